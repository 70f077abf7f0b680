"""StreamKL: the KL divergence between two attention distributions as one fused, O(N)-memory op.

``attention_kl`` is the functional op, ``AttentionKLLoss`` its module form, ``AttentionKLOptions`` its options
(defined once, :mod:`streamkl.options`), ``naive_attention_kl`` the materialising oracle and ``chunked_attention_kl``
the exact chunked PyTorch backend; :mod:`streamkl.dispatch` decides which kernel computes a call. ``indexer_kl`` is the
sparse-attention (DeepSeek-V3.2 lightning) indexer loss, ``naive_indexer_kl`` its materialising oracle. This package
depends on torch (and triton for CUDA tensors) only; it never imports lightning.
"""

from .api import attention_kl, chunked_attention_kl
from .indexer import indexer_kl
from .indexer_naive import naive_indexer_kl
from .naive import naive_attention_kl
from .nn import AttentionKLLoss
from .options import AttentionKLOptions, KLWithCount

__all__ = [
    "AttentionKLLoss",
    "AttentionKLOptions",
    "KLWithCount",
    "attention_kl",
    "chunked_attention_kl",
    "indexer_kl",
    "naive_attention_kl",
    "naive_indexer_kl",
]
__version__ = "0.1.0"
