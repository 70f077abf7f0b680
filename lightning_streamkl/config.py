# ruff: noqa: UP045  - omegaconf < 2.4 reads typing.Optional, not `X | None`, in structured configs
r"""
Configuration
^^^^^^^^^^^^^

Everything a user sets, as omegaconf structured configs (dataclasses): :class:`LayerPair` for one
teacher/student layer pair, :class:`AttentionKLOptions` for the options every attention-KL term has, and
:class:`StreamKLConfig` for a distillation. Each option is declared once, as a field that carries its check
(:func:`~lightning_streamkl.options.option`); :func:`validate_config` runs those checks, and the constructors
(:class:`~lightning_streamkl.StreamKLDistillation`, the mixin) and the YAML loader (:func:`load_config`) all go
through it, so a bad key or value fails with the same message naming it wherever it was written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from streamkl.options import BACKENDS, DIRECTIONS  # the op's choices, defined there once

from .capture import CAPTURE_KINDS
from .options import (
    Check,
    Choice,
    Count,
    Flag,
    Keywords,
    LayerRef,
    Number,
    Text,
    check_fields,
    invalid,
    option,
    plain,
    read_mapping,
)

__all__ = ["AttentionKLOptions", "LayerPair", "StreamKLConfig", "load_config", "to_yaml", "validate_config"]

HEAD_MAPS = ("error", "group")
TEACHER_DTYPES = ("auto", "float32", "float16", "bfloat16", "float64")
#: The named values of ``teacher_device`` (any other value is a torch device, e.g. ``"cuda:1"``).
TEACHER_DEVICES = ("student", "keep", "offload")
#: The named values of ``teacher_inputs`` (any other value is a module path in the student).
TEACHER_INPUTS = ("auto", "batch")
#: The values of ``teacher_sharding``.
TEACHER_SHARDING = ("auto", "shard", "replicate")


#: What a pair compares: ``"qk"``, the attention distributions softmax(q kᵀ); ``"qq"``, ``"kk"``, ``"vv"``, MiniLM-v2's
#: self-attention relations softmax(x xᵀ) of the queries, keys and values (re-split into relation heads).
RELATIONS = ("qk", "qq", "kk", "vv")


class _Relations(Check):
    """A non-empty list of distinct relations from :data:`RELATIONS` (a single one is taken as a list of one)."""

    @property
    def expected(self) -> str:
        return f"a non-empty list of distinct relations from {RELATIONS}"

    def check(self, value: Any, where: str) -> list[str]:
        value = plain(value)
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not value:
            raise self.fail(where, value, TypeError if not isinstance(value, (list, tuple)) else ValueError)
        out = [Choice(RELATIONS)(r, f"{where}[{i}]") for i, r in enumerate(value)]
        if len(set(out)) != len(out):
            raise self.fail(where, list(value))
        return out


#: The smallest temperature, the smallest normal float32 (``torch.finfo(torch.float32).tiny``): the op divides the
#: scores by the temperature in float32, and a smaller one (``1e-38``) gave nan.
MIN_TEMPERATURE = float(torch.finfo(torch.float32).tiny)


class _Temperature(Number):
    """A finite number ``>= MIN_TEMPERATURE`` (in words "> 0" for values at or below 0)."""

    def __init__(self, *, optional: bool = False) -> None:
        super().__init__(low=0.0, inclusive=False, optional=optional)

    def check(self, value: Any, where: str) -> float:
        value = super().check(value, where)
        if value < MIN_TEMPERATURE:
            raise invalid(where, f"a finite number >= {MIN_TEMPERATURE:g} (the smallest normal float32; the op "
                                 "computes in float32)", value)
        return value


@dataclass
class LayerPair:
    """One teacher layer distilled into one student layer.

    Args:
        teacher: the teacher layer: a module path (``"model.layers.11.self_attn"``) or an index into the
            teacher's attention layers in module order (negative counts from the end).
        student: the student layer, likewise (paths are relative to the LightningModule for the student).
        weight: this pair's weight in the sum of KL terms, ``>= 0``. Default: ``1.0``.
        temperature: overrides the config's temperature for this pair. Default: ``None``.
        direction: ``"forward"`` (KL(teacher‖student)) or ``"reverse"``; overrides the config's. Default: ``None``.
        causal: overrides the causality taken from the layers (or the config). Default: ``None``.
        head_map: ``"error"`` or ``"group"`` when the two layers have different numbers of query heads;
            overrides the config's (see :class:`StreamKLConfig`). Default: ``None``.
        name: the name in logs (``train/attn_kl/<name>``). Default: ``"t<i>_s<j>"``, where ``i`` and ``j``
            are the layer indices, or the layer numbers in the module paths (``model.layers.11.self_attn``
            gives ``11``).
        relations: what this pair compares, overriding the config's ``relations`` (see
            :class:`StreamKLConfig`). Default: ``None``.
        relation_heads: the number of relation heads for this pair's ``"qq"``/``"kk"``/``"vv"`` relations,
            overriding the config's. Default: ``None``.

    Example:
        >>> LayerPair(teacher=-1, student=-1).label
        't-1_s-1'
        >>> LayerPair(teacher="model.layers.11.self_attn", student="model.model.layers.3.self_attn").label
        't11_s3'
    """

    teacher: Any = option(None, LayerRef())
    student: Any = option(None, LayerRef())
    weight: float = option(1.0, Number(low=0.0))
    temperature: Optional[float] = option(None, _Temperature(optional=True))
    direction: Optional[str] = option(None, Choice(DIRECTIONS, optional=True))
    causal: Optional[bool] = option(None, Flag(optional=True))
    head_map: Optional[str] = option(None, Choice(HEAD_MAPS, optional=True))
    name: Optional[str] = option(None, Text(optional=True))
    relations: Optional[list[str]] = option(None, _Relations(optional=True))
    relation_heads: Optional[int] = option(None, Count(low=1, optional=True))

    @property
    def label(self) -> str:
        """``name``, or ``"t<i>_s<j>"`` from the layer references (see ``name``)."""
        return self.name if self.name is not None else f"t{_short(self.teacher)}_s{_short(self.student)}"

    @property
    def full_label(self) -> str:
        """``name``, or ``"t<teacher>_s<student>"`` with the layer references as written."""
        return self.name if self.name is not None else f"t{self.teacher}_s{self.student}"


def _short(layer: Any) -> str:
    """A layer reference for a default pair name: an index, the last number in a module path, else the path."""
    if isinstance(layer, str):
        numbers = [part for part in layer.split(".") if part.isdigit()]
        return numbers[-1] if numbers else layer
    return str(layer)


class _TeacherDevice(Check):
    """``"student"``, ``"keep"``, ``"offload"`` or a torch device name."""

    @property
    def expected(self) -> str:
        return f"one of {TEACHER_DEVICES} or a torch device such as 'cpu' or 'cuda:1'"

    def check(self, value: Any, where: str) -> str:
        if not isinstance(value, str):
            raise self.fail(where, value, TypeError)
        if value not in TEACHER_DEVICES:
            try:
                torch.device(value)
            except (RuntimeError, ValueError):
                raise self.fail(where, value) from None
        return value


_PAIR_FIELDS = ("teacher", "student", "weight")


def _check_pair(raw: Any, where: str) -> LayerPair:
    raw = plain(raw)
    if isinstance(raw, LayerPair):
        raw = dataclasses.asdict(raw)
    elif isinstance(raw, (list, tuple)) and len(raw) in (2, 3):
        raw = dict(zip(_PAIR_FIELDS, raw))
    elif not isinstance(raw, Mapping):
        expected = "a LayerPair, a mapping of its fields or a [teacher, student(, weight)] list"
        raise invalid(where, expected, raw, TypeError)
    for key in ("teacher", "student"):
        if raw.get(key) is None:
            raise ValueError(f"Missing `{where}.{key}`: each pair names a teacher layer and a student layer.")
    return LayerPair(**check_fields(LayerPair, raw, prefix=f"{where}."))


class _Pairs(Check):
    """A non-empty list of layer pairs with unique names (see :class:`StreamKLConfig`)."""

    @property
    def expected(self) -> str:
        return "a non-empty list of layer pairs"

    def check(self, value: Any, where: str) -> list[LayerPair]:
        if isinstance(value, (LayerPair, Mapping)):
            value = [value]
        if not isinstance(value, (list, tuple)) or not value:
            raise self.fail(where, value, ValueError if isinstance(value, (list, tuple)) else TypeError)
        checked = [_check_pair(p, f"{where}[{i}]") for i, p in enumerate(value)]
        # a default name shared by pairs whose layers are written differently falls back to the layers as written
        labels, full = [p.label for p in checked], [p.full_label for p in checked]
        for p in checked:
            if p.name is None and labels.count(p.label) > 1 and full.count(p.full_label) == 1:
                p.name = p.full_label
        labels = [p.label for p in checked]
        if "total" in labels:
            raise ValueError("Expected no pair to be named 'total' (the sum of all pairs is logged under that name).")
        dupes = sorted({x for x in labels if labels.count(x) > 1})
        if dupes:
            raise ValueError(f"Expected `{where}` to have unique names, but {dupes} occur more than once; set their "
                             "`name`.")
        return checked


@dataclass
class AttentionKLOptions:
    """The options of an attention-KL term, shared by :class:`StreamKLConfig` and
    :class:`~lightning_streamkl.ContinualConfig` (declared here once).

    Example:
        >>> from lightning_streamkl import ContinualConfig
        >>> StreamKLConfig().temperature == ContinualConfig().temperature == AttentionKLOptions().temperature
        True

    Args:
        weight: multiplies the term before it is added to the loss, ``>= 0``. Default: ``1.0``.
        warmup_steps: ramp ``weight`` linearly from 0 over this many optimizer steps (``0``: no ramp).
            Default: ``0``.
        temperature: divides both sides' scores, ``> 0`` and at least the smallest normal float32
            (:data:`MIN_TEMPERATURE`; the op computes in float32). Default: ``1.0``.
        direction: ``"forward"`` for KL(teacher‖student), ``"reverse"`` for KL(student‖teacher).
            Default: ``"forward"``.
        causal: force causal (``True``) or bidirectional (``False``) masking for every pair; ``None`` takes it
            from the captured layers (teacher and student must then agree). Default: ``None``.
        mask_key: the key of the padding mask (True/1 = real token) in mapping batches, used for layers whose
            capture does not read the mask from the attention call (``record()``); ``None`` for no mask.
            Default: ``"attention_mask"``.
        mask_queries: also exclude padded query rows from the KL (and its mean). Default: ``True``.
        validation: compute and log the KL on validation batches too. Default: ``True``.
        log_on_step: log per-step values of the training KL (epoch values are always logged). Default: ``True``.
        prog_bar: show the total in the progress bar. Default: ``False``.
        name: the log namespace and part of the checkpoint state key: logs go to ``<stage>/<name>/<pair>``
            and ``<stage>/<name>/total``; two callbacks need two names. Default: ``"attn_kl"``.
        backend: passed to :func:`streamkl.attention_kl`. Default: ``"auto"``.
    """

    weight: float = option(1.0, Number(low=0.0))
    warmup_steps: int = option(0, Count(low=0))
    temperature: float = option(1.0, _Temperature())
    direction: str = option("forward", Choice(DIRECTIONS))
    causal: Optional[bool] = option(None, Flag(optional=True))
    mask_key: Optional[str] = option("attention_mask", Text(optional=True))
    mask_queries: bool = option(True, Flag())
    validation: bool = option(True, Flag())
    log_on_step: bool = option(True, Flag())
    prog_bar: bool = option(False, Flag())
    name: str = option("attn_kl", Text())
    backend: str = option("auto", Choice(BACKENDS))


@dataclass
class StreamKLConfig(AttentionKLOptions):
    r"""A whole attention-distillation setup (everything except the teacher model itself).

    The options of :class:`AttentionKLOptions` (``weight``, ``warmup_steps``, ``temperature``, ``direction``,
    ``causal``, ``mask_key``, ``mask_queries``, ``validation``, ``log_on_step``, ``prog_bar``, ``name``,
    ``backend``), and:

    Args:
        pairs: the layer pairs (:class:`LayerPair`, or mappings with its fields, or ``[teacher, student]``
            / ``[teacher, student, weight]`` lists); at least one, names unique.
        head_map: what to do when paired layers have different numbers of query heads: ``"error"`` raises;
            ``"group"`` (when one count is a multiple of the other) compares each head of the layer with more
            heads to the head of the other layer whose consecutive group it falls in, as GQA groups heads,
            and averages over all of them. Default: ``"error"``.
        teacher_capture: how to capture the teacher: ``"auto"``, ``"hf"``, ``"mha"`` or ``"recorder"``
            (see :func:`lightning_streamkl.capture.build_capture`). Default: ``"auto"``.
        student_capture: the same for the student. Default: ``"auto"``.
        teacher_dtype: ``"auto"`` keeps the teacher's own dtype (under mixed precision too: a bf16 teacher stays
            bf16 next to the student's fp32 master weights; a teacher loaded by name gets its checkpoint's
            dtype); ``"float32"``, ``"float16"``, ``"bfloat16"`` or ``"float64"`` (or the ``torch.dtype`` itself,
            ``torch.bfloat16``) casts it once; ``None`` is the same as ``"auto"``. Default: ``"auto"``.
        teacher_device: where the teacher runs: ``"student"`` moves it to the student's device; ``"keep"``
            leaves it where it is (a model spread with ``device_map`` is always kept); ``"offload"`` keeps the teacher
            in host memory (pinned when CUDA is available) and streams it to the student's device one block at a time
            (its layers; what lies outside them, such as the embeddings, is copied for the whole pass): each pass
            copies the weights of the blocks that run, on CUDA while the previous block computes, and the device holds
            at most two blocks plus the weights outside them (:func:`~lightning_streamkl.teacher.streamed`); a device
            such as ``"cuda:1"`` or ``"cpu"`` moves it there. The batch goes to the teacher's device and the captured
            queries and keys come back to the student's. Default: ``"student"``.
        teacher_inputs: what the teacher is run on: ``"batch"``, the batch (through ``teacher_forward``); a
            module path in the student (e.g. ``"encoder"``), exactly the inputs that submodule receives in the
            step (for a teacher that is a copy of it, behind an embedding or projection of the LightningModule);
            ``"auto"``, that submodule when the teacher is a copy of one (same type and parameter shapes) and no
            ``teacher_forward`` is given, else the batch. Default: ``"auto"``.
        teacher_from_pretrained: for a teacher given by name or path, the keyword arguments of
            ``AutoModel.from_pretrained`` (``dtype``, ``revision``, ``attn_implementation``, ``trust_remote_code``,
            ``device_map``, ...); ``attn_implementation`` defaults to ``"sdpa"``. Default: ``None``.
        teacher_early_exit: stop the teacher's forward pass once every paired teacher layer has been captured:
            later layers and the output head (logits) never run; and take each pair's loss as soon as its teacher
            layer has recorded, so its captures go then (with the full pass, a layer that runs twice keeps its last
            call, and every loss is taken at the end). A compiled teacher (``teacher.compile()`` or
            ``torch.compile(teacher)``) always runs whole: the exit is an exception, which a graph cannot raise.
            Default: ``True``.
        teacher_sharding: how the teacher is laid out over the processes of a distributed run: ``"shard"`` shards
            it with FSDP2 over the data-parallel processes (each holds ``1/W`` of its weights; its blocks are
            gathered one at a time during its forward pass and freed after); ``"replicate"`` keeps a whole copy on
            every process; ``"auto"`` shards under ``FSDPStrategy`` and ``ModelParallelStrategy`` and replicates
            under DDP. A single process always holds the whole teacher. Default: ``"auto"``.
        relations: what every pair compares (a pair's own ``relations`` overrides it), any of: ``"qk"``, the
            attention distributions :math:`\mathrm{softmax}(q k^\top)`; ``"qq"``, ``"kk"``, ``"vv"``, the
            self-attention relations of MiniLM-v2 (Wang et al., 2021) :math:`\mathrm{softmax}(x x^\top /
            \sqrt{d_r})` of the queries, keys or values, after the layer's heads are concatenated and re-split into
            ``relation_heads`` heads of size :math:`d_r`, so teacher and student may differ in head counts and head
            dims. Each relation is one :func:`streamkl.attention_kl` term (``attention_kl(x_t, x_t, x_s, x_s)``),
            logged as ``<pair>/<relation>`` (a pair that compares only ``"qk"`` keeps its plain name); a pair's
            weight multiplies each of its terms. ``"vv"`` needs captured values (the ``v`` of a record).
            Default: ``["qk"]``.
        relation_heads: the number of relation heads :math:`A_r`; ``None`` takes the student layer's number of
            query heads. Each side's concatenated queries (keys, values) must split evenly. Default: ``None``.
        fuse_pairs: run the terms that share every shape, option and mask as one
            :func:`streamkl.attention_kl` call on their heads concatenated, when each is launch-bound (at most
            :data:`~lightning_streamkl.terms.FUSE_MAX_SCORES` score elements, e.g. BERT-sized layers): the op's host
            overhead is then paid once per step instead of once per pair. A group concatenates at most
            :data:`~lightning_streamkl.terms.FUSE_MAX_BYTES` of queries and keys per call (the copies are kept for
            the backward). Values and gradients equal the per-pair calls' up to float32 summation order. ``False``
            calls the op once per term. Default: ``True``.

    Example:
        >>> cfg = StreamKLConfig(pairs=[LayerPair(teacher=-1, student=-1)], teacher_dtype="bfloat16")
        >>> validate_config(cfg) == cfg, cfg.teacher_device, cfg.teacher_inputs
        (True, 'student', 'auto')
    """

    pairs: list[LayerPair] = option(check=_Pairs(), factory=list)
    head_map: str = option("error", Choice(HEAD_MAPS))
    teacher_capture: str = option("auto", Choice(CAPTURE_KINDS))
    student_capture: str = option("auto", Choice(CAPTURE_KINDS))
    teacher_dtype: Optional[str] = option("auto", Choice(TEACHER_DTYPES, optional=True))
    teacher_device: str = option("student", _TeacherDevice())
    teacher_inputs: str = option("auto", Text(expected=f"one of {TEACHER_INPUTS} or a module path of the student"))
    teacher_from_pretrained: Optional[dict[str, Any]] = option(None, Keywords(optional=True))
    teacher_early_exit: bool = option(True, Flag())
    teacher_sharding: str = option("auto", Choice(TEACHER_SHARDING))
    relations: list[str] = option(check=_Relations(), factory=lambda: ["qk"])
    relation_heads: Optional[int] = option(None, Count(low=1, optional=True))
    fuse_pairs: bool = option(True, Flag())


# ---------------------------------------------------------------------------------------------- validation
def validate_config(config: StreamKLConfig | Mapping[str, Any] | DictConfig) -> StreamKLConfig:
    """Check every field and return a normalised :class:`StreamKLConfig` (pairs as :class:`LayerPair`).

    This is the one validation routine: the constructors and :func:`load_config` call it.

    Raises:
        ValueError: an unknown key (with the closest valid one), a value out of range or not among the
            allowed choices, no pairs, or two pairs with the same name.
        TypeError: a value of the wrong type.

    Example:
        >>> cfg = validate_config({"pairs": [{"teacher": 3, "student": 1}], "temperature": 2})
        >>> cfg.pairs[0].teacher, cfg.pairs[0].student, cfg.pairs[0].label, cfg.temperature
        (3, 1, 't3_s1', 2.0)
        >>> validate_config({"pairs": [[3, 1]], "temprature": 2})
        Traceback (most recent call last):
        ...
        ValueError: Unknown key `temprature` in the StreamKL config. Did you mean `temperature`? Valid keys: [...].
    """
    if isinstance(config, str):
        raise invalid("config", "a StreamKLConfig or a mapping of its fields (use load_config for YAML)", config,
                      TypeError)
    return StreamKLConfig(**check_fields(StreamKLConfig, read_mapping(config, StreamKLConfig)))


def load_config(source: str | Any | Mapping[str, Any] | DictConfig, *, key: str | None = None) -> StreamKLConfig:
    """Load a :class:`StreamKLConfig` from a YAML file, YAML text, a mapping or a ``DictConfig``.

    omegaconf interpolations (``${...}``) are resolved first; the result goes through :func:`validate_config`.

    Args:
        source: a path to a ``.yaml`` file, YAML text, or an already loaded mapping.
        key: a dotted path selecting the StreamKL section of a larger config (e.g. ``"model.distillation"``).

    Example:
        >>> cfg = load_config('''
        ... pairs:
        ...   - {teacher: -1, student: -1, name: last}
        ... temperature: 2.0
        ... ''')
        >>> cfg.pairs[0].label, cfg.temperature
        ('last', 2.0)
    """
    return validate_config(read_mapping(source, StreamKLConfig, key=key))


def to_yaml(config: StreamKLConfig | Mapping[str, Any]) -> str:
    """The YAML text of a (validated) config; :func:`load_config` reads it back to an equal config.

    Example:
        >>> text = to_yaml(StreamKLConfig(pairs=[LayerPair(teacher=1, student=0)]))
        >>> load_config(text) == validate_config({"pairs": [[1, 0]]})
        True
    """
    return OmegaConf.to_yaml(OmegaConf.structured(validate_config(config)))
