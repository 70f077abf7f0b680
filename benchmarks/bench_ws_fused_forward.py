"""v17 (issue 14): the warp-specialised Gluon training forward with a frozen teacher, against v16's portable one.

v17 adds a Gluon kernel for the forward of the frozen-teacher training call (KL, both log-sum-exps and the student's
query gradient in one pass, ``kernels/streamkl/_hopper/fused_forward.py``): a producer warp streams both sides' key
tiles into a shared ring, two consumer warpgroups of 64 query rows each take their steps one at a time. It computes
the portable kernel's function step for step, so their outputs are bitwise equal.

For each long-context shape below (bf16, frozen teacher), in one process on one GPU:

* the kernel's tiles, each timed once (``CANDIDATES``);
* with ``--one-warpgroup``: the first Gluon version of this forward (v17a, one warpgroup per program, a copy of
  commit 568df98's package) with its three schedules, each timed once;
* paired rounds, the order alternating: the portable fused forward against the Gluon one (same package), and the
  training call as users make it (``attention_kl(...)``, then the student's q and k gradients) through v16's package
  (``--against``) and v17's; the sign test on each;
* cuDNN attention's forward, and its forward+backward, on the student's shapes;
* exactness (``bench_hopper_key_pass.CHECKS``, in scope): whether the Gluon and portable forwards give the same bits
  (KL, both lse, dQ_s), and the query gradient's error against float64.

    PYTHONPATH=kernels:. python benchmarks/bench_ws_fused_forward.py --against <copy of v16's kernels/streamkl> \\
        --one-warpgroup <copy of v17a's kernels/streamkl> --out benchmarks/results    # ~3 minutes on an H100
    PYTHONPATH=kernels:. python benchmarks/bench_ws_fused_forward.py --render   # tables into docs/perf-notes.md

Timing assertions never go into tests; the numbers here are ratios measured in one run.
"""

from __future__ import annotations

import importlib
import os
import platform
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_fused_dq import SHAPES as FUSED_SHAPES  # noqa: E402
from bench_hopper import tiles_table as hopper_tiles_table  # noqa: E402
from bench_hopper_key_pass import CHECKS  # noqa: E402
from bench_lazy_frames import ROUNDS, _bench, _rel, cudnn_attention_ms, paired, paired_cell  # noqa: E402
from bench_ws_key_pass import _problem  # noqa: E402
from report import load_package, paired_run_main  # noqa: E402

RESULT_NAME = "ws-fused-forward.json"
DOC = os.path.join(HERE, "..", "docs", "perf-notes.md")
H100_RESULT = os.path.join(HERE, "results", f"nvidia-h100-80gb-hbm3-{RESULT_NAME}")
#: the fused-forward benchmark's long-context shapes (name, B, H, teacher key heads, N, D, causal)
SHAPES = [s for s in FUSED_SHAPES if not s[0].startswith("BERT")]
#: (rows per consumer, keys per tile, warps per consumer, ring stages) of the warp-specialised kernel
CANDIDATES = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 4)]
#: v17a's schedules (``overlap``): 0 one step at a time, 1 the previous tile's dQ products in flight during the
#: exponentials, 2 those and the next tile's scores
ONE_WARPGROUP_SCHEDULES = (0, 1, 2)


def measure_shape(base, one_warpgroup, name, b, h, h_kt, n, d, causal) -> dict:
    """One shape's row: the tiles, v17a's schedules (``one_warpgroup``: its package, or None), the paired rounds of
    both forwards and of both packages' training call, and cuDNN's forward and forward+backward."""
    import streamkl
    from streamkl._hopper.fused_forward import attention_kl_fused_fwd_hopper
    from streamkl._triton.configs import LaunchConfig
    from streamkl._triton.forward import attention_kl_fwd, new_dq_b_buffer

    inputs, spec, *_ = _problem(streamkl, b, h, h_kt, h, n, n, d, d, causal, 1.0, "bhnd", 1)
    buf = new_dq_b_buffer(inputs)
    row = {"shape": dict(name=name, b=b, h=h, h_kt=h_kt, n=n, d=d, causal=causal, dtype="bfloat16"), "tiles": []}
    for cand in CANDIDATES:
        cfg = LaunchConfig(*cand)
        row["tiles"].append(dict(tile=list(cand), ms=_bench(
            lambda cfg=cfg: attention_kl_fused_fwd_hopper(inputs, spec, buf, cfg))))
    if one_warpgroup is not None:
        one = importlib.import_module(f"{one_warpgroup.__name__}._hopper.fused_forward").attention_kl_fused_fwd_hopper
        row["one_warpgroup_ms"] = {str(o): _bench(lambda o=o: one(inputs, spec, buf, None, o))
                                   for o in ONE_WARPGROUP_SCHEDULES}
    q_t, k_t, q_s, k_s = inputs.q_a, inputs.k_a, inputs.q_b.detach().requires_grad_(True), \
        inputs.k_b.detach().requires_grad_(True)

    def train(module):
        def step():
            loss = module.attention_kl(q_t, k_t, q_s, k_s, causal=causal)
            return torch.autograd.grad(loss, (q_s, k_s))
        return step

    calls = {
        "fused fwd new": lambda: attention_kl_fused_fwd_hopper(inputs, spec, buf),
        "fused fwd previous": lambda: attention_kl_fwd(inputs, spec, dq_b=buf),
        "training call new": train(streamkl),
        "training call previous": train(base),
    }
    times = {label: [] for label in calls}
    for r in range(ROUNDS):
        for what in ("fused fwd", "training call"):
            for label in (("new", "previous") if r % 2 == 0 else ("previous", "new")):
                times[f"{what} {label}"].append(_bench(calls[f"{what} {label}"]))
    row["ms"] = times
    row["cudnn_fwd_ms"], row["cudnn_fwd_bwd_ms"] = cudnn_attention_ms(b, h, n, d, causal)
    print(f"{name}: " + ", ".join(f"{k} {statistics.median(t):.3f}" for k, t in times.items())
          + f", cuDNN fwd {row['cudnn_fwd_ms']:.3f}, fwd+bwd {row['cudnn_fwd_bwd_ms']:.3f}", flush=True)
    return row


def exactness(package=None) -> list[dict]:
    """:data:`CHECKS` in the kernel's scope: whether the Gluon and portable fused forwards of ``package`` (default: this
    checkout's ``streamkl``; or a copy loaded by ``report.load_package``) give the same bits, and the query gradient's
    relative error (``reduction="sum"``'s, per unit upstream gradient) against float64."""
    import streamkl
    from streamkl import attention_kl
    from streamkl._triton.forward import new_dq_b_buffer

    package = package or streamkl
    fused = importlib.import_module(f"{package.__name__}._hopper.fused_forward")
    attention_kl_fused_fwd_hopper, in_scope = fused.attention_kl_fused_fwd_hopper, fused.in_scope
    attention_kl_fwd = importlib.import_module(f"{package.__name__}._triton.forward").attention_kl_fwd

    rows = []
    for i, case in enumerate(CHECKS):
        b, h, hk_t, hk_s, n_q, n_k, d_t, d_s, causal, _loss, _temp, sharpness, layout = case
        inputs, spec, *_ = _problem(streamkl, b, h, hk_t, hk_s, n_q, n_k, d_t, d_s, causal, sharpness, layout, i)
        if not in_scope(inputs, spec):
            continue
        dq_gluon, dq_portable = new_dq_b_buffer(inputs), new_dq_b_buffer(inputs)
        gluon = (*attention_kl_fused_fwd_hopper(inputs, spec, dq_gluon), dq_gluon)
        portable = (*attention_kl_fwd(inputs, spec, dq_b=dq_portable), dq_portable)
        q_t, k_t, q_s, k_s = (x.double() for x in inputs[:4])
        q_s.requires_grad_(True)
        ref = attention_kl(q_t, k_t, q_s, k_s, causal=causal, scale_t=spec.scale_a, scale_s=spec.scale_b,
                           reduction="sum", backend="reference")
        (ref_dq,) = torch.autograd.grad(ref, (q_s,))
        rows.append(dict(case=[b, h, hk_t, hk_s, n_q, n_k, d_t, d_s, causal, layout], dq_dtype=str(dq_gluon.dtype),
                         bitwise_equal=all(torch.equal(x, y) for x, y in zip(gluon, portable)),
                         rel_gluon_vs_ref=_rel(dq_gluon, ref_dq), rel_portable_vs_ref=_rel(dq_portable, ref_dq)))
        print(f"check {case}: {rows[-1]}", flush=True)
    return rows


def run(against: str, one_warpgroup: str | None) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    base = load_package(os.path.abspath(against), "streamkl_base")
    one = load_package(os.path.abspath(one_warpgroup), "streamkl_v17a") if one_warpgroup else None
    data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "host": platform.node(), "rounds": ROUNDS}
    data["checks"] = exactness()
    data["rows"] = [measure_shape(base, one, *shape) for shape in SHAPES]
    return data


def op_table(data: dict) -> str:
    """The paired fused-forward and training-call table, with cuDNN's times for scale."""
    lines = ["| shape | fused fwd ms, portable → Gluon | Gluon / portable (wins, sign test p) | fused fwd / cuDNN fwd, "
             "portable → Gluon | training call ms, v16 → v17 | v17 / v16 (wins, p) | training call / cuDNN "
             "fwd+bwd, v16 → v17 |",
             "|---|---|---|---|---|---|---|"]
    for row in data["rows"]:
        f, t = paired(row, "fused fwd"), paired(row, "training call")
        fwd, both = row["cudnn_fwd_ms"], row["cudnn_fwd_bwd_ms"]
        lines.append(f"| {row['shape']['name']} | {f['previous']:.3f} → {f['new']:.3f} | {paired_cell(f)} | "
                     f"{f['previous'] / fwd:.2f}× → {f['new'] / fwd:.2f}× | {t['previous']:.3f} → {t['new']:.3f} | "
                     f"{paired_cell(t)} | {t['previous'] / both:.2f}× → {t['new'] / both:.2f}× |")
    return "\n".join(lines)


def one_warpgroup_table(data: dict) -> str:
    """v17a's schedules against the portable fused forward's median in the same run."""
    lines = ["| shape | portable fused fwd ms | v17a one step at a time | v17a dQ products in flight | v17a dQ "
             "products and next scores in flight |", "|---|---|---|---|---|"]
    for row in data["rows"]:
        if "one_warpgroup_ms" not in row:
            continue
        portable = paired(row, "fused fwd")["previous"]
        cells = [f"{ms:.3f} ({ms / portable:.2f}×)" for ms in (row["one_warpgroup_ms"][str(o)]
                                                               for o in ONE_WARPGROUP_SCHEDULES)]
        lines.append(f"| {row['shape']['name']} | {portable:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tiles_table(data: dict) -> str:
    return hopper_tiles_table({"shapes": [dict(name=r["shape"]["name"], tiles=r["tiles"]) for r in data["rows"]]},
                              tile="rows per consumer × keys", timed="Gluon fused fwd ms")


def checks_table(data: dict) -> str:
    lines = ["| case (B, H, H_k teacher, H_k student, N_q, N_k, D_t, D_s, causal, layout) | dQ_s saved as | "
             "dQ_s Gluon vs float64 | portable vs float64 | KL, lse and dQ_s bitwise equal |",
             "|---|---|---|---|---|"]
    for c in data["checks"]:
        lines.append(f"| {', '.join(str(x) for x in c['case'])} | {c['dq_dtype'].replace('torch.', '')} | "
                     f"{c['rel_gluon_vs_ref']:.1e} | {c['rel_portable_vs_ref']:.1e} | "
                     f"{'yes' if c['bitwise_equal'] else 'no'} |")
    return "\n".join(lines)


def blocks(data: dict, _tuning=None) -> dict[str, str]:
    """The generated blocks of docs/perf-notes.md v17: name -> markdown."""
    return {"ws-fwd:tiles": tiles_table(data), "ws-fwd:op": op_table(data),
            "ws-fwd:one-warpgroup": one_warpgroup_table(data), "ws-fwd:checks": checks_table(data)}


def main(argv: list[str] | None = None) -> None:
    paired_run_main(argv, __doc__, run, blocks, RESULT_NAME, H100_RESULT, DOC,
                    extra=("--one-warpgroup", "a copy of v17a's kernels/streamkl (commit 568df98)"))


if __name__ == "__main__":
    main()
