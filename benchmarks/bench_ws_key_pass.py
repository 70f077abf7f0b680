"""v13 (issue 14): the warp-specialised Hopper key pass against v12's one-warpgroup key pass, in one run.

v13 adds a second Gluon kernel for the frozen teacher's key pass (``kernels/streamkl/_hopper/key_pass_ws.py``): a
producer warp streams both sides' query tiles into a shared ring and two consumer warpgroups, each with its own 64
keys, take turns issuing their products on the tensor cores (FlashAttention-3's ping-pong), with 240 registers each
(``setmaxnreg``). It runs where it measured faster: with a causal mask.

For each long-context shape of ``bench_hopper_key_pass.SHAPES`` (bf16, frozen teacher), in one process on one GPU:

* the warp-specialised kernel's tiles, each timed once (causal shapes);
* paired rounds, the order alternating: v12's key pass (a copy of v12's package, ``--against``) against v13's
  default key pass, and against the warp-specialised kernel forced (for the non-causal shapes, where v13 keeps v12's
  kernel, this is the measurement behind that choice); the training call as users make it
  (``attention_kl(...)``, then the student's q and k gradients) through both packages; the sign test on each;
* cuDNN attention's forward+backward on the student's shapes;
* exactness (``bench_hopper_key_pass.CHECKS``, in scope): the warp-specialised kernel's key gradient against float64
  and against the one-warpgroup kernel, with a scalar and a per-row upstream gradient.

    PYTHONPATH=kernels:. python benchmarks/bench_ws_key_pass.py --against <copy of v12's kernels/streamkl> \\
        --out benchmarks/results     # ~4 minutes on an H100
    PYTHONPATH=kernels:. python benchmarks/bench_ws_key_pass.py --render   # tables into docs/perf-notes.md

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

from bench_fused_dq import _rel  # noqa: E402
from bench_hopper import _tensors  # noqa: E402
from bench_hopper import tiles_table as hopper_tiles_table  # noqa: E402
from bench_hopper_key_pass import CHECKS  # noqa: E402
from bench_hopper_key_pass import SHAPES as KEY_PASS_SHAPES  # noqa: E402
from bench_lazy_frames import ROUNDS, _bench, paired, paired_cell  # noqa: E402
from report import load_package, paired_run_main  # noqa: E402

RESULT_NAME = "ws-key-pass.json"
DOC = os.path.join(HERE, "..", "docs", "perf-notes.md")
H100_RESULT = os.path.join(HERE, "results", f"nvidia-h100-80gb-hbm3-{RESULT_NAME}")
SHAPES = [s for s in KEY_PASS_SHAPES if not s[0].startswith("BERT")]
#: (block_m, block_n, warps per consumer, ring stages) of the warp-specialised kernel timed on the causal shapes
CANDIDATES = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4), (128, 64, 4, 2)]


def _problem(module, b, h, h_kt, h_ks, n_q, n_k, d_t, d_s, causal, sharpness, layout, seed):
    """Inputs, spec and the forward's outputs (kl, lse_a, lse_b) through ``module``'s kernels."""
    problem = importlib.import_module(f"{module.__name__}._problem")
    forward = importlib.import_module(f"{module.__name__}._triton.forward")
    q_t, k_t, q_s, k_s = _tensors(b, h, h_kt, h_ks, n_q, n_k, d_t, d_s, torch.bfloat16, sharpness, layout, seed)
    if layout == "bnhd":  # the kernels' (B, H, N, D) views of (B, N, H, D) tensors
        q_t, k_t, q_s, k_s = (x.transpose(1, 2) for x in (q_t, k_t, q_s, k_s))
    inputs = problem.KLInputs(q_t, k_t, q_s, k_s, None, None, None, None, None, None)
    spec = problem.KLSpec(d_t ** -0.5, d_s ** -0.5, window_right=0 if causal else -1)
    return (inputs, spec, *forward.attention_kl_fwd(inputs, spec, dq_b=forward.new_dq_b_buffer(inputs)))


def measure_shape(base, name, b, h, h_kt, n, d, causal, candidates=CANDIDATES, specialised: bool = True) -> dict:
    """One shape's row: the ``candidates`` tiles of the kernel ``specialised`` picks (causal shapes), the paired rounds
    of both packages' default key pass, of that kernel forced, and of the training call, and cuDNN's
    forward+backward."""
    import streamkl
    from streamkl._hopper.backward import attention_kl_key_pass_hopper, warp_specialised
    from streamkl._triton.configs import LaunchConfig

    base_pass = importlib.import_module(f"{base.__name__}._hopper.backward").attention_kl_key_pass_hopper
    inputs, spec, kl, lse_a, lse_b = _problem(streamkl, b, h, h_kt, h, n, n, d, d, causal, 1.0, "bhnd", 1)
    g = torch.full((1,), 1.0 / kl.numel(), device="cuda")  # reduction="mean"'s gradient, as the backward passes it
    row = {"shape": dict(name=name, b=b, h=h, h_kt=h_kt, n=n, d=d, causal=causal, dtype="bfloat16"),
           "default_is_warp_specialised": warp_specialised(spec, d, d)}
    if causal:
        row["tiles"] = []
        for cand in candidates:
            cfg = LaunchConfig(*cand)
            row["tiles"].append(dict(tile=list(cand), ms=_bench(
                lambda cfg=cfg: attention_kl_key_pass_hopper(g, inputs, spec, lse_a, lse_b, cfg,
                                                             specialised=specialised))))
    q_t, k_t, q_s, k_s = inputs.q_a, inputs.k_a, inputs.q_b.detach().requires_grad_(True), \
        inputs.k_b.detach().requires_grad_(True)

    def train(module):
        def step():
            loss = module.attention_kl(q_t, k_t, q_s, k_s, causal=causal)
            return torch.autograd.grad(loss, (q_s, k_s))
        return step

    calls = {
        "key pass new": lambda: attention_kl_key_pass_hopper(g, inputs, spec, lse_a, lse_b),
        "key pass previous": lambda: base_pass(g, inputs, spec, lse_a, lse_b),
        "forced key pass new": lambda: attention_kl_key_pass_hopper(g, inputs, spec, lse_a, lse_b,
                                                                    specialised=specialised),
        "forced key pass previous": lambda: base_pass(g, inputs, spec, lse_a, lse_b),
        "training call new": train(streamkl),
        "training call previous": train(base),
    }
    times = {label: [] for label in calls}
    for r in range(ROUNDS):
        for what in ("key pass", "forced key pass", "training call"):
            for label in (("new", "previous") if r % 2 == 0 else ("previous", "new")):
                times[f"{what} {label}"].append(_bench(calls[f"{what} {label}"]))
    row["ms"] = times
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    sq, sk, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def attention_step():
        out = sdpa(sq, sk, v, is_causal=causal)
        return torch.autograd.grad(out, (sq, sk, v), torch.ones_like(out))

    row["cudnn_fwd_bwd_ms"] = _bench(attention_step)
    print(f"{name}: " + ", ".join(f"{k} {statistics.median(t):.3f}" for k, t in times.items())
          + f", cuDNN fwd+bwd {row['cudnn_fwd_bwd_ms']:.3f}", flush=True)
    return row


def compare_key_passes(first, second, names: tuple[str, str]) -> list[dict]:
    """:data:`CHECKS` in the kernels' scope: two key passes' student key gradients (``first`` and ``second``, functions
    of ``(g, inputs, spec, lse_a, lse_b)``) against float64 and whether they are bitwise equal, for
    ``reduction="mean"``'s scalar gradient and a random per-row one; ``names`` label their errors
    (``rel_<name>_vs_ref``)."""
    import streamkl
    from streamkl import attention_kl
    from streamkl._hopper.backward import in_scope

    rows = []
    for i, case in enumerate(CHECKS):
        b, h, hk_t, hk_s, n_q, n_k, d_t, d_s, causal, _loss, _temp, sharpness, layout = case
        inputs, spec, kl, lse_a, lse_b = _problem(streamkl, b, h, hk_t, hk_s, n_q, n_k, d_t, d_s, causal, sharpness,
                                                  layout, i)
        if not in_scope(inputs, spec, False, True):
            continue
        for grad in ("scalar", "per row"):
            if grad == "scalar":
                g = torch.full((1,), 1.0 / kl.numel(), device="cuda")
            else:
                g = torch.rand(kl.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(i))
            one, two = first(g, inputs, spec, lse_a, lse_b), second(g, inputs, spec, lse_a, lse_b)
            k_s = inputs.k_b.double().requires_grad_(True)
            per_row = attention_kl(inputs.q_a.double(), inputs.k_a.double(), inputs.q_b.double(), k_s,
                                   reduction="none", causal=causal, backend="reference")
            ref = torch.autograd.grad((per_row * g.double().expand(kl.shape)).sum(), k_s)[0]
            row = {"case": list(case[:9]) + [layout], "grad": grad, f"rel_{names[0]}_vs_ref": _rel(one, ref),
                   f"rel_{names[1]}_vs_ref": _rel(two, ref), "bitwise_equal": bool(torch.equal(one, two)),
                   "finite": bool(torch.isfinite(one).all())}
            rows.append(row)
            print(f"check {i} {grad}: {row}", flush=True)
    return rows


def exactness() -> list[dict]:
    """The warp-specialised key gradient against float64 and against the one-warpgroup kernel
    (:func:`compare_key_passes`)."""
    from streamkl._hopper.backward import attention_kl_key_pass_hopper as key_pass

    return compare_key_passes(lambda *a: key_pass(*a, specialised=True), lambda *a: key_pass(*a, specialised=False),
                              ("ws", "one"))


def run(against: str) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    base = load_package(os.path.abspath(against), "streamkl_base")
    data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "host": platform.node(), "rounds": ROUNDS}
    data["checks"] = exactness()
    data["rows"] = [measure_shape(base, *shape) for shape in SHAPES]
    return data


def op_table(data: dict, old: str = "v12", new: str = "v13", forced: str = "warp-specialised",
             one: str = "one warpgroup (v12's)") -> str:
    """The paired key-pass and training-call table (``old`` → ``new``; ``forced``: the kernel forced in its column,
    ``one``: how the one-warpgroup kernel is named)."""
    lines = [f"| shape | {new} key pass | key pass ms, {old} → {new} | {new} / {old} (wins, sign test p) | {forced} "
             f"forced / {old} (wins, p) | training call ms, {old} → {new} | {new} / {old} (wins, p) | training call / "
             f"cuDNN fwd+bwd, {old} → {new} |",
             "|---|---|---|---|---|---|---|---|"]
    for row in data["rows"]:
        k, f, t = (paired(row, what) for what in ("key pass", "forced key pass", "training call"))
        cudnn = row["cudnn_fwd_bwd_ms"]
        kind = "warp-specialised" if row["default_is_warp_specialised"] else one
        lines.append(f"| {row['shape']['name']} | {kind} | {k['previous']:.3f} → {k['new']:.3f} | {paired_cell(k)} | "
                     f"{paired_cell(f)} | {t['previous']:.3f} → {t['new']:.3f} | {paired_cell(t)} | "
                     f"{t['previous'] / cudnn:.2f}× → {t['new'] / cudnn:.2f}× |")
    return "\n".join(lines)


def tiles_table(data: dict, tile: str = "queries × keys per consumer") -> str:
    return hopper_tiles_table({"shapes": [dict(name=r["shape"]["name"], tiles=r["tiles"]) for r in data["rows"]
                                          if "tiles" in r]}, tile=tile, timed="key pass ms")


def checks_table(data: dict, names: tuple[str, str] = ("ws", "one"),
                 columns: tuple[str, str] = ("dK_s warp-specialised vs float64", "one warpgroup vs float64")) -> str:
    """The exactness checks of :func:`compare_key_passes` (``names``: the two passes' labels there, ``columns``: their
    error columns' headers)."""
    lines = ["| case (B, H, H_k teacher, H_k student, N_q, N_k, D_t, D_s, causal, layout) | upstream gradient | "
             f"{columns[0]} | {columns[1]} | bitwise equal |",
             "|---|---|---|---|---|"]
    for c in data["checks"]:
        lines.append(f"| {', '.join(str(x) for x in c['case'])} | {c['grad']} | {c[f'rel_{names[0]}_vs_ref']:.1e} | "
                     f"{c[f'rel_{names[1]}_vs_ref']:.1e} | {'yes' if c['bitwise_equal'] else 'no'} |")
    return "\n".join(lines)


def blocks(data: dict, _tuning=None) -> dict[str, str]:
    """The generated blocks of docs/perf-notes.md v13: name -> markdown."""
    return {"ws:tiles": tiles_table(data), "ws:op": op_table(data), "ws:checks": checks_table(data)}


def main(argv: list[str] | None = None) -> None:
    paired_run_main(argv, __doc__, run, blocks, RESULT_NAME, H100_RESULT, DOC)

if __name__ == "__main__":
    main()
