r"""
Indexer distillation callback
^^^^^^^^^^^^^^^^^^^^^^^^^^^^^

:class:`IndexerDistillation`: train lightning indexers against the model's own main attention with no change to the
LightningModule, a thin Lightning adapter over :class:`~lightning_streamkl.indexer.IndexerDistiller` built like
:class:`~lightning_streamkl.StreamKLDistillation` (the same step wrapping, logging, metric state and checks).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from ..adapter import LossTermCallback, add_to_loss, check_trainer, load_metric_state, log_step, metric_state
from ..engine import DistillationMetrics, padding_mask_from_batch
from ..metrics import AttentionKLDivergence
from ..options import signature_from_fields
from .config import IndexerConfig, IndexerLayer, load_indexer_config, validate_indexer_config
from .engine import IndexerDistiller

__all__ = ["IndexerDistillation"]

_STATE_VERSION = 1


class IndexerDistillation(LossTermCallback):
    r"""Add the lightning-indexer loss (DeepSeek-V3.2) to a LightningModule's training loss.

    On every training batch the callback records, during the module's own forward pass, the main attention's
    ``(q, k)`` at the configured layers and the indexers' ``(q_idx, k_idx, w_idx)``
    (:func:`~lightning_streamkl.indexer.record_indexer`; :class:`~lightning_streamkl.LightningIndexer` calls it),
    and adds

    .. math::

        \mathrm{weight} \cdot \mathrm{ramp}(t) \cdot \sum_l w_l \, \overline{\mathrm{KL}}_l

    to the loss ``training_step`` returns, where :math:`\overline{\mathrm{KL}}_l` is the mean over the query rows
    of :func:`streamkl.indexer_kl` for layer :math:`l`: KL from the head-averaged main attention (a constant:
    ``q`` and ``k`` are detached) to the indexer's softmax. Before ``sparse_from_step`` it is the dense warm-up
    (every allowed key); from it on, the sparse stage, over the ``topk`` keys with the highest indexer logits
    (chosen without gradient, among the keys each row may see). No ``N × N`` map is materialised by the loss.

    The main model's parameters stay out of the loss: the target is detached, and at the first training step
    (``check_detached``) the callback follows the autograd graph of the indexers' inputs and raises if it reaches
    a parameter outside the indexer modules. Train the main model with its own loss as usual, or freeze it.

    Logs (``<name>`` is the config's ``name``, default ``indexer_kl``): ``train/<name>/<layer>``,
    ``train/<name>/total`` and ``train/<name>/sparse`` (1 in the sparse stage) per step and, at epoch end, the
    row-weighted epoch values from :class:`~lightning_streamkl.AttentionKLDivergence` (synced across processes)
    under the same keys; ``val/<name>/...`` at the end of each validation run.

    Args:
        layers: the layers: :class:`~lightning_streamkl.IndexerLayer` objects, mappings of its fields, or
            attention layer references (an index into the model's attention layers or a module path, relative
            to the LightningModule), each with its indexer at ``<attention path>.indexer`` unless it says otherwise.
        options: every other field of :class:`~lightning_streamkl.IndexerConfig` (``topk``, ``sparse_from_step``,
            ``weight``, ``capture``, ...), as keyword arguments; the signature lists them.

    Raises:
        TypeError: a config value of the wrong type.
        ValueError: a bad config value or key (the message names it), or, in ``setup``, an unknown layer or a
            missing indexer module (the message lists the closest names).
        MisconfigurationException: in ``setup``, an unsupported strategy (FSDP, DeepSpeed, model parallel), manual
            optimization, a ``dataloader_iter`` training step, or two instances with the same ``name``.

    Example::

        >>> from lightning_streamkl import IndexerDistillation
        >>> callback = IndexerDistillation(layers=[0, 1], topk=64, sparse_from_step=500)
        >>> callback.state_key
        "IndexerDistillation{'name': 'indexer_kl', 'layers': ('l0', 'l1')}"

        then ``Trainer(callbacks=[callback]).fit(module)``, with a :class:`~lightning_streamkl.LightningIndexer`
        attached to each of the module's first two attention layers.
    """

    @signature_from_fields(IndexerConfig, skip=("layers",))
    def __init__(self, layers: Sequence[IndexerLayer | Mapping[str, Any] | int | str], **options: Any) -> None:
        super().__init__()
        self._init(validate_indexer_config({**options, "layers": layers}))

    def _init(self, config: IndexerConfig) -> None:
        self.config = config  # type: ignore[assignment]
        self._distiller = IndexerDistiller(config, padding_mask=self.padding_mask)
        self._state = self._distiller.metrics()
        self._train_batches = 0
        self._val_batches = 0

    @classmethod
    def from_config(cls, config: IndexerConfig | Mapping[str, Any] | str) -> IndexerDistillation:
        """Build from an :class:`~lightning_streamkl.IndexerConfig`, a mapping, or a YAML path/text.

        Example:
            >>> cb = IndexerDistillation.from_config("layers: [-1]\\ntopk: 32\\nsparse_from_step: 10")
            >>> cb.config.topk, cb.config.layers[0].label
            (32, 'l-1')
        """
        cfg = load_indexer_config(config) if isinstance(config, str) else validate_indexer_config(config)
        self = cls.__new__(cls)
        LossTermCallback.__init__(self)
        self._init(cfg)
        return self

    # ------------------------------------------------------------------------------------------ overridables
    def padding_mask(self, batch: Any) -> torch.Tensor | None:
        """The ``[B, N]`` bool padding mask (True = real token) of ``batch``; default: ``batch[mask_key]``."""
        return padding_mask_from_batch(batch, self.config.mask_key)

    # ------------------------------------------------------------------------------------------ public
    @property
    def distiller(self) -> IndexerDistiller:
        """The engine this callback adapts (captures, stages, loss)."""
        return self._distiller

    @property
    def train_metric(self) -> AttentionKLDivergence:
        """The training per-layer KL metric (reset every epoch)."""
        return self._state.train

    @property
    def val_metric(self) -> AttentionKLDivergence:
        """The validation per-layer KL metric."""
        return self._state.val

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(name=self.config.name, layers=tuple(self._distiller.layer_names))

    # ------------------------------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage not in ("fit", "validate"):
            return
        check_trainer(self, trainer, pl_module, stage, alternative="IndexerDistillationMixin")
        self._distiller.setup(pl_module)
        self._wrap_steps(pl_module, stage)
        rank_zero_info(self._distiller.describe())

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._unwrap_steps(pl_module)
        self._distiller.clear()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, trainer.state.fn or "fit")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "name": self.config.name,
            "layers": list(self._distiller.layer_names),
            "train_batches": self._train_batches,
            "val_batches": self._val_batches,
            "train_metric": metric_state(self.train_metric, getattr(self._module, "_trainer", None)),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._train_batches = int(state_dict.get("train_batches", 0))
        self._val_batches = int(state_dict.get("val_batches", 0))
        saved = state_dict.get("layers")
        if saved is not None and list(saved) != list(self._distiller.layer_names):
            rank_zero_warn(f"StreamKL {self.config.name!r}: the checkpoint was written with layers {list(saved)}, "
                           f"this run trains {self._distiller.layer_names}.")
        elif state_dict.get("train_metric") is not None:
            load_metric_state(self.train_metric, state_dict["train_metric"], getattr(self._module, "_trainer", None))

    # ------------------------------------------------------------------------------------------ the step
    def _metrics(self) -> DistillationMetrics:
        return self._state

    def _step_begin(self, stage: str, batch: Any) -> bool:
        if not self._takes_part(stage):
            return False
        self._distiller.clear()
        return True

    def _student_recording(self) -> AbstractContextManager[None]:
        return self._distiller.recording()

    def _step_end(self, stage: str, batch: Any, output: Any) -> Any:
        module = self._module
        assert module is not None
        if output is None and stage == "train":
            return output  # the user skipped this batch
        step = module.trainer.global_step
        terms = self._distiller.end_step(batch, step=step, training=stage == "train")
        sparse = torch.tensor(float(self._distiller.stage_at(step) == "sparse"), device=terms.rows.device)
        log_step(module, self._state, stage, terms, log_on_step=self.config.log_on_step,
                 prog_bar=self.config.prog_bar, extra={"sparse": sparse})
        if stage != "train":
            self._val_batches += 1
            return output
        self._train_batches += 1
        return add_to_loss(output, terms.total * self._distiller.weight_at(step), type(self).__name__)

    def _step_cleanup(self) -> None:
        self._distiller.clear()
