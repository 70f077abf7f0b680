"""Benchmark the real-teacher options: packed documents and sliding windows cost what their band costs (GPU).

Times, with ``triton.testing.do_bench`` medians in one run (bf16, H=16, causal):

* ``dense``: 8 separate N=4096 problems (B=8), the baseline;
* ``packed``: the same 8 documents packed into one 32768-token row (``layout="thd"``, ``cu_seqlens``): the same
  allowed pairs as ``dense``, so the target is ≤ 1.3× its time; ``packed-full`` the same without causal masking,
  against ``dense-full``;
* ``window``: one 32768-token row with a causal sliding window of 4096 keys (``window=(4095, 0)``): each row sees up
  to 4096 keys, twice the allowed pairs of causal ``dense`` and as many as 8 non-causal N=4096 problems
  (``dense-full``), which is its element-matched baseline;
* ``softcap+sinks``: ``dense`` with a soft-capped teacher (cap 50) and sinks on both sides;
* FlexAttention (``torch.nn.attention.flex_attention`` under ``torch.compile``) with the same block masks, as the
  FA-class reference for *attention* (one softmax where the KL has two), and SDPA (cuDNN) on ``dense``.

Each row records forward, forward+backward, peak memory and the number of allowed (query, key) pairs, so times
per allowed pair compare across masks. Results go to ``benchmarks/results/<gpu>-real-teacher.json``.

    python benchmarks/bench_real_teacher.py [--d 64] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys

import torch
import torch.nn.functional as F

from streamkl import attention_kl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS, do_bench_ms, gpu_tag, write_json

DOCS, DOC_LEN, HEADS = 8, 4096, 16
TOTAL = DOCS * DOC_LEN
WINDOW = 4096


def _peak(fn) -> int:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _rand(*shape, grad=False):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16).requires_grad_(grad)


def _allowed_pairs(case: str) -> int:
    causal_doc = DOC_LEN * (DOC_LEN + 1) // 2
    if case in ("dense", "packed", "softcap+sinks"):
        return HEADS * DOCS * causal_doc
    if case in ("dense-full", "packed-full"):
        return HEADS * DOCS * DOC_LEN * DOC_LEN
    if case == "window":  # rows 0..4095 see i + 1 keys, later rows 4096
        return HEADS * (WINDOW * (WINDOW + 1) // 2 + (TOTAL - WINDOW) * WINDOW)
    raise ValueError(case)


def streamkl_cases(d: int) -> dict:
    """name -> (forward callable, tensors that receive gradients)."""
    cu = torch.arange(0, TOTAL + 1, DOC_LEN, device="cuda", dtype=torch.int32)
    cases = {}
    dense = [_rand(DOCS, HEADS, DOC_LEN, d, grad=i >= 2) for i in range(4)]
    cases["dense"] = (lambda x=dense: attention_kl(*x, causal=True), dense[2:])
    cases["dense-full"] = (lambda x=dense: attention_kl(*x), dense[2:])
    packed = [_rand(TOTAL, HEADS, d, grad=i >= 2) for i in range(4)]
    cases["packed"] = (lambda x=packed: attention_kl(*x, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                     max_seqlen_q=DOC_LEN, max_seqlen_k=DOC_LEN, causal=True),
                       packed[2:])
    cases["packed-full"] = (lambda x=packed: attention_kl(*x, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                          max_seqlen_q=DOC_LEN, max_seqlen_k=DOC_LEN), packed[2:])
    row = [_rand(1, HEADS, TOTAL, d, grad=i >= 2) for i in range(4)]
    cases["window"] = (lambda x=row: attention_kl(*x, causal=True, window=(WINDOW - 1, 0)), row[2:])
    sinks_t, sinks_s = torch.randn(HEADS, device="cuda"), torch.randn(HEADS, device="cuda", requires_grad=True)
    cases["softcap+sinks"] = (lambda x=dense: attention_kl(*x, causal=True, softcap_t=50.0, sinks_t=sinks_t,
                                                           sinks_s=sinks_s), [*dense[2:], sinks_s])
    return cases


def flex_cases(d: int) -> dict:
    """FlexAttention (attention, one softmax) with the block masks of the packed and windowed cases."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    doc = torch.arange(TOTAL, device="cuda") // DOC_LEN

    def document_causal(b, h, q, k):
        return (doc[q] == doc[k]) & (k <= q)

    def sliding_window(b, h, q, k):
        return (k <= q) & (q - k < WINDOW)

    cases = {}
    for name, mask_mod in (("packed", document_causal), ("window", sliding_window)):
        block_mask = create_block_mask(mask_mod, 1, 1, TOTAL, TOTAL, device="cuda")
        q, k, v = (_rand(1, HEADS, TOTAL, d, grad=True) for _ in range(3))
        cases[name] = (lambda q=q, k=k, v=v, m=block_mask: flex(q, k, v, block_mask=m), [q, k, v])
    q, k, v = (_rand(DOCS, HEADS, DOC_LEN, d, grad=True) for _ in range(3))
    cases["dense"] = (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), [q, k, v])
    return cases


def measure(provider: str, name: str, fwd, targets) -> dict:
    row = {"provider": provider, "case": name, "allowed_pairs": _allowed_pairs(name)}
    try:
        y = fwd()
        grad = torch.randn_like(y) if y.dim() else None

        def fb():
            torch.autograd.grad(fwd(), targets, grad)

        fb()
        with torch.no_grad():
            row["fwd_ms"] = do_bench_ms(fwd)
        row["fwd_bwd_ms"] = do_bench_ms(fb)
        row["peak_bytes"] = _peak(fb)
    except torch.OutOfMemoryError:
        row["status"] = "OOM"
    gc.collect()
    torch.cuda.empty_cache()
    print(json.dumps(row), flush=True)
    return row


def render_markdown(result: dict) -> str:
    """The "Real-teacher options" section of docs/benchmarks.md, from one results file of this script."""
    shape = result["shape"]
    lines = [
        "## Real-teacher options",
        "",
        f"Generated by `python benchmarks/bench_real_teacher.py` ({result['device']}, torch {result['torch']}, triton "
        f"{result['triton']}): bf16, H={shape['heads']}, D={shape['d']}, {shape['docs']} documents of "
        f"{shape['doc_len']} tokens. `dense` is {shape['docs']} separate causal problems (B={shape['docs']}), "
        f"`packed` the same documents in one {shape['docs'] * shape['doc_len']}-token row (`layout=\"thd\"`), "
        f"`window` one row with a causal {shape['window']}-key sliding window, `dense-full` the non-causal "
        "problems with as many allowed pairs as `window`. FlexAttention (compiled, same block masks) and SDPA are "
        "*attention*, one softmax where the KL has two. Times in ms (`do_bench` medians); ps/pair is the "
        "forward+backward time per allowed (query, key, head) triple.",
        "",
        "| provider | case | allowed pairs | fwd | fwd+bwd | ps/pair | peak MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "fwd_bwd_ms" not in r:
            lines.append(f"| {r['provider']} | {r['case']} | {r['allowed_pairs']:.3g} | {r.get('status', '–')} | | | |")
            continue
        per_pair = r["fwd_bwd_ms"] * 1e9 / r["allowed_pairs"]
        lines.append(f"| {r['provider']} | {r['case']} | {r['allowed_pairs']:.3g} | {r['fwd_ms']:.3f} | "
                     f"{r['fwd_bwd_ms']:.3f} | {per_pair:.2f} | {r['peak_bytes'] / 2**20:.0f} |")
    lines += ["", "| ratio (streamkl fwd+bwd) | measured | target |", "|---|---|---|"]
    targets = {"packed / dense (causal, same pairs)": "≤ 1.3", "packed-full / dense-full (same pairs)": "≤ 1.3",
               "window / dense-full (same pairs)": "≤ 1.3"}
    for name, value in result["ratios_fwd_bwd"].items():
        lines.append(f"| {name} | {value:.2f} | {targets.get(name, '–')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d", type=int, default=64, help="head dim (teacher and student)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (compiling takes ~1 min)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_real_teacher.py needs a CUDA GPU.")
    rows = [measure("streamkl", name, fwd, t) for name, (fwd, t) in streamkl_cases(args.d).items()]
    if not args.no_flex:
        rows += [measure("flex-attention" if name != "dense" else "sdpa-default", name, fwd, t)
                 for name, (fwd, t) in flex_cases(args.d).items()]
    base = {r["case"]: r for r in rows if r["provider"] == "streamkl"}
    ratios = {
        "packed / dense (causal, same pairs)": base["packed"]["fwd_bwd_ms"] / base["dense"]["fwd_bwd_ms"],
        "packed-full / dense-full (same pairs)": base["packed-full"]["fwd_bwd_ms"] / base["dense-full"]["fwd_bwd_ms"],
        "window / dense-full (same pairs)": base["window"]["fwd_bwd_ms"] / base["dense-full"]["fwd_bwd_ms"],
        "window / dense (2x the pairs)": base["window"]["fwd_bwd_ms"] / base["dense"]["fwd_bwd_ms"],
        "softcap+sinks / dense": base["softcap+sinks"]["fwd_bwd_ms"] / base["dense"]["fwd_bwd_ms"],
    }
    out = args.out or os.path.join(RESULTS, f"{gpu_tag(torch.cuda.get_device_name())}-real-teacher.json")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "host": platform.node(),
              "shape": {"docs": DOCS, "doc_len": DOC_LEN, "heads": HEADS, "d": args.d, "dtype": "bfloat16",
                        "window": WINDOW},
              "rows": rows, "ratios_fwd_bwd": ratios}
    write_json(out, result)
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
