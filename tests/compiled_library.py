"""A library module that compiles a helper as it is imported, as flash-linear-attention's
activations do (``@torch.compile`` at module level), for ``tests/first_compile_job.py``."""

import torch


@torch.compile
def fast_gelu(x):
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))
