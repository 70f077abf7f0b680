"""Small built-in tasks for the ``streamkl-distill`` job and the docs' examples (synthetic data, no downloads)."""

from .recall import CausalSelfAttention, RecallData, RecallModel, TinyTransformer, make_recall_batch

__all__ = ["CausalSelfAttention", "RecallData", "RecallModel", "TinyTransformer", "make_recall_batch"]
