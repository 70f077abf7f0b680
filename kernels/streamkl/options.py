r"""
Options
^^^^^^^

The keyword options of :func:`streamkl.attention_kl`, defined once: :class:`AttentionKLOptions`, a frozen dataclass
whose fields are the op's keywords, with their defaults, types and checks. Everything that takes the options reads it:

* :func:`streamkl.attention_kl` takes every field as a keyword (or an ``options=`` instance plus keywords that
  replace its fields);
* :func:`streamkl.naive_attention_kl`, the oracle, takes the fields that define the result (:data:`PROBLEM` and
  :data:`BATCH`), not those that choose how it runs (:data:`EXECUTION`);
* :class:`streamkl.AttentionKLLoss` takes :data:`PROBLEM` and :data:`EXECUTION` fields in its constructor and the
  :data:`BATCH` ones (masks, sinks, packed offsets) in ``forward``;
* the Lightning loss builds one per term (``lightning_streamkl.terms.TermCall``).

Their signatures are derived from the fields (:func:`keyword_signature`), so ``help()`` and ``inspect.signature``
list every option. A bad value fails when the options are made, with a message that names the argument.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ._constants import BACKENDS, DIRECTIONS, LAYOUTS, REDUCTIONS
from ._validation import (
    FLOAT32_TINY,
    check_choice,
    check_flag,
    check_scale,
    check_softcap,
    check_temperature,
    check_window,
)

__all__ = ["BACKENDS", "BATCH", "DIRECTIONS", "EXECUTION", "LAYOUTS", "PROBLEM", "REDUCTIONS", "AttentionKLOptions",
           "KLWithCount", "keyword_signature", "option_names"]

#: Options that define the distributions and the result: the op, the oracle and the module's constructor take them.
PROBLEM = "problem"
#: Per-batch tensors and sizes (masks, sinks, packed offsets): the op, the oracle and the module's ``forward``.
BATCH = "batch"
#: How the op runs (backend, product precision, determinism, input checks): the op and the module's constructor.
EXECUTION = "execution"


_P, _B, _E = ({"kind": kind} for kind in (PROBLEM, BATCH, EXECUTION))


@dataclass(frozen=True)
class AttentionKLOptions:
    """Every keyword option of :func:`streamkl.attention_kl` (see its Args for what each one means), checked when made.

    Numbers are normalised (``temperature``, scales and soft-caps to float, ``window`` to a tuple); tensors are kept
    as given and checked against the inputs when the op runs.

    Example:
        >>> options = AttentionKLOptions(causal=True, temperature=2)
        >>> options.temperature, options.reduction
        (2.0, 'mean')
        >>> AttentionKLOptions(direction="sideways")
        Traceback (most recent call last):
        ...
        ValueError: Expected argument `direction` to be one of ['forward', 'reverse'], but got 'sideways'.
    """

    causal: bool = field(default=False, metadata=_P)
    scale_t: float | None = field(default=None, metadata=_P)
    scale_s: float | None = field(default=None, metadata=_P)
    temperature: float = field(default=1.0, metadata=_P)
    direction: str = field(default="forward", metadata=_P)
    reduction: str = field(default="mean", metadata=_P)
    key_padding_mask: torch.Tensor | None = field(default=None, metadata=_B)
    query_mask: torch.Tensor | None = field(default=None, metadata=_B)
    layout: str = field(default="bhnd", metadata=_P)
    backend: str = field(default="auto", metadata=_E)
    window: tuple[int, int] | None = field(default=None, metadata=_P)
    softcap_t: float | None = field(default=None, metadata=_P)
    softcap_s: float | None = field(default=None, metadata=_P)
    sinks_t: torch.Tensor | None = field(default=None, metadata=_B)
    sinks_s: torch.Tensor | None = field(default=None, metadata=_B)
    cu_seqlens_q: torch.Tensor | None = field(default=None, metadata=_B)
    cu_seqlens_k: torch.Tensor | None = field(default=None, metadata=_B)
    max_seqlen_q: int | None = field(default=None, metadata=_B)
    max_seqlen_k: int | None = field(default=None, metadata=_B)
    attn_mask: torch.Tensor | None = field(default=None, metadata=_B)
    allow_tf32: bool | None = field(default=None, metadata=_E)
    deterministic: bool = field(default=True, metadata=_E)
    check_finite: bool = field(default=False, metadata=_E)
    return_count: bool = field(default=False, metadata=_P)

    def __post_init__(self) -> None:
        # each check runs its helper (which raises with the argument's name, or normalises) only when the value is
        # not already canonical: this runs on every call of the op
        if type(self.causal) is not bool:
            check_flag("causal", self.causal)
        for name in ("scale_t", "scale_s"):
            if getattr(self, name) is not None:
                self._normalise(name, check_scale(name, getattr(self, name)))
        if type(self.temperature) is not float or not FLOAT32_TINY <= self.temperature < math.inf:  # else: checked
            self._normalise("temperature", check_temperature(self.temperature))
        if self.direction not in DIRECTIONS or type(self.direction) is not str:
            check_choice("direction", self.direction, DIRECTIONS)
        if self.reduction not in REDUCTIONS or type(self.reduction) is not str:
            check_choice("reduction", self.reduction, REDUCTIONS)
        if self.layout not in LAYOUTS or type(self.layout) is not str:
            check_choice("layout", self.layout, LAYOUTS)
        if self.backend not in BACKENDS or type(self.backend) is not str:
            check_choice("backend", self.backend, BACKENDS)
        if self.window is not None:
            self._normalise("window", check_window(self.window))
        for name in ("softcap_t", "softcap_s"):
            if getattr(self, name) is not None:
                self._normalise(name, check_softcap(name, getattr(self, name)))
        if self.allow_tf32 is not None and type(self.allow_tf32) is not bool:
            raise TypeError(
                f"Expected argument `allow_tf32` to be None or a bool, but got {type(self.allow_tf32).__name__}."
            )
        for name in ("deterministic", "check_finite", "return_count"):
            if type(getattr(self, name)) is not bool:
                check_flag(name, getattr(self, name))

    def _normalise(self, name: str, value: Any) -> None:
        """Replace a field by its normalised value (a float for an int, a tuple for a list) where they differ."""
        current = getattr(self, name)
        if type(current) is not type(value) or current != value:
            object.__setattr__(self, name, value)

    @classmethod
    def of(cls, caller: str, options: AttentionKLOptions | None, keywords: Mapping[str, Any],
           kinds: Iterable[str] = (PROBLEM, BATCH, EXECUTION)) -> AttentionKLOptions:
        """``options`` (default: all defaults) with ``keywords`` replacing its fields, for ``caller`` (a function name
        for the messages), which takes the fields of ``kinds``.

        Raises:
            TypeError: a keyword that is no field of ``kinds`` (as Python names an unexpected keyword argument), or
                ``options`` that is not an :class:`AttentionKLOptions`.

        Example:
            >>> AttentionKLOptions.of("f", AttentionKLOptions(causal=True), {"temperature": 2.0}).causal
            True
            >>> AttentionKLOptions.of("f", None, {"backend": "triton"}, kinds=(PROBLEM,))
            Traceback (most recent call last):
            ...
            TypeError: f() got an unexpected keyword argument 'backend'
        """
        allowed = _NAMES[tuple(kinds)] if tuple(kinds) in _NAMES else option_names(*kinds)
        unknown = [name for name in keywords if name not in allowed]
        if unknown:
            raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
        if options is not None and not isinstance(options, cls):
            raise TypeError(
                f"Expected argument `options` to be None or an AttentionKLOptions, but got {type(options).__name__}."
            )
        base = _DEFAULT if options is None else options
        if not keywords:
            return base
        if torch.compiler.is_compiling():
            return dataclasses.replace(base, **keywords)
        # the dataclass's frozen __init__ sets every field through object.__setattr__ (tens of microseconds per call
        # for 24 fields): fill a new instance's __dict__ directly, then check it as __init__ would
        made = cls.__new__(cls)
        made.__dict__.update(base.__dict__)
        made.__dict__.update(keywords)
        made.__post_init__()
        return made

    def values(self, *kinds: str) -> dict[str, Any]:
        """The fields of ``kinds`` (all by default) as keyword arguments (tensors as they are, never copied).

        Example:
            >>> AttentionKLOptions(causal=True).values(EXECUTION)
            {'backend': 'auto', 'allow_tf32': None, 'deterministic': True, 'check_finite': False}
        """
        return {name: getattr(self, name) for name in option_names(*kinds)}


class KLWithCount(NamedTuple):
    """What :func:`streamkl.attention_kl` returns with ``return_count=True``: the result of the reduction and the
    number of counted rows (the mean's denominator: rows with at least one allowed key that ``query_mask`` keeps,
    every head counted), a float32 scalar on the inputs' device, never differentiable.

    Example:
        >>> import streamkl
        >>> q = torch.randn(1, 2, 3, 8)
        >>> out = streamkl.attention_kl(q, q, q, q, causal=True, reduction="sum", return_count=True)
        >>> float(out.kl), float(out.rows)
        (0.0, 6.0)
    """

    kl: torch.Tensor
    rows: torch.Tensor


def option_names(*kinds: str) -> tuple[str, ...]:
    """The names of the fields of ``kinds`` (all by default), in declaration order.

    Example:
        >>> option_names(EXECUTION)
        ('backend', 'allow_tf32', 'deterministic', 'check_finite')
    """
    kinds = kinds or (PROBLEM, BATCH, EXECUTION)
    return tuple(f.name for f in dataclasses.fields(AttentionKLOptions) if f.metadata["kind"] in kinds)


def keyword_signature(fn: Callable[..., Any], kinds: Iterable[str], *, skip: Iterable[str] = ()) -> inspect.Signature:
    """The signature of ``fn`` (written as ``fn(..., **options)``) with its ``**options`` replaced by the fields of
    ``kinds`` as keyword-only parameters (less ``skip``), their defaults and annotations: what ``help(fn)`` and
    ``inspect.signature(fn)`` then show.

    Example:
        >>> def f(x, *, options=None, **kwargs): ...
        >>> list(keyword_signature(f, (EXECUTION,)).parameters)
        ['x', 'options', 'backend', 'allow_tf32', 'deterministic', 'check_finite']
        >>> keyword_signature(f, (EXECUTION,)).parameters["backend"].default
        'auto'
    """
    skip = set(skip)
    own = [p for p in inspect.signature(fn).parameters.values() if p.kind != inspect.Parameter.VAR_KEYWORD]
    taken = {p.name for p in own}
    fields = {f.name: f for f in dataclasses.fields(AttentionKLOptions)}
    extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=fields[name].default,
                               annotation=fields[name].type)
             for name in option_names(*kinds) if name not in skip and name not in taken]
    return inspect.signature(fn).replace(parameters=[*own, *extra])


_DEFAULT = AttentionKLOptions()
_NAMES = {kinds: frozenset(option_names(*kinds)) for kinds in ((PROBLEM, BATCH, EXECUTION), (PROBLEM, BATCH),
                                                                (PROBLEM, EXECUTION), (BATCH,))}
