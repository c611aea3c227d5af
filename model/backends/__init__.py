"""Kernel backends: the catalog (catalog.py: what each backend serves and its traits, no tinygrad), the registry of
their implementations (registry.py, each loaded on first use), and the implementations: tensor, fp16_cache, dsl (UOp
custom kernels, every device) and native (CUDA C from cuda_src.py, CUDA only)."""
