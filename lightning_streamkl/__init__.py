"""Lightning integration of StreamKL attention distillation.

Three ways in, each a thin adapter over one Lightning-free engine (:class:`AttentionDistiller`): the
:class:`StreamKLDistillation` callback (add it to ``Trainer(callbacks=[...])``), the
:class:`AttentionDistillationMixin` (call ``self.attention_distillation_loss()`` from your own step), and the
:class:`ContinualAttentionRegularizer` (regularise attention toward frozen snapshots of the model taken at task
boundaries). LightningCLI YAML works too (``class_path: lightning_streamkl.StreamKLDistillation``). Layer pairs,
weights and options are :class:`StreamKLConfig` structured configs; :class:`AttentionKLDivergence` logs per-pair
divergence. :class:`IndexerDistillation` and :class:`IndexerDistillationMixin` (:mod:`lightning_streamkl.indexer`, an
engine and two adapters of their own) train a sparse-attention (DeepSeek-V3.2 lightning) indexer against the model's
own attention. The demo job (``streamkl-distill``) lives in :mod:`lightning_streamkl.jobs`, which this package never
imports.
"""

import logging

from .callback import StreamKLDistillation
from .capture import AttentionCapture, HFAttentionCapture, MultiheadAttentionCapture, RecorderCapture, record
from .config import AttentionKLOptions, LayerPair, StreamKLConfig, load_config, to_yaml, validate_config
from .continual import ContinualAttentionRegularizer, ContinualConfig
from .engine import AttentionDistiller, DistillationMetrics, DistillationStep
from .indexer import (
    IndexerConfig,
    IndexerDistillation,
    IndexerDistillationMixin,
    IndexerDistiller,
    IndexerLayer,
    LightningIndexer,
    record_indexer,
)
from .loss import AttentionDistillationLoss, explicit_pairs, last_k_pairs, last_to_last, layer_count, uniform_pairs
from .metrics import AttentionKLDivergence
from .mixin import AttentionDistillationMixin
from .teacher import AdaptersOff

# The pairing line each front door prints (INFO, from the engine) reaches the console as Lightning's own messages do:
# the package's logger prints INFO itself unless the application configured logging (a handler on the root logger).
_logger = logging.getLogger(__name__)
if not logging.getLogger().hasHandlers() and not _logger.handlers:
    _logger.setLevel(logging.INFO)
    _logger.addHandler(logging.StreamHandler())
    _logger.propagate = False

__all__ = [
    "AdaptersOff",
    "AttentionCapture",
    "AttentionDistillationLoss",
    "AttentionDistillationMixin",
    "AttentionDistiller",
    "AttentionKLDivergence",
    "AttentionKLOptions",
    "ContinualAttentionRegularizer",
    "ContinualConfig",
    "DistillationMetrics",
    "DistillationStep",
    "HFAttentionCapture",
    "IndexerConfig",
    "IndexerDistillation",
    "IndexerDistillationMixin",
    "IndexerDistiller",
    "IndexerLayer",
    "LayerPair",
    "LightningIndexer",
    "MultiheadAttentionCapture",
    "RecorderCapture",
    "StreamKLConfig",
    "StreamKLDistillation",
    "explicit_pairs",
    "last_k_pairs",
    "last_to_last",
    "layer_count",
    "load_config",
    "record",
    "record_indexer",
    "to_yaml",
    "uniform_pairs",
    "validate_config",
]
