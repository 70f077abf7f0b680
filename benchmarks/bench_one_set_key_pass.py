"""v16 (issue 14): the one-warpgroup Hopper key pass takes its full steps one at a time at head dim 128, against v15.

Up to v15 the one-warpgroup key pass issued each full step's score products before the previous step's exponentials,
two register sets of scores in flight (v10). Beside a 128-wide ``dK`` accumulator those sets spill (v14; the hardware
counters after v15 show the key pass without a mask waiting on local memory). v16 takes the full steps one at a time
where side b's head dim is above 64 (``overlaps_steps``): the same products in the same order, so the same key
gradient, with no spills. Head dim 64 keeps the pipelined loop; its compiled code is v15's.

For each head-dim-128 shape below (bf16, frozen teacher), in one process on one GPU:

* the one-warpgroup kernel's tiles on the causal shapes, each timed once;
* paired rounds, the order alternating: v15's key pass (a copy of v15's package, ``--against``) against v16's default
  key pass and against the one-warpgroup kernel forced; the training call as users make it (``attention_kl(...)``,
  then the student's q and k gradients) through both packages; the sign test on each (``bench_ws_key_pass``);
* cuDNN attention's forward+backward on the student's shapes;
* exactness (``bench_hopper_key_pass.CHECKS``, in scope): the one-warpgroup key gradient of both versions against
  float64 and whether they are bitwise equal, with a scalar and a per-row upstream gradient.

    PYTHONPATH=kernels:. python benchmarks/bench_one_set_key_pass.py --against <copy of v15's kernels/streamkl> \\
        --out benchmarks/results     # ~4 minutes on an H100
    PYTHONPATH=kernels:. python benchmarks/bench_one_set_key_pass.py --render   # tables into docs/perf-notes.md

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

from bench_lazy_frames import ROUNDS  # noqa: E402
from bench_ws_key_pass import checks_table, compare_key_passes, measure_shape, op_table, tiles_table  # noqa: E402
from report import load_package, paired_run_main  # noqa: E402

RESULT_NAME = "one-set-key-pass.json"
DOC = os.path.join(HERE, "..", "docs", "perf-notes.md")
H100_RESULT = os.path.join(HERE, "results", f"nvidia-h100-80gb-hbm3-{RESULT_NAME}")
#: (name, B, H, teacher key heads, N, D, causal): the head-dim-128 shapes, with and without a mask
SHAPES = [
    ("N8192-D128", 1, 16, 16, 8192, 128, False),
    ("N8192-D128-causal", 1, 16, 16, 8192, 128, True),
    ("N16384-D128-H32-GQA8", 1, 32, 8, 16384, 128, False),
    ("N16384-D128-H32-GQA8-causal", 1, 32, 8, 16384, 128, True),
]
#: (block_m, block_n, warps, ring stages) of the one-warpgroup kernel timed on the causal shapes
CANDIDATES = [(32, 64, 4, 4), (64, 64, 4, 2), (64, 64, 4, 3)]


def exactness(base) -> list[dict]:
    """The one-warpgroup key gradient of this version and of ``base`` against float64, and whether they are bitwise
    equal (``bench_ws_key_pass.compare_key_passes``)."""
    from streamkl._hopper.backward import attention_kl_key_pass_hopper as new_pass

    old_pass = importlib.import_module(f"{base.__name__}._hopper.backward").attention_kl_key_pass_hopper
    return compare_key_passes(lambda *a: new_pass(*a, specialised=False), lambda *a: old_pass(*a, specialised=False),
                              ("new", "old"))


def run(against: str) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    base = load_package(os.path.abspath(against), "streamkl_base")
    data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "host": platform.node(), "rounds": ROUNDS}
    data["checks"] = exactness(base)
    data["rows"] = [measure_shape(base, *shape, candidates=CANDIDATES, specialised=False) for shape in SHAPES]
    return data


def blocks(data: dict, _tuning=None) -> dict[str, str]:
    """The generated blocks of docs/perf-notes.md v16: name -> markdown."""
    return {"one-set:tiles": tiles_table(data, tile="queries × keys"),
            "one-set:op": op_table(data, "v15", "v16", "one warpgroup", "one warpgroup"),
            "one-set:checks": checks_table(data, ("new", "old"), ("dK_s v16 vs float64", "dK_s v15 vs float64"))}


def main(argv: list[str] | None = None) -> None:
    paired_run_main(argv, __doc__, run, blocks, RESULT_NAME, H100_RESULT, DOC)


if __name__ == "__main__":
    main()
