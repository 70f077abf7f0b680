"""Issue 14: the Gluon training forward with three consumer warpgroups at head dim 64, against two, in one run.

The warp-specialised training forward (v17, ``kernels/streamkl/_hopper/fused_forward.py``) holds two consumer
warpgroups of 64 rows per program, 240 registers each: two computing warps per scheduler, which the hardware counters
(docs/perf-notes.md, "After v15") found waiting on dependent arithmetic with the issue slots half used. Three consumers
(192 rows per program, FlashAttention-3's choice at small head dims) give each scheduler a third warp to switch to, at
168 registers for the first consumer and 160 for the other two (the register file holds no more), where the compiled
kernel spills a few registers per key tile (``benchmarks/kernel_resources.py``). Head dim 64 only: at 128 the
accumulators alone need more.

For each head-dim-64 shape (bf16, frozen teacher), in one process on one GPU, paired rounds with the order
alternating, and the sign test on each pair:

* the fused training forward, three consumers against two;
* the training call as users make it (``attention_kl(...)``, then the student's q and k gradients) with each;
* cuDNN attention's forward+backward on the student's shapes, for scale;
* exactness: whether three consumers give the bits of two (KL, both log-sum-exps, the saved query gradient) on the
  key pass's checks in scope at head dim 64.

    PYTHONPATH=kernels:. python benchmarks/bench_three_consumers.py --out benchmarks/results   # ~2 min on an H100
    PYTHONPATH=kernels:. python benchmarks/bench_three_consumers.py --render   # tables into docs/perf-notes.md

Timing assertions never go into tests; the numbers here are ratios measured in one run.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from unittest import mock

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_hopper_key_pass import CHECKS  # noqa: E402
from bench_lazy_frames import ROUNDS, paired_cell, paired_labels, paired_rounds, training_step  # noqa: E402
from bench_ws_key_pass import _problem  # noqa: E402
from report import RESULTS, render_results  # noqa: E402

RESULT_NAME = "three-consumers.json"
DOC = os.path.join(HERE, "..", "docs", "perf-notes.md")
H100_RESULT = os.path.join(HERE, "results", f"nvidia-h100-80gb-hbm3-{RESULT_NAME}")
#: (name, B, H, H_k teacher, N, D, causal): the long-context head-dim-64 shapes of the grid and the issue
SHAPES = [
    ("N8192-D64", 1, 16, 16, 8192, 64, False),
    ("N8192-D64-causal", 1, 16, 16, 8192, 64, True),
    ("N16384-D64-H32-causal", 1, 32, 32, 16384, 64, True),
    ("N4096-B2-H12-D64", 2, 12, 12, 4096, 64, False),
]
#: what each round times, in pairs (label of three consumers, label of two)
PAIRS = {
    "fused fwd": ("fused fwd, 3 consumers", "fused fwd, 2 consumers"),
    "training call": ("training call, 3 consumers", "training call, 2 consumers"),
}


def _consumers(n: int):
    """A context in which the training forward runs ``n`` consumer warpgroups."""
    from streamkl._hopper import fused_forward

    return mock.patch.object(fused_forward, "fused_forward_consumers", lambda d_a, d_b: n)


def exactness() -> list[dict]:
    """:data:`CHECKS` in the kernel's scope at head dim 64: whether three consumers give the bits of two."""
    import streamkl
    from streamkl._hopper.fused_forward import attention_kl_fused_fwd_hopper, in_scope
    from streamkl._triton.forward import new_dq_b_buffer

    rows = []
    for i, case in enumerate(CHECKS):
        b, h, hk_t, hk_s, n_q, n_k, d_t, d_s, causal, _loss, _temp, sharpness, layout = case
        if max(d_t, d_s) > 64:
            continue
        inputs, spec, *_ = _problem(streamkl, b, h, hk_t, hk_s, n_q, n_k, d_t, d_s, causal, sharpness, layout, i)
        if not in_scope(inputs, spec):
            continue
        dq_three, dq_two = new_dq_b_buffer(inputs), new_dq_b_buffer(inputs)
        three = (*attention_kl_fused_fwd_hopper(inputs, spec, dq_three, consumers=3), dq_three)
        two = (*attention_kl_fused_fwd_hopper(inputs, spec, dq_two, consumers=2), dq_two)
        rows.append(dict(case=[b, h, hk_t, hk_s, n_q, n_k, d_t, d_s, causal, layout],
                         bitwise_equal=all(torch.equal(x, y) for x, y in zip(three, two))))
        print(f"check {case}: {rows[-1]}", flush=True)
    return rows


def measure_shape(name, b, h, h_kt, n, d, causal) -> dict:
    """One shape's row: the paired rounds of every call of :data:`PAIRS` and cuDNN's forward+backward."""
    import streamkl
    from streamkl._hopper.fused_forward import attention_kl_fused_fwd_hopper
    from streamkl._triton.forward import new_dq_b_buffer

    inputs, spec, *_ = _problem(streamkl, b, h, h_kt, h, n, n, d, d, causal, 1.0, "bhnd", 1)
    buf = new_dq_b_buffer(inputs)
    q_t, k_t, q_s, k_s = inputs.q_a, inputs.k_a, inputs.q_b.detach().requires_grad_(True), \
        inputs.k_b.detach().requires_grad_(True)

    def train(consumers: int):
        return training_step(streamkl, q_t, k_t, q_s, k_s, causal, lambda: _consumers(consumers))

    calls = {
        "fused fwd, 3 consumers": lambda: attention_kl_fused_fwd_hopper(inputs, spec, buf, consumers=3),
        "fused fwd, 2 consumers": lambda: attention_kl_fused_fwd_hopper(inputs, spec, buf, consumers=2),
        "training call, 3 consumers": train(3),
        "training call, 2 consumers": train(2),
    }
    return paired_rounds(calls, name, b, h, h_kt, n, d, causal)


def run() -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "host": platform.node(), "rounds": ROUNDS}
    data["checks"] = exactness()
    data["rows"] = [measure_shape(*shape) for shape in SHAPES]
    return data


def table(data: dict) -> str:
    """Three consumers against two: the fused training forward and the training call, with cuDNN for scale."""
    lines = ["| shape | fused fwd ms, 2 → 3 consumers | 3 / 2 (wins, sign test p) | training call ms, 2 → 3 "
             "consumers | 3 / 2 (wins, p) | training call / cuDNN fwd+bwd, 2 → 3 consumers |",
             "|---|---|---|---|---|---|"]
    for row in data["rows"]:
        f, t = paired_labels(row, *PAIRS["fused fwd"]), paired_labels(row, *PAIRS["training call"])
        cudnn = row["cudnn_fwd_bwd_ms"]
        lines.append(f"| {row['shape']['name']} | {f['previous']:.3f} → {f['new']:.3f} | {paired_cell(f)} | "
                     f"{t['previous']:.3f} → {t['new']:.3f} | {paired_cell(t)} | "
                     f"{t['previous'] / cudnn:.2f}× → {t['new'] / cudnn:.2f}× |")
    return "\n".join(lines)


def checks_table(data: dict) -> str:
    """Whether three consumers give two consumers' bits on each check."""
    lines = ["| case (B, H, H_k teacher, H_k student, N_q, N_k, D_t, D_s, causal, layout) | KL, lse and dQ_s "
             "bitwise equal |", "|---|---|"]
    for row in data["checks"]:
        lines.append(f"| {', '.join(str(x) for x in row['case'])} | {'yes' if row['bitwise_equal'] else 'no'} |")
    return "\n".join(lines)


def blocks(data: dict, _tuning: dict | None = None) -> dict[str, str]:
    """The docs/perf-notes.md blocks of a run."""
    return {"three-consumers:op": table(data), "three-consumers:checks": checks_table(data)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=RESULTS, help=f"directory for <gpu>-{RESULT_NAME}")
    parser.add_argument("--render", nargs="?", const=H100_RESULT,
                        help="write the tables of a results file into docs/perf-notes.md")
    args = parser.parse_args(argv)
    if args.render:
        render_results(DOC, blocks, args.render)
        return
    from bench_attention_kl import gpu_tag, write_json

    data = run()
    out = os.path.join(args.out, f"{gpu_tag(data['device'])}-{RESULT_NAME}")
    write_json(out, data)
    for body in blocks(data).values():
        print(body)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
