r"""
Continual attention regulariser
^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^

Learning without forgetting, on attention distributions: at each task boundary (the end of a ``trainer.fit``
call, or an explicit :meth:`ContinualAttentionRegularizer.snapshot`) a frozen copy of the model is kept. In later
tasks the copy runs on the inputs its live counterpart receives, and the attention KL between it and the live model,
at every selected attention layer, is added to the loss that ``training_step`` returns. The KL is
:func:`streamkl.attention_kl`, so no attention map is materialised, whatever the context length.

A thin Lightning adapter: every kept snapshot is the teacher of one
:class:`~lightning_streamkl.engine.AttentionDistiller`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from ..adapter import LossTermCallback, add_to_loss, check_trainer, log_step, warn_stage_without_term
from ..capture import AttentionCapture, is_recording
from ..config import AttentionKLOptions, LayerPair, StreamKLConfig, validate_config
from ..engine import AttentionDistiller, DistillationMetrics, default_teacher_forward, padding_mask_from_batch
from ..loss import weighted_sum
from ..metrics import AttentionKLDivergence
from ..options import signature_from_fields
from ..teacher import AdaptersOff
from .config import ContinualConfig, validate_continual_config
from .layers import resolve_layers
from .snapshots import Snapshot, Trimmer, frozen_copy, rebuild

__all__ = ["ContinualAttentionRegularizer"]

_STATE_VERSION = 1

SnapshotForward = Callable[[nn.Module, Any], Any]
WeightSchedule = Callable[[int, int], float]


class ContinualAttentionRegularizer(LossTermCallback):
    r"""Regularise a model's attention toward frozen snapshots of itself taken at task boundaries.

    Task boundaries are the ends of ``trainer.fit`` calls (one fit per task, the usual idiom of continual
    learning with Lightning) and explicit :meth:`snapshot` calls. At a boundary the callback stores a frozen copy
    of the model (``eval()``, no gradients, never updated). During every later training step each kept snapshot
    runs on exactly the inputs its live counterpart receives in that step (the inputs of the snapshotted submodule,
    recorded during the step; the batch for a snapshot of the whole LightningModule), the queries and keys of the
    selected attention layers of both are captured, and

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
        options: every other field of :class:`ContinualConfig` (``warmup_steps``, ``keep``, ``layers``,
            ``module``, ``temperature``, ...), as keyword arguments; the signature lists them, derived from the
            config.
        snapshot_forward: ``fn(snapshot, batch)`` that runs a snapshot on the batch instead of on the recorded
            inputs of its live counterpart. Subclasses can override :meth:`snapshot_forward` instead.

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
        RuntimeError: at a step, a snapshotted submodule that did not run (so its inputs are unknown).
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

    ``reference="adapters_off"`` regularises toward the model itself with its adapters off (a LoRA fine-tune's
    pretrained base, :class:`~lightning_streamkl.teacher.AdaptersOff`) from the first step, with no snapshot copy.

    .. tip:: The snapshots' weights and the callback's counters are saved in checkpoints under
        :attr:`state_key`; resuming a task with ``ckpt_path`` rebuilds the snapshots (a copy of the live module's
        structure, loaded with the saved weights) and continues the task's warm-up where it stopped. Each kept
        snapshot adds one copy of the model to the checkpoint and, with ``snapshot_device="same"``, to device
        memory.
    """

    @signature_from_fields(ContinualConfig, annotations={"weight": float | WeightSchedule})
    def __init__(self, *, snapshot_forward: SnapshotForward | None = None, **options: Any) -> None:
        super().__init__()
        schedule = None
        if callable(options.get("weight")):
            schedule, options["weight"] = options["weight"], 1.0
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
        self._snapshots: list[Snapshot] = []
        self._base = Snapshot(task=-1) if config.reference == "adapters_off" else None
        self._task = 0
        self._task_start_step = 0
        self._train_batches = 0
        self._restarting = False
        self._probed = True
        self._probing = False
        # resolved against a module (in setup or at the first snapshot)
        self._resolved_for: LightningModule | None = None
        self._root = ""
        self._probe: AttentionCapture | None = None
        self._pairs: list[LayerPair] = []
        self._attention: StreamKLConfig | None = None
        self._state: DistillationMetrics | None = None
        self._trimmer = Trimmer(config.snapshot_trim, config.name)  # drops what a snapshot's first pass did not need

    @classmethod
    def from_config(cls, config: ContinualConfig | Mapping[str, Any] | str, *,
                    snapshot_forward: SnapshotForward | None = None) -> ContinualAttentionRegularizer:
        """Build from a :class:`ContinualConfig`, a mapping, or YAML text or a YAML path.

        Example:
            >>> ContinualAttentionRegularizer.from_config("weight: 0.5\\nkeep: null").config.keep is None
            True
        """
        self = cls.__new__(cls)
        LossTermCallback.__init__(self)
        self._init(validate_continual_config(config), None, snapshot_forward)
        return self

    # ------------------------------------------------------------------------------------------ overridables
    def snapshot_forward(self, snapshot: nn.Module, batch: Any) -> Any:
        """Run a snapshot on ``batch``. Used only when overridden (or given as ``snapshot_forward``): by default a
        snapshot of a submodule gets the inputs its live counterpart received, and one of the whole LightningModule
        the batch (mapping batches: the keys its ``forward`` names; tuple batches: ``batch[0]``)."""
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

    def snapshot_memory(self) -> list[dict[str, Any]]:
        """What each kept snapshot holds, oldest first (:meth:`~lightning_streamkl.continual.snapshots.Snapshot.memory`:
        bytes per device, each storage once; the tensors dropped after its first pass, ``snapshot_trim``)."""
        return [s.memory() for s in self._snapshots]

    @property
    def train_metric(self) -> AttentionKLDivergence | None:
        """The training :class:`~lightning_streamkl.AttentionKLDivergence` (built in ``setup``)."""
        return None if self._state is None else self._state.train

    @property
    def val_metric(self) -> AttentionKLDivergence | None:
        """The validation one."""
        return None if self._state is None else self._state.val

    def weight_at(self, task: int, step: int) -> float:
        r""":math:`\lambda` in task ``task`` after ``step`` optimizer steps of it (warm-up included).

        Example:
            >>> ContinualAttentionRegularizer(weight=lambda task, step: 2.0 * task, warmup_steps=2).weight_at(3, 1)
            3.0
        """
        weight = self.config.weight if self._schedule is None else _scheduled(self._schedule, task, step)
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
            ValueError: ``reference="adapters_off"`` (nothing to copy).
        """
        if self._base is not None:
            raise ValueError("reference='adapters_off' regularises toward the model with adapters off: no snapshot.")
        if is_recording():
            raise RuntimeError(
                "ContinualAttentionRegularizer.snapshot() was called while attention is being captured (inside a "
                "training step); call it between steps, e.g. from on_train_batch_end or on_train_epoch_end."
            )
        self._resolve(pl_module)
        frozen = frozen_copy(self._root_module(pl_module), pl_module)
        self._snapshots.append(Snapshot(task=self._task, module=self._place(frozen)))
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
            warn_stage_without_term(type(self).__name__, self.config.name, stage)
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
        self._probed = stage != "fit"
        self._wrap_steps(pl_module, stage)

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
        if stage == "fit" and self.config.snapshot_on_fit_end and self._base is None:
            self.snapshot(pl_module)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._release(pl_module)  # no boundary: the task did not finish

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "name": self.config.name,
            "module": self._root,
            "layers": self.pair_names,
            "task": self._task,
            "task_start_step": self._task_start_step,
            "train_batches": self._train_batches,
            "snapshots": [s.state() for s in self._snapshots],
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._task = int(state_dict.get("task", 0))
        self._task_start_step = int(state_dict.get("task_start_step", 0))
        self._train_batches = int(state_dict.get("train_batches", 0))
        for snap in self._snapshots:
            snap.release()
        self._snapshots = [Snapshot(task=int(s["task"]), pending=dict(s["state_dict"]),
                                    trimmed=list(s["trimmed"]) if s.get("trimmed") else None)
                           for s in state_dict.get("snapshots", [])]
        self._restarting = True
        saved = state_dict.get("layers")
        if saved and self._pairs and list(saved) != self.pair_names:
            rank_zero_warn(
                f"ContinualAttentionRegularizer {self.config.name!r}: the checkpoint was written regularising "
                f"{list(saved)}, this run regularises {self.pair_names}."
            )

    # ------------------------------------------------------------------------------------------ internals
    def _resolve(self, pl_module: LightningModule) -> None:
        """Find the attention layers, the snapshot root and the layer pairs for ``pl_module`` (once per module)."""
        if self._resolved_for is pl_module:
            return
        cfg = self.config
        selection = resolve_layers(pl_module, cfg)
        self._root, self._pairs, self._probe = selection.root, selection.pairs, selection.probe
        shared = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(AttentionKLOptions)}
        # the regulariser applies its own weight and per-task warm-up; each snapshot is a teacher fed what its live
        # counterpart receives (the batch for the whole LightningModule, or with a custom snapshot_forward)
        feed = "batch" if self._forward is not None or not self._root else self._root
        self._attention = validate_config({
            **shared, "weight": 1.0, "warmup_steps": 0, "pairs": self._pairs, "teacher_capture": self._probe.kind,
            "student_capture": self._probe.kind, "teacher_inputs": feed,
        })
        self._state = DistillationMetrics(self.pair_names, [p.weight for p in self._pairs], cfg.name)
        for snap in self._teachers():
            snap.release()
        self._resolved_for = pl_module

    def _root_module(self, pl_module: LightningModule) -> nn.Module:
        return pl_module.get_submodule(self._root) if self._root else pl_module

    def _place(self, frozen: nn.Module) -> nn.Module:
        if self.config.snapshot_device == "cpu":
            frozen.to("cpu")
        return frozen

    def _materialise(self, pl_module: LightningModule) -> None:
        """Rebuild checkpointed snapshots: a copy of the live module's structure, loaded with the saved weights."""
        pending = [s for s in self._snapshots if s.module is None]
        if not pending:
            return
        self._resolve(pl_module)
        for snap in pending:
            snap.module = self._place(rebuild(snap, self._root_module(pl_module), pl_module, self.config.name))
            snap.pending = None

    def _teachers(self) -> list[Snapshot]:  # the kept snapshots, or the model with its adapters off
        return [self._base] if self._base is not None else self._snapshots

    def _distiller(self, snap: Snapshot, pl_module: LightningModule) -> AttentionDistiller:
        if snap.distiller is None:
            assert (snap.module is not None or snap is self._base) and self._attention is not None
            base = snap is self._base  # the model itself, adapters off: never offloaded
            config = self._attention
            if self.config.snapshot_device == "cpu" and not base:  # streamed from host memory for each pass
                config = dataclasses.replace(config, teacher_device="offload")
            snap.distiller = AttentionDistiller(AdaptersOff(self._root) if base else snap.module, config,
                                                teacher_forward=self._forward, padding_mask=self.padding_mask)
            snap.distiller.setup(pl_module)
        return snap.distiller

    def _release(self, pl_module: LightningModule) -> None:
        self._trimmer.close()
        self._unwrap_steps(pl_module)
        for snap in self._teachers():
            if snap.distiller is not None:
                snap.distiller.clear()
        if self._probe is not None:
            self._probe.clear()
        self._probing = False

    # ------------------------------------------------------------------------------------------ the step
    def _metrics(self) -> DistillationMetrics | None:
        return self._state

    def _step_begin(self, stage: str, batch: Any) -> bool:
        module = self._module
        assert module is not None
        if not self._takes_part(stage):
            return False
        self._materialise(module)
        if not self._teachers():
            # First task: nothing to regularise toward. Record the student once, so a layer that cannot be captured
            # fails now rather than after the first task.
            self._probing = stage == "train" and not self._probed
            return self._probing
        for snap in self._teachers():
            self._trimmer.watch(snap)  # a no-op for the adapters-off reference (no module of its own)
            self._distiller(snap, module).begin_step(batch)
        return True

    def _student_recording(self) -> Any:
        if self._probing:
            assert self._probe is not None
            return self._probe.recording()
        stack = ExitStack()
        for snap in self._teachers():
            assert snap.distiller is not None
            stack.enter_context(snap.distiller.student_recording())
        return stack

    def _step_end(self, stage: str, batch: Any, output: Any) -> Any:
        module = self._module
        assert module is not None and self._state is not None
        if self._probing:
            self._check_probe()
            return output
        if output is None and stage == "train":
            return output  # the user skipped this batch
        terms = [snap.distiller.end_step(batch) for snap in self._teachers()]  # type: ignore[union-attr]
        self._trimmer.trim(self._snapshots)
        combined = weighted_sum(terms, _alphas(self.config.snapshot_weights, len(terms)))
        if stage != "train":
            log_step(module, self._state, stage, combined, log_on_step=False, prog_bar=False)
            return output
        self._train_batches += 1
        weight = self.weight_at(self._task, module.trainer.global_step - self._task_start_step)
        extra = {"weight": torch.tensor(weight)}
        if len(terms) > 1:
            extra.update({f"task{snap.task}": t.total.detach() for snap, t in zip(self._snapshots, terms)})
        log_step(module, self._state, stage, combined, log_on_step=self.config.log_on_step,
                 prog_bar=self.config.prog_bar, extra=extra)
        return add_to_loss(output, combined.total * weight, type(self).__name__)

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
        self._trimmer.close()  # after a failed step, the next one watches again
        if self._probe is not None:
            self._probe.clear()
        self._probing = False
        for snap in self._teachers():
            if snap.distiller is not None:
                snap.distiller.clear()


def _scheduled(schedule: WeightSchedule, task: int, step: int) -> float:
    """``schedule(task, step)``, checked to be a finite number >= 0."""
    value = schedule(task, step)
    if isinstance(value, torch.Tensor):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ValueError(f"Expected `weight({task}, {step})` to return a finite number >= 0, but got {value!r}.")
    return float(value)


def _alphas(weights: list[float] | None, count: int) -> list[float]:
    """The snapshot weights, oldest first (``snapshot_weights`` lists them newest first; ``None``: equal)."""
    return [1.0 / count] * count if weights is None else list(reversed(weights[:count]))
