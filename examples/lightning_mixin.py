"""Attention distillation with AttentionDistillationMixin: explicit control inside your own training_step.

    python examples/lightning_mixin.py
"""

from __future__ import annotations

import lightning as L
from lightning_tiny import CausalLMModule, TokenDataModule, tiny_teacher

from lightning_streamkl import AttentionDistillationMixin, LayerPair


class DistilledLM(AttentionDistillationMixin, CausalLMModule):
    def __init__(self, teacher, **kwargs) -> None:
        super().__init__(**kwargs)
        self.configure_attention_distillation(teacher, pairs=[LayerPair(teacher=0, student=0, name="first")],
                                              weight=5.0, warmup_steps=10)

    def training_step(self, batch, batch_idx):
        task_loss = self.model(**batch).loss  # the student's (q, k) are captured during this forward
        self.log("train/task_loss", task_loss)
        return task_loss + self.attention_distillation_loss()  # teacher forward + weighted attention KL

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        self.attention_distillation_loss()  # accumulates val/attn_kl/... (logged at the end of validation)


def main(max_steps: int = 60, **trainer_kwargs) -> dict[str, float]:
    L.seed_everything(0)
    model = DistilledLM(tiny_teacher())
    trainer = L.Trainer(max_steps=max_steps, **trainer_kwargs)
    trainer.fit(model, datamodule=TokenDataModule())
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


if __name__ == "__main__":
    for name, value in sorted(main(accelerator="cpu", logger=False, enable_checkpointing=False).items()):
        print(f"{name:24s} {value:.4f}")
