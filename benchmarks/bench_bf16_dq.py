"""v15 (issue 14): the frozen teacher's forward writes its saved query gradient as bf16 itself, against v14, in one run.

Up to v14 the training forward with a frozen teacher filled an fp32 buffer with the student's query gradient and, for
bf16 inputs from ``NARROW_DQ_MIN_BYTES`` up, narrowed it to bf16 with a separate copy kernel (v9). v15 allocates the
buffer in the saved dtype and rounds in the kernel's epilogue, to nearest even as the copy did
(``_to_bf16_nearest_even``), so the copy kernel and the fp32 buffer are gone and the gradients stay bitwise the same.
For each shape of ``bench_fused_dq.SHAPES`` (bf16), in one process on one GPU:

* paired rounds, the order alternating, of both versions' fused forward kernel and of the training call as users make
  it (``attention_kl(...)`` with a frozen teacher, then the student's q and k gradients), with the sign test
  (``bench_lazy_frames.measure_shape``), and cuDNN attention's forward+backward;
* the memory the training forward allocates above its inputs at its peak, and the whole training call's, in each
  version;
* exactness: the student's query gradient of both versions against float64 (``bench_lazy_frames.CHECKS``), and
  whether both versions' query and key gradients are bitwise equal, on those cases with the narrowing forced on
  (``NARROW_DQ_MIN_BYTES = 0`` in both packages) and at the N = 8192 shapes, where it applies by default.

    PYTHONPATH=kernels:. python benchmarks/bench_bf16_dq.py --against <copy of v14's kernels/streamkl> \\
        --out benchmarks/results     # ~4 minutes on an H100
    PYTHONPATH=kernels:. python benchmarks/bench_bf16_dq.py --render   # tables into docs/perf-notes.md

Timing assertions never go into tests; the numbers here are ratios measured in one run.
"""

from __future__ import annotations

import importlib
import os
import platform
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_fused_dq import SHAPES  # noqa: E402
from bench_lazy_frames import CHECKS, ROUNDS, _rel, _tensors, measure_shape, op_table  # noqa: E402
from report import load_package, paired_run_main  # noqa: E402

RESULT_NAME = "bf16-dq.json"
DOC = os.path.join(HERE, "..", "docs", "perf-notes.md")
H100_RESULT = os.path.join(HERE, "results", f"nvidia-h100-80gb-hbm3-{RESULT_NAME}")
MIB = float(1 << 20)


def _training_inputs(b, h, h_kt, n, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q_t = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k_t = torch.randn(b, h_kt, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    q_s, k_s = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
                for _ in range(2))
    return q_t, k_t, q_s, k_s


def peak_mib(module, b, h, h_kt, n, d, causal) -> dict:
    """MiB allocated above the inputs at the peak of ``module``'s training forward, and of the whole training call."""
    q_t, k_t, q_s, k_s = _training_inputs(b, h, h_kt, n, d)
    torch.autograd.grad(module.attention_kl(q_t, k_t, q_s, k_s, causal=causal), (q_s, k_s))  # compile, warm
    out = {}
    for what in ("forward", "training call"):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = module.attention_kl(q_t, k_t, q_s, k_s, causal=causal)
        if what == "training call":
            torch.autograd.grad(loss, (q_s, k_s))
        torch.cuda.synchronize()
        out[what] = (torch.cuda.max_memory_allocated() - base) / MIB
        del loss
    return out


def _gradients(module, q_t, k_t, q_s, k_s, causal, scale_s):
    qs, ks = q_s.detach().requires_grad_(True), k_s.detach().requires_grad_(True)
    loss = module.attention_kl(q_t, k_t, qs, ks, causal=causal, scale_t=q_t.shape[-1] ** -0.5, scale_s=scale_s)
    return torch.autograd.grad(loss, (qs, ks))


def exactness(base) -> list[dict]:
    """``bench_lazy_frames.CHECKS`` with the narrowing forced on in both packages, and the N = 8192 shapes by default:
    relative error of each version's query gradient against float64 (checks only) and whether both versions' query
    and key gradients are bitwise equal."""
    import streamkl

    packages = {"new": streamkl, "previous": base}
    forwards = {label: importlib.import_module(f"{m.__name__}._triton.forward") for label, m in packages.items()}
    rows = []
    cases = [("forced", *c) for c in CHECKS] + [("default", s[0], s[1], s[2], s[4], s[5], s[6], "random")
                                                for s in SHAPES if s[0].startswith("N8192")]
    for narrowing, name, b, h, n, d, causal, kind in cases:
        q_t, k_t, q_s, k_s, scale_s = _tensors(b, h, n, d, kind)
        q_t, k_t, q_s, k_s = (x.cuda().bfloat16() for x in (q_t, k_t, q_s, k_s))
        saved = {label: f.NARROW_DQ_MIN_BYTES for label, f in forwards.items()}
        try:
            if narrowing == "forced":
                for f in forwards.values():
                    f.NARROW_DQ_MIN_BYTES = 0
            grads = {label: _gradients(m, q_t, k_t, q_s, k_s, causal, scale_s) for label, m in packages.items()}
        finally:
            for label, f in forwards.items():
                f.NARROW_DQ_MIN_BYTES = saved[label]
        row = dict(case=[name, b, h, n, d, causal, kind], narrowing=narrowing,
                   bitwise_equal=all(torch.equal(a, c) for a, c in zip(grads["new"], grads["previous"])),
                   finite=all(bool(torch.isfinite(x).all()) for x in grads["new"]))
        if narrowing == "forced":
            ref_q = q_s.detach().double().requires_grad_(True)
            loss = streamkl.attention_kl(q_t.double(), k_t.double(), ref_q, k_s.double(), causal=causal,
                                         scale_t=d ** -0.5, scale_s=scale_s, backend="reference")
            (ref,) = torch.autograd.grad(loss, (ref_q,))
            row.update(new=_rel(grads["new"][0], ref), previous=_rel(grads["previous"][0], ref))
        rows.append(row)
        print(f"check {row}", flush=True)
    return rows


def run(against: str) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    base = load_package(os.path.abspath(against), "streamkl_base")
    import streamkl

    data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "host": platform.node(), "rounds": ROUNDS}
    data["checks"] = exactness(base)
    data["rows"] = []
    for shape in SHAPES:
        row = measure_shape(base, *shape)
        name, b, h, h_kt, n, d, causal = shape
        row["peak_mib"] = {label: peak_mib(m, b, h, h_kt, n, d, causal)
                           for label, m in (("new", streamkl), ("previous", base))}
        print(f"{name}: peak MiB {row['peak_mib']}", flush=True)
        data["rows"].append(row)
    return data


def memory_table(data: dict) -> str:
    lines = ["| shape | training forward, MiB above its inputs at the peak, v14 → v15 | training call, v14 → v15 |",
             "|---|---|---|"]
    for row in data["rows"]:
        new, old = row["peak_mib"]["new"], row["peak_mib"]["previous"]
        lines.append(f"| {row['shape']['name']} | {old['forward']:.1f} → {new['forward']:.1f} | "
                     f"{old['training call']:.1f} → {new['training call']:.1f} |")
    return "\n".join(lines)


def checks_table(data: dict) -> str:
    lines = ["| case (B, H, N, D, causal, inputs) | bf16 query gradient | dQ_s v15 vs float64 | dQ_s v14 vs float64 | "
             "dQ_s and dK_s bitwise equal |",
             "|---|---|---|---|---|"]
    for c in data["checks"]:
        _, b, h, n, d, causal, kind = c["case"]
        errs = (f"{c['new']:.1e} | {c['previous']:.1e}" if "new" in c else "– | –")
        lines.append(f"| {b}, {h}, {n}, {d}, {causal}, {kind} | {c['narrowing']} | {errs} | "
                     f"{'yes' if c['bitwise_equal'] else 'no'} |")
    return "\n".join(lines)


def blocks(data: dict, _tuning=None) -> dict[str, str]:
    """The generated blocks of docs/perf-notes.md v15: name -> markdown."""
    return {"bf16-dq:op": op_table(data, "v14", "v15"), "bf16-dq:memory": memory_table(data),
            "bf16-dq:checks": checks_table(data)}


def main(argv: list[str] | None = None) -> None:
    paired_run_main(argv, __doc__, run, blocks, RESULT_NAME, H100_RESULT, DOC)

if __name__ == "__main__":
    main()
