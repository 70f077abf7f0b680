"""v8 (issue 14): many layer pairs at short context, one call per step instead of one per pair.

The distillation loss (:class:`lightning_streamkl.AttentionDistillationLoss`) with ``L`` layer pairs, forward and
backward (``torch.autograd.grad`` of its total w.r.t. the student's captured queries and keys), bf16, measured on one
GPU in one run:

* ``fused``: the default (``fuse_pairs=True``): launch-bound terms that share every option run as one
  ``attention_kl`` call on their heads concatenated;
* ``per pair``: ``fuse_pairs=False``, one call per pair (what every earlier version did);
* ``SDPA x L``: the student's own attention, ``L`` calls of torch SDPA forward+backward (default backend, a ``.sum()``
  loss) on the same shapes, for scale.

Each is timed three times, interleaved (``do_bench`` medians, ms); the table shows the median of the three and the
JSON keeps all three. The fused and per-pair totals and student gradients are compared in the same run.

    PYTHONPATH=kernels:. python benchmarks/bench_pairs.py --out benchmarks/results   # GPU, about a minute
    PYTHONPATH=kernels:. python benchmarks/bench_pairs.py --render                   # the table into the docs

Timing assertions never go into tests; the numbers here are ratios measured in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_attention_kl import _do_bench as _bench  # noqa: E402  (the same do_bench median as the other scripts)
from bench_fused_dq import _rel  # noqa: E402  (relative L2 difference)
from report import replace_block  # noqa: E402

#: (name, L pairs, B, H, N, D, padded)
SHAPES = [
    ("BERT-base 12 pairs, B=8 N=512", 12, 8, 12, 512, 64, False),
    ("BERT-base 12 pairs, B=8 N=512, padded", 12, 8, 12, 512, 64, True),
    ("MiniLM 6 pairs, B=32 N=128", 6, 32, 12, 128, 64, False),
    ("8 pairs, B=2 H=16 N=2048", 8, 2, 16, 2048, 64, False),
]
RESULT_NAME = "pairs.json"
H100_RESULT = os.path.join(HERE, "results", "nvidia-h100-80gb-hbm3-pairs.json")
DOCS = [os.path.join(HERE, "..", "docs", "perf-notes.md")]
BLOCK = "pairs:table"


def records(layers: int, b: int, h: int, n: int, d: int, *, grad: bool, seed: int, mask: torch.Tensor | None):
    """``{l<i>: CapturedAttention}``: what a capture records from each layer (a padded batch's one mask shared by
    every layer of the model, as Hugging Face models pass it)."""
    from lightning_streamkl.capture import CapturedAttention

    g = torch.Generator(device="cuda").manual_seed(seed)
    out = {}
    for i in range(layers):
        q, k = (torch.randn(b, h, n, d, device="cuda", generator=g).to(torch.bfloat16).requires_grad_(grad)
                for _ in range(2))
        out[f"l{i}"] = CapturedAttention(q, k, causal=False, key_padding_mask=mask, query_mask=mask,
                                         masks_from_call=True)
    return out


def measure(shape: tuple) -> dict:
    from lightning_streamkl import AttentionDistillationLoss

    name, layers, b, h, n, d, padded = shape
    mask = None
    if padded:  # a quarter of the sequences end after 3/4 of the tokens
        mask = torch.ones(b, n, dtype=torch.bool, device="cuda")
        mask[::4, 3 * n // 4:] = False
    teacher = records(layers, b, h, n, d, grad=False, seed=1, mask=mask)
    # each model builds its own mask tensor (equal values): the loss compares the two once per step
    student = records(layers, b, h, n, d, grad=True, seed=2, mask=None if mask is None else mask.clone())
    leaves = [x for rec in student.values() for x in (rec.q, rec.k)]
    pairs = [{"teacher": f"l{i}", "student": f"l{i}", "weight": 1.0 / layers} for i in range(layers)]
    losses = {"fused": AttentionDistillationLoss({"pairs": pairs, "backend": "triton"}),
              "per pair": AttentionDistillationLoss({"pairs": pairs, "backend": "triton", "fuse_pairs": False})}

    def step(loss_fn):
        return lambda: torch.autograd.grad(loss_fn(teacher, student).total, leaves)

    v = [torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]

    def sdpa():
        for i, rec in enumerate(student.values()):
            F.scaled_dot_product_attention(rec.q, rec.k, v[i]).sum().backward()

    fns = {"fused": step(losses["fused"]), "per pair": step(losses["per pair"]), f"SDPA x {layers}": sdpa}
    runs: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(3):  # interleaved: drifts of the machine fall on every column alike
        for key, fn in fns.items():
            runs[key].append(float(_bench(fn)))
    ms = {k: statistics.median(v) for k, v in runs.items()}
    out_f, out_a = (losses[k](teacher, student) for k in ("fused", "per pair"))
    grads_f = torch.autograd.grad(out_f.total, leaves)
    grads_a = torch.autograd.grad(out_a.total, leaves)
    return {
        "name": name, "pairs": layers, "b": b, "h": h, "n": n, "d": d, "padded": padded,
        "ms": ms, "runs_ms": runs,
        "per_pair_over_fused": ms["per pair"] / ms["fused"],
        "fused_over_sdpa": ms["fused"] / ms[f"SDPA x {layers}"],
        "per_pair_over_sdpa": ms["per pair"] / ms[f"SDPA x {layers}"],
        "agreement": {"total rel": abs(out_f.total.item() - out_a.total.item()) / abs(out_a.total.item()),
                      "grad rel L2 (max over tensors)": max(_rel(x, y) for x, y in zip(grads_f, grads_a))},
    }


def run() -> dict:
    import triton

    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "rows": [measure(s) for s in SHAPES]}


def spread(runs: list[float]) -> float:
    """max / min of a column's repeats: how much this machine moved it between repeats."""
    return max(runs) / min(runs)


def table(data: dict) -> str:
    lines = ["| setup (bf16, D = 64) | fused | per pair | per pair / fused | SDPA × L (the student's attention) "
             "| fused / SDPA × L | repeats, max / min: fused, per pair, SDPA | fused vs per pair: loss, gradients "
             "(rel.) |", "|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        sdpa = f"SDPA x {r['pairs']}"
        spreads = ", ".join(f"{spread(r['runs_ms'][k]):.2f}" for k in ("fused", "per pair", sdpa))
        lines.append(f"| {r['name']} | {r['ms']['fused']:.2f} ms | {r['ms']['per pair']:.2f} ms "
                     f"| {r['per_pair_over_fused']:.2f}× | {r['ms'][sdpa]:.2f} ms | {r['fused_over_sdpa']:.2f}× "
                     f"| {spreads} "
                     f"| {r['agreement']['total rel']:.0e}, {r['agreement']['grad rel L2 (max over tensors)']:.0e} |")
    return "\n".join(lines)


def render(path: str = H100_RESULT, docs: list[str] = DOCS) -> None:
    with open(path) as f:
        data = json.load(f)
    for doc in docs:
        with open(doc) as f:
            text = f.read()
        with open(doc, "w") as f:
            f.write(replace_block(text, BLOCK, table(data)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="directory for <gpu>-pairs.json")
    parser.add_argument("--render", nargs="?", const=H100_RESULT, help="write a results file's table into the docs")
    args = parser.parse_args(argv)
    if args.render:
        render(args.render)
        return
    from bench_attention_kl import gpu_tag, write_json

    data = run()
    out = os.path.join(args.out or os.path.join(HERE, "results"), f"{gpu_tag(data['device'])}-{RESULT_NAME}")
    write_json(out, data)
    print(table(data))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
