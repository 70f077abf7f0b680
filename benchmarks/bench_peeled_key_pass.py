"""v14 (issue 14): the one-warpgroup Hopper key pass with its causal diagonal swept apart, against v13, in one run.

v10's one-warpgroup key pass kept the masked (diagonal) tile code and the unmasked one live in one pipelined loop; with
a causal mask that did not fit 64-query steps in the registers, so it ran 32-query steps, and v13's warp-specialised
kernel replaced it there. v14 sweeps each program's diagonal tiles first, one at a time, then the full tiles through
the pipelined loop, which never masks (``kernels/streamkl/_hopper/backward.py``), so causal problems run 64-query
steps without spilling; it takes the causal key pass at head dim 64, and the warp-specialised kernel keeps head dim
128.

For each long-context shape of ``bench_ws_key_pass.SHAPES`` (bf16, frozen teacher), in one process on one GPU:

* the one-warpgroup kernel's tiles on the causal shapes, each timed once;
* paired rounds, the order alternating: v13's key pass (a copy of v13's package, ``--against``) against v14's default
  key pass and against the one-warpgroup kernel forced; the training call as users make it (``attention_kl(...)``,
  then the student's q and k gradients) through both packages; the sign test on each (``bench_ws_key_pass``);
* cuDNN attention's forward+backward on the student's shapes;
* exactness (``bench_hopper_key_pass.CHECKS``, in scope): both kernels' key gradients against float64 and whether
  they are bitwise equal, with a scalar and a per-row upstream gradient.

    PYTHONPATH=kernels:. python benchmarks/bench_peeled_key_pass.py --against <copy of v13's kernels/streamkl> \\
        --out benchmarks/results     # ~5 minutes on an H100
    PYTHONPATH=kernels:. python benchmarks/bench_peeled_key_pass.py --render   # tables into docs/perf-notes.md

Timing assertions never go into tests; the numbers here are ratios measured in one run.
"""

from __future__ import annotations

import os
import platform
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_lazy_frames import ROUNDS  # noqa: E402
from bench_ws_key_pass import SHAPES, checks_table, exactness, measure_shape, op_table, tiles_table  # noqa: E402
from report import load_package, paired_run_main  # noqa: E402

RESULT_NAME = "peeled-key-pass.json"
DOC = os.path.join(HERE, "..", "docs", "perf-notes.md")
H100_RESULT = os.path.join(HERE, "results", f"nvidia-h100-80gb-hbm3-{RESULT_NAME}")
#: (block_m, block_n, warps, ring stages) of the one-warpgroup kernel timed on the causal shapes, by head dim
CANDIDATES = {64: [(32, 64, 4, 4), (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4), (64, 64, 4, 6)],
              128: [(32, 64, 4, 4), (64, 64, 4, 2), (64, 64, 4, 3)]}


def run(against: str) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    base = load_package(os.path.abspath(against), "streamkl_base")
    data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "host": platform.node(), "rounds": ROUNDS}
    data["checks"] = exactness()
    data["rows"] = [measure_shape(base, *shape, candidates=CANDIDATES[shape[5]], specialised=False)
                    for shape in SHAPES]
    return data


def blocks(data: dict, _tuning=None) -> dict[str, str]:
    """The generated blocks of docs/perf-notes.md v14: name -> markdown."""
    return {"peeled:tiles": tiles_table(data, tile="queries × keys"),
            "peeled:op": op_table(data, "v13", "v14", "one warpgroup", "one warpgroup"),
            "peeled:checks": checks_table(data)}


def main(argv: list[str] | None = None) -> None:
    paired_run_main(argv, __doc__, run, blocks, RESULT_NAME, H100_RESULT, DOC)

if __name__ == "__main__":
    main()
