"""Measurements of te_adapters against bf16 and its peers; part of the source tree, not the package.

``python -m bench`` (run from the repository root) times seed 000's Dense, the seed's transformer
layer and a GEMM size sweep (``bench/speed.py``); the other files here are scripts of their own.
"""
