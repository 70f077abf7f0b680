"""v12 (issue 14): causal grids run their longest tiles first, against the previous version in one run.

A causal grid's programs differ in length: a forward row tile sees keys up to its diagonal, a key-pass key tile the
queries from its diagonal on. Up to v11 the (sequence, head) pairs were the slow grid dimension, so the last head's
tiles were dispatched last, whatever their length (the portable forward even ran each head's shortest row tile
first), and its longest programs ran after the rest of the grid had drained. v12 runs causal grids longest first
(``_longest_first`` in ``kernels/streamkl/_triton/_helpers.py``; the portable forward, and so the frozen teacher's
fused forward, and the Hopper key pass), in chunks of heads whose keys (forward) or queries (key pass) fit in half
of the L2 cache, so that concurrent programs still share what they read. Non-causal grids are unchanged: their rows
are the control.

For each shape (bf16, the student's shapes of ``bench_fused_dq.SHAPES`` without the host-bound BERT one), in one
process on one GPU, through ``bench_lazy_frames.measure_shape``: paired rounds with the order alternating of the
fused forward kernel and of the training call as users make it (``attention_kl(...)`` with a frozen teacher, then the
student's q and k gradients) through both versions, with the sign test; cuDNN attention's forward+backward; and the
student's query gradient of both versions against float64 (``bench_lazy_frames.CHECKS``).

    PYTHONPATH=kernels:. python benchmarks/bench_causal_order.py --against <copy of v11's kernels/streamkl> \\
        --out benchmarks/results     # ~3 minutes on an H100
    PYTHONPATH=kernels:. python benchmarks/bench_causal_order.py --render   # tables into docs/perf-notes.md

Timing assertions never go into tests; the numbers here are ratios measured in one run.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_fused_dq import SHAPES as FUSED_SHAPES  # noqa: E402
from bench_lazy_frames import CHECKS, ROUNDS, check, measure_shape, paired  # noqa: E402
from report import load_package, render_results  # noqa: E402

RESULT_NAME = "causal-order.json"
DOC = os.path.join(HERE, "..", "docs", "perf-notes.md")
H100_RESULT = os.path.join(HERE, "results", f"nvidia-h100-80gb-hbm3-{RESULT_NAME}")
SHAPES = [s for s in FUSED_SHAPES if not s[0].startswith("BERT")]


def run(against: str) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    base = load_package(os.path.abspath(against), "streamkl_base")
    data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "host": platform.node(), "rounds": ROUNDS,
            "l2_bytes": torch.cuda.get_device_properties(0).L2_cache_size}
    data["rows"] = [measure_shape(base, *shape) for shape in SHAPES]
    data["checks"] = []
    for case in CHECKS:
        errs = {label: check(module, *case) for label, module in (("new", sys.modules["streamkl"]),
                                                                   ("previous", base))}
        data["checks"].append(dict(case=list(case), **errs))
        print(f"check {case[0]}: {errs}", flush=True)
    return data


def op_table(data: dict) -> str:
    lines = ["| shape | fused fwd ms, v11 → v12 | v12 / v11 (wins, sign test p) | training call ms, v11 → v12 | "
             "v12 / v11 (wins, sign test p) | training call / cuDNN fwd+bwd, v11 → v12 |",
             "|---|---|---|---|---|---|"]
    for row in data["rows"]:
        k, t = paired(row, "fused fwd"), paired(row, "training call")
        cudnn = row["cudnn_fwd_bwd_ms"]
        lines.append(f"| {row['shape']['name']} | {k['previous']:.3f} → {k['new']:.3f} | {k['ratio']:.2f}× "
                     f"({k['wins']}/{k['rounds']}, {k['p']:.2g}) | {t['previous']:.3f} → {t['new']:.3f} | "
                     f"{t['ratio']:.2f}× ({t['wins']}/{t['rounds']}, {t['p']:.2g}) | "
                     f"{t['previous'] / cudnn:.2f}× → {t['new'] / cudnn:.2f}× |")
    return "\n".join(lines)


def checks_table(data: dict) -> str:
    lines = ["| case (B, H, N, D, causal, inputs) | dQ_s v12 vs float64 | dQ_s v11 vs float64 |", "|---|---|---|"]
    for c in data["checks"]:
        _, b, h, n, d, causal, kind = c["case"]
        lines.append(f"| {b}, {h}, {n}, {d}, {causal}, {kind} | {c['new']:.1e} | {c['previous']:.1e} |")
    return "\n".join(lines)


def blocks(data: dict, _tuning=None) -> dict[str, str]:
    """The generated blocks of docs/perf-notes.md v12: name -> markdown."""
    return {"causal-order:op": op_table(data), "causal-order:checks": checks_table(data)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", help="a copy of the previous version's kernels/streamkl")
    parser.add_argument("--out", help="directory for <gpu>-causal-order.json")
    parser.add_argument("--render", nargs="?", const=H100_RESULT,
                        help="write the tables of a results file into docs/perf-notes.md")
    args = parser.parse_args(argv)
    if args.render:
        render_results(DOC, blocks, args.render)
        return
    if not args.against:
        parser.error("--against is required to measure (a copy of the previous version's kernels/streamkl)")
    from bench_attention_kl import gpu_tag, write_json

    data = run(args.against)
    out = os.path.join(args.out or os.path.join(HERE, "results"), f"{gpu_tag(data['device'])}-{RESULT_NAME}")
    write_json(out, data)
    print(op_table(data))
    print(checks_table(data))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
