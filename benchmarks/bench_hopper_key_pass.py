"""v10 (issue 14): the Hopper key pass (Gluon: TMA query ring, the next step's score products in flight during this
step's exponentials) against the portable key pass, measured on one H100 in one run.

The training path with a frozen teacher (the default ``direction="forward"``, v6) runs the fused forward and then only
the backward's key pass. For each shape (bf16), in the same run:

* kernel level: the backward as that path calls it (``attention_kl_bwd`` with the forward's ``dq_b``: the key pass
  and one scaling kernel) on the Hopper key pass and on the portable one (``STREAMKL_HOPPER_KERNELS``), the Hopper
  key pass for every candidate tile (``CANDIDATES``, with ``--tune``), and the key pass's exp/matmul bound (3 products,
  2 exponentials per score element) from the ceilings measured in this run;
* host time per launch (``launch_host_us``: B=1 H=4 N=1024, too small to keep the GPU busy) of the Hopper key pass and
  forward kernels, the portable forward, and the backward of the training path on either key pass;
* the op as users call it for training (``attention_kl(...)``, ``reduction="mean"``, then ``torch.autograd.grad`` for
  the student's q and k): forward+backward with the default selection and with the Hopper kernels off, and cuDNN
  attention's forward+backward on the student's shapes.

A correctness grid (``CHECKS``: odd sizes, GQA on either side, causal with N_k > N_q, mixed head dims, the bnhd
layout, near one-hot rows, a temperature, ``mean``/``sum``/weighted per-row losses) compares the student's gradients
of that training call with the Hopper key pass forced on, with it off, and from the float64 reference, on fresh
random inputs, and records that the Hopper pass ran.

    PYTHONPATH=kernels:. python benchmarks/bench_hopper_key_pass.py --tune --out benchmarks/results  # published, ~2 min
    PYTHONPATH=kernels:. python benchmarks/bench_hopper_key_pass.py --out DIR  # without the candidate tiles
    PYTHONPATH=kernels:. python benchmarks/bench_hopper_key_pass.py --render  # tables into docs/perf-notes.md

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
from bench_hopper import _tensors  # noqa: E402  (the same inputs as the Hopper forward's benchmark)
from bench_hopper import tiles_table as hopper_tiles_table  # noqa: E402
from report import render_results  # noqa: E402

#: (block_m, block_n, warps, stages) of the Hopper key pass timed with --tune: block_m queries per step, block_n keys
CANDIDATES = [(32, 64, 4, 2), (32, 64, 4, 3), (32, 64, 4, 4), (64, 64, 4, 2), (64, 64, 4, 4), (64, 64, 4, 6),
              (32, 128, 8, 3), (64, 128, 8, 2)]
#: (name, B, H, teacher key heads, N, D, causal)
SHAPES = [
    ("N8192-D64", 1, 16, 16, 8192, 64, False),
    ("N8192-D64-causal", 1, 16, 16, 8192, 64, True),
    ("N8192-D128", 1, 16, 16, 8192, 128, False),
    ("N8192-D128-causal", 1, 16, 16, 8192, 128, True),
    ("N16384-D128-H32-GQA8-causal", 1, 32, 8, 16384, 128, True),
    ("N4096-B2-H12-D64", 2, 12, 12, 4096, 64, False),
    ("BERT-B8-H12-N512-D64", 8, 12, 12, 512, 64, False),
]
#: (B, H, teacher key heads, student key heads, N_q, N_k, D_t, D_s, causal, loss, temperature, sharpness, layout);
#: loss "weighted" is ``(per_row_kl * w).sum()`` with random row weights (a per-row upstream gradient)
CHECKS = [
    (2, 4, 4, 4, 1000, 1000, 64, 64, False, "mean", 1.0, 1.0, "bhnd"),
    (1, 4, 4, 4, 777, 777, 64, 64, True, "mean", 1.0, 1.0, "bhnd"),
    (1, 8, 2, 8, 1030, 1030, 128, 128, True, "mean", 1.0, 1.0, "bhnd"),
    (1, 8, 2, 4, 1030, 1030, 128, 128, True, "sum", 1.0, 1.0, "bhnd"),
    (1, 8, 8, 2, 700, 700, 64, 64, True, "mean", 1.0, 1.0, "bhnd"),
    (2, 8, 4, 1, 500, 500, 128, 64, False, "weighted", 1.0, 1.0, "bhnd"),
    (1, 4, 4, 4, 513, 1500, 128, 64, True, "weighted", 1.0, 1.0, "bhnd"),
    (2, 4, 4, 4, 300, 2100, 64, 128, False, "mean", 2.0, 1.0, "bnhd"),
    (1, 4, 4, 4, 1024, 1024, 64, 64, True, "mean", 1.0, 30.0, "bhnd"),
    (1, 2, 2, 2, 64, 64, 64, 64, False, "weighted", 0.5, 1.0, "bhnd"),
    (1, 2, 1, 1, 4099, 4099, 128, 128, True, "mean", 1.0, 1.0, "bnhd"),
]
RESULT_NAME = "hopper-key-pass.json"
DOC = os.path.join(HERE, "..", "docs", "perf-notes.md")
H100_RESULT = os.path.join(HERE, "results", f"nvidia-h100-80gb-hbm3-{RESULT_NAME}")
#: the run with every candidate tile, the sweep the defaults come from: the published run itself (``--tune``)
H100_TUNING = H100_RESULT


def _student_grads(q_t, k_t, q_s, k_s, loss: str, weights, **kw):
    """``(dq_s, dk_s)`` of the training call ``attention_kl(...)`` with a frozen teacher."""
    from streamkl import attention_kl

    q_s = q_s.detach().requires_grad_(True)
    k_s = k_s.detach().requires_grad_(True)
    if loss == "weighted":
        value = (attention_kl(q_t, k_t, q_s, k_s, reduction="none", **kw) * weights).sum()
    else:
        value = attention_kl(q_t, k_t, q_s, k_s, reduction=loss, **kw)
    return torch.autograd.grad(value, (q_s, k_s))


def check(seed: int = 0) -> list[dict]:
    """The correctness grid: the student's gradients with the Hopper key pass forced (``STREAMKL_HOPPER_KERNELS=all``,
    so small problems take it too), with the Hopper kernels off, and from the float64 reference."""
    import streamkl._hopper as hopper

    module = hopper._module("backward")
    calls = []
    real = module.attention_kl_key_pass_hopper
    module.attention_kl_key_pass_hopper = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    rows = []
    try:
        for i, (b, h, hk_t, hk_s, n_q, n_k, d_t, d_s, causal, loss, temp, sharp, layout) in enumerate(CHECKS):
            q_t, k_t, q_s, k_s = _tensors(b, h, hk_t, hk_s, n_q, n_k, d_t, d_s, torch.bfloat16, sharp, layout,
                                          seed + i)
            weights = torch.rand((b, h, n_q), device="cuda",
                                 generator=torch.Generator(device="cuda").manual_seed(seed + 100 + i))
            kw = dict(causal=causal, temperature=temp, layout=layout)
            out = {}
            for name, env in (("hopper", "all"), ("portable", "0")):
                os.environ[hopper.ENV_SWITCH] = env
                before = len(calls)
                out[name] = _student_grads(q_t, k_t, q_s, k_s, loss, weights, backend="triton", **kw)
                out[f"{name}_calls"] = len(calls) - before
            os.environ.pop(hopper.ENV_SWITCH, None)
            ref = _student_grads(q_t.double(), k_t.double(), q_s.double(), k_s.double(), loss, weights.double(),
                                 backend="reference", **kw)
            row = dict(case=CHECKS[i], hopper_ran=out["hopper_calls"] == 1 and out["portable_calls"] == 0,
                       finite=bool(all(torch.isfinite(g).all() for g in out["hopper"])),
                       rel_dk_hopper_vs_ref=_rel(out["hopper"][1], ref[1]),
                       rel_dk_portable_vs_ref=_rel(out["portable"][1], ref[1]),
                       rel_dk_hopper_vs_portable=_rel(out["hopper"][1], out["portable"][1]),
                       dq_equal=bool(torch.equal(out["hopper"][0], out["portable"][0])))
            row["ok"] = bool(row["hopper_ran"] and row["finite"] and row["dq_equal"]
                             and row["rel_dk_hopper_vs_ref"] <= 1.5 * row["rel_dk_portable_vs_ref"] + 1e-6)
            rows.append(row)
            print(f"check {i}: {row}", flush=True)
    finally:
        module.attention_kl_key_pass_hopper = real
    return rows


def measure_shape(name, b, h, h_kt, n, d, causal, tune: bool) -> dict:
    import streamkl._hopper as hopper
    from streamkl import attention_kl
    from streamkl._hopper.backward import attention_kl_key_pass_hopper, hopper_key_pass_config
    from streamkl._problem import KLInputs, KLSpec
    from streamkl._triton.backward import attention_kl_bwd
    from streamkl._triton.configs import LaunchConfig
    from streamkl._triton.forward import attention_kl_fwd, new_dq_b_buffer

    q_t, k_t, q_s, k_s = _tensors(b, h, h_kt, h, n, n, d, d, torch.bfloat16, 1.0, "bhnd", 1)
    inputs = KLInputs(q_t, k_t, q_s, k_s, None, None, None, None, None, None)
    spec = KLSpec(d ** -0.5, d ** -0.5, window_right=0 if causal else -1)
    dq = new_dq_b_buffer(inputs)
    kl, lse_a, lse_b = attention_kl_fwd(inputs, spec, dq_b=dq)
    grad = torch.full((1,), 1.0 / kl.numel(), device="cuda").expand(kl.shape)  # reduction="mean"'s gradient
    row = dict(name=name, b=b, h=h, h_kt=h_kt, n=n, d=d, causal=causal,
               default_tile=list(vars(hopper_key_pass_config(d, d, causal)).values()))
    grads = {}
    for label, env in (("hopper", "all"), ("portable", "0")):
        os.environ[hopper.ENV_SWITCH] = env
        row[f"{label}_bwd_ms"] = _bench(
            lambda: attention_kl_bwd(grad, inputs, spec, kl, lse_a, lse_b, False, True, dq_b=dq))
        grads[label] = attention_kl_bwd(grad, inputs, spec, kl, lse_a, lse_b, False, True, dq_b=dq)[3]
    os.environ.pop(hopper.ENV_SWITCH, None)
    row["rel_dk_hopper_vs_portable"] = _rel(grads["hopper"], grads["portable"])
    if tune:
        row["tiles"] = []
        g1 = grad.as_strided((1,), (1,))
        for cand in CANDIDATES:
            cfg = LaunchConfig(*cand)
            try:
                ms = _bench(lambda cfg=cfg: attention_kl_key_pass_hopper(g1, inputs, spec, lse_a, lse_b, cfg))
                dk = attention_kl_key_pass_hopper(g1, inputs, spec, lse_a, lse_b, cfg)
                row["tiles"].append(dict(tile=list(cand), ms=ms, rel_vs_portable=_rel(dk, grads["portable"])))
            except Exception as exc:  # a tile that does not fit (shared memory) is reported, not fatal
                row["tiles"].append(dict(tile=list(cand), error=f"{type(exc).__name__}: {exc}"[:300]))
    # the op as users call it for training: forward + backward of the student's q and k, frozen teacher
    q_sg, k_sg = q_s.detach().requires_grad_(True), k_s.detach().requires_grad_(True)

    def step():
        loss = attention_kl(q_t, k_t, q_sg, k_sg, causal=causal)
        return torch.autograd.grad(loss, (q_sg, k_sg))

    for label, env in (("op_train_default_ms", None), ("op_train_portable_ms", "0")):
        if env is None:
            os.environ.pop(hopper.ENV_SWITCH, None)
            row["default_picks_hopper"] = hopper.hopper_key_pass(inputs, spec, False, True) is not None
        else:
            os.environ[hopper.ENV_SWITCH] = env
        row[label] = _bench(step)
    os.environ.pop(hopper.ENV_SWITCH, None)
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    sq = q_s.detach().requires_grad_(True)
    sk = k_s.detach().requires_grad_(True)
    v = torch.randn_like(k_s).requires_grad_(True)

    def attention_step():
        out = sdpa(sq, sk, v, is_causal=causal)
        return torch.autograd.grad(out, (sq, sk, v), torch.ones_like(out))

    row["cudnn_fwd_bwd_ms"] = _bench(attention_step)
    print(f"shape {name}: {row}", flush=True)
    return row


def launch_host_us(rounds: int = 9, calls: int = 200) -> dict:
    """Host time per launch (µs, median over interleaved rounds of ``calls`` back-to-back launches on a problem too
    small to keep the GPU busy) of the Hopper key pass and forward and of their portable counterparts."""
    from streamkl._hopper.backward import attention_kl_key_pass_hopper
    from streamkl._hopper.forward import attention_kl_fwd_hopper
    from streamkl._problem import KLInputs, KLSpec
    from streamkl._triton.backward import attention_kl_bwd
    from streamkl._triton.forward import attention_kl_fwd, new_dq_b_buffer

    q_t, k_t, q_s, k_s = _tensors(1, 4, 4, 4, 1024, 1024, 64, 64, torch.bfloat16, 1.0, "bhnd", 2)
    inputs = KLInputs(q_t, k_t, q_s, k_s, None, None, None, None, None, None)
    spec = KLSpec(0.125, 0.125, window_right=0)
    dq = new_dq_b_buffer(inputs)
    kl, lse_a, lse_b = attention_kl_fwd(inputs, spec, dq_b=dq)
    grad = torch.full((1,), 1.0 / kl.numel(), device="cuda")
    import streamkl._hopper as hopper

    def portable_key_pass():
        os.environ[hopper.ENV_SWITCH] = "0"
        attention_kl_bwd(grad.expand(kl.shape), inputs, spec, kl, lse_a, lse_b, False, True, dq_b=dq)

    def hopper_key_pass_call():
        os.environ[hopper.ENV_SWITCH] = "all"
        attention_kl_bwd(grad.expand(kl.shape), inputs, spec, kl, lse_a, lse_b, False, True, dq_b=dq)

    fns = {"hopper_key_pass_kernel": lambda: attention_kl_key_pass_hopper(grad, inputs, spec, lse_a, lse_b),
           "hopper_forward_kernel": lambda: attention_kl_fwd_hopper(inputs, spec),
           "portable_forward_kernel": lambda: attention_kl_fwd(inputs, spec),
           "bwd_portable_key_pass": portable_key_pass, "bwd_hopper_key_pass": hopper_key_pass_call}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # compile and fill the launch caches
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - t0) / calls * 1e6)
            torch.cuda.synchronize()
    os.environ.pop(hopper.ENV_SWITCH, None)
    return {name: sorted(v)[len(v) // 2] for name, v in samples.items()} | {"rounds": rounds, "calls": calls}


def bounds_ms(row: dict, ceilings: dict) -> dict:
    """The key pass's exp and matmul bounds (3 products, 2 exp2 per score element; causal: half the elements)."""
    e = row["b"] * row["h"] * row["n"] * row["n"] * (0.5 if row["causal"] else 1.0)
    exp_ms = 2 * e / ceilings["exp2_per_s"] * 1e3
    mm_ms = 3 * e * 2 * row["d"] / ceilings["bf16_matmul_flops"] * 1e3
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
    launch = launch_host_us()
    print(f"host time per launch (µs): {launch}", flush=True)
    return dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), ceilings=ceilings, checks=checks, shapes=shapes,
                launch_host_us=launch, seconds=time.time() - t0)


def table(data: dict) -> str:
    lines = ["| shape | key pass ms, portable → Hopper | Hopper / portable "
             "| % of the key pass bound, portable → Hopper | Hopper by default "
             "| training call ms, portable → default | default / portable "
             "| default / cuDNN fwd+bwd |",
             "|---|---|---|---|---|---|---|---|"]
    for r in data["shapes"]:
        lines.append(
            f"| {r['name']} | {r['portable_bwd_ms']:.3f} → {r['hopper_bwd_ms']:.3f} "
            f"| {r['hopper_bwd_ms'] / r['portable_bwd_ms']:.2f}× "
            f"| {100 * r['bound_ms'] / r['portable_bwd_ms']:.0f}% → {100 * r['bound_ms'] / r['hopper_bwd_ms']:.0f}% "
            f"| {'yes' if r['default_picks_hopper'] else 'no'} "
            f"| {r['op_train_portable_ms']:.3f} → {r['op_train_default_ms']:.3f} "
            f"| {r['op_train_default_ms'] / r['op_train_portable_ms']:.2f}× "
            f"| {r['op_train_default_ms'] / r['cudnn_fwd_bwd_ms']:.2f}× |")
    return "\n".join(lines)


def tiles_table(data: dict) -> str:
    return hopper_tiles_table(data, tile="queries × keys per step", timed="Hopper key pass ms")


def checks_table(data: dict) -> str:
    lines = ["| case (B, H, H_k teacher, H_k student, N_q, N_k, D_t, D_s, causal, loss, T, sharpness, layout) "
             "| dK_s Hopper vs float64 | portable vs float64 | Hopper vs portable | dQ_s equal |",
             "|---|---|---|---|---|"]
    for c in data["checks"]:
        lines.append(f"| {', '.join(str(x) for x in c['case'])} | {c['rel_dk_hopper_vs_ref']:.1e} "
                     f"| {c['rel_dk_portable_vs_ref']:.1e} | {c['rel_dk_hopper_vs_portable']:.1e} "
                     f"| {'yes' if c['dq_equal'] else 'no'} |")
    return "\n".join(lines)


def blocks(data: dict, tuning: dict) -> dict[str, str]:
    """The generated blocks of docs/perf-notes.md v10: name -> markdown (the tiles from the tuning run)."""
    return {"key-pass:tiles": tiles_table(tuning), "key-pass:op": table(data), "key-pass:checks": checks_table(data)}


def render(path: str, tuning_path: str = H100_TUNING, doc: str = DOC) -> None:
    render_results(doc, blocks, path, tuning_path)



def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="directory for <gpu>-hopper-key-pass.json")
    parser.add_argument("--tune", action="store_true", help="also time every candidate tile at N = 8192")
    parser.add_argument("--render", nargs="?", const=H100_RESULT,
                        help="write the tables of a results file into docs/perf-notes.md")
    args = parser.parse_args(argv)
    if args.render:
        render(args.render)
        return
    from bench_attention_kl import gpu_tag, write_json

    data = run(args.tune)
    out = os.path.join(args.out or os.path.join(HERE, "results"), f"{gpu_tag(data['device'])}-{RESULT_NAME}")
    write_json(out, data)
    print(checks_table(data))
    print(tiles_table(data))
    print(table(data))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
