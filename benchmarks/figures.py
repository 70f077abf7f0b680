"""Every figure that README.md and the docs quote, traced to the committed result file it comes from.

Tables are generated between ``<!-- name:start -->`` and ``<!-- name:end -->`` markers by the script that owns them
(``GENERATED`` lists them; this file renders the ``figures:*`` blocks). Figures in running text are *claims*: a page,
a phrase of that page, and the result file the phrase's numbers are formatted from. The check fails when

- a claimed phrase is not in its page (a number was edited by hand, or the results changed);
- a ``figures:*`` block differs from its rendering from the result files;
- a figure of the prose (a number with a unit, a decimal number, a p-value) is covered by no claim, no generated
  block and no entry of ``ALLOWED`` (figures that are not measurements: versions, hardware, test parameters).

    python benchmarks/figures.py            # check (exit status 1 and the problems if any)
    python benchmarks/figures.py --write    # rewrite the figures:* blocks from the result files
    python benchmarks/figures.py --list     # every claim and its source

tests/test_numbers.py runs the check. It reads committed files only; nothing is re-run.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import inspect
import json
import math
import os
import re
import statistics
import sys
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, ".."))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, HERE)

import report  # noqa: E402

#: the pages whose figures are checked (benchmarks.md is generated whole by report.py and tested there)
PAGES = ("README.md", "docs/guides/precision.md", "docs/index.md", "docs/quickstart.md",
         "docs/concepts/attention-distillation.md",
         "docs/concepts/streamkl.md", "docs/guides/choosing.md", "docs/guides/cli.md", "docs/guides/continual.md",
         "docs/guides/long-context.md", "docs/guides/lightning.md", "docs/guides/hf-models.md",
         "docs/guides/custom-attention.md", "docs/guides/real-teachers.md", "docs/guides/indexer.md",
         "docs/guides/sharding.md", "docs/concepts/architecture.md", "docs/guides/recipes.md",
         "docs/examples.md", "docs/faq.md", "docs/perf-notes.md", "docs/reliability.md", "docs/guides/trl.md")

#: generated blocks -> the script that writes them (each has a test comparing the block with that script's output)
GENERATED = {
    "bounds": "benchmarks/report.py", "tuning:best": "benchmarks/report.py", "tuning:pipeline": "benchmarks/report.py",
    "continual-results:cpu": "benchmarks/continual/run.py", "continual-results:cpu10": "benchmarks/continual/run.py",
    "continual-results:sweep": "benchmarks/continual/run.py",
    "continual-stats:cpu10": "benchmarks/continual/stats.py",
    "split-digits:tuning": "benchmarks/continual/split_digits.py",
    "split-digits:task-incremental": "benchmarks/continual/split_digits.py",
    "split-digits:class-incremental": "benchmarks/continual/split_digits.py",
    "split-digits:stats": "benchmarks/continual/split_digits.py",
    "minilm-sequence:tuning": "benchmarks/continual/minilm_sequence.py",
    "minilm-sequence:results": "benchmarks/continual/minilm_sequence.py",
    "minilm-sequence:stats": "benchmarks/continual/minilm_sequence.py",
    "minilm-sequence:memory": "benchmarks/continual/minilm_sequence.py",
    "minilm:results": "examples/minilm_attention_transfer.py",
    "minilm:relations": "examples/minilm_attention_transfer.py", "lora:memory": "benchmarks/lora_memory.py",
    "ablation": "benchmarks/ablation.py",  # written between <!-- ablation:table --> and <!-- /ablation -->
    "job-headline": "benchmarks/job_headline.py", "figures:quickstart-eval": "benchmarks/figures.py",
    "figures:gpu-long": "benchmarks/figures.py",
    # the long-context experiment: rendered by benchmarks/long_context/tables.py (and cpu_check.py) from its results
    **{f"figures:long-context-{name}": "benchmarks/long_context/tables.py"
       for name in ("findings", "setup", "cpu", "teacher", "students", "every-row", "runs", "cost")},
    "figures:readme-long-context": "benchmarks/long_context/tables.py",
    "figures:v4-first": "benchmarks/figures.py", "figures:v4-final": "benchmarks/figures.py",
    "indexer-gpu": "benchmarks/bench_indexer.py", "indexer-example": "examples/sparse_indexer.py",
    "sharding-gpu": "benchmarks/bench_sharding.py", "sharding-gpu-context": "benchmarks/bench_sharding.py",
    **{f"user-path:{name}": "benchmarks/user_path.py"
       for name in ("readme", "setup", "n4096", "n16384", "n32768", "naive", "accuracy")},
    "fused-dq:tiles": "benchmarks/bench_fused_dq.py", "fused-dq:op": "benchmarks/bench_fused_dq.py",
    "fused-dq:kernels": "benchmarks/bench_fused_dq.py",
    "hopper:tiles": "benchmarks/bench_hopper.py", "hopper:op": "benchmarks/bench_hopper.py",
    "hopper:checks": "benchmarks/bench_hopper.py", "pairs:table": "benchmarks/bench_pairs.py",
    "key-pass:tiles": "benchmarks/bench_hopper_key_pass.py", "key-pass:op": "benchmarks/bench_hopper_key_pass.py",
    "key-pass:checks": "benchmarks/bench_hopper_key_pass.py",
    "pairs:step": "benchmarks/bench_pairs.py",
    "lazy:tiles": "benchmarks/bench_lazy_frames.py", "lazy:op": "benchmarks/bench_lazy_frames.py",
    "gap": "benchmarks/report.py",
    "grid-refresh": "benchmarks/report.py",
    **{f"gluon-order:{name}": "benchmarks/bench_gluon_causal_order.py" for name in ("kernel", "op", "checks")},
    **{f"three-consumers:{name}": "benchmarks/bench_three_consumers.py" for name in ("op", "checks")},
    **{f"exp-diff:{name}": "benchmarks/bench_exponent_difference.py" for name in ("kernel", "op", "checks", "kl")},
    "causal-order:op": "benchmarks/bench_causal_order.py", "causal-order:checks": "benchmarks/bench_causal_order.py",
    "causal-order:paths": "benchmarks/bench_causal_order.py",
    "lazy:checks": "benchmarks/bench_lazy_frames.py",
    "ws:tiles": "benchmarks/bench_ws_key_pass.py", "ws:op": "benchmarks/bench_ws_key_pass.py",
    "ws:checks": "benchmarks/bench_ws_key_pass.py",
    "peeled:tiles": "benchmarks/bench_peeled_key_pass.py", "peeled:op": "benchmarks/bench_peeled_key_pass.py",
    "peeled:checks": "benchmarks/bench_peeled_key_pass.py",
    "bf16-dq:op": "benchmarks/bench_bf16_dq.py", "bf16-dq:memory": "benchmarks/bench_bf16_dq.py",
    "bf16-dq:checks": "benchmarks/bench_bf16_dq.py",
    "profile:kernels": "benchmarks/kernel_profile.py",
    "one-set:tiles": "benchmarks/bench_one_set_key_pass.py", "one-set:op": "benchmarks/bench_one_set_key_pass.py",
    "one-set:checks": "benchmarks/bench_one_set_key_pass.py",
    **{f"ws-fwd:{name}": "benchmarks/bench_ws_fused_forward.py" for name in ("one-warpgroup", "tiles", "op", "checks")},
}

#: figures in prose that are not measurements: (page or "*", regex of the phrase, evidence). The evidence of a
#: parameter is (a glob of files under the repository, a string one of them must contain); None for versions and
#: hardware.
ALLOWED: tuple[tuple[str, str, tuple[str, str] | None], ...] = (
    ("*", r"(?:torch|Triton|triton|Lightning|lightning|transformers|KaTeX|Python|omegaconf) \d+(?:\.\d+)+(?:\+cpu)?",
     None),
    ("*", r"4\.48\+", None),  # transformers versions
    ("*", r"80 ?GB(?: HBM3)?", None),  # the card
    ("*", r"2(?:-core| CPU)? cores", None),
    ("docs/perf-notes.md", r"2 × N·D·4 bytes|BLOCK_M×BLOCK_N = 128×64|128×64/4-warp", None),  # v0's launch
    ("docs/perf-notes.md", r"1\.07e9", None),  # E = 16·8192²: arithmetic
    ("*", r"32 MiB of fp32", ("kernels/streamkl/_triton/forward.py", "NARROW_DQ_MIN_BYTES = 32 << 20")),
    ("docs/faq.md", r"about 1e5", ("tests/streamkl/test_reliability.py", "q·k reaches ~1e5 > 65504")),
    ("docs/guides/real-teachers.md", r"8 × 4096 tokens",
     ("benchmarks/bench_real_teacher.py", "DOCS, DOC_LEN, HEADS = 8, 4096, 16")),
    ("docs/guides/indexer.md", r"756 TFLOP/s", ("benchmarks/bench_indexer.py", "BF16_FLOOR_FLOPS = 756e12")),
    ("docs/guides/indexer.md", r"90% of the card's memory", ("benchmarks/bench_indexer.py", "0.9 * memory_bytes")),
    ("docs/faq.md", r"about 1e-12", ("tests/streamkl/test_reference.py", "assert_close(kl, ref, 1e-12")),
    ("docs/reliability.md", r"≈60 nats", ("tests/streamkl/test_reliability.py", "KL ≈ 60 nats")),
    ("docs/reliability.md", r"~1e5", ("tests/streamkl/test_reliability.py", "q·k reaches ~1e5")),
    ("docs/reliability.md", r"N up to 8192", ("tests/streamkl/test_gpu.py", "n_q=8192")),
    ("docs/reliability.md", r"100, 500 and 1,000 steps",
     ("tests/lightning_streamkl/test_reliability_memory.py", "count_at=(100, 500, 1000)")),
    ("docs/reliability.md", r"every 25 steps from 50 to 300",
     ("tests/lightning_streamkl/test_ddp_gpu.py", "steps = tuple(range(50, 301, 25))")),
    ("docs/reliability.md", r"growth bounded at 256 KiB and 512 bytes per step",
     ("tests/lightning_streamkl/test_ddp_gpu.py", "assert slope <= 512")),
    ("docs/reliability.md", r"would add 12 KiB per step",
     ("tests/lightning_streamkl/test_ddp_gpu.py", "would add at least 12 KiB per step")),
    ("docs/reliability.md", r"rtol 1e-10", ("tests/lightning_streamkl/test_ddp.py", "rtol=1e-10")),
    ("docs/guides/sharding.md", r"74 GiB in bf16", ("benchmarks/bench_sharding.py", "74 GiB in bf16")),
    ("docs/reliability.md", r"< 1e-4", ("tests/lightning_streamkl/test_ddp_gpu.py", "RTOL = 1e-4")),
    ("docs/guides/hf-models.md", r"1e-9", ("tests/lightning_streamkl/test_capture_hf.py", "rtol=1e-9")),
    ("docs/guides/hf-models.md", r"1e-5", ("tests/lightning_streamkl/test_capture_implementations.py", "rtol=1e-5")),
    ("docs/reliability.md", r"relative 1e-9",
     ("tests/lightning_streamkl/test_capture_implementations.py", "rtol=1e-9")),
    ("docs/reliability.md", r"relative 1e-5",
     ("tests/lightning_streamkl/test_capture_implementations.py", "rtol=1e-5")),
    ("docs/examples.md", r"1e-9", ("tests/lightning_streamkl/test_minilm.py", "rtol=1e-9")),
    ("docs/guides/recipes.md", r"to 1e-10", ("tests/lightning_streamkl/test_adapters_off.py", "rtol=1e-10")),
    ("docs/guides/trl.md", r"relative 1e-9", ("tests/lightning_streamkl/test_trl.py", "rtol=1e-9")),
    ("docs/guides/trl.md", r"(?:TRL |trl>=)?1\.1[4-7](?:\.\d)?(?:,<1\.17)?", ("pyproject.toml", "trl>=1.14,<1.17")),
    ("docs/guides/trl.md", r"a 1\.1B Llama teacher, a 0\.25B student",
     ("benchmarks/user_path.py", "A Llama teacher of 1.1B parameters")),
    ("docs/guides/continual.md", r"40 steps", ("benchmarks/continual/run.py", "steps: int = 40")),
    ("docs/guides/continual.md", r"150 steps per task|150 Adam steps", ("benchmarks/continual/cpu.yaml",
                                                                        "steps_per_task: 150")),
    ("docs/guides/continual.md", r"batch 64", ("benchmarks/continual/cpu.yaml", "batch_size: 64")),
    ("docs/guides/continual.md", r"p < 0\.05|p ≥ it", ("benchmarks/continual/stats.py", "ALPHA = 0.05")),
    ("docs/guides/continual.md", r"cannot go below 0\.0625",  # 2/2^5: the exact sign-flip test over 5 pairs
     ("benchmarks/continual/minilm_sequence.py", "cannot go below 0.0625")),
    ("docs/guides/cli.md", r"2 points", ("**/report.py", "MARGIN = 0.02")),
    ("docs/guides/cli.md", r"below 50%", ("**/report.py", "t_ref < 0.5")),
    ("docs/guides/long-context.md", r"first 5 steps", ("**/distill.py", "self.step_times[5:]")),
    ("docs/guides/long-context.md", r"50 % and 90 % training accuracy",
     ("benchmarks/long_context/mqar.py", "thresholds: Sequence[float] = (0.5, 0.9)")),
    ("docs/guides/long-context.md", r"at most 1\.5× the time and 1\.2× the memory",
     ("benchmarks/long_context/tables.py", "TIME_TARGET, MEMORY_TARGET = 1.5, 1.2")),
    ("docs/guides/long-context.md", r"Two calls of at most 9 minutes",
     ("benchmarks/long_context/experiment.py", "two calls of at most 9 minutes")),
    ("docs/guides/choosing.md", r"50 %", ("**/report.py", '"train/acc", 0.5')),
    ("docs/guides/choosing.md", r"0\.1, 1 and 10|At 0\.1", ("benchmarks/ablation.py", "--distillation.weight=0.1")),
    ("docs/quickstart.md", r"50%", ("**/report.py", '"train/acc", 0.5')),
    ("docs/quickstart.md", r"moving average over 20 steps", ("**/report.py", "window: int = 20")),
    ("README.md", r"50%", ("**/report.py", '"train/acc", 0.5')),
    ("*", r"(?:to|reach|below) 90% (?:training )?accuracy|\(0\.9 in the default config\)",
     ("**/configs/default.yaml", "target_accuracy: 0.9")),
    ("*", r"up to 3000|at most 3000 steps", ("**/configs/default.yaml", "target_max_steps: 3000")),
    ("*", r"(?:after|past) its 300 steps|its 300 steps run out|the same 300 steps",
     ("**/configs/default.yaml", "max_steps: 300")),
    ("docs/guides/cli.md", r"moving average over 20 steps", ("**/report.py", "window: int = 20")),
)


@dataclass(frozen=True)
class Claim:
    page: str
    text: str  # the phrase as it stands in the page (whitespace-insensitive)
    source: str  # the result file (and field) its numbers come from


def _json(*parts: str) -> Any:
    with open(os.path.join(RESULTS, *parts)) as f:
        return json.load(f)


def _gib(nbytes: float, digits: int = 2) -> str:
    return f"{nbytes / 2**30:.{digits}f}"


def _pct(x: float, digits: int = 1) -> str:
    return f"{100 * x:.{digits}f}"


def _assert_all_passed(log: str, claim: str) -> None:
    """The committed pytest log ``log`` (under benchmarks/results) reports passed tests and no failure."""
    with open(os.path.join(RESULTS, log)) as f:
        text = f.read()
    assert re.search(r"\d+ passed", text) and "failed" not in text, claim


def _pct_span(values) -> str:
    """Fractions as a whole-percent range, one value when both ends round alike: "88%", "73–83%"."""
    low, high = round(100 * min(values)), round(100 * max(values))
    return f"{low}%" if low == high else f"{low}–{high}%"


def _ratio_span(values, unit: str = "×") -> str:
    """Ratios (or other numbers, with another ``unit``) to two decimals as a range, one value when both ends round
    alike: "0.85–0.90×", "0.93×"."""
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    return f"{low}{unit}" if low == high else f"{low}–{high}{unit}"


def _p(p: float) -> str:
    return "p < 0.001" if p < 0.001 else f"p = {p:.3f}"


def profile_row(text: str, where: str) -> tuple[int, float, float]:
    """(ncalls, tottime, cumtime) of the cProfile row of ``text`` whose location contains ``where``."""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 6 and where in line and parts[0].isdigit():
            return int(parts[0]), float(parts[1]), float(parts[3])
    raise KeyError(where)


class Results:
    """The committed result files, loaded on first use."""

    @cached_property
    def grid(self) -> tuple[dict, dict]:
        return report.load(os.path.join(RESULTS, "nvidia-h100-80gb-hbm3.json"))

    def row(self, h: int, d: int, causal: bool, n: int) -> dict:
        return self.grid[1][report.plain(h, d, causal, n)]

    @cached_property
    def grid_v3(self) -> tuple[dict, dict]:
        """The full grid as the v3 kernels measured it (the perf notes' v3 section quotes it)."""
        return report.load(os.path.join(RESULTS, "runs", "nvidia-h100-80gb-hbm3-v3.json"))

    @cached_property
    def tuning(self) -> dict:
        with open(report.PERF_NOTES_TUNING) as f:
            return json.load(f)

    @cached_property
    def overhead(self) -> str:
        with open(os.path.join(RESULTS, "nvidia-h100-80gb-hbm3-overhead.txt")) as f:
            return f.read()

    def per_call_us(self, name: str) -> int:
        return int(re.search(rf"^{re.escape(name)}: (\d+) us per call", self.overhead, re.M).group(1))

    def profile(self, where: str) -> tuple[int, float, float]:
        """(ncalls, tottime, cumtime) of the v3 profile row whose location contains ``where``."""
        return profile_row(self.overhead, where)

    @cached_property
    def job(self) -> dict:
        return _json("default_cpu", "results.json")

    @cached_property
    def job_eval(self) -> dict[tuple[str, int], float]:
        with open(os.path.join(RESULTS, "default_cpu", "eval.csv")) as f:
            return {(r["model"], int(r["seq_len"])): float(r["accuracy"]) for r in csv.DictReader(f)}

    @cached_property
    def teacher_half(self) -> int | None:
        from lightning_streamkl.jobs.report import first_step_reaching

        return first_step_reaching(self.job["runs"]["teacher"]["history"], "train/acc", 0.5)

    @staticmethod
    def config(pattern: str) -> dict:
        """A YAML config of the repository, found by glob (it may move between packages)."""
        import yaml

        path = next(p for p in sorted(_repo_files(ROOT)) if fnmatch.fnmatch(p, pattern)
                    or fnmatch.fnmatch(p, pattern.removeprefix("**/")))
        with open(os.path.join(ROOT, path)) as f:
            return yaml.safe_load(f)

    @cached_property
    def gpu_long(self) -> dict:
        return _json("gpu_long_h100", "results.json")

    @cached_property
    def ablation(self) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        for r in sorted(_json("ablation_cpu.json")["runs"], key=lambda r: r["seed"]):
            out.setdefault(r["variant"], []).append(r)
        return out

    def abl_mean(self, variant: str, key: str) -> str:
        return _pct(statistics.mean(r[key] for r in self.ablation[variant]))

    def abl_steps(self, variant: str) -> list[int]:
        return [r["steps_to_half"] for r in self.ablation[variant]]

    @cached_property
    def continual(self) -> dict:
        return {tag: _json(f"continual_{tag}.json") for tag in ("cpu", "cpu10", "sweep")}

    def summary(self, tag: str, scenario: str, method: str) -> dict:
        return self.continual[tag]["summary"][scenario][method]

    @cached_property
    def stats(self) -> dict[tuple[str, str, str, str], dict]:
        return {(c["scenario"], c["method"], c["baseline"], c["metric"]): c
                for c in _json("continual_cpu10_stats.json")["comparisons"]}

    @cached_property
    def minilm(self) -> dict:
        return _json("minilm_cpu.json")

    @cached_property
    def digits(self) -> dict:
        """Split-Digits: benchmarks/results/split_digits/results.json (built from its runs.jsonl)."""
        return _json("split_digits", "results.json")

    @cached_property
    def minilm_sequence(self) -> dict:
        """The pretrained-MiniLM scenario: benchmarks/results/continual_minilm/results.json."""
        return _json("continual_minilm", "results.json")

    @cached_property
    def minilm_relations(self) -> dict:
        return _json("minilm_relations_cpu.json")

    def minilm_paired_p(self, key: str) -> float:
        """The relations file's paired t-test of one metric (relations against attention maps, one pair per seed)."""
        from scipy.stats import ttest_rel

        runs = self.minilm_relations["runs"]
        return float(ttest_rel([r["relations"][key] for r in runs], [r["with_kl"][key] for r in runs]).pvalue)

    @cached_property
    def minilm_w01(self) -> dict:
        return _json("minilm_cpu_weight0.1.json")

    @cached_property
    def long_context(self) -> dict | None:
        """The long-context experiment's GPU results (``None`` until they are committed)."""
        return long_context().load()

    @cached_property
    def indexer_gpu(self) -> dict[tuple, dict]:
        """The indexer benchmark's records by ``(topk, n, h, h_kv, provider, mode)``."""
        out = {}
        for rec in _json("indexer_nvidia-h100-80gb-hbm3.json")["records"]:
            s = rec["shape"]
            out[s["topk"], s["n"], s["h"], s["h_kv"], rec["provider"], rec["mode"]] = rec
        return out

    @cached_property
    def indexer_example(self) -> dict:
        return _json("indexer_example_cpu.json")

    @cached_property
    def sharding(self) -> dict:
        """bench_sharding.py's run on two H200s."""
        return _json("sharding_nvidia-h200.json")

    @cached_property
    def sharding_gpu_tests(self) -> dict[str, dict[str, float]]:
        """The 2-GPU context-parallel test's relative errors against one GPU, by dtype, from its committed log."""
        with open(os.path.join(RESULTS, "sharding_nvidia-h200-2gpu-tests.log")) as f:
            log = f.read()
        assert re.search(r"^=+ 2 passed", log, re.M), "the 2-GPU test log does not say 2 passed"
        return {m.group(1): {k: v for k, v in re.findall(r"(\w+) (\d\.\d+e[-+]\d+)", m.group(2))}
                for m in re.finditer(r"context parallel, 2 GPUs vs 1, torch\.(\w+): (.*)$", log, re.M)}

    @cached_property
    def plateau(self) -> dict:
        return _json("teacher_plateau_cpu", "batch32_128_512", "results.json")


# ------------------------------------------------------------------------------------------------ generated blocks
def quickstart_eval(r: Results) -> str:
    """Quickstart: held-out accuracy of the three models at every evaluated length."""
    n_train = r.job["setup"]["train_seq_len"]
    lines = ["| context length N | teacher | student with attention KL | student without |", "|---|---|---|---|"]
    for n in r.job["eval"]["lengths"]:
        cells = [f"{_pct(r.job_eval[m, n])}%" for m in ("teacher", "student_kl", "student_base")]
        if n == n_train:
            lines.append(f"| **{n}** (training) | " + " | ".join(f"**{c}**" for c in cells) + " |")
        else:
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def gpu_long_table(r: Results) -> str:
    """Long-context guide: the H100 run of gpu_long, per run."""
    g = r.gpu_long
    runs, setup, ev = g["runs"], g["setup"], g["eval"]
    td, sd = setup["teacher_data"], setup["data"]
    kl = ev["attention_kl"]
    n, n_max = setup["train_seq_len"], max(ev["lengths"])

    def kls(run: str) -> str:
        return " / ".join(f"{kl[run][p]:.3g}" for p in kl[run])

    def acc(length: int) -> list[str]:
        return [f"{_pct(ev['accuracy'][m][str(length)])} %" for m in ("teacher", "student_kl", "student_base")]

    rows = [("steps", [str(runs[m]["steps"]) for m in ("teacher", "student_kl", "student_base")]),
            ("batch", [f"{td['batch_size']} × N ∈ {{{', '.join(map(str, td['seq_len']))}}}",
                       f"{sd['batch_size']} × {sd['seq_len']}", f"{sd['batch_size']} × {sd['seq_len']}"]),
            ("time per step (median)", [f"{runs[m]['step_ms_median']:.1f} ms" for m in runs]),
            ("peak CUDA memory", [f"{_gib(runs[m]['peak_cuda_bytes'])} GiB" for m in runs]),
            (f"held-out attention KL to the teacher, layer 0 / layer 1 (N = {ev['attention_kl_seq_len']})",
             ["–", kls("student_kl"), kls("student_base")]),
            (f"held-out accuracy at N = {n}", acc(n)),
            (f"held-out accuracy at N = {n_max}", acc(n_max))]
    lines = ["| | teacher | student with attention KL | student without |", "|---|---|---|---|"]
    for label, (t, w, b) in rows:
        bold = label.startswith(("time", "peak", "held-out attention"))
        lines.append(f"| {label} | {t} | {f'**{w}**' if bold else w} | {b} |")
    return "\n".join(lines)


def _v4_table(r: Results, run: str, label: str) -> str:
    """perf-notes v4: forward and backward at N=8192, H=16, the v3 grid against one v4 run."""
    new = report.load(os.path.join(RESULTS, "runs", run))[1]
    lines = [f"| D | causal | fwd ms, v3 → {label} | bwd ms, v3 → {label} |", "|---|---|---|---|"]
    for d in (64, 128):
        for causal in (False, True):
            old, now = r.grid_v3[1][report.plain(16, d, causal, 8192)], new[report.plain(16, d, causal, 8192)]
            cells = [f"{old[m]:.3f} → {now[m]:.3f} ({100 * (now[m] / old[m] - 1):+.0f}%)"
                     for m in ("streamkl/fwd", "streamkl/bwd")]
            lines.append(f"| {d} | {causal} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def v4_first(r: Results) -> str:
    return _v4_table(r, "nvidia-h100-80gb-hbm3-v4-first.json", "v4 first")


def v4_final(r: Results) -> str:
    return _v4_table(r, "nvidia-h100-80gb-hbm3-v4-quick.json", "v4")


@lru_cache
def long_context():
    """benchmarks/long_context/tables.py, loaded under its own name (its folder has a ``run`` and a ``paired``)."""
    import importlib.util

    folder = os.path.join(HERE, "long_context")
    sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location("long_context_tables", os.path.join(folder, "tables.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["long_context_tables"] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(folder)


def _lc(name: str):
    """A long-context block: ``tables.<name>`` of the committed GPU results (None before they exist)."""
    return lambda r: getattr(long_context(), name)(r.long_context)


BLOCKS = {"figures:quickstart-eval": ("docs/quickstart.md", quickstart_eval),
          "figures:v4-first": ("docs/perf-notes.md", v4_first), "figures:v4-final": ("docs/perf-notes.md", v4_final),
          "figures:gpu-long": ("docs/guides/long-context.md", gpu_long_table),
          "figures:long-context-findings": ("docs/guides/long-context.md", _lc("findings")),
          "figures:long-context-setup": ("docs/guides/long-context.md", _lc("setup_table")),
          "figures:long-context-cpu": ("docs/guides/long-context.md", lambda r: long_context().cpu_table()),
          "figures:long-context-teacher": ("docs/guides/long-context.md", _lc("teacher_table")),
          "figures:long-context-students": ("docs/guides/long-context.md", _lc("students_table")),
          "figures:long-context-every-row": ("docs/guides/long-context.md", _lc("every_row_table")),
          "figures:long-context-runs": ("docs/guides/long-context.md", _lc("runs_table")),
          "figures:long-context-cost": ("docs/guides/long-context.md", _lc("cost_table")),
          "figures:readme-long-context": ("README.md", lambda r: long_context().readme(r.long_context, r.gpu_long))}


# ------------------------------------------------------------------------------------------------------ claims
def torch_profile_calls(table: str, name: str) -> int:
    """``# of Calls`` of the row ``name`` of a torch.profiler ``key_averages().table()``."""
    for line in table.splitlines():
        if line.strip().startswith(name + " "):
            return int(line.split()[-1])
    raise KeyError(name)


def lazy_frames_v11_claims() -> list[Claim]:
    """perf-notes v11: the lazily rescaled frozen-teacher forward against v10's in paired rounds of one run, which
    differences the sign test finds significant, and the training call against cuDNN over the long-context shapes."""
    import bench_lazy_frames as bench

    name = "nvidia-h100-80gb-hbm3-lazy-frames.json"
    data = _json(name)
    assert all(c["new"] <= 1.05 * c["previous"] for c in data["checks"]), "v11 says it is as exact as v10"
    long = [r for r in data["rows"] if r["shape"]["n"] >= 4096]
    bert = next(r for r in data["rows"] if r["shape"]["name"].startswith("BERT"))
    kernel = {r["shape"]["name"]: bench.paired(r, "fused fwd") for r in long}
    train = {r["shape"]["name"]: bench.paired(r, "training call") for r in long}

    def span(values, digits=2):
        return f"{min(values):.{digits}f}–{max(values):.{digits}f}"

    def names(stats, significant):
        return ", ".join(n for n, x in stats.items() if (x["p"] < 0.05) == significant)

    d64 = kernel["N8192-D64"]
    others = [x["ratio"] for n, x in kernel.items() if n != "N8192-D64"]
    assert all(x["ratio"] < 1 for x in kernel.values()) and all(x["ratio"] < 1 for x in train.values())
    cudnn_old = [train[r["shape"]["name"]]["previous"] / r["cudnn_fwd_bwd_ms"] for r in long]
    cudnn_new = [train[r["shape"]["name"]]["new"] / r["cudnn_fwd_bwd_ms"] for r in long]
    b = bench.paired(bert, "training call")
    source = f"benchmarks/results/{name}"
    return [Claim("docs/perf-notes.md", t, source) for t in (
        f"the fused forward took {d64['ratio']:.2f}× v10's time at head dim 64 without a mask and "
        f"{span(others)}× on the other long-context shapes",
        f"the training call {span([x['ratio'] for x in train.values()])}× "
        f"({span(cudnn_new)}× cuDNN attention's forward+backward, v10 {span(cudnn_old)}× in the same run)",
        f"significant for the fused forward on {names(kernel, True)}; not significant on {names(kernel, False)}",
        f"significant for the training call on {names(train, True)}; not significant on {names(train, False)}",
        f"the BERT-sized training call took {b['ratio']:.2f}× v10's ({b['wins']} of {b['rounds']} rounds faster, "
        f"p = {b['p']:.2f})",
        f"(with {data['rounds']} rounds the smallest possible p is "
        f"{report.sign_test_p(data['rounds'], data['rounds']):.2g})",
    )]


def training_gap_claims() -> list[Claim]:
    """perf-notes "Where the remaining gap is (as of v14)": the training call and cuDNN's forward+backward against
    their overlap and no-overlap bounds, without and with a causal mask, and where the issue's target sits."""
    meta = report.load(report.PERF_NOTES_GRID)[0]
    with open(report.PERF_NOTES_TRAINING) as f:
        rows = report.training_gap_rows(meta["ceilings"], json.load(f))
    dense = [r for r in rows if "causal" not in r["name"]]
    causal = [r for r in rows if "causal" in r["name"]]

    source = os.path.relpath(report.PERF_NOTES_TRAINING, ROOT)
    return [Claim("docs/perf-notes.md", t, source) for t in (
        f"the frozen-teacher training call within {report.TRAINING_TARGET}× cuDNN attention's forward+backward",
        f"the training call already runs at {_pct_span([r['bound'][1] / r['ms'] for r in dense])} of its no-overlap "
        f"sum, "
        f"and the target sits at {_pct_span([r['bound'][1] / r['target'] for r in dense])} of it",
        f"at {_pct_span([r['cudnn_bound'][1] / r['cudnn'] for r in dense])} of its own sum",
        f"the call runs at {_pct_span([r['bound'][1] / r['ms'] for r in causal])} of the sum, where the target needs "
        f"{_pct_span([r['bound'][1] / r['target'] for r in causal])}",
    )]


def ws_key_pass_v13_claims() -> list[Claim]:
    """perf-notes v13: the warp-specialised key pass against v12 in paired rounds (which differences the sign test
    finds significant), the forced kernel without a mask, the ratios to cuDNN and the GPU tests' count."""
    import bench_ws_key_pass as bench

    data = _json("nvidia-h100-80gb-hbm3-ws-key-pass.json")
    assert all(c["bitwise_equal"] and c["finite"] for c in data["checks"]), "v13 says the two kernels agree bitwise"
    rows = {r["shape"]["name"]: r for r in data["rows"]}
    causal = [n for n in rows if n.endswith("causal")]
    causal8k = [n for n in causal if n.startswith("N8192")]
    dense = [n for n in rows if n not in causal]
    assert all(rows[n]["default_is_warp_specialised"] == (n in causal) for n in rows)
    key, forced, train = ({n: bench.paired(rows[n], what) for n in rows}
                          for what in ("key pass", "forced key pass", "training call"))
    assert all(train[n]["p"] < 0.05 and train[n]["wins"] == train[n]["rounds"] for n in causal8k)
    gqa = [n for n in causal if n not in causal8k]
    assert all(train[n]["p"] >= 0.05 and forced[n]["wins"] == forced[n]["rounds"] for n in gqa)
    assert all(forced[n]["wins"] == 0 for n in dense)
    cudnn = {n: (train[n]["previous"] / rows[n]["cudnn_fwd_bwd_ms"], train[n]["new"] / rows[n]["cudnn_fwd_bwd_ms"])
             for n in rows}
    d64, d128 = "N8192-D64-causal", "N8192-D128-causal"
    (g,) = gqa
    _assert_all_passed("nvidia-h100-80gb-hbm3-hopper-tests-v13.log", "v13 says every Hopper test passed")
    texts = [
        f"the key pass took {_ratio_span([key[n]['ratio'] for n in causal])} v12's time, and the training call "
        f"{train[d64]['ratio']:.2f}× and {train[d128]['ratio']:.2f}× at",
        f"N = 8192 ({train[d64]['wins']} of {train[d64]['rounds']} rounds, p = {train[d64]['p']:.2g}), which moves it "
        f"from {cudnn[d64][0]:.2f}× to {cudnn[d64][1]:.2f}× cuDNN attention's forward+backward at head",
        f"from {cudnn[d128][0]:.2f}× to {cudnn[d128][1]:.2f}× at head dim 128",
        f"the forced kernel was faster in {forced[g]['wins']} of {forced[g]['rounds']}",
        f"training call's {train[g]['ratio']:.2f}× ({train[g]['wins']} of {train[g]['rounds']}, "
        f"p = {train[g]['p']:.2g})",
        f"the kernel took {_ratio_span([forced[n]['ratio'] for n in dense])} v12's "
        f"({max(forced[n]['wins'] for n in dense)} of {forced[dense[0]]['rounds']} rounds faster)",
    ]
    source = "benchmarks/results/nvidia-h100-80gb-hbm3-ws-key-pass.json"
    concepts = f"causal key pass: {_ratio_span([key[n]['ratio'] for n in causal])} v12's"
    return [Claim("docs/perf-notes.md", t, source) for t in texts] + [Claim("docs/concepts/streamkl.md", concepts,
                                                                           source)]


def peeled_key_pass_v14_claims() -> list[Claim]:
    """perf-notes v14: the offline register counts behind the change, the one-warpgroup key pass against v13 in paired
    rounds (which differences the sign test finds significant, and which it flags on identical code), the forced
    kernel at head dim 128, the ratios to cuDNN and the target, where the two kernels agree bitwise, and the GPU
    tests' count."""
    import bench_ws_key_pass as bench

    res = _json("kernel-resources-hopper-key-pass.json")

    def compiled(package, d, causal, block_m, stages):
        (row,) = [r for r in res["rows"] if (r["package"], r["d"], r["causal"], r["block_m"], r["stages"]) ==
                  (package, d, causal, block_m, stages)]
        return row

    old_causal, old_dense = compiled("against", 64, True, 64, 3), compiled("against", 64, False, 64, 3)
    new_causal = compiled("this", 64, True, 64, 3)
    old_128, new_128, dense_128 = (compiled(p, 128, c, 64, 2) for p, c in (("against", True), ("this", True),
                                                                            ("this", False)))
    assert dense_128["stack"] == compiled("against", 128, False, 64, 2)["stack"]
    new_dense6, old_dense6 = compiled("this", 64, False, 64, 6), compiled("against", 64, False, 64, 6)
    data = _json("nvidia-h100-80gb-hbm3-peeled-key-pass.json")
    v13 = {r["shape"]["name"]: r for r in _json("nvidia-h100-80gb-hbm3-ws-key-pass.json")["rows"]}
    rows = {r["shape"]["name"]: r for r in data["rows"]}
    d64, d128, gqa = "N8192-D64-causal", "N8192-D128-causal", "N16384-D128-H32-GQA8-causal"
    dense = [n for n in rows if not n.endswith("causal")]
    assert [n for n in rows if rows[n]["default_is_warp_specialised"]] == [d128, gqa]
    key, forced, train = ({n: bench.paired(rows[n], what) for n in rows}
                          for what in ("key pass", "forced key pass", "training call"))
    assert key[d64]["p"] < 0.05 and train[d64]["p"] < 0.05 and train[d64]["wins"] == train[d64]["rounds"]
    assert all(key[n]["p"] >= 0.05 and train[n]["p"] >= 0.05 and forced[n]["wins"] == 0 for n in (d128, gqa))
    assert all(train[n]["p"] >= 0.05 for n in dense)
    dense_cells = [c[n] for c in (key, forced, train) for n in dense]
    flagged = [c for c in dense_cells if c["p"] < 0.05]
    assert flagged and all(c["wins"] == c["rounds"] for c in flagged)
    cudnn = {n: (train[n]["previous"] / rows[n]["cudnn_fwd_bwd_ms"], train[n]["new"] / rows[n]["cudnn_fwd_bwd_ms"])
             for n in rows}
    short = train[d64]["new"] / (report.TRAINING_TARGET * rows[d64]["cudnn_fwd_bwd_ms"]) - 1
    unequal = [c for c in data["checks"] if not c["bitwise_equal"]]
    assert unequal and all(c["case"][8] and c["case"][1] // c["case"][3] > 1 for c in unequal), \
        "v14 says the kernels differ only with a mask and several query heads per program"
    assert all(abs(c["rel_ws_vs_ref"] - c["rel_one_vs_ref"]) < 0.05 * c["rel_ws_vs_ref"] for c in data["checks"])
    _assert_all_passed("nvidia-h100-80gb-hbm3-hopper-tests-v14.log", "v14 says every Hopper test passed")
    half = statistics.median(v13["N8192-D64"]["ms"]["key pass new"])
    texts = [
        f"head dim 64 with 64-query steps and a ring of 3 used {old_causal['regs']} registers and a "
        f"{old_causal['stack']}-byte stack (spills); without a mask the\n  same loop used {old_dense['regs']} "
        "registers and no stack",
        f"now uses {new_causal['regs']} registers there and no stack",
        f"(a {new_128['stack']}-byte stack, v13's {old_128['stack']}), as the non-causal kernel does there "
        f"({dense_128['stack']} bytes, as in\n  v13)",
        f"64, {new_dense6['regs']} registers where v13's used {old_dense6['regs']}",
        f"(v13's run: {half:.3f} ms, so about\n  {half / 2:.2f} ms, against the warp-specialised kernel's "
        f"{statistics.median(v13[d64]['ms']['key pass new']):.3f})",
        f"the key pass took {key[d64]['ratio']:.2f}× v13's time\n  ({key[d64]['previous']:.3f} → {key[d64]['new']:.3f} "
        f"ms, {key[d64]['wins']} of {key[d64]['rounds']} rounds, p = {key[d64]['p']:.2g})",
        f"the training call {train[d64]['ratio']:.2f}× ({train[d64]['wins']} of {train[d64]['rounds']}\n  rounds, "
        f"p = {train[d64]['p']:.2g}), which moves it from {cudnn[d64][0]:.2f}× to {cudnn[d64][1]:.2f}× cuDNN",
        f"{round(100 * short)}% short of the issue's\n  {report.TRAINING_TARGET}×",
        f"dim 64 to {cudnn[d64][1]:.2f}× cuDNN, {round(100 * short)}% short of the target",
        f"forced, took\n  {forced[d128]['ratio']:.2f}× and {forced[gqa]['ratio']:.2f}× the warp-specialised kernel's "
        f"time\n  (0 of {forced[d128]['rounds']} rounds faster)",
        f"all their ratios lie within {_ratio_span([c['ratio'] for c in dense_cells])}, and the sign test flags "
        f"{len(flagged)} of them ({flagged[0]['wins']} of {flagged[0]['rounds']})",
        f"({forced['N8192-D128']['ratio']:.2f}×, {forced['N8192-D128']['wins']} of {forced['N8192-D128']['rounds']} "
        "at head dim 128)",
    ]
    source = "benchmarks/results/nvidia-h100-80gb-hbm3-peeled-key-pass.json"
    concepts = (f"causal key pass at head dim 64: {key[d64]['ratio']:.2f}× v13's, training call "
                f"{cudnn[d64][1]:.2f}× cuDNN attention's")
    return [Claim("docs/perf-notes.md", t, source) for t in texts] + [Claim("docs/concepts/streamkl.md", concepts,
                                                                           source)]


def bf16_dq_v15_claims() -> list[Claim]:
    """perf-notes v15: bitwise-equal gradients, the training forward's transient memory and the whole call's peak,
    which time differences the sign test finds significant, and the same code's ratio to cuDNN in two runs."""
    import bench_lazy_frames as bench

    data = _json("nvidia-h100-80gb-hbm3-bf16-dq.json")
    assert all(c["bitwise_equal"] and c["finite"] for c in data["checks"]), "v15 says v14's gradients, bitwise"
    rows = {r["shape"]["name"]: r for r in data["rows"]}
    peak = {n: r["peak_mib"] for n, r in rows.items()}
    assert all(p["new"]["training call"] == p["previous"]["training call"] for p in peak.values())
    train, fused = ({n: bench.paired(rows[n], what) for n in rows} for what in ("training call", "fused fwd"))
    d128c, d64c, bert = "N8192-D128-causal", "N8192-D64-causal", "BERT-B8-H12-N512-D64"
    assert [n for n in rows if train[n]["p"] < 0.05] == [d128c] and all(f["p"] >= 0.05 for f in fused.values())
    rest = [n for n in rows if n not in (d128c, bert)]
    v14_run = {r["shape"]["name"]: r for r in _json("nvidia-h100-80gb-hbm3-peeled-key-pass.json")["rows"]}[d64c]
    v14_here = train[d64c]["previous"] / rows[d64c]["cudnn_fwd_bwd_ms"]
    v14_there = statistics.median(v14_run["ms"]["training call new"]) / v14_run["cudnn_fwd_bwd_ms"]

    moved = round(100 * max(abs(1 - train[n]["ratio"]) for n in rows if n != bert))
    largest = max(report.same_code_movements().values())

    def mib(name, what="forward"):
        return f"{peak[name]['previous'][what]:.1f} → {peak[name]['new'][what]:.1f} MiB"

    texts = [
        f"bitwise v14's on all {len(data['checks'])} checks",
        f"({mib('N8192-D64')} at N = 8192, head dim 64; {mib('N16384-D128-H32-GQA8-causal')} at the GQA shape)",
        f"the training call took {train[d128c]['ratio']:.2f}× v14's at N8192-D128-causal ({train[d128c]['wins']} of "
        f"{train[d128c]['rounds']} rounds, p = {train[d128c]['p']:.2g})",
        f"({_ratio_span([train[n]['ratio'] for n in rest])}, and {train[bert]['ratio']:.2f}× at the BERT-sized shape",
        f"v14's code took {v14_here:.2f}× cuDNN's\n  forward+backward at N8192-D64-causal here and {v14_there:.2f}× in "
        "v14's run",
        f"the same code measured {v14_here:.2f}× in v15's run",
        f"the same code's ratio moved by up to {100 * largest:.1f}% between two runs",
        f"within {report.RUN_SPREAD:.0%} of its goal",
        f"v15 changed the long-context training calls by {moved}% or less",
    ]
    source = "benchmarks/results/nvidia-h100-80gb-hbm3-bf16-dq.json"
    return [Claim("docs/perf-notes.md", t, source) for t in texts]


def kernel_profile_claims() -> list[Claim]:
    """perf-notes after v15: the hardware-counter reading of the training call's kernels and cuDNN's
    (benchmarks/kernel_profile.py)."""
    import kernel_profile

    data = _json("nvidia-h100-80gb-hbm3-kernel-profile.json")
    rows = kernel_profile.kernel_rows(data)

    def pick(kernel, *shapes):
        return [r for r in rows if r["kernel"] == kernel and (not shapes or r["shape"] in shapes)]

    def stall(r, name):
        return r["stall"][name]

    def _pcts(values):  # ncu's percentages
        return _pct_span([v / 100 for v in values])

    ours = [r for r in rows if not r["kernel"].startswith("cuDNN")]
    cudnn = [r for r in rows if r["kernel"].startswith("cuDNN")]
    d64, d128 = ("N8192-D64", "N8192-D64-causal"), ("N8192-D128", "N8192-D128-causal")
    fwd64, cfwd64 = pick("fused forward", *d64), pick("cuDNN forward", *d64)
    fwd128, cfwd128 = pick("fused forward", *d128), pick("cuDNN forward", *d128)
    (plain64,) = pick("fused forward", "N8192-D64")
    (cudnn64,) = pick("cuDNN forward", "N8192-D64")
    (key128,) = pick("key pass", "N8192-D128")
    (ws128,) = pick("key pass", "N8192-D128-causal")
    assert all(r["stalls"][0][0] == "wait" for r in fwd64), "the fused forward's largest stall at head dim 64"
    assert all(r["stalls"][0][0] == "barrier" for r in fwd128 + [ws128]) and key128["stalls"][0][0] == "long_scoreboard"
    spill = [r for r in _json("kernel-resources-hopper-key-pass.json")["rows"]
             if r["package"] == "this" and (r["d"], r["causal"], r["block_m"], r["stages"]) == (128, False, 64, 2)]
    texts = [
        f"Nsight Compute {data['ncu'].split()[1].rsplit('.', 1)[0]}",
        f"kernels under {inspect.signature(kernel_profile.kernel_rows).parameters['min_share'].default:.0%} of their "
        "call's time are left out",
        f"the schedulers issue on {_pcts([r['issue'] for r in rows])} of cycles",
        f"the tensor pipe is busy {_pcts([r['tensor'] for r in rows])} of the time",
        f"at most {max(r['xu'] for r in rows):.0f}%",
        f"ours {min(r['warps'] for r in ours):.1f}–{max(r['warps'] for r in ours):.0f} warps per SM, cuDNN's "
        f"{min(r['warps'] for r in cudnn):.0f}–{max(r['warps'] for r in cudnn):.0f}",
        f"the fused forward issues on {_pcts([r['issue'] for r in fwd64])} of cycles against cuDNN's forward's "
        f"{_pcts([r['issue'] for r in cfwd64])}",
        f"its tensor pipe {_pcts([r['tensor'] for r in fwd64])} and XU pipe {_pcts([r['xu'] for r in fwd64])} "
        "busy",
        f"It takes {plain64['ms'] / cudnn64['ms']:.1f}× cuDNN's forward's time",
        f"a dependent arithmetic result ({_ratio_span([stall(r, 'wait') for r in fwd64], '')} cycles per issue)",
        f"its {max(r['regs'] for r in fwd64):.0f} registers",
        "the CTA barrier (" + " and ".join(f"{stall(r, 'barrier'):.2f}" for r in fwd128) + " cycles per issue)",
        f"it issues on {_pcts([r['issue'] for r in fwd128])} of cycles",
        f"cuDNN's forward keeps its tensor pipe {_pcts([r['tensor'] for r in cfwd128])} busy there against the "
        f"fused forward's {_pcts([r['tensor'] for r in fwd128])}",
        f"waits on memory ({stall(key128, 'long_scoreboard'):.2f} cycles per issue)",
        f"at {key128['regs']:.0f} registers",
        f"a {spill[0]['stack']}-byte stack",
        f"issues on {key128['issue']:.0f}% of cycles",
        f"its turn-taking ({stall(ws128, 'barrier'):.2f} cycles per issue) and issues on {ws128['issue']:.0f}%",
    ]
    source = "benchmarks/results/nvidia-h100-80gb-hbm3-kernel-profile.json"
    return [Claim("docs/perf-notes.md", t, source) for t in texts]


def one_set_key_pass_v16_claims() -> list[Claim]:
    """perf-notes v16: the offline register counts (v15 → v16 at head dim 128, head dim 64 unchanged), the paired
    rounds against v15 (which differences the sign test finds), the forced kernel on the causal shapes, bitwise-equal
    checks and the GPU tests' log."""
    import bench_ws_key_pass as bench

    res = _json("kernel-resources-hopper-key-pass-v16.json")
    compiled = {(r["package"], r["d"], r["causal"], r["block_m"], r["stages"]): r for r in res["rows"]}
    same = ("regs", "stack", "total")
    assert all(compiled[("this", *k[1:])][f] == r[f] for k, r in compiled.items() if k[0] == "against" and k[1] == 64
               for f in same), "v16 says the head-dim-64 kernels compile as v15's"
    old_dense, new_dense = compiled[("against", 128, False, 64, 2)], compiled[("this", 128, False, 64, 2)]
    old_causal, new_causal = compiled[("against", 128, True, 64, 2)], compiled[("this", 128, True, 64, 2)]
    assert new_dense["stack"] == 0 and new_causal["stack"] == 0
    data = _json("nvidia-h100-80gb-hbm3-one-set-key-pass.json")
    rows = {r["shape"]["name"]: r for r in data["rows"]}
    key, forced, train = ({n: bench.paired(rows[n], what) for n in rows}
                          for what in ("key pass", "forced key pass", "training call"))
    n8, gqa, n8c, gqac = "N8192-D128", "N16384-D128-H32-GQA8", "N8192-D128-causal", "N16384-D128-H32-GQA8-causal"
    assert all(c["bitwise_equal"] and c["finite"] for c in data["checks"]), "v16 says v15's key gradients, bitwise"
    assert key[gqa]["p"] < 0.05 and train[gqa]["p"] < 0.05 and train[n8]["p"] >= 0.05
    assert forced[n8]["p"] < 0.05 <= key[n8]["p"] and all(forced[n]["p"] >= 0.05 for n in (n8c, gqac))
    _assert_all_passed("nvidia-h100-80gb-hbm3-hopper-tests-v16.log", "v16 says every Hopper test passed")
    slower = round(100 * (max(key[n8]["ratio"], forced[n8]["ratio"]) - 1))
    texts = [
        f"v15's kernel without a\n  mask used {old_dense['regs']} registers and a {old_dense['stack']}-byte stack",
        f"now uses {new_dense['regs']} registers and no stack",
        f"(the causal one, forced, {new_causal['regs']} and no stack, where v15's used {old_causal['regs']} and a "
        f"{old_causal['stack']}-byte stack)",
        f"the key pass took {key[gqa]['ratio']:.2f}×\n  v15's time and the training call {train[gqa]['ratio']:.2f}×, "
        f"both in {key[gqa]['wins']} of {key[gqa]['rounds']} rounds (p = {key[gqa]['p']:.2g})",
        f"the training call did not\n  change ({train[n8]['ratio']:.2f}×, {train[n8]['wins']} of "
        f"{train[n8]['rounds']} rounds faster)",
        f"the key pass took {key[n8]['ratio']:.2f}× v15's time in both columns",
        f"significant in one ({forced[n8]['wins']} of {forced[n8]['rounds']} rounds faster) and not in the other "
        f"({key[n8]['wins']} of {key[n8]['rounds']})",
        f"a slowdown of about {slower}% of\n  the key pass",
        f"took {forced[n8c]['ratio']:.2f}× and {forced[gqac]['ratio']:.2f}× its time ({forced[n8c]['wins']} of "
        f"{forced[n8c]['rounds']} rounds faster each",
    ]
    assert forced[n8c]["wins"] == forced[gqac]["wins"] and f"{forced[n8]['ratio']:.2f}" == f"{key[n8]['ratio']:.2f}"
    source = "benchmarks/results/nvidia-h100-80gb-hbm3-one-set-key-pass.json"
    import kernel_profile

    def key_pass(tag):
        rows = kernel_profile.kernel_rows(_json(f"nvidia-h100-80gb-hbm3-kernel-profile{tag}.json"))
        (row,) = [r for r in rows if r["shape"] == n8 and r["kernel"] == "key pass"]
        return row

    before, after = key_pass(""), key_pass("-v16")
    stall = {"before": before["stall"], "after": after["stall"]}
    profile = [
        f"waits\n  on memory fell from {stall['before']['long_scoreboard']:.2f} to "
        f"{stall['after']['long_scoreboard']:.2f} cycles per issue",
        f"its waits on dependent arithmetic rose from {stall['before']['wait']:.2f} to {stall['after']['wait']:.2f}",
        f"it issues on {after['issue']:.0f}% of cycles where v15's issued on {before['issue']:.0f}%",
    ]
    return [Claim("docs/perf-notes.md", t, source) for t in texts] + [
        Claim("docs/perf-notes.md", t, "benchmarks/results/nvidia-h100-80gb-hbm3-kernel-profile-v16.json")
        for t in profile]


def grid_refresh_claims() -> list[Claim]:
    """perf-notes "The grid re-measured": the long-context rows' ratios to cuDNN before and after, how many rows sit
    within the issue's goal, how the times grew from N = 16384 to 32768, the forward's ratios, and the ceilings of
    the two grids."""
    before, after = report.load(report.PERF_NOTES_GRID), report.load(report.PERF_NOTES_CURRENT_GRID)
    keys = [(h, d, c, n) for h in (16, 32) for d in (64, 128) for c in (False, True) for n in report.REFRESH_NS]
    ratios = {k: (report.cudnn_ratios(before[1][report.plain(*k)]), report.cudnn_ratios(after[1][report.plain(*k)]))
              for k in keys}
    long_rows = [k for k in keys if k[3] > 8192 or k[0] == 32]
    target = report.TRAINING_TARGET
    within = [k for k in keys if ratios[k][1][1] <= target]
    edge = [ratios[k][1][1] for k in within if abs(ratios[k][1][1] / target - 1) <= report.RUN_SPREAD]
    below = sorted(k for k in within if ratios[k][1][1] < 1.0)
    assert len(edge) + len(below) == len(within), "every row within the goal is at its edge or below 1.0×"
    growth = {}
    for k in {k[:3] for k in keys}:
        t16, t32 = (after[1][report.plain(*k, n)] for n in (16384, 32768))
        growth[k] = tuple(t32[f"{p}/fwd+bwd"] / t16[f"{p}/fwd+bwd"] for p in ("streamkl", "sdpa-default"))
    fastest = sorted((k for k in keys if ratios[k][1][1] < 1.0), key=lambda k: ratios[k][1][1])
    assert len(fastest) == len(below) == 2
    mm = before[0]["ceilings"]["bf16_matmul_flops"] / after[0]["ceilings"]["bf16_matmul_flops"] - 1
    assert abs(after[0]["ceilings"]["exp2_per_s"] / before[0]["ceilings"]["exp2_per_s"] - 1) < 5e-3, "same exp2 rate"

    texts = (
        f"a bf16 matmul rate {100 * mm:.0f}% lower",
        f"a ratio moves by up to {100 * report.RUN_SPREAD:.0f}% between runs of the same code",
        f"forward+backward took {_ratio_span([ratios[k][0][1] for k in long_rows])} cuDNN attention's in the grid as "
        f"published and {_ratio_span([ratios[k][1][1] for k in long_rows])} in the new run "
        f"({len(long_rows)} rows)",
        f"Of the {len(keys)} bf16 rows from N = 8192 up, {len(within)} are now within the issue's {target}× of cuDNN's "
        f"forward+backward, {len(edge)} of them\n    at {_ratio_span(edge)}",
        f"inside the {100 * report.RUN_SPREAD:.0f}% run-to-run spread of that goal",
        f"{sum(k[1] == 128 for k in within)} of the {len(within)} are at head dim 128. The two rows below 1.0× are not "
        f"wins: from N = 16384 to 32768 the work grows {(32768 / 16384) ** 2:.0f}×",
        f"The issue's forward target ({target}×) stays far off",
        f"the training call's times grew\n    {_ratio_span([g[0] for g in growth.values()])} and cuDNN's "
        f"{_ratio_span([g[1] for g in growth.values()])}",
        f"took {ratios[fastest[0]][1][1]:.2f}× and {ratios[fastest[1]][1][1]:.2f}× cuDNN's time are the two where\n"
        f"    cuDNN's time grew most ({growth[fastest[0][:3]][1]:.2f}× and {growth[fastest[1][:3]][1]:.2f}×)",
        f"takes {_ratio_span([ratios[k][1][0] for k in keys])} cuDNN's forward in every one of these rows",
    )
    assert sorted(g[1] for g in growth.values())[-2:] == sorted(growth[k[:3]][1] for k in fastest[:2])
    source = "benchmarks/results/nvidia-h100-80gb-hbm3.json; " + os.path.relpath(report.PERF_NOTES_GRID, ROOT)
    return [Claim("docs/perf-notes.md", t, source) for t in texts]


def gluon_causal_order_v18_claims() -> list[Claim]:
    """perf-notes v18: the Gluon forwards' causal order against v17 in paired rounds (which differences the sign test
    finds), the Gluon training forward against the portable one, the training call with it forced, and the ratios to
    cuDNN."""
    import bench_gluon_causal_order as bench
    import bench_ws_fused_forward as v17_bench

    data = _json("nvidia-h100-80gb-hbm3-gluon-causal-order.json")
    rows = {r["shape"]["name"]: r for r in data["rows"]}
    v17_rows = {r["shape"]["name"]: r for r in _json("nvidia-h100-80gb-hbm3-ws-fused-forward.json")["rows"]}
    g = {n: bench.pair(r, "Gluon fused fwd") for n, r in rows.items()}
    gp = {n: bench.pair(r, "Gluon / portable fused fwd") for n, r in rows.items()}
    m = {n: bench.pair(r, "metric call") for n, r in rows.items()}
    t = {n: bench.pair(r, "training call") for n, r in rows.items()}
    f = {n: bench.pair(r, "training call, Gluon fwd forced") for n, r in rows.items()}
    d64c, d128c, gqa = "N8192-D64-causal", "N8192-D128-causal", "N16384-D128-H32-GQA8-causal"
    dense = [n for n in rows if "causal" not in n]
    assert all(gp[n]["wins"] == gp[n]["rounds"] for n in rows) and all(g[n]["p"] >= 0.12 for n in dense)
    v17_d64c = v17_bench.paired(v17_rows[d64c], "fused fwd")["ratio"]

    def cell(x: dict) -> str:
        return f"{x['wins']} of {x['rounds']}"

    def cudnn(n: str, x: float) -> float:
        return x / rows[n]["cudnn_fwd_bwd_ms"]

    others = [cudnn(n, t[n]["new"]) for n in rows if n not in (d64c, d128c)]
    texts = (
        f"the Gluon training forward took {g[d64c]['ratio']:.2f}× v17's time at head dim 64 and "
        f"{g[d128c]['ratio']:.2f}× at head dim 128 ({cell(g[d64c])} rounds each, p = {g[d64c]['p']:.2g})",
        f"faster than the portable kernel on all five shapes ({_ratio_span([gp[n]['ratio'] for n in rows])}, "
        f"{cell(gp[d64c])} rounds each), at head dim 64 with a causal mask by {gp[d64c]['ratio']:.2f}× where v17's "
        f"took {v17_d64c:.2f}×",
        f"The GQA shape took {g[gqa]['ratio']:.2f}× ({g[gqa]['wins']} of {g[gqa]['rounds']} rounds faster, p = "
        f"{g[gqa]['p']:.2f})",
        f"the non-causal controls did not move (p ≥ {min(g[n]['p'] for n in dense):.2f})",
        f"The metric at head dim 128 with a causal mask took {m[d128c]['ratio']:.2f}× ({cell(m[d128c])}, p = "
        f"{m[d128c]['p']:.2g})",
        f"{t[d128c]['ratio']:.2f}× at head dim 128 with a causal mask ({cell(t[d128c])}, p = {t[d128c]['p']:.2f}, "
        f"not significant)",
        f"{f[d64c]['ratio']:.2f}× with the Gluon forward against the portable one ({cell(f[d64c])}, p = "
        f"{f[d64c]['p']:.2g})",
        f"differed by {t[d64c]['ratio']:.2f}× ({cell(t[d64c])}, p = {t[d64c]['p']:.2f})",
        f"{cudnn(d128c, t[d128c]['new']):.2f}× cuDNN attention's forward+backward at head dim 128 with a causal mask "
        f"and {cudnn(d64c, f[d64c]['new']):.2f}× at head dim 64 with one (with the Gluon forward), and "
        f"{_ratio_span(others)} on the other shapes: the long-context target (≤ {report.TRAINING_TARGET}×)",
    )
    assert len(rows) == 5
    assert t[d128c]["p"] >= 0.05 and f[d64c]["p"] < 0.05 and t[d64c]["p"] >= 0.05
    _assert_all_passed("nvidia-h100-80gb-hbm3-hopper-tests-v18.log", "the GPU tests of the Hopper kernels passed")
    source = "benchmarks/results/nvidia-h100-80gb-hbm3-gluon-causal-order.json"
    return [Claim("docs/perf-notes.md", text, source) for text in texts]


def three_consumers_claims() -> list[Claim]:
    """perf-notes, three consumer warpgroups tried: the offline stacks, the paired rounds (slower on every shape, in
    every round, which the sign test finds), bitwise-equal checks."""
    import bench_three_consumers as bench

    res = {(r["causal"], r["consumers"]): r for r in _json("kernel-resources-hopper-consumers.json")["rows"]}
    assert res[(False, 2)]["stack"] == 0 and res[(True, 2)]["stack"] == 0
    data = _json("nvidia-h100-80gb-hbm3-three-consumers.json")
    assert data["checks"] and all(c["bitwise_equal"] for c in data["checks"]), "the notes say the same bits"
    fwd = [bench.paired_labels(r, *bench.PAIRS["fused fwd"]) for r in data["rows"]]
    train = [bench.paired_labels(r, *bench.PAIRS["training call"]) for r in data["rows"]]
    assert all(x["wins"] == 0 and x["p"] < 0.05 for x in fwd + train), "the notes say slower in every round"
    _assert_all_passed("nvidia-h100-80gb-hbm3-hopper-tests-three-consumers.log", "the notes say the GPU tests passed")
    texts = (
        f"a {res[(False, 3)]['stack']}-byte stack without a mask and {res[(True, 3)]['stack']} bytes with a causal "
        f"one",
        f"Three consumers took {_ratio_span([x['ratio'] for x in fwd])} the time of two in the fused forward and "
        f"{_ratio_span([x['ratio'] for x in train])} in the training call, slower in every round on every shape (0 of "
        f"{fwd[0]['rounds']} rounds faster, p = {max(x['p'] for x in fwd + train):.2g} each)",
    )
    return [Claim("docs/perf-notes.md", text, "benchmarks/results/nvidia-h100-80gb-hbm3-three-consumers.json")
            for text in texts]


def exponent_difference_v19_claims() -> list[Claim]:
    """perf-notes v19 (not kept): the paired rounds of both training forwards, the calls users make (which differences
    the sign test finds), the bits and the KL's error against float64."""
    import bench_exponent_difference as bench

    data = _json("nvidia-h100-80gb-hbm3-exponent-difference.json")
    assert data["checks"] and all(c["bitwise_equal"] for c in data["checks"]), "the notes say the same bits"
    rows = {r["shape"]["name"]: r for r in data["rows"]}
    g, p, m, t = ({n: bench.pair(r, what) for n, r in rows.items()} for what in bench.PAIRS)
    d64, d64c = "N8192-D64", "N8192-D64-causal"
    d128 = [n for n in rows if "D128" in n]
    assert g[d64]["ratio"] > 1 and g[d64]["wins"] == 0 and g[d64c]["ratio"] < 1 and g[d64c]["wins"] == 7
    assert all(g[n]["p"] >= 0.05 for n in rows if n not in (d64, d64c)), "no other significant change"
    assert all(p[n]["wins"] == 7 for n in (d64, d64c)) and all(p[n]["wins"] == 0 for n in d128)
    assert [n for n in rows if t[n]["p"] < 0.05] == [d64c]
    assert [n for n in rows if m[n]["p"] < 0.05] == [d64c, "N16384-D128-H32-GQA8-causal"]
    assert all(m[n]["wins"] == 7 for n in (d64c, "N16384-D128-H32-GQA8-causal"))
    _assert_all_passed("nvidia-h100-80gb-hbm3-hopper-tests-v19.log", "the notes say the GPU tests passed on v19")
    kl = {c["case"][0]: c for c in data["kl_checks"]}
    assert all(c["new"] <= c["previous"] * 1.01 for c in kl.values()), "the notes say the KL error did not grow"
    texts = (
        f"{g[d64]['ratio']:.2f}× at N8192-D64 (slower in every round, p = {g[d64]['p']:.2g}), {g[d64c]['ratio']:.2f}× "
        f"at N8192-D64-causal (faster in every round, p = {g[d64c]['p']:.2g})",
        f"The portable training forward took {_ratio_span([p[n]['ratio'] for n in (d64, d64c)])} at head dim 64 and "
        f"{_ratio_span([p[n]['ratio'] for n in d128])} at head dim 128 (every round each way, p = "
        f"{max(p[n]['p'] for n in rows):.2g})",
        f"moved its time by {_ratio_span([g[n]['ratio'] for n in (d64, d64c)])} at head dim 64",
        f"the metric call {_ratio_span([x['ratio'] for x in m.values()])} (faster in every round at",
        f"and the training call {_ratio_span([x['ratio'] for x in t.values()])} (significant",
        f"differs from float64 by {kl['close']['previous']:.1e} of its size in v18",
        f"late-key variant by {kl['close, late key']['previous']:.1e}",
    )
    source = "benchmarks/results/nvidia-h100-80gb-hbm3-exponent-difference.json"
    faq = f"the per-row KL differed from float64 by {kl['close']['previous']:.1e} of its size"
    return [Claim("docs/perf-notes.md", text, source) for text in texts] + [Claim("docs/faq.md", faq, source)]


def ws_fused_forward_v17_claims() -> list[Claim]:
    """perf-notes v17: the offline stacks, the paired rounds (which differences the sign test finds, and the shape
    where the Gluon forward is slower, which the selection leaves out), the ratios to cuDNN, bitwise-equal checks and
    the GPU tests' logs."""
    import bench_ws_fused_forward as bench

    res = {(r["d"], r["causal"], r["block_n"]): r for r in _json("kernel-resources-hopper-fused-forward.json")["rows"]}
    assert all(r["stack"] == 0 for k, r in res.items() if k[0] == 64 or k[2] == 32), "v17 says no stack there"
    data = _json("nvidia-h100-80gb-hbm3-ws-fused-forward.json")
    assert all(c["bitwise_equal"] for c in data["checks"]), "v17 says the portable forward's bits"
    rows = {r["shape"]["name"]: r for r in data["rows"]}
    fwd, train = ({n: bench.paired(rows[n], what) for n in rows} for what in ("fused fwd", "training call"))
    d64, d64c, d128, d128c, gqa = (s[0] for s in bench.SHAPES)
    assert fwd[d64c]["ratio"] > 1 and fwd[d64c]["p"] < 0.05, "v17 says slower at causal head dim 64"
    assert fwd[d64]["p"] < 0.05 and fwd[d128c]["p"] < 0.05 and fwd[d128]["p"] >= 0.05 and fwd[gqa]["p"] >= 0.05
    assert all(train[n]["p"] < 0.05 and train[n]["wins"] == train[n]["rounds"] for n in (d64, d128, gqa))
    assert train[d128c]["p"] >= 0.05 and train[d64c]["p"] >= 0.05
    for one in data["rows"]:  # v17a: slower than the portable kernel in every schedule, the more in flight the slower
        ms = [one["one_warpgroup_ms"][str(o)] for o in bench.ONE_WARPGROUP_SCHEDULES]
        assert min(ms) > fwd[one["shape"]["name"]]["previous"] and ms == sorted(ms), one["shape"]["name"]
    _assert_all_passed("nvidia-h100-80gb-hbm3-hopper-tests-v17.log", "v17 says every Hopper test passed")
    _assert_all_passed("nvidia-h100-80gb-hbm3-hopper-tests-v17-selection.log", "v17 says the selection tests passed")

    def rounds(x, faster=False):
        return f"{x['wins']} of {x['rounds']}{' rounds faster' if faster else ''}, p = {x['p']:.2g}"

    gluon_fwd = [fwd[n]["new"] / rows[n]["cudnn_fwd_ms"] for n in rows]
    v17_train = [train[n]["new"] / rows[n]["cudnn_fwd_bwd_ms"] for n in rows]
    texts = [
        f"a {res[(128, False, 64)]['stack']}-byte stack without a mask, {res[(128, True, 64)]['stack']} with a causal "
        "one",
        f"The Gluon forward took {fwd[d64]['ratio']:.2f}× of the portable one's time at N8192-D64 "
        f"({fwd[d64]['wins']} of {fwd[d64]['rounds']} rounds, p = {fwd[d64]['p']:.2g}), {fwd[d128]['ratio']:.2f}× at "
        f"N8192-D128 ({rounds(fwd[d128])}: not significant), {fwd[d128c]['ratio']:.2f}× at N8192-D128-causal "
        f"({rounds(fwd[d128c])}) and {fwd[gqa]['ratio']:.2f}× at the GQA shape ({rounds(fwd[gqa])}: not "
        f"significant), and {fwd[d64c]['ratio']:.2f}× at N8192-D64-causal ({rounds(fwd[d64c], True)}), where it is "
        "slower",
        f"The training call took {train[d64]['ratio']:.2f}× of v16's time at N8192-D64, {train[d128]['ratio']:.2f}× at "
        f"N8192-D128 and {train[gqa]['ratio']:.2f}× at the GQA shape ({train[d64]['wins']} of {train[d64]['rounds']} "
        f"rounds each, p = {train[d64]['p']:.2g}); at N8192-D128-causal it did not change "
        f"({train[d128c]['ratio']:.2f}×, {rounds(train[d128c], True)}), nor at N8192-D64-causal, which runs v16's "
        f"kernels ({train[d64c]['ratio']:.2f}×, {train[d64c]['wins']} of {train[d64c]['rounds']})",
        f"Against cuDNN the Gluon forward still takes {_ratio_span(gluon_fwd)} the time of an attention forward, and "
        f"the training call {_ratio_span(v17_train)} that of an attention forward+backward",
    ]
    return [Claim("docs/perf-notes.md", t, "benchmarks/results/nvidia-h100-80gb-hbm3-ws-fused-forward.json")
            for t in texts]


def short_context_v15_claims() -> list[Claim]:
    """perf-notes "Where the remaining gap is": the short-context targets measured on v15 (overhead.py, paired with a
    copy of v14, SDPA in every round)."""
    data = _json("nvidia-h100-80gb-hbm3-overhead-v15.json")
    paired, bert, host = data["against"]["bert_fwd_bwd_ms"], data["bert_fwd_bwd_ms"], data["host"]
    sdpa = [r["bert_fwd_bwd_ms_sdpa"] for r in data["against"]["per_round"]]
    assert paired["sign_test_p"] >= 0.05 and host["host_sync_free"]
    v9 = _json("nvidia-h100-80gb-hbm3-overhead-v9.json")["against"]["bert_fwd_bwd_ms"]
    texts = [
        f"over {paired['rounds']} rounds the training\n  call's forward+backward took a median "
        f"{paired['median_new_over_sdpa']:.2f}× SDPA's in the same rounds",
        f"which is why v9's run, with a slower SDPA,\n  read {v9['median_new_over_sdpa']:.2f}×)",
        f"({paired['rounds_new_faster']} of {paired['rounds']} rounds faster, p = {paired['sign_test_p']:.1g})",
        f"the call is {bert['naive_compile_over_streamkl']:.2f}×\n  faster than the naive loss",
        f"it is {bert['naive_compile_over_streamkl_cuda_graph']:.2f}× faster than the graphed naive loss and "
        f"{bert['streamkl_over_sdpa_cuda_graph']:.2f}× SDPA's",
        f"forward+backward is {host['streamkl_fwd_bwd_us']:.0f} µs, against SDPA's {host['sdpa_fwd_bwd_us']:.0f} µs",
        f"SDPA itself took {min(sdpa):.2f}–{max(sdpa):.2f} ms",
    ]
    source = "benchmarks/results/nvidia-h100-80gb-hbm3-overhead-v15.json"
    return [Claim("docs/perf-notes.md", t, source) for t in texts]


def causal_order_v12_claims() -> list[Claim]:
    """perf-notes v12: where the causal rows stood against their bounds in v11's run, and v12's longest-first order
    against v11 in paired rounds (which differences the sign test finds significant)."""
    import bench_causal_order as bench

    meta = report.load(report.PERF_NOTES_GRID)[0]
    with open(os.path.join(report.RESULTS, "nvidia-h100-80gb-hbm3-lazy-frames.json")) as f:
        before = report.training_gap_rows(meta["ceilings"], json.load(f))
    data = _json("nvidia-h100-80gb-hbm3-causal-order.json")
    assert all(c["new"] <= 1.05 * c["previous"] for c in data["checks"]), "v12 says it is as exact as v11"
    rows = {r["shape"]["name"]: r for r in data["rows"]}
    causal8k = [n for n in rows if n.startswith("N8192") and n.endswith("causal")]
    unchanged = [n for n in rows if n not in causal8k]
    kernel = {n: bench.paired(rows[n], "fused fwd") for n in rows}
    train = {n: bench.paired(rows[n], "training call") for n in rows}
    assert all(kernel[n]["p"] < 0.05 and train[n]["p"] < 0.05 for n in causal8k)
    assert all(kernel[n]["p"] >= 0.05 and train[n]["p"] >= 0.05 for n in unchanged)
    wins = {train[n]["wins"] for n in causal8k} | {kernel[n]["wins"] for n in causal8k}
    ps = {round(train[n]["p"], 3) for n in causal8k} | {round(kernel[n]["p"], 3) for n in causal8k}
    assert len(wins) == 1 and len(ps) == 1

    def span(values, digits=2, unit="×"):
        low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
        return f"{low}{unit}" if low == high else f"{low}–{high}{unit}"

    cudnn = lambda label: [train[n][label] / rows[n]["cudnn_fwd_bwd_ms"] for n in causal8k]
    source = "benchmarks/results/nvidia-h100-80gb-hbm3-causal-order.json"
    v11_causal = [r["bound"][1] / r["ms"] for r in before if r["name"].startswith("N8192") and "causal" in r["name"]]
    v11_dense = [r["bound"][1] / r["ms"] for r in before if "causal" not in r["name"]]
    return [Claim("docs/perf-notes.md", t, source) for t in (
        f"with a causal mask the training call ran at {_pct_span(v11_causal)}\n  of its no-overlap bound at N = 8192, "
        f"against {_pct_span(v11_dense)} without a mask",
        f"the fused forward took {span([kernel[n]['ratio'] for n in causal8k])} v11's time and the training call\n  "
        f"{span([train[n]['ratio'] for n in causal8k])} ({wins.pop()} of {data['rounds']} rounds each, p = "
        f"{ps.pop():.2g}), which moves the training call from {span(cudnn('previous'))} to {span(cudnn('new'))} "
        f"cuDNN attention's",
        f"show no difference the sign test finds significant (p ≥ "
        f"{min(min(kernel[n]['p'], train[n]['p']) for n in unchanged):.2g})",
        f"The long-context target (≤ {report.TRAINING_TARGET}×) stays unmet",
    )] + [Claim("docs/perf-notes.md", t, "benchmarks/results/nvidia-h100-80gb-hbm3-causal-order-paths.json")
          for t in path_claims(bench, _json("nvidia-h100-80gb-hbm3-causal-order-paths.json"))]


def path_claims(bench, data: dict) -> list[str]:
    """perf-notes v12's other callers (``bench_causal_order.py --paths``): the causal calls that run the portable
    kernels against v11, and the metric at head dim 128 (the unchanged Hopper forward)."""
    rows = {r["shape"]["name"]: r for r in data["rows"]}
    stats = {(n, p): bench.paired(rows[n], p) for n in rows for p in bench.PATHS}
    hopper = ("N8192-D128-causal", "metric")
    changed = [x for (n, p), x in stats.items() if n.endswith("causal") and (n, p) != hopper]
    unchanged = [x for (n, p), x in stats.items() if not n.endswith("causal") or (n, p) == hopper]
    assert all(x["wins"] == x["rounds"] for x in changed) and all(x["p"] >= 0.05 for x in unchanged)
    low, high = min(x["ratio"] for x in changed), max(x["ratio"] for x in changed)
    return [f"The other causal calls took {low:.2f}–{high:.2f}× v11's time ({changed[0]['wins']} of "
            f"{changed[0]['rounds']} rounds each)",
            f"({stats[hopper]['ratio']:.2f}×, not significant"]


def key_pass_v10_claims() -> list[Claim]:
    """perf-notes v10: the Hopper key pass against the portable one and the training call against cuDNN, over the
    long-context shapes of one run (the BERT-sized row apart), and v6's ratio to cuDNN for comparison."""
    name = "nvidia-h100-80gb-hbm3-hopper-key-pass.json"
    data = _json(name)
    assert all(c["ok"] for c in data["checks"]), "a key-pass check failed: v10 says every check passed"
    long = [r for r in data["shapes"] if r["n"] >= 4096]
    bert = next(r for r in data["shapes"] if r["name"].startswith("BERT"))
    assert all(r["default_picks_hopper"] for r in long) and not bert["default_picks_hopper"]
    assert all(r["op_train_default_ms"] - r["hopper_bwd_ms"] > r["hopper_bwd_ms"] for r in long), \
        "the key pass is no longer the smaller part of the training call: v10's conclusion says it is"

    def span(values, digits=2):
        return f"{min(values):.{digits}f}–{max(values):.{digits}f}"

    kernel = span([r["hopper_bwd_ms"] / r["portable_bwd_ms"] for r in long])
    train = span([r["op_train_default_ms"] / r["op_train_portable_ms"] for r in long])
    cudnn = span([r["op_train_default_ms"] / r["cudnn_fwd_bwd_ms"] for r in long])
    v6 = span([r["ms"]["op fwd+bwd fused"] / r["ms"]["sdpa-cudnn fwd+bwd"]
               for r in _json("nvidia-h100-80gb-hbm3-fused-dq.json")["rows"] if r["shape"]["n"] >= 4096])
    by_name = {r["name"]: r for r in long}
    launch = data["launch_host_us"]
    best, worst = by_name["N8192-D128"], by_name["N8192-D64-causal"]
    source = f"benchmarks/results/{name}"
    return [Claim("docs/perf-notes.md", t, source) for t in (
        f"on the {dict(enumerate(('no', 'one', 'two', 'three', 'four', 'five', 'six', 'seven')))[len(long)]} "
        f"long-context shapes the Hopper key pass took {kernel}× the portable pass's time, and "
        f"the training call {train}× ({cudnn}× cuDNN attention's forward+backward, where v6 stood at {v6}×)",
        f"largest at head dim 128 ({100 * best['bound_ms'] / best['hopper_bwd_ms']:.0f}% of the key pass bound "
        f"without a mask) and smallest with a causal mask at head dim 64 "
        f"({100 * worst['bound_ms'] / worst['hopper_bwd_ms']:.0f}%)",
        f"the forced Hopper pass took {bert['hopper_bwd_ms'] / bert['portable_bwd_ms']:.2f}× the portable one",
        f"and its {bert['op_train_default_ms'] / bert['op_train_portable_ms']:.2f}× is this machine's noise",
        f"the training call is {cudnn}× cuDNN attention's forward+backward against ≤ 1.15×",
        "host time per launch (`launch_host_us`): the Hopper key pass "
        f"{launch['hopper_key_pass_kernel']:.0f} µs, the Hopper forward {launch['hopper_forward_kernel']:.0f} µs, "
        f"the portable forward {launch['portable_forward_kernel']:.0f} µs; the training path's backward took "
        f"{launch['bwd_hopper_key_pass']:.0f} µs of host time with the Hopper key pass and "
        f"{launch['bwd_portable_key_pass']:.0f} µs with the portable one",
    )] + [Claim("docs/concepts/streamkl.md", f"the key pass: {kernel}× the portable pass's time on long-context shapes",
                source)]


def host_path_v9_claims() -> list[Claim]:
    """perf-notes v9: the host path's pieces on the v8 code, and v9 against v8 in paired rounds."""
    v8_file = "benchmarks/results/nvidia-h100-80gb-hbm3-overhead-v8-profile.json"
    v9_file = "benchmarks/results/nvidia-h100-80gb-hbm3-overhead-v9.json"
    v8, v9 = _json("nvidia-h100-80gb-hbm3-overhead-v8-profile.json"), _json("nvidia-h100-80gb-hbm3-overhead-v9.json")
    assert v8["host"]["host_sync_free"] and v9["host"]["host_sync_free"], "an overhead run saw a host synchronisation"
    pieces = v8["breakdown_us"]
    iterations = 100  # torch_profile_table(fwd_bwd, 100, ...) in benchmarks/overhead.py

    def counts(result: dict) -> tuple[int, int]:
        table = result["torch_profile_fwd_bwd"]
        kernels = torch_profile_calls(table, "cudaLaunchKernel")
        allocations = torch_profile_calls(table, "aten::empty") + torch_profile_calls(table, "aten::empty_strided")
        return kernels // iterations, allocations // iterations

    (k8, a8), (k9, a9) = counts(v8), counts(v9)
    assert k8 - k9 == 4, (k8, k9)
    predicted = (k8 - k9) * pieces["torch_elementwise"] + (a8 - a9) * pieces["torch_empty"]
    tiny, bert = v9["against"]["tiny_fwd_bwd_us"], v9["against"]["bert_fwd_bwd_ms"]
    sdpa_rounds = [row["bert_fwd_bwd_ms_sdpa"] for row in v9["against"]["per_round"]]
    single = v9["bert_fwd_bwd_ms"]
    assert pieces["sdpa_fwd_bwd"] > 150 and pieces["noop_function_fwd_bwd"] < 150
    out = [Claim("docs/perf-notes.md", t, v8_file) for t in (
        f"on this host an allocation costs {pieces['torch_empty']:.1f} µs, one elementwise kernel "
        f"{pieces['torch_elementwise']:.1f} µs, an autograd Function that does nothing "
        f"{pieces['noop_function_fwd_bwd']:.0f} µs per forward+backward",
        f"SDPA's forward+backward {pieces['sdpa_fwd_bwd']:.0f} µs and the op's {pieces['op_fwd_bwd']:.0f} µs; torch "
        f"launched {k8} kernels and made {a8} allocations per forward+backward",
        f"cost at least {predicted:.0f} µs (their prices measured alone",
        f"an empty one costs {pieces['noop_function_fwd_bwd']:.0f} µs on this host, and SDPA's forward+backward, all "
        f"C++, costs {pieces['sdpa_fwd_bwd']:.0f} µs")]
    out += [Claim("docs/perf-notes.md", t, v9_file) for t in (
        f"in {tiny['rounds']} alternating rounds",
        f"took from {min(sdpa_rounds):.3f} to {max(sdpa_rounds):.3f} ms between rounds",
        f"tiny forward+backward (B=1 H=4 N=128): {tiny['median_new']:.0f} µs against {tiny['median_base']:.0f} µs, "
        f"median ratio {tiny['median_ratio_base_over_new']:.2f}×, v9 faster in {tiny['rounds_new_faster']} of "
        f"{tiny['rounds']} rounds (sign test p = {tiny['sign_test_p']:.2g})",
        f"forward+backward, eager: {bert['median_new']:.3f} ms against {bert['median_base']:.3f} ms, median ratio "
        f"{bert['median_ratio_base_over_new']:.2f}×, v9 faster in {bert['rounds_new_faster']} of {bert['rounds']} "
        f"rounds (sign test p = {bert['sign_test_p']:.2g}); {bert['median_new_over_sdpa']:.2f}× SDPA's in the same "
        f"rounds, where v8 took {bert['median_base_over_sdpa']:.2f}×",
        f"counts {k9} kernels and {a9} allocations from torch per forward+backward (v8: {k8} and {a8})",
        f"the tiny forward+backward took {v9['host']['streamkl_fwd_bwd_us']:.0f} µs there against SDPA's "
        f"{v9['host']['sdpa_fwd_bwd_us']:.0f} µs, and the BERT-sized call took {single['streamkl_over_sdpa']:.2f}× "
        f"SDPA's and ran {single['naive_compile_over_streamkl']:.2f}× faster than the naive loss",
        f"BERT-sized forward+backward within 2× SDPA's is {'met' if bert['median_new_over_sdpa'] <= 2 else 'not met'} "
        f"in these paired rounds ({bert['median_new_over_sdpa']:.2f}×); 3× faster than the compiled naive loss is "
        f"{'met' if single['naive_compile_over_streamkl'] >= 3 else 'not met'} eagerly (replayed from CUDA graphs it "
        f"is {single['naive_compile_over_streamkl_cuda_graph']:.2f}× faster in this run); and 150 µs of host time",
    )]
    teacher_file = "benchmarks/results/nvidia-h100-80gb-hbm3-pairs-teacher-v9.json"
    teacher = _json("nvidia-h100-80gb-hbm3-pairs-teacher-v9.json")
    assert teacher["sign_test_p"] > 0.05, "the capture changes now differ beyond the noise: say so in v9"
    out += [Claim("docs/perf-notes.md", t, teacher_file) for t in (
        f"{teacher['rounds']} alternating rounds): the plain pass took {teacher['ms']['plain']:.2f} ms, the pass "
        f"captured by v9 {teacher['ms']['new']:.2f} ms and by v8 {teacher['ms']['base']:.2f} ms; v9 was faster in "
        f"{teacher['rounds_new_faster']} of {teacher['rounds']} rounds (sign test p = {teacher['sign_test_p']:.2g})",
        f"the captured pass's remaining {teacher['new_over_plain']:.2f}×")]
    return out


def claims(r: Results) -> list[Claim]:
    """Every phrase of prose that quotes a result file, page by page, formatted from the files."""
    out: list[Claim] = []

    def add(page: str, source: str, *texts: str) -> None:
        out.extend(Claim(page, t, source) for t in texts)

    # --- the kernel benchmark (H100 grid): naive memory, README's "how fast"
    grid, grid_file = r.grid, "benchmarks/results/nvidia-h100-80gb-hbm3.json"
    mem8k = r.grid[1][report.plain(16, 64, True, 8192)]["naive-eager/mem"]
    oom16k = r.grid[1][report.plain(16, 64, True, 16384)]["naive-eager/mem"]
    assert oom16k == "OOM"
    maps = {n: 2 * 16 * n * n * 4 for n in (8192, 16384)}  # two fp32 maps, B=1, H=16: arithmetic
    peak = f"{mem8k / 2**30:.1f} GiB"
    for page in ("README.md", "docs/index.md"):
        add(page, f"arithmetic (2·16·8192²·4 bytes); {grid_file} (naive-eager/mem at N=8192 and 16384)",
            f"the two fp32 maps alone are {_gib(maps[8192], 0)} GiB (2·16·8192²·4 bytes)",
            f"materialised loss peaked at {peak} on an H100", "at 16k it ran out of memory")
    add("docs/concepts/attention-distillation.md", f"arithmetic; {grid_file}",
        f"\\(16 \\cdot 8192^2 \\cdot 4\\) bytes = {_gib(maps[8192] / 2, 0)} GiB",
        f"materialised loss peaked at {peak} on an H100", "At \\(N=16384\\) it ran out of memory")
    add("docs/faq.md", f"arithmetic; {grid_file}; {grid_file} (streamkl/mem per row)",
        f"that is {_gib(maps[8192], 0)} GiB of maps and {_gib(maps[8192] * 1.5, 0)} GiB with the gradient",
        f"at \\(N=16384\\), {_gib(maps[16384], 0)} GiB and {_gib(maps[16384] * 1.5, 0)} GiB",
        f"peaked at {peak} at N=8192 and ran out of memory at N=16384")
    per_row = r.grid[1][report.plain(16, 64, True, 131072)]["streamkl/mem"] / (16 * 131072)
    add("docs/faq.md", grid_file, f"about {per_row:.0f} bytes per query row and head")
    d64 = r.row(16, 64, False, 8192)
    fb, naive, comp = d64["streamkl/fwd+bwd"], d64["naive-eager/fwd+bwd"], d64["naive-compile/fwd+bwd"]
    add("README.md", grid_file,
        f"the fused forward+backward takes {fb:.1f} ms where the materialised loss takes {naive:.0f} ms eagerly "
        f"({naive / fb:.0f}×) and {comp:.0f} ms under `torch.compile`",
        f"it needs {per_row:.0f} bytes per query row and head",
        f"the forward is {d64['streamkl/fwd'] / d64['sdpa-flash/fwd']:.1f}× the FA2 forward and "
        f"{d64['streamkl/fwd'] / d64['sdpa-default/fwd']:.1f}× cuDNN's, the forward+backward "
        f"{fb / d64['sdpa-default/fwd+bwd']:.1f}× cuDNN's")

    # --- the default job (benchmarks/results/default_cpu)
    job_file = "benchmarks/results/default_cpu/results.json"
    setup, runs, ev = r.job["setup"], r.job["runs"], r.job["eval"]
    half = r.job["outcome"]["steps_to_half"]
    n = setup["train_seq_len"]
    kl = ev["attention_kl"]
    acc = {m: _pct(r.job_eval[m, n]) for m in ("teacher", "student_kl", "student_base")}
    add("README.md", job_file, f"a student still below it after its {setup['student_steps']} steps trains on")
    add("docs/concepts/attention-distillation.md", job_file,
        f"with the same {setup['student_steps']} steps, the students reach {acc['student_kl']}% with attention KL and "
        f"{acc['student_base']}% without")
    add("docs/quickstart.md", job_file,
        f"The teacher trains for {setup['teacher_steps']} steps on batches of {setup['teacher_data']['batch_size']}",
        f"trains for {setup['student_steps']} steps on batches of {setup['data']['batch_size']}",
        f"(torch {r.job['environment']['torch'].split('+')[0]}, {r.job['environment']['threads']} threads) the default "
        f"run gave this, with the teacher at {acc['teacher']}%",
        f"whole job {r.job['total_wall_s']:.0f} s",
        f"Chance is {_pct(setup['chance'])}%",
        f"passes 50% after {half['student_kl']} steps",
        f"when the {setup['student_steps']} steps run out",
        f"the teacher needed {r.teacher_half} steps on twice the batch to find it",
        f"its held-out KL is {kl['student_base']['layer0']:.1f} and {kl['student_base']['layer1']:.1f} nats per row "
        f"for the two layers, against {kl['student_kl']['layer0']:.2f} and {kl['student_kl']['layer1']:.2f}",
        f"At {max(ev['lengths'])} tokens, four times the training length")

    first = runs["student_kl"]["history"][0]
    add("docs/faq.md", job_file, f"the KL at the student's\nfirst step is {first['train/attn_kl/layer0']:.2f} and "
        f"{first['train/attn_kl/layer1']:.2f} nats per row")
    add("docs/guides/choosing.md", job_file,
        f"students of {setup['student_steps']} steps", f"within {setup['student_steps']} steps (",
        f"for\nall {setup['student_steps']} steps",
        f"a task loss of about {runs['student_kl']['history'][0]['train/loss']:.0f} nats at initialisation")
    add("docs/guides/cli.md", job_file,
        f"({setup['teacher_steps']} steps\nagainst {setup['student_steps']})")

    # --- gpu_long on one H100 (benchmarks/results/gpu_long_h100)
    gl_file = "benchmarks/results/gpu_long_h100/results.json"
    g = r.gpu_long
    grun, gsetup, gev, naive_b = g["runs"], g["setup"], g["eval"], g["naive_loss"]
    kl_w, kl_b = gev["attention_kl"]["student_kl"], gev["attention_kl"]["student_base"]
    sk, sb = grun["student_kl"], grun["student_base"]
    if r.long_context is None:  # README's long-context block quotes this run until the experiment's results exist
        add("README.md", gl_file,
            f"a student step with two attention-KL terms took {sk['step_ms_median']:.1f} ms "
            f"({sb['step_ms_median']:.1f} ms\nwithout) and peaked at {_gib(sk['peak_cuda_bytes'])} GiB, where the "
            "materialised loss would need "
            f"{_gib(naive_b['with_grad'], 0)} GiB")
    t_acc = gev["accuracy"]["teacher"][str(gsetup["train_seq_len"])]
    add("docs/guides/long-context.md", gl_file,
        f"`teacher_steps: {gsetup['teacher_steps']}`",
        f"whole job {g['total_wall_s']:.0f} s.",
        f"would need {_gib(naive_b['maps'], 0)} GiB of fp32 probability maps, {_gib(naive_b['with_grad'], 0)} GiB with "
        "one map-sized gradient per pair",
        f"peaked at {_gib(sk['peak_cuda_bytes'])} GiB, {_gib(sk['peak_cuda_bytes'] - sb['peak_cuda_bytes'])} GiB "
        f"({100 * (sk['peak_cuda_bytes'] / sb['peak_cuda_bytes'] - 1):.0f} %) above the same step without the term",
        f"add {sk['step_ms_median'] - sb['step_ms_median']:.0f} ms to a {sb['step_ms_median']:.0f} ms step",
        f"within {kl_w['layer0']:.3g} and {kl_w['layer1']:.3g} nats per row of the teacher's, against "
        f"{kl_b['layer0']:.1f} and {kl_b['layer1']:.1f} for the student",
        f"({_pct(t_acc)} % against {_pct(1 / gsetup['data']['vocab_size'])} % chance)",
        f"the plateau outlasted {gsetup['teacher_steps']} steps")
    cfg = r.config("**/configs/gpu_long.yaml")
    job_cfg, data_cfg = cfg["job"], cfg["data"]["init_args"]
    b, h, n_long = data_cfg["batch_size"], setup["student_hparams"]["num_heads"], data_cfg["seq_len"]
    long_maps = 2 * 2 * b * h * n_long**2 * 4  # two pairs, two fp32 maps each: arithmetic
    *short_lengths, last = job_cfg["teacher_data"]["seq_len"]
    add("docs/guides/long-context.md", "the gpu_long config (lightning_streamkl/configs/gpu_long.yaml) and arithmetic",
        f"({job_cfg['teacher_steps']} steps of batch {job_cfg['teacher_data']['batch_size']} at "
        f"{', '.join(map(str, short_lengths))} and {last} tokens)", f"students at **N = {n_long}**",
        f"For \\(B={b}, H={h}, N={n_long}\\) and two pairs, that is {_gib(long_maps, 0)} GiB of maps and "
        f"{_gib(long_maps * 1.5, 0)} GiB with the gradient")
    add("docs/examples.md", gl_file, f"{g['total_wall_s']:.0f} s on one H100 (first teacher settings")

    # --- the CPU check of the teacher's plateau (benchmarks/results/teacher_plateau_cpu)
    from lightning_streamkl.jobs.report import first_step_reaching

    check = r.plateau
    check_acc, check_setup = check["eval"]["accuracy"]["teacher"], check["setup"]
    add("docs/guides/long-context.md", "benchmarks/results/teacher_plateau_cpu/batch32_128_512/results.json",
        f"A CPU check at batch {check_setup['teacher_data']['batch_size']}, alternating between "
        f"{' and '.join(map(str, check_setup['teacher_data']['seq_len']))} tokens, did learn: 50 % training accuracy "
        f"after {first_step_reaching(check['runs']['teacher']['history'], 'train/acc', 0.5)} steps, and after "
        f"{check_setup['teacher_steps']} steps {_pct(check_acc['128'])} % held out at N = 128 and "
        f"{_pct(check_acc['512'])} % at N = 512, but {_pct(check_acc['1024'])} % at N = 1024")

    # --- the ablation (benchmarks/results/ablation_cpu.json)
    ab_file = "benchmarks/results/ablation_cpu.json"
    default, none = "both layers, forward, T=1, weight 1 (default)", "no attention KL"

    def span(values: list[float], fmt: str = "{:.0f}", sep: str = "–") -> str:
        return f"{fmt.format(min(values))}{sep}{fmt.format(max(values))}"

    def mean_steps(variant: str) -> float:
        return statistics.mean(r.abl_steps(variant))

    kl1 = {v: [x["attention_kl"]["layer1"] for x in r.ablation[v]] for v in (default, "weight 10", "direction reverse")}
    weights = [statistics.mean(x["acc_128"] for x in r.ablation[v]) for v in ("weight 0.1", default, "weight 10")]
    add("docs/guides/choosing.md", ab_file,
        f"Distilling only layer 1 (the\ninduction head) reaches {r.abl_mean('layer 1 only', 'acc_128')} % against "
        f"{r.abl_mean(default, 'acc_128')} % for both layers, and needs about "
        f"{mean_steps('layer 1 only') - mean_steps(default):.0f} more steps",
        f"({r.abl_mean('layer 0 only', 'acc_128')} %, against {r.abl_mean(none, 'acc_128')} % without distillation)",
        f"({r.abl_mean('direction reverse', 'acc_128')} %, below the\n{r.abl_mean(none, 'acc_128')} % of no "
        f"distillation)",
        f"layer 1 stayed about {statistics.mean(kl1['direction reverse']):.0f} nats per row away",
        f"after {span(r.abl_steps('temperature 2'))} steps, against {span(r.abl_steps(default))} at \\(T = 1\\) and "
        f"{span(r.abl_steps('temperature 0.5'))} at \\(T = 0.5\\)",
        f"({r.abl_mean('temperature 2', 'acc_256')} % at N = 256, against {r.abl_mean(default, 'acc_256')} % and "
        f"{r.abl_mean('temperature 0.5', 'acc_256')} %)",
        f"all reach {math.floor(100 * min(weights))}–{math.floor(100 * max(weights))} %",
        f"passes\n50 % about {mean_steps('weight 0.1') - mean_steps(default):.0f} steps later",
        f"({r.abl_mean('weight 0.1', 'acc_256')} %\nat N = 256, against {r.abl_mean(default, 'acc_256')} % at weight 1 "
        f"and {r.abl_mean('weight 10', 'acc_256')} % at 10)",
        f"({span(kl1['weight 10'], '{:.2f}', ' to ')} nats per row on layer 1, against "
        f"{span(kl1[default], '{:.2f}', ' to ')} at weight 1)")

    # --- the continual benchmark (benchmarks/results/continual_*.json and the stats)
    ct_file = "benchmarks/results/continual_cpu10.json and continual_cpu10_stats.json"
    ti, di = "task-incremental", "domain-incremental"

    def s10(scenario: str, method: str, key: str) -> str:
        return _pct(r.summary("cpu10", scenario, method)[key][0])

    def s10r(scenario: str, method: str, key: str) -> str:
        return f"{100 * r.summary('cpu10', scenario, method)[key][0]:.0f}"

    def vs(scenario: str, method: str, base: str = "finetune", metric: str = "final_accuracy") -> dict:
        return r.stats[scenario, method, base, metric]

    def diff(c: dict, sign: bool = True) -> str:
        return f"{100 * c['mean_difference']:{'+' if sign else ''}.1f} ± {100 * c['se']:.1f}"

    a_ti, l_ti, a_di, l_di = vs(ti, "attention"), vs(ti, "lwf"), vs(di, "attention"), vs(di, "lwf")
    al_l_ti, al_l_di = vs(ti, "attention+lwf", "lwf"), vs(di, "attention+lwf", "lwf")
    al_l_forget = vs(ti, "attention+lwf", "lwf", "forgetting")
    first_ti, first_di = vs(ti, "attention", metric="first_task_final"), vs(di, "attention", metric="first_task_final")
    cost = r.continual["cpu"]["cost"]
    add("docs/guides/continual.md", ct_file,
        f"from {s10r(ti, 'finetune', 'first_task_final')} to {s10r(ti, 'attention', 'first_task_final')} % with\n"
        f"one head per task ({_p(first_ti['p_t'])}), and from {s10r(di, 'finetune', 'first_task_final')} to "
        f"{s10r(di, 'attention', 'first_task_final')} % with a shared head ({_p(first_di['p_t'])})",
        f"by {diff(a_ti, False)} points over plain fine-tuning (better on\n{a_ti['seeds_better']} of {a_ti['n']} "
        f"seeds), which is not significant ({_p(a_ti['p_t'])}, paired t-test, {a_ti['n']} seeds)",
        f"raises it by {diff(l_ti, False)} points ({_p(l_ti['p_t'])})",
        f"by {diff(a_di, False).lstrip('-')} points\n({_p(a_di['p_t'])})",
        f"({diff(l_di)},\n{_p(l_di['p_t'])}, not significant)",
        f"({s10(ti, 'attention+lwf', 'forgetting')} against {s10(ti, 'lwf', 'forgetting')} points), but that "
        f"difference is\nnot significant ({_p(al_l_forget['p_t'])})",
        f"by {abs(100 * al_l_ti['mean_difference']):.1f} points with one head per task (not significant, "
        f"{_p(al_l_ti['p_t'])}) and by {abs(100 * al_l_di['mean_difference']):.1f} points with a shared head\n"
        f"({_p(al_l_di['p_t'])}, significant by a small margin)",
        f"its final accuracy is {s10(ti, 'attention', 'first_task_final')} % (task-incremental) and "
        f"{s10(di, 'attention', 'first_task_final')} %\n(domain-incremental), against "
        f"{s10(ti, 'finetune', 'first_task_final')} % and {s10(di, 'finetune', 'first_task_final')} % for "
        f"fine-tuning. After the second task it is "
        f"{_pct(r.summary('cpu10', ti, 'attention')['matrix_mean'][0][1])} % against\n"
        f"{_pct(r.summary('cpu10', ti, 'finetune')['matrix_mean'][0][1])} %",
        f"net gain ({diff(a_ti)}, {a_ti['seeds_better']}/{a_ti['n']} seeds) that is not significant "
        f"({_p(a_ti['p_t'])}, paired t-test)",
        f"ends at\n{_pct(r.summary('cpu10', di, 'attention')['matrix_mean'][1][2])} % against "
        f"{_pct(r.summary('cpu10', di, 'finetune')['matrix_mean'][1][2])} % for fine-tuning",
        f"falls by {diff(a_di, False).lstrip('-')} points ({a_di['seeds_better']}/{a_di['n']}\n   seeds better, "
        f"{_p(a_di['p_t'])})",
        f"{diff(l_ti)} ({l_ti['seeds_better']}/{l_ti['n']}, {_p(l_ti['p_t'])}) with one head per task",
        f"({diff(l_di)}, not\n   significant, {_p(l_di['p_t'])})",
        f"with one head per task ({s10(ti, 'attention+lwf', 'forgetting')} ± "
        f"{_pct(r.summary('cpu10', ti, 'attention+lwf')['forgetting'][1])}), but not significantly below\n   LwF "
        f"alone ({_p(al_l_forget['p_t'])})",
        f"(accuracy right after learning {s10(ti, 'attention+lwf', 'learning_accuracy')} % against "
        f"{s10(ti, 'lwf', 'learning_accuracy')} % for LwF alone)",
        f"(not significant with one head per task, {_p(al_l_ti['p_t'])};\n   significant by a small margin with a "
        f"shared head, {_p(al_l_di['p_t'])})",
        f"(about {r.continual['cpu10']['meta']['wall_seconds'] / 60:.0f} minutes on 2 cores)")
    add("docs/guides/continual.md", "benchmarks/results/continual_cpu.json (cost: ms per step, same machine, in turns)",
        f"{cost[ti]['attention'] / cost[ti]['finetune']:.2f}× (one head per task) and "
        f"{cost[di]['attention'] / cost[di]['finetune']:.2f}× (shared head)")
    sweep = r.continual["sweep"]["summary"][di]
    add("docs/guides/continual.md", "benchmarks/results/continual_sweep.json",
        f"(accuracy right\n   after learning {100 * sweep['lwf λ=1']['learning_accuracy'][0]:.0f} % at λ = 1, "
        f"{100 * sweep['lwf λ=10']['learning_accuracy'][0]:.0f} % at λ = 10, in the\n   sweep)")
    gpu = r.config("benchmarks/continual/gpu.yaml")
    words = {4: "four", 10: "ten"}
    add("docs/guides/continual.md", "benchmarks/continual/gpu.yaml",
        f"sequences of {gpu['length']}\ntokens, a {gpu['model']['layers']}-layer d={gpu['model']['d_model']} model, "
        f"{words[len(gpu['tasks'])]} tasks, {gpu['steps_per_task']} steps per task and "
        f"{words[len(gpu['seeds'])]} seeds")

    out.extend(continual_benchmark_claims(r))

    # --- MiniLM (benchmarks/results/minilm_cpu*.json)
    ml_file = "benchmarks/results/minilm_cpu.json, minilm_cpu_weight0.1.json"

    def ml(results: dict, side: str, key: str) -> float:
        return statistics.mean(x[side][key] for x in results["runs"])

    w1, w01, ms = r.minilm, r.minilm_w01, r.minilm["runs"][0]["setup"]
    add("docs/examples.md", ml_file,
        f"({ms['teacher_params'] / 1e6:.1f}M parameters)",
        f"({ms['student_params'] / 1e6:.1f}M parameters, {ms['student_trained_params'] / 1e6:.1f}M of them trained)",
        f"attends like the teacher's ({ml(w1, 'with_kl', 'attn_kl_last'):.2f} nats per row\nagainst "
        f"{ml(w1, 'without_kl', 'attn_kl_last'):.2f})",
        f"trained for {w1['args']['steps']} steps have little capacity",
        f"the\nattention still nearly matches ({ml(w01, 'with_kl', 'attn_kl_last'):.2f} nats per row against "
        f"{ml(w01, 'without_kl', 'attn_kl_last'):.2f}), and the embeddings lose almost nothing: cosine\n"
        f"{ml(w01, 'with_kl', 'cosine'):.3f} against {ml(w01, 'without_kl', 'cosine'):.3f}, similarity correlation "
        f"{ml(w01, 'with_kl', 'similarity_corr'):.3f} against {ml(w01, 'without_kl', 'similarity_corr'):.3f}, same "
        f"nearest paragraph {ml(w01, 'with_kl', 'neighbour_agreement'):.3f} against "
        f"{ml(w01, 'without_kl', 'neighbour_agreement'):.3f}")

    rel_file = "benchmarks/results/minilm_relations_cpu.json (paired t-tests over its 3 seeds)"
    add("docs/examples.md", rel_file,
        f"has the same sign on all three seeds ({_p(r.minilm_paired_p('cosine'))}, paired t-test)",
        f"({_p(r.minilm_paired_p('similarity_corr'))} for the similarity correlation, "
        f"{_p(r.minilm_paired_p('neighbour_agreement'))} for the nearest\nparagraph)")

    # --- perf notes: the grid, the tuning sweep, the overhead profile
    tu_file = "benchmarks/results/nvidia-h100-80gb-hbm3-tuning.json"
    best = {(k.split("/")[0], int(k.split("/D")[1].split("/")[0])): v["false"]["ms"]
            for k, v in r.tuning.items() if k.endswith("/best")}
    grid, grid_file = r.grid_v3, "benchmarks/results/runs/nvidia-h100-80gb-hbm3-v3.json"  # the v3 kernels

    def v3(h: int, d: int, causal: bool, n: int) -> dict:
        return grid[1][report.plain(h, d, causal, n)]

    d64 = v3(16, 64, False, 8192)
    meta = grid[0]
    add("docs/perf-notes.md", grid_file,
        f"(torch {meta['torch'].split('+')[0].rsplit('.', 1)[0]}, Triton {meta['triton'].rsplit('.', 1)[0]})")
    fwd64 = r.tuning["fwd/D64/best"]["false"]["config"]
    add("docs/perf-notes.md", tu_file,
        f"({fwd64['block_m']}×{fwd64['block_n']} tiles with {fwd64['num_warps']} warps, the fastest D=64 forward tile "
        "of the sweep)")
    add("docs/perf-notes.md", tu_file,
        f"({best['bwd-det-dq', 64]:.3f} against {best['bwd-atomic', 64]:.3f} ms at D=64, {best['bwd-det-dq', 128]:.3f} "
        f"against {best['bwd-atomic', 128]:.3f} ms at D=128, non-causal)")
    fp32 = grid[1][(16, 64, False, 4096, "float32", None, None, False)]
    d128 = v3(16, 128, False, 32768)
    fwd_bound = {d: grid[0]["bounds"][report.plain(16, d, False, 8192)]["fwd_bound_ms"] for d in (64, 128)}
    b1024 = grid[0]["bounds"][report.plain(16, 64, False, 1024)]
    short = [v3(16, d, c, n)["streamkl/fwd+bwd"] for d in (64, 128) for c in (False, True)
             for n in (1024, 2048, 4096)]
    d128_8k = v3(16, 128, False, 8192)
    spread = re.search(r"(\d\.\d-\d\.\d) ms", " ".join(meta["notes"])).group(1)
    add("docs/perf-notes.md", grid_file,
        f"fp32 inputs ({fp32['streamkl-atomic/bwd']:.1f} against {fp32['streamkl/bwd']:.1f} ms at N=4096, D=64) and "
        f"D=128 at\n  N=32768 ({d128['streamkl-atomic/bwd']:.1f} against {d128['streamkl/bwd']:.1f} ms",
        f"up to the exp bound ({fwd_bound[64]:.2f} ms at D=64)",
        f"the D=64 forward takes {d64['streamkl/fwd']:.3f} ms against its {fwd_bound[64]:.2f} ms\n  exp bound "
        f"({100 * fwd_bound[64] / d64['streamkl/fwd']:.0f}%)",
        f"takes {min(short):.2f} to {max(short):.2f} ms (H=16;\n  D=64 and 128, causal or not), far above its "
        f"exp/matmul bound of {b1024['fwd_bound_ms'] + b1024['bwd_bound_ms']:.2f} ms at N=1024",
        f"runs at {100 * fwd_bound[64] / d64['streamkl/fwd']:.0f}% (D=64) and "
        f"{100 * fwd_bound[128] / d128_8k['streamkl/fwd']:.0f}% (D=128) of max(exp bound, matmul bound)",
        f"{d64['streamkl/fwd'] / d64['sdpa-default/fwd']:.2f}×/"
        f"{d128_8k['streamkl/fwd'] / d128_8k['sdpa-default/fwd']:.2f}× the cuDNN attention forward and "
        f"{d64['streamkl/fwd'] / d64['sdpa-flash/fwd']:.2f}×/"
        f"{d128_8k['streamkl/fwd'] / d128_8k['sdpa-flash/fwd']:.2f}× the FA2 attention forward",
        f"The backward is {d64['streamkl/bwd'] / d64['sdpa-default/bwd']:.2f}× the\ncuDNN attention backward at D=64 "
        f"and {d128_8k['streamkl/bwd'] / d128_8k['sdpa-default/bwd']:.2f}× at D=128",
        f"({fwd_bound[64]:.2f} ms at D=64, {d64['streamkl/fwd'] / fwd_bound[64]:.2f}× faster than its "
        f"{d64['streamkl/fwd']:.3f} ms)",
        f"run-to-run spread (~{spread} ms at N ≤ 4096)")
    oh_file = "benchmarks/results/nvidia-h100-80gb-hbm3-overhead.txt"
    launches, _, launch_cum = r.profile("jit.py:695(run)")
    specialise = r.profile("native_specialize_impl")[0]
    engine = r.profile("run_backward")
    add("docs/perf-notes.md", oh_file,
        f"{r.per_call_us('streamkl fwd')} µs per forward and {r.per_call_us('streamkl fwd+bwd')} µs per "
        f"forward+backward, against {r.per_call_us('sdpa fwd+bwd (+sum)')} µs for an SDPA forward+backward",
        f"launcher ~{1e6 * launch_cum / launches:.0f} µs per launch (three launches per call; `JITFunction.run` "
        f"re-specialises ~{specialise / launches:.0f} arguments on\n  every launch), the autograd engine "
        f"~{1e6 * engine[1] / engine[0]:.0f} µs")

    v5_file = "benchmarks/results/nvidia-h100-80gb-hbm3-overhead.json"
    v5 = _json("nvidia-h100-80gb-hbm3-overhead.json")
    host, bert = v5["host"], v5["bert_fwd_bwd_ms"]

    compile_verdict = "met" if bert["naive_compile_over_streamkl"] >= 3 else "not\n  met"
    engine_calls, _, engine_cum = profile_row(v5["profile_fwd_bwd"], "run_backward")
    launch_calls, _, launch_cum = profile_row(v5["profile_fwd_bwd"], "_launch.py")
    add("docs/perf-notes.md", v5_file,
        f"{host['streamkl_fwd_us']:.0f} µs per forward and {host['streamkl_fwd_bwd_us']:.0f} µs per\n  "
        f"forward+backward at B=1 H=4 N=128 (v3: {r.per_call_us('streamkl fwd')} and "
        f"{r.per_call_us('streamkl fwd+bwd')} µs), against {host['sdpa_fwd_bwd_us']:.0f} µs for an SDPA "
        "forward+backward",
        f"takes {bert['streamkl']:.3f} ms: {bert['streamkl_over_sdpa']:.2f}×\n  SDPA's {bert['sdpa_default']:.3f} ms "
        f"(target ≤ 2×: {'met' if bert['streamkl_over_sdpa'] <= 2 else 'not met'}) and "
        f"{bert['naive_compile_over_streamkl']:.2f}× faster than the naive loss",
        f"target ≥ 3×: {compile_verdict}",
        f"puts {1e6 * engine_cum / engine_calls:.0f} µs per call inside `run_backward`",
        f"the direct launches cost {1e6 * launch_cum / launch_calls:.0f} µs each")
    assert host["host_sync_free"], "the v5 overhead run saw a host synchronisation"
    v5b_file = "benchmarks/results/nvidia-h100-80gb-hbm3-overhead-v5b.json"
    v5b = _json("nvidia-h100-80gb-hbm3-overhead-v5b.json")
    host_b, bert_b = v5b["host"], v5b["bert_fwd_bwd_ms"]
    assert host_b["host_sync_free"], "the v5b overhead run saw a host synchronisation"
    add("docs/perf-notes.md", v5b_file,
        f"{host_b['streamkl_fwd_us']:.0f} µs per forward and\n  {host_b['streamkl_fwd_bwd_us']:.0f} µs per "
        f"forward+backward at B=1 H=4 N=128 (v5: {host['streamkl_fwd_bwd_us']:.0f} µs), against "
        f"{host_b['sdpa_fwd_bwd_us']:.0f} µs for an SDPA forward+backward",
        f"took {bert_b['streamkl']:.3f} ms, {bert_b['streamkl_over_sdpa']:.2f}× SDPA's {bert_b['sdpa_default']:.3f} ms "
        f"in this run\n  and {bert_b['naive_compile_over_streamkl']:.2f}× faster than the naive loss",
        f"fell from {r.per_call_us('streamkl fwd+bwd')} µs (v3) to {host_b['streamkl_fwd_bwd_us']:.0f} µs")

    v6_file = "benchmarks/results/nvidia-h100-80gb-hbm3-overhead-v6.json"
    host_6 = _json("nvidia-h100-80gb-hbm3-overhead-v6.json")["host"]
    assert host_6["host_sync_free"], "the v6 overhead run saw a host synchronisation"
    bert_6 = _json("nvidia-h100-80gb-hbm3-overhead-v6.json")["bert_fwd_bwd_ms"]
    add("docs/perf-notes.md", v6_file,
        f"{host_6['streamkl_fwd_us']:.0f} µs per forward and {host_6['streamkl_fwd_bwd_us']:.0f} µs per "
        f"forward+backward at B=1 H=4 N=128, against {host_6['sdpa_fwd_bwd_us']:.0f} µs for an SDPA "
        "forward+backward in the same run",
        f"(about {host_6['streamkl_fwd_bwd_us'] / host_6['sdpa_fwd_bwd_us']:.0f}×)",
        f"Eagerly the op took {bert_6['streamkl']:.3f} ms, {bert_6['streamkl_over_sdpa']:.2f}× SDPA's "
        f"{bert_6['sdpa_default']:.3f} ms and {bert_6['naive_compile_over_streamkl']:.2f}× faster than the naive loss "
        "under `torch.compile`",
        f"replayed from CUDA graphs it took {bert_6['streamkl_cuda_graph']:.3f} ms, "
        f"{bert_6['streamkl_over_sdpa_cuda_graph']:.2f}× SDPA's {bert_6['sdpa_default_cuda_graph']:.3f} ms "
        "(target ≤ 2×: "
        f"{'met' if bert_6['streamkl_over_sdpa_cuda_graph'] <= 2 else 'not met'}) and "
        f"{bert_6['naive_compile_over_streamkl_cuda_graph']:.2f}× faster than the compiled naive loss's "
        f"{bert_6['naive_compile_cuda_graph']:.3f} ms (target ≥ 3×: "
        f"{'met' if bert_6['naive_compile_over_streamkl_cuda_graph'] >= 3 else 'not met'})")

    out += host_path_v9_claims()
    out += key_pass_v10_claims()
    out += lazy_frames_v11_claims()
    out += training_gap_claims()
    out += causal_order_v12_claims()
    out += ws_key_pass_v13_claims()
    out += peeled_key_pass_v14_claims()
    out += bf16_dq_v15_claims()
    out += short_context_v15_claims()
    out += kernel_profile_claims()
    out += one_set_key_pass_v16_claims()
    out += ws_fused_forward_v17_claims()
    out += grid_refresh_claims()
    out += gluon_causal_order_v18_claims()
    out += three_consumers_claims()
    out += exponent_difference_v19_claims()

    pairs_file = "benchmarks/results/nvidia-h100-80gb-hbm3-pairs.json"
    bert_p, padded_p, minilm_p, long_p = _json("nvidia-h100-80gb-hbm3-pairs.json")["rows"]
    sdpa_spread = max(max(r["runs_ms"][f"SDPA x {r['pairs']}"]) / min(r["runs_ms"][f"SDPA x {r['pairs']}"])
                      for r in (bert_p, padded_p, minilm_p, long_p))
    assert abs(minilm_p["fused_over_sdpa"] - 1) < sdpa_spread - 1, "the MiniLM row is no longer within the noise"
    step_p = _json("nvidia-h100-80gb-hbm3-pairs.json")["step"]
    add("docs/perf-notes.md", pairs_file,
        f"the loss's forward+backward is {bert_p['per_pair_over_fused']:.2f}× faster than one call per pair\n"
        f"  ({padded_p['per_pair_over_fused']:.2f}× with a padded batch) and costs {bert_p['fused_over_sdpa']:.2f}× "
        "the student's own twelve SDPA\n"
        f"  attention calls, where one call per pair cost {bert_p['per_pair_over_sdpa']:.2f}×",
        f"{minilm_p['per_pair_over_fused']:.2f}× with\n  six pairs at N = 128, {long_p['per_pair_over_fused']:.2f}× "
        "with eight pairs at N = 2048",
        f"SDPA's repeats differ by up to {sdpa_spread:.2f}×",
        f"the distilled step took\n  {step_p['fused_over_alone']:.2f}× the student's step alone, against "
        f"{step_p['per_pair_over_alone']:.2f}× with one call per pair (per pair slower in "
        f"{step_p['rounds_per_pair_slower']} of {step_p['rounds']} paired\n  rounds, sign test p = "
        f"{step_p['sign_test_p']:.2g})",
        f"that pass still costs {step_p['captured_teacher_over_plain']:.2f}× the teacher's forward alone")
    add("README.md", pairs_file,
        f"forward+backward of the loss is {bert_p['per_pair_over_fused']:.2f}× faster than one call per pair")

    rt_file = "benchmarks/results/nvidia-h100-80gb-hbm3-real-teacher.json"
    ratios = _json("nvidia-h100-80gb-hbm3-real-teacher.json")["ratios_fwd_bwd"]
    add("docs/perf-notes.md", rt_file,
        f"cost {ratios['packed / dense (causal, same pairs)']:.1f}× the separate dense problems with the same allowed\n"
        f"  pairs, and a window {ratios['window / dense-full (same pairs)']:.1f}×")

    out += indexer_claims(r)
    out += sharding_claims(r)
    return out


def sharding_claims(r: Results) -> list[Claim]:
    """The sharding guide's prose about bench_sharding.py's run on two H200s (its tables are the script's blocks) and
    the 2-GPU context-parallel test's log."""
    page, src = "docs/guides/sharding.md", "benchmarks/results/sharding_nvidia-h200.json"
    res = r.sharding
    lay, cp = res["layouts"], res["context_parallel"]
    ddp, fsdp, ddp_sh = lay["ddp"], lay["fsdp"], lay["ddp+sharded-teacher"]
    teacher_bytes = 2 * ddp["per_gpu"][0]["teacher_params"]  # bf16

    def peak(entry: dict) -> str:
        return f"{_gib(entry['peak_memory_bytes_max'])} GiB"

    def rest(entry: dict) -> str:
        return f"{_gib(entry['memory_at_rest_bytes_max'])} GiB"

    def ratio(entry: dict, key: str) -> str:
        return f"{entry[key] / ddp[key]:.2f}×"

    saved = ddp["memory_at_rest_bytes_max"] - ddp_sh["memory_at_rest_bytes_max"]
    share = "half of" if saved == teacher_bytes // 2 else f"{saved / teacher_bytes:.2f} of"
    card = 80e9  # an H100's 80 GB
    fits = ("DDP's peak is above the 80 GB of an H100 and the sharded layouts' peaks are below it"
            if ddp["peak_memory_bytes_max"] > card > max(fsdp["peak_memory_bytes_max"], ddp_sh["peak_memory_bytes_max"])
            else "(the comparison with an 80 GB card no longer holds)")
    bitwise = all(e["first_step_kl_max_rel_diff_vs_ddp"] == 0 for e in (fsdp, ddp_sh))
    out = [Claim(page, text, src) for text in (
        f"FSDP2 peaks at {peak(fsdp)} per GPU against DDP's {peak(ddp)} ({ratio(fsdp, 'peak_memory_bytes_max')}), "
        f"and DDP with only the teacher sharded at {peak(ddp_sh)} ({ratio(ddp_sh, 'peak_memory_bytes_max')})",
        f"lowers the memory held at rest from {rest(ddp)} to {rest(ddp_sh)} per GPU, by {share} the teacher's weights "
        f"in bf16; sharding the student too (FSDP2) takes it to {rest(fsdp)}",
        fits,
        f"A step takes {fsdp['step_time_s_max']:.3f} s under FSDP2 and {ddp_sh['step_time_s_max']:.3f} s with the "
        f"teacher sharded under DDP, against {ddp['step_time_s_max']:.3f} s under DDP "
        f"({ratio(fsdp, 'step_time_s_max')} and {ratio(ddp_sh, 'step_time_s_max')})",
        "the first step's KL equals DDP's bitwise on both GPUs" if bitwise else "(the first step's KL is not bitwise)",
    )]

    n, whole, half = cp["tokens"], cp[f"one_gpu_{cp['tokens']}"], cp[f"one_gpu_{cp['tokens_per_gpu']}"]
    sharded = cp["sharded_2gpu"]
    peaks = [g["peak_memory_bytes"] for g in sharded["per_gpu"]]
    above = "above" if min(peaks) > whole["peak_memory_bytes"] else "(not above)"
    gpu0 = cp["exactness_per_gpu"][0]
    exact0 = gpu0["kl_rel_error"] == gpu0["dq_s_rel_error"] == 0
    worst = cp["exactness_vs_one_gpu"]
    tests = r.sharding_gpu_tests
    out += [Claim(page, text, src) for text in (
        f"the KL of the whole sequence (N = {n}) takes {sharded['time_s_max']:.3f} s, against {whole['time_s']:.3f} s "
        f"on one GPU ({sharded['time_s_max'] / whole['time_s']:.2f}×), and "
        f"{sharded['time_s_max'] / half['time_s']:.2f}× one GPU's time on half the sequence",
        f"The sharded run peaks at {_gib(peaks[1])} GiB on GPU 1 and {_gib(peaks[0])} GiB on GPU 0, {above} the "
        f"{_gib(whole['peak_memory_bytes'])} GiB of one GPU computing the whole sequence",
        "their KL and query gradient are bitwise those of one GPU" if exact0 else "(GPU 0's rows are not bitwise)",
        f"the per-row KL differs from one GPU's by {worst['kl_rel_error']:.1e} relative and the gradients by at most "
        f"{max(worst['dq_s_rel_error'], worst['dk_s_rel_error']):.1e}, in bf16",
    )]
    out.append(Claim(page, f"largest relative error against one GPU at "
                           f"{max(tests['float32'].values(), key=float)} in float32 and "
                           f"{max(tests['bfloat16'].values(), key=float)} in bfloat16",
                     "benchmarks/results/sharding_nvidia-h200-2gpu-tests.log"))
    return out


def continual_benchmark_claims(r: Results) -> list[Claim]:
    """The continual guide's prose about Split-Digits and the pretrained-MiniLM scenario (their results.json files,
    built from the committed runs.jsonl by split_digits.py and minilm_sequence.py)."""
    out: list[Claim] = []
    page = "docs/guides/continual.md"
    ti, ci = "task-incremental", "class-incremental"

    # --- Split-Digits
    sd_file = "benchmarks/results/split_digits/results.json"
    settings = r.digits["summary"]["settings"]
    tests = {(c["scenario"], c["method"], c["baseline"], c["metric"]): c
             for c in r.digits["summary"]["stats"]["comparisons"]}

    def acc(setting: str, method: str, key: str = "final_accuracy") -> str:
        return _pct(settings[setting][method][key][0])

    def diff(setting: str, method: str, base: str, key: str = "final_accuracy", sign: bool = True) -> str:
        c = tests[setting, method, base, key]
        text = f"{100 * c['mean_difference']:{'+' if sign else ''}.1f} ± {100 * c['se']:.1f}"
        return text if sign else text.lstrip("-")

    def p(setting: str, method: str, base: str, key: str = "final_accuracy", holm: bool = False) -> str:
        c = tests[setting, method, base, key]
        return _p(c["p_holm"] if holm else c["p_t"])

    def runs(setting: str, method: str, base: str, key: str = "final_accuracy") -> str:
        c = tests[setting, method, base, key]
        return f"{c['seeds_better']}/{c['n']} runs"

    def ms(setting: str, method: str) -> float:
        return settings[setting][method]["ms_per_step_later_tasks"]

    weight = {s: settings[s]["attention"]["options"]["attention_weight"] for s in (ti, ci)}
    ci_regs = [tests[ci, m, "finetune", "final_accuracy"]["p_t"] for m in ("ewc", "lwf", "attention")]
    held = settings[ti]["attention"]["snapshot_bytes"]
    baselines = [tests[ti, m, "finetune", "final_accuracy"] for m in ("ewc", "lwf", "replay")]

    def add(source: str, *texts: str) -> None:
        out.extend(Claim(page, t, source) for t in texts)

    add(sd_file,
        # the summary
        f"raises average accuracy over fine-tuning by {diff(ti, 'attention', 'finetune', sign=False)} points "
        f"({p(ti, 'attention', 'finetune')}; Holm-adjusted {p(ti, 'attention', 'finetune', holm=True)})",
        f"EWC, LwF and replay gain {diff(ti, 'ewc', 'finetune', sign=False)}, "
        f"{diff(ti, 'lwf', 'finetune', sign=False)} and {diff(ti, 'replay', 'finetune', sign=False)} points",
        f"only replay moves average accuracy off fine-tuning's {acc(ci, 'finetune')} %",
        # the findings
        f"At λ = {weight[ti]:g} the regulariser raises average accuracy over fine-tuning by "
        f"{diff(ti, 'attention', 'finetune', sign=False)} points (better in {runs(ti, 'attention', 'finetune')}, "
        f"{p(ti, 'attention', 'finetune')}; Holm-adjusted {p(ti, 'attention', 'finetune', holm=True)}) and lowers "
        f"forgetting by {diff(ti, 'attention', 'finetune', 'forgetting', sign=False)} points "
        f"({p(ti, 'attention', 'finetune', 'forgetting')})",
        f"{diff(ti, 'ewc', 'finetune')}, {diff(ti, 'lwf', 'finetune')} and {diff(ti, 'replay', 'finetune')} points "
        f"of average accuracy over fine-tuning",
        *([f"(every run better, {_p(max(c['p_t'] for c in baselines))})"]
          if all(c["seeds_better"] == c["n"] for c in baselines) else []),
        f"ends {diff(ti, 'attention', 'ewc', sign=False)} points below EWC and "
        f"{diff(ti, 'attention', 'lwf', sign=False)} points below LwF ({p(ti, 'attention', 'lwf')})",
        f"forgetting falls by {diff(ti, 'attention+replay', 'replay', 'forgetting', sign=False)} points "
        f"({runs(ti, 'attention+replay', 'replay', 'forgetting')}, {p(ti, 'attention+replay', 'replay', 'forgetting')};"
        f" Holm-adjusted {p(ti, 'attention+replay', 'replay', 'forgetting', holm=True)})",
        f"the gain in average accuracy, {diff(ti, 'attention+replay', 'replay')} points, is not significant "
        f"({p(ti, 'attention+replay', 'replay')})",
        f"attention+replay ends at {acc(ti, 'attention+replay')} %, replay alone at {acc(ti, 'replay')} %, joint "
        f"training (the upper bound) at {acc(ti, 'joint')} %",
        f"{diff(ti, 'attention+lwf', 'lwf')} points of average accuracy ({p(ti, 'attention+lwf', 'lwf')}), "
        f"{diff(ti, 'attention+lwf', 'lwf', 'forgetting')} points of forgetting "
        f"({p(ti, 'attention+lwf', 'lwf', 'forgetting')})",
        f"Fine-tuning ends at {acc(ci, 'finetune')} %",
        f"EWC, LwF and the regulariser stay at that level ({acc(ci, 'ewc')}, {acc(ci, 'lwf')} and "
        f"{acc(ci, 'attention')} %; no difference to fine-tuning is significant, the smallest is {_p(min(ci_regs))})",
        f"Replay reaches {acc(ci, 'replay')} % and joint training {acc(ci, 'joint')} %",
        f"adds {diff(ci, 'attention+replay', 'replay', sign=False)} points ({p(ci, 'attention+replay', 'replay')})",
        # the cost
        f"{ms(ti, 'attention'):.1f} ms per step of a later task against {ms(ti, 'finetune'):.1f} ms for fine-tuning "
        f"({ms(ti, 'attention') / ms(ti, 'finetune'):.1f}×; EWC {ms(ti, 'ewc'):.1f} ms, LwF {ms(ti, 'lwf'):.1f} ms, "
        f"replay {ms(ti, 'replay'):.1f} ms)",
        f"holds {held['held']['cpu'] / 2**10:.0f} KiB, and trimming dropped {held['trimmed'] / 2**10:.0f} KiB")
    add(f"{sd_file} (tuning)",
        f"at λ = {weight[ci]:g}, the smallest of the grid")

    # --- the pretrained MiniLM
    ml_file = "benchmarks/results/continual_minilm/results.json"
    methods = r.minilm_sequence["summary"]["methods"]
    mtests = {(c["method"], c["baseline"], c["metric"]): c
              for c in r.minilm_sequence["summary"]["stats"]["comparisons"]}

    def mval(method: str, key: str) -> str:
        return f"{methods[method][key][0]:.3f}"

    def macc(method: str, key: str = "learning_accuracy") -> str:
        return _pct(methods[method][key][0])

    def mdiff(method: str, base: str, key: str, scale: float = 100.0) -> str:
        c = mtests[method, base, key]
        return f"{scale * c['mean_difference']:+.1f} ± {scale * c['se']:.1f}"

    def mp(method: str, base: str, key: str) -> str:
        return _p(mtests[method, base, key]["p_t"])

    def mruns(method: str, base: str, key: str) -> str:
        c = mtests[method, base, key]
        return f"{c['seeds_better']}/{c['n']} runs"

    learned = methods["finetune"]["learned_by_task"]
    after = {m: methods[m]["retention_after_task"] for m in methods}
    acc_ps = [mtests[m, b, "learning_accuracy"]["p_t"] for m, b in (("attention", "finetune"),
                                                                     ("embedding", "finetune"),
                                                                     ("attention", "embedding"))]
    add(ml_file,
        # the summary
        f"(mean cosine {mval('attention', 'cosine')} against {mval('finetune', 'cosine')} on held-out text, higher in "
        f"{mruns('attention', 'finetune', 'cosine')}",
        f"distilling the embeddings directly keeps more ({mval('embedding', 'cosine')})",
        f"though the paired t-test gives {mp('attention', 'finetune', 'cosine')}",
        f"{methods['attention']['ms_per_step'] / methods['finetune']['ms_per_step']:.2f}× for MiniLM",
        # the findings
        f"a mean cosine of {mval('attention', 'cosine')} to the pretrained model's with the regulariser "
        f"(λ = {methods['attention']['options']['attention_weight']:g}), {mval('finetune', 'cosine')} with plain "
        f"fine-tuning and {mval('embedding', 'cosine')} with embedding distillation "
        f"(λ = {methods['embedding']['options']['embedding_weight']:g})",
        f"{mdiff('attention', 'finetune', 'cosine')} hundredths of cosine, higher in "
        f"{mruns('attention', 'finetune', 'cosine')} ({mp('attention', 'finetune', 'cosine')}); similarity correlation "
        f"{mdiff('attention', 'finetune', 'similarity_corr')} ({mp('attention', 'finetune', 'similarity_corr')}), same "
        f"nearest neighbour {mdiff('attention', 'finetune', 'neighbour_agreement')} "
        f"({mp('attention', 'finetune', 'neighbour_agreement')})",
        f"Embedding distillation is above the regulariser in every run ({mdiff('attention', 'embedding', 'cosine')} "
        f"hundredths of cosine, {mp('attention', 'embedding', 'cosine')})",
        f"(cosine {after['finetune'][0]:.3f} after the first task, {after['finetune'][-1]:.3f} after the last); with "
        f"the regulariser {after['attention'][0]:.3f} and {after['attention'][-1]:.3f}",
        f"New-task accuracy is {macc('attention')} % with the regulariser, {macc('finetune')} % with fine-tuning and "
        f"{macc('embedding')} % with embedding distillation; no difference reaches significance (the smallest is "
        f"{_p(min(acc_ps))})",
        f"In {r.minilm_sequence['config']['steps_per_task']} steps per task only the topic task is learned "
        f"(fine-tuning: {_pct(learned['topic'])} % right after learning it)",
        f"stay near chance ({_pct(learned['order'])} and {_pct(learned['continuation'])} %)",
        # the cost
        f"a step takes {methods['attention']['ms_per_step']:.0f} ms with the regulariser against "
        f"{methods['finetune']['ms_per_step']:.0f} ms for fine-tuning "
        f"({methods['attention']['ms_per_step'] / methods['finetune']['ms_per_step']:.2f}×) and "
        f"{methods['embedding']['ms_per_step']:.0f} ms for embedding distillation",
        f"the trimmed snapshot held {methods['attention']['snapshot_bytes']['held']['cpu'] / 2**20:.1f} MiB")
    add(sd_file,
        f"{ms(ti, 'attention') / ms(ti, 'finetune'):.1f}× a fine-tuning step for the small vision transformer")

    # --- the snapshot memory of all-MiniLM-L6-v2
    mem_file = "benchmarks/results/continual_minilm/memory.json"
    memory = r.minilm_sequence["memory"]
    cases = {(len(c["layers"]), c["snapshot_trim"], c["snapshot_device"]): c for c in memory["cases"]}
    every, first = cases[6, True, "same"], cases[1, True, "same"]
    add(mem_file,
        f"trimming drops {every['trimmed_bytes'] / 2**20:.1f} MiB of {memory['model_bytes'] / 2**20:.1f} MiB when "
        f"every layer is regularised",
        f"the snapshot of the first layer alone holds {sum(first['bytes_held'].values()) / 2**20:.1f} MiB")
    return out


def indexer_claims(r: Results) -> list[Claim]:
    """The indexer guide and the README's indexer sentence: the H100 benchmark and the worked example."""
    page, gpu_file = "docs/guides/indexer.md", "benchmarks/results/indexer_nvidia-h100-80gb-hbm3.json"
    rec = r.indexer_gpu

    def span(topk: int | None, h_kv: int, mode: str) -> str:
        values = [x["extra"]["floor_fraction"] for k, x in rec.items()
                  if k[0] == topk and k[3] == h_kv and k[4] == "fused" and k[5] == mode and k[1] >= 8192]
        lo, hi = f"{min(values):.0%}", f"{max(values):.0%}"
        return hi if lo == hi else f"{lo[:-1]}–{hi}"

    def ms(provider: str, mode: str = "fwd+bwd") -> float:
        return rec[None, 8192, 16, 1, provider, mode]["ms"]

    def gib(provider: str, n: int = 8192) -> str:
        return _gib(rec[None, n, 16, 1, provider, "mem"]["peak_bytes"])

    oom = rec[None, 8192, 64, 1, "naive", "fwd+bwd"]["status"]
    estimated = re.fullmatch(r"OOM \(estimated (\d+) GiB\)", oom).group(1)
    out = [Claim(page, text, gpu_file) for text in (
        f"forward+backward takes {ms('fused'):.2f} ms against the materialised loss's {ms('naive'):.2f} ms "
        f"({ms('naive') / ms('fused'):.0f}×) and peaks at {gib('fused')} GiB against {gib('naive')} GiB",
        f"its estimated footprint ({estimated} GiB at N = 8192, H = 64)",
        f"In the dense stage the kernels reach {span(None, 1, 'fwd')} of the floor forward, {span(None, 1, 'bwd')} "
        f"backward and {span(None, 1, 'fwd+bwd')} forward+backward",
        f"in the sparse stage with one key head, {span(2048, 1, 'fwd+bwd')} forward+backward, and "
        f"{span(2048, 16, 'fwd+bwd')} with one key head per query head",
    )]

    ex, ex_file = r.indexer_example, "benchmarks/results/indexer_example_cpu.json"
    n = str(max(ex["setup"]["eval_lengths"]))

    def pct(part: dict, layer: str, length: str = n) -> str:
        return f"{100 * part[layer][length]:.1f}%"

    gap = max(ex["best"][layer][m] - ex["after"]["indexer"][layer][m]
              for layer in ex["best"] for m in ex["best"][layer])
    for layer, words in (("l0", "layer 0"), ("l1", "layer 1")):
        out.append(Claim(page, f"{words}'s trained indexer keeps {pct(ex['after']['indexer'], layer)} of the "
                               f"attention's mass at N = {n} (K = {int(n) // 8}), against "
                               f"{pct(ex['before']['indexer'], layer)} untrained, {pct(ex['window'], layer)} for the "
                               f"last K keys and {pct(ex['best'], layer)} for the attention's own top K", ex_file))
    out.append(Claim(page, f"within {100 * gap:.1f} points of the attention's own top K", ex_file))
    out.append(Claim("README.md", f"keep {pct(ex['after']['indexer'], 'l1')} of a layer's attention mass at "
                                  f"N = {n} with K = N/8, against {pct(ex['before']['indexer'], 'l1')} before training",
                     ex_file))
    return out


# ------------------------------------------------------------------------------------------------------- check
def norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


_FENCE = re.compile(r"```.*?```", re.S)
_NUM = r"(?<![\w.])[-−+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?"
_UNIT = (r"(?:%|ms\b|µs\b|us\b|s\b|min\b|minutes\b|GiB\b|GB\b|MB\b|KiB\b|KB\b|bytes\b|B\b|×|nats\b|TFLOP/s|TB/s|"
         r"steps\b|points\b|pts\b|M\b)")
FIGURE = re.compile(rf"{_NUM}(?:\s?(?:–|-|to|/)\s?{_NUM})*\s?{_UNIT}|(?<![\w.])\d+\.\d+(?![\w.])|"
                    rf"(?<![\w.])\d(?:\.\d+)?e[-+]?\d+|p\s?[=<≈]\s?0?\.\d+")


def blocks(text: str) -> list[tuple[str, int, int]]:
    """``(name, start, end)`` of every generated block in ``text`` (offsets of the whole block, markers included)."""
    found = [(m.group(1), m.start(), m.end())
             for m in re.finditer(r"<!-- (\S+?):start -->.*?<!-- \1:end -->", text, re.S)]
    found += [("ablation", m.start(), m.end()) for m in re.finditer(r"<!-- ablation:table -->.*?<!-- /ablation -->",
                                                                     text, re.S)]
    return [b for b in found if b[0] in GENERATED]


def prose(text: str) -> str:
    """``text`` without fenced code (figures in code are code), whitespace-normalised."""
    return norm(_FENCE.sub(" ", text))


def uncovered(page: str, text: str, page_claims: list[Claim]) -> list[str]:
    """The figures of ``page``'s prose that no claim, generated block or allowed phrase covers."""
    flat = prose(text)
    covered: list[tuple[int, int]] = [(s, e) for _, s, e in blocks(flat)]
    covered += [(m.start(), m.end()) for m in re.finditer(r"`[^`]*`|\]\([^)]*\)|<!--.*?-->", flat)]
    for c in page_claims:
        phrase = norm(c.text)
        covered += [(m.start(), m.end()) for m in re.finditer(re.escape(phrase), flat)]
    for where, pattern, _ in ALLOWED:
        if where in ("*", page):
            covered += [(m.start(), m.end()) for m in re.finditer(pattern, flat)]
    out = []
    for m in FIGURE.finditer(flat):
        if not any(s <= m.start() and m.end() <= e for s, e in covered):
            out.append(f"{page}: {m.group(0)!r} in “…{flat[max(0, m.start() - 50):m.end() + 30]}…”")
    return out


@lru_cache
def _repo_files(root: str) -> tuple[str, ...]:
    """The repository's files, relative to ``root``, without hidden folders (.git, virtual environments) and builds."""
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("site", "build", "dist", "__pycache__")]
        out += [os.path.relpath(os.path.join(folder, f), root) for f in files]
    return tuple(out)


def _evidenced(root: str, pattern: str, needle: str) -> bool:
    """Whether a file matching ``pattern`` (fnmatch on the path from ``root``; ``**/`` matches any folder) contains
    ``needle``."""
    for path in _repo_files(root):
        if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(path, pattern.removeprefix("**/")):
            with open(os.path.join(root, path), errors="replace") as f:
                if needle in f.read():
                    return True
    return False


def read_pages(root: str = ROOT) -> dict[str, str]:
    texts = {}
    for page in PAGES:
        with open(os.path.join(root, page)) as f:
            texts[page] = f.read()
    return texts


def check(texts: dict[str, str] | None = None, root: str = ROOT) -> list[str]:
    """Every problem found: claims missing from their pages, stale generated blocks, uncovered figures, allowed
    parameters without their evidence. ``texts`` (page -> text) replaces the pages' committed text."""
    r = Results()
    all_claims = claims(r)
    problems = []
    texts = texts if texts is not None else read_pages(root)
    for c in all_claims:
        if c.page not in texts:
            problems.append(f"claim on a page that is not checked: {c.page}")
        elif norm(c.text) not in prose(texts[c.page]):
            problems.append(f"{c.page}: expected “{norm(c.text)}” (from {c.source})")
    for name, (page, render) in BLOCKS.items():
        block = re.search(rf"<!-- {re.escape(name)}:start -->\n(.*?)\n<!-- {re.escape(name)}:end -->", texts[page],
                          re.S)
        if block is None:
            problems.append(f"{page}: the block {name} is missing")
        elif block.group(1) != render(r):
            problems.append(f"{page}: the block {name} is not what benchmarks/figures.py renders (run it with --write)")
    for where, pattern, evidence in ALLOWED:
        if evidence is not None and not _evidenced(root, *evidence):
            problems.append(f"{where}: “{pattern}” is allowed as a parameter, but no {evidence[0]} contains "
                            f"“{evidence[1]}”")
    for page, text in texts.items():
        for name in re.findall(r"<!-- (\S+?):start -->", text):
            if name not in GENERATED and not name.startswith("findings"):
                problems.append(f"{page}: the block {name} is not a known generated block (GENERATED)")
        problems += uncovered(page, text, [c for c in all_claims if c.page == page])
    return problems


def write(root: str = ROOT) -> None:
    r = Results()
    for name, (page, render) in BLOCKS.items():
        path = os.path.join(root, page)
        with open(path) as f:
            text = report.replace_block(f.read(), name, render(r))
        with open(path, "w") as f:
            f.write(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the figures:* blocks, then check")
    parser.add_argument("--list", action="store_true", help="print every claim with its source")
    args = parser.parse_args(argv)
    if args.write:
        write()
    if args.list:
        for c in claims(Results()):
            print(f"{c.page}: “{norm(c.text)}” ← {c.source}")
    problems = check()
    for p in problems:
        print(p)
    print(f"{len(problems)} problem(s)" if problems else "every figure is traced to a committed result file")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
