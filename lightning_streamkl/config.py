# ruff: noqa: UP007, UP045  - omegaconf < 2.4 reads typing.Optional/Union, not `X | None`, in structured configs
r"""
Configuration
^^^^^^^^^^^^^

Everything a user sets, as omegaconf structured configs (dataclasses): :class:`LayerPair` for one
teacher/student layer pair and :class:`StreamKLConfig` for a distillation. One routine,
:func:`validate_config`, checks them; the Python constructors (:class:`~lightning_streamkl.StreamKLDistillation`,
the mixin) and the YAML loader (:func:`load_config`) all go through it, so a bad key or value fails with the
same message naming it wherever it was written.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from omegaconf import DictConfig, ListConfig, OmegaConf

DIRECTIONS = ("forward", "reverse")
HEAD_MAPS = ("error", "group")
CAPTURES = ("auto", "hf", "mha", "recorder")
BACKENDS = ("auto", "triton", "reference")
TEACHER_DTYPES = ("auto", "float32", "float16", "bfloat16", "float64")


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
        name: the name in logs (``train/attn_kl/<name>``). Default: ``"t<teacher>_s<student>"``.

    Example:
        >>> LayerPair(teacher=-1, student=-1).label
        't-1_s-1'
    """

    teacher: Any = None
    student: Any = None
    weight: float = 1.0
    temperature: Optional[float] = None
    direction: Optional[str] = None
    causal: Optional[bool] = None
    head_map: Optional[str] = None
    name: Optional[str] = None

    @property
    def label(self) -> str:
        """``name``, or ``"t<teacher>_s<student>"``."""
        return self.name if self.name is not None else f"t{self.teacher}_s{self.student}"


@dataclass
class StreamKLConfig:
    """A whole attention-distillation setup (everything except the teacher model itself).

    Args:
        pairs: the layer pairs (:class:`LayerPair`, or mappings with its fields, or ``[teacher, student]``
            / ``[teacher, student, weight]`` lists); at least one, names unique.
        weight: multiplies the weighted sum of pair terms before it is added to the loss, ``>= 0``.
            Default: ``1.0``.
        warmup_steps: ramp ``weight`` linearly from 0 over this many optimizer steps (``0``: no ramp).
            Default: ``0``.
        temperature: divides both sides' scores, ``> 0``. Default: ``1.0``.
        direction: ``"forward"`` for KL(teacher‖student), ``"reverse"`` for KL(student‖teacher).
            Default: ``"forward"``.
        causal: force causal (``True``) or bidirectional (``False``) masking for every pair; ``None`` takes it
            from the captured layers (teacher and student must then agree). Default: ``None``.
        head_map: what to do when paired layers have different numbers of query heads: ``"error"`` raises;
            ``"group"`` (when one count is a multiple of the other) compares each head of the layer with more
            heads to the head of the other layer whose consecutive group it falls in, as GQA groups heads,
            and averages over all of them. Default: ``"error"``.
        teacher_capture: how to capture the teacher: ``"auto"``, ``"hf"``, ``"mha"`` or ``"recorder"``
            (see :func:`lightning_streamkl.capture.build_capture`). Default: ``"auto"``.
        student_capture: the same for the student. Default: ``"auto"``.
        teacher_dtype: cast the teacher to this dtype; ``"auto"`` follows the student's parameters, ``None``
            leaves it. Default: ``"auto"``.
        mask_key: the key of the padding mask (True/1 = real token) in mapping batches; ``None`` for no mask.
            Default: ``"attention_mask"``.
        mask_queries: also exclude padded query rows from the KL (and its mean). Default: ``True``.
        validation: compute and log the KL on validation batches too. Default: ``True``.
        log_on_step: log per-step values of the training KL (epoch values are always logged). Default: ``True``.
        prog_bar: show the total in the progress bar. Default: ``False``.
        name: the log namespace and part of the checkpoint state key: logs go to ``<stage>/<name>/<pair>``
            and ``<stage>/<name>/total``; two callbacks need two names. Default: ``"attn_kl"``.
        backend: passed to :func:`streamkl.attention_kl`. Default: ``"auto"``.
    """

    pairs: list[LayerPair] = field(default_factory=list)
    weight: float = 1.0
    warmup_steps: int = 0
    temperature: float = 1.0
    direction: str = "forward"
    causal: Optional[bool] = None
    head_map: str = "error"
    teacher_capture: str = "auto"
    student_capture: str = "auto"
    teacher_dtype: Optional[str] = "auto"
    mask_key: Optional[str] = "attention_mask"
    mask_queries: bool = True
    validation: bool = True
    log_on_step: bool = True
    prog_bar: bool = False
    name: str = "attn_kl"
    backend: str = "auto"


# ---------------------------------------------------------------------------------------------- validation
def _fail(where: str, expected: str, got: Any, exc: type[Exception] = ValueError) -> Exception:
    shown = f"{got!r}" if not isinstance(got, (Mapping, list, tuple)) or len(repr(got)) < 80 else type(got).__name__
    return exc(f"Expected `{where}` to be {expected}, but got {shown}.")


def _number(value: Any, where: str, *, low: float, inclusive: bool, optional: bool = False) -> Optional[float]:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        bound = f"{'>=' if inclusive else '>'} {low:g}"
        raise _fail(where, f"a finite number {bound}{' or None' if optional else ''}", value, TypeError)
    value = float(value)
    if not math.isfinite(value) or value < low or (value == low and not inclusive):
        raise _fail(where, f"a finite number {'>=' if inclusive else '>'} {low:g}", value)
    return value


def _choice(value: Any, where: str, choices: Sequence[str], *, optional: bool = False) -> Optional[str]:
    if value is None and optional:
        return None
    if value not in choices:
        exc = ValueError if isinstance(value, str) else TypeError
        raise _fail(where, f"one of {tuple(choices)}{' or None' if optional else ''}", value, exc)
    return value


def _flag(value: Any, where: str, *, optional: bool = False) -> Optional[bool]:
    if value is None and optional:
        return None
    if not isinstance(value, bool):
        raise _fail(where, f"a bool{' or None' if optional else ''}", value, TypeError)
    return value


def _text(value: Any, where: str, *, optional: bool = False) -> Optional[str]:
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        exc = ValueError if isinstance(value, str) else TypeError
        raise _fail(where, f"a non-empty string without spaces{' or None' if optional else ''}", value, exc)
    return value


def _layer(value: Any, where: str) -> Union[int, str]:
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, str)) or value == "":
        raise _fail(where, "a layer index (int) or a module path (non-empty str)", value, TypeError)
    return int(value) if isinstance(value, numbers.Integral) else value


def _plain(value: Any) -> Any:
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _check_keys(raw: Mapping[str, Any], cls: type, where: str) -> None:
    known = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in known:
            near = difflib.get_close_matches(str(key), known, n=1)
            hint = f" Did you mean `{where}{near[0]}`?" if near else ""
            raise ValueError(f"Unknown key `{where}{key}` in the StreamKL config.{hint} Valid keys: {known}.")


def _check_pair(raw: Any, where: str) -> LayerPair:
    raw = _plain(raw)
    if isinstance(raw, LayerPair):
        raw = dataclasses.asdict(raw)
    elif isinstance(raw, (list, tuple)) and len(raw) in (2, 3):
        raw = dict(zip(("teacher", "student", "weight"), raw))
    elif not isinstance(raw, Mapping):
        expected = "a LayerPair, a mapping of its fields or a [teacher, student(, weight)] list"
        raise _fail(where, expected, raw, TypeError)
    _check_keys(raw, LayerPair, f"{where}.")
    for key in ("teacher", "student"):
        if raw.get(key) is None:
            raise ValueError(f"Missing `{where}.{key}`: each pair names a teacher layer and a student layer.")
    return LayerPair(
        teacher=_layer(raw["teacher"], f"{where}.teacher"),
        student=_layer(raw["student"], f"{where}.student"),
        weight=_number(raw.get("weight", 1.0), f"{where}.weight", low=0.0, inclusive=True),
        temperature=_number(raw.get("temperature"), f"{where}.temperature", low=0.0, inclusive=False, optional=True),
        direction=_choice(raw.get("direction"), f"{where}.direction", DIRECTIONS, optional=True),
        causal=_flag(raw.get("causal"), f"{where}.causal", optional=True),
        head_map=_choice(raw.get("head_map"), f"{where}.head_map", HEAD_MAPS, optional=True),
        name=_text(raw.get("name"), f"{where}.name", optional=True),
    )


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
    raw = _plain(config)
    if isinstance(raw, StreamKLConfig):
        raw = {f.name: getattr(raw, f.name) for f in dataclasses.fields(StreamKLConfig)}
    if not isinstance(raw, Mapping):
        raise _fail("config", "a StreamKLConfig or a mapping of its fields", raw, TypeError)
    _check_keys(raw, StreamKLConfig, "")
    d = {f.name: f.default for f in dataclasses.fields(StreamKLConfig) if f.default is not dataclasses.MISSING}
    d.update(raw)
    pairs = _plain(d.get("pairs", []))
    if isinstance(pairs, (LayerPair, Mapping)):
        pairs = [pairs]
    if not isinstance(pairs, (list, tuple)) or not pairs:
        exc = ValueError if isinstance(pairs, (list, tuple)) else TypeError
        raise _fail("pairs", "a non-empty list of layer pairs", pairs, exc)
    checked = [_check_pair(p, f"pairs[{i}]") for i, p in enumerate(pairs)]
    labels = [p.label for p in checked]
    if "total" in labels:
        raise ValueError("Expected no pair to be named 'total' (the sum of all pairs is logged under that name).")
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise ValueError(f"Expected `pairs` to have unique names, but {dupes} occur more than once; set their `name`.")
    warmup = d["warmup_steps"]
    if isinstance(warmup, bool) or not isinstance(warmup, numbers.Integral) or warmup < 0:
        exc = ValueError if isinstance(warmup, numbers.Integral) and not isinstance(warmup, bool) else TypeError
        raise _fail("warmup_steps", "an int >= 0", warmup, exc)
    return StreamKLConfig(
        pairs=checked,
        weight=_number(d["weight"], "weight", low=0.0, inclusive=True),
        warmup_steps=int(warmup),
        temperature=_number(d["temperature"], "temperature", low=0.0, inclusive=False),
        direction=_choice(d["direction"], "direction", DIRECTIONS),
        causal=_flag(d["causal"], "causal", optional=True),
        head_map=_choice(d["head_map"], "head_map", HEAD_MAPS),
        teacher_capture=_choice(d["teacher_capture"], "teacher_capture", CAPTURES),
        student_capture=_choice(d["student_capture"], "student_capture", CAPTURES),
        teacher_dtype=_choice(d["teacher_dtype"], "teacher_dtype", TEACHER_DTYPES, optional=True),
        mask_key=_text(d["mask_key"], "mask_key", optional=True),
        mask_queries=_flag(d["mask_queries"], "mask_queries"),
        validation=_flag(d["validation"], "validation"),
        log_on_step=_flag(d["log_on_step"], "log_on_step"),
        prog_bar=_flag(d["prog_bar"], "prog_bar"),
        name=_text(d["name"], "name"),
        backend=_choice(d["backend"], "backend", BACKENDS),
    )


# ---------------------------------------------------------------------------------------------- YAML
def load_config(
    source: str | os.PathLike[str] | Mapping[str, Any] | DictConfig, *, key: str | None = None
) -> StreamKLConfig:
    """Load a :class:`StreamKLConfig` from a YAML file, a YAML string, a mapping or a ``DictConfig``.

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
    if isinstance(source, (str, os.PathLike)) and _is_path(source):
        node = OmegaConf.load(Path(source))
    elif isinstance(source, str):
        node = OmegaConf.create(source)
    elif isinstance(source, (Mapping, DictConfig)):
        node = OmegaConf.create(_plain(source) if isinstance(source, DictConfig) else dict(source))
    else:
        raise _fail("source", "a YAML path, YAML text, a mapping or a DictConfig", source, TypeError)
    if key is not None:
        selected = OmegaConf.select(node, key)
        if selected is None:
            raise ValueError(f"Expected the config to contain `{key}`, but it has no such key.")
        node = selected
    raw = OmegaConf.to_container(node, resolve=True) if isinstance(node, (DictConfig, ListConfig)) else node
    return validate_config(raw)


def _is_path(source: str | os.PathLike[str]) -> bool:
    if not isinstance(source, str):
        return True
    return "\n" not in source and (source.endswith((".yaml", ".yml")) or os.path.isfile(source))


def to_yaml(config: StreamKLConfig | Mapping[str, Any]) -> str:
    """The YAML text of a (validated) config; :func:`load_config` reads it back to an equal config.

    Example:
        >>> text = to_yaml(StreamKLConfig(pairs=[LayerPair(teacher=1, student=0)]))
        >>> load_config(text) == validate_config({"pairs": [[1, 0]]})
        True
    """
    return OmegaConf.to_yaml(OmegaConf.structured(validate_config(config)))
