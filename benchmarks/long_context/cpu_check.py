"""The CPU checks behind the long-context experiment's design (one seed each; a 2-core machine shared with others).

- ``length_nope`` / ``length_rope``: a 2-layer teacher (d=64, short convolution before each attention) trained on
  MQAR at N = 128 only, evaluated at up to 64 times that length, with no position encoding in its attention (NoPE) and
  with rotary embeddings (RoPE). Does the lookup carry to lengths never trained on?
- ``students_128`` / ``students_512``: a smaller student (d=32) trained from the same initial weights on the same
  batches without attention KL, with attention KL over every query row, and with attention KL over the task's query
  rows only, at N = 128 and at N = 512 with the same tokens and about the same scored positions per step. How many
  steps does each need, and does the gap grow with the context length?

Each check writes its entry of ``benchmarks/results/long_context_cpu.json``; :func:`markdown` renders the guide's
tables::

    python benchmarks/long_context/cpu_check.py                      # every check (about an hour on 2 busy cores)
    python benchmarks/long_context/cpu_check.py --checks length_nope  # one
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
for extra in (os.path.join(ROOT, "kernels"), ROOT):
    if extra not in sys.path:
        sys.path.append(extra)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402
from mqar import MQAR, ModelConfig, Schedule, count_params, evaluate, train  # noqa: E402

OUT = os.path.join(ROOT, "benchmarks", "results", "long_context_cpu.json")
TEACHER_CACHE = os.path.join(ROOT, "runs", "long_context_cpu", "teacher_nope.pt")

#: The task of the GPU experiment (run.py's GPU["task"]).
TASK = {"num_keys": 64, "num_values": 64, "num_noise": 32, "num_pairs": 8, "query_every": 16}
TEACHER = {"d_model": 64, "num_layers": 2, "num_heads": 4, "conv_kernel": 4}
STUDENT = {"d_model": 32, "num_layers": 2, "num_heads": 4, "conv_kernel": 4}
LR = 3e-3

CHECKS: dict[str, dict[str, Any]] = {
    "length_nope": {"kind": "length", "model": {**TEACHER, "position": "nope"}, "train": [128, 32], "steps": 800,
                    "eval": {128: 32, 512: 16, 2048: 8, 8192: 2}},
    "length_nope_logscale": {"kind": "length", "model": {**TEACHER, "position": "nope", "length_scale": True},
                             "train": [128, 32], "steps": 800, "eval": {128: 32, 512: 16, 2048: 8, 8192: 2}},
    # a short curriculum up to 2048 tokens: does the lookup then hold at 2, 4 and 8 times that?
    "curriculum_nope": {"kind": "length", "model": {**TEACHER, "position": "nope"},
                        "stages": [[500, [[128, 32]]], [300, [[512, 8], [2048, 2]]]],
                        "eval": {2048: 4, 4096: 2, 8192: 2, 16384: 1}},
    "curriculum_nope_logscale": {"kind": "length", "model": {**TEACHER, "position": "nope", "length_scale": True},
                                 "stages": [[500, [[128, 32]]], [300, [[512, 8], [2048, 2]]]],
                                 "eval": {2048: 4, 4096: 2, 8192: 2, 16384: 1}},
    "length_rope": {"kind": "length", "model": {**TEACHER, "position": "rope"}, "train": [128, 32], "steps": 800,
                    "eval": {128: 32, 512: 16, 2048: 8, 8192: 2}},
    "students_128": {"kind": "students", "train": [128, 32], "steps": 300, "eval": {128: 32, 512: 16, 2048: 4}},
    "students_512": {"kind": "students", "train": [512, 8], "steps": 300, "eval": {512: 16, 2048: 4}},
}
#: arm -> (attention-KL weight, rows)
ARMS = {"base": (0.0, "all"), "kl_all": (1.0, "all"), "kl_queries": (1.0, "queries")}


def _env() -> dict[str, Any]:
    return {"device": f"cpu ({platform.processor() or platform.machine()})", "torch": torch.__version__,
            "threads": torch.get_num_threads(), "python": platform.python_version()}


def _eval(model: torch.nn.Module, task: MQAR, spec: dict[int, int]) -> dict[str, Any]:
    out = {}
    for n, seqs in spec.items():
        out.update(evaluate(model, task, [n], sequences=seqs, batch_size=max(1, min(seqs, 8192 // n)),
                            device=torch.device("cpu")))
    return out


def _log(name: str):
    return lambda row: print(f"{name}: step {row['step']} loss {row['loss']:.3f} acc {row['acc']:.3f} "
                             f"[{row['train_s']:.0f} s]", flush=True)


def run_length(name: str, spec: dict[str, Any], task: MQAR) -> dict[str, Any]:
    torch.manual_seed(0)
    model = ModelConfig(**spec["model"]).build(task.vocab_size)
    stages = spec.get("stages") or [[spec["steps"], [spec["train"]]]]
    schedule = Schedule([(steps, [tuple(x) for x in shapes]) for steps, shapes in stages])
    r = train(model, task, schedule, seed=0, device=torch.device("cpu"), lr=LR, log_every=50, on_log=_log(name))
    if name == "length_nope":
        os.makedirs(os.path.dirname(TEACHER_CACHE), exist_ok=True)
        torch.save(model.state_dict(), TEACHER_CACHE)
    r.pop("snapshots")
    return {"params": count_params(model), "train": {k: v for k, v in r.items() if k != "step_ms"},
            "eval": _eval(model, task, spec["eval"])}


def _teacher(task: MQAR) -> torch.nn.Module:
    if not os.path.exists(TEACHER_CACHE):
        print("students: training the teacher first (length_nope)", flush=True)
        result = run_length("length_nope", CHECKS["length_nope"], task)
        _write("length_nope", CHECKS["length_nope"], result, 0.0)
    teacher = ModelConfig(**CHECKS["length_nope"]["model"]).build(task.vocab_size)
    teacher.load_state_dict(torch.load(TEACHER_CACHE, weights_only=True))
    return teacher


def run_students(name: str, spec: dict[str, Any], task: MQAR) -> dict[str, Any]:
    from run import distiller_for

    teacher = _teacher(task)
    torch.manual_seed(0)
    initial = ModelConfig(**STUDENT).build(task.vocab_size)
    n, b = spec["train"]
    out: dict[str, Any] = {"params": count_params(initial), "teacher_params": count_params(teacher), "arms": {}}
    for arm, (weight, rows) in ARMS.items():
        model = copy.deepcopy(initial)
        distiller = distiller_for(teacher, model, [[0, 0], [1, 1]]) if weight else None
        r = train(model, task, Schedule([(spec["steps"], [(n, b)])]), seed=0, device=torch.device("cpu"), lr=LR,
                  distiller=distiller, kl_weight=weight, kl_rows=rows, log_every=25, on_log=_log(f"{name}/{arm}"))
        r.pop("snapshots")
        out["arms"][arm] = {"train": {k: v for k, v in r.items() if k != "step_ms"},
                            "eval": _eval(model, task, spec["eval"])}
    return out


def _write(name: str, spec: dict[str, Any], result: dict[str, Any], wall: float) -> str:
    """Put check ``name``'s entry into :data:`OUT` (the other checks' entries are kept)."""
    checks = {}
    if os.path.exists(OUT):
        with open(OUT) as f:
            checks = json.load(f)
    checks[name] = {"check": name, "spec": {k: (v if k != "eval" else {str(n): s for n, s in v.items()})
                                            for k, v in spec.items()},
                    "task": TASK, "lr": LR, "student": STUDENT, "seed": 0, "result": result, "wall_s": wall,
                    "environment": _env()}
    with open(OUT, "w") as f:
        json.dump(checks, f, indent=1)
        f.write("\n")
    return OUT


# --------------------------------------------------------------------------------------------------- markdown
def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f} %"


def markdown(path: str = OUT) -> str:
    """Two tables: length generalisation of the teachers (RoPE, NoPE, NoPE with the log-length scale; trained at
    N = 128, or with a short curriculum up to 2048); the students' steps to 50 % and 90 %."""
    with open(path) as f:
        load = json.load(f).get

    lines = []
    rows = {"length_rope": "RoPE", "length_nope": "NoPE", "length_nope_logscale": "NoPE, log-length scale",
            "curriculum_nope": "NoPE", "curriculum_nope_logscale": "NoPE, log-length scale"}
    teachers = {name: data for name in rows if (data := load(name)) is not None}
    if teachers:
        ns = sorted({int(n) for d in teachers.values() for n in d["result"]["eval"]})
        lines += ["| teacher (d=64) | trained on N × batch (steps) | " + " | ".join(f"N = {n}" for n in ns) + " |",
                  "|---|---|" + "---|" * len(ns)]
        for name, data in teachers.items():
            spec = data["spec"]
            stages = spec.get("stages") or [[spec["steps"], [spec["train"]]]]
            trained = ", then ".join(" and ".join(f"{n} × {b}" for n, b in shapes) + f" ({steps})"
                                     for steps, shapes in stages)
            ev = data["result"]["eval"]
            lines.append(f"| {rows[name]} | {trained} | "
                         + " | ".join(_pct(ev[str(n)]["acc"]) if str(n) in ev else "–" for n in ns) + " |")
        lines.append("")
    students = [data for n in ("students_128", "students_512") if (data := load(n)) is not None]
    if students:
        labels = {"base": "without attention KL", "kl_all": "attention KL, every row",
                  "kl_queries": "attention KL, query rows"}
        lines += ["| student (d=32), N × batch | attention KL | step at 50 % | step at 90 % | held-out accuracy after "
                  "the last step |", "|---|---|---|---|---|"]
        for data in students:
            n, b = data["spec"]["train"]
            for arm, rec in data["result"]["arms"].items():
                reached = rec["train"]["reached"]
                step = [("–" if reached[t] is None else str(reached[t]["step"])) for t in ("0.5", "0.9")]
                acc = ", ".join(f"{_pct(v['acc'])} at {k}" for k, v in rec["eval"].items())
                lines.append(f"| {n} × {b} | {labels[arm]} | {step[0]} | {step[1]} | {acc} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checks", nargs="+", choices=list(CHECKS), default=list(CHECKS))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    task = MQAR(**TASK)
    for name in args.checks:
        spec = CHECKS[name]
        start = time.time()
        result = (run_length if spec["kind"] == "length" else run_students)(name, spec, task)
        print(f"wrote {_write(name, spec, result, time.time() - start)}", flush=True)


if __name__ == "__main__":
    main()
