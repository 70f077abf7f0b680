"""Integrations with other training libraries, one module each; ``import lightning_streamkl`` imports none of them.

- :mod:`lightning_streamkl.integrations.trl`: attention KL in TRL's trainers (``SFTTrainer``, ``DistillationTrainer``,
  ``GKDTrainer``) and any ``transformers.Trainer``.
"""
