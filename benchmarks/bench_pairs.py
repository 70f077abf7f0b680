"""Many layer pairs at short context: one call per step instead of one per pair.

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

Then a whole training step (``STEP``: a BERT-base-sized teacher, 12 layers, and a MiniLM-sized student, 6 layers of
384 dims, both built from configs; bf16 autocast, AdamW; a padded batch): the step without distillation, and with
the engine (:class:`lightning_streamkl.AttentionDistiller`, ``uniform_pairs``: 6 pairs; the teacher's pass
included) fused and per pair: ``STEP_ROUNDS`` paired rounds (``common.paired_rounds``), each timing every variant
over ``STEP_ITERS`` steps (median); the ratios are medians of the per-round ratios, with an exact sign test over the
rounds. The tables go to docs/guides/lightning.md.

    PYTHONPATH=kernels:. python benchmarks/bench_pairs.py --out benchmarks/results   # GPU, about a minute
    PYTHONPATH=kernels:. python benchmarks/bench_pairs.py --render                   # the table into the docs
    PYTHONPATH=kernels:. python benchmarks/bench_pairs.py --profile                  # where a distilled step's host
                                                                                    # time goes (cProfile)

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

from common import do_bench_ms, gpu_tag, paired_rounds, rel_l2, sign_test_p, wall_ms, write_blocks, write_json  # noqa: E402

#: (name, L pairs, B, H, N, D, padded)
SHAPES = [
    ("BERT-base 12 pairs, B=8 N=512", 12, 8, 12, 512, 64, False),
    ("BERT-base 12 pairs, B=8 N=512, padded", 12, 8, 12, 512, 64, True),
    ("MiniLM 6 pairs, B=32 N=128", 6, 32, 12, 128, 64, False),
    ("8 pairs, B=2 H=16 N=2048", 8, 2, 16, 2048, 64, False),
]
RESULT_NAME = "pairs.json"
H100_RESULT = os.path.join(HERE, "results", "nvidia-h100-80gb-hbm3-pairs.json")
DOCS = [os.path.join(HERE, "..", "docs", "guides", "lightning.md")]
BLOCK, STEP_BLOCK = "pairs:table", "pairs:step"


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
            runs[key].append(do_bench_ms(fn))
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
                      "grad rel L2 (max over tensors)": max(rel_l2(x, y) for x, y in zip(grads_f, grads_a))},
    }


#: the end-to-end step: batch, tokens, teacher (layers, hidden, heads), student (layers, hidden, heads)
STEP = {"batch": 16, "tokens": 256, "teacher": (12, 768, 12), "student": (6, 384, 12)}
STEP_ITERS = 10
STEP_ROUNDS = 15


def bert(layers: int, hidden: int, heads: int, seed: int):
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    cfg = BertConfig(hidden_size=hidden, num_attention_heads=heads, num_hidden_layers=layers,
                     intermediate_size=4 * hidden, vocab_size=30522, max_position_embeddings=512,
                     attn_implementation="sdpa", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertModel(cfg, add_pooling_layer=False).cuda()


def step_times(profile: bool = False) -> dict:
    """Median ms per training step: the student alone, and with the engine's attention-KL loss fused / per pair.
    With ``profile``, instead the top cProfile entries (internal time) of ten distilled steps, printed."""
    from lightning_streamkl import AttentionDistiller, uniform_pairs

    b, n = STEP["batch"], STEP["tokens"]
    teacher = bert(*STEP["teacher"], seed=0).to(torch.bfloat16).eval()
    student = bert(*STEP["student"], seed=1)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(1000, 30000, (b, n), generator=g).cuda(),
             "attention_mask": torch.ones(b, n, dtype=torch.long).cuda()}
    batch["attention_mask"][::4, 3 * n // 4:] = 0  # a quarter of the sequences padded
    pairs = uniform_pairs(STEP["teacher"][0], STEP["student"][0])
    distiller = AttentionDistiller(teacher, {"pairs": pairs, "backend": "triton"})
    distiller.setup(student)

    def step(fuse: bool | None):
        def run_step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if fuse is None:
                    loss = student(**batch).last_hidden_state.float().pow(2).mean()
                else:
                    distiller.loss.config.fuse_pairs = fuse
                    distiller.begin_step(batch)
                    with distiller.student_recording():
                        task = student(**batch).last_hidden_state.float().pow(2).mean()
                    loss = task + distiller.end_step(batch).total
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return run_step

    def teacher_pass(captured: bool):
        def run_pass():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if captured:  # the engine's teacher pass: placement check, capture, early exit after layer 12
                    distiller.run_teacher(batch)
                    distiller.clear()
                else:
                    with torch.no_grad():
                        teacher(**batch)

        return run_pass

    fns = {"student alone": step(None), "fused": step(True), "per pair": step(False),
           "teacher pass": teacher_pass(False), "teacher pass, captured": teacher_pass(True)}
    if profile:
        import cProfile
        import io
        import pstats

        fns["fused"]()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(10):
            fns["fused"]()
        torch.cuda.synchronize()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
        print(out.getvalue())
        return {}
    runs = paired_rounds(fns, STEP_ROUNDS, lambda fn: wall_ms(fn, STEP_ITERS))
    ms = {k: statistics.median(v) for k, v in runs.items()}
    ratios = [p / f for p, f in zip(runs["per pair"], runs["fused"])]
    slower = sum(r > 1 for r in ratios)
    return {"setup": STEP, "pairs": len(pairs), "rounds": STEP_ROUNDS, "ms": ms, "runs_ms": runs,
            "fused_over_alone": statistics.median(f / a for f, a in zip(runs["fused"], runs["student alone"])),
            "per_pair_over_alone": statistics.median(p / a for p, a in zip(runs["per pair"], runs["student alone"])),
            "per_pair_over_fused": statistics.median(ratios),
            "rounds_per_pair_slower": slower, "sign_test_p": sign_test_p(slower, len(ratios)),
            "captured_teacher_over_plain": statistics.median(
                c / t for c, t in zip(runs["teacher pass, captured"], runs["teacher pass"]))}


def run() -> dict:
    import triton

    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "rows": [measure(s) for s in SHAPES], "step": step_times()}


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


def step_table(data: dict) -> str:
    st = data["step"]
    (lt, ht, _), (ls, hs, _) = st["setup"]["teacher"], st["setup"]["student"]
    lines = [f"| training step (B={st['setup']['batch']}, N={st['setup']['tokens']}, teacher {lt}×{ht}, student "
             f"{ls}×{hs}, {st['pairs']} pairs; {st['rounds']} paired rounds) | ms per step (median) "
             "| / student alone (median of the rounds' ratios) |", "|---|---|---|"]
    lines.append(f"| student alone | {st['ms']['student alone']:.2f} | 1 |")
    lines.append(f"| fused | {st['ms']['fused']:.2f} | {st['fused_over_alone']:.2f}× |")
    lines.append(f"| per pair | {st['ms']['per pair']:.2f} | {st['per_pair_over_alone']:.2f}× |")
    lines.append(f"| per pair / fused | | {st['per_pair_over_fused']:.3f}× (per pair slower in "
                 f"{st['rounds_per_pair_slower']} of {st['rounds']} rounds; sign test p = {st['sign_test_p']:.2g}) |")
    lines.append(f"| the teacher's pass alone (no capture) | {st['ms']['teacher pass']:.2f} | |")
    lines.append(f"| the teacher's pass as the engine runs it (captured) | {st['ms']['teacher pass, captured']:.2f} "
                 f"| {st['captured_teacher_over_plain']:.2f}× the pass alone |")
    return "\n".join(lines)


def blocks(data: dict) -> dict[str, str]:
    """The generated blocks of docs/guides/lightning.md: name -> markdown."""
    return {BLOCK: table(data), STEP_BLOCK: step_table(data)}


def render(path: str = H100_RESULT, docs: list[str] = DOCS) -> None:
    with open(path) as f:
        data = json.load(f)
    for doc in docs:
        write_blocks(doc, blocks(data))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="directory for <gpu>-pairs.json")
    parser.add_argument("--render", nargs="?", const=H100_RESULT, help="write a results file's table into the docs")
    parser.add_argument("--profile", action="store_true",
                        help="only print the top cProfile entries of the distilled training step")
    args = parser.parse_args(argv)
    if args.render:
        render(args.render)
        return
    if args.profile:
        step_times(profile=True)
        return
    data = run()
    out = os.path.join(args.out or os.path.join(HERE, "results"), f"{gpu_tag(data['device'])}-{RESULT_NAME}")
    write_json(out, data)
    print(table(data))
    print(step_table(data))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
