"""Sparse-attention indexer training: a DeepSeek-V3.2 lightning indexer learns the model's own main attention.

:class:`IndexerDistillation` (the callback, :mod:`.callback`) and :class:`IndexerDistillationMixin` (:mod:`.mixin`)
adapt one Lightning-free engine, :class:`IndexerDistiller` (:mod:`.engine`), configured by :class:`IndexerConfig`
(:mod:`.config`). :class:`LightningIndexer` (:mod:`.module`) is the indexer itself; any other indexer hands its
inputs over with :func:`record_indexer` (:mod:`.capture`). :mod:`.selection` holds the top-k selection of the sparse
stage and the share of the attention's mass a selection captures.
"""

from .callback import IndexerDistillation
from .capture import CapturedIndexer, IndexerCapture, indexer_recording, record_indexer
from .config import IndexerConfig, IndexerLayer, load_indexer_config, validate_indexer_config
from .engine import IndexerDistiller, parameters_reached
from .mixin import IndexerDistillationMixin
from .module import LightningIndexer
from .selection import best_topk_attention_mass, indexer_logits, indexer_topk, topk_attention_mass

__all__ = [
    "CapturedIndexer",
    "IndexerCapture",
    "IndexerConfig",
    "IndexerDistillation",
    "IndexerDistillationMixin",
    "IndexerDistiller",
    "IndexerLayer",
    "LightningIndexer",
    "best_topk_attention_mass",
    "indexer_logits",
    "indexer_recording",
    "indexer_topk",
    "load_indexer_config",
    "parameters_reached",
    "record_indexer",
    "topk_attention_mass",
    "validate_indexer_config",
]
