"""v11 (issue 14): the frozen teacher's forward with lazy frames, against the previous version in one run.

The training forward with a frozen teacher (v6) keeps two ``[BLOCK_M, D]`` fp32 accumulators for the student's query
gradient and rescaled both on every key tile (three operations per element). v11 moves each row's reference max
only when a tile's max exceeds it by more than 2^8 (``FRAME_SLACK``), so on most tiles the update is one FMA per
element (``_fused_dq_fold`` in ``kernels/streamkl/_triton/forward.py``). For each shape (bf16, the student's shapes
of ``bench_fused_dq.SHAPES``), in one process on one GPU:

* ``--tune``: every candidate tile of the new fused forward (``bench_fused_dq.FUSED_CANDIDATES``) on the N = 8192
  shapes; per head dim the tile with the least total time over the causal and non-causal shape is used for the
  rest of the run (recorded as ``tile_used``; ``streamkl._triton.configs`` must name the same tiles);
* paired rounds, the order alternating: the fused forward kernel of both versions (their default tiles), and the
  training call as users make it (``attention_kl(...)`` with a frozen teacher, then the student's q and k gradients)
  through both versions; medians, the per-round ratio new / previous, how many rounds the new version won and the
  two-sided sign test;
* cuDNN attention's forward+backward on the student's shapes;
* exactness: the student's query gradient of both versions against float64 on fresh inputs, including a key that
  moves every later row's frame.

    PYTHONPATH=kernels:. python benchmarks/bench_lazy_frames.py --against <copy of v10's kernels/streamkl> --tune \\
        --out benchmarks/results     # ~4 minutes on an H100
    PYTHONPATH=kernels:. python benchmarks/bench_lazy_frames.py --render   # tables into docs/perf-notes.md

Timing assertions never go into tests; the numbers here are ratios measured in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import platform
import statistics
import sys
from dataclasses import asdict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_fused_dq import FUSED_CANDIDATES, SHAPES  # noqa: E402
from bench_hopper import tiles_table as hopper_tiles_table  # noqa: E402
from report import load_package, render_results, sign_test_p  # noqa: E402

ROUNDS = 7
RESULT_NAME = "lazy-frames.json"
DOC = os.path.join(HERE, "..", "docs", "perf-notes.md")
H100_RESULT = os.path.join(HERE, "results", f"nvidia-h100-80gb-hbm3-{RESULT_NAME}")
#: (name, B, H, N, D, causal, case): exactness checks; "late key": one key far above every earlier score for
#: every query (both sides), so every later row's frame moves mid-sweep; "close": a student 0.2 % sharper than its
#: teacher on the same tensors (KL ~1e-6 per row), where the gradient is a small difference of large terms
CHECKS = [
    ("random", 2, 4, 1000, 64, False, "random"),
    ("random-causal", 1, 4, 777, 128, True, "random"),
    ("close", 1, 4, 1024, 64, True, "close"),
    ("close, late key", 1, 4, 1024, 64, True, "close late key"),
    ("late key", 1, 4, 1030, 128, True, "late key"),
]


def _bench(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def _tensors(b, h, n, d, kind: str, seed: int = 0):
    """Teacher and student queries and keys (fp32, CPU) and the student's scale for one check."""
    g = torch.Generator().manual_seed(seed)
    q_t, k_t, q_s, k_s = (torch.randn(b, h, n, d, generator=g) for _ in range(4))
    scale_s = d**-0.5
    if kind.startswith("close"):
        q_s, k_s = q_t.clone(), k_t.clone()
        scale_s *= 1.002
    if kind.endswith("late key"):  # key n // 3 scores +12 with every query, on both sides
        for q, k in ((q_t, k_t), (q_s, k_s)):
            q[..., 0] = 1.0
            k[..., 0] = 0.0
            k[..., n // 3, 0] = 12.0 * d**0.5
    return q_t, k_t, q_s, k_s, scale_s


def check(module, name, b, h, n, d, causal, kind) -> float:
    """Relative L2 error of the student's query gradient (bf16, frozen teacher, mean) against float64."""
    import streamkl

    q_t, k_t, q_s, k_s, scale_s = _tensors(b, h, n, d, kind)
    kw = dict(causal=causal, scale_t=d**-0.5, scale_s=scale_s)
    qs = q_s.cuda().bfloat16().requires_grad_(True)
    ks = k_s.cuda().bfloat16().requires_grad_(True)
    qt, kt = q_t.cuda().bfloat16(), k_t.cuda().bfloat16()
    (dq,) = torch.autograd.grad(module.attention_kl(qt, kt, qs, ks, **kw), (qs,))
    ref_q = qs.detach().double().requires_grad_(True)
    loss = streamkl.attention_kl(qt.double(), kt.double(), ref_q, ks.detach().double(), backend="reference", **kw)
    (ref,) = torch.autograd.grad(loss, (ref_q,))
    return _rel(dq, ref)


def tune(shapes) -> dict:
    """Time every candidate tile of the new fused forward; returns ``{head dim: best LaunchConfig}`` and the rows."""
    from streamkl._triton.configs import LaunchConfig
    from streamkl._triton.forward import attention_kl_fwd, new_dq_b_buffer
    from streamkl._validation import prepare_problem

    rows, totals = [], {}
    for name, b, h, h_kt, n, d, causal in shapes:
        q_t, q_s, k_s = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        k_t = torch.randn(b, h_kt, n, d, device="cuda", dtype=torch.bfloat16)
        inputs, spec = prepare_problem(q_t, k_t, q_s, k_s, causal=causal, reduction="mean").kernel_problem()
        buf = new_dq_b_buffer(inputs)
        for tile in FUSED_CANDIDATES[d]:
            cfg = LaunchConfig(*tile)
            try:
                ms = _bench(lambda cfg=cfg, i=inputs, s=spec, o=buf: attention_kl_fwd(i, s, config=cfg, dq_b=o))
            except Exception as exc:  # a tile that does not compile or fit is recorded, not fatal
                rows.append(dict(shape=name, tile=list(tile), error=f"{type(exc).__name__}: {exc}"[:200]))
                continue
            rows.append(dict(shape=name, tile=list(tile), ms=ms))
            totals.setdefault(d, {}).setdefault(tile, []).append(ms)
            print(f"  tune {name} {tile}: {ms:.3f}", flush=True)
    best = {d: LaunchConfig(*min((t for t in ts if len(ts[t]) == 2), key=lambda t: sum(ts[t])))
            for d, ts in totals.items()}
    return best, rows


def use_tiles(best: dict) -> None:
    """Make the new package's fused forward use ``best[head dim]`` for the rest of the run."""
    import streamkl._triton.forward as forward

    original = forward.forward_config

    def config(d_a, d_b, banded, element_size=2, fused_dq=False):
        if fused_dq and d_a == d_b and d_a in best and element_size == 2:
            return best[d_a]
        return original(d_a, d_b, banded, element_size, fused_dq)

    forward.forward_config = config
    forward._forward_plan.cache_clear()


def measure_shape(base, name, b, h, h_kt, n, d, causal) -> dict:
    import streamkl
    from streamkl._triton.forward import attention_kl_fwd, new_dq_b_buffer
    from streamkl._validation import prepare_problem

    dt = torch.bfloat16
    q_t = torch.randn(b, h, n, d, device="cuda", dtype=dt)
    k_t = torch.randn(b, h_kt, n, d, device="cuda", dtype=dt)
    q_s = torch.randn(b, h, n, d, device="cuda", dtype=dt, requires_grad=True)
    k_s = torch.randn(b, h, n, d, device="cuda", dtype=dt, requires_grad=True)
    row = {"shape": dict(name=name, b=b, h=h, h_kt=h_kt, n=n, d=d, causal=causal, dtype="bfloat16")}

    base_fwd = importlib.import_module(f"{base.__name__}._triton.forward")
    base_prepare = importlib.import_module(f"{base.__name__}._validation").prepare_problem
    kernels = {}
    for label, pkg_fwd, prepare in (
        ("new", (attention_kl_fwd, new_dq_b_buffer), prepare_problem),
        ("previous", (base_fwd.attention_kl_fwd, base_fwd.new_dq_b_buffer), base_prepare),
    ):
        inputs, spec = prepare(q_t, k_t, q_s.detach(), k_s.detach(), causal=causal, reduction="mean").kernel_problem()
        fwd, new_buf = pkg_fwd
        buf = new_buf(inputs)
        kernels[label] = lambda fwd=fwd, inputs=inputs, spec=spec, buf=buf: fwd(inputs, spec, dq_b=buf)

    def train(module):
        def step():
            loss = module.attention_kl(q_t, k_t, q_s, k_s, causal=causal)
            return torch.autograd.grad(loss, (q_s, k_s))
        return step

    trains = {"new": train(streamkl), "previous": train(base)}
    times = {f"{what} {label}": [] for what in ("fused fwd", "training call") for label in ("new", "previous")}
    for r in range(ROUNDS):
        order = ("new", "previous") if r % 2 == 0 else ("previous", "new")
        for label in order:
            times[f"fused fwd {label}"].append(_bench(kernels[label]))
        for label in order:
            times[f"training call {label}"].append(_bench(trains[label]))
    row["ms"] = times
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    sq, sk, v = (torch.randn(b, h, n, d, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))

    def attention_step():
        out = sdpa(sq, sk, v, is_causal=causal)
        return torch.autograd.grad(out, (sq, sk, v), torch.ones_like(out))

    row["cudnn_fwd_bwd_ms"] = _bench(attention_step)
    print(f"{name}: " + ", ".join(f"{k} {statistics.median(t):.3f}" for k, t in times.items())
          + f", cuDNN fwd+bwd {row['cudnn_fwd_bwd_ms']:.3f}", flush=True)
    return row


def cudnn_attention_ms(b: int, h: int, n: int, d: int, causal: bool) -> tuple[float, float]:
    """``(forward, forward+backward)`` ms of cuDNN attention (SDPA's default backend) on bf16 ``(b, h, n, d)``
    tensors: the scale the paired benchmarks quote their times against."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    sq, sk, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def attention_step():
        out = sdpa(sq, sk, v, is_causal=causal)
        return torch.autograd.grad(out, (sq, sk, v), torch.ones_like(out))

    with torch.no_grad():
        fwd = _bench(lambda: sdpa(sq, sk, v, is_causal=causal))
    return fwd, _bench(attention_step)


def paired_rounds(calls: dict, name: str, b: int, h: int, h_kt: int, n: int, d: int, causal: bool) -> dict:
    """One shape's row of a paired benchmark: every call of ``calls`` (label -> function) timed once per round for
    :data:`ROUNDS` rounds, the order reversed every other round, then cuDNN attention's forward and forward+backward
    on the student's shapes (:func:`cudnn_attention_ms`)."""
    order = list(calls)
    times = {label: [] for label in calls}
    for r in range(ROUNDS):
        for label in (order if r % 2 == 0 else order[::-1]):
            times[label].append(_bench(calls[label]))
    row = {"shape": dict(name=name, b=b, h=h, h_kt=h_kt, n=n, d=d, causal=causal, dtype="bfloat16"), "ms": times}
    row["cudnn_fwd_ms"], row["cudnn_fwd_bwd_ms"] = cudnn_attention_ms(b, h, n, d, causal)
    print(f"{name}: " + ", ".join(f"{k} {statistics.median(t):.3f}" for k, t in times.items())
          + f", cuDNN fwd {row['cudnn_fwd_ms']:.3f}, fwd+bwd {row['cudnn_fwd_bwd_ms']:.3f}", flush=True)
    return row


def training_step(module, q_t, k_t, q_s, k_s, causal: bool, context=contextlib.nullcontext):
    """The training call as users make it through ``module`` (``attention_kl``, then the student's q and k
    gradients), inside ``context()`` (a patched selection, say)."""
    def step():
        with context():
            loss = module.attention_kl(q_t, k_t, q_s, k_s, causal=causal)
            return torch.autograd.grad(loss, (q_s, k_s))
    return step


def metric_call(module, q_t, k_t, q_s, k_s, causal: bool):
    """The metric's call through ``module``: ``attention_kl`` without grad."""
    def call():
        with torch.no_grad():
            return module.attention_kl(q_t, k_t, q_s, k_s, causal=causal)
    return call


def paired(row: dict, what: str) -> dict:
    """Median times, the median per-round ratio new / previous, the new version's wins and the sign test."""
    return paired_labels(row, f"{what} new", f"{what} previous")


def paired_labels(row: dict, new_label: str, old_label: str) -> dict:
    """:func:`paired` of the rounds timed under ``row["ms"][new_label]`` against those under ``old_label``."""
    new, old = row["ms"][new_label], row["ms"][old_label]
    ratios = [a / b for a, b in zip(new, old)]
    wins = sum(r < 1.0 for r in ratios)
    return dict(new=statistics.median(new), previous=statistics.median(old), ratio=statistics.median(ratios),
                wins=wins, rounds=len(ratios), p=sign_test_p(wins, len(ratios)))


def run(against: str, do_tune: bool) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    base = load_package(os.path.abspath(against), "streamkl_base")
    data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "host": platform.node(), "rounds": ROUNDS}
    if do_tune:
        best, rows = tune([s for s in SHAPES if s[0].startswith("N8192")])
        data["tiles"] = rows
        data["tile_used"] = {str(d): asdict(cfg) for d, cfg in best.items()}
        use_tiles(best)
    data["rows"] = [measure_shape(base, *shape) for shape in SHAPES]
    data["checks"] = exactness(base)
    return data


def exactness(base) -> list[dict]:
    """:data:`CHECKS` through the new package and ``base``: each case's relative error of both (:func:`check`)."""
    checks = []
    for case in CHECKS:
        errs = {label: check(module, *case) for label, module in (("new", sys.modules["streamkl"]),
                                                                   ("previous", base))}
        checks.append(dict(case=list(case), **errs))
        print(f"check {case[0]}: {errs}", flush=True)
    return checks


def paired_cell(x: dict) -> str:
    """A :func:`paired` comparison as a table cell: "0.93× (7/7, 0.016)" (ratio, wins of the new version, sign test
    p)."""
    return f"{x['ratio']:.2f}× ({x['wins']}/{x['rounds']}, {x['p']:.2g})"


def op_table(data: dict, previous: str = "v10", new: str = "v11") -> str:
    """The paired fused-forward and training-call table of a run of ``new`` against ``previous``."""
    lines = [f"| shape | fused fwd ms, {previous} → {new} | {new} / {previous} (wins, sign test p) | training call ms, "
             f"{previous} → {new} | {new} / {previous} (wins, sign test p) | training call / cuDNN fwd+bwd, "
             f"{previous} → {new} |",
             "|---|---|---|---|---|---|"]
    for row in data["rows"]:
        k, t = paired(row, "fused fwd"), paired(row, "training call")
        cudnn = row["cudnn_fwd_bwd_ms"]
        lines.append(f"| {row['shape']['name']} | {k['previous']:.3f} → {k['new']:.3f} | {paired_cell(k)} | "
                     f"{t['previous']:.3f} → {t['new']:.3f} | {paired_cell(t)} | "
                     f"{t['previous'] / cudnn:.2f}× → {t['new'] / cudnn:.2f}× |")
    return "\n".join(lines)


def tiles_table(data: dict) -> str:
    shapes = [{"name": name, "tiles": [t for t in data.get("tiles", []) if t["shape"] == name]}
              for name in dict.fromkeys(t["shape"] for t in data.get("tiles", []))]
    return hopper_tiles_table({"shapes": shapes}, timed="v11 fused fwd ms", stages="stages")


def checks_table(data: dict, previous: str = "v10", new: str = "v11") -> str:
    lines = [f"| case (B, H, N, D, causal, inputs) | dQ_s {new} vs float64 | dQ_s {previous} vs float64 |",
             "|---|---|---|"]
    for c in data["checks"]:
        _, b, h, n, d, causal, kind = c["case"]
        lines.append(f"| {b}, {h}, {n}, {d}, {causal}, {kind} | {c['new']:.1e} | {c['previous']:.1e} |")
    return "\n".join(lines)


def blocks(data: dict, _tuning=None) -> dict[str, str]:
    """The generated blocks of docs/perf-notes.md v11: name -> markdown."""
    return {"lazy:tiles": tiles_table(data), "lazy:op": op_table(data), "lazy:checks": checks_table(data)}


def render(path: str, doc: str = DOC) -> None:
    render_results(doc, blocks, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", help="a copy of the previous version's kernels/streamkl")
    parser.add_argument("--tune", action="store_true", help="time every candidate tile of the new fused forward first")
    parser.add_argument("--out", help="directory for <gpu>-lazy-frames.json")
    parser.add_argument("--render", nargs="?", const=H100_RESULT,
                        help="write the tables of a results file into docs/perf-notes.md")
    args = parser.parse_args(argv)
    if args.render:
        render(args.render)
        return
    if not args.against:
        parser.error("--against is required to measure (a copy of the previous version's kernels/streamkl)")
    from bench_attention_kl import gpu_tag, write_json

    data = run(args.against, args.tune)
    out = os.path.join(args.out or os.path.join(HERE, "results"), f"{gpu_tag(data['device'])}-{RESULT_NAME}")
    write_json(out, data)
    print(op_table(data))
    print(tiles_table(data))
    print(checks_table(data))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
