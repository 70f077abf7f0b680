"""Does the default job's teacher get off the task's plateau when it trains on longer sequences? (a CPU check)

The recall task's two-layer circuit forms suddenly after a plateau; the first H100 run of ``gpu_long`` (1500 steps of
batch 8 at 1024-16384 tokens) never left it. This teacher-only run of ``streamkl-distill`` (the student trains one
step and is not compared) checks on a CPU that batches of 32 alternating between 128 and 512 tokens get the teacher
off the plateau, and how far what it learns carries beyond the lengths it saw::

    python benchmarks/teacher_plateau.py              # the check of docs/guides/long-context.md, ~40 min on 2 cores

Each check's run directory (``results.json``, ``report.md``, ``eval.csv``, ``config.yaml``) goes to
``benchmarks/results/teacher_plateau_cpu/<check>/``; docs/guides/long-context.md quotes them.
"""

from __future__ import annotations

import argparse
import os
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "results", "teacher_plateau_cpu")
KEEP = ("results.json", "report.md", "eval.csv", "config.yaml")

#: check -> the teacher's data and the evaluation lengths
CHECKS: dict[str, list[str]] = {
    "batch32_128_512": ["--job.teacher_data={seq_len: [128, 512], batch_size: 32}",
                        "--job.eval_lengths=[128, 512, 1024]"],
}
COMMON = ["--trainer.enable_progress_bar=false", "--job.plots=false", "--job.baseline=false", "--trainer.max_steps=1",
          "--job.teacher_steps=1200", "--job.eval_sequences=128", "--job.kl_eval_sequences=8"]


def run_check(name: str, out: str = OUT) -> str:
    """Run one check with ``streamkl-distill`` and keep the files the docs quote; returns its directory."""
    from lightning_streamkl.jobs.cli import main

    run_dir = os.path.relpath(os.path.join(out, name))  # relative, as the resolved config records it
    main([*COMMON, *CHECKS[name], f"--job.run_dir={run_dir}"])
    for entry in os.listdir(run_dir):  # per-run CSV logs and steps.csv: the histories are in results.json
        if entry not in KEEP:
            path = os.path.join(run_dir, entry)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    return run_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checks", nargs="+", choices=list(CHECKS), default=list(CHECKS))
    args = parser.parse_args(argv)
    for name in args.checks:
        print(f"wrote {run_check(name)}")


if __name__ == "__main__":
    main()
