r"""
Indexer distillation mixin
^^^^^^^^^^^^^^^^^^^^^^^^^^

:class:`IndexerDistillationMixin`: the same engine as :class:`~lightning_streamkl.IndexerDistillation`
(:class:`~lightning_streamkl.indexer.IndexerDistiller`), called from the module's own ``training_step``, for modules
that want the term in their hands (manual optimization, a separate optimizer for the indexers, ...). Its batch
hooks live in a small callback the module adds to its trainer (``configure_callbacks``), as
:class:`~lightning_streamkl.AttentionDistillationMixin` does.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from ..adapter import load_metric_state, log_epoch, log_step, metric_state
from ..engine import DistillationMetrics
from .config import IndexerConfig, IndexerLayer, load_indexer_config, validate_indexer_config
from .engine import IndexerDistiller

__all__ = ["IndexerDistillationMixin"]

_MISSING_CALLBACK = (
    "the mixin's batch hooks did not run: they live in a callback that configure_callbacks() adds, so if you "
    "override configure_callbacks, return super().configure_callbacks()'s callbacks too"
)


class IndexerDistillationMixin:
    r"""Give a LightningModule ``self.indexer_distillation_loss()``, the lightning-indexer loss of its own attention.

    Call :meth:`configure_indexer_distillation` once (in ``__init__``); then every training and validation batch
    records the main attention's ``(q, k)`` at the configured layers and the indexers' inputs (the mixin adds a
    callback that opens the recording when a batch starts), and :meth:`indexer_distillation_loss` returns
    ``weight · ramp · Σ_l w_l · KL_l`` (differentiable w.r.t. the indexers only) for the stage of the current
    optimizer step, and releases what was captured. Add it to your loss yourself. Logging, the epoch metrics
    (``self.train_indexer_kl``, ``self.val_indexer_kl``) and the checks are the callback's
    (:class:`~lightning_streamkl.IndexerDistillation`).

    Put the mixin before ``LightningModule`` in the bases. If you override ``configure_callbacks``,
    ``on_save_checkpoint`` or ``on_load_checkpoint``, call ``super()``.

    Example::

        >>> import torch, lightning as L
        >>> from torch import nn
        >>> from lightning_streamkl import IndexerDistillationMixin, LightningIndexer
        >>> class Model(IndexerDistillationMixin, L.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.attn = nn.MultiheadAttention(16, 4, batch_first=True)
        ...         LightningIndexer(16, heads=2, head_dim=8).attach(self.attn)
        ...         self.configure_indexer_distillation(layers=[0], causal=True)
        ...     def training_step(self, batch, batch_idx):
        ...         out, _ = self.attn(batch, batch, batch, need_weights=False)
        ...         return out.pow(2).mean() + self.indexer_distillation_loss()
        >>> model, x = Model(), torch.randn(2, 6, 16)
        >>> with model.capture_indexer_inputs():              # what a Trainer does when a batch starts
        ...     _ = model.attn(x, x, x, need_weights=False)
        >>> loss = model.indexer_distillation_loss(x)
        >>> loss.requires_grad, bool(loss > 0)
        (True, True)
    """

    _indexer_metrics: DistillationMetrics

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._indexer: IndexerDistiller | None = None
        self._indexer_batch: Any = None
        self._indexer_recording: AbstractContextManager[Any] | None = None
        self._indexer_warned = False

    def configure_indexer_distillation(
        self,
        layers: Sequence[IndexerLayer | Mapping[str, Any] | int | str] | None = None,
        *,
        config: IndexerConfig | Mapping[str, Any] | str | None = None,
        **options: Any,
    ) -> IndexerConfig:
        """Set the config (the options of :class:`~lightning_streamkl.IndexerConfig`).

        Args:
            layers: the layers (or put them in ``config``).
            config: a config, mapping or YAML path/text; ``layers`` and ``options`` override its fields.
            options: any other :class:`~lightning_streamkl.IndexerConfig` field.

        Returns:
            The validated config.
        """
        base: dict[str, Any] = {}
        if config is not None:
            cfg = load_indexer_config(config) if isinstance(config, str) else validate_indexer_config(config)
            base = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
        if layers is not None:
            base["layers"] = layers
        cfg = validate_indexer_config({**base, **options})
        distiller = IndexerDistiller(cfg)
        object.__setattr__(self, "_indexer", distiller)
        metrics = distiller.metrics()
        object.__setattr__(self, "_indexer_metrics", metrics)
        self.train_indexer_kl = metrics.train
        self.val_indexer_kl = metrics.val
        return cfg

    # ------------------------------------------------------------------------------------------ public
    @contextmanager
    def capture_indexer_inputs(self) -> Iterator[None]:
        """Record the main attention layers and the indexers inside the block (a Trainer opens one per batch)."""
        distiller = self._indexer_ready()
        with distiller.recording():
            yield

    def indexer_distillation_loss(self, batch: Any = None, *, step: int | None = None, log: bool = True,
                                  ) -> torch.Tensor:
        """The weighted indexer term of the current batch (default: the batch the trainer is on), for the stage of
        optimizer step ``step`` (default: the trainer's ``global_step``, else 0). Call it after the forward pass.

        Raises:
            RuntimeError: :meth:`configure_indexer_distillation` was not called, or nothing was recorded (the
                message says what is missing).
        """
        distiller = self._indexer_ready()
        trainer = getattr(self, "_trainer", None)
        if batch is None:
            batch = self._indexer_batch
        if not distiller.recorded:
            distiller.clear()
            raise RuntimeError(
                "indexer_distillation_loss(): nothing was recorded. Run the model's forward first; " +
                (f"in a Trainer, {_MISSING_CALLBACK}." if trainer is not None and self._indexer_recording is None
                 else "outside a Trainer, use `with self.capture_indexer_inputs():`.")
            )
        self._indexer_stop()
        if step is None:
            step = trainer.global_step if trainer is not None else 0
        stage = self._indexer_stage()
        terms = distiller.end_step(batch, step=step, training=stage == "train")
        if stage == "train" or (stage == "val" and distiller.config.validation):
            sparse = torch.tensor(float(distiller.stage_at(step) == "sparse"), device=terms.rows.device)
            log_step(self, self._indexer_metrics, stage, terms,  # type: ignore[arg-type]
                     log_on_step=log and distiller.config.log_on_step, prog_bar=distiller.config.prog_bar,
                     extra={"sparse": sparse})
        return terms.total * distiller.weight_at(step)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Save the training metric's epoch-so-far sums. If you override this hook, call ``super()``."""
        super().on_save_checkpoint(checkpoint)  # type: ignore[misc]
        distiller = self.__dict__.get("_indexer")
        if distiller is not None:
            checkpoint[self._indexer_checkpoint_key()] = {
                "layers": list(distiller.layer_names),
                "train_metric": metric_state(self.train_indexer_kl, getattr(self, "_trainer", None)),
            }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore what :meth:`on_save_checkpoint` saved (ignored when the layers differ). If you override this
        hook, call ``super()``."""
        super().on_load_checkpoint(checkpoint)  # type: ignore[misc]
        distiller = self.__dict__.get("_indexer")
        saved = checkpoint.get(self._indexer_checkpoint_key()) if distiller is not None else None
        if saved is not None and list(saved["layers"]) == list(distiller.layer_names):
            load_metric_state(self.train_indexer_kl, saved["train_metric"], getattr(self, "_trainer", None))

    def configure_callbacks(self) -> Sequence[Callback] | Callback:
        """Add the callback that runs the mixin's batch hooks. If you override this hook, include ``super()``'s
        callbacks."""
        own = super().configure_callbacks()  # type: ignore[misc]
        own = list(own) if isinstance(own, Sequence) else [own]
        return [*own, _IndexerMixinHooks()]

    # ------------------------------------------------------------------------------------------ internals
    def _indexer_checkpoint_key(self) -> str:
        return f"IndexerDistillationMixin[{self._indexer.config.name}]"  # type: ignore[union-attr]

    def _indexer_ready(self) -> IndexerDistiller:
        distiller = self.__dict__.get("_indexer")
        if distiller is None:
            raise RuntimeError("Call self.configure_indexer_distillation(layers=...) first (in __init__).")
        distiller.setup(self)  # type: ignore[arg-type]
        return distiller

    def _indexer_stage(self) -> str | None:
        trainer = getattr(self, "_trainer", None)
        if trainer is None:
            return "train"
        if trainer.state.stage == RunningStage.TRAINING:
            return "train"
        if trainer.state.stage == RunningStage.VALIDATING:
            return "val"
        return None

    def _indexer_start(self, batch: Any) -> None:
        self._indexer_stop(clear=True)
        self._indexer_batch = batch
        ctx = self.capture_indexer_inputs()
        ctx.__enter__()
        self._indexer_recording = ctx

    def _indexer_stop(self, clear: bool = False) -> None:
        ctx, self._indexer_recording = self._indexer_recording, None
        if ctx is not None:
            ctx.__exit__(None, None, None)
        if clear:
            self._indexer_batch = None
            if self._indexer is not None:
                self._indexer.clear()

    def _indexer_end_training_batch(self) -> None:
        distiller = self._indexer
        if distiller is not None and distiller.recorded and not self._indexer_warned:
            self._indexer_warned = True
            rank_zero_warn(f"{type(self).__name__}: training_step ran the model but never called "
                           "self.indexer_distillation_loss(), so no indexer learned in this batch.")
        self._indexer_stop(clear=True)


class _IndexerMixinHooks(Callback):
    """The batch and epoch hooks of an :class:`IndexerDistillationMixin` module (added by its
    ``configure_callbacks``)."""

    @staticmethod
    def _configured(pl_module: Any) -> bool:
        return isinstance(pl_module, IndexerDistillationMixin) and pl_module.__dict__.get("_indexer") is not None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._configured(pl_module) and stage in ("fit", "validate"):
            rank_zero_info(pl_module._indexer_ready().describe())

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._configured(pl_module):
            pl_module._indexer_start(batch)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._configured(pl_module):
            pl_module._indexer_end_training_batch()

    def on_validation_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        if self._configured(pl_module):
            pl_module._indexer_start(batch)

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        if self._configured(pl_module):
            pl_module._indexer_stop(clear=True)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self._configured(pl_module):
            log_epoch(pl_module, pl_module._indexer_metrics, "train", prog_bar=pl_module._indexer.config.prog_bar)

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self._configured(pl_module) and not trainer.sanity_checking:
            log_epoch(pl_module, pl_module._indexer_metrics, "val", prog_bar=pl_module._indexer.config.prog_bar)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if isinstance(pl_module, IndexerDistillationMixin):
            pl_module._indexer_stop(clear=True)
