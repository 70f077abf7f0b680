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
import json
import os
import platform
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_fused_dq import SHAPES as FUSED_SHAPES  # noqa: E402
from bench_lazy_frames import (  # noqa: E402
    CHECKS,  # noqa: F401 (this run's exactness cases, named here for its tests)
    ROUNDS,
    _bench,
    exactness,
    measure_shape,
    paired,
)
from bench_lazy_frames import checks_table as lazy_checks_table  # noqa: E402
from bench_lazy_frames import op_table as lazy_op_table  # noqa: E402
from report import load_package, render_results, write_blocks  # noqa: E402

RESULT_NAME = "causal-order.json"
DOC = os.path.join(HERE, "..", "docs", "perf-notes.md")
H100_RESULT = os.path.join(HERE, "results", f"nvidia-h100-80gb-hbm3-{RESULT_NAME}")
PATHS_NAME = "causal-order-paths.json"
H100_PATHS_RESULT = os.path.join(HERE, "results", f"nvidia-h100-80gb-hbm3-{PATHS_NAME}")
SHAPES = [s for s in FUSED_SHAPES if not s[0].startswith("BERT")]


#: the calls of the second run (``--paths``): the portable kernels' other callers, which v12 also orders longest first
PATHS = ("reverse KL", "trainable teacher", "fp16 frozen teacher", "metric")
PATH_SHAPES = [s for s in SHAPES if s[0].startswith("N8192-D64") or s[0] == "N8192-D128-causal"]


def _path_calls(module, b, h, h_kt, n, d, causal) -> dict:
    """One closure per :data:`PATHS` entry: the call as users make it through ``module`` (its backward included,
    except for the metric, which runs under ``no_grad``)."""
    def tensors(dtype, teacher_grad):
        g = torch.Generator(device="cuda").manual_seed(0)
        q_t = torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=g, requires_grad=teacher_grad)
        k_t = torch.randn(b, h_kt, n, d, device="cuda", dtype=dtype, generator=g, requires_grad=teacher_grad)
        q_s, k_s = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=g, requires_grad=True)
                    for _ in range(2))
        return q_t, k_t, q_s, k_s

    def step(dtype, teacher_grad, **kw):
        q_t, k_t, q_s, k_s = tensors(dtype, teacher_grad)
        wrt = (q_t, k_t, q_s, k_s) if teacher_grad else (q_s, k_s)
        return lambda: torch.autograd.grad(module.attention_kl(q_t, k_t, q_s, k_s, causal=causal, **kw), wrt)

    q_t, k_t, q_s, k_s = tensors(torch.bfloat16, False)

    def metric():
        with torch.no_grad():
            return module.attention_kl(q_t, k_t, q_s, k_s, causal=causal)

    return {"reverse KL": step(torch.bfloat16, False, direction="reverse"),
            "trainable teacher": step(torch.bfloat16, True), "fp16 frozen teacher": step(torch.float16, False),
            "metric": metric}


def measure_paths(base, name, b, h, h_kt, n, d, causal) -> dict:
    """Paired rounds (order alternating) of every :data:`PATHS` call through both versions."""
    import streamkl

    calls = {"new": _path_calls(streamkl, b, h, h_kt, n, d, causal),
             "previous": _path_calls(base, b, h, h_kt, n, d, causal)}
    times = {f"{path} {label}": [] for path in PATHS for label in ("new", "previous")}
    for r in range(ROUNDS):
        order = ("new", "previous") if r % 2 == 0 else ("previous", "new")
        for path in PATHS:
            for label in order:
                times[f"{path} {label}"].append(_bench(calls[label][path]))
    print(f"{name}: " + ", ".join(f"{k} {statistics.median(t):.3f}" for k, t in times.items()), flush=True)
    return {"shape": dict(name=name, b=b, h=h, h_kt=h_kt, n=n, d=d, causal=causal, dtype="bfloat16"), "ms": times}


def run_paths(against: str) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    base = load_package(os.path.abspath(against), "streamkl_base")
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "host": platform.node(), "rounds": ROUNDS,
            "rows": [measure_paths(base, *shape) for shape in PATH_SHAPES]}


def paths_table(data: dict) -> str:
    lines = ["| shape | " + " | ".join(f"{p}: ms, v11 → v12 (ratio, wins, sign test p)" for p in PATHS) + " |",
             "|---|" + "---|" * len(PATHS)]
    for row in data["rows"]:
        cells = []
        for path in PATHS:
            x = paired(row, path)
            cells.append(f"{x['previous']:.3f} → {x['new']:.3f} ({x['ratio']:.2f}×, {x['wins']}/{x['rounds']}, "
                         f"{x['p']:.2g})")
        lines.append(f"| {row['shape']['name']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(against: str) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    base = load_package(os.path.abspath(against), "streamkl_base")
    data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "host": platform.node(), "rounds": ROUNDS,
            "l2_bytes": torch.cuda.get_device_properties(0).L2_cache_size}
    data["rows"] = [measure_shape(base, *shape) for shape in SHAPES]
    data["checks"] = exactness(base)
    return data


def op_table(data: dict) -> str:
    return lazy_op_table(data, "v11", "v12")


def checks_table(data: dict) -> str:
    return lazy_checks_table(data, "v11", "v12")


def blocks(data: dict, _tuning=None) -> dict[str, str]:
    """The generated blocks of docs/perf-notes.md v12: name -> markdown."""
    return {"causal-order:op": op_table(data), "causal-order:checks": checks_table(data)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", help="a copy of the previous version's kernels/streamkl")
    parser.add_argument("--out", help="directory for <gpu>-causal-order.json")
    parser.add_argument("--paths", action="store_true",
                        help="time the portable kernels' other callers instead (reverse KL, a trainable teacher, fp16, "
                             "the metric) -> <gpu>-causal-order-paths.json")
    parser.add_argument("--render", nargs="?", const=H100_RESULT,
                        help="write the tables of a results file into docs/perf-notes.md")
    args = parser.parse_args(argv)
    if args.render:
        render_results(DOC, blocks, args.render)
        with open(H100_PATHS_RESULT) as f:
            write_blocks(DOC, {"causal-order:paths": paths_table(json.load(f))})
        return
    if not args.against:
        parser.error("--against is required to measure (a copy of the previous version's kernels/streamkl)")
    from bench_attention_kl import gpu_tag, write_json

    if args.paths:
        data = run_paths(args.against)
        out = os.path.join(args.out or os.path.join(HERE, "results"), f"{gpu_tag(data['device'])}-{PATHS_NAME}")
        write_json(out, data)
        print(paths_table(data))
        print(f"wrote {out}")
        return
    data = run(args.against)
    out = os.path.join(args.out or os.path.join(HERE, "results"), f"{gpu_tag(data['device'])}-{RESULT_NAME}")
    write_json(out, data)
    print(op_table(data))
    print(checks_table(data))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
