r"""
``torch.nn.MultiheadAttention`` capture
^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^

A forward pre-hook on each selected ``nn.MultiheadAttention`` recomputes the layer's query and key projections
from the call's inputs with the layer's own weights (two extra ``linear`` calls, differentiable), because the
fused implementation never exposes them.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .base import AttentionCapture

_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)


def _is_causal_pattern(mask: torch.Tensor, n_q: int, n_k: int) -> bool:
    """True when ``mask`` ([N_q, N_k], bool True = masked, or additive float) is the causal mask."""
    if mask.dim() != 2 or tuple(mask.shape) != (n_q, n_k):
        return False
    future = torch.ones(n_q, n_k, dtype=torch.bool, device=mask.device).triu(1 + n_k - n_q)
    blocked = mask if mask.dtype == torch.bool else torch.isneginf(mask)
    if mask.dtype != torch.bool and bool((mask[~blocked] != 0).any()):
        return False
    return bool(torch.equal(blocked, future))


class MultiheadAttentionCapture(AttentionCapture):
    """Capture ``(q, k)`` of every ``torch.nn.MultiheadAttention`` in a model.

    The record holds ``q [B, H, N_q, D]`` and ``k [B, H, N_k, D]`` (``D = embed_dim // num_heads``, scale
    ``1/sqrt(D)``), the call's ``key_padding_mask`` converted to True = real key, and ``causal`` from
    ``is_causal=True`` or an ``attn_mask`` equal to the causal mask. Any other ``attn_mask`` is recorded as
    inexact (it is not applied by ``attention_kl``). Layers with ``add_bias_kv`` or ``add_zero_attn`` are
    rejected. With ``capture_values=True`` the record also holds the values ``v [B, H, N_k, D]`` (a third
    ``linear``), which MiniLM-v2's value relation (``"vv"``) needs.

    Args:
        model: the model whose ``nn.MultiheadAttention`` layers are captured.
        exclude: submodules to ignore.
        capture_values: also record the value projections. Default: ``False``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), 2,
        ...                               enable_nested_tensor=False)
        >>> capture = MultiheadAttentionCapture(model)
        >>> capture.layer_names()
        ['layers.0.self_attn', 'layers.1.self_attn']
        >>> with capture.recording():
        ...     _ = model(torch.randn(3, 7, 16), is_causal=True, mask=nn.Transformer.generate_square_subsequent_mask(7))
        >>> r = capture.records["layers.0.self_attn"]
        >>> tuple(r.q.shape), r.causal
        ((3, 4, 7, 4), True)
    """

    kind = "mha"

    def __init__(self, model: nn.Module, *, exclude: Iterable[nn.Module] = (), capture_values: bool = False) -> None:
        super().__init__(model, exclude=exclude)
        self._handles: list[Any] = []
        self.capture_values = bool(capture_values)

    def find_layers(self) -> list[str]:
        """Module paths of the ``nn.MultiheadAttention`` modules."""
        return [name for name, m in self.named_modules() if isinstance(m, nn.MultiheadAttention)]

    def _attach(self) -> None:
        modules = dict(self.named_modules())
        for name in self.layer_names():
            if self.selected is not None and name not in self.selected:
                continue
            m = modules[name]
            if m.bias_k is not None or m.add_zero_attn:
                raise ValueError(
                    f"nn.MultiheadAttention {name!r} uses add_bias_kv/add_zero_attn, which attention_kl cannot "
                    "express; record its queries and keys yourself with lightning_streamkl.capture.record()."
                )
            self._handles.append(m.register_forward_pre_hook(self._make_hook(name), with_kwargs=True))

    def _detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _make_hook(self, name: str):
        def hook(module: nn.MultiheadAttention, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self.is_recording:
                self._record_call(name, module, _SIGNATURE.bind(module, *args, **kwargs).arguments)

        return hook

    def _record_call(self, name: str, m: nn.MultiheadAttention, call: dict[str, Any]) -> None:
        query, key, value = call["query"], call["key"], call["value"]
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)  # (N, E) -> (N, 1, E)
        elif m.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)  # -> (N, B, E)
        if m._qkv_same_embed_dim:
            w_q, w_k, w_v = m.in_proj_weight.chunk(3)
        else:
            w_q, w_k, w_v = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
        b_q = b_k = b_v = None
        if m.in_proj_bias is not None:
            b_q, b_k, b_v = m.in_proj_bias.chunk(3)
        n_q, batch, n_k, heads = query.shape[0], query.shape[1], key.shape[0], m.num_heads
        q = F.linear(query, w_q, b_q).view(n_q, batch, heads, m.head_dim).permute(1, 2, 0, 3)
        k = F.linear(key, w_k, b_k).view(n_k, batch, heads, m.head_dim).permute(1, 2, 0, 3)
        v = F.linear(value, w_v, b_v).view(n_k, batch, heads, m.head_dim).permute(1, 2, 0, 3) \
            if self.capture_values else None

        notes = []
        kpm = call.get("key_padding_mask")
        if kpm is not None:
            if unbatched:
                kpm = kpm.unsqueeze(0)
            if kpm.dtype == torch.bool:
                kpm = ~kpm
            else:
                if bool((~torch.isneginf(kpm) & (kpm != 0)).any()):
                    notes.append("a float key_padding_mask with values other than 0/-inf")
                kpm = kpm == 0
        causal = bool(call.get("is_causal", False))
        attn_mask = call.get("attn_mask")
        if attn_mask is not None and not causal:
            causal = _is_causal_pattern(attn_mask, n_q, n_k)
            if not causal:
                notes.append("an attn_mask that is not the causal mask")
        self.record(name, q, k, scale=None, causal=causal, key_padding_mask=kpm, exact=not notes,
                    note=f"nn.MultiheadAttention call with {' and '.join(notes)}" if notes else None, v=v)
