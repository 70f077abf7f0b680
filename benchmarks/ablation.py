"""Ablation of the distillation options on the default job (layers, direction, temperature, weight).

One teacher is trained once (the default config's teacher, seed 0) and saved; then, for every seed, a student
trains from the same initial weights and batches under each variant below, plus one student without attention KL.
Each student is scored by its held-out accuracy at the training length (N=128) and at N=256, and by the
optimizer step at which its training accuracy first passes 50 % (the sudden formation of the task's two-layer
circuit; "–" when it never does within the budget). Results go to ``benchmarks/results/ablation_cpu.json`` and the
table between the ``ablation`` markers of ``docs/guides/choosing.md``::

    python benchmarks/ablation.py                 # 3 seeds, about 20 minutes on 2 CPU cores
    python benchmarks/ablation.py --seeds 0       # one seed, a third of that
    python benchmarks/ablation.py --report        # only rewrite the docs table from the results file

Needs the ``cli`` extra (jsonargparse) like ``streamkl-distill`` itself.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import time
from datetime import datetime, timezone
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, ".."))
RESULTS = os.path.join(HERE, "results", "ablation_cpu.json")
sys.path.insert(0, HERE)
from common import write_blocks  # noqa: E402

DOC = os.path.join(ROOT, "docs", "guides", "choosing.md")

#: name -> command-line overrides of the default job's student with attention KL. ``None``: the student without
#: the term, which the default variant's run trains alongside (the job's baseline).
VARIANTS: dict[str, list[str] | None] = {
    "both layers, forward, T=1, weight 1 (default)": [],
    "layer 0 only": ["--distillation.pairs=[{teacher: model.blocks.0.attn, student: model.blocks.0.attn, "
                     "name: layer0}]"],
    "layer 1 only": ["--distillation.pairs=[{teacher: model.blocks.1.attn, student: model.blocks.1.attn, "
                     "name: layer1}]"],
    "direction reverse": ["--distillation.direction=reverse"],
    "temperature 0.5": ["--distillation.temperature=0.5"],
    "temperature 2": ["--distillation.temperature=2.0"],
    "weight 0.1": ["--distillation.weight=0.1"],
    "weight 10": ["--distillation.weight=10.0"],
    "no attention KL": None,
}
COMMON = ["--trainer.enable_progress_bar=false", "--job.plots=false", "--job.eval_lengths=[128, 256]",
          "--job.kl_eval_sequences=32", "--job.target_accuracy=null"]  # step-matched only (no training on to a target)


def _run(args: list[str]) -> dict[str, Any]:
    from lightning_streamkl.jobs.cli import main

    results = main(args).results
    return json.loads(json.dumps(results, default=str))  # as in the run's results.json (string keys)


def train_teacher(workdir: str) -> str:
    """Train the default config's teacher once (seed 0) and return its checkpoint path."""
    run_dir = os.path.join(workdir, "teacher")
    _run(COMMON + [f"--job.run_dir={run_dir}", "--job.save_teacher=true", "--job.baseline=false",
                   "--trainer.max_steps=1"])
    return os.path.join(run_dir, "teacher.ckpt")


def _row(results: dict[str, Any], run: str, name: str, seed: int) -> dict[str, Any]:
    acc = results["eval"]["accuracy"][run]
    return {"variant": name, "seed": seed, "acc_128": acc["128"], "acc_256": acc["256"],
            "steps_to_half": results["outcome"]["steps_to_half"][run],
            "teacher_acc_128": results["eval"]["accuracy"]["teacher"]["128"],
            "attention_kl": results["eval"]["attention_kl"][run]}


def run_variant(name: str, seed: int, teacher: str, workdir: str) -> list[dict[str, Any]]:
    """The rows of one variant's run: its student, and for the default variant also the student without the term."""
    overrides = VARIANTS[name]
    baseline = overrides == []
    run_dir = os.path.join(workdir, f"seed{seed}-{re.sub(r'[^a-z0-9]+', '-', name.lower())}")
    args = COMMON + [f"--seed_everything={seed}", f"--job.run_dir={run_dir}", f"--job.teacher_checkpoint={teacher}",
                     f"--job.baseline={str(baseline).lower()}"] + overrides
    results = _run(args)
    rows = [_row(results, "student_kl", name, seed)]
    if baseline:
        rows.append(_row(results, "student_base", "no attention KL", seed))
    return rows


def _mean_std(values: list[float]) -> str:
    m = sum(values) / len(values)
    s = (sum((v - m) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0
    return f"{100 * m:.1f} ± {100 * s:.1f}"


def markdown(results: dict[str, Any]) -> str:
    runs, meta = results["runs"], results["meta"]
    seeds = sorted({r["seed"] for r in runs})
    lines = [f"Default job (`streamkl-distill`, students 300 steps at N = 128), one teacher "
             f"({100 * runs[0]['teacher_acc_128']:.1f} % at N = 128), seeds {', '.join(map(str, seeds))}; "
             "accuracy in %, mean ± std over seeds; steps to 50 % per seed (– = not within 300 steps):\n",
             "| variant | held-out accuracy, N = 128 | N = 256 | steps to 50 % training accuracy |",
             "|---|---|---|---|"]
    for name in VARIANTS:
        group = sorted((r for r in runs if r["variant"] == name), key=lambda r: r["seed"])
        if not group:
            continue
        steps = ", ".join("–" if r["steps_to_half"] is None else str(int(r["steps_to_half"])) for r in group)
        lines.append(f"| {name} | {_mean_std([r['acc_128'] for r in group])} | "
                     f"{_mean_std([r['acc_256'] for r in group])} | {steps} |")
    lines.append("")
    lines.append(f"`python benchmarks/ablation.py`: {meta['device']}, torch {meta['torch']}, "
                 f"{meta['wall_seconds'] / 60:.0f} min, {meta['date']}.")
    return "\n".join(lines)


def update_docs(results: dict[str, Any]) -> None:
    write_blocks(DOC, {"ablation": markdown(results)})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", choices=[v for v, o in VARIANTS.items() if o is not None],
                        help="run only these variants (the first one also trains the student without the term)")
    parser.add_argument("--report", action="store_true", help="only rewrite the docs table from the results file")
    parser.add_argument("--output", default=RESULTS)
    args = parser.parse_args(argv)
    if args.report:
        with open(args.output) as f:
            results = json.load(f)
    else:
        import torch

        torch.set_num_threads(min(2, os.cpu_count() or 1))
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="streamkl-ablation-") as workdir:
            teacher = train_teacher(workdir)
            runs = []
            for seed in args.seeds:
                for name in args.variants or [v for v, o in VARIANTS.items() if o is not None]:
                    for r in run_variant(name, seed, teacher, workdir):
                        runs.append(r)
                        print(f"seed {seed} {r['variant']:48s} acc@128 {100 * r['acc_128']:5.1f}%  "
                              f"steps to 50%: {r['steps_to_half']}", file=sys.stderr)
        results = {"meta": {"device": f"CPU ({platform.machine()}, {os.cpu_count()} cores)", "torch": torch.__version__,
                            "wall_seconds": time.perf_counter() - start,
                            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d")},
                   "variants": VARIANTS, "runs": runs}
        os.makedirs(os.path.dirname(args.output), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)
    print(markdown(results))
    if os.path.abspath(args.output) == RESULTS:
        update_docs(results)


if __name__ == "__main__":
    main()
