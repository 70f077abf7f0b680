r"""
Attention capture
^^^^^^^^^^^^^^^^^

The base class every adapter subclasses: it records the queries and keys of selected attention layers of one
model while a :meth:`AttentionCapture.recording` block runs, and holds nothing else (no attention maps).

An adapter implements one method, :meth:`AttentionCapture.find_layers` (the ordered module paths it can
capture), and installs whatever hooks it needs in :meth:`~AttentionCapture._attach` /
:meth:`~AttentionCapture._detach`; it hands each layer's tensors to :meth:`AttentionCapture.record`.
"""

from __future__ import annotations

import difflib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from streamkl.precision import cast_for_autocast

from .masks import KeyRows, Masking, PackedSequences

log = logging.getLogger(__name__)

#: The captures whose :meth:`AttentionCapture.recording` block is open, innermost last. Module-level
#: :func:`lightning_streamkl.capture.record` calls go to these.
_RECORDING: list[AttentionCapture] = []


@dataclass
class CapturedAttention:
    """One attention call, in the form :func:`streamkl.attention_kl` takes: queries, keys and everything that decides
    the layer's distribution (its scale, soft-cap, sinks and the call's complete mask).

    Attributes:
        q: queries ``[B, H, N_q, D]`` as the attention computed them (after RoPE, if any).
        k: keys ``[B, H_k, N_k, D]`` before any GQA repetition (``H`` divisible by ``H_k``).
        scale: the score scale the layer used; ``None`` means ``1 / sqrt(D)``.
        causal: whether the layer masks future keys; ``None`` when the adapter cannot tell.
        key_padding_mask: ``[B, N_k]`` bool, True for real keys. ``None``: no key padding when ``masks_from_call``,
            else the batch's padding mask.
        exact: False when the adapter could not express the layer's distribution (the loss refuses such a record;
            the adapters of this package refuse the layer when it is recorded instead).
        note: why ``exact`` is False.
        layer_idx: the layer's ``layer_idx`` when the module has one (Hugging Face attention modules).
        v: values ``[B, H_k, N_k, D_v]`` (before GQA repetition), only when the capture was asked for them
            (``capture_values=True``; MiniLM-v2's ``"vv"`` relation needs them).
        window: ``(left, right)`` sliding window (flash-attn convention, −1 unbounded), or ``None``.
        softcap: the logit soft-cap (Gemma 2), or ``None``.
        sinks: ``[H]`` sink logits (gpt-oss), or ``None``.
        attn_mask: ``[B|1, H|1, N_q, N_k]`` bool, True = allowed: the call's mask when no structured option
            describes it (it then holds the padding too), or ``None``.
        query_mask: ``[B, N_q]`` bool, True = a real query token (self-attention), or ``None``.
        packed: the call's packed sequences (:class:`~lightning_streamkl.capture.masks.PackedSequences`), or
            ``None``.
        masks_from_call: True when the fields above are the call's complete mask; False (the manual recorder):
            the batch's padding mask fills in ``key_padding_mask`` and the query mask.
        key_rows: ``key_padding_mask``'s rows as the capture read them on the host
            (:class:`~lightning_streamkl.capture.masks.KeyRows`), or ``None``.

    Example:
        >>> record = CapturedAttention(torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), causal=True)
        >>> record.q.shape[1] // record.k.shape[1], record.exact, record.window
        (2, True, None)
    """

    q: torch.Tensor
    k: torch.Tensor
    scale: float | None = None
    causal: bool | None = None
    key_padding_mask: torch.Tensor | None = None
    exact: bool = True
    note: str | None = None
    layer_idx: int | None = None
    v: torch.Tensor | None = None
    window: tuple[int, int] | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    attn_mask: torch.Tensor | None = None
    query_mask: torch.Tensor | None = None
    packed: PackedSequences | None = None
    masks_from_call: bool = False
    key_rows: KeyRows | None = None

    def masking(self) -> Masking:
        """The mask fields as one :class:`~lightning_streamkl.capture.masks.Masking`."""
        return Masking(self.causal, self.window, self.key_padding_mask, self.query_mask, self.packed, self.attn_mask,
                       self.key_rows)


#: What the captures find by themselves, for messages about a model where none was found.
SUPPORTED_LAYERS = ("Hugging Face models whose attention goes through the attention interface "
                    "(ALL_ATTENTION_FUNCTIONS), nn.MultiheadAttention, and layers that call "
                    "lightning_streamkl.capture.record(...) (address those by module path)")


#: The attributes under which FSDP (``FullyShardedDataParallel``), activation checkpointing and ``torch.compile``
#: hold the module they wrap.
WRAPPER_ATTRIBUTES = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def unwrapped_path(path: str) -> str:
    """A module path with the wrappers' attributes left out: the path in the unwrapped model.

    Example:
        >>> unwrapped_path("model.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.self_attn")
        'model.layers.0.self_attn'
    """
    return ".".join(part for part in path.split(".") if part not in WRAPPER_ATTRIBUTES)


def is_recording() -> bool:
    """True while any capture's :meth:`AttentionCapture.recording` block is open (e.g. inside a distilled step).

    Example:
        >>> is_recording()
        False
    """
    return bool(_RECORDING)


def closest(name: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """The up-to-``n`` closest names in ``choices`` (difflib), for "did you mean" messages.

    Example:
        >>> closest("model.layer.1.self_attn", ["model.layers.0.self_attn", "model.layers.1.self_attn"], n=1)
        ['model.layers.1.self_attn']
    """
    return difflib.get_close_matches(str(name), list(choices), n=n, cutoff=0.4)


class AttentionCapture(ABC):
    """Record ``(q, k)`` of selected attention layers of ``model`` while :meth:`recording` is open.

    Subclasses implement :meth:`find_layers` and, when they need hooks, :meth:`_attach`/:meth:`_detach`
    (called when the outermost :meth:`recording` block opens and closes). Captured tensors stay in
    :attr:`records` until :meth:`pop` or :meth:`clear`; callers release them every step.

    Args:
        model: the module whose attention layers are captured; layer paths are relative to it.
        exclude: submodules of ``model`` to ignore (e.g. a teacher stored inside the student's
            LightningModule), with everything below them.
        capture_values: also record the value tensors (``CapturedAttention.v``), e.g. for MiniLM-v2's value
            relation (``"vv"``); off by default, so only queries and keys are held.

    Attributes:
        records: ``{layer path: CapturedAttention}`` of the layers recorded since the last :meth:`pop`.
        selected: the layer paths to record, or ``None`` for every layer.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from lightning_streamkl.capture import RecorderCapture, record
        >>> capture = RecorderCapture(nn.Identity(), names=["attn0"])
        >>> with capture.recording():
        ...     record("attn0", torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), causal=True)
        >>> sorted(capture.pop()), capture.records
        (['attn0'], {})
    """

    #: Short name used in messages ("hf", "mha", "recorder").
    kind: str = "custom"

    def __init__(self, model: nn.Module, *, exclude: Iterable[nn.Module] = (), capture_values: bool = False) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Expected argument `model` to be a torch.nn.Module, but got {type(model).__name__}.")
        if not isinstance(capture_values, bool):
            raise TypeError(
                f"Expected argument `capture_values` to be a bool, but got {type(capture_values).__name__}."
            )
        self.model = model
        self.capture_values = capture_values
        self._exclude_ids = {id(m) for m in exclude if m is not model}
        self._records: dict[str, CapturedAttention] = {}
        self._taken: set[str] = set()
        self._take: Callable[[str, CapturedAttention], bool] | None = None
        self.selected: set[str] | None = None
        self._depth = 0
        self._paths: dict[int, str] | None = None
        self._by_path: dict[str, nn.Module] | None = None
        self._layers: list[str] | None = None

    # ---------------------------------------------------------------- what subclasses provide
    @abstractmethod
    def find_layers(self) -> list[str]:
        """The module paths of the attention layers this adapter captures, in module order."""

    def _attach(self) -> None:  # noqa: B027 - optional hook
        """Install hooks; called when the outermost :meth:`recording` block opens."""

    def _detach(self) -> None:  # noqa: B027 - optional hook
        """Remove what :meth:`_attach` installed; called when the outermost block closes (also on error)."""

    def _settle(self) -> None:  # noqa: B027 - optional hook
        """Turn the calls that ``torch.compile`` traced while recording into records; called before the records are
        read and before the outermost block closes."""

    @property
    def records(self) -> dict[str, CapturedAttention]:
        """The recorded calls by layer path (each layer's last call)."""
        self._settle()
        return self._records

    @records.setter
    def records(self, records: dict[str, CapturedAttention]) -> None:
        self._records = records

    @property
    def recorded(self) -> set[str]:
        """The layers recorded since the last :meth:`pop` or :meth:`clear`: those in :attr:`records` and those whose
        record was taken when it was made (:meth:`handing_over`)."""
        return self.records.keys() | self._taken

    # ---------------------------------------------------------------- layers
    def named_modules(self) -> Iterator[tuple[str, nn.Module]]:
        """``model.named_modules()`` without the excluded subtrees, named as in the unwrapped model.

        A module wrapped by FSDP (``FullyShardedDataParallel``), activation checkpointing or ``torch.compile`` is
        listed once, under its own path: the wrapper is skipped and the wrapper's attribute (``_fsdp_wrapped_module``,
        ``_checkpoint_wrapped_module``, ``_orig_mod``) is left out of the paths, so layer paths are the same before
        and after a strategy wraps the model (:func:`unwrapped_path`).
        """
        skip: list[str] = []
        for name, module in self.model.named_modules():
            if any(name == s or name.startswith(s + ".") for s in skip):
                continue
            if id(module) in self._exclude_ids:
                skip.append(name)
                continue
            if any(w in module._modules for w in WRAPPER_ATTRIBUTES):
                continue
            yield unwrapped_path(name), module

    def layer_names(self) -> list[str]:
        """:meth:`find_layers`, computed once."""
        if self._layers is None:
            self._layers = list(self.find_layers())
        return self._layers

    def module_path(self, module: nn.Module) -> str | None:
        """The path of ``module`` inside the captured model, or ``None`` when it is not part of it."""
        if self._paths is None:
            self._index()
        return self._paths.get(id(module))  # type: ignore[union-attr]

    def modules_at(self, paths: Iterable[str]) -> list[nn.Module]:
        """The modules at ``paths`` (as :meth:`named_modules` names them), looked up in an index built once: walking
        a large model's modules every step cost milliseconds of host time per step and model."""
        if self._by_path is None:
            self._index()
        return [self._by_path[p] for p in paths]  # type: ignore[index]

    def _index(self) -> None:
        named = list(self.named_modules())
        self._by_path = dict(named)
        self._paths = {id(m): name for name, m in named}

    def resolve(self, layer: str | int, *, role: str = "layer") -> str:
        """Map a layer reference (module path, or index into :meth:`layer_names`, negative from the end).

        Raises:
            ValueError: an unknown path (the message lists the closest layer names) or an index out of range.
        """
        names = self.layer_names()
        if isinstance(layer, int) and not isinstance(layer, bool):
            if not names:
                raise ValueError(
                    f"The {role} {layer} is an index, but no attention layers were found in "
                    f"{type(self.model).__name__} (the {self.kind!r} capture); supported: {SUPPORTED_LAYERS}."
                )
            if not -len(names) <= layer < len(names):
                raise ValueError(
                    f"The {role} index {layer} is out of range: {type(self.model).__name__} has {len(names)} "
                    f"attention layers ({self.kind!r} capture): {names}."
                )
            return names[layer]
        if layer in names:
            return layer
        near = closest(layer, names)
        hint = f" Closest: {near}." if near else ""
        raise ValueError(
            f"Unknown {role}: {type(self.model).__name__} has no attention layer {layer!r} "
            f"(the {self.kind!r} capture found {len(names)}: {_abbrev(names)}).{hint}"
        )

    def select(self, names: Iterable[str] | None) -> None:
        """Record only these layer paths (``None``: all)."""
        self.selected = None if names is None else set(names)

    # ---------------------------------------------------------------- recording
    def record(
        self,
        name: str,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        scale: float | None = None,
        causal: bool | None = None,
        key_padding_mask: torch.Tensor | None = None,
        exact: bool = True,
        note: str | None = None,
        layer_idx: int | None = None,
        v: torch.Tensor | None = None,
        window: tuple[int, int] | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        query_mask: torch.Tensor | None = None,
        packed: PackedSequences | None = None,
        masks_from_call: bool = False,
        key_rows: KeyRows | None = None,
    ) -> None:
        """Store the call of layer ``name`` (ignored when the layer is not selected); see :class:`CapturedAttention`.

        ``v`` is kept only when the capture was made with ``capture_values=True``. A layer that runs twice in one
        recording (a module reused across depths) keeps its last call.

        Under autocast, ``q``, ``k`` and ``v`` are kept in the autocast dtype of their device (a differentiable
        cast), as ``F.scaled_dot_product_attention`` and flash-attention receive them: under ``bf16-mixed`` a Llama
        layer's queries leave the rotary embedding in float32 (its fp32 ``cos``/``sin`` promote them), but its
        attention computes in bf16, and so does the KL of its record.
        """
        if self.selected is not None and name not in self.selected:
            return
        with torch.enable_grad():  # (the cast of a reentrant checkpoint's leaf copies, made under no_grad, too)
            q, k, v = cast_for_autocast(q, k, v)
        record = CapturedAttention(
            q, k, scale, causal, key_padding_mask, exact, note, layer_idx, v if self.capture_values else None,
            window, softcap, sinks, attn_mask, query_mask, packed, masks_from_call, key_rows)
        if self._take is not None and self._take(name, record):
            self._records.pop(name, None)
            self._taken.add(name)
            return
        self._records[name] = record

    @contextmanager
    def handing_over(self, take: Callable[[str, CapturedAttention], bool]) -> Iterator[None]:
        """Inside the block, offer every record to ``take(name, record)`` as it is made: a record ``take`` returns
        True for is not kept (its tensors are free once ``take`` drops them), and :attr:`recorded` still names its
        layer. The engine takes each pair's loss this way while the teacher runs.

        Example:
            >>> from lightning_streamkl.capture import RecorderCapture, record
            >>> capture, seen = RecorderCapture(nn.Identity(), names=["a", "b"]), []
            >>> with capture.recording(), capture.handing_over(lambda name, rec: seen.append(name) or name == "a"):
            ...     record("a", torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4), causal=True)
            ...     record("b", torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4), causal=True)
            >>> seen, sorted(capture.records), sorted(capture.recorded)
            (['a', 'b'], ['b'], ['a', 'b'])
        """
        previous, self._take = self._take, take
        try:
            yield
        finally:
            self._take = previous

    @property
    def is_recording(self) -> bool:
        """True while a :meth:`recording` block is open."""
        return self._depth > 0

    @contextmanager
    def recording(self) -> Iterator[AttentionCapture]:
        """Capture the layers' ``(q, k)`` for the forward passes run inside the block (re-entrant)."""
        if self._depth == 0:
            self._attach()
        self._depth += 1
        _RECORDING.append(self)
        try:
            yield self
        finally:
            if self._depth == 1:
                self._settle()
            # remove this instance (the innermost occurrence), even if blocks close out of order
            for i in range(len(_RECORDING) - 1, -1, -1):
                if _RECORDING[i] is self:
                    del _RECORDING[i]
                    break
            self._depth -= 1
            if self._depth == 0:
                self._detach()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Stop recording inside the block (e.g. while a teacher runs in the middle of a student step)."""
        depth = self._depth
        if depth == 0:
            yield
            return
        self._settle()
        _RECORDING[:] = [c for c in _RECORDING if c is not self]
        self._depth = 0
        self._detach()
        try:
            yield
        finally:
            self._attach()
            self._depth = depth
            _RECORDING.extend([self] * depth)

    def pop(self) -> dict[str, CapturedAttention]:
        """Hand over the records and forget them."""
        records, self._records = self.records, {}
        self._taken = set()
        return records

    def clear(self) -> None:
        """Drop every record (releases the captured tensors)."""
        self._settle()
        self._records = {}
        self._taken = set()

    def discard(self, name: str) -> None:
        """Drop layer ``name``'s record (its tensors are free once nothing else holds them); it still counts as
        :attr:`recorded`."""
        if self.records.pop(name, None) is not None:
            self._taken.add(name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model={type(self.model).__name__}, layers={len(self.layer_names())})"


def _abbrev(names: list[str], n: int = 6) -> str:
    return str(names) if len(names) <= n else str(names[:n])[:-1] + f", ... ({len(names) - n} more)]"
