# ruff: noqa: UP045  - omegaconf < 2.4 reads typing.Optional, not `X | None`, in structured configs
r"""
Continual configuration
^^^^^^^^^^^^^^^^^^^^^^^

:class:`ContinualConfig`, every option of :class:`~lightning_streamkl.ContinualAttentionRegularizer`: the
attention-KL options it shares with :class:`~lightning_streamkl.StreamKLConfig` (inherited from
:class:`~lightning_streamkl.AttentionKLOptions`, so declared and checked once) and its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import DictConfig

from ..capture import CAPTURE_KINDS
from ..config import AttentionKLOptions
from ..options import Check, Choice, Count, Flag, LayerRef, Number, Text, check_fields, option, read_mapping

__all__ = ["REFERENCES", "SNAPSHOT_DEVICES", "ContinualConfig", "validate_continual_config"]

SNAPSHOT_DEVICES = ("same", "cpu")
#: What the model is regularised toward: its own snapshots (copies), or itself with its adapters switched off.
REFERENCES = ("snapshots", "adapters_off")


class _Weights(Check):
    """A non-empty list of numbers ``>= 0``, in the order ``order`` says (shown in the error)."""

    def __init__(self, order: str = "newest snapshot first", *, optional: bool = False) -> None:
        super().__init__(optional=optional)
        self.order = order

    @property
    def expected(self) -> str:
        return f"a non-empty list of numbers >= 0 ({self.order})"

    def check(self, value: Any, where: str) -> list[float]:
        if not isinstance(value, (list, tuple)) or not value:
            raise self.fail(where, value, TypeError)
        return [Number(low=0.0)(w, f"{where}[{i}]") for i, w in enumerate(value)]


class _Layers(Check):
    """A non-empty list of layer references, each named once (a single one is taken as a list of one)."""

    @property
    def expected(self) -> str:
        return "a non-empty list of layer indices or module paths"

    def check(self, value: Any, where: str) -> list[int | str]:
        if isinstance(value, (int, str)):
            value = [value]
        if not isinstance(value, (list, tuple)) or not value:
            raise self.fail(where, value, TypeError)
        layers = [LayerRef()(x, f"{where}[{i}]") for i, x in enumerate(value)]
        if len(set(map(repr, layers))) != len(layers):
            raise ValueError(f"Expected `{where}` to name each layer once, but got {layers}.")
        return layers


@dataclass
class ContinualConfig(AttentionKLOptions):
    """Every option of :class:`~lightning_streamkl.ContinualAttentionRegularizer` (an omegaconf structured config).

    The options of :class:`~lightning_streamkl.AttentionKLOptions` (``direction="forward"`` is
    KL(snapshot‖model); ``weight`` multiplies the regularisation term, and the callback also takes a function
    ``weight(task, step)`` where a config holds a number; ``warmup_steps`` ramps it at the start of every task),
    and:

    Args:
        name: the log namespace (``train/<name>/...``) and the checkpoint state key. Default: ``"continual_kl"``.
        keep: how many snapshots to keep, the newest ones; ``None`` keeps one per finished task. Default: ``1``.
        snapshot_weights: with several snapshots, the weight of each, newest first (``len == keep``); ``None``
            weighs the kept snapshots equally (their mean). Default: ``None``.
        snapshot_device: ``"same"`` keeps the snapshots on the model's device; ``"cpu"`` keeps them in host
            memory (pinned when CUDA is available) and streams them to the device for the snapshot's forward pass of
            every step one block at a time, as :class:`~lightning_streamkl.StreamKLConfig`'s
            ``teacher_device="offload"`` does a teacher. Default: ``"same"``.
        layers: the attention layers to regularise: indices into the model's attention layers (negative from
            the end) or module paths (relative to the LightningModule or to ``module``); ``None``: every
            attention layer. Each layer is paired with the same layer of the snapshot. Default: ``None``.
        layer_weights: the relative weight of each regularised layer, in the order of ``layers`` (or of the
            model's attention layers when ``layers`` is ``None``); normalised to sum to 1, so ``weight`` keeps its
            meaning. A layer of weight 0 is not regularised (nor captured). ``None``: equal weights (the mean over
            layers). Default: ``None``.
        module: the submodule of the LightningModule that is copied and run as the snapshot (a dotted path;
            ``""`` for the whole LightningModule, which then needs a ``forward``). ``None``: the child module
            that holds every selected attention layer (e.g. ``model`` for ``self.model = AutoModel...``), else
            the whole LightningModule if it defines ``forward``. A snapshot of a submodule is fed exactly the
            inputs that submodule receives in the step (after any embedding or projection the LightningModule
            applies first); a snapshot of the whole LightningModule is run on the batch. Default: ``None``.
        snapshot_trim: drop the weights of the snapshot's modules that do not run before its deepest regularised
            layer (an output head, the layers after it). The snapshot's forward pass stops at that layer
            (``teacher_early_exit``); the modules its first pass did not enter are found then, and their
            tensors (unless shared with a module that ran) are replaced by empty ones, so the snapshot holds
            only what it computes with. Calling a dropped module later is an error that names it. ``False``
            keeps the whole copy. Default: ``True``.
        snapshot_on_fit_end: take a snapshot when a ``trainer.fit`` call finishes (one fit per task). With
            ``False``, only :meth:`~lightning_streamkl.ContinualAttentionRegularizer.snapshot` takes them.
            Default: ``True``.
        capture: how to capture both models: ``"auto"``, ``"hf"``, ``"mha"`` or ``"recorder"``. Default:
            ``"auto"``.
        reference: what the model is regularised toward: ``"snapshots"``, the frozen copies taken at task
            boundaries; ``"adapters_off"``, the model itself with its adapters (LoRA, ...) switched off, i.e. the
            pretrained base of a fine-tune, from the first step on and without a copy in memory
            (:class:`~lightning_streamkl.teacher.AdaptersOff`; ``module`` names the adapter-carrying submodule, found
            when ``None``; no snapshots are taken). Default: ``"snapshots"``.

    Example:
        >>> ContinualConfig().name, ContinualConfig(keep=None).keep
        ('continual_kl', None)
    """

    name: str = option("continual_kl", Text())
    keep: Optional[int] = option(1, Count(low=1, optional=True))
    snapshot_weights: Optional[list[float]] = option(None, _Weights(optional=True))
    snapshot_device: str = option("same", Choice(SNAPSHOT_DEVICES))
    layers: Optional[list[Any]] = option(None, _Layers(optional=True))
    layer_weights: Optional[list[float]] = option(None, _Weights("one per regularised layer", optional=True))
    module: Optional[str] = option(None, Text(empty=True, optional=True, expected="a dotted submodule path ('' for "
                                                                                  "the whole LightningModule)"))
    snapshot_trim: bool = option(True, Flag())
    snapshot_on_fit_end: bool = option(True, Flag())
    capture: str = option("auto", Choice(CAPTURE_KINDS))
    reference: str = option("snapshots", Choice(REFERENCES))


def validate_continual_config(config: ContinualConfig | Mapping[str, Any] | DictConfig | str) -> ContinualConfig:
    """Check every option and return a normalised :class:`ContinualConfig`.

    ``config`` may also be YAML text or the path of a YAML file. The options shared with
    :class:`~lightning_streamkl.StreamKLConfig` are declared once (in :class:`~lightning_streamkl.AttentionKLOptions`),
    so they fail with the same messages.

    Raises:
        ValueError: an unknown key (with the closest valid one) or a value out of range.
        TypeError: a value of the wrong type.

    Example:
        >>> cfg = validate_continual_config({"keep": 2, "snapshot_weights": [0.7, 0.3], "layers": [-1]})
        >>> cfg.keep, cfg.snapshot_weights, cfg.layers
        (2, [0.7, 0.3], [-1])
        >>> validate_continual_config("keep: 0")
        Traceback (most recent call last):
        ...
        ValueError: Expected `keep` to be an int >= 1 or None, but got 0.
    """
    values = check_fields(ContinualConfig, read_mapping(config, ContinualConfig), what="continual config")
    keep, weights = values["keep"], values["snapshot_weights"]
    if weights is not None:
        if keep is None or len(weights) != keep:
            raise ValueError(
                f"Expected `snapshot_weights` to have one weight per kept snapshot (`keep` = {keep}), but got "
                f"{len(weights)}; set `keep` to {len(weights)}."
            )
        if not any(weights):
            raise ValueError(f"Expected at least one of `snapshot_weights` to be > 0, but got {weights}.")
    layers, layer_weights = values["layers"], values["layer_weights"]
    if layer_weights is not None:
        if not any(layer_weights):
            raise ValueError(f"Expected at least one of `layer_weights` to be > 0, but got {layer_weights}.")
        if layers is not None and len(layer_weights) != len(layers):
            raise ValueError(
                f"Expected `layer_weights` to have one weight per layer of `layers` ({len(layers)}), but got "
                f"{len(layer_weights)}."
            )
    return ContinualConfig(**values)
