"""What self-distillation under LoRA saves: the teacher as the student with its adapters switched off
(``AdaptersOff``) against the usual frozen copy of the base model, on the CPU.

Each mode runs in a fresh process: a Llama of ~34M parameters gets LoRA adapters (PEFT, r=8 on q/k/v/o), then the
teacher is made (a deep copy of the base model taken before the adapters went in, or ``AdaptersOff()``) and a few
training steps run with attention KL on the last layer. Measured: the bytes of teacher parameters that are not the
student's own (``untyped_storage`` pointers), and the process's resident memory (``VmRSS``, ``VmHWM`` from
``/proc/self/status``) before the teacher is made and after the steps.

    python benchmarks/lora_memory.py                         # both modes, writes the results file and the docs table
    python benchmarks/lora_memory.py --report                # only the table, from the committed file
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import re
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "lora_self_distillation_cpu.json"
DOC = ROOT / "docs" / "guides" / "recipes.md"
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import write_blocks  # noqa: E402

MODES = ("frozen_copy", "adapters_off")
MODEL = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8,
         "intermediate_size": 1376, "vocab_size": 8000}
LORA = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "lora_dropout": 0.0}
STEPS, BATCH, LENGTH = 4, 4, 128


def _memory() -> dict[str, int]:
    """Resident and peak resident bytes of this process (Linux)."""
    status = Path("/proc/self/status").read_text()
    return {key: int(re.search(rf"^{key}:\s+(\d+) kB", status, re.M).group(1)) * 1024 for key in ("VmRSS", "VmHWM")}


def measure(mode: str) -> dict:
    """One mode, in this process: build the LoRA student, make the teacher, train ``STEPS`` steps."""
    import peft
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_streamkl import AdaptersOff, AttentionDistiller

    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**MODEL, attn_implementation="sdpa", pad_token_id=0))
    student = peft.get_peft_model(base, peft.LoraConfig(**LORA))
    optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=1e-3)
    batch = {"input_ids": torch.randint(1, MODEL["vocab_size"], (BATCH, LENGTH)),
             "attention_mask": torch.ones(BATCH, LENGTH, dtype=torch.long)}
    batch["labels"] = batch["input_ids"]
    before = _memory()
    if mode == "frozen_copy":  # the usual teacher: a copy of the pretrained weights (the LoRA wrappers stripped)
        teacher = copy.deepcopy(student.get_base_model())
        for name, module in list(teacher.named_modules()):  # a plain copy: the LoRA wrappers replaced by base layers
            if isinstance(module, peft.tuners.lora.LoraLayer):
                parent, _, child = name.rpartition(".")
                setattr(teacher.get_submodule(parent), child, module.get_base_layer())
    else:
        teacher = AdaptersOff()
    distiller = AttentionDistiller(teacher, {"pairs": [[-1, -1]]}, student=student)
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        kd = distiller(batch)
        (distiller.student_output.loss + kd).backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    after = _memory()
    own = {p.untyped_storage().data_ptr() for p in student.parameters()}
    teacher_params = list(distiller.teacher_module.parameters())
    extra = sum(p.numel() * p.element_size() for p in teacher_params if p.untyped_storage().data_ptr() not in own)
    return {"mode": mode, "student_params": sum(p.numel() for p in student.parameters()),
            "trainable_params": sum(p.numel() for p in student.parameters() if p.requires_grad),
            "teacher_params": sum(p.numel() for p in teacher_params), "teacher_extra_param_bytes": extra,
            "rss_before": before["VmRSS"], "rss_after": after["VmRSS"], "peak_before": before["VmHWM"],
            "peak_after": after["VmHWM"], "step_s": times}


def run() -> dict:
    runs = []
    for mode in MODES:
        out = subprocess.run([sys.executable, __file__, "--measure", mode], check=True, capture_output=True,
                             text=True, cwd=ROOT)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    import peft
    import torch

    return {"meta": {"device": f"CPU ({platform.machine()}, {os.cpu_count()} cores)", "torch": torch.__version__,
                     "peft": peft.__version__, "threads": 1,
                     "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
                     "command": "python benchmarks/lora_memory.py"},
            "setup": {"model": MODEL, "lora": LORA, "steps": STEPS, "batch": BATCH, "length": LENGTH},
            "runs": runs}


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def markdown(results: dict) -> str:
    """The docs' table of a results file."""
    meta, setup = results["meta"], results["setup"]
    runs = {r["mode"]: r for r in results["runs"]}
    copy_run, off = runs["frozen_copy"], runs["adapters_off"]
    lines = [f"`{meta['command']}`: a Llama of {copy_run['teacher_params'] / 1e6:.1f}M parameters with LoRA "
             f"(r={setup['lora']['r']} on {'/'.join(m.split('_')[0] for m in setup['lora']['target_modules'])}, "
             f"{copy_run['trainable_params'] / 1e6:.2f}M trainable), {setup['steps']} training steps of batch "
             f"{setup['batch']} × {setup['length']} tokens with attention KL on the last layer, one fresh process per "
             f"teacher; {meta['device']}, torch {meta['torch']}, peft {meta['peft']}, {meta['date']}.", "",
             "| teacher | teacher parameters that are not the student's | resident memory added by the teacher and the "
             "steps | peak resident memory |", "|---|---|---|---|"]
    for mode, label in (("frozen_copy", "a frozen copy of the base model"),
                        ("adapters_off", "`AdaptersOff()`: the student, adapters off")):
        r = runs[mode]
        lines.append(f"| {label} | {_mib(r['teacher_extra_param_bytes'])} MiB | "
                     f"{_mib(r['rss_after'] - r['rss_before'])} MiB | {_mib(r['peak_after'])} MiB |")
    saved = (copy_run["rss_after"] - copy_run["rss_before"]) - (off["rss_after"] - off["rss_before"])
    lines += ["", f"Resident memory saved by `AdaptersOff()`: {_mib(saved)} MiB, against "
              f"{_mib(copy_run['teacher_extra_param_bytes'])} MiB of copied parameters."]
    return "\n".join(lines)


def update_docs(results: dict, doc: Path = DOC) -> None:
    write_blocks(str(doc), {"lora:memory": markdown(results)})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measure", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--report", action="store_true", help="only print the committed file's table (and put it in "
                                                              "the docs)")
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return
    if args.report:
        results = json.loads(RESULTS.read_text())
    else:
        results = run()
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(results))
    if DOC.exists():
        update_docs(results)


if __name__ == "__main__":
    main()
