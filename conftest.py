"""Root pytest configuration (collected before any module of the project is imported).

Without a CUDA device the Triton kernels are exercised through Triton's CPU interpreter, which must be
switched on before triton is first imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
