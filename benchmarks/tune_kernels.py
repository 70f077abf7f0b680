"""Time candidate tile configurations of every attention-KL kernel on this GPU (one run, medians).

The candidates are the spill-free ones found offline with ``benchmarks/kernel_resources.py``. For each
head dim the whole list is timed non-causal; the best few are re-timed causal. Results (all timings and
the winners) go to ``--out``; the winners are what ``streamkl/_triton/configs.py`` encodes.

    python benchmarks/tune_kernels.py --out tune.json
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

from streamkl._constants import LOG2E
from streamkl._problem import KLInputs, KLSpec
from streamkl._triton.backward import attention_kl_bwd
from streamkl._triton.configs import LaunchConfig
from streamkl._triton.forward import attention_kl_fwd

C = LaunchConfig
FORWARD = {
    64: [C(128, 64, 8, 3), C(128, 128, 8, 2), C(64, 64, 4, 3),
         C(128, 32, 8, 3), C(256, 64, 8, 3),
         C(64, 64, 4, 2), C(64, 32, 4, 2), C(64, 32, 4, 3), C(64, 64, 4, 4), C(32, 64, 4, 3)],
    128: [C(128, 64, 8, 2), C(128, 128, 8, 2), C(64, 64, 4, 3),
          C(128, 32, 8, 3), C(256, 64, 8, 2),
          C(64, 32, 4, 2), C(64, 32, 4, 3), C(64, 64, 4, 2)],
}
DK = {
    64: [C(32, 64, 4, 2), C(32, 64, 4, 3), C(64, 64, 8, 2), C(64, 64, 8, 3), C(64, 128, 8, 2), C(64, 128, 8, 3),
         C(32, 128, 8, 2), C(32, 128, 8, 3), C(64, 64, 4, 2), C(32, 32, 4, 2), C(64, 32, 4, 2), C(64, 32, 4, 3)],
    128: [C(32, 128, 8, 1), C(32, 128, 8, 2), C(32, 128, 8, 3), C(32, 32, 4, 2), C(64, 32, 4, 1), C(32, 64, 4, 1),
          C(64, 64, 8, 2)],
}
DQ = {
    64: [C(64, 64, 8, 2), C(64, 64, 4, 3), C(128, 64, 8, 2), C(128, 128, 8, 2), C(64, 128, 8, 2), C(128, 64, 8, 3),
         C(64, 32, 4, 2), C(64, 32, 4, 3), C(64, 64, 4, 2)],
    128: [C(64, 64, 8, 2), C(128, 64, 8, 2), C(64, 64, 4, 2), C(128, 128, 8, 1), C(64, 128, 8, 2), C(128, 32, 8, 2),
          C(64, 32, 4, 2), C(64, 32, 4, 3)],
}


def _time(fn) -> float | str:
    try:
        fn()
        torch.cuda.synchronize()
        return float(do_bench(fn, warmup=10, rep=60, return_mode="median"))
    except Exception as exc:  # out of resources, compile errors: recorded, not fatal
        return f"{type(exc).__name__}: {str(exc)[:120]}"


def tune_head_dim(d: int, n: int, h: int, top: int, results: dict) -> None:
    """Time every candidate of every kernel at head dim ``d`` and store rows and winners in ``results``."""
    q_t, k_t, q_s, k_s = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = d**-0.5
    inputs = KLInputs(q_t, k_t, q_s, k_s, *[None] * 7)
    specs = {causal: KLSpec(scale_a=scale, scale_b=scale, window_right=0 if causal else -1)
             for causal in (False, True)}
    state = {}
    for causal in (False, True):
        kl, la, lb = attention_kl_fwd(inputs, specs[causal])
        state[causal] = (kl, la, lb, torch.full_like(kl, 1.0 / kl.numel()))

    def fwd(cfg, causal):
        return lambda: attention_kl_fwd(inputs, specs[causal], config=cfg)

    def bwd(dk_cfg, dq_cfg, causal, deterministic):
        kl, la, lb, g = state[causal]
        return lambda: attention_kl_bwd(g, inputs, specs[causal], kl, la, lb, False, True, deterministic=deterministic,
                                        dk_launch=dk_cfg, dq_launch=dq_cfg)

    def sweep(name, cands, make):
        rows = []
        for cfg in cands:
            rows.append({"config": cfg.__dict__, "causal": False, "ms": _time(make(cfg, False))})
        ranked = sorted([r for r in rows if isinstance(r["ms"], float)], key=lambda r: r["ms"])
        for r in ranked[: top]:
            cfg = LaunchConfig(**r["config"])
            rows.append({"config": cfg.__dict__, "causal": True, "ms": _time(make(cfg, True))})
        for r in rows:
            print(f"D={d} {name} causal={r['causal']} {r['config']}: {r['ms']}", flush=True)
        results[f"{name}/D{d}"] = rows
        best = {}
        for causal in (False, True):
            ok = [r for r in rows if r["causal"] == causal and isinstance(r["ms"], float)]
            if ok:
                best[causal] = min(ok, key=lambda r: r["ms"])
        results[f"{name}/D{d}/best"] = best
        return best

    sweep("fwd", FORWARD[d], fwd)
    sweep("bwd-atomic", DK[d], lambda cfg, causal: bwd(cfg, None, causal, False))
    best_dk = sweep("bwd-det-dk", DK[d], lambda cfg, causal: bwd(cfg, None, causal, True))
    dk0 = LaunchConfig(**best_dk[False]["config"])
    sweep("bwd-det-dq", DQ[d], lambda cfg, causal: bwd(dk0, cfg, causal, True))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--top", type=int, default=3)
    args = parser.parse_args()
    n, h = args.n, args.heads
    results: dict = {}
    for d in (64, 128):
        tune_head_dim(d, n, h, args.top, results)
        torch.cuda.empty_cache()
    results["device"] = torch.cuda.get_device_name()
    results["shape"] = {"B": 1, "H": h, "N": n, "dtype": "bfloat16", "log2e": LOG2E}
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1, default=str)
    print("\nBEST:")
    for key, val in results.items():
        if key.endswith("/best"):
            print(key, {c: (v["config"], round(v["ms"], 3)) for c, v in val.items()})


if __name__ == "__main__":
    main()
