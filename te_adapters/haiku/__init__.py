"""Haiku adapter of te_adapters."""

__all__: list[str] = []
