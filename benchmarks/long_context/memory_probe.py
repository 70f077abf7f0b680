"""Live and peak CUDA memory of one training step, phase by phase: the plain student, the student with attention KL
and a teacher that stops early, and with a teacher that runs whole (B=4, N=16384, the experiment's models).

Written to find why the early-exit step held more memory than the full one (the stopped frames stayed alive; fixed
in ``lightning_streamkl.teacher.stop_after``). Its output before and after the fix is
``benchmarks/results/long_context_h100/early_exit_memory_probe.txt``. Run on a CUDA machine::

    PYTHONPATH=kernels:. python benchmarks/long_context/memory_probe.py
"""

from __future__ import annotations

import copy
import os
import sys

import torch

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]
from experiment import GPU  # noqa: E402
from mqar import MQAR, ModelConfig, autocast, batch_for, distiller_for, kl_terms, task_loss  # noqa: E402

MIB = 2**20


def _now(device: torch.device) -> tuple[float, float]:
    return torch.cuda.memory_allocated(device) / MIB, torch.cuda.max_memory_allocated(device) / MIB


def step_phases(variant: str, teacher: torch.nn.Module, student: torch.nn.Module, task: MQAR,
                device: torch.device, steps: int = 4) -> dict[str, tuple[float, float]]:
    """(live MiB, peak MiB) after each phase of the last of ``steps`` steps; ``variant``: none, early or full."""
    model = copy.deepcopy(student)
    distiller = None if variant == "none" else distiller_for(teacher, model, [[0, 0], [1, 1]],
                                                             early_exit=variant == "early")
    opt = torch.optim.AdamW(model.parameters())
    phases: dict[str, tuple[float, float]] = {}
    for step in range(steps):
        batch = batch_for(task, 0, step, (16384, 4), device)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        phases = {"start": _now(device)}
        with autocast(device):
            if distiller is not None:
                distiller.begin_step(batch)
                torch.cuda.synchronize(device)
                phases["teacher"] = _now(device)
                with distiller.student_recording():
                    logits = model(batch["input_ids"])
                phases["student_fwd"] = _now(device)
                terms = kl_terms(distiller, batch, "all")
                phases["kl_fwd"] = _now(device)
                loss = task_loss(logits, batch["labels"])[0] + terms.total
            else:
                logits = model(batch["input_ids"])
                phases["student_fwd"] = _now(device)
                loss = task_loss(logits, batch["labels"])[0]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        torch.cuda.synchronize(device)
        phases["end"] = _now(device)
    return phases


def main() -> None:
    device = torch.device("cuda")
    task = MQAR(**GPU["task"])
    torch.manual_seed(0)
    teacher = ModelConfig(**GPU["teacher"]).build(task.vocab_size).to(device)
    student = ModelConfig(**GPU["student"]).build(task.vocab_size).to(device)
    for variant in ("none", "early", "full", "early", "none"):
        phases = step_phases(variant, teacher, student, task, device)
        print(variant, {k: f"alloc {a:.0f} MiB / peak {m:.0f} MiB" for k, (a, m) in phases.items()}, flush=True)


if __name__ == "__main__":
    main()
