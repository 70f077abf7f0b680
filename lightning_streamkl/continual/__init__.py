"""Continual learning: regularise a model's attention toward frozen snapshots of itself taken at task boundaries.

:class:`ContinualAttentionRegularizer` (the callback, :mod:`.regularizer`) with its :class:`ContinualConfig`
(:mod:`.config`); the snapshots (:mod:`.snapshots`) and the choice of regularised layers (:mod:`.layers`) each have
their own module.
"""

from .config import SNAPSHOT_DEVICES, ContinualConfig, validate_continual_config
from .regularizer import ContinualAttentionRegularizer

__all__ = ["SNAPSHOT_DEVICES", "ContinualAttentionRegularizer", "ContinualConfig", "validate_continual_config"]
