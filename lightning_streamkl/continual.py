# ruff: noqa: UP045  - omegaconf < 2.4 reads typing.Optional, not `X | None`, in structured configs
r"""
Continual attention regulariser
^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^

Learning without forgetting, on attention distributions: at each task boundary (the end of a ``trainer.fit``
call, or an explicit :meth:`ContinualAttentionRegularizer.snapshot`) a frozen copy of the model is kept. In later
tasks the copy runs on the current batch, and the attention KL between it and the live model, at every selected
attention layer, is added to the loss that ``training_step`` returns. The KL is :func:`streamkl.attention_kl`, so
no attention map is materialised, whatever the context length.

The machinery is the one :class:`~lightning_streamkl.StreamKLDistillation` uses (the step wrapper, the capture
adapters, the layer-pair loss and the metric): every kept snapshot is the teacher of one distiller.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import numbers
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Optional

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from omegaconf import DictConfig, OmegaConf
from torch import nn
from typing_extensions import override

from . import _hooks
from ._distiller import Distiller, default_teacher_forward, padding_mask_from_batch
from .callback import _add_to_loss, check_trainer, log_epoch
from .capture import CAPTURE_KINDS, AttentionCapture, build_capture
from .capture.base import _RECORDING, closest
from .config import (
    LayerPair,
    StreamKLConfig,
    _check_keys,
    _choice,
    _fail,
    _flag,
    _is_path,
    _layer,
    _number,
    _plain,
    validate_config,
)
from .loss import LossOutput
from .metrics import AttentionKLDivergence

log = logging.getLogger(__name__)

__all__ = ["ContinualAttentionRegularizer", "ContinualConfig", "validate_continual_config"]

_STATE_VERSION = 1
SNAPSHOT_DEVICES = ("same", "cpu")
#: The options shared with :class:`~lightning_streamkl.StreamKLConfig` (validated by the same routine).
_SHARED = ("temperature", "direction", "causal", "mask_key", "mask_queries", "validation", "log_on_step", "prog_bar",
           "name", "backend", "warmup_steps")

SnapshotForward = Callable[[nn.Module, Any], Any]
WeightSchedule = Callable[[int, int], float]


# ---------------------------------------------------------------------------------------------- config
@dataclass
class ContinualConfig:
    """Every option of :class:`ContinualAttentionRegularizer` (an omegaconf structured config).

    Args:
        weight: multiplies the regularisation term, ``>= 0``. (The callback also takes a function
            ``weight(task, step)``; a config holds a number.) Default: ``1.0``.
        warmup_steps: ramp the weight linearly from 0 over this many optimizer steps at the start of every
            task (``0``: no ramp). Default: ``0``.
        keep: how many snapshots to keep, the newest ones; ``None`` keeps one per finished task. Default: ``1``.
        snapshot_weights: with several snapshots, the weight of each, newest first (``len == keep``); ``None``
            weighs the kept snapshots equally (their mean). Default: ``None``.
        snapshot_device: ``"same"`` keeps the snapshots on the model's device; ``"cpu"`` keeps them in host
            memory (pinned when CUDA is available) and copies the weights to the device for the snapshot's
            forward pass of every step, releasing the copy afterwards. Default: ``"same"``.
        layers: the attention layers to regularise: indices into the model's attention layers (negative from
            the end) or module paths (relative to the LightningModule or to ``module``); ``None``: every
            attention layer. Each layer is paired with the same layer of the snapshot. Default: ``None``.
        module: the submodule of the LightningModule that is copied and run as the snapshot (a dotted path;
            ``""`` for the whole LightningModule, which then needs a ``forward``). ``None``: the child module
            that holds every selected attention layer (e.g. ``model`` for ``self.model = AutoModel...``), else
            the whole LightningModule if it defines ``forward``. Default: ``None``.
        snapshot_on_fit_end: take a snapshot when a ``trainer.fit`` call finishes (one fit per task). With
            ``False``, only :meth:`ContinualAttentionRegularizer.snapshot` takes them. Default: ``True``.
        temperature, direction, causal, mask_key, mask_queries, validation, log_on_step, prog_bar, backend:
            as in :class:`~lightning_streamkl.StreamKLConfig` (``direction="forward"`` is KL(snapshot‖model)).
        capture: how to capture both models: ``"auto"``, ``"hf"``, ``"mha"`` or ``"recorder"``. Default:
            ``"auto"``.
        name: the log namespace (``train/<name>/...``) and the checkpoint state key. Default:
            ``"continual_kl"``.
    """

    weight: float = 1.0
    warmup_steps: int = 0
    keep: Optional[int] = 1
    snapshot_weights: Optional[list[float]] = None
    snapshot_device: str = "same"
    layers: Optional[list[Any]] = None
    module: Optional[str] = None
    snapshot_on_fit_end: bool = True
    temperature: float = 1.0
    direction: str = "forward"
    causal: Optional[bool] = None
    capture: str = "auto"
    mask_key: Optional[str] = "attention_mask"
    mask_queries: bool = True
    validation: bool = True
    log_on_step: bool = True
    prog_bar: bool = False
    name: str = "continual_kl"
    backend: str = "auto"


def validate_continual_config(config: ContinualConfig | Mapping[str, Any] | DictConfig | str) -> ContinualConfig:
    """Check every option and return a normalised :class:`ContinualConfig`.

    ``config`` may also be YAML text or the path of a YAML file. The options shared with
    :class:`~lightning_streamkl.StreamKLConfig` go through :func:`~lightning_streamkl.validate_config`, so they
    fail with the same messages.

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
    if isinstance(config, (str, os.PathLike)):
        node = OmegaConf.load(config) if _is_path(config) else OmegaConf.create(str(config))
        config = OmegaConf.to_container(node, resolve=True) if node is not None else {}
    raw = _plain(config)
    if isinstance(raw, ContinualConfig):
        raw = {f.name: getattr(raw, f.name) for f in dataclasses.fields(ContinualConfig)}
    if not isinstance(raw, Mapping):
        raise _fail("config", "a ContinualConfig, a mapping of its fields or YAML", raw, TypeError)
    raw = {k: _plain(v) for k, v in raw.items()}
    _check_keys(raw, ContinualConfig, "")
    d = {f.name: f.default for f in dataclasses.fields(ContinualConfig)}
    d.update(raw)
    capture = _choice(d["capture"], "capture", CAPTURE_KINDS)
    shared = validate_config({**{k: d[k] for k in _SHARED}, "pairs": [[0, 0]], "teacher_capture": capture,
                              "student_capture": capture})
    keep = d["keep"]
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, numbers.Integral) or keep < 1):
        exc = ValueError if isinstance(keep, numbers.Integral) and not isinstance(keep, bool) else TypeError
        raise _fail("keep", "an int >= 1 or None", keep, exc)
    weights = d["snapshot_weights"]
    if weights is not None:
        if not isinstance(weights, (list, tuple)) or not weights:
            raise _fail("snapshot_weights", "a non-empty list of numbers >= 0 (newest snapshot first) or None",
                        weights, TypeError)
        weights = [_number(w, f"snapshot_weights[{i}]", low=0.0, inclusive=True) for i, w in enumerate(weights)]
        if keep is None or len(weights) != keep:
            raise ValueError(
                f"Expected `snapshot_weights` to have one weight per kept snapshot (`keep` = {keep}), but got "
                f"{len(weights)}; set `keep` to {len(weights)}."
            )
        if not any(weights):
            raise ValueError(f"Expected at least one of `snapshot_weights` to be > 0, but got {weights}.")
    layers = d["layers"]
    if layers is not None:
        if isinstance(layers, (int, str)):
            layers = [layers]
        if not isinstance(layers, (list, tuple)) or not layers:
            raise _fail("layers", "a non-empty list of layer indices or module paths, or None", layers, TypeError)
        layers = [_layer(x, f"layers[{i}]") for i, x in enumerate(layers)]
        if len(set(map(repr, layers))) != len(layers):
            raise ValueError(f"Expected `layers` to name each layer once, but got {layers}.")
    module = d["module"]
    if module is not None and (not isinstance(module, str) or any(c.isspace() for c in module)):
        raise _fail("module", "a dotted submodule path ('' for the whole LightningModule) or None", module, TypeError)
    return ContinualConfig(
        weight=_number(d["weight"], "weight", low=0.0, inclusive=True),
        warmup_steps=shared.warmup_steps,
        keep=None if keep is None else int(keep),
        snapshot_weights=weights,
        snapshot_device=_choice(d["snapshot_device"], "snapshot_device", SNAPSHOT_DEVICES),
        layers=layers,
        module=module,
        snapshot_on_fit_end=_flag(d["snapshot_on_fit_end"], "snapshot_on_fit_end"),
        temperature=shared.temperature,
        direction=shared.direction,
        causal=shared.causal,
        capture=shared.student_capture,
        mask_key=shared.mask_key,
        mask_queries=shared.mask_queries,
        validation=shared.validation,
        log_on_step=shared.log_on_step,
        prog_bar=shared.prog_bar,
        name=shared.name,
        backend=shared.backend,
    )


# ---------------------------------------------------------------------------------------------- snapshots
@dataclass
class _Snapshot:
    task: int  # the task whose end produced it
    module: nn.Module | None = None  # the frozen copy; None until a checkpointed one is rebuilt
    pending: dict[str, torch.Tensor] | None = None  # checkpointed weights waiting for a module structure
    distiller: Distiller | None = None


def _frozen_copy(root: nn.Module, pl_module: LightningModule) -> nn.Module:
    """A deep copy of ``root`` (``pl_module`` or one of its submodules) without the trainer or step wrappers."""
    memo: dict[int, Any] = {}
    trainer = getattr(pl_module, "_trainer", None)
    if trainer is not None:
        memo[id(trainer)] = None
    registry = pl_module.__dict__.get(_hooks._REGISTRY_ATTR)
    if registry is not None:
        memo[id(registry)] = {}
    try:
        frozen = copy.deepcopy(root, memo)
    except (RuntimeError, TypeError) as err:
        what = type(root).__name__
        raise RuntimeError(
            f"ContinualAttentionRegularizer could not copy {what} for the snapshot ({err}). A module holding "
            "non-leaf tensors (e.g. a stored loss) or unpicklable objects cannot be deep-copied; set `module` to the "
            "network submodule (e.g. module='model') or drop those attributes."
        ) from err
    if root is pl_module and registry is not None:
        for method in registry:
            frozen.__dict__.pop(method, None)  # the live module's step wrappers, not the class methods
        frozen.__dict__.pop(_hooks._REGISTRY_ATTR, None)
    frozen.eval()
    frozen.requires_grad_(False)
    return frozen


def _pin(module: nn.Module) -> None:
    if not torch.cuda.is_available():
        return
    for t in _tensors(module):
        if t.device.type == "cpu" and not t.is_pinned():
            t.data = t.data.pin_memory()


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


@contextmanager
def _borrowed(module: nn.Module, device: torch.device, dtype: torch.dtype | None = None) -> Iterator[None]:
    """Run ``module`` (kept on the host) on ``device``: inside the block its tensors' data are device copies.

    ``dtype`` also casts the floating-point tensors. The host tensors are put back afterwards without a copy (the
    snapshot never changes), which releases the device copies.
    """

    def target(t: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    saved = [(t, t.data) for t in _tensors(module) if t.device != device or t.dtype != target(t)]
    try:
        for t, host in saved:
            t.data = host.to(device=device, dtype=target(t), non_blocking=True)
        yield
    finally:
        for t, host in saved:
            t.data = host


# ---------------------------------------------------------------------------------------------- the callback
class ContinualAttentionRegularizer(Callback):
    r"""Regularise a model's attention toward frozen snapshots of itself taken at task boundaries.

    Task boundaries are the ends of ``trainer.fit`` calls (one fit per task, the usual idiom of continual
    learning with Lightning) and explicit :meth:`snapshot` calls. At a boundary the callback stores a frozen copy
    of the model (``eval()``, no gradients, never updated). During every later training step each kept snapshot
    runs on the current batch, the queries and keys of the selected attention layers of both are captured, and

    .. math::

        \lambda(t, s) \cdot \sum_{k} \alpha_k \cdot \frac{1}{L} \sum_{l=1}^{L}
        \overline{\mathrm{KL}}\bigl(P^{\mathrm{snap}_k}_l \,\|\, P_l\bigr)

    is added to the loss ``training_step`` returns, where :math:`\overline{\mathrm{KL}}` is the mean over heads
    and non-padded query rows of :func:`streamkl.attention_kl` between layer :math:`l` of snapshot :math:`k` and
    the same layer of the model, :math:`\alpha_k` the snapshot weights (equal by default) and
    :math:`\lambda(t, s)` the weight in task :math:`t` at optimizer step :math:`s` of that task (``weight``,
    ramped over ``warmup_steps``). The first task, with no snapshot, is trained unchanged.

    The loss reaches ``training_step``'s value the same way as :class:`~lightning_streamkl.StreamKLDistillation`'s
    (a wrapper around the module's ``training_step``), so gradient accumulation, mixed precision and DDP see one
    loss. Logs: ``train/<name>/layer<i>`` per layer, ``train/<name>/total`` (the double sum above, before
    :math:`\lambda`), ``train/<name>/weight`` (:math:`\lambda`), ``train/<name>/task<k>`` per snapshot when
    several are kept; epoch values and ``val/<name>/...`` from an
    :class:`~lightning_streamkl.AttentionKLDivergence`.

    Args:
        weight: :math:`\lambda`: a number ``>= 0``, or a function ``weight(task, step) -> float`` of the
            task index (0 for the first task) and the optimizer steps done in the current task.
        warmup_steps, keep, snapshot_weights, snapshot_device, layers, module, snapshot_on_fit_end,
        temperature, direction, causal, capture, mask_key, mask_queries, validation, log_on_step, prog_bar, name,
        backend: see :class:`ContinualConfig`.
        snapshot_forward: ``fn(snapshot, batch)`` that runs a snapshot on a batch; default: mapping batches
            pass the keys its ``forward`` names (except ``labels``), tuple batches pass ``batch[0]``. Subclasses
            can override :meth:`snapshot_forward` instead.

    Attributes:
        config: the validated :class:`ContinualConfig`.
        train_metric: the training :class:`~lightning_streamkl.AttentionKLDivergence` (built in ``setup``).
        val_metric: the validation one.

    Raises:
        TypeError: an option of the wrong type.
        ValueError: a bad option (the message names it); in ``setup``, a model with no attention layer the
            capture adapters can find (a custom attention must call :func:`lightning_streamkl.capture.record`),
            an unknown layer or submodule (with the closest names); at the first training step, selected layers
            that were never recorded.
        MisconfigurationException: in ``setup``, an unsupported strategy (FSDP, DeepSpeed, model parallel,
            ``ddp_spawn``), manual optimization, a ``dataloader_iter`` training step, or a name used twice.

    Example::

        >>> import lightning as L
        >>> from torch import nn
        >>> class Classifier(L.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True)
        ...         self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        ...         self.head = nn.Linear(16, 2)
        >>> model = Classifier()
        >>> regularizer = ContinualAttentionRegularizer(weight=2.0, keep=2)
        >>> frozen = regularizer.snapshot(model)     # what the end of each trainer.fit call does
        >>> regularizer.task, type(frozen).__name__, any(p.requires_grad for p in frozen.parameters())
        (1, 'TransformerEncoder', False)
        >>> regularizer.pair_names
        ['layer0', 'layer1']

        then ``for task in tasks: L.Trainer(callbacks=[regularizer], ...).fit(model, task)``.

    .. tip:: The snapshots' weights and the callback's counters are saved in checkpoints under
        :attr:`state_key`; resuming a task with ``ckpt_path`` rebuilds the snapshots (a copy of the live module's
        structure, loaded with the saved weights) and continues the task's warm-up where it stopped. Each kept
        snapshot adds one copy of the model to the checkpoint and, with ``snapshot_device="same"``, to device
        memory.
    """

    def __init__(
        self,
        *,
        weight: float | WeightSchedule = 1.0,
        warmup_steps: int = 0,
        keep: int | None = 1,
        snapshot_weights: Sequence[float] | None = None,
        snapshot_device: str = "same",
        layers: Sequence[int | str] | None = None,
        module: str | None = None,
        snapshot_on_fit_end: bool = True,
        temperature: float = 1.0,
        direction: str = "forward",
        causal: bool | None = None,
        capture: str = "auto",
        mask_key: str | None = "attention_mask",
        mask_queries: bool = True,
        validation: bool = True,
        log_on_step: bool = True,
        prog_bar: bool = False,
        name: str = "continual_kl",
        backend: str = "auto",
        snapshot_forward: SnapshotForward | None = None,
    ) -> None:
        super().__init__()
        options = {k: v for k, v in locals().items() if k not in ("self", "snapshot_forward", "__class__")}
        schedule = None
        if callable(weight):
            schedule, options["weight"] = weight, 1.0
        self._init(validate_continual_config(options), schedule, snapshot_forward)

    def _init(self, config: ContinualConfig, schedule: WeightSchedule | None,
              snapshot_forward: SnapshotForward | None) -> None:
        if snapshot_forward is not None and not callable(snapshot_forward):
            raise TypeError(f"Expected `snapshot_forward` to be callable, but got {type(snapshot_forward).__name__}.")
        self.config = config
        self._schedule = schedule
        forward = snapshot_forward
        if forward is None and type(self).snapshot_forward is not ContinualAttentionRegularizer.snapshot_forward:
            forward = self.snapshot_forward
        self._forward = forward
        self._snapshots: list[_Snapshot] = []
        self._task = 0
        self._task_start_step = 0
        self._train_batches = 0
        self._restarting = False
        self._probed = True
        self._probing = False
        self._module: LightningModule | None = None
        self._wrapped: list[str] = []
        # resolved against a module (in setup or at the first snapshot)
        self._resolved_for: LightningModule | None = None
        self._root = ""
        self._probe: AttentionCapture | None = None
        self._pairs: list[LayerPair] = []
        self._attention: StreamKLConfig | None = None
        self.train_metric: AttentionKLDivergence | None = None
        self.val_metric: AttentionKLDivergence | None = None

    @classmethod
    def from_config(cls, config: ContinualConfig | Mapping[str, Any] | str, *,
                    snapshot_forward: SnapshotForward | None = None) -> ContinualAttentionRegularizer:
        """Build from a :class:`ContinualConfig`, a mapping, or YAML text or a YAML path.

        Example:
            >>> ContinualAttentionRegularizer.from_config("weight: 0.5\\nkeep: null").config.keep is None
            True
        """
        self = cls.__new__(cls)
        Callback.__init__(self)
        self._init(validate_continual_config(config), None, snapshot_forward)
        return self

    # ------------------------------------------------------------------------------------------ overridables
    def snapshot_forward(self, snapshot: nn.Module, batch: Any) -> Any:
        """Run a snapshot on ``batch`` (override in a subclass to feed it differently)."""
        return default_teacher_forward(snapshot, batch)

    def padding_mask(self, batch: Any) -> torch.Tensor | None:
        """The ``[B, N]`` bool padding mask (True = real token) of ``batch``; default: ``batch[mask_key]``."""
        return padding_mask_from_batch(batch, self.config.mask_key)

    # ------------------------------------------------------------------------------------------ public
    @property
    def task(self) -> int:
        """The index of the current task: the number of snapshots taken so far (kept or not)."""
        return self._task

    @property
    def snapshots(self) -> list[nn.Module]:
        """The kept frozen snapshots, oldest first (those restored from a checkpoint once rebuilt)."""
        return [s.module for s in self._snapshots if s.module is not None]

    @property
    def snapshot_tasks(self) -> list[int]:
        """For each kept snapshot (oldest first), the task whose end produced it."""
        return [s.task for s in self._snapshots]

    @property
    def pair_names(self) -> list[str]:
        """The regularised layers' names in logs (``layer<i>``, ``i`` the index among the attention layers)."""
        return [p.label for p in self._pairs]

    @property
    def root(self) -> str:
        """The path of the submodule that is copied and run as the snapshot (``""``: the LightningModule)."""
        return self._root

    def weight_at(self, task: int, step: int) -> float:
        r""":math:`\lambda` in task ``task`` after ``step`` optimizer steps of it (warm-up included)."""
        if self._schedule is not None:
            value = self._schedule(task, step)
            if isinstance(value, torch.Tensor):
                value = float(value)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
                raise ValueError(
                    f"Expected `weight({task}, {step})` to return a finite number >= 0, but got {value!r}."
                )
            weight = float(value)
        else:
            weight = self.config.weight
        if self.config.warmup_steps > 0:
            weight *= min(1.0, max(step, 0) / self.config.warmup_steps)
        return weight

    def snapshot(self, pl_module: LightningModule) -> nn.Module:
        """Close the current task: keep a frozen copy of the model as a teacher for the following tasks.

        Called at the end of every ``trainer.fit`` (unless ``snapshot_on_fit_end=False``); call it yourself to
        mark a boundary inside a fit (between steps, e.g. from another callback's ``on_train_epoch_end``) or
        before the first task (to regularise toward a pretrained model). Only the newest ``keep`` snapshots are
        kept.

        Returns:
            the frozen copy (of :attr:`root` inside ``pl_module``).

        Raises:
            RuntimeError: called while a training step is recording attention, or the module cannot be copied.
        """
        if _RECORDING:
            raise RuntimeError(
                "ContinualAttentionRegularizer.snapshot() was called while attention is being captured (inside a "
                "training step); call it between steps, e.g. from on_train_batch_end or on_train_epoch_end."
            )
        self._resolve(pl_module)
        frozen = self._place_snapshot(_frozen_copy(self._root_module(pl_module), pl_module))
        self._snapshots.append(_Snapshot(task=self._task, module=frozen))
        if self.config.keep is not None and len(self._snapshots) > self.config.keep:
            self._snapshots = self._snapshots[-self.config.keep:]
        self._task += 1
        trainer = getattr(pl_module, "_trainer", None)
        self._task_start_step = trainer.global_step if trainer is not None else 0
        rank_zero_info(
            f"ContinualAttentionRegularizer {self.config.name!r}: snapshot of task {self._task - 1} taken "
            f"({type(frozen).__name__} at {self._root or '<LightningModule>'!r}); keeping tasks {self.snapshot_tasks}."
        )
        return frozen

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(name=self.config.name)

    # ------------------------------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage not in ("fit", "validate"):
            return
        check_trainer(self, trainer, pl_module, stage)
        launcher = getattr(trainer.strategy, "launcher", None)
        if stage == "fit" and type(launcher).__name__ == "_MultiProcessingLauncher":
            raise MisconfigurationException(
                "ContinualAttentionRegularizer keeps its snapshots in the callback, but with a spawning strategy "
                f"({type(trainer.strategy).__name__}, e.g. 'ddp_spawn') the snapshots taken in the worker processes "
                "never reach the main process; use strategy='ddp' (or a single device)."
            )
        self._resolve(pl_module)
        self._module = pl_module
        self._probed = stage != "fit"
        methods = [("training_step", "train")] if stage == "fit" else []
        if self.config.validation and is_overridden("validation_step", pl_module):
            methods.append(("validation_step", "val"))
        for method, step_stage in methods:
            _hooks.install(pl_module, method, step_stage, self)
            self._wrapped.append(method)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._restarting:  # resumed from a checkpoint: the task started earlier
            self._restarting = False
        else:
            self._task_start_step = trainer.global_step
        self._materialise(pl_module)
        rank_zero_info(
            f"ContinualAttentionRegularizer {self.config.name!r}: task {self._task}, regularising "
            f"{len(self._pairs)} attention layer(s) of {self._root or '<LightningModule>'!r} toward the snapshots "
            f"of tasks {self.snapshot_tasks}."
        )

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._release(pl_module)
        if stage == "fit" and self.config.snapshot_on_fit_end:
            self.snapshot(pl_module)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._release(pl_module)  # no boundary: the task did not finish

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.train_metric is not None:
            log_epoch(pl_module, self.train_metric, "train", prog_bar=self.config.prog_bar)

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.val_metric is not None and not trainer.sanity_checking:
            log_epoch(pl_module, self.val_metric, "val", prog_bar=self.config.prog_bar)

    @override
    def state_dict(self) -> dict[str, Any]:
        snapshots = []
        for s in self._snapshots:
            weights = s.pending if s.module is None else s.module.state_dict()
            snapshots.append({"task": s.task, "state_dict": {k: v.detach().cpu() for k, v in weights.items()}})
        return {
            "version": _STATE_VERSION,
            "name": self.config.name,
            "module": self._root,
            "layers": self.pair_names,
            "task": self._task,
            "task_start_step": self._task_start_step,
            "train_batches": self._train_batches,
            "snapshots": snapshots,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._task = int(state_dict.get("task", 0))
        self._task_start_step = int(state_dict.get("task_start_step", 0))
        self._train_batches = int(state_dict.get("train_batches", 0))
        self._release_distillers()
        self._snapshots = [_Snapshot(task=int(s["task"]), pending=dict(s["state_dict"]))
                           for s in state_dict.get("snapshots", [])]
        self._restarting = True
        saved = state_dict.get("layers")
        if saved and self._pairs and list(saved) != self.pair_names:
            rank_zero_warn(
                f"ContinualAttentionRegularizer {self.config.name!r}: the checkpoint was written regularising "
                f"{list(saved)}, this run regularises {self.pair_names}."
            )

    # ------------------------------------------------------------------------------------------ resolution
    def _resolve(self, pl_module: LightningModule) -> None:
        """Find the attention layers, the snapshot root and the layer pairs for ``pl_module`` (once per module)."""
        if self._resolved_for is pl_module:
            return
        cfg = self.config
        probe = build_capture(pl_module, cfg.capture)
        model = type(pl_module).__name__
        if probe.kind == "recorder" and cfg.layers is None:
            raise ValueError(
                f"ContinualAttentionRegularizer found no attention layer it can capture in {model}: no Hugging Face "
                "attention-interface layer and no nn.MultiheadAttention. For a custom attention, call "
                "lightning_streamkl.capture.record(self, q, k, ...) in its forward and name those modules with "
                "`layers=[...]`."
            )
        names = [] if probe.kind == "recorder" else probe.layer_names()
        if probe.kind != "recorder" and not names:
            raise ValueError(
                f"ContinualAttentionRegularizer: the {probe.kind!r} capture found no attention layer in {model}."
            )
        selected = self._select(probe, names, pl_module)
        self._root = self._find_root(pl_module, [path for _, path in selected])
        prefix = f"{self._root}." if self._root else ""
        pairs = []
        for index, path in selected:
            if not path.startswith(prefix):
                raise ValueError(
                    f"ContinualAttentionRegularizer: the layer {path!r} is outside the snapshotted submodule "
                    f"{self._root!r}; set `module` to a submodule that contains every selected layer."
                )
            label = f"layer{index}" if index is not None else path
            pairs.append(LayerPair(teacher=path[len(prefix):], student=path, weight=1.0 / len(selected), name=label))
        self._pairs = pairs
        self._attention = validate_config({
            "pairs": pairs, "temperature": cfg.temperature, "direction": cfg.direction, "causal": cfg.causal,
            "teacher_capture": probe.kind, "student_capture": probe.kind, "teacher_dtype": "auto",
            "mask_key": cfg.mask_key, "mask_queries": cfg.mask_queries, "validation": cfg.validation,
            "log_on_step": cfg.log_on_step, "prog_bar": cfg.prog_bar, "name": cfg.name, "backend": cfg.backend,
        })
        probe.select({path for _, path in selected})
        self._probe = probe
        weights = [p.weight for p in pairs]
        self.train_metric = AttentionKLDivergence(self.pair_names, weights=weights, prefix=f"{cfg.name}/")
        self.val_metric = AttentionKLDivergence(self.pair_names, weights=weights, prefix=f"{cfg.name}/")
        self._release_distillers()
        self._resolved_for = pl_module

    def _select(self, probe: AttentionCapture, names: list[str], pl_module: LightningModule,
                ) -> list[tuple[int | None, str]]:
        cfg = self.config
        model = type(pl_module).__name__
        paths = {n for n, _ in pl_module.named_modules()}
        if cfg.layers is None:
            return list(enumerate(names))
        selected: list[tuple[int | None, str]] = []
        for i, layer in enumerate(cfg.layers):
            role = f"layer layers[{i}]"
            if not names:  # recorder: module paths only, whatever calls record()
                if isinstance(layer, int):
                    raise ValueError(
                        f"ContinualAttentionRegularizer: {role} is the index {layer}, but the attention of {model} is "
                        "captured through record() calls, which have no order before a forward pass; name the "
                        "layer by its module path."
                    )
                if cfg.module and not layer.startswith(f"{cfg.module}.") and f"{cfg.module}.{layer}" in paths:
                    layer = f"{cfg.module}.{layer}"
                selected.append((None, layer))
                continue
            if isinstance(layer, str) and layer not in names and cfg.module and f"{cfg.module}.{layer}" in names:
                layer = f"{cfg.module}.{layer}"
            path = probe.resolve(layer, role=role)
            selected.append((names.index(path), path))
        if len({p for _, p in selected}) != len(selected):
            raise ValueError(f"Expected `layers` to select each layer once, but {cfg.layers} repeat one.")
        return selected

    def _find_root(self, pl_module: LightningModule, paths: list[str]) -> str:
        module = self.config.module
        if module is not None:
            if module:
                children = [n for n, _ in pl_module.named_modules() if n]
                try:
                    pl_module.get_submodule(module)
                except AttributeError:
                    near = closest(module, children)
                    hint = f" Closest: {near}." if near else ""
                    raise ValueError(
                        f"Expected `module` to name a submodule of {type(pl_module).__name__}, but it has no "
                        f"{module!r}.{hint}"
                    ) from None
            elif not is_overridden("forward", pl_module, LightningModule):
                raise ValueError(
                    f"`module=''` snapshots the whole {type(pl_module).__name__}, which defines no forward() to run "
                    "the snapshot with; set `module` to the network submodule (e.g. 'model') or define forward()."
                )
            return module
        firsts = {p.split(".", 1)[0] for p in paths}
        if len(firsts) == 1 and all("." in p for p in paths):
            return firsts.pop()
        if is_overridden("forward", pl_module, LightningModule):
            return ""
        raise ValueError(
            f"ContinualAttentionRegularizer: the attention layers of {type(pl_module).__name__} lie in several "
            f"submodules ({sorted(firsts)}) and it defines no forward(); set `module` to the submodule to copy and "
            "run as the snapshot, or define forward() and set module=''."
        )

    def _root_module(self, pl_module: LightningModule) -> nn.Module:
        return pl_module.get_submodule(self._root) if self._root else pl_module

    # ------------------------------------------------------------------------------------------ snapshot handling
    def _place_snapshot(self, frozen: nn.Module) -> nn.Module:
        if self.config.snapshot_device == "cpu":
            frozen.to("cpu")
            _pin(frozen)
        return frozen

    def _materialise(self, pl_module: LightningModule) -> None:
        """Rebuild checkpointed snapshots: a copy of the live module's structure, loaded with the saved weights."""
        pending = [s for s in self._snapshots if s.module is None]
        if not pending:
            return
        self._resolve(pl_module)
        root = self._root_module(pl_module)
        for snap in pending:
            assert snap.pending is not None
            frozen = _frozen_copy(root, pl_module)
            frozen.to("cpu")
            try:
                result = frozen.load_state_dict(snap.pending, strict=False)
            except RuntimeError as err:
                raise RuntimeError(
                    f"ContinualAttentionRegularizer {self.config.name!r}: the snapshot of task {snap.task} in the "
                    f"checkpoint does not fit {type(root).__name__} ({err})."
                ) from err
            if result.unexpected_keys:
                raise RuntimeError(
                    f"ContinualAttentionRegularizer {self.config.name!r}: the snapshot of task {snap.task} in the "
                    f"checkpoint has weights {result.unexpected_keys[:5]} that {type(root).__name__} lacks; resume "
                    "with the model the checkpoint was written with."
                )
            if result.missing_keys:
                rank_zero_warn(
                    f"ContinualAttentionRegularizer {self.config.name!r}: the snapshot of task {snap.task} has no "
                    f"weights for {result.missing_keys[:5]} (added after it was taken); they keep the current values."
                )
            snap.module = self._place_snapshot(frozen)
            snap.pending = None

    def _distiller(self, snap: _Snapshot, pl_module: LightningModule) -> Distiller:
        if snap.distiller is None:
            assert snap.module is not None and self._attention is not None
            distiller = Distiller(snap.module, self._attention, self._forward, self.padding_mask)
            distiller.setup(pl_module)
            snap.distiller = distiller
        return snap.distiller

    def _run_snapshot(self, snap: _Snapshot, module: LightningModule, batch: Any) -> None:
        distiller = self._distiller(snap, module)
        if self.config.snapshot_device == "same":
            distiller.place_teacher(module.device, module)
            placed = nullcontext()
        else:
            placed = _borrowed(snap.module, module.device, distiller._teacher_dtype(module))
        with placed:
            distiller.run_teacher(batch)

    def _alphas(self, count: int) -> list[float]:
        """The snapshot weights, oldest first (``snapshot_weights`` lists them newest first)."""
        weights = self.config.snapshot_weights
        if weights is None:
            return [1.0 / count] * count
        return list(reversed(weights[:count]))

    def _release_distillers(self) -> None:
        for snap in self._snapshots:
            if snap.distiller is not None:
                snap.distiller.clear()
                snap.distiller = None

    def _release(self, pl_module: LightningModule) -> None:
        for method in self._wrapped:
            _hooks.uninstall(pl_module, method, self)
        self._wrapped = []
        for snap in self._snapshots:
            if snap.distiller is not None:
                snap.distiller.clear()
        if self._probe is not None:
            self._probe.clear()
        self._probing = False
        self._module = None

    # ------------------------------------------------------------------------------------------ per step
    def _step_begin(self, stage: str, batch: Any) -> bool:
        module = self._module
        assert module is not None
        if stage == "val" and (module.trainer.sanity_checking or not self.config.validation):
            return False
        self._materialise(module)
        if not self._snapshots:
            # First task: nothing to regularise toward. Record the student once, so a layer that cannot be captured
            # fails now rather than after the first task.
            self._probing = stage == "train" and not self._probed
            return self._probing
        for snap in self._snapshots:
            self._run_snapshot(snap, module, batch)
        return True

    def _student_recording(self) -> Any:
        if self._probing:
            assert self._probe is not None
            return self._probe.recording()
        stack = ExitStack()
        for snap in self._snapshots:
            assert snap.distiller is not None
            stack.enter_context(snap.distiller.student_recording())
        return stack

    def _step_end(self, stage: str, batch: Any, output: Any) -> Any:
        module = self._module
        assert module is not None
        if self._probing:
            self._check_probe()
            return output
        if output is None and stage == "train":
            return output  # the user skipped this batch
        terms = [snap.distiller.compute(batch) for snap in self._snapshots]  # type: ignore[union-attr]
        combined = _combine(terms, self._alphas(len(terms)))
        metric = self.train_metric if stage == "train" else self.val_metric
        assert metric is not None
        metric.to(combined.rows.device)
        metric.update(combined.kl_sums, combined.rows)
        if stage != "train":
            return output
        self._train_batches += 1
        step = module.trainer.global_step - self._task_start_step
        weight = self.weight_at(self._task, step)
        output = _add_to_loss(output, combined.total * weight, type(self).__name__)
        if self.config.log_on_step:
            name = self.config.name
            values = {f"train/{name}/{k}": v.detach() for k, v in combined.per_pair.items()}
            values[f"train/{name}/weight"] = torch.tensor(weight)
            if len(terms) > 1:
                for snap, t in zip(self._snapshots, terms):
                    values[f"train/{name}/task{snap.task}"] = t.total.detach()
            module.log_dict(values, on_step=True, on_epoch=False)
            module.log(f"train/{name}/total", combined.total.detach(), on_step=True, on_epoch=False,
                       prog_bar=self.config.prog_bar)
        return output

    def _check_probe(self) -> None:
        assert self._probe is not None
        self._probed, self._probing = True, False
        recorded = self._probe.pop()
        missing = [p.student for p in self._pairs if p.student not in recorded]
        if missing:
            raise ValueError(
                f"ContinualAttentionRegularizer {self.config.name!r}: the layers {missing} recorded no queries and "
                f"keys during the first training step (recorded: {sorted(recorded)}). A custom attention must call "
                "lightning_streamkl.capture.record(self, q, k, ...) in its forward; check `layers`."
            )

    def _step_cleanup(self) -> None:
        if self._probe is not None:
            self._probe.clear()
        self._probing = False
        for snap in self._snapshots:
            if snap.distiller is not None:
                snap.distiller.clear()


def _combine(terms: list[LossOutput], alphas: list[float]) -> LossOutput:
    """``Σ_k α_k · terms_k`` (the row counts are the same for every snapshot: same batch, same masks)."""
    if len(terms) == 1 and alphas[0] == 1.0:
        return terms[0]
    total = sum(a * t.total for a, t in zip(alphas, terms))
    per_pair = {k: sum(a * t.per_pair[k] for a, t in zip(alphas, terms)) for k in terms[0].per_pair}
    kl_sums = sum(a * t.kl_sums for a, t in zip(alphas, terms))
    return LossOutput(total, per_pair, kl_sums, terms[0].rows)  # type: ignore[arg-type]
