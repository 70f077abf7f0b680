r"""
Distillation engine
^^^^^^^^^^^^^^^^^^^

The Lightning-free core the three front doors (:class:`~lightning_streamkl.StreamKLDistillation`,
:class:`~lightning_streamkl.AttentionDistillationMixin`, :class:`~lightning_streamkl.ContinualAttentionRegularizer`)
are thin adapters over, and what a plain PyTorch, Fabric or Hugging Face ``Trainer`` loop uses directly:
:class:`AttentionDistiller` runs the frozen teacher (under ``no_grad``, stopping after the deepest paired layer),
captures both models at the paired layers, and turns the records into the loss terms;
:class:`DistillationMetrics` holds the per-stage metric state and the values a step or an epoch reports.
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .capture import AttentionCapture, build_capture, closest
from .config import LayerPair, StreamKLConfig, validate_config
from .loss import AttentionDistillationLoss, LossOutput, LossStream
from .metrics import AttentionKLDivergence
from .teacher import (
    AdaptersOff,
    FrozenTeacher,
    InputRecorder,
    SelfTeacher,
    find_copy,
    is_compiled,
    stop_after,
    teacher_failed,
    to_device,
)

log = logging.getLogger(__name__)

__all__ = ["AttentionDistiller", "DistillationMetrics", "DistillationStep", "default_student_forward",
           "default_teacher_forward", "padding_mask_from_batch"]

TeacherForward = Callable[[nn.Module, Any], Any]

#: Keys of padding-free batches (transformers' ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``) that
#: the attention layers read through ``**kwargs``: the teacher gets them too.
PACKED_SEQUENCE_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def default_teacher_forward(teacher: nn.Module, batch: Any) -> Any:
    """Run ``teacher`` on a batch the way most training steps run their model.

    - a mapping (Hugging Face style): the keys that ``teacher.forward`` names as parameters, except ``labels``, and,
      when it takes ``**kwargs``, the packed-sequence keys of padding-free batches (:data:`PACKED_SEQUENCE_KEYS`:
      ``cu_seq_lens_q``, ...) so that the teacher attends over the same documents (``use_cache=False`` is added when
      the forward takes it); when it names none of them, every key but ``labels`` if it takes ``**kwargs`` (a
      wrapper such as PEFT's ``PeftModel``), else ``teacher(batch)``;
    - a tuple or list: ``teacher(batch[0])`` (the ``(inputs, targets)`` convention);
    - anything else: ``teacher(batch)``.

    Example:
        >>> out = default_teacher_forward(nn.Linear(3, 2), (torch.randn(4, 3), torch.zeros(4)))
        >>> tuple(out.shape)
        (4, 2)
    """
    return _forward(teacher, batch, labels=False)


def default_student_forward(student: nn.Module, batch: Any) -> Any:
    """Run the student on a batch for ``distiller(batch)``: as :func:`default_teacher_forward`, except that a
    mapping's ``labels`` are passed too (a Hugging Face model then returns its loss). Like the teacher's,
    ``use_cache=False`` is added when the forward takes it and the batch does not set it: a training pass needs no KV
    cache, and with one transformers does not read packed documents from restarting ``position_ids``.

    Example:
        >>> class LM(nn.Module):
        ...     def forward(self, input_ids, labels=None):
        ...         return {"loss": None if labels is None else (input_ids - labels).abs().sum()}
        >>> default_student_forward(LM(), {"input_ids": torch.ones(2), "labels": torch.zeros(2), "other": 1})
        {'loss': tensor(2.)}
    """
    return _forward(student, batch, labels=True)


def _forward_parameters(forward: Callable[..., Any]) -> Mapping[str, inspect.Parameter]:
    """The parameters of a model's ``forward``, read once per function: ``inspect.signature`` costs a hundred
    microseconds or more of host time, on every pass of both models."""
    function = getattr(forward, "__func__", None)
    if function is None:  # not a bound method (an instance attribute, a partial): read it every time
        return inspect.signature(forward).parameters
    params = _FORWARD_PARAMETERS.get(function)
    if params is None:
        params = _FORWARD_PARAMETERS[function] = inspect.signature(forward).parameters
    return params


_FORWARD_PARAMETERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _forward(model: nn.Module, batch: Any, *, labels: bool) -> Any:
    if isinstance(batch, Mapping):
        params = _forward_parameters(model.forward)
        named = {k for k, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        kwargs = {k: v for k, v in batch.items() if k in named and (labels or k != "labels")}
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            # forward(*args, **kwargs) naming none of the keys is a wrapper: it gets every key; a model that takes
            # **kwargs gets the packed-sequence keys its attention layers read
            wrapper = not kwargs
            kwargs.update({k: v for k, v in batch.items()
                           if (labels or k != "labels") and (wrapper or k in PACKED_SEQUENCE_KEYS)})
        if not kwargs:
            return model(batch)
        if "use_cache" in named and "use_cache" not in kwargs:
            kwargs["use_cache"] = False  # no KV cache in a training pass; with one, packed documents are not read
        return model(**kwargs)
    if isinstance(batch, (tuple, list)):
        return model(batch[0])
    return model(batch)


def padding_mask_from_batch(batch: Any, key: str | None) -> torch.Tensor | None:
    """``batch[key]`` as a bool ``[B, N]`` mask (True = real token) for mapping batches, else ``None``.

    It fills in only for layers whose capture does not read the mask from the attention call (the manual
    recorder); a 4D custom mask (``[B, 1, N_q, N_k]``, which a model reads itself) gives ``None``.

    Example:
        >>> padding_mask_from_batch({"attention_mask": torch.tensor([[1, 0]])}, "attention_mask")
        tensor([[ True, False]])
        >>> padding_mask_from_batch({"attention_mask": torch.ones(1, 1, 2, 2, dtype=torch.bool)}, "attention_mask")
    """
    if key is None or not isinstance(batch, Mapping) or batch.get(key) is None:
        return None
    mask = batch[key]
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise ValueError(
            f"Expected the batch's `{key}` to be a [B, N] padding mask tensor (1/True = real token), but got "
            f"{type(mask).__name__}{tuple(mask.shape) if isinstance(mask, torch.Tensor) else ''}; set `mask_key` to "
            "the right key or None."
        )
    return mask.bool() if mask.dtype != torch.bool else mask


@dataclass
class DistillationStep:
    """What one :meth:`AttentionDistiller.distilling` block (or call) produced; filled when the block ends.

    Attributes:
        loss: ``weight_at(step) · terms.total``, differentiable: add it to the student's loss.
        terms: the :class:`~lightning_streamkl.loss.LossOutput` (per-term means, row sums and counts).
        weight: the global weight at this step (warm-up included).
        step: the step the weight was taken at.
        output: the student's output, when the distiller ran the student itself (``distiller(batch)``).

    Example:
        >>> DistillationStep().loss is None
        True
    """

    loss: torch.Tensor | None = None
    terms: LossOutput | None = None
    weight: float = 0.0
    step: int = 0
    output: Any = field(default=None, repr=False)


def _teacher_of(teacher: nn.Module | str | AdaptersOff, config: StreamKLConfig) -> FrozenTeacher | SelfTeacher:
    """The engine's teacher: the student with its adapters off, or a frozen module placed as ``config`` says."""
    if not isinstance(teacher, AdaptersOff):
        return FrozenTeacher(teacher, dtype=config.teacher_dtype, device=config.teacher_device,
                             from_pretrained=config.teacher_from_pretrained)
    if config.teacher_device == "offload":
        raise ValueError("Expected a `teacher_device` other than 'offload' with AdaptersOff, but got "
                         "teacher_device='offload': the teacher is the student itself, which is never offloaded.")
    return SelfTeacher(teacher)


def _check_caller_pass(config: StreamKLConfig) -> None:
    """Refuse a teacher pass run by the caller (``teacher_recording``) for an offloaded teacher."""
    if config.teacher_device == "offload":
        raise ValueError(
            "Expected the engine to run a teacher with teacher_device='offload' (it streams the teacher's blocks to "
            "the device during its own pass), but the caller runs it (teacher_recording(), e.g. a trainer's own "
            "teacher_model): that pass would find the teacher in host memory. Use teacher_device='student', or let "
            "the engine run the teacher."
        )


def _device_of(module: nn.Module) -> torch.device:
    device = getattr(module, "device", None)
    if isinstance(device, torch.device):
        return device
    for t in module.parameters():
        return t.device
    return torch.device("cpu")


class AttentionDistiller:
    r"""Teacher, captures and loss of one distillation setup; no Lightning needed.

    Per step: :meth:`begin_step` releases the last step's records, the student's forward pass runs inside
    :meth:`student_recording`, and :meth:`end_step` runs the teacher, taking each pair's terms as soon as its teacher
    layer has recorded (and dropping both layers' captures then), and returns the
    :class:`~lightning_streamkl.loss.LossOutput` (``total`` is :math:`\sum_p w_p \overline{\mathrm{KL}}_p`,
    differentiable; multiply it by :meth:`weight_at`). Captured tensors are released at the end of every step.

    The teacher runs under ``no_grad`` in ``eval()`` mode and stops once every paired teacher layer is captured
    (``teacher_early_exit``): later layers and the output head never run. Its placement and dtype follow
    ``teacher_device`` and ``teacher_dtype``; its inputs follow ``teacher_inputs`` (see
    :class:`~lightning_streamkl.StreamKLConfig`).

    Outside Lightning there are three ways to drive it, from the shortest:

    - ``loss = distiller(batch)``: the teacher's pass, the student's forward (``student_forward``) and the
      weighted term; the student's output is then :attr:`student_output` (for the task loss);
    - ``with distiller.distilling(batch) as kd: out = student(...)``, then ``out.loss + kd.loss``: a context
      manager around your own forward pass;
    - :meth:`begin_step`, :meth:`student_recording`, :meth:`end_step`: the three steps by hand.

    The first two count their calls (:attr:`steps`) for the warm-up unless given ``step=``. A loop that runs the teacher
    itself, because it needs the teacher's output (a logit-distillation trainer), opens :meth:`teacher_recording`
    around that pass instead of calling :meth:`begin_step`: the pass is recorded, and not repeated.

    Args:
        teacher: the teacher module, a Hugging Face model name/path, or
            :class:`~lightning_streamkl.teacher.AdaptersOff` (the student itself with its adapters switched off).
        config: a :class:`~lightning_streamkl.StreamKLConfig` or a mapping of its fields.
        student: the student; given here, :meth:`setup` runs at once. Default: ``None`` (call :meth:`setup`).
        teacher_forward: ``fn(teacher, batch)`` that runs the teacher on a batch; default
            :func:`default_teacher_forward`. Giving one turns ``teacher_inputs="auto"`` into ``"batch"``.
        student_forward: ``fn(student, batch)`` that ``distiller(batch)`` runs the student with; default
            :func:`default_student_forward` (mapping batches keep ``labels``, so a Hugging Face model returns its
            loss).
        padding_mask: ``fn(batch) -> [B, N] bool mask or None``; default: ``batch[config.mask_key]``.

    Example:
        ``loss = distiller(batch)`` in a plain PyTorch loop:

        >>> encoder = lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), 2,
        ...                                         enable_nested_tensor=False)
        >>> teacher, student = encoder(), encoder()
        >>> distiller = AttentionDistiller(teacher, {"pairs": [[-1, -1]], "causal": False}, student=student)
        >>> optimizer = torch.optim.SGD(student.parameters(), lr=0.1)
        >>> for _ in range(2):
        ...     kd = distiller(torch.randn(2, 5, 16))
        ...     loss = distiller.student_output.pow(2).mean() + kd
        ...     loss.backward(); optimizer.step(); optimizer.zero_grad()
        >>> distiller.steps, kd.requires_grad
        (2, True)

        A context manager around your own forward pass:

        >>> x = torch.randn(2, 5, 16)
        >>> with distiller.distilling(x) as kd:
        ...     y = student(x)
        >>> (y.pow(2).mean() + kd.loss).backward()
        >>> sorted(kd.terms.per_pair), kd.step
        (['t-1_s-1'], 2)

        The three steps by hand:

        >>> distiller = AttentionDistiller(teacher, {"pairs": [[-1, -1]], "causal": False})
        >>> distiller.setup(student)
        [('layers.1.self_attn', 'layers.1.self_attn')]
        >>> x = torch.randn(2, 5, 16)
        >>> distiller.begin_step(x)
        >>> with distiller.student_recording():
        ...     y = student(x)
        >>> terms = distiller.end_step(x)
        >>> loss = y.pow(2).mean() + distiller.weight_at(step=0) * terms.total
        >>> loss.backward()
        >>> list(terms.per_pair), terms.total.requires_grad
        (['t-1_s-1'], True)
    """

    def __init__(self, teacher: nn.Module | str | AdaptersOff, config: StreamKLConfig | Mapping[str, Any], *,
                 student: nn.Module | None = None, teacher_forward: TeacherForward | None = None,
                 student_forward: TeacherForward | None = None,
                 padding_mask: Callable[[Any], torch.Tensor | None] | None = None) -> None:
        for arg, fn in (("teacher_forward", teacher_forward), ("student_forward", student_forward)):
            if fn is not None and not callable(fn):
                raise TypeError(f"Expected `{arg}` to be callable, but got {type(fn).__name__}.")
        self.config = config = validate_config(config)
        self.teacher = _teacher_of(teacher, config)
        self.custom_forward = teacher_forward is not None
        self.teacher_forward = teacher_forward or default_teacher_forward
        self.student_forward = student_forward or default_student_forward
        #: Calls of :meth:`__call__` and :meth:`distilling` so far (the warm-up step when none is given).
        self.steps = 0
        #: The student's output of the last ``distiller(batch)`` call.
        self.student_output: Any = None
        self.padding_mask = padding_mask or functools.partial(padding_mask_from_batch, key=config.mask_key)
        self.loss = AttentionDistillationLoss(config)
        self.teacher_capture: AttentionCapture | None = None
        self.student_capture: AttentionCapture | None = None
        self.student: nn.Module | None = None
        self.resolved: list[tuple[str, str]] = []
        #: The student submodule whose inputs the teacher is fed (``None``: the teacher gets the batch).
        self.inputs_from: str | None = None
        self._inputs: InputRecorder | None = None
        self._teacher_ran = False
        self._announced = False
        self._compiled: tuple[nn.Module, bool] | None = None  # (teacher module, whether it runs compiled)
        if student is not None:
            self.setup(student)

    # ------------------------------------------------------------------------------------------ setup
    @property
    def teacher_module(self) -> nn.Module | None:
        """The loaded, frozen teacher module (``None`` before :meth:`setup`); with
        :class:`~lightning_streamkl.teacher.AdaptersOff`, the student's adapter-carrying submodule."""
        return self.teacher.module

    @property
    def is_self_teacher(self) -> bool:
        """True when the teacher is the student itself with its adapters off (:class:`AdaptersOff`)."""
        return isinstance(self.teacher, SelfTeacher)

    def setup(self, student: nn.Module) -> list[tuple[str, str]]:
        """Load and freeze the teacher, build both captures, resolve the layer pairs and the teacher's inputs.

        Idempotent for the same student. Returns the resolved ``(teacher layer, student layer)`` paths.

        Raises:
            ValueError: the teacher is the student module itself (use
                :class:`~lightning_streamkl.teacher.AdaptersOff` for the student with its adapters off), is part of
                it (a submodule holding every parameter, or every paired layer, of the student), shares parameters
                with it (:func:`~lightning_streamkl.teacher.check_separate`, checked before the teacher is frozen)
                or has no data (meta tensors), an unknown layer (listing the closest names), an unknown
                ``teacher_inputs`` submodule, or (``AdaptersOff``) no submodule whose adapters can be switched off.
        """
        if self.student is student:
            return self.resolved
        if isinstance(self.teacher, SelfTeacher):
            self.teacher.bind(student)
            teacher = self.teacher.prepare()
        else:
            if isinstance(self.teacher.source, nn.Module):
                _check_not_inside(self.teacher.source, student)
            teacher = self.teacher.prepare(student)  # refuses shared parameters before freezing the teacher
        values = self.loss.needs_values
        self.teacher_capture = build_capture(teacher, self.config.teacher_capture, capture_values=values)
        exclude = [] if self.is_self_teacher else [teacher]
        self.student_capture = build_capture(student, self.config.student_capture, exclude=exclude,
                                             capture_values=values)
        try:
            self.resolved = self.loss.resolve(self.teacher_capture, self.student_capture)
        except ValueError as err:
            path = None if self.is_self_teacher else _path_in(student, teacher)
            if path is None or _finds_layers(self.student_capture) or not _finds_layers(self.teacher_capture):
                raise  # not a teacher that took the student's attention layers with it
            raise ValueError(
                f"The teacher is part of the student: it is the student's submodule {path!r}, whose layers then count "
                f"as the teacher's and not the student's ({err}) {_SEPARATE_TEACHER}"
            ) from None
        self.inputs_from = self._resolve_inputs(teacher, student)
        self._inputs = None if self.inputs_from is None else InputRecorder(student.get_submodule(self.inputs_from))
        self.student = student
        return self.resolved

    def _resolve_inputs(self, teacher: nn.Module, student: nn.Module) -> str | None:
        choice = self.config.teacher_inputs
        if choice == "batch" or (choice == "auto" and self.custom_forward):
            return None
        if choice == "auto" and isinstance(self.teacher, SelfTeacher):
            return self.teacher.path or None  # the adapter-carrying submodule is fed what it received
        if choice == "auto":
            return find_copy(teacher, student)
        paths = [name for name, _ in student.named_modules() if name]
        if choice not in paths:
            near = closest(choice, paths)
            raise ValueError(
                f"Expected `teacher_inputs` to be 'auto', 'batch' or a submodule of {type(student).__name__}, but it "
                f"has no {choice!r}." + (f" Closest: {near}." if near else "")
            )
        return choice

    @property
    def feeds_student_inputs(self) -> bool:
        """True when the teacher is fed the inputs of a student submodule (it then runs after the student)."""
        return self.inputs_from is not None

    def shard_teacher(self, mesh: Any) -> None:
        """Shard the teacher over ``mesh`` (a 1-D ``DeviceMesh`` of the data-parallel processes) with FSDP2, in
        place: each process keeps ``1/W`` of its weights, and every step's teacher pass gathers one block at a time
        (collective: every process runs it). Idempotent (see :meth:`FrozenTeacher.shard
        <lightning_streamkl.teacher.FrozenTeacher.shard>`)."""
        self.teacher.shard(mesh)

    def describe(self) -> str:
        """One line saying what is distilled: each pair's layers and, once a step has run, the precision of its
        products (``bf16``, ``fp16``, ``fp32 (TF32)``, ``fp32 (IEEE)``; see :mod:`streamkl.precision`). The engine
        logs it at the end of its first step (logger ``lightning_streamkl.engine``, INFO, global rank 0).

        Example:
            >>> encoder = lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), 1,
            ...                                         enable_nested_tensor=False)
            >>> d = AttentionDistiller(encoder(), {"pairs": [[0, 0]], "name": "kd", "causal": False}, student=encoder())
            >>> d.describe()
            "StreamKL 'kd': distilling 1 layer pair(s): t0_s0 (layers.0.self_attn -> layers.0.self_attn)"
            >>> _ = d(torch.randn(2, 5, 16))
            >>> d.describe()
            "StreamKL 'kd': distilling 1 layer pair(s): t0_s0 (layers.0.self_attn -> layers.0.self_attn, fp32 (IEEE))"
        """
        precisions = self.loss.precisions

        def products(pair: LayerPair) -> str:
            terms = [precisions[n] for n in self.loss.term_names(pair) if n in precisions]
            return f", {'; '.join(dict.fromkeys(terms))}" if terms else ""

        pairs = ", ".join(f"{p.label} ({t} -> {s}{products(p)})" for p, (t, s) in zip(self.config.pairs, self.resolved))
        fed = f"; the teacher is fed the inputs of the student's {self.inputs_from!r}" if self.inputs_from else ""
        shards = self.teacher.shards
        placed = f"; the teacher is sharded over {shards} processes" if shards > 1 else ""
        if self.config.teacher_device == "offload" and not self.is_self_teacher:
            placed += "; the teacher is streamed from host memory one block at a time"
        return f"StreamKL {self.config.name!r}: distilling {len(self.resolved)} layer pair(s): {pairs}{fed}{placed}"

    def metrics(self) -> DistillationMetrics:
        """A fresh :class:`DistillationMetrics` for this setup's pairs."""
        return DistillationMetrics(self.loss.pair_names, self.loss.weights, self.config.name)

    # ------------------------------------------------------------------------------------------ per step
    def _ready(self) -> tuple[nn.Module, AttentionCapture, AttentionCapture]:
        if self.student is None or self.teacher_capture is None or self.student_capture is None:
            raise RuntimeError("AttentionDistiller.setup(student) must run before the first step.")
        return self.student, self.teacher_capture, self.student_capture

    def run_teacher(self, batch: Any, *, stream: LossStream | None = None) -> None:
        """Run the teacher once for this step, under ``no_grad`` with its capture recording: on the batch, or on
        the inputs the student submodule received. Given a ``stream`` (the step's loss, :meth:`end_step`), each pair's
        terms run as soon as its teacher layer has recorded, and both layers' captures are dropped then.

        Raises:
            TeacherForwardError: the teacher's forward raised (:func:`~lightning_streamkl.teacher.teacher_failed`:
                the message names the error and, for token ids outside the teacher's vocabulary, their range and the
                vocabulary size); errors raised by this package's own checks pass through unchanged.
        """
        student, teacher_capture, student_capture = self._ready()
        teacher = self.teacher.prepare()
        layers = [m for m in (_submodule(teacher, p) for p in teacher_capture.selected or ()) if m is not None]
        if self._compiled is None or self._compiled[0] is not teacher:  # once per teacher: a walk of its modules
            self._compiled = (teacher, is_compiled(teacher))  # a compiled one runs whole: a graph cannot raise the exit
        stops = bool(self.config.teacher_early_exit and teacher_capture.selected) and not self._compiled[1]
        early_exit = stop_after(layers, lambda: teacher_capture.selected <= teacher_capture.recorded) \
            if stops else nullcontext()
        with ExitStack() as stack:
            stack.enter_context(student_capture.paused())
            stack.enter_context(torch.no_grad())
            device = stack.enter_context(self.teacher.placed(_device_of(student), up_to=layers if stops else None))
            stack.enter_context(teacher_capture.recording())
            stack.enter_context(early_exit)
            if stream is not None:
                stack.enter_context(teacher_capture.handing_over(functools.partial(self._take, stream)))
            inputs = to_device(self._inputs.take(), device) if self._inputs is not None else to_device(batch, device)
            try:
                if self._inputs is not None:
                    teacher(*inputs[0], **inputs[1])
                else:
                    self.teacher_forward(teacher, inputs)
            except Exception as err:
                failure = teacher_failed(err, teacher, inputs[0] if self._inputs is not None else inputs)
                if failure is err:
                    raise
                raise failure from (None if getattr(failure, "explained", False) else err)
        self._teacher_ran = True

    def _take(self, stream: LossStream, layer: str, record: Any) -> bool:
        """A teacher record as it is made: run its pairs' terms now, drop the student records no pair still needs,
        and say whether the teacher record itself can go."""
        _, _, student_capture = self._ready()
        teacher_done, students_done = stream.add(layer, record, student_capture.records)
        for name in students_done:
            student_capture.discard(name)
        return teacher_done

    def begin_step(self, batch: Any) -> None:
        """Start a step: release what the last one left. The teacher runs in :meth:`end_step`, after the student's
        forward pass (:meth:`student_recording`)."""
        self.clear()

    @contextmanager
    def student_recording(self) -> Iterator[None]:
        """Record the student's paired layers (and, when the teacher is fed them, its submodule's inputs)."""
        _, _, student_capture = self._ready()
        with ExitStack() as stack:
            stack.enter_context(student_capture.recording())
            if self._inputs is not None:
                stack.enter_context(self._inputs.recording())
            yield

    @contextmanager
    def teacher_recording(self) -> Iterator[None]:
        """Record the teacher's paired layers during a teacher forward pass that the caller runs inside the block
        (a trainer that needs the teacher's logits, such as a logit-distillation trainer, runs it itself).

        The pass runs as the caller runs it: to the end (no early exit: its output is needed), on the caller's
        device, in the caller's ``no_grad``. Once every paired teacher layer has recorded, the step counts the teacher
        as run, and :meth:`end_step` does not run it a second time (it still does when a paired layer did not run in
        the block). Call :meth:`clear` before the step, as :meth:`begin_step` does.

        Raises:
            ValueError: ``teacher_device="offload"``: only the engine's own pass streams the teacher to the device.

        Example:
            >>> encoder = lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), 1,
            ...                                         enable_nested_tensor=False)
            >>> teacher, student = encoder(), encoder()
            >>> distiller = AttentionDistiller(teacher, {"pairs": [[0, 0]], "causal": False}, student=student)
            >>> x = torch.randn(2, 5, 16)
            >>> distiller.clear()
            >>> with distiller.student_recording():
            ...     y = student(x)
            ...     with distiller.teacher_recording(), torch.no_grad():
            ...         logits = teacher(x)  # the trainer's own teacher pass, used for its loss too
            >>> distiller.teacher_recorded
            True
            >>> terms = distiller.end_step(x)  # no second teacher pass
            >>> list(terms.per_pair), terms.total.requires_grad
            (['t0_s0'], True)
        """
        _, teacher_capture, _ = self._ready()
        _check_caller_pass(self.config)  # before prepare() moves an offloaded teacher to the host
        self.teacher.prepare()
        with teacher_capture.recording():
            yield
        if self.teacher_recorded:
            self._teacher_ran = True

    @property
    def teacher_recorded(self) -> bool:
        """True when every paired teacher layer has recorded since the last :meth:`clear`."""
        capture = self.teacher_capture
        if capture is None or not capture.recorded:
            return False
        return capture.selected is None or capture.selected <= capture.recorded

    @property
    def student_recorded(self) -> bool:
        """True when the student's paired layers recorded something since the last :meth:`clear`."""
        return bool(self.student_capture is not None and self.student_capture.records)

    def end_step(self, batch: Any) -> LossOutput:
        """The loss terms of this step, then release the records.

        Unless the teacher has run in this step (:meth:`teacher_recording`), it runs now, after the student, and
        each pair's terms are taken as soon as its teacher layer has recorded (with ``teacher_early_exit``, the
        default): both layers' captured queries and keys are dropped then, and with a frozen teacher the op keeps only
        the student's gradients for its backward, so at no point of the step are every pair's captures alive at once.
        """
        try:
            if self._teacher_ran:
                return self.compute(batch)
            stream = self._stream(batch)
            self.run_teacher(batch, stream=stream if self.config.teacher_early_exit else None)
            return self._finish(stream)
        finally:
            self.clear()

    @contextmanager
    def distilling(self, batch: Any, *, step: int | None = None) -> Iterator[DistillationStep]:
        """Distil around the student's forward pass run inside the block: the teacher runs on ``batch`` after
        it; when the block ends, the yielded
        :class:`DistillationStep` holds ``loss`` (``weight_at(step) · total``, differentiable) and the terms.

        Args:
            batch: what the teacher is run on (and where the padding mask comes from).
            step: the optimizer step for the warm-up; default: :attr:`steps` (this distiller's calls so far).

        Example:
            >>> model = lambda: nn.Sequential(nn.Linear(8, 8), nn.MultiheadAttention(8, 2, batch_first=True))
            >>> teacher, student = model(), model()
            >>> distiller = AttentionDistiller(teacher, {"pairs": [[0, 0]], "causal": False}, student=student,
            ...                                teacher_forward=lambda m, x: m[1](m[0](x), m[0](x), m[0](x)))
            >>> x = torch.randn(2, 4, 8)
            >>> with distiller.distilling(x) as kd:
            ...     h = student[0](x)
            ...     out, _ = student[1](h, h, h)
            >>> kd.loss.requires_grad, kd.weight, distiller.steps
            (True, 1.0, 1)
        """
        kd = DistillationStep(step=self.steps if step is None else int(step))
        self.begin_step(batch)
        try:
            with self.student_recording():
                yield kd
            kd.terms = self.end_step(batch)
        finally:
            self.clear()
        kd.weight = self.weight_at(kd.step)
        kd.loss = kd.terms.total * kd.weight
        self.steps += 1

    def __call__(self, batch: Any, *, step: int | None = None) -> torch.Tensor:
        """One distilled forward pass: the teacher's, the student's (``student_forward(student, batch)``, kept in
        :attr:`student_output`), and the weighted term ``weight_at(step) · total`` (differentiable).

        Example: see the class.
        """
        student, _, _ = self._ready()
        with self.distilling(batch, step=step) as kd:
            kd.output = self.student_forward(student, batch)
        self.student_output = kd.output
        assert kd.loss is not None
        return kd.loss

    def compute(self, batch: Any) -> LossOutput:
        """The loss terms from the records of this step (both models have run), then release the records."""
        return self._finish(self._stream(batch))

    def _stream(self, batch: Any) -> LossStream:
        mask = self.padding_mask(batch)
        return self.loss.stream(key_padding_mask=mask, query_mask=mask if self.config.mask_queries else None)

    def _finish(self, stream: LossStream) -> LossOutput:
        _, teacher_capture, student_capture = self._ready()
        try:
            terms = stream.finish(teacher_capture.pop(), student_capture.pop())
        finally:
            self.clear()
        if not self._announced:
            self._announced = True
            if not torch.distributed.is_available() or not torch.distributed.is_initialized() \
                    or torch.distributed.get_rank() == 0:
                log.info(self.describe())
        return terms

    def clear(self) -> None:
        """Release everything captured in this step."""
        for capture in (self.teacher_capture, self.student_capture):
            if capture is not None:
                capture.clear()
        if self._inputs is not None:
            self._inputs.clear()
        self._teacher_ran = False

    def weight_at(self, step: int) -> float:
        """The global weight at optimizer step ``step`` (linear warm-up from 0 over ``warmup_steps``).

        Example:
            >>> AttentionDistiller(nn.Identity(), {"pairs": [[0, 0]], "weight": 2.0, "warmup_steps": 4}).weight_at(1)
            0.5
        """
        cfg = self.config
        if cfg.warmup_steps <= 0:
            return cfg.weight
        return cfg.weight * min(1.0, max(step, 0) / cfg.warmup_steps)


_SEPARATE_TEACHER = ("Pass a separate teacher: a copy made before training (`copy.deepcopy(student.<path>)`) or the "
                     "model loaded again; a teacher the LightningModule holds beside the student's own network (e.g. "
                     "`self.teacher`) is fine.")


def _finds_layers(capture: AttentionCapture) -> bool:
    """True when ``capture`` found attention layers by itself (the recorder takes any path it is given)."""
    return capture.kind != "recorder" and bool(capture.layer_names())


def _path_in(student: nn.Module, module: nn.Module) -> str | None:
    """The path of ``module`` inside ``student`` (not the root), or ``None``."""
    return next((name for name, m in student.named_modules(remove_duplicate=False) if name and m is module), None)


def _check_not_inside(teacher: nn.Module, student: nn.Module) -> None:
    """Refuse a teacher that is a submodule of the student holding every one of the student's parameters (the
    student's own network passed as its teacher): nothing would be left to distil into."""
    path = _path_in(student, teacher)
    if path is None:
        return
    inside = {id(p) for p in teacher.parameters()}
    if all(id(p) in inside for p in student.parameters()):
        raise ValueError(
            f"The teacher is part of the student: it is the student's submodule {path!r} ({type(teacher).__name__}), "
            f"which holds every parameter of {type(student).__name__}, so the student would have nothing of its own "
            f"to distil into (and freezing the teacher would freeze the student). {_SEPARATE_TEACHER}"
        )


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


class DistillationMetrics:
    """The metric state of a distillation: one :class:`~lightning_streamkl.AttentionKLDivergence` per stage, and
    the values a step and an epoch report (``<stage>/<name>/<pair>`` and ``<stage>/<name>/total``).

    Args:
        pair_names: the pairs' names.
        weights: the pairs' weights (for the total).
        name: the log namespace (the config's ``name``).

    Example:
        >>> from lightning_streamkl.loss import LossOutput
        >>> metrics = DistillationMetrics(["last"], [1.0], "attn_kl")
        >>> terms = LossOutput(torch.tensor(0.5), {"last": torch.tensor(0.5)}, torch.tensor([4.0]), torch.tensor([8.0]))
        >>> {k: float(v) for k, v in metrics.update("train", terms).items()}
        {'train/attn_kl/last': 0.5, 'train/attn_kl/total': 0.5}
        >>> {k: float(v) for k, v in metrics.epoch_values("train").items()}
        {'train/attn_kl/last': 0.5, 'train/attn_kl/total': 0.5}
        >>> metrics.epoch_values("train")
        {}
    """

    def __init__(self, pair_names: list[str], weights: list[float], name: str) -> None:
        self.name = name
        # the rows are the op's counts: no check that reads them on the host each step
        self.train, self.val = (AttentionKLDivergence(pair_names, weights=weights, prefix=f"{name}/",
                                                      validate_args=False) for _ in range(2))

    def __getitem__(self, stage: str) -> AttentionKLDivergence:
        if stage not in ("train", "val"):
            raise ValueError(f"Expected `stage` to be 'train' or 'val', but got {stage!r}.")
        return self.train if stage == "train" else self.val

    def update(self, stage: str, terms: LossOutput, extra: Mapping[str, torch.Tensor] | None = None,
               ) -> dict[str, torch.Tensor]:
        """Add one batch's terms to the stage's metric; returns the step's values (``extra`` goes under the same
        namespace, e.g. ``{"weight": ...}``), total last."""
        metric = self[stage]
        if metric.device != terms.rows.device:  # (moving it builds a tensor on the device: only when it moves)
            metric.to(terms.rows.device)
        metric.update(terms.kl_sums, terms.rows)
        prefix = f"{stage}/{self.name}/"
        values = {prefix + k: v.detach() for k, v in terms.per_pair.items()}
        values.update({prefix + k: v for k, v in (extra or {}).items()})
        values[prefix + "total"] = terms.total.detach()
        return values

    def epoch_values(self, stage: str) -> dict[str, torch.Tensor]:
        """The stage's epoch values (row-weighted, synced across processes), then a reset; ``{}`` when no batch
        was added."""
        metric = self[stage]
        if metric.update_count == 0:
            return {}
        values = {f"{stage}/{k}": v for k, v in metric.compute().items()}
        metric.reset()
        return values
