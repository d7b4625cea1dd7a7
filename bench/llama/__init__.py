"""A Llama-style decoder trained end to end in bf16 and through te_adapters' FP8 conversions.

``model``: the configurations and the model, written in plain Flax NNX, Flax Linen and Haiku
(and once with the library's fused ``LayerNormDenseGeneral`` / ``LayerNormMLP`` modules);
``data``: a 32k BPE vocabulary trained on the Python standard library's source, and the token
files the benchmark reads; ``train``: the training step of each variant, its tokens/s and MFU,
its FP8 GEMM count and a coarse profile; ``converge``: convergence runs (held-out loss of bf16
against the FP8 recipes over seeds, checkpointed and resumed across commands) at the 377.5M
configuration. See ``python -m bench.llama.train --help``, ``python -m bench.llama.converge
--help``.
"""
