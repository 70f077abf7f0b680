"""Attention distillation with the StreamKLDistillation callback: the student module stays unchanged.

    python examples/lightning_callback.py
"""

from __future__ import annotations

import lightning as L
from lightning_tiny import CausalLMModule, TokenDataModule, tiny_teacher

from lightning_streamkl import LayerPair, StreamKLDistillation


def main(max_steps: int = 60, **trainer_kwargs) -> dict[str, float]:
    L.seed_everything(0)
    teacher = tiny_teacher()  # any nn.Module; e.g. AutoModelForCausalLM.from_pretrained(...)
    student = CausalLMModule()  # your LightningModule, unchanged
    distill = StreamKLDistillation(
        teacher,  # frozen, run on every batch
        pairs=[LayerPair(teacher=0, student=0, name="first"), LayerPair(teacher=-1, student=-1, name="last")],
        weight=5.0,  # loss = task loss + 5 · (KL_first + KL_last)
    )
    trainer = L.Trainer(max_steps=max_steps, callbacks=[distill], **trainer_kwargs)
    # logs train/attn_kl/{first,last,total}_{step,epoch} and val/attn_kl/...
    trainer.fit(student, datamodule=TokenDataModule())
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


if __name__ == "__main__":
    for name, value in sorted(main(accelerator="cpu", logger=False, enable_checkpointing=False).items()):
        print(f"{name:24s} {value:.4f}")
