r"""
Options
^^^^^^^

How an option is declared once: a dataclass field made with :func:`option` carries its default and its
:class:`Check`. Everything else is derived from the fields: :func:`check_fields` validates a mapping against them
(the one validation routine of a config), :func:`signature_from_fields` gives a constructor its keyword
parameters (so LightningCLI and ``help()`` see every option), and :func:`read_mapping` reads YAML, mappings,
omegaconf nodes or config instances into a plain mapping. Errors name the option, what was expected and what was
given.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import numbers
import os
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

__all__ = [
    "Check",
    "Choice",
    "Count",
    "Flag",
    "Keywords",
    "LayerRef",
    "Number",
    "Text",
    "check_fields",
    "check_keys",
    "dtype_names",
    "field_check",
    "invalid",
    "option",
    "plain",
    "read_mapping",
    "signature_from_fields",
]


def invalid(where: str, expected: str, got: Any, exc: type[Exception] = ValueError) -> Exception:
    """The error for option ``where``: ``Expected `where` to be <expected>, but got <got>.``

    Example:
        >>> invalid("temperature", "a finite number > 0", -2.0)
        ValueError('Expected `temperature` to be a finite number > 0, but got -2.0.')
    """
    shown = f"{got!r}" if not isinstance(got, (Mapping, list, tuple)) or len(repr(got)) < 80 else type(got).__name__
    return exc(f"Expected `{where}` to be {expected}, but got {shown}.")


def plain(value: Any) -> Any:
    """An omegaconf node as plain Python containers (interpolations resolved); anything else unchanged.

    Example:
        >>> plain(OmegaConf.create({"a": [1, 2]}))
        {'a': [1, 2]}
    """
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


# ---------------------------------------------------------------------------------------------- checks
class Check:
    """Validates and normalises the value of one option; ``optional`` also accepts ``None``.

    Subclasses implement :meth:`check` (``value`` is never ``None`` there) and :attr:`expected`.

    Example:
        >>> Number(low=0.0, inclusive=False)(2, "temperature")
        2.0
    """

    def __init__(self, *, optional: bool = False) -> None:
        self.optional = optional

    @property
    def expected(self) -> str:
        """What a valid value is, in words (used in error messages)."""
        raise NotImplementedError

    def check(self, value: Any, where: str) -> Any:
        """The normalised ``value``; raises :func:`invalid` errors."""
        raise NotImplementedError

    def __call__(self, value: Any, where: str) -> Any:
        if value is None and self.optional:
            return None
        return self.check(value, where)

    def fail(self, where: str, value: Any, exc: type[Exception] = ValueError) -> Exception:
        """:func:`invalid` with this check's :attr:`expected` (and ``or None`` when optional)."""
        return invalid(where, self.expected + (" or None" if self.optional else ""), value, exc)


class Number(Check):
    """A finite real number above ``low`` (``inclusive``: at or above); returned as ``float``.

    Example:
        >>> Number(low=0.0)(-1, "weight")
        Traceback (most recent call last):
        ...
        ValueError: Expected `weight` to be a finite number >= 0, but got -1.0.
    """

    def __init__(self, *, low: float = 0.0, inclusive: bool = True, optional: bool = False) -> None:
        super().__init__(optional=optional)
        self.low, self.inclusive = low, inclusive

    @property
    def expected(self) -> str:
        return f"a finite number {'>=' if self.inclusive else '>'} {self.low:g}"

    def check(self, value: Any, where: str) -> float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise self.fail(where, value, TypeError)
        value = float(value)
        if not math.isfinite(value) or value < self.low or (value == self.low and not self.inclusive):
            raise invalid(where, self.expected, value)
        return value


class Count(Check):
    """An ``int`` at or above ``low``.

    Example:
        >>> Count(low=1, optional=True)(0, "keep")
        Traceback (most recent call last):
        ...
        ValueError: Expected `keep` to be an int >= 1 or None, but got 0.
    """

    def __init__(self, *, low: int = 0, optional: bool = False) -> None:
        super().__init__(optional=optional)
        self.low = low

    @property
    def expected(self) -> str:
        return f"an int >= {self.low}"

    def check(self, value: Any, where: str) -> int:
        integral = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        if not integral or value < self.low:
            raise self.fail(where, value, ValueError if integral else TypeError)
        return int(value)


class Choice(Check):
    """One of ``choices`` (strings).

    Example:
        >>> Choice(("forward", "reverse"))("sideways", "direction")
        Traceback (most recent call last):
        ...
        ValueError: Expected `direction` to be one of ('forward', 'reverse'), but got 'sideways'.
    """

    def __init__(self, choices: Sequence[str], *, optional: bool = False) -> None:
        super().__init__(optional=optional)
        self.choices = tuple(choices)

    @property
    def expected(self) -> str:
        return f"one of {self.choices}"

    def check(self, value: Any, where: str) -> str:
        if value not in self.choices:
            raise self.fail(where, value, ValueError if isinstance(value, str) else TypeError)
        return value


class Flag(Check):
    """A ``bool``.

    Example:
        >>> Flag(optional=True)("yes", "causal")
        Traceback (most recent call last):
        ...
        TypeError: Expected `causal` to be a bool or None, but got 'yes'.
    """

    @property
    def expected(self) -> str:
        return "a bool"

    def check(self, value: Any, where: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(where, value, TypeError)
        return value


class Text(Check):
    """A non-empty string without white space (names, keys, module paths); ``empty=True`` also allows ``""``.

    Example:
        >>> Text()("my kd", "name")
        Traceback (most recent call last):
        ...
        ValueError: Expected `name` to be a non-empty string without spaces, but got 'my kd'.
    """

    def __init__(self, *, empty: bool = False, optional: bool = False, expected: str | None = None) -> None:
        super().__init__(optional=optional)
        self.empty = empty
        self._expected = expected

    @property
    def expected(self) -> str:
        if self._expected is not None:
            return self._expected
        return "a string without spaces" if self.empty else "a non-empty string without spaces"

    def check(self, value: Any, where: str) -> str:
        if not isinstance(value, str) or (not value and not self.empty) or any(c.isspace() for c in value):
            raise self.fail(where, value, ValueError if isinstance(value, str) else TypeError)
        return value


class LayerRef(Check):
    """A layer reference: an index into a model's attention layers (``int``) or a module path (``str``).

    Example:
        >>> LayerRef()("model.layers.3.self_attn", "pairs[0].teacher"), LayerRef()(-1, "pairs[0].student")
        ('model.layers.3.self_attn', -1)
    """

    @property
    def expected(self) -> str:
        return "a layer index (int) or a module path (non-empty str)"

    def check(self, value: Any, where: str) -> int | str:
        if isinstance(value, bool) or not isinstance(value, (numbers.Integral, str)) or value == "":
            raise self.fail(where, value, TypeError)
        return int(value) if isinstance(value, numbers.Integral) else value


class Keywords(Check):
    """A mapping of keyword arguments with string keys (e.g. options passed on to ``from_pretrained``).

    Example:
        >>> Keywords(optional=True)({"revision": "main"}, "teacher_from_pretrained")
        {'revision': 'main'}
    """

    @property
    def expected(self) -> str:
        return "a mapping of keyword arguments (str keys)"

    def check(self, value: Any, where: str) -> dict[str, Any]:
        value = plain(value)
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise self.fail(where, value, TypeError)
        return dict(value)


# ---------------------------------------------------------------------------------------------- declaring
def option(default: Any = dataclasses.MISSING, check: Check | None = None, *,
           factory: Callable[[], Any] | None = None) -> Any:
    """A dataclass field that carries its :class:`Check` (in ``metadata["check"]``): the one declaration of an option.

    Example:
        >>> @dataclasses.dataclass
        ... class Opts:
        ...     temperature: float = option(1.0, Number(low=0.0, inclusive=False))
        >>> check_fields(Opts, {"temperature": 2})
        {'temperature': 2.0}
    """
    if check is None:
        raise TypeError("Expected `check` to be a Check for the option, but got None.")
    metadata = {"check": check}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def field_check(field: dataclasses.Field[Any]) -> Check | None:
    """The :class:`Check` an :func:`option` field carries (``None`` for a plain field).

    Example:
        >>> from lightning_streamkl import StreamKLConfig
        >>> field_check(StreamKLConfig.__dataclass_fields__["direction"]).choices
        ('forward', 'reverse')
    """
    return field.metadata.get("check")


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def check_keys(raw: Mapping[str, Any], cls: type, prefix: str = "", what: str = "StreamKL config") -> None:
    """Reject keys of ``raw`` that are not fields of dataclass ``cls``, naming the closest valid key.

    Example:
        >>> from lightning_streamkl import StreamKLConfig
        >>> check_keys({"temprature": 2}, StreamKLConfig)
        Traceback (most recent call last):
        ...
        ValueError: Unknown key `temprature` in the StreamKL config. Did you mean `temperature`? Valid keys: [...].
    """
    known = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in known:
            near = difflib.get_close_matches(str(key), known, n=1)
            hint = f" Did you mean `{prefix}{near[0]}`?" if near else ""
            raise ValueError(f"Unknown key `{prefix}{key}` in the {what}.{hint} Valid keys: {known}.")


def check_fields(cls: type, raw: Mapping[str, Any], prefix: str = "", what: str = "StreamKL config",
                 ) -> dict[str, Any]:
    """Every field of dataclass ``cls``: the value in ``raw`` (or the default), checked by the field's :class:`Check`.

    Fields without a check are passed through unchanged.

    Raises:
        ValueError: an unknown key (with the closest valid one) or a value out of range.
        TypeError: a value of the wrong type.

    Example:
        >>> from lightning_streamkl import LayerPair
        >>> check_fields(LayerPair, {"teacher": 3, "student": "model.layers.0.self_attn", "weight": 2})["weight"]
        2.0
    """
    check_keys(raw, cls, prefix, what)
    out = {}
    for f in dataclasses.fields(cls):
        value = plain(raw[f.name]) if f.name in raw else _default(f)
        check = field_check(f)
        out[f.name] = check(value, prefix + f.name) if check is not None else value
    return out


def read_mapping(source: Any, cls: type, *, key: str | None = None) -> Mapping[str, Any]:
    """A config as a plain mapping: an instance of ``cls``, a mapping, a ``DictConfig``, YAML text or a YAML path.

    ``key`` selects a dotted sub-section (e.g. ``"model.distillation"``) of a larger YAML document or mapping.

    Example:
        >>> from lightning_streamkl import StreamKLConfig
        >>> dict(read_mapping("a:\\n  temperature: 2", StreamKLConfig, key="a"))
        {'temperature': 2}
    """
    if isinstance(source, cls):
        return {f.name: getattr(source, f.name) for f in dataclasses.fields(cls)}
    if isinstance(source, (str, os.PathLike)):
        node = OmegaConf.load(Path(source)) if _is_path(source) else OmegaConf.create(str(source))
    elif isinstance(source, (Mapping, DictConfig)):
        node = OmegaConf.create(plain(source) if isinstance(source, DictConfig) else dtype_names(dict(source)))
    else:
        raise invalid("config", f"a {cls.__name__}, a mapping of its fields, YAML text or a YAML path", source,
                      TypeError)
    if key is not None:
        selected = OmegaConf.select(node, key)
        if selected is None:
            raise ValueError(f"Expected the config to contain `{key}`, but it has no such key.")
        node = selected
    raw = plain(node)
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise invalid("config", f"a mapping of {cls.__name__} fields", raw, TypeError)
    return raw


def dtype_names(value: Any) -> Any:
    """``value`` with every ``torch.dtype`` in it, at any depth of mappings, lists and tuples, replaced by its name
    (``torch.bfloat16`` becomes ``"bfloat16"``), which omegaconf (and YAML) can hold: options such as
    ``teacher_dtype`` accept a dtype as well as its name.

    Example:
        >>> import torch
        >>> dtype_names({"teacher_dtype": torch.bfloat16, "teacher_from_pretrained": {"dtype": torch.float16}})
        {'teacher_dtype': 'bfloat16', 'teacher_from_pretrained': {'dtype': 'float16'}}
    """
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, Mapping) and not isinstance(value, DictConfig):
        return {k: dtype_names(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(dtype_names(v) for v in value) if not hasattr(value, "_fields") else value
    return value


def _is_path(source: str | os.PathLike[str]) -> bool:
    if not isinstance(source, str):
        return True
    return "\n" not in source and (source.endswith((".yaml", ".yml")) or os.path.isfile(source))


# ---------------------------------------------------------------------------------------------- signatures
def signature_from_fields(cls: type, *, skip: Sequence[str] = (),
                          annotations: Mapping[str, Any] | None = None) -> Callable[[Callable[..., Any]], Any]:
    """Decorate ``__init__(self, <own parameters>, **options)``: its signature gains one keyword parameter per
    field of dataclass ``cls`` (except ``skip``), with the field's type and default, before ``**options``
    (which is then dropped from the signature). LightningCLI/jsonargparse, ``help()`` and
    ``inspect.signature`` see every option; the body receives them in ``options``.

    ``annotations`` replaces the annotation of some parameters (e.g. a weight that may also be a function).

    Example:
        >>> @dataclasses.dataclass
        ... class Opts:
        ...     weight: float = option(1.0, Number())
        >>> class Thing:
        ...     @signature_from_fields(Opts)
        ...     def __init__(self, name: str, **options: Any) -> None:
        ...         self.options = check_fields(Opts, options)
        >>> inspect.signature(Thing)
        <Signature (name: str, *, weight: float = 1.0)>
        >>> Thing("a", weight=2).options
        {'weight': 2.0}
    """

    def decorate(init: Callable[..., Any]) -> Callable[..., Any]:
        resolved = typing.get_type_hints(init)
        own = [p.replace(annotation=resolved.get(p.name, p.annotation))
               for p in inspect.signature(init).parameters.values() if p.kind is not p.VAR_KEYWORD]
        positional = [p for p in own if p.kind is not p.KEYWORD_ONLY]
        keyword = [p for p in own if p.kind is p.KEYWORD_ONLY]
        hints = typing.get_type_hints(cls)
        hints.update(annotations or {})
        derived = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=_default(f),
                                     annotation=hints[f.name])
                   for f in dataclasses.fields(cls) if f.name not in skip and f.name not in {p.name for p in own}]
        init.__signature__ = inspect.Signature([*positional, *derived, *keyword])  # type: ignore[attr-defined]
        return init

    return decorate

