"""v18 (issue 14): the Gluon forwards run causal grids longest first in chunks of heads, against v17 in one run.

v12 ordered the portable kernels' causal grids longest first (``_longest_first``): every (sequence, head) pair's
longest row tile before any pair's second longest, in chunks of pairs whose keys fit in half of the L2 cache. The two
Gluon forwards (v7's metric forward, v17's warp-specialised training forward) kept a (row tiles, pairs) grid with each
head's longest row tile first, so the last heads' longest programs were dispatched last, after most of the grid had
drained. v18 launches both with the portable forward's order (``row_tile_grid`` and ``_row_tile_start`` in
``kernels/streamkl/_hopper/forward.py``). Non-causal grids are unchanged: their rows are the control.

For each long-context shape (bf16, frozen teacher; ``bench_fused_dq.SHAPES`` without the host-bound BERT one), in one
process on one GPU, paired rounds with the order alternating, and the sign test on each pair:

* the fused training forward: v18's Gluon kernel against v17's, and against the portable kernel (same package): the
  latter decides where the Gluon kernel is selected;
* the metric call (``attention_kl`` without grad: the Gluon forward at head dim 128, the portable one at 64) and the
  training call as users make it (``attention_kl(...)``, then the student's q and k gradients), v18 against v17, each
  with its package's default selection; and v18's training call with the Gluon training forward forced
  (``STREAMKL_HOPPER_KERNELS=all``, which at these shapes changes only that selection) against v18's default.

The committed run measured v18's kernels with v17's selection, which left the portable training forward at head dim
64 with a causal mask; the forced column there is what moved the Gluon one into the default (commit after the run,
docs/perf-notes.md v18; the run forced it by replacing that rule, which at these shapes selects what the switch does).
On the code since, the default and forced training calls run the same kernels.
* cuDNN attention's forward and forward+backward on the student's shapes;
* exactness (``bench_ws_fused_forward.exactness``): whether the Gluon and portable fused forwards give the same bits.

    PYTHONPATH=kernels:. python benchmarks/bench_gluon_causal_order.py --against <copy of v17's kernels/streamkl> \\
        --out benchmarks/results     # ~3 minutes on an H100
    PYTHONPATH=kernels:. python benchmarks/bench_gluon_causal_order.py --render   # tables into docs/perf-notes.md

Timing assertions never go into tests; the numbers here are ratios measured in one run.
"""

from __future__ import annotations

import importlib
import os
import platform
import sys
from unittest import mock

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_lazy_frames import ROUNDS, metric_call, paired_cell, paired_labels, paired_rounds, training_step  # noqa: E402
from bench_ws_fused_forward import SHAPES, exactness  # noqa: E402
from bench_ws_fused_forward import checks_table as ws_checks_table  # noqa: E402
from bench_ws_key_pass import _problem  # noqa: E402
from report import load_package, paired_run_main  # noqa: E402

RESULT_NAME = "gluon-causal-order.json"
DOC = os.path.join(HERE, "..", "docs", "perf-notes.md")
H100_RESULT = os.path.join(HERE, "results", f"nvidia-h100-80gb-hbm3-{RESULT_NAME}")
#: what each round times, in pairs (label of the new side, label of the previous side)
PAIRS = {
    "Gluon fused fwd": ("Gluon fused fwd v18", "Gluon fused fwd v17"),
    "Gluon / portable fused fwd": ("Gluon fused fwd v18", "portable fused fwd"),
    "metric call": ("metric call v18", "metric call v17"),
    "training call": ("training call v18", "training call v17"),
    "training call, Gluon fwd forced": ("training call v18, Gluon fwd forced", "training call v18"),
}


def pair(row: dict, what: str) -> dict:
    """The paired comparison (``bench_lazy_frames.paired``) of the two sides of ``PAIRS[what]``."""
    return paired_labels(row, *PAIRS[what])


def measure_shape(base, name, b, h, h_kt, n, d, causal) -> dict:
    """One shape's row: the paired rounds of every call of :data:`PAIRS` and cuDNN's forward and forward+backward."""
    import streamkl
    from streamkl._hopper import ENV_SWITCH
    from streamkl._hopper.fused_forward import attention_kl_fused_fwd_hopper
    from streamkl._triton.forward import attention_kl_fwd, new_dq_b_buffer

    previous_fused = importlib.import_module(f"{base.__name__}._hopper.fused_forward").attention_kl_fused_fwd_hopper
    inputs, spec, *_ = _problem(streamkl, b, h, h_kt, h, n, n, d, d, causal, 1.0, "bhnd", 1)
    buf = new_dq_b_buffer(inputs)
    q_t, k_t, q_s, k_s = inputs.q_a, inputs.k_a, inputs.q_b.detach().requires_grad_(True), \
        inputs.k_b.detach().requires_grad_(True)

    def train(module, forced: bool = False):
        # forced: every Hopper kernel in scope; above HOPPER_MIN_SCORES only the training forward's pick moves
        switch = {ENV_SWITCH: "all"} if forced else {}
        return training_step(module, q_t, k_t, q_s, k_s, causal, lambda: mock.patch.dict(os.environ, switch))

    def metric(module):
        return metric_call(module, q_t, k_t, q_s, k_s, causal)

    calls = {
        "Gluon fused fwd v18": lambda: attention_kl_fused_fwd_hopper(inputs, spec, buf),
        "Gluon fused fwd v17": lambda: previous_fused(inputs, spec, buf),
        "portable fused fwd": lambda: attention_kl_fwd(inputs, spec, dq_b=buf),
        "metric call v18": metric(streamkl),
        "metric call v17": metric(base),
        "training call v18": train(streamkl),
        "training call v17": train(base),
        "training call v18, Gluon fwd forced": train(streamkl, forced=True),
    }
    return paired_rounds(calls, name, b, h, h_kt, n, d, causal)


def run(against: str) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    base = load_package(os.path.abspath(against), "streamkl_base")
    data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "host": platform.node(), "rounds": ROUNDS}
    data["checks"] = exactness()
    data["rows"] = [measure_shape(base, *shape) for shape in SHAPES]
    return data


def kernel_table(data: dict) -> str:
    """The fused training forward: v18's Gluon kernel against v17's and against the portable kernel."""
    lines = ["| shape | Gluon fused fwd ms, v17 → v18 | v18 / v17 (wins, sign test p) | portable fused fwd ms | "
             "Gluon v18 / portable (wins, p) |", "|---|---|---|---|---|"]
    for row in data["rows"]:
        g, gp = pair(row, "Gluon fused fwd"), pair(row, "Gluon / portable fused fwd")
        lines.append(f"| {row['shape']['name']} | {g['previous']:.3f} → {g['new']:.3f} | {paired_cell(g)} | "
                     f"{gp['previous']:.3f} | {paired_cell(gp)} |")
    return "\n".join(lines)


def op_table(data: dict) -> str:
    """The calls users make: the metric and the training call, v17 → v18, the training call with the Gluon forward
    forced, and the ratios to cuDNN attention."""
    lines = ["| shape | metric call ms, v17 → v18 | v18 / v17 (wins, p) | training call ms, v17 → v18 | v18 / v17 "
             "(wins, p) | Gluon fwd forced / v18 (wins, p) | metric / cuDNN fwd, v18 | training call / cuDNN "
             "fwd+bwd, v17 → v18 → Gluon fwd forced |", "|---|---|---|---|---|---|---|---|"]
    for row in data["rows"]:
        m, t, f = pair(row, "metric call"), pair(row, "training call"), pair(row, "training call, Gluon fwd forced")
        fwd, both = row["cudnn_fwd_ms"], row["cudnn_fwd_bwd_ms"]
        lines.append(f"| {row['shape']['name']} | {m['previous']:.3f} → {m['new']:.3f} | {paired_cell(m)} | "
                     f"{t['previous']:.3f} → {t['new']:.3f} | {paired_cell(t)} | {paired_cell(f)} | "
                     f"{m['new'] / fwd:.2f}× | {t['previous'] / both:.2f}× → {t['new'] / both:.2f}× → "
                     f"{f['new'] / both:.2f}× |")
    return "\n".join(lines)


def blocks(data: dict, _tuning=None) -> dict[str, str]:
    """The generated blocks of docs/perf-notes.md v18: name -> markdown."""
    return {"gluon-order:kernel": kernel_table(data), "gluon-order:op": op_table(data),
            "gluon-order:checks": ws_checks_table(data)}


def main(argv: list[str] | None = None) -> None:
    paired_run_main(argv, __doc__, run, blocks, RESULT_NAME, H100_RESULT, DOC)


if __name__ == "__main__":
    main()
