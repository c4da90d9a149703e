"""Triton kernels for the GPU path, one module per kernel.

Each module holds the `@triton.jit` kernel, its Python launcher and a PyTorch reference the
tests compare against. On CPU the kernels run under `TRITON_INTERPRET=1`, which must be set
before these modules are imported (Triton reads it when `@triton.jit` decorates a function).
"""
