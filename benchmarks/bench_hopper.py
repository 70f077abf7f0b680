"""v7 (issue 14): the Hopper forward (Gluon: TMA, asynchronous wgmma in flight during the exponentials) against the
portable Triton forward and cuDNN attention, measured on one H100 in one run.

For each shape (bf16), in the same run:

* the Hopper forward kernel for every candidate tile (``CANDIDATES``) and with its default tile;
* the portable Triton forward (the kernel every other GPU runs), torch SDPA's forward on the student's shapes (cuDNN,
  the default on H100, and FLASH_ATTENTION);
* the op as users call it for a metric (``attention_kl`` under ``torch.no_grad``, reduction "mean") with the Hopper
  kernels on and off (``STREAMKL_HOPPER_KERNELS``);
* the forward's exp/matmul bound from the ceilings measured in this run.

A correctness grid (``CHECKS``: odd sizes, GQA, causal with N_k > N_q, mixed head dims, fp16, the bnhd layout,
near one-hot rows, a temperature, reverse KL) compares the Hopper forward's per-row KL and log-sum-exps with the
portable kernel's and with the float64 chunked reference, on fresh random inputs.

    PYTHONPATH=kernels:. python benchmarks/bench_hopper.py --out DIR             # + every candidate tile (~80 s)
    PYTHONPATH=kernels:. python benchmarks/bench_hopper.py --no-tune --out benchmarks/results   # the published run
    PYTHONPATH=kernels:. python benchmarks/bench_hopper.py --render                  # tables into docs/perf-notes.md

Timing assertions never go into tests; the numbers here are ratios measured in one run.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_attention_kl import _do_bench as _bench  # noqa: E402  (the same do_bench median as the other scripts)
from bench_fused_dq import _rel  # noqa: E402  (relative L2 difference)
from report import render_results  # noqa: E402

#: (block_m, block_n, warps, stages) of the Hopper forward timed per head dim
CANDIDATES = {
    64: [(128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3), (128, 32, 8, 3), (64, 32, 4, 4)],
    128: [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 2), (128, 32, 8, 3), (64, 32, 4, 3)],
}
#: (name, B, H, teacher key heads, N, D, causal)
SHAPES = [
    ("N8192-D64", 1, 16, 16, 8192, 64, False),
    ("N8192-D64-causal", 1, 16, 16, 8192, 64, True),
    ("N8192-D128", 1, 16, 16, 8192, 128, False),
    ("N8192-D128-causal", 1, 16, 16, 8192, 128, True),
    ("N16384-D128-H32-GQA8-causal", 1, 32, 8, 16384, 128, True),
    ("N2048-D64-H16", 1, 16, 16, 2048, 64, False),
    ("BERT-B8-H12-N512-D64", 8, 12, 12, 512, 64, False),
]
#: (B, H, teacher key heads, student key heads, N_q, N_k, D_t, D_s, causal, dtype, direction, temperature,
#:  sharpness, layout)
CHECKS = [
    (2, 4, 4, 4, 1000, 1000, 64, 64, False, "bfloat16", "forward", 1.0, 1.0, "bhnd"),
    (1, 4, 4, 4, 777, 777, 64, 64, True, "bfloat16", "forward", 1.0, 1.0, "bhnd"),
    (1, 8, 2, 8, 1030, 1030, 128, 128, True, "bfloat16", "forward", 1.0, 1.0, "bhnd"),
    (1, 4, 4, 1, 513, 1500, 128, 64, True, "float16", "forward", 1.0, 1.0, "bhnd"),
    (2, 4, 4, 4, 300, 2100, 64, 128, False, "bfloat16", "reverse", 2.0, 1.0, "bnhd"),
    (1, 4, 4, 4, 1024, 1024, 64, 64, True, "bfloat16", "forward", 1.0, 30.0, "bhnd"),
    (1, 2, 2, 2, 64, 64, 64, 64, False, "float16", "forward", 0.5, 1.0, "bhnd"),
    (1, 2, 1, 1, 4099, 4099, 128, 128, True, "bfloat16", "forward", 1.0, 1.0, "bnhd"),
]
RESULT_NAME = "hopper.json"
DOC = os.path.join(HERE, "..", "docs", "perf-notes.md")
H100_RESULT = os.path.join(HERE, "results", f"nvidia-h100-80gb-hbm3-{RESULT_NAME}")
#: the first run (default tile 128×64, 8 warps), with every candidate tile: the sweep the defaults come from
H100_TUNING = os.path.join(HERE, "results", "runs", "nvidia-h100-80gb-hbm3-hopper-tuning.json")


def _tensors(b, h, hk_t, hk_s, n_q, n_k, d_t, d_s, dtype, sharpness, layout, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def make(heads, n, d, mult=1.0):
        x = torch.randn(b, heads, n, d, device="cuda", generator=g) * mult
        if layout == "bnhd":
            return x.transpose(1, 2).contiguous().to(dtype)
        return x.to(dtype)

    return make(h, n_q, d_t), make(hk_t, n_k, d_t), make(h, n_q, d_s, sharpness), make(hk_s, n_k, d_s)


def check(seed: int = 0) -> list[dict]:
    """The correctness grid: per-row KL of the Hopper path (``STREAMKL_HOPPER_KERNELS=all``, so small problems and
    head dim 64 take it too), the portable kernel and the float64 reference."""
    import streamkl._hopper as hopper
    from streamkl import attention_kl

    module = hopper._module()
    calls = []
    real = module.attention_kl_fwd_hopper
    module.attention_kl_fwd_hopper = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    rows = []
    try:
        for i, (b, h, hk_t, hk_s, n_q, n_k, d_t, d_s, causal, dt, direction, temp, sharp, layout) in enumerate(CHECKS):
            dtype = getattr(torch, dt)
            q_t, k_t, q_s, k_s = _tensors(b, h, hk_t, hk_s, n_q, n_k, d_t, d_s, dtype, sharp, layout, seed + i)
            kw = dict(causal=causal, direction=direction, temperature=temp, reduction="none", layout=layout)
            out = {}
            for name, env in (("hopper", "all"), ("portable", "0")):
                os.environ[hopper.ENV_SWITCH] = env
                before = len(calls)
                with torch.no_grad():
                    out[name] = attention_kl(q_t, k_t, q_s, k_s, backend="triton", **kw)
                out[f"{name}_calls"] = len(calls) - before
            os.environ.pop(hopper.ENV_SWITCH, None)
            ref = attention_kl(q_t.double(), k_t.double(), q_s.double(), k_s.double(), backend="reference", **kw)
            row = dict(case=CHECKS[i], hopper_ran=out["hopper_calls"] == 1 and out["portable_calls"] == 0,
                       finite=bool(torch.isfinite(out["hopper"]).all()),
                       rel_hopper_vs_ref=_rel(out["hopper"], ref), rel_portable_vs_ref=_rel(out["portable"], ref),
                       rel_hopper_vs_portable=_rel(out["hopper"], out["portable"]),
                       max_abs_hopper_vs_ref=float((out["hopper"].double() - ref).abs().max()))
            row["ok"] = bool(row["hopper_ran"] and row["finite"]
                             and row["rel_hopper_vs_ref"] <= 2 * row["rel_portable_vs_ref"] + 1e-6)
            rows.append(row)
            print(f"check {i}: {row}", flush=True)
    finally:
        module.attention_kl_fwd_hopper = real
    return rows


def measure_shape(name, b, h, h_kt, n, d, causal, tune: bool) -> dict:
    import streamkl._hopper as hopper
    from streamkl import attention_kl
    from streamkl._hopper.forward import attention_kl_fwd_hopper, hopper_forward_config
    from streamkl._problem import KLInputs, KLSpec
    from streamkl._triton.configs import LaunchConfig
    from streamkl._triton.forward import attention_kl_fwd

    q_t, k_t, q_s, k_s = _tensors(b, h, h_kt, h, n, n, d, d, torch.bfloat16, 1.0, "bhnd", 1)
    inputs = KLInputs(q_t, k_t, q_s, k_s, None, None, None, None, None, None)
    spec = KLSpec(d ** -0.5, d ** -0.5, window_right=0 if causal else -1)
    row = dict(name=name, b=b, h=h, h_kt=h_kt, n=n, d=d, causal=causal,
               default_tile=list(vars(hopper_forward_config(d, d)).values()))
    row["portable_fwd_ms"] = _bench(lambda: attention_kl_fwd(inputs, spec))
    row["hopper_fwd_ms"] = _bench(lambda: attention_kl_fwd_hopper(inputs, spec))
    kl_h, *_ = attention_kl_fwd_hopper(inputs, spec)
    kl_p, *_ = attention_kl_fwd(inputs, spec)
    row["rel_hopper_vs_portable"] = _rel(kl_h, kl_p)
    if tune:
        row["tiles"] = []
        for cand in CANDIDATES[d]:
            cfg = LaunchConfig(*cand)
            try:
                ms = _bench(lambda cfg=cfg: attention_kl_fwd_hopper(inputs, spec, cfg))
                kl_c, *_ = attention_kl_fwd_hopper(inputs, spec, cfg)
                row["tiles"].append(dict(tile=list(cand), ms=ms, rel_vs_portable=_rel(kl_c, kl_p)))
            except Exception as exc:  # a tile that does not fit (shared memory) is reported, not fatal
                row["tiles"].append(dict(tile=list(cand), error=f"{type(exc).__name__}: {exc}"[:300]))
    sq, sk = q_s, k_s.repeat_interleave(h // k_s.shape[1], dim=1) if k_s.shape[1] != h else k_s
    v = torch.randn_like(sk)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    row["cudnn_fwd_ms"] = _bench(lambda: sdpa(sq, sk, v, is_causal=causal))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        row["fa2_fwd_ms"] = _bench(lambda: sdpa(sq, sk, v, is_causal=causal))
    # the op as a metric: with the default selection (Hopper only where it is picked), forced, and off
    for label, env in (("op_metric_default_ms", None), ("op_metric_hopper_ms", "all"), ("op_metric_portable_ms", "0")):
        if env is None:
            os.environ.pop(hopper.ENV_SWITCH, None)
            row["default_picks_hopper"] = hopper.hopper_forward(inputs, spec) is not None
        else:
            os.environ[hopper.ENV_SWITCH] = env
        with torch.no_grad():
            row[label] = _bench(lambda: attention_kl(q_t, k_t, q_s, k_s, causal=causal))
    os.environ.pop(hopper.ENV_SWITCH, None)
    print(f"shape {name}: {row}", flush=True)
    return row


def bounds_ms(row: dict, ceilings: dict) -> dict:
    """The forward's exp and matmul bounds (2 products, 2 exp2 per score element; causal: half the elements)."""
    e = row["b"] * row["h"] * row["n"] * row["n"] * (0.5 if row["causal"] else 1.0)
    exp_ms = 2 * e / ceilings["exp2_per_s"] * 1e3
    mm_ms = 2 * e * 2 * row["d"] / ceilings["bf16_matmul_flops"] * 1e3
    return {"exp_ms": exp_ms, "matmul_ms": mm_ms, "bound_ms": max(exp_ms, mm_ms)}


def run(tune: bool) -> dict:
    import triton
    from bench_attention_kl import measure_ceilings

    t0 = time.time()
    checks = check()
    ceilings = measure_ceilings()
    shapes = [measure_shape(*s, tune=tune and s[4] == 8192) for s in SHAPES]
    for row in shapes:
        row.update(bounds_ms(row, ceilings))
    return dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), ceilings=ceilings, checks=checks, shapes=shapes,
                seconds=time.time() - t0)


def table(data: dict) -> str:
    lines = ["| shape | portable fwd ms | Hopper fwd ms | Hopper / portable | Hopper / cuDNN fwd | Hopper / FA2 fwd "
             "| % of the fwd bound | metric call, Hopper forced / portable | Hopper by default | metric call, default "
             "/ portable |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["shapes"]:
        lines.append(
            f"| {r['name']} | {r['portable_fwd_ms']:.3f} | {r['hopper_fwd_ms']:.3f} "
            f"| {r['hopper_fwd_ms'] / r['portable_fwd_ms']:.2f}× | {r['hopper_fwd_ms'] / r['cudnn_fwd_ms']:.2f}× "
            f"| {r['hopper_fwd_ms'] / r['fa2_fwd_ms']:.2f}× | {100 * r['bound_ms'] / r['hopper_fwd_ms']:.0f}% "
            f"| {r['op_metric_hopper_ms'] / r['op_metric_portable_ms']:.2f}× "
            f"| {'yes' if r['default_picks_hopper'] else 'no'} "
            f"| {r['op_metric_default_ms'] / r['op_metric_portable_ms']:.2f}× |")
    return "\n".join(lines)


def tiles_table(data: dict, tile: str = "block_m×block_n", timed: str = "Hopper fwd ms",
                stages: str = "ring stages") -> str:
    """Every candidate tile of a kernel's sweep (``row["tiles"]`` of each shape), fastest first per shape;
    ``tile`` names the tile's first two sizes, ``stages`` its last and ``timed`` the time column."""
    lines = [f"| shape | tile ({tile}, warps, {stages}) | {timed} |", "|---|---|---|"]
    for r in data["shapes"]:
        for t in sorted(r.get("tiles", []), key=lambda t: t.get("ms", float("inf"))):
            bm, bn, w, s = t["tile"]
            ms = f"{t['ms']:.3f}" if "ms" in t else "failed: " + t["error"].split(":")[0]
            lines.append(f"| {r['name']} | {bm}×{bn}, {w}, {s} | {ms} |")
    return "\n".join(lines)


def checks_table(data: dict) -> str:
    lines = ["| case (B, H, H_k teacher, H_k student, N_q, N_k, D_t, D_s, causal, dtype, direction, T, sharpness, "
             "layout) | Hopper vs float64 | portable vs float64 | Hopper vs portable |", "|---|---|---|---|"]
    for c in data["checks"]:
        lines.append(f"| {', '.join(str(x) for x in c['case'])} | {c['rel_hopper_vs_ref']:.1e} "
                     f"| {c['rel_portable_vs_ref']:.1e} | {c['rel_hopper_vs_portable']:.1e} |")
    return "\n".join(lines)


def blocks(data: dict, tuning: dict) -> dict[str, str]:
    """The generated blocks of docs/perf-notes.md v7: name -> markdown (the tiles from the tuning run)."""
    return {"hopper:tiles": tiles_table(tuning), "hopper:op": table(data), "hopper:checks": checks_table(data)}


def render(path: str, tuning_path: str = H100_TUNING, doc: str = DOC) -> None:
    render_results(doc, blocks, path, tuning_path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="directory for <gpu>-hopper.json")
    parser.add_argument("--no-tune", action="store_true", help="skip the candidate tiles")
    parser.add_argument("--render", nargs="?", const=H100_RESULT,
                        help="write the tables of a results file into docs/perf-notes.md")
    args = parser.parse_args(argv)
    if args.render:
        render(args.render)
        return
    from bench_attention_kl import gpu_tag, write_json

    data = run(not args.no_tune)
    out = os.path.join(args.out or os.path.join(HERE, "results"), f"{gpu_tag(data['device'])}-{RESULT_NAME}")
    write_json(out, data)
    print(checks_table(data))
    print(tiles_table(data))
    print(table(data))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
