"""The machinery shared by the callback and the mixin: teacher handling, captures, masks, loss, metrics."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from .capture import AttentionCapture, build_capture
from .config import StreamKLConfig
from .loss import AttentionDistillationLoss, LossOutput
from .metrics import AttentionKLDivergence

TeacherForward = Callable[[nn.Module, Any], Any]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def default_teacher_forward(teacher: nn.Module, batch: Any) -> Any:
    """Run ``teacher`` on a batch the way most training steps run their model.

    - a mapping (Hugging Face style): the keys that ``teacher.forward`` names as parameters, except ``labels``
      (``use_cache=False`` is added when the forward takes it); when it names none of them, ``teacher(batch)``;
    - a tuple or list: ``teacher(batch[0])`` (the ``(inputs, targets)`` convention);
    - anything else: ``teacher(batch)``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> out = default_teacher_forward(nn.Linear(3, 2), (torch.randn(4, 3), torch.zeros(4)))
        >>> tuple(out.shape)
        (4, 2)
    """
    if isinstance(batch, Mapping):
        params = inspect.signature(teacher.forward).parameters
        named = {k for k, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        kwargs = {k: v for k, v in batch.items() if k in named and k != "labels"}
        if not kwargs:
            return teacher(batch)
        if "use_cache" in named and "use_cache" not in kwargs:
            kwargs["use_cache"] = False
        return teacher(**kwargs)
    if isinstance(batch, (tuple, list)):
        return teacher(batch[0])
    return teacher(batch)


def padding_mask_from_batch(batch: Any, key: str | None) -> torch.Tensor | None:
    """``batch[key]`` as a bool ``[B, N]`` mask (True = real token) for mapping batches, else ``None``."""
    if key is None or not isinstance(batch, Mapping) or batch.get(key) is None:
        return None
    mask = batch[key]
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise ValueError(
            f"Expected the batch's `{key}` to be a [B, N] padding mask tensor (1/True = real token), but got "
            f"{type(mask).__name__}{tuple(mask.shape) if isinstance(mask, torch.Tensor) else ''}; set `mask_key` to "
            "the right key or None."
        )
    return mask.bool() if mask.dtype != torch.bool else mask


def load_teacher(teacher: nn.Module | str) -> nn.Module:
    """A module as is; a string is a Hugging Face model name or local path loaded with ``AutoModel``."""
    if isinstance(teacher, nn.Module):
        return teacher
    if isinstance(teacher, str):
        try:
            from transformers import AutoModel
        except ImportError as err:  # pragma: no cover
            raise ImportError(f"A teacher given by name ({teacher!r}) needs transformers; install it.") from err
        return AutoModel.from_pretrained(teacher, attn_implementation="sdpa")
    raise TypeError(
        f"Expected `teacher` to be a torch.nn.Module or the name/path of a Hugging Face model, but got "
        f"{type(teacher).__name__}."
    )


class Distiller:
    """Teacher, captures and loss for one distillation setup; owned by a callback or a mixin."""

    def __init__(self, teacher: nn.Module | str, config: StreamKLConfig,
                 teacher_forward: TeacherForward | None = None,
                 padding_mask: Callable[[Any], torch.Tensor | None] | None = None) -> None:
        if not isinstance(teacher, (nn.Module, str)):
            load_teacher(teacher)  # raises the TypeError
        if teacher_forward is not None and not callable(teacher_forward):
            raise TypeError(f"Expected `teacher_forward` to be callable, but got {type(teacher_forward).__name__}.")
        self.teacher_ref = teacher
        self.config = config
        self.teacher_forward = teacher_forward or default_teacher_forward
        self.padding_mask = padding_mask or functools.partial(padding_mask_from_batch, key=config.mask_key)
        self.loss = AttentionDistillationLoss(config)
        self.teacher: nn.Module | None = None
        self.teacher_capture: AttentionCapture | None = None
        self.student_capture: AttentionCapture | None = None
        self.resolved: list[tuple[str, str]] = []

    def make_metric(self) -> AttentionKLDivergence:
        return AttentionKLDivergence(self.loss.pair_names, weights=self.loss.weights, prefix=f"{self.config.name}/")

    # ------------------------------------------------------------------------------------------ setup
    def setup(self, student: nn.Module) -> None:
        """Load and freeze the teacher, build both captures and resolve the layer pairs (idempotent)."""
        if self.student_capture is not None and self.student_capture.model is student:
            return
        teacher = self.teacher if self.teacher is not None else load_teacher(self.teacher_ref)
        if teacher is student:
            raise ValueError("The teacher is the student module itself; pass a separate (e.g. copied) teacher.")
        on_meta = [name for name, t in (*teacher.named_parameters(), *teacher.named_buffers()) if t.is_meta]
        if on_meta:
            raise ValueError(
                f"The teacher has {len(on_meta)} parameters/buffers on the meta device (no data), e.g. {on_meta[0]!r}; "
                "load or materialise its weights (e.g. `to_empty()` then `load_state_dict()`) before training."
            )
        teacher.eval()
        teacher.requires_grad_(False)
        self.teacher = teacher
        self.teacher_capture = build_capture(teacher, self.config.teacher_capture)
        self.student_capture = build_capture(student, self.config.student_capture, exclude=[teacher])
        self.resolved = self.loss.resolve(self.teacher_capture, self.student_capture)

    def place_teacher(self, device: torch.device, student: nn.Module) -> None:
        """Move the teacher to ``device`` and the configured dtype (cheap when already there)."""
        assert self.teacher is not None
        dtype = self._teacher_dtype(student)
        # every tensor is checked, not only the first: a teacher partly on another device or partly cast is moved whole
        misplaced = any(t.device != device for t in (*self.teacher.parameters(), *self.teacher.buffers()))
        if misplaced or (dtype is not None and any(p.is_floating_point() and p.dtype != dtype
                                                   for p in self.teacher.parameters())):
            self.teacher.to(device=device, dtype=dtype)
        if self.teacher.training:
            self.teacher.eval()

    def _teacher_dtype(self, student: nn.Module) -> torch.dtype | None:
        choice = self.config.teacher_dtype
        if choice is None:
            return None
        if choice != "auto":
            return _DTYPES[choice]
        for p in student.parameters():
            if p.is_floating_point():
                return p.dtype
        return None

    # ------------------------------------------------------------------------------------------ per step
    def run_teacher(self, batch: Any) -> None:
        """Teacher forward on ``batch`` under ``no_grad`` with the teacher capture recording."""
        assert self.teacher is not None and self.teacher_capture is not None
        pause = self.student_capture.paused() if self.student_capture is not None else nullcontext()
        with pause, torch.no_grad(), self.teacher_capture.recording():
            self.teacher_forward(self.teacher, batch)

    @contextmanager
    def student_recording(self) -> Iterator[None]:
        assert self.student_capture is not None
        with self.student_capture.recording():
            yield

    def compute(self, batch: Any) -> LossOutput:
        """The loss terms from the records of this step, then release the records."""
        assert self.teacher_capture is not None and self.student_capture is not None
        try:
            mask = self.padding_mask(batch)
            return self.loss(
                self.teacher_capture.pop(), self.student_capture.pop(),
                key_padding_mask=mask, query_mask=mask if self.config.mask_queries else None,
            )
        finally:
            self.clear()

    def clear(self) -> None:
        for capture in (self.teacher_capture, self.student_capture):
            if capture is not None:
                capture.clear()

    def weight_at(self, step: int) -> float:
        """The global weight at optimizer step ``step`` (linear warm-up from 0 over ``warmup_steps``)."""
        cfg = self.config
        if cfg.warmup_steps <= 0:
            return cfg.weight
        return cfg.weight * min(1.0, step / cfg.warmup_steps)
