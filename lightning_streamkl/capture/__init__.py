"""Getting ``(q, k)`` out of models: Hugging Face transformers, ``nn.MultiheadAttention``, manual recording.

Only queries and keys (and, when asked, values) are held (``O(N·D)`` per layer), with the call's mask, never
attention maps, and only between a forward pass and the loss that consumes them.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from .base import AttentionCapture, CapturedAttention, closest, is_recording
from .hf import HFAttentionCapture, is_hf_model
from .masks import Masking, PackedSequences
from .mha import MultiheadAttentionCapture
from .recorder import RecorderCapture, record

#: The values of the ``teacher_capture`` / ``student_capture`` options.
CAPTURE_KINDS = ("auto", "hf", "mha", "recorder")

__all__ = [
    "CAPTURE_KINDS",
    "AttentionCapture",
    "CapturedAttention",
    "HFAttentionCapture",
    "Masking",
    "MultiheadAttentionCapture",
    "PackedSequences",
    "RecorderCapture",
    "build_capture",
    "closest",
    "is_recording",
    "record",
]


def build_capture(model: nn.Module, kind: str = "auto", *, exclude: Iterable[nn.Module] = (),
                  capture_values: bool = False) -> AttentionCapture:
    """Make the capture adapter for ``model``.

    Args:
        model: the model (or LightningModule) to capture.
        kind: ``"hf"``, ``"mha"``, ``"recorder"``, or ``"auto"``: ``"hf"`` when the model contains a transformers
            ``PreTrainedModel`` with attention-interface layers, else ``"mha"`` when it contains an
            ``nn.MultiheadAttention``, else ``"recorder"``. Every adapter also accepts :func:`record` calls.
        exclude: submodules to ignore.
        capture_values: also record the value tensors (``CapturedAttention.v``), e.g. for MiniLM-v2's ``"vv"``
            relation (the engine asks for them when a pair compares it); off by default.

    Example:
        >>> from torch import nn
        >>> build_capture(nn.MultiheadAttention(8, 2))
        MultiheadAttentionCapture(model=MultiheadAttention, layers=1)
        >>> build_capture(nn.Linear(2, 2)).kind
        'recorder'
    """
    if kind not in CAPTURE_KINDS:
        raise ValueError(f"Expected `kind` to be one of {CAPTURE_KINDS}, but got {kind!r}.")
    exclude = tuple(exclude)
    if kind == "hf" or (kind == "auto" and is_hf_model(model)):
        capture: AttentionCapture = HFAttentionCapture(model, exclude=exclude, capture_values=capture_values)
        if kind == "hf" or capture.layer_names():
            return capture
    if kind == "mha" or (kind == "auto" and any(isinstance(m, nn.MultiheadAttention) for m in model.modules())):
        return MultiheadAttentionCapture(model, exclude=exclude, capture_values=capture_values)
    return RecorderCapture(model, exclude=exclude, capture_values=capture_values)
