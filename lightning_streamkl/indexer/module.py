r"""
The lightning indexer
^^^^^^^^^^^^^^^^^^^^^

:class:`LightningIndexer`, DeepSeek-V3.2's lightning indexer as a module: ``H_I`` small heads that score every
(query, key) token pair from the hidden states the attention layer reads,

.. math::

    I_{ts} = \sum_{j} w_{tj}\, \mathrm{ReLU}\!\left(q^{I}_{j,t} \cdot k^{I}_{s}\right),

with a query per head, one key per token (layer-normalised, shared by the heads), RoPE on the first dimensions of
both when the attention layer passes its rotary embedding, and a weight per head. Its forward records its inputs
with :func:`~lightning_streamkl.indexer.record_indexer`, and by default it reads *detached* hidden states: in
DeepSeek's recipe the indexer learns from the indexer loss alone, and that loss never reaches the main model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .capture import indexer_recording, record_indexer
from .selection import indexer_logits

__all__ = ["LightningIndexer"]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of ``x`` (``[B, N, ..., D]``; ``cos``, ``sin``: ``[B|1, N, R]``,
    Hugging Face's rotate-half convention) and keep the rest.

    Example:
        >>> x = torch.ones(1, 2, 4)
        >>> cos, sin = torch.ones(1, 2, 2), torch.zeros(1, 2, 2)         # angle 0: unchanged
        >>> torch.equal(apply_rope(x, cos, sin), x)
        True
    """
    r = cos.shape[-1]
    if r > x.shape[-1]:
        raise ValueError(f"Expected the rotary embedding's dims ({r}) to be at most the indexer head dim "
                         f"({x.shape[-1]}); give LightningIndexer a head_dim >= {r}.")
    while cos.dim() < x.dim():  # [B, N, R] -> [B, N, 1, R] for per-head tensors
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rot, rest = x[..., :r], x[..., r:]
    rot = rot * cos.to(x.dtype) + _rotate_half(rot) * sin.to(x.dtype)
    return torch.cat((rot, rest), dim=-1) if rest.shape[-1] else rot


class LightningIndexer(nn.Module):
    r"""DeepSeek-V3.2's lightning indexer for one attention layer.

    ``forward(hidden_states, position_embeddings=None)`` returns ``(q_idx [B, N, H_I, D_I], k_idx [B, N, D_I],
    w_idx [B, N, H_I])`` and records them (layout ``"bnhd"``) for
    :class:`~lightning_streamkl.IndexerDistillation`. ``w_idx`` has the scale folded in
    (:math:`H_I^{-1/2} D_I^{-1/2}`, as DeepSeek's ``weights_proj(x) · n_heads^{-1/2} · softmax_scale``), so the
    logits are exactly :math:`\sum_j w_{tj} \mathrm{ReLU}(q_{j,t} \cdot k_s)`.

    Args:
        hidden_size: the width of the hidden states the attention layer reads.
        heads: ``H_I``, the indexer heads. Default: ``4``.
        head_dim: ``D_I``; at least the rotary embedding's dims when one is passed. Default: ``32``.
        detach_input: read ``hidden_states.detach()``, so the indexer's loss never reaches the main model.
            Default: ``True``.

    Example:
        >>> indexer = LightningIndexer(hidden_size=16, heads=2, head_dim=8)
        >>> q_idx, k_idx, w_idx = indexer(torch.randn(3, 10, 16))
        >>> tuple(q_idx.shape), tuple(k_idx.shape), tuple(w_idx.shape)
        ((3, 10, 2, 8), (3, 10, 8), (3, 10, 2))
        >>> tuple(indexer.topk(q_idx, k_idx, w_idx, 4).shape)             # the keys a sparse attention keeps
        (3, 10, 4)
    """

    def __init__(self, hidden_size: int, heads: int = 4, head_dim: int = 32, *, detach_input: bool = True) -> None:
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("heads", heads), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Expected argument `{name}` to be an int >= 1, but got {value!r}.")
        if not isinstance(detach_input, bool):
            raise TypeError(f"Expected argument `detach_input` to be a bool, but got {type(detach_input).__name__}.")
        self.heads, self.head_dim, self.detach_input = heads, head_dim, detach_input
        self.wq = nn.Linear(hidden_size, heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim)
        self.weights_proj = nn.Linear(hidden_size, heads, bias=False)
        self.scale = heads ** -0.5 * head_dim ** -0.5

    def forward(self, hidden_states: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q_idx, k_idx, w_idx)`` of ``hidden_states`` ``[B, N, hidden_size]``; ``position_embeddings`` is the
        ``(cos, sin)`` pair a Hugging Face attention layer receives (RoPE on the first dims), or ``None``."""
        x = hidden_states.detach() if self.detach_input else hidden_states
        b, n, _ = x.shape
        q = self.wq(x).view(b, n, self.heads, self.head_dim)
        k = self.k_norm(self.wk(x))
        if position_embeddings is not None:
            cos, sin = position_embeddings
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        w = self.weights_proj(x) * self.scale
        record_indexer(self, q, k, w, layout="bnhd")
        return q, k, w

    @staticmethod
    def topk(q_idx: torch.Tensor, k_idx: torch.Tensor, w_idx: torch.Tensor, topk: int, *, causal: bool = True,
             key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The keys a sparse attention would keep: each query's ``topk`` allowed keys by indexer logit,
        ``[B, N, min(topk, N)]``, ``-1`` for empty slots (:func:`~lightning_streamkl.indexer.indexer_topk` on
        this module's outputs)."""
        from .selection import indexer_topk

        return indexer_topk(q_idx, k_idx, w_idx, topk, causal=causal, key_padding_mask=key_padding_mask,
                            layout="bnhd")

    @staticmethod
    def logits(q_idx: torch.Tensor, k_idx: torch.Tensor, w_idx: torch.Tensor) -> torch.Tensor:
        """The unmasked indexer logits ``[B, N_q, N_k]`` of this module's outputs (materialised: short sequences)."""
        return indexer_logits(q_idx, k_idx, w_idx, layout="bnhd")

    def attach(self, attention: nn.Module, name: str = "indexer") -> RemovableHandle:
        """Make this indexer a submodule of ``attention`` (``attention.<name>``, so its parameters are the model's)
        and run it on the attention's input at every call: a forward pre-hook reads ``hidden_states`` (the first
        positional argument or the keyword) and ``position_embeddings`` (keyword), as Hugging Face attention
        layers (Llama, Mistral, Qwen, ...) are called. The hook runs the indexer only while an indexer capture is
        recording (its outputs serve the loss alone), so it costs nothing elsewhere. Returns the hook's handle.

        Example:
            >>> attention = nn.MultiheadAttention(16, 2, batch_first=True)
            >>> indexer = LightningIndexer(16, heads=2, head_dim=8)
            >>> _ = indexer.attach(attention)
            >>> from lightning_streamkl.indexer import IndexerCapture
            >>> capture = IndexerCapture(attention)
            >>> with capture.recording():
            ...     x = torch.randn(2, 5, 16)
            ...     _ = attention(x, x, x)
            >>> list(capture.records), attention.indexer is indexer
            (['indexer'], True)
        """
        if not isinstance(attention, nn.Module):
            raise TypeError(f"Expected argument `attention` to be a torch.nn.Module, but got "
                            f"{type(attention).__name__}.")
        attention.add_module(name, self)

        def run(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not indexer_recording():
                return
            hidden = args[0] if args else kwargs.get("hidden_states")
            if not isinstance(hidden, torch.Tensor):
                raise TypeError(f"LightningIndexer.attach: expected {type(module).__name__} to be called with the "
                                "hidden states first or as `hidden_states=`, but found none.")
            self(hidden, kwargs.get("position_embeddings"))

        return attention.register_forward_pre_hook(run, with_kwargs=True)
