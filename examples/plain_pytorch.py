"""Attention distillation in a plain PyTorch loop: no Lightning, the engine alone (``loss = distiller(batch)``).

    python examples/plain_pytorch.py
"""

from __future__ import annotations

import torch
from lightning_tiny import TokenDataModule, llama_config, take, tiny_teacher
from transformers import LlamaForCausalLM

from lightning_streamkl import AttentionDistiller


def main(max_steps: int = 60) -> dict[str, float]:
    torch.manual_seed(1)
    teacher = tiny_teacher()  # any nn.Module; e.g. AutoModelForCausalLM.from_pretrained(...)
    student = LlamaForCausalLM(llama_config(hidden_size=16, num_kv_heads=1))
    distiller = AttentionDistiller(teacher, {"pairs": [[-1, -1]], "weight": 5.0}, student=student)
    optimizer = torch.optim.Adam(student.parameters(), lr=0.01)
    kls = []
    for batch in take(TokenDataModule().train_dataloader(), max_steps):
        kd = distiller(batch)  # teacher pass, student forward, weight · attention KL (differentiable)
        task_loss = distiller.student_output.loss  # the student's own output of that forward
        (task_loss + kd).backward()
        optimizer.step()
        optimizer.zero_grad()
        kls.append(float(kd.detach()) / 5.0)
    return {"task_loss": float(task_loss.detach()), "attn_kl_first": kls[0], "attn_kl_last": kls[-1],
            "steps": distiller.steps}


if __name__ == "__main__":
    print(main())
