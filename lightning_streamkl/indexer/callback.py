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

from ..adapter import EngineCallback, LossTermCallback
from ..engine import padding_mask_from_batch
from ..loss import LossOutput
from ..options import signature_from_fields
from .config import IndexerConfig, IndexerLayer, load_indexer_config, validate_indexer_config
from .engine import IndexerDistiller

__all__ = ["IndexerDistillation"]


class IndexerDistillation(EngineCallback):
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

    alternative = "IndexerDistillationMixin"
    names_key = "layers"
    verb = "trains"

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

    # ------------------------------------------------------------------------------------------ the engine
    def _names(self) -> list[str]:
        return list(self._distiller.layer_names)

    def _terms(self, stage: str, batch: Any, step: int) -> tuple[LossOutput, dict[str, torch.Tensor]]:
        terms = self._distiller.end_step(batch, step=step, training=stage == "train")
        sparse = float(self._distiller.stage_at(step) == "sparse")
        return terms, {"sparse": torch.tensor(sparse, device=terms.rows.device)}

    # ------------------------------------------------------------------------------------------ the step
    def _step_begin(self, stage: str, batch: Any) -> bool:
        if not self._takes_part(stage):
            return False
        self._distiller.clear()
        return True

    def _student_recording(self) -> AbstractContextManager[None]:
        return self._distiller.recording()

