r"""
Attention distillation mixin
^^^^^^^^^^^^^^^^^^^^^^^^^^^^

For LightningModules that want explicit control: the same capture and loss as
:class:`~lightning_streamkl.StreamKLDistillation`, called from the module's own ``training_step``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.trainer.states import RunningStage
from torch import nn

from ._distiller import Distiller
from .callback import load_metric_state, metric_state
from .config import LayerPair, StreamKLConfig, load_config, validate_config
from .metrics import AttentionKLDivergence


class AttentionDistillationMixin:
    r"""Give a LightningModule ``self.attention_distillation_loss()``.

    Call :meth:`configure_attention_distillation` once (in ``__init__``); then every training and validation
    batch records the student's ``(q, k)`` at the paired layers (from ``on_train_batch_start`` /
    ``on_validation_batch_start``: if you override those hooks, call ``super()``), and
    :meth:`attention_distillation_loss` runs the teacher on the batch, returns
    ``weight · ramp · Σ_p w_p · KL_p`` (differentiable) and releases the captured tensors. Add it to your loss
    yourself, which also works with manual optimization. Per-step values are logged as
    ``train/<name>/<pair>`` and ``train/<name>/total``, epoch values (row-weighted, synced across processes)
    from the metrics registered as ``self.train_attention_kl`` and ``self.val_attention_kl``.

    Put the mixin before ``LightningModule`` (or your existing module class) in the bases; its ``__init__``
    takes nothing of its own and passes any arguments on to ``super().__init__``.

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
        >>> student = Student(teacher=encoder())
        >>> with student.capture_student_attention():            # what the batch-start hook does in a Trainer
        ...     _ = student.encoder(torch.randn(2, 5, 16))
        >>> loss = student.attention_distillation_loss(torch.randn(2, 5, 16))
        >>> loss.requires_grad, bool(loss > 0)
        (True, True)
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._streamkl: Distiller | None = None
        self._streamkl_batch: Any = None
        self._streamkl_recording: AbstractContextManager[Any] | None = None

    def configure_attention_distillation(
        self,
        teacher: nn.Module | str,
        pairs: Sequence[LayerPair | Mapping[str, Any] | Sequence[Any]] | None = None,
        *,
        config: StreamKLConfig | Mapping[str, Any] | str | None = None,
        teacher_forward: Callable[[nn.Module, Any], Any] | None = None,
        **options: Any,
    ) -> StreamKLConfig:
        """Set the teacher and the config (the options of :class:`~lightning_streamkl.StreamKLConfig`).

        Args:
            teacher: the teacher module, or a Hugging Face model name/path. It is frozen and kept out of the
                module's submodules (so out of checkpoints and optimizers).
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
        base.update(options)
        cfg = validate_config(base)
        distiller = Distiller(teacher, cfg, teacher_forward)
        object.__setattr__(self, "_streamkl", distiller)  # not a submodule: keeps the teacher out of state_dict
        self.train_attention_kl = distiller.make_metric()
        self.val_attention_kl = distiller.make_metric()
        return cfg

    # ------------------------------------------------------------------------------------------ public
    @contextmanager
    def capture_student_attention(self) -> Iterator[None]:
        """Record the student's paired layers inside the block (the batch-start hooks open one for you)."""
        distiller = self._streamkl_ready()
        with distiller.student_recording():
            yield

    def attention_distillation_loss(self, batch: Any = None, *, log: bool = True) -> torch.Tensor:
        """Run the teacher on ``batch`` (default: the current batch) and return the weighted attention-KL term.

        Call it after the student's forward pass on that batch. Outside a Trainer, run the student forward
        inside :meth:`capture_student_attention`.

        Raises:
            RuntimeError: :meth:`configure_attention_distillation` was not called, no batch is known, or the
                student's paired layers were not recorded (e.g. an overridden batch-start hook skipped ``super()``).
        """
        distiller = self._streamkl_ready()
        if batch is None:
            batch = self._streamkl_batch
            if batch is None:
                raise RuntimeError("attention_distillation_loss() has no batch: pass it, or call it from a step.")
        student = distiller.student_capture
        assert student is not None
        if not student.records:
            distiller.clear()
            raise RuntimeError(
                "attention_distillation_loss(): the student's paired layers were not recorded. Run the student's "
                "forward first; in a Trainer, recording starts in on_train_batch_start/on_validation_batch_start "
                "(call super() if you override them); outside one, use `with self.capture_student_attention():`."
            )
        self._streamkl_stop()  # nothing after this point (e.g. a checkpointed re-forward) is recorded
        distiller.place_teacher(self._streamkl_device(), self)  # type: ignore[arg-type]
        distiller.run_teacher(batch)
        terms = distiller.compute(batch)
        stage = self._streamkl_stage()
        trainer = self._streamkl_trainer()
        step = trainer.global_step if trainer is not None else 0
        if stage == "train" or (stage == "val" and distiller.config.validation):
            metric = self._streamkl_metric(stage)
            metric.to(terms.rows.device)
            metric.update(terms.kl_sums, terms.rows)
            if log and trainer is not None and stage == "train" and distiller.config.log_on_step:
                name = distiller.config.name
                values = {f"train/{name}/{k}": v.detach() for k, v in terms.per_pair.items()}
                values[f"train/{name}/total"] = terms.total.detach()
                self.log_dict(values, on_step=True, on_epoch=False)  # type: ignore[attr-defined]
        return terms.total * distiller.weight_at(step)

    # ------------------------------------------------------------------------------------------ hooks
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Any:
        out = super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        self._streamkl_start(batch)
        return out

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(outputs, batch, batch_idx)  # type: ignore[misc]
        self._streamkl_stop(clear=True)

    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        super().on_validation_batch_start(batch, batch_idx, dataloader_idx)  # type: ignore[misc]
        if self._streamkl is not None:
            self._streamkl_start(batch)  # (sanity-check batches are computed but not counted in the metric)

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        super().on_validation_batch_end(outputs, batch, batch_idx, dataloader_idx)  # type: ignore[misc]
        self._streamkl_stop(clear=True)

    def on_train_epoch_end(self) -> None:
        super().on_train_epoch_end()  # type: ignore[misc]
        self._streamkl_log_epoch("train")

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()  # type: ignore[misc]
        trainer = self._streamkl_trainer()
        if not (trainer and trainer.sanity_checking):
            self._streamkl_log_epoch("val")

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
        """Add a callback that closes the student's recording when a run raises (Lightning then skips the
        batch-end hooks that close it otherwise). If you override this hook, include ``super()``'s callbacks."""
        own = super().configure_callbacks()  # type: ignore[misc]
        own = list(own) if isinstance(own, Sequence) else [own]
        return [*own, _CloseRecordingOnException()]

    # ------------------------------------------------------------------------------------------ internals
    def _streamkl_checkpoint_key(self) -> str:
        return f"AttentionDistillationMixin[{self._streamkl.config.name}]"  # type: ignore[union-attr]

    def _streamkl_ready(self) -> Distiller:
        distiller = self.__dict__.get("_streamkl")
        if distiller is None:
            raise RuntimeError("Call self.configure_attention_distillation(teacher, pairs=...) first (in __init__).")
        distiller.setup(self)  # type: ignore[arg-type]
        return distiller

    def _streamkl_trainer(self) -> Any:
        return getattr(self, "_trainer", None)

    def _streamkl_device(self) -> torch.device:
        param = next(self.parameters(), None)  # type: ignore[attr-defined]
        return param.device if param is not None else torch.device("cpu")

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
        if self.__dict__.get("_streamkl") is None:
            return
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

    def _streamkl_metric(self, stage: str) -> AttentionKLDivergence:
        return self.train_attention_kl if stage == "train" else self.val_attention_kl

    def _streamkl_log_epoch(self, stage: str) -> None:
        if self.__dict__.get("_streamkl") is None:
            return
        metric = self._streamkl_metric(stage)
        if metric.update_count == 0:
            return
        values = {f"{stage}/{k}": v for k, v in metric.compute().items()}
        self.log_dict(values, on_step=False, on_epoch=True, sync_dist=True)  # type: ignore[attr-defined]
        metric.reset()


class _CloseRecordingOnException(Callback):
    """Closes an :class:`AttentionDistillationMixin` module's open recording when a run raises."""

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if isinstance(pl_module, AttentionDistillationMixin):
            pl_module._streamkl_stop(clear=True)
