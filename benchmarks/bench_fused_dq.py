"""v6 (issue 14): the student's query gradient accumulated in the forward, measured on one GPU in one run.

With a frozen teacher (the default ``direction="forward"``), ``dQ_s = g·scale_s·Σ_j (P_s − P_t)_ij k_s,j`` is
accumulated by the forward (two more products per key tile), so the backward runs only its key pass. For each shape
(bf16), in the same run:

* kernel level: the forward alone; the fused forward for every candidate tile (``FUSED_CANDIDATES``, the
  spill-free and nearly spill-free ones of ``benchmarks/kernel_resources.py --sweep-forward --fused-dq``) and with
  the default tile; the two-pass backward (key pass + query pass, the previous default) and the fused backward (key
  pass + one scaling kernel); both forward+backward totals;
* the op as users call it (``attention_kl(...)`` with ``reduction="mean"``, then ``torch.autograd.grad`` for the
  student's q and k): forward+backward through the fused path (the default now) and through the previous design
  (selected for this measurement by patching ``streamkl.autograd.fuses_dq_b``), and the forward alone;
* torch SDPA (cuDNN, the default backend on H100, and FLASH_ATTENTION): forward, forward+backward;
* agreement: the relative L2 difference of both designs' gradients.

    PYTHONPATH=kernels:. python benchmarks/bench_fused_dq.py --out benchmarks/results   # ~3 minutes on an H100
    PYTHONPATH=kernels:. python benchmarks/bench_fused_dq.py --tune --out DIR  # + every candidate tile (the tuning run)
    PYTHONPATH=kernels:. python benchmarks/bench_fused_dq.py --render                  # tables into docs/perf-notes.md

Timing assertions never go into tests; the numbers here are ratios measured in one run.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from dataclasses import asdict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from report import render_results  # noqa: E402

#: (block_m, block_n, warps, stages) of the fused forward timed per head dim
FUSED_CANDIDATES = {
    64: [(64, 32, 4, 3), (128, 32, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2), (128, 64, 8, 3), (128, 64, 8, 2)],
    128: [(64, 32, 4, 3), (128, 32, 8, 3), (64, 64, 4, 2), (128, 64, 8, 3), (128, 64, 8, 2)],
}
#: (name, B, H, teacher key heads, N, D, causal): the issue's shapes
SHAPES = [
    ("N8192-D64", 1, 16, 16, 8192, 64, False),
    ("N8192-D64-causal", 1, 16, 16, 8192, 64, True),
    ("N8192-D128", 1, 16, 16, 8192, 128, False),
    ("N8192-D128-causal", 1, 16, 16, 8192, 128, True),
    ("N16384-D128-H32-GQA8-causal", 1, 32, 8, 16384, 128, True),
    ("BERT-B8-H12-N512-D64", 8, 12, 12, 512, 64, False),
]
RESULT_NAME = "fused-dq.json"
DOC = os.path.join(HERE, "..", "docs", "perf-notes.md")
H100_RESULT = os.path.join(HERE, "results", f"nvidia-h100-80gb-hbm3-{RESULT_NAME}")
H100_TUNING = os.path.join(HERE, "results", "runs", "nvidia-h100-80gb-hbm3-fused-dq-tuning.json")


def _bench(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def measure_shape(name, b, h, h_kt, n, d, causal, tune: bool) -> dict:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import streamkl.autograd as autograd_mod
    from streamkl import attention_kl
    from streamkl._triton.backward import attention_kl_bwd
    from streamkl._triton.configs import LaunchConfig, forward_config
    from streamkl._triton.forward import attention_kl_fwd, new_dq_b_buffer
    from streamkl._validation import prepare_problem

    dt = torch.bfloat16
    q_t = torch.randn(b, h, n, d, device="cuda", dtype=dt)
    k_t = torch.randn(b, h_kt, n, d, device="cuda", dtype=dt)
    q_s = torch.randn(b, h, n, d, device="cuda", dtype=dt, requires_grad=True)
    k_s = torch.randn(b, h, n, d, device="cuda", dtype=dt, requires_grad=True)
    row = {"shape": dict(name=name, b=b, h=h, h_kt=h_kt, n=n, d=d, causal=causal, dtype="bfloat16")}

    # kernel level (a scalar upstream gradient, as reduction="mean" hands it over)
    problem = prepare_problem(q_t, k_t, q_s.detach(), k_s.detach(), causal=causal, reduction="mean")
    inputs, spec = problem.kernel_problem()
    kl, la, lb = attention_kl_fwd(inputs, spec)
    g = torch.full((), 1.0 / kl.numel(), device="cuda").expand(kl.shape)
    buf = new_dq_b_buffer(inputs)
    default = forward_config(d, d, causal, 2, fused_dq=True)
    ms = {"kernel fwd": _bench(lambda: attention_kl_fwd(inputs, spec)),
          "kernel fused fwd": _bench(lambda: attention_kl_fwd(inputs, spec, dq_b=buf)),
          "kernel bwd two-pass": _bench(lambda: attention_kl_bwd(g, inputs, spec, kl, la, lb, False, True)),
          "kernel bwd fused": _bench(lambda: attention_kl_bwd(g, inputs, spec, kl, la, lb, False, True, dq_b=buf))}
    row["fused_default_tile"] = asdict(default)
    if tune:
        tiles = []
        for bm, bn, w, s in FUSED_CANDIDATES[d]:
            cfg = LaunchConfig(bm, bn, w, s)
            try:
                t = _bench(lambda cfg=cfg: attention_kl_fwd(inputs, spec, config=cfg, dq_b=buf))
            except Exception as exc:  # a tile that does not compile or fit is recorded, not fatal
                t = f"error: {type(exc).__name__}: {exc}"[:200]
            tiles.append({"tile": asdict(cfg), "ms": t})
            print(f"  {name} fused fwd {cfg}: {t}", flush=True)
        row["fused_tiles"] = tiles
    # agreement of the two designs (kernel level)
    _, _, dq_two, dk_two = attention_kl_bwd(g, inputs, spec, kl, la, lb, False, True)
    attention_kl_fwd(inputs, spec, dq_b=buf)
    _, _, dq_f, dk_f = attention_kl_bwd(g, inputs, spec, kl, la, lb, False, True, dq_b=buf)
    row["agreement"] = {"dq rel L2": _rel(dq_f, dq_two), "dk rel L2": _rel(dk_f, dk_two)}

    # the op as users call it
    def op():
        return attention_kl(q_t, k_t, q_s, k_s, causal=causal, backend="triton")

    def op_fwd_bwd():
        torch.autograd.grad(op(), (q_s, k_s))

    with torch.no_grad():
        ms["op fwd"] = _bench(op)
    ms["op fwd+bwd fused"] = _bench(op_fwd_bwd)
    original = autograd_mod.fuses_dq_b
    autograd_mod.fuses_dq_b = lambda *args: False
    try:
        ms["op fwd+bwd two-pass"] = _bench(op_fwd_bwd)
    finally:
        autograd_mod.fuses_dq_b = original

    # SDPA on the student's shapes (one softmax)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(b, h, n, d, device="cuda", dtype=dt)
    for label, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        def attn(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        try:
            with torch.no_grad():
                ms[f"sdpa-{label} fwd"] = _bench(attn)
            ms[f"sdpa-{label} fwd+bwd"] = _bench(lambda attn=attn: torch.autograd.grad(attn(), (q, k, v), grad_out))
        except Exception as exc:
            row.setdefault("errors", {})[label] = f"{type(exc).__name__}: {exc}"[:200]
    row["ms"] = ms
    print(f"{name}: " + ", ".join(f"{k} {v:.3f}" for k, v in ms.items()), flush=True)
    print(f"  agreement {row['agreement']}", flush=True)
    return row


def run(tune: bool) -> dict:
    from bench_attention_kl import measure_ceilings

    torch.backends.cuda.matmul.allow_tf32 = False
    ceilings = measure_ceilings()
    rows = [measure_shape(*shape, tune=tune and shape[0].startswith("N8192")) for shape in SHAPES]
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "host": platform.node(), "ceilings": ceilings, "rows": rows}


def bounds_ms(shape: dict, ceilings: dict) -> dict:
    """exp- and matmul-bound ms of forward+backward for each design (student gradients, frozen teacher)."""
    e = shape["b"] * shape["h"] * shape["n"] * shape["n"]
    if shape["causal"]:
        e = e * (shape["n"] + 1) / (2 * shape["n"])
    flop_per_product = 2 * shape["d"]
    out = {}
    for design, products, exps in (("two-pass", 8, 6), ("fused", 7, 4)):
        exp_ms = exps * e / ceilings["exp2_per_s"] * 1e3
        mm_ms = products * flop_per_product * e / ceilings["bf16_matmul_flops"] * 1e3
        out[design] = max(exp_ms, mm_ms)
    return out


def table(data: dict) -> str:
    """The perf-notes v6 table: one row per shape, ratios from the same run."""
    lines = ["| shape | fwd+bwd ms, two-pass → fused | fused / two-pass | fused fwd+bwd / cuDNN | fwd / cuDNN fwd "
             "| fused, % of its bound |",
             "|---|---|---|---|---|---|"]
    for row in data["rows"]:
        ms, s = row["ms"], row["shape"]
        old, new = ms["op fwd+bwd two-pass"], ms["op fwd+bwd fused"]
        cudnn = ms.get("sdpa-cudnn fwd+bwd")
        cudnn_f = ms.get("sdpa-cudnn fwd")
        bound = bounds_ms(s, data["ceilings"])["fused"]
        lines.append(f"| {s['name']} | {old:.3f} → {new:.3f} | {new / old:.2f}× | "
                     f"{new / cudnn:.2f}× | {ms['op fwd'] / cudnn_f:.2f}× | {100 * bound / new:.0f}% |")
    return "\n".join(lines)


def kernel_table(data: dict) -> str:
    """Kernel-level split of the same run: where the time went."""
    lines = ["| shape | fwd | fused fwd | bwd, two-pass | bwd, fused | fwd+bwd, two-pass → fused |",
             "|---|---|---|---|---|---|"]
    for row in data["rows"]:
        ms = row["ms"]
        old = ms["kernel fwd"] + ms["kernel bwd two-pass"]
        new = ms["kernel fused fwd"] + ms["kernel bwd fused"]
        lines.append(f"| {row['shape']['name']} | {ms['kernel fwd']:.3f} | {ms['kernel fused fwd']:.3f} | "
                     f"{ms['kernel bwd two-pass']:.3f} | {ms['kernel bwd fused']:.3f} | {old:.3f} → {new:.3f} |")
    return "\n".join(lines)


def tiles_table(tuning: dict) -> str:
    """Every candidate tile of the fused forward in the tuning run, fastest first per shape."""
    lines = ["| shape | tile (block_m×block_n, warps, stages) | fused fwd ms |", "|---|---|---|"]
    for row in tuning["rows"]:
        for t in sorted((t for t in row.get("fused_tiles", []) if isinstance(t["ms"], float)), key=lambda t: t["ms"]):
            c = t["tile"]
            lines.append(f"| {row['shape']['name']} | {c['block_m']}×{c['block_n']}, {c['num_warps']}, "
                         f"{c['num_stages']} | {t['ms']:.3f} |")
    return "\n".join(lines)


def blocks(data: dict, tuning: dict) -> dict[str, str]:
    """The generated blocks of docs/perf-notes.md v6: name -> markdown."""
    return {"fused-dq:tiles": tiles_table(tuning), "fused-dq:op": table(data), "fused-dq:kernels": kernel_table(data)}


def render(path: str, tuning_path: str = H100_TUNING, doc: str = DOC) -> None:
    render_results(doc, blocks, path, tuning_path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="directory for <gpu>-fused-dq.json")
    parser.add_argument("--tune", action="store_true", help="also time every candidate tile of the fused forward")
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
    print(table(data))
    print(kernel_table(data))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
