r"""
Manual recorder
^^^^^^^^^^^^^^^

For attention modules that no adapter knows: the module hands its queries and keys over itself with
:func:`record`, which costs nothing unless a capture is recording.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .base import _RECORDING, SUPPORTED_LAYERS, AttentionCapture


def record(
    layer: str | nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool | None = None,
    key_padding_mask: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
) -> None:
    """Hand the queries and keys of one attention call to the captures that are recording.

    Call it from a custom attention module's ``forward``; outside a recording block it does nothing.

    Args:
        layer: the module itself (its path in the captured model becomes the layer name, and only the
            captures of models that contain it receive the call), or a name of your choosing.
        q: queries ``[B, H, N_q, D]``, exactly as they enter the softmax (after RoPE, before any scaling).
        k: keys ``[B, H_k, N_k, D]``, before GQA repetition (``H`` divisible by ``H_k``).
        scale: the score scale; ``None`` means ``1 / sqrt(D)``.
        causal: whether the layer masks future keys; ``None`` leaves it to the distillation config.
        key_padding_mask: ``[B, N_k]`` bool, True for real keys; ``None`` uses the batch's padding mask.
        v: values ``[B, H_k, N_k, D_v]`` (before GQA repetition), for MiniLM-v2's value relation (``"vv"``); kept
            by captures made with ``capture_values=True`` (the engine's, when a pair compares ``"vv"``).
        window: ``(left, right)`` sliding window (flash-attn convention, −1 unbounded), if the layer has one.
        softcap: the layer's logit soft-cap, if any.
        sinks: ``[H]`` sink logits, if the layer has attention sinks.
        attn_mask: ``[B|1, H|1, N_q, N_k]`` bool (True = allowed), any other mask the layer applies.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from lightning_streamkl.capture import RecorderCapture, record
        >>> class Attn(nn.Module):
        ...     def forward(self, x):                      # x: [B, N, 8], one head
        ...         q = k = x.unsqueeze(1)
        ...         record(self, q, k, causal=True)
        ...         return (torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, -1) @ q).squeeze(1)
        >>> model = nn.Sequential(Attn(), Attn())
        >>> capture = RecorderCapture(model)
        >>> with capture.recording():
        ...     _ = model(torch.randn(2, 5, 8))
        >>> sorted(capture.records), tuple(capture.records["1"].q.shape)
        (['0', '1'], (2, 1, 5, 8))
    """
    if not _RECORDING:
        return
    for capture in tuple(_RECORDING):
        if isinstance(layer, nn.Module):
            name = capture.module_path(layer)
            if name is None:
                continue
        else:
            name = str(layer)
        capture.record(name, q, k, scale=scale, causal=causal, key_padding_mask=key_padding_mask, v=v, window=window,
                       softcap=softcap, sinks=sinks, attn_mask=attn_mask)


class RecorderCapture(AttentionCapture):
    """A capture fed only by :func:`record` calls placed in the model's own attention code.

    Args:
        model: the module whose layers call :func:`record`.
        names: the layer names the model records, in order, when you want to address layers by index or
            have unknown names rejected before the first step. Default: every module path of ``model``
            (which is what ``record(self, ...)`` produces) and any other name is accepted until the first
            step shows it was never recorded.
        exclude: submodules to ignore (see :class:`AttentionCapture`).
        capture_values: keep the values handed to :func:`record`.

    Example:
        >>> capture = RecorderCapture(nn.Identity(), names=["a", "b"])
        >>> capture.resolve(-1), capture.kind
        ('b', 'recorder')
    """

    kind = "recorder"

    def __init__(self, model: nn.Module, names: Iterable[str] | None = None, *, exclude: Iterable[nn.Module] = (),
                 capture_values: bool = False):
        super().__init__(model, exclude=exclude, capture_values=capture_values)
        self._names = None if names is None else [str(n) for n in names]

    def find_layers(self) -> list[str]:
        """The declared ``names``, else every module path of the model except the root."""
        if self._names is not None:
            return list(self._names)
        return [name for name, _ in self.named_modules() if name]

    def resolve(self, layer: str | int, *, role: str = "layer") -> str:
        """Like :meth:`AttentionCapture.resolve`; without declared names any string is accepted."""
        if self._names is None and isinstance(layer, str):
            return layer
        if self._names is None:
            raise ValueError(
                f"The {role} {layer} is an index, but no attention layers were found in {type(self.model).__name__}; "
                f"supported: {SUPPORTED_LAYERS}, or declared ones: RecorderCapture(model, names=[...])."
            )
        return super().resolve(layer, role=role)
