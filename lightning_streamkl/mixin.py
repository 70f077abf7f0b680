r"""
Attention distillation mixin
^^^^^^^^^^^^^^^^^^^^^^^^^^^^

For LightningModules that want explicit control: the same engine as
:class:`~lightning_streamkl.StreamKLDistillation` (:class:`~lightning_streamkl.engine.AttentionDistiller`), called
from the module's own ``training_step``. The Lightning hooks it needs live in a small callback the module adds to
its own trainer (``configure_callbacks``), so overriding the module's batch hooks cannot switch them off.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from .adapter import (
    check_strategy,
    load_metric_state,
    log_epoch,
    log_step,
    metric_state,
    place_teacher,
    warn_stage_without_term,
)
from .config import LayerPair, StreamKLConfig, load_config, validate_config
from .engine import AttentionDistiller, DistillationMetrics
from .teacher import AdaptersOff

__all__ = ["AttentionDistillationMixin"]

#: What a step that could not record the student is missing, in every message that says so.
_MISSING_CALLBACK = (
    "the mixin's batch hooks did not run: they live in a callback that configure_callbacks() adds, so if you "
    "override configure_callbacks, return super().configure_callbacks()'s callbacks too"
)


class AttentionDistillationMixin:
    r"""Give a LightningModule ``self.attention_distillation_loss()``.

    Call :meth:`configure_attention_distillation` once (in ``__init__``); then every training and validation
    batch records the student's ``(q, k)`` at the paired layers (the mixin adds a callback to the trainer that
    opens the recording when a batch starts), and :meth:`attention_distillation_loss` runs the teacher on the
    batch, returns ``weight · ramp · Σ_p w_p · KL_p`` (differentiable) and releases the captured tensors. Add it
    to your loss yourself, which also works with manual optimization. Per-step values are logged as
    ``train/<name>/<pair>`` and ``train/<name>/total``, epoch values (row-weighted, synced across processes)
    from the metrics registered as ``self.train_attention_kl`` and ``self.val_attention_kl``. At the start of a
    fit the pairing is printed, as the callback does; a training step that records the student but never calls
    :meth:`attention_distillation_loss` gets one warning.

    Under ``FSDPStrategy`` and ``ModelParallelStrategy`` the teacher is sharded over the same processes, as with the
    callback (``teacher_sharding``); DeepSpeed and tensor parallelism are refused when the fit starts.

    Put the mixin before ``LightningModule`` (or your existing module class) in the bases; its ``__init__``
    takes nothing of its own and passes any arguments on to ``super().__init__``. If you override
    ``configure_callbacks``, include ``super().configure_callbacks()``; if you override ``on_save_checkpoint`` or
    ``on_load_checkpoint``, call ``super()``.

    Example::

        >>> import torch, lightning as L
        >>> from torch import nn
        >>> from lightning_streamkl import AttentionDistillationMixin
        >>> def encoder():
        ...     layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True)
        ...     return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        >>> class Student(AttentionDistillationMixin, L.LightningModule):
        ...     def __init__(self, teacher):
        ...         super().__init__()
        ...         self.encoder = encoder()
        ...         self.configure_attention_distillation(teacher, pairs=[[-1, -1]], causal=False)
        ...     def training_step(self, batch, batch_idx):
        ...         task_loss = self.encoder(batch).pow(2).mean()
        ...         return task_loss + self.attention_distillation_loss()
        >>> student = Student(teacher=nn.Sequential(encoder()))
        >>> x = torch.randn(2, 5, 16)
        >>> with student.capture_student_attention():            # what a Trainer does when a batch starts
        ...     _ = student.encoder(x)
        >>> loss = student.attention_distillation_loss(x)
        >>> loss.requires_grad, bool(loss > 0)
        (True, True)
    """

    _streamkl_metrics: DistillationMetrics

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._streamkl: AttentionDistiller | None = None
        self._streamkl_batch: Any = None
        self._streamkl_recording: AbstractContextManager[Any] | None = None
        self._streamkl_warned = False
        self._streamkl_taken = False  # attention_distillation_loss() ran since the student was last recorded

    def configure_attention_distillation(
        self,
        teacher: nn.Module | str | AdaptersOff,
        pairs: Sequence[LayerPair | Mapping[str, Any] | Sequence[Any]] | None = None,
        *,
        config: StreamKLConfig | Mapping[str, Any] | str | None = None,
        teacher_forward: Callable[[nn.Module, Any], Any] | None = None,
        **options: Any,
    ) -> StreamKLConfig:
        """Set the teacher and the config (the options of :class:`~lightning_streamkl.StreamKLConfig`).

        Args:
            teacher: the teacher module, or a Hugging Face model name/path. It is frozen and kept out of the
                module's submodules (so out of checkpoints and optimizers). ``AdaptersOff()``: the module itself with
                its adapters switched off (:class:`~lightning_streamkl.teacher.AdaptersOff`).
            pairs: the layer pairs (or put them in ``config``).
            config: a config, mapping or YAML path/text; ``pairs`` and ``options`` override its fields.
            teacher_forward: ``fn(teacher, batch)``; default as in the callback.
            options: any other :class:`~lightning_streamkl.StreamKLConfig` field.

        Returns:
            The validated config.
        """
        base: dict[str, Any] = {}
        if config is not None:
            cfg = load_config(config) if isinstance(config, str) else validate_config(config)
            base = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
        if pairs is not None:
            base["pairs"] = pairs
        cfg = validate_config({**base, **options})
        distiller = AttentionDistiller(teacher, cfg, teacher_forward=teacher_forward)
        object.__setattr__(self, "_streamkl", distiller)  # not a submodule: keeps the teacher out of state_dict
        metrics = distiller.metrics()
        object.__setattr__(self, "_streamkl_metrics", metrics)
        self.train_attention_kl = metrics.train
        self.val_attention_kl = metrics.val
        return cfg

    # ------------------------------------------------------------------------------------------ public
    @contextmanager
    def capture_student_attention(self) -> Iterator[None]:
        """Record the student's paired layers inside the block (in a Trainer, a callback opens one per batch)."""
        distiller = self._streamkl_ready()
        self._streamkl_taken = False
        with distiller.student_recording():
            yield

    def attention_distillation_loss(self, batch: Any = None, *, log: bool = True) -> torch.Tensor:
        """Run the teacher on ``batch`` (default: the current batch) and return the weighted attention-KL term.

        Call it after the student's forward pass on that batch. Outside a Trainer, run the student forward
        inside :meth:`capture_student_attention`.

        Raises:
            RuntimeError: :meth:`configure_attention_distillation` was not called, no batch is known, the
                student's paired layers were not recorded, or the term was already taken in this step (the first
                call releases the captured tensors); the message says what is missing.
        """
        distiller = self._streamkl_ready()
        trainer = self._streamkl_trainer()
        if self.__dict__.get("_streamkl_taken", False) and not distiller.student_recorded:
            raise RuntimeError(
                "attention_distillation_loss() was already taken in this step: the first call ran the teacher, "
                "returned the term and released the captured tensors. Call it once per step and reuse its value "
                "(e.g. `kd = self.attention_distillation_loss()`)."
            )
        if batch is None:
            batch = self._streamkl_batch
            if batch is None:
                where = f": {_MISSING_CALLBACK}" if trainer is not None else ""
                raise RuntimeError(
                    f"attention_distillation_loss() has no batch: pass it, or call it from a step{where}.")
        if not distiller.student_recorded:
            distiller.clear()
            raise RuntimeError(
                "attention_distillation_loss(): the student's paired layers were not recorded. Run the student's "
                "forward first; " + (f"in a Trainer, {_MISSING_CALLBACK}." if trainer is not None and
                                     self._streamkl_recording is None else
                                     "outside a Trainer, use `with self.capture_student_attention():`.")
            )
        self._streamkl_stop()  # nothing after this point (e.g. a checkpointed re-forward) is recorded
        terms = distiller.end_step(batch)
        self._streamkl_taken = True
        stage = self._streamkl_stage()
        if stage == "train" or (stage == "val" and distiller.config.validation):
            log_step(self, self._streamkl_metrics, stage, terms,  # type: ignore[arg-type]
                     log_on_step=log and distiller.config.log_on_step, prog_bar=distiller.config.prog_bar)
        return terms.total * distiller.weight_at(trainer.global_step if trainer is not None else 0)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Save the training metric's epoch-so-far sums (as the callback does), so that a mid-epoch resume logs
        the uninterrupted run's epoch values. If you override this hook, call ``super()``."""
        super().on_save_checkpoint(checkpoint)  # type: ignore[misc]
        distiller = self.__dict__.get("_streamkl")
        if distiller is not None:
            checkpoint[self._streamkl_checkpoint_key()] = {
                "pairs": list(distiller.loss.pair_names),
                "train_metric": metric_state(self.train_attention_kl, self._streamkl_trainer()),
            }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore what :meth:`on_save_checkpoint` saved (ignored when the pairs differ). If you override this
        hook, call ``super()``."""
        super().on_load_checkpoint(checkpoint)  # type: ignore[misc]
        distiller = self.__dict__.get("_streamkl")
        saved = checkpoint.get(self._streamkl_checkpoint_key()) if distiller is not None else None
        if saved is not None and list(saved["pairs"]) == list(distiller.loss.pair_names):
            load_metric_state(self.train_attention_kl, saved["train_metric"], self._streamkl_trainer())

    def configure_callbacks(self) -> Sequence[Callback] | Callback:
        """Add the callback that runs the mixin's batch hooks (open the student's recording when a batch starts,
        close it when it ends or the run raises, log epoch values, print the pairing). If you override this hook,
        include ``super()``'s callbacks."""
        own = super().configure_callbacks()  # type: ignore[misc]
        own = list(own) if isinstance(own, Sequence) else [own]
        return [*own, _MixinHooks()]

    # ------------------------------------------------------------------------------------------ internals
    def _streamkl_checkpoint_key(self) -> str:
        return f"AttentionDistillationMixin[{self._streamkl.config.name}]"  # type: ignore[union-attr]

    def _streamkl_ready(self) -> AttentionDistiller:
        distiller = self.__dict__.get("_streamkl")
        if distiller is None:
            raise RuntimeError("Call self.configure_attention_distillation(teacher, pairs=...) first (in __init__).")
        distiller.setup(self)  # type: ignore[arg-type]
        return distiller

    def _streamkl_trainer(self) -> Any:
        return getattr(self, "_trainer", None)

    def _streamkl_stage(self) -> str | None:
        trainer = self._streamkl_trainer()
        if trainer is None:
            return "train"
        stage = trainer.state.stage
        if stage == RunningStage.TRAINING:
            return "train"
        if stage == RunningStage.VALIDATING:
            return "val"
        return None

    def _streamkl_start(self, batch: Any) -> None:
        self._streamkl_stop(clear=True)
        self._streamkl_batch = batch
        ctx = self.capture_student_attention()
        ctx.__enter__()
        self._streamkl_recording = ctx

    def _streamkl_stop(self, clear: bool = False) -> None:
        ctx, self._streamkl_recording = self._streamkl_recording, None
        if ctx is not None:
            ctx.__exit__(None, None, None)
        if clear:
            self._streamkl_batch = None
            if self._streamkl is not None:
                self._streamkl.clear()

    def _streamkl_end_training_batch(self) -> None:
        distiller = self._streamkl
        if distiller is not None and distiller.student_recorded and not self._streamkl_warned:
            self._streamkl_warned = True
            rank_zero_warn(
                f"{type(self).__name__}: training_step ran the student's paired layers but never called "
                "self.attention_distillation_loss(), so nothing was distilled in this batch; add it to the loss "
                "training_step returns."
            )
        self._streamkl_stop(clear=True)


class _MixinHooks(Callback):
    """The batch and epoch hooks of an :class:`AttentionDistillationMixin` module (added by its
    ``configure_callbacks``)."""

    @staticmethod
    def _configured(pl_module: Any) -> bool:
        return isinstance(pl_module, AttentionDistillationMixin) and pl_module.__dict__.get("_streamkl") is not None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._configured(pl_module):
            warn_stage_without_term(f"{type(pl_module).__name__} (AttentionDistillationMixin)",
                                    pl_module._streamkl.config.name, stage)
        if self._configured(pl_module) and stage in ("fit", "validate"):
            check_strategy(f"{type(pl_module).__name__} (AttentionDistillationMixin)", trainer, sharding=True)
            if not is_overridden("configure_model", pl_module):  # else the model may not exist yet: on_*_start
                self._prepare(trainer, pl_module)

    @staticmethod
    def _prepare(trainer: Any, pl_module: Any) -> None:
        """Resolve the layers and lay the teacher out for the strategy (once per module)."""
        place_teacher(trainer, pl_module, pl_module._streamkl_ready())  # (the engine logs its pairing line itself)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self._configured(pl_module):
            self._prepare(trainer, pl_module)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self._configured(pl_module):
            self._prepare(trainer, pl_module)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._configured(pl_module):
            pl_module._streamkl_start(batch)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._configured(pl_module):
            pl_module._streamkl_end_training_batch()

    def on_validation_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        if self._configured(pl_module):
            pl_module._streamkl_start(batch)  # (sanity-check batches are computed but not counted in the metric)

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        if self._configured(pl_module):
            pl_module._streamkl_stop(clear=True)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self._configured(pl_module):
            log_epoch(pl_module, pl_module._streamkl_metrics, "train", prog_bar=pl_module._streamkl.config.prog_bar)

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self._configured(pl_module) and not trainer.sanity_checking:
            log_epoch(pl_module, pl_module._streamkl_metrics, "val", prog_bar=pl_module._streamkl.config.prog_bar)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if isinstance(pl_module, AttentionDistillationMixin):
            pl_module._streamkl_stop(clear=True)

