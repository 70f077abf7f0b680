"""v19 (issue 14, not kept): the forwards form the score difference from the two exponents, against v18.

Every forward accumulates the coupled sum ``Σ p_a·(x·c_a − y·c_b)`` of the KL. v18 formed the difference from the raw
products (a multiply and a fused multiply-add per score element) and the exponents separately (a fused multiply-add
each); v19 forms it from the exponents, ``(e_a − e_b) + (m_a − m_b)``, one subtraction per element and the frames'
offset once per row (``_attention_kl_fwd_keys`` in ``kernels/streamkl/_triton/forward.py``, ``_fold_tile`` in
``_hopper/forward.py``, ``_fold_scores`` in ``_hopper/fused_forward.py``): one instruction fewer per score element.
v19 was measured and not kept (docs/perf-notes.md): the package runs v18's forwards again, and v19's lives in commit
b64b578, which ``--new`` takes a copy of (the committed run measured that commit's checkout, the default of
``--new``).

For each long-context shape (bf16, frozen teacher; ``bench_fused_dq.SHAPES`` without the host-bound BERT one), in one
process on one GPU, paired rounds with the order alternating, and the sign test on each pair:

* the fused training forward (the Gluon kernel, and the portable one), v19 against v18;
* the metric call (``attention_kl`` without grad) and the training call as users make it (``attention_kl(...)``, then
  the student's q and k gradients), v19 against v18, each with its package's default selection;
* cuDNN attention's forward and forward+backward on the student's shapes;
* exactness: whether the Gluon and portable fused forwards still give the same bits
  (``bench_ws_fused_forward.exactness``), and the per-row KL of the metric call against float64, v19 and v18, on
  ``bench_lazy_frames.CHECKS`` (random inputs; a student 0.2 % sharper than its teacher, KL ~1e-6 per row; a late key
  that moves every later row's frame).

    mkdir -p /tmp/v19 && git archive b64b578 kernels/streamkl | tar -x -C /tmp/v19 --strip-components=1
    PYTHONPATH=kernels:. python benchmarks/bench_exponent_difference.py --against <copy of v18's kernels/streamkl> \\
        --new /tmp/v19/streamkl --out benchmarks/results     # ~4 minutes on an H100
    PYTHONPATH=kernels:. python benchmarks/bench_exponent_difference.py --render   # tables into docs/perf-notes.md

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

from bench_lazy_frames import CHECKS as KL_CHECKS  # noqa: E402
from bench_lazy_frames import (  # noqa: E402
    ROUNDS,
    _rel,
    _tensors,
    metric_call,
    paired_cell,
    paired_labels,
    paired_rounds,
    training_step,
)
from bench_ws_fused_forward import SHAPES, exactness  # noqa: E402
from bench_ws_fused_forward import checks_table as ws_checks_table  # noqa: E402
from bench_ws_key_pass import _problem  # noqa: E402
from report import load_package, paired_run_main  # noqa: E402

RESULT_NAME = "exponent-difference.json"
DOC = os.path.join(HERE, "..", "docs", "perf-notes.md")
H100_RESULT = os.path.join(HERE, "results", f"nvidia-h100-80gb-hbm3-{RESULT_NAME}")
#: what each round times, in pairs (label of the new side, label of the previous side)
PAIRS = {
    "Gluon fused fwd": ("Gluon fused fwd v19", "Gluon fused fwd v18"),
    "portable fused fwd": ("portable fused fwd v19", "portable fused fwd v18"),
    "metric call": ("metric call v19", "metric call v18"),
    "training call": ("training call v19", "training call v18"),
}


def pair(row: dict, what: str) -> dict:
    """The paired comparison (``bench_lazy_frames.paired_labels``) of the two sides of ``PAIRS[what]``."""
    return paired_labels(row, *PAIRS[what])


def kl_error(module, name, b, h, n, d, causal, kind) -> float:
    """Relative L2 error of the per-row KL of ``module``'s metric call (bf16 inputs) against float64 on the same
    bf16-rounded inputs."""
    import streamkl

    q_t, k_t, q_s, k_s, scale_s = _tensors(b, h, n, d, kind)
    kw = dict(causal=causal, scale_t=d**-0.5, scale_s=scale_s, reduction="none")
    x = [t.cuda().bfloat16() for t in (q_t, k_t, q_s, k_s)]
    with torch.no_grad():
        kl = module.attention_kl(*x, **kw)
        ref = streamkl.attention_kl(*(t.double() for t in x), backend="reference", **kw)
    return _rel(kl, ref)


def kl_exactness(base, new) -> list[dict]:
    """:func:`kl_error` of ``new`` and of ``base`` on each of ``bench_lazy_frames.CHECKS``."""
    rows = []
    for case in KL_CHECKS:
        errs = {label: kl_error(module, *case) for label, module in (("new", new), ("previous", base))}
        rows.append(dict(case=list(case), **errs))
        print(f"KL check {case[0]}: {errs}", flush=True)
    return rows


def _fused_forwards(package):
    """``(Gluon, portable)`` fused training forwards of ``package``."""
    return (importlib.import_module(f"{package.__name__}._hopper.fused_forward").attention_kl_fused_fwd_hopper,
            importlib.import_module(f"{package.__name__}._triton.forward").attention_kl_fwd)


def measure_shape(base, new, name, b, h, h_kt, n, d, causal) -> dict:
    """One shape's row: the paired rounds of every call of :data:`PAIRS` and cuDNN's forward and forward+backward."""
    import streamkl
    from streamkl._triton.forward import new_dq_b_buffer

    new_gluon, new_portable = _fused_forwards(new)
    previous_gluon, previous_portable = _fused_forwards(base)
    inputs, spec, *_ = _problem(streamkl, b, h, h_kt, h, n, n, d, d, causal, 1.0, "bhnd", 1)
    buf = new_dq_b_buffer(inputs)
    q_t, k_t, q_s, k_s = inputs.q_a, inputs.k_a, inputs.q_b.detach().requires_grad_(True), \
        inputs.k_b.detach().requires_grad_(True)

    def train(module):
        return training_step(module, q_t, k_t, q_s, k_s, causal)

    def metric(module):
        return metric_call(module, q_t, k_t, q_s, k_s, causal)

    calls = {
        "Gluon fused fwd v19": lambda: new_gluon(inputs, spec, buf),
        "Gluon fused fwd v18": lambda: previous_gluon(inputs, spec, buf),
        "portable fused fwd v19": lambda: new_portable(inputs, spec, dq_b=buf),
        "portable fused fwd v18": lambda: previous_portable(inputs, spec, dq_b=buf),
        "metric call v19": metric(new),
        "metric call v18": metric(base),
        "training call v19": train(new),
        "training call v18": train(base),
    }
    return paired_rounds(calls, name, b, h, h_kt, n, d, causal)


def run(against: str, new_path: str | None = None) -> dict:
    """Measure v19 (``new_path``, a copy of its ``kernels/streamkl``; default this checkout's package) against the copy
    of v18 at ``against``."""
    import streamkl

    torch.backends.cuda.matmul.allow_tf32 = False
    base = load_package(os.path.abspath(against), "streamkl_base")
    new = load_package(os.path.abspath(new_path), "streamkl_new") if new_path else streamkl
    data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "host": platform.node(), "rounds": ROUNDS}
    data["checks"] = exactness(new)
    data["kl_checks"] = kl_exactness(base, new)
    data["rows"] = [measure_shape(base, new, *shape) for shape in SHAPES]
    return data


def kernel_table(data: dict) -> str:
    """The fused training forward, both kernels, v19 against v18."""
    lines = ["| shape | Gluon fused fwd ms, v18 → v19 | v19 / v18 (wins, sign test p) | portable fused fwd ms, v18 → "
             "v19 | v19 / v18 (wins, p) |", "|---|---|---|---|---|"]
    for row in data["rows"]:
        g, p = pair(row, "Gluon fused fwd"), pair(row, "portable fused fwd")
        lines.append(f"| {row['shape']['name']} | {g['previous']:.3f} → {g['new']:.3f} | {paired_cell(g)} | "
                     f"{p['previous']:.3f} → {p['new']:.3f} | {paired_cell(p)} |")
    return "\n".join(lines)


def op_table(data: dict) -> str:
    """The calls users make, v19 against v18, and the ratios to cuDNN attention in the same run."""
    lines = ["| shape | metric call ms, v18 → v19 | v19 / v18 (wins, p) | training call ms, v18 → v19 | v19 / v18 "
             "(wins, p) | metric / cuDNN fwd, v18 → v19 | training call / cuDNN fwd+bwd, v18 → v19 |",
             "|---|---|---|---|---|---|---|"]
    for row in data["rows"]:
        m, t = pair(row, "metric call"), pair(row, "training call")
        fwd, fwd_bwd = row["cudnn_fwd_ms"], row["cudnn_fwd_bwd_ms"]
        lines.append(f"| {row['shape']['name']} | {m['previous']:.3f} → {m['new']:.3f} | {paired_cell(m)} | "
                     f"{t['previous']:.3f} → {t['new']:.3f} | {paired_cell(t)} | {m['previous'] / fwd:.2f}× → "
                     f"{m['new'] / fwd:.2f}× | {t['previous'] / fwd_bwd:.2f}× → {t['new'] / fwd_bwd:.2f}× |")
    return "\n".join(lines)


def kl_checks_table(data: dict) -> str:
    """The per-row KL of the metric call against float64, v19 and v18."""
    lines = ["| case (B, H, N, D, causal, inputs) | KL v19 vs float64 | KL v18 vs float64 |", "|---|---|---|"]
    for c in data["kl_checks"]:
        _, b, h, n, d, causal, kind = c["case"]
        lines.append(f"| {b}, {h}, {n}, {d}, {causal}, {kind} | {c['new']:.1e} | {c['previous']:.1e} |")
    return "\n".join(lines)


def blocks(data: dict, _tuning=None) -> dict[str, str]:
    """The generated blocks of docs/perf-notes.md v19: name -> markdown."""
    return {"exp-diff:kernel": kernel_table(data), "exp-diff:op": op_table(data),
            "exp-diff:checks": ws_checks_table(data), "exp-diff:kl": kl_checks_table(data)}


def main(argv: list[str] | None = None) -> None:
    paired_run_main(argv, __doc__, run, blocks, RESULT_NAME, H100_RESULT, DOC,
                    extra=("--new", "a copy of v19's kernels/streamkl (default: this checkout's package)"))


if __name__ == "__main__":
    main()
