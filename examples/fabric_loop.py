"""Attention distillation in a Lightning Fabric loop: a context manager around the student's forward pass.

    python examples/fabric_loop.py
"""

from __future__ import annotations

import torch
from lightning.fabric import Fabric
from lightning_tiny import TokenDataModule, llama_config, take, tiny_teacher
from transformers import LlamaForCausalLM

from lightning_streamkl import AttentionDistiller


def main(max_steps: int = 60, **fabric_kwargs) -> dict[str, float]:
    fabric = Fabric(**{"accelerator": "cpu", "devices": 1, **fabric_kwargs})
    fabric.seed_everything(1)
    teacher = tiny_teacher()  # frozen, moved to the student's device at the first step
    student = LlamaForCausalLM(llama_config(hidden_size=16, num_kv_heads=1))
    distiller = AttentionDistiller(teacher, {"pairs": [[-1, -1]], "weight": 5.0, "warmup_steps": 10},
                                   student=student)  # the module itself, before Fabric wraps it
    model, optimizer = fabric.setup(student, torch.optim.Adam(student.parameters(), lr=0.01))
    loader = fabric.setup_dataloaders(TokenDataModule().train_dataloader())
    kls = []
    for step, batch in enumerate(take(loader, max_steps)):
        with distiller.distilling(batch, step=step) as kd:  # the teacher runs, the student is recorded
            task_loss = model(**batch).loss
        fabric.backward(task_loss + kd.loss)  # kd.loss = ramp(step) · 5 · attention KL
        optimizer.step()
        optimizer.zero_grad()
        kls.append(float(kd.terms.total.detach()))
    return {"task_loss": float(task_loss.detach()), "attn_kl_first": kls[0], "attn_kl_last": kls[-1],
            "weight": kd.weight}


if __name__ == "__main__":
    print(main())
