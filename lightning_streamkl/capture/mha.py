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
from .masks import MASKED_BELOW, KeyRows, Masking, allowed_map, describe_allowed

_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)


class MultiheadAttentionCapture(AttentionCapture):
    """Capture ``(q, k)`` of every ``torch.nn.MultiheadAttention`` in a model.

    The record holds ``q [B, H, N_q, D]`` and ``k [B, H, N_k, D]`` (``D = embed_dim // num_heads``, scale
    ``1/sqrt(D)``; with ``capture_values``, ``v`` too) and the call's complete mask: its ``key_padding_mask``
    (True = real key; an additive one may hold only 0 and masking values), ``causal`` from ``is_causal=True``, and any
    ``attn_mask`` (bool, True = masked, or additive; ``[N_q, N_k]`` or ``[B·H, N_q, N_k]``) mapped to causal / window
    / packed documents when it equals them, else kept as a general mask. For self-attention (the same tensor as
    query and key) the padded positions' rows are not counted. Layers with ``add_bias_kv`` or ``add_zero_attn`` are
    rejected.

    Args:
        model: the model whose ``nn.MultiheadAttention`` layers are captured.
        exclude: submodules to ignore.
        capture_values: also record the values ``v [B, H, N_k, D]`` (a third ``linear``), which MiniLM-v2's value
            relation (``"vv"``) needs. Default: ``False``.

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
        super().__init__(model, exclude=exclude, capture_values=capture_values)
        self._handles: list[Any] = []

    def find_layers(self) -> list[str]:
        """Module paths of the ``nn.MultiheadAttention`` modules."""
        return [name for name, m in self.named_modules() if isinstance(m, nn.MultiheadAttention)]

    def _attach(self) -> None:
        wanted = [n for n in self.layer_names() if self.selected is None or n in self.selected]
        for name, m in zip(wanted, self.modules_at(wanted)):
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
        self_attention = query is key
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
        v = None
        if self.capture_values:
            v = F.linear(value, w_v, b_v).view(n_k, batch, heads, -1).permute(1, 2, 0, 3)
        masking = self._masking(name, call, unbatched, batch, heads, n_q, n_k, self_attention)
        self.record(name, q, k, scale=None, causal=masking.causal, key_padding_mask=masking.key_padding_mask, v=v,
                    window=masking.window, attn_mask=masking.attn_mask, query_mask=masking.query_mask,
                    packed=masking.packed, key_rows=masking.key_rows, masks_from_call=True)

    @staticmethod
    def _masking(name: str, call: dict[str, Any], unbatched: bool, batch: int, heads: int, n_q: int, n_k: int,
                 self_attention: bool) -> Masking:
        kpm, rows = call.get("key_padding_mask"), None
        if kpm is not None:
            if unbatched:
                kpm = kpm.unsqueeze(0)
            if kpm.dtype != torch.bool and bool((~(kpm == 0) & ~(kpm <= MASKED_BELOW)).any()):
                raise ValueError(
                    f"StreamKL cannot distil nn.MultiheadAttention {name!r}: its float key_padding_mask holds values "
                    "other than 0 and a masking value (a score bias, which attention_kl cannot express)."
                )
            kpm = ~kpm if kpm.dtype == torch.bool else kpm == 0
            rows = KeyRows.read(kpm)
            kpm, rows = (None, None) if rows.keeps_all else (kpm, rows)
        attn_mask = call.get("attn_mask")
        causal = bool(call.get("is_causal", False))
        if attn_mask is None or causal:
            return Masking(causal, None, kpm, kpm if self_attention and n_q == n_k else None, key_rows=rows)
        mask = attn_mask.view(batch, heads, n_q, n_k) if attn_mask.dim() == 3 else attn_mask
        try:
            allowed = allowed_map(mask, n_q, n_k, blocked=True)
        except ValueError as err:
            raise ValueError(f"StreamKL cannot distil nn.MultiheadAttention {name!r}: {err}") from err
        if kpm is not None:
            allowed = allowed & kpm[:, None, None, :]
        return describe_allowed(allowed, batch, self_attention=self_attention)
