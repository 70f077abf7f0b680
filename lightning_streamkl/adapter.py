r"""
Lightning adapter base
^^^^^^^^^^^^^^^^^^^^^^

The Lightning side that the front doors share, written once: :class:`LossTermCallback`, the base of the
callbacks that add a term to the loss ``training_step`` returns (:class:`~lightning_streamkl.StreamKLDistillation`,
:class:`~lightning_streamkl.ContinualAttentionRegularizer`, :class:`~lightning_streamkl.IndexerDistillation`), with
:class:`EngineCallback` for those that adapt a single engine, and the functions the mixin uses too: log a step's
values (:func:`log_step`) and an epoch's (:func:`log_epoch`), checkpoint a metric's epoch-so-far state
(:func:`metric_state`, :func:`load_metric_state`), check the trainer (:func:`check_trainer`, :func:`check_strategy`),
lay the teacher out for the strategy (:func:`place_teacher`) and add a term to a step's output (:func:`add_to_loss`).
Everything model-side is the engine's (:mod:`lightning_streamkl.engine`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from typing_extensions import override

from . import step_wrapper
from .config import AttentionKLOptions
from .engine import AttentionDistiller, DistillationMetrics
from .loss import LossOutput
from .metrics import AttentionKLDivergence
from .teacher import SelfTeacher

__all__ = ["EPOCH_SUFFIX", "STEP_SUFFIX", "EngineCallback", "LossTermCallback", "add_to_loss", "check_strategy",
           "check_trainer", "load_metric_state", "log_epoch", "log_step", "metric_state", "place_teacher",
           "warn_stage_without_term"]

#: Strategies that shard the student; the teacher is sharded over the same processes by default.
SHARDED_STRATEGIES = ("FSDPStrategy", "ModelParallelStrategy")
#: Strategies no adapter supports.
UNSUPPORTED_STRATEGIES = ("DeepSpeedStrategy", "XLAFSDPStrategy")


def _strategy_kinds(trainer: Trainer) -> set[str]:
    """The class names of the trainer's strategy and its bases (subclasses count as what they extend)."""
    return {cls.__name__ for cls in type(trainer.strategy).__mro__}


def check_strategy(name: str, trainer: Trainer, *, sharding: bool) -> None:
    """Reject the strategies ``name`` (an adapter) cannot run under.

    DeepSpeed and XLA's FSDP are always rejected; FSDP and model parallelism are rejected unless ``sharding`` (the
    adapter lays its teacher out for them, :func:`place_teacher`), and model parallelism with tensor parallelism
    (``tensor_parallel_size > 1``) always is.

    Raises:
        MisconfigurationException: one of those strategies (or a subclass), naming it and what to use instead.

    Example:
        >>> from types import SimpleNamespace
        >>> from lightning.pytorch.strategies import FSDPStrategy
        >>> check_strategy("ContinualAttentionRegularizer", SimpleNamespace(strategy=FSDPStrategy()), sharding=False)
        Traceback (most recent call last):
        ...
        lightning.fabric.utilities.exceptions.MisconfigurationException: ContinualAttentionRegularizer does not \
support the FSDPStrategy strategy: it copies the student's own modules into snapshots, which sharded modules do \
not allow; use 'ddp' or a single device.
    """
    kinds = _strategy_kinds(trainer)
    strategy = type(trainer.strategy).__name__
    if kinds & set(UNSUPPORTED_STRATEGIES):
        raise MisconfigurationException(
            f"{name} does not support the {strategy} strategy: DeepSpeed and XLA's FSDP are not tested with StreamKL "
            "(DeepSpeed is not installed in its CI). To shard the student and the teacher, use FSDPStrategy or "
            "ModelParallelStrategy (FSDP2); to replicate them, 'ddp'."
        )
    if kinds & set(SHARDED_STRATEGIES) and not sharding:
        raise MisconfigurationException(
            f"{name} does not support the {strategy} strategy: it copies the student's own modules into "
            "snapshots, which sharded modules do not allow; use 'ddp' or a single device."
        )
    if "ModelParallelStrategy" in kinds:
        mesh = getattr(trainer.strategy, "_device_mesh", None)
        tensor_parallel = mesh["tensor_parallel"].size() if mesh is not None else 1
        if tensor_parallel > 1:
            raise MisconfigurationException(
                f"{name} does not support tensor parallelism (tensor_parallel_size={tensor_parallel}): it splits the "
                "heads of the student's attention over processes, and the captured queries and keys would be a "
                "part of each layer's; use tensor_parallel_size=1 (FSDP2 only)."
            )


def place_teacher(trainer: Trainer, pl_module: LightningModule, distiller: AttentionDistiller) -> None:
    """Shard the distiller's teacher over the data-parallel processes when its ``teacher_sharding`` asks for it
    under this trainer's strategy (``"auto"``: under FSDP and model parallelism; ``"shard"``: whenever there are
    several processes); leave it whole otherwise. Idempotent.

    The mesh is the strategy's data-parallel mesh (``ModelParallelStrategy``) or one over all processes.

    Raises:
        MisconfigurationException: the teacher to shard is a submodule of the LightningModule (the strategy would
            wrap it with the student).

    Example:
        >>> from torch import nn
        >>> distiller = AttentionDistiller(nn.MultiheadAttention(8, 2), {"pairs": [[0, 0]]})
        >>> trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
        >>> place_teacher(trainer, LightningModule(), distiller)   # one process: the teacher stays whole
        >>> distiller.teacher.shards
        1
    """
    if isinstance(distiller.teacher, SelfTeacher):
        return  # the student itself (AdaptersOff): the strategy lays it out
    mode = distiller.config.teacher_sharding
    kinds = _strategy_kinds(trainer)
    if mode == "replicate" or trainer.world_size <= 1 or (mode == "auto" and not kinds & set(SHARDED_STRATEGIES)):
        return
    teacher = distiller.teacher.prepare()
    if any(m is teacher for m in pl_module.modules()):
        raise MisconfigurationException(
            f"The teacher ({type(teacher).__name__}) is a submodule of {type(pl_module).__name__}, so the "
            f"{type(trainer.strategy).__name__} strategy would wrap it with the student; keep it out of the "
            "LightningModule (pass it to StreamKL only) to have it sharded on its own."
        )
    if "ModelParallelStrategy" in kinds:
        mesh = trainer.strategy.device_mesh["data_parallel"]  # type: ignore[attr-defined]
    else:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(trainer.strategy.root_device.type, (trainer.world_size,))
    distiller.shard_teacher(mesh)


def check_trainer(who: Any, trainer: Trainer, pl_module: LightningModule, stage: str, *,
                  alternative: str | None = None, sharding: bool = False) -> None:
    """The checks every loss-adding StreamKL callback makes in ``setup`` (``who.config.name`` is its name).

    ``alternative`` is named in the manual-optimization and ``dataloader_iter`` messages as what to use instead.

    ``sharding``: whether ``who`` lays its teacher out for FSDP and model parallelism (:func:`check_strategy`).

    Raises:
        MisconfigurationException: an unsupported strategy (:func:`check_strategy`), manual optimization, a
            ``dataloader_iter`` training step, or another StreamKL callback with the same name on this module.

    Example:
        >>> from lightning_streamkl import ContinualAttentionRegularizer
        >>> class Manual(LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.automatic_optimization = False
        >>> trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
        >>> check_trainer(ContinualAttentionRegularizer(), trainer, Manual(), "fit")
        Traceback (most recent call last):
        ...
        lightning.fabric.utilities.exceptions.MisconfigurationException: ContinualAttentionRegularizer adds its term \
to the loss returned by training_step, which manual optimization ignores.
    """
    name = type(who).__name__
    check_strategy(name, trainer, sharding=sharding)
    if stage == "fit" and not pl_module.automatic_optimization:
        hint = (f"; with `automatic_optimization = False` use {alternative} and add "
                "`self.attention_distillation_loss()` to the loss you backpropagate") if alternative else ""
        raise MisconfigurationException(
            f"{name} adds its term to the loss returned by training_step, which manual optimization ignores{hint}."
        )
    if stage == "fit" and is_param_in_hook_signature(pl_module.training_step, "dataloader_iter", explicit=True):
        hint = f" Use {alternative} instead." if alternative else ""
        raise MisconfigurationException(
            f"{name} needs the batch passed to training_step; a `dataloader_iter` training_step hides it.{hint}"
        )
    for method in ("training_step", "validation_step"):
        for other in step_wrapper.runners(pl_module, method):
            other_config = getattr(other, "config", None)
            if other is not who and other_config is not None and other_config.name == who.config.name:
                kinds = name if type(other) is type(who) else f"{type(other).__name__} and {name}"
                raise MisconfigurationException(
                    f"Two {kinds} callbacks use the name {who.config.name!r}; their logs and checkpoint state would "
                    "collide. Give each a distinct `name`."
                )


def warn_stage_without_term(who: str, name: str, stage: str) -> None:
    """Say, once per ``trainer.test()`` or ``trainer.predict()`` run, that the run goes without ``who``: no teacher
    pass, no term, nothing logged under ``test/<name>/...``; ``trainer.validate(model, dataloaders=...)`` measures the
    KL on held-out data instead. Other stages say nothing.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_stage_without_term("StreamKLDistillation", "attn_kl", "test")
        >>> "test/attn_kl" in str(caught[0].message)
        True
    """
    stage = str(getattr(stage, "value", stage))  # Lightning passes its TrainerFn enum
    if stage not in ("test", "predict"):
        return
    rank_zero_warn(
        f"{who} ({name!r}) does not take part in trainer.{stage}(): the teacher does not run and nothing is logged "
        f"under {stage}/{name}/. To measure the attention KL on held-out data, pass that data to "
        f"trainer.validate(model, dataloaders=...), which logs val/{name}/."
    )


def add_to_loss(output: Any, term: torch.Tensor, who: str) -> Any:
    """``output`` (a loss tensor, or a mapping with a ``"loss"`` entry) with ``term`` added to the loss.

    Example:
        >>> add_to_loss({"loss": torch.tensor(1.0), "n": 2}, torch.tensor(0.5), "me")
        {'loss': tensor(1.5000), 'n': 2}
    """
    if isinstance(output, torch.Tensor):
        return output + term
    if isinstance(output, Mapping) and "loss" in output:
        return {**output, "loss": output["loss"] + term}
    what = "a mapping without a 'loss' key" if isinstance(output, Mapping) else type(output).__name__
    raise MisconfigurationException(
        f"{who} adds its term to the loss returned by training_step, but it returned {what}; "
        "return the loss tensor or a dict with a 'loss' entry."
    )


#: The suffixes of training keys, as ``self.log(..., on_step=True, on_epoch=True)`` names them: one key, one meaning.
STEP_SUFFIX, EPOCH_SUFFIX = "_step", "_epoch"


def log_step(module: LightningModule, metrics: DistillationMetrics, stage: str, terms: LossOutput, *,
             log_on_step: bool, prog_bar: bool, extra: Mapping[str, torch.Tensor] | None = None) -> None:
    """Add one batch's terms to the stage's metric and, for training steps with ``log_on_step`` (and a trainer),
    log the per-step values under ``<key>_step`` (``<name>/total_step`` in the progress bar with ``prog_bar``), as
    ``self.log`` names a value logged per step and per epoch; :func:`log_epoch` logs the epoch's under ``<key>_epoch``.

    Example:
        >>> metrics = DistillationMetrics(["last"], [1.0], "attn_kl")
        >>> terms = LossOutput(torch.tensor(0.5), {"last": torch.tensor(0.5)}, torch.tensor([2.0]), torch.tensor([4.0]))
        >>> log_step(LightningModule(), metrics, "train", terms, log_on_step=True, prog_bar=False)  # no trainer: no log
        >>> metrics.train.update_count
        1
    """
    values = metrics.update(stage, terms, extra)
    if stage != "train" or not log_on_step or getattr(module, "_trainer", None) is None:
        return
    total = f"{stage}/{metrics.name}/total"
    module.log_dict({k + STEP_SUFFIX: v for k, v in values.items() if k != total}, on_step=True, on_epoch=False)
    module.log(total + STEP_SUFFIX, values[total], on_step=True, on_epoch=False, prog_bar=prog_bar)


def log_epoch(module: LightningModule, metrics: DistillationMetrics, stage: str, *, prog_bar: bool) -> None:
    """Log the stage's epoch values (synced across processes; the validation total in the progress bar with
    ``prog_bar``) and reset its metric: training values under ``<key>_epoch`` (the step values are ``<key>_step``),
    validation values, which exist per epoch only, under ``<key>``. A stage that saw no batch logs nothing.

    Example:
        >>> log_epoch(LightningModule(), DistillationMetrics(["last"], [1.0], "attn_kl"), "val", prog_bar=True)
    """
    values = metrics.epoch_values(stage)
    suffix = EPOCH_SUFFIX if stage == "train" else ""
    if values:
        module.log_dict({k + suffix: v for k, v in values.items()}, on_step=False, on_epoch=True, sync_dist=True,
                        prog_bar=prog_bar and stage == "val")


def metric_state(metric: AttentionKLDivergence, trainer: Trainer | None) -> dict[str, Any]:
    """The epoch-so-far state of ``metric`` for a checkpoint, summed over processes.

    Under DDP every process calls ``state_dict`` while a checkpoint is written (Lightning's ``save_checkpoint``
    must run on all of them), so the sum is one collective; the checkpoint then holds the whole group's state.

    Example:
        >>> metric = AttentionKLDivergence(["last"])
        >>> metric.update(torch.tensor([2.0]), torch.tensor([4.0]))
        >>> state = metric_state(metric, None)
        >>> resumed = AttentionKLDivergence(["last"])
        >>> load_metric_state(resumed, state, None)
        >>> {k: float(v) for k, v in resumed.compute().items()}
        {'attn_kl/last': 0.5}
    """
    state = torch.stack([metric.kl_sum, metric.rows]).detach()
    updates = int(metric.update_count)
    if trainer is not None and trainer.training and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
        # written after the epoch's last batch but before its end hooks: a run resumed from here starts the next
        # epoch (Lightning does not run the rest of this one), so nothing of this epoch may be carried over
        state, updates = torch.zeros_like(state), 0
    if trainer is not None and trainer.world_size > 1:
        state = trainer.strategy.reduce(state.to(trainer.strategy.root_device), reduce_op="sum")
    return {"kl_sum": state[0].cpu(), "rows": state[1].cpu(), "updates": updates}


def load_metric_state(metric: AttentionKLDivergence, state: Mapping[str, Any], trainer: Trainer | None) -> None:
    """Restore what :func:`metric_state` saved: global rank 0 takes the group's sums, the other ranks start from 0,
    so the synced value over the rest of the epoch is the uninterrupted run's (example: :func:`metric_state`)."""
    kl_sum, rows = state["kl_sum"], state["rows"]
    if tuple(kl_sum.shape) != tuple(metric.kl_sum.shape):
        return
    metric.reset()
    rank = trainer.global_rank if trainer is not None else 0
    if rank == 0:
        metric.kl_sum = kl_sum.to(metric.kl_sum)
        metric.rows = rows.to(metric.rows)
    metric._update_count = int(state.get("updates", 0))  # non-zero on every rank: all of them log the epoch


class LossTermCallback(Callback):
    """Base of the callbacks that add a term to the loss ``training_step`` returns.

    Callback hooks cannot change the loss, so in ``setup`` the callback takes part in the module's
    ``training_step`` (and ``validation_step``) through :mod:`lightning_streamkl.step_wrapper`, and leaves it in
    ``teardown`` or when a run raises. A subclass sets :attr:`config` (with the
    :class:`~lightning_streamkl.AttentionKLOptions`), returns its metric state from :meth:`_metrics`, and
    implements the step protocol of :class:`~lightning_streamkl.step_wrapper.StepRunner`; epoch values are logged
    here.

    Example:
        >>> from lightning_streamkl import ContinualAttentionRegularizer, StreamKLDistillation
        >>> [issubclass(c, LossTermCallback) for c in (StreamKLDistillation, ContinualAttentionRegularizer)]
        [True, True]
    """

    config: AttentionKLOptions

    def __init__(self) -> None:
        super().__init__()
        self._module: LightningModule | None = None
        self._wrapped: list[str] = []

    def _metrics(self) -> DistillationMetrics | None:
        raise NotImplementedError

    def _wrap_steps(self, pl_module: LightningModule, stage: str) -> None:
        """Take part in ``training_step`` (``fit``) and ``validation_step`` (when it exists and
        ``validation`` is on)."""
        self._module = pl_module
        methods = [("training_step", "train")] if stage == "fit" else []
        if self.config.validation and is_overridden("validation_step", pl_module):
            methods.append(("validation_step", "val"))
        for method, step_stage in methods:
            step_wrapper.install(pl_module, method, step_stage, self)  # type: ignore[arg-type]
            self._wrapped.append(method)

    def _unwrap_steps(self, pl_module: LightningModule) -> None:
        for method in self._wrapped:
            step_wrapper.uninstall(pl_module, method, self)  # type: ignore[arg-type]
        self._wrapped = []
        self._module = None

    def _takes_part(self, stage: str) -> bool:
        """Whether this step of ``stage`` is distilled (validation: not while sanity checking, only with
        ``validation``)."""
        module = self._module
        assert module is not None
        return stage == "train" or (not module.trainer.sanity_checking and self.config.validation)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        metrics = self._metrics()
        if metrics is not None:
            log_epoch(pl_module, metrics, "train", prog_bar=self.config.prog_bar)

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        metrics = self._metrics()
        if metrics is not None and not trainer.sanity_checking:
            log_epoch(pl_module, metrics, "val", prog_bar=self.config.prog_bar)


class EngineCallback(LossTermCallback):
    """Base of the callbacks that adapt one engine with one metric state
    (:class:`~lightning_streamkl.StreamKLDistillation`, :class:`~lightning_streamkl.IndexerDistillation`): their
    ``setup``, ``teardown``, checkpoint state and the end of a step, written once.

    A subclass holds its engine in ``_distiller`` (with ``setup(module)``, ``describe()``, ``weight_at(step)`` and
    ``clear()``) and its :class:`~lightning_streamkl.DistillationMetrics` in ``_state``, initialises
    ``_train_batches`` and ``_val_batches`` to 0, sets :attr:`alternative`, :attr:`state_version`, :attr:`names_key`
    and :attr:`verb`, and implements :meth:`_names`, :meth:`_terms` and the step protocol's ``_step_begin`` and
    ``_student_recording``.

    Example:
        >>> from lightning_streamkl import IndexerDistillation, StreamKLDistillation
        >>> [issubclass(c, EngineCallback) for c in (StreamKLDistillation, IndexerDistillation)]
        [True, True]
    """

    #: The mixin that check_trainer's messages name as the way to use manual optimization.
    alternative: str | None = None
    #: The version written into the checkpoint state.
    state_version: int = 1
    #: The key of the term names (pairs, layers) in the checkpoint state and the state key.
    names_key: str = "pairs"
    #: What the callback does with its terms, in the message about a checkpoint written with other names.
    verb: str = "distils"
    #: Whether the adapter lays its teacher out for FSDP and model parallelism (:func:`place_teacher`); the others
    #: refuse those strategies.
    sharding: bool = False
    #: Whether :meth:`_prepare` prints the engine's ``describe()`` line; False for an engine that logs it itself at
    #: the end of its first step, when it can name each pair's product precision (:class:`AttentionDistiller`).
    describe_at_setup: bool = True
    #: The module the layers were last resolved on.
    _prepared_for: LightningModule | None = None

    _distiller: Any
    _state: DistillationMetrics
    _train_batches: int
    _val_batches: int

    def _names(self) -> list[str]:
        """The names of the terms (the metric's), in order."""
        raise NotImplementedError

    def _terms(self, stage: str, batch: Any, step: int) -> tuple[LossOutput, Mapping[str, torch.Tensor] | None]:
        """This step's loss terms (releasing what was captured) and any extra values to log with them."""
        raise NotImplementedError

    @property
    def train_metric(self) -> AttentionKLDivergence:
        """The training :class:`~lightning_streamkl.AttentionKLDivergence` (reset every epoch)."""
        return self._state.train

    @property
    def val_metric(self) -> AttentionKLDivergence:
        """The validation :class:`~lightning_streamkl.AttentionKLDivergence`."""
        return self._state.val

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(name=self.config.name, **{self.names_key: tuple(self._names())})

    def _metrics(self) -> DistillationMetrics:
        return self._state

    def _step_cleanup(self) -> None:
        self._distiller.clear()

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage not in ("fit", "validate"):
            warn_stage_without_term(type(self).__name__, self.config.name, stage)
            return
        check_trainer(self, trainer, pl_module, stage, alternative=self.alternative, sharding=self.sharding)
        if not is_overridden("configure_model", pl_module):  # else the model may not exist yet: on_*_start
            self._prepare(trainer, pl_module)
        self._wrap_steps(pl_module, stage)

    def _prepare(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Resolve the layers and, when :attr:`sharding`, lay the teacher out for the strategy (once per module)."""
        first = self._prepared_for is not pl_module
        self._distiller.setup(pl_module)
        if self.sharding:
            place_teacher(trainer, pl_module, self._distiller)
        self._prepared_for = pl_module
        if first and self.describe_at_setup:
            rank_zero_info(self._distiller.describe())

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._prepare(trainer, pl_module)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._prepare(trainer, pl_module)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._unwrap_steps(pl_module)
        self._step_cleanup()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # a run that raises skips `teardown`: restore the module's step methods anyway, so the module can be trained
        # again (with or without this callback) after the crash
        self.teardown(trainer, pl_module, trainer.state.fn or "fit")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": self.state_version,
            "name": self.config.name,
            self.names_key: self._names(),
            "train_batches": self._train_batches,
            "val_batches": self._val_batches,
            "train_metric": metric_state(self.train_metric, getattr(self._module, "_trainer", None)),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._train_batches = int(state_dict.get("train_batches", 0))
        self._val_batches = int(state_dict.get("val_batches", 0))
        saved, names = state_dict.get(self.names_key), self._names()
        if saved is not None and list(saved) != names:
            rank_zero_warn(f"StreamKL {self.config.name!r}: the checkpoint was written with {self.names_key} "
                           f"{list(saved)}, this run {self.verb} {names}.")
        elif state_dict.get("train_metric") is not None:
            load_metric_state(self.train_metric, state_dict["train_metric"], getattr(self._module, "_trainer", None))

    def _step_end(self, stage: str, batch: Any, output: Any) -> Any:
        module = self._module
        assert module is not None
        if output is None and stage == "train":
            return output  # the user skipped this batch
        step = module.trainer.global_step
        terms, extra = self._terms(stage, batch, step)
        log_step(module, self._state, stage, terms, log_on_step=self.config.log_on_step, prog_bar=self.config.prog_bar,
                 extra=extra)
        if stage != "train":
            self._val_batches += 1
            return output
        self._train_batches += 1
        return add_to_loss(output, terms.total * self._distiller.weight_at(step), type(self).__name__)
