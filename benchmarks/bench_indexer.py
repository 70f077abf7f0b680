"""Benchmark the fused indexer loss (:func:`streamkl.indexer_kl`) against the materialised PyTorch loss (GPU).

For each shape (causal, bf16, B=1, D=128, H_I=64, D_I=128, the main attention MQA-like as DeepSeek's MLA: one key
head, unless ``h_kv`` says otherwise) it times with ``triton.testing.do_bench`` medians:

* ``fused``: forward (computing the per-head lse itself), forward with the lse given (as a flash-attn caller can),
  backward alone, forward+backward; the peak memory of forward+backward;
* ``naive``: the Megatron-style materialised loss (``streamkl.indexer_naive.megatron_style_indexer_loss``: the
  ``[B, H, N, N]`` fp32 scores, masked, softmax, head mean, the ``[B, N, H_I, N]`` indexer scores, KL) forward
  and forward+backward and its peak memory, where its estimated footprint fits the card (else ``OOM (estimated
  ...)``; an actual out-of-memory is recorded as ``OOM``).

Dense stage N = 4k..64k, sparse stage (K = 2048 keys per row picked at random among the allowed ones) N = 4k..64k,
H = 16 and 64. It reports the fraction of the bf16 tensor-core floor reached: the tensor-core FLOPs the kernels
issue (forward ``2·(2·H·D + H_I·D_I)`` per score element, ``2·(H·D + H_I·D_I)`` with the lse given; backward
``2·(H·D + 5·H_I·D_I)`` dense, ``2·(H·D + 3·H_I·D_I)`` sparse; causal elements ``N(N+1)/2``, sparse
``Σ_t min(K, t+1)``) at :data:`BF16_FLOOR_FLOPS` (an 8192³ bf16 matmul on an H100; the run also measures its
own). The fused op runs with ``check_indices=False`` (the index check is a sort; the benchmark's selection is valid).

    python benchmarks/bench_indexer.py                       # GPU grid
    python benchmarks/bench_indexer.py --smoke               # tiny shapes on the CPU (reference backend), for CI

Writes ``indexer_<gpu>.json`` (``--smoke``: ``indexer_smoke_cpu.json``) into ``--out`` (default
``benchmarks/results``) after every shape, and prints a table. With ``--budget-s``, shapes left when it runs out are
recorded as skipped.

    python benchmarks/bench_indexer.py --docs benchmarks/results/indexer_nvidia-h100-80gb-hbm3.json

renders a committed run (no GPU needed) into ``docs/guides/indexer.md``, between its ``indexer-gpu`` markers.
Timing assertions never go into tests.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from streamkl import indexer_kl
from streamkl.indexer_autograd import indexer_forward_impl
from streamkl.indexer_naive import megatron_style_indexer_loss

#: bf16 dense matmul rate measured on an H100 (8192³, do_bench).
BF16_FLOOR_FLOPS = 756e12
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS, ROOT, do_bench_ms, gpu_tag, wall_ms, write_blocks, write_json  # noqa: E402


@dataclass
class Shape:
    n: int
    h: int
    topk: int | None = None  # None: dense stage
    h_kv: int = 1
    b: int = 1
    d: int = 128
    h_i: int = 64
    d_i: int = 128
    dtype: str = "bfloat16"

    @property
    def stage(self) -> str:
        return "dense" if self.topk is None else "sparse"

    def elements(self) -> float:
        """Usable (query, key) pairs under the causal mask (sparse: at most K per row)."""
        if self.topk is None:
            return self.b * self.n * (self.n + 1) / 2
        k = min(self.topk, self.n)
        return self.b * (k * (k + 1) / 2 + (self.n - k) * k)

    def flops(self, mode: str) -> float:
        """Tensor-core FLOPs of one call of ``mode`` (fwd | fwd-lse | bwd | fwd+bwd)."""
        main, index = 2 * self.h * self.d, 2 * self.h_i * self.d_i
        bwd = main + (5 if self.topk is None else 3) * index
        per_element = {"fwd": 2 * main + index, "fwd-lse": main + index, "bwd": bwd, "fwd+bwd": 2 * main + index + bwd}
        return per_element[mode] * self.elements()

    def naive_bytes(self) -> float:
        """Rough peak of the materialised forward+backward: fp32 maps of B·N² times (2H + 3H_I + 8)."""
        return 4.0 * self.b * self.n * self.n * (2 * self.h + 3 * self.h_i + 8)


@dataclass
class Record:
    provider: str  # fused | naive
    mode: str  # fwd | fwd-lse | bwd | fwd+bwd | mem
    shape: dict
    ms: float | None = None
    peak_bytes: int | None = None
    status: str = "ok"
    extra: dict = field(default_factory=dict)


def make_topk(shape: Shape, device, rows_per_chunk: int = 1024) -> torch.Tensor:
    """``[B, N, K]`` int32: per row, K distinct random keys among the causally allowed ones (``-1`` when fewer)."""
    out = torch.empty(shape.b, shape.n, shape.topk, dtype=torch.int32, device=device)
    cols = torch.arange(shape.n, device=device)
    for b in range(shape.b):
        for r0 in range(0, shape.n, rows_per_chunk):
            rows = torch.arange(r0, min(r0 + rows_per_chunk, shape.n), device=device)
            scores = torch.rand(rows.numel(), shape.n, device=device).masked_fill(cols > rows[:, None], -1.0)
            idx = scores.topk(min(shape.topk, shape.n), dim=-1).indices
            idx = idx.masked_fill(idx > rows[:, None], -1)
            out[b, r0:r0 + rows.numel(), : idx.shape[1]] = idx.to(torch.int32)
            out[b, r0:r0 + rows.numel(), idx.shape[1]:] = -1
    return out


def make_inputs(shape: Shape, device) -> dict:
    dt = getattr(torch, shape.dtype)
    g = lambda *s: torch.randn(*s, device=device, dtype=dt)
    x = dict(q=g(shape.b, shape.h, shape.n, shape.d), k=g(shape.b, shape.h_kv, shape.n, shape.d),
             q_idx=g(shape.b, shape.h_i, shape.n, shape.d_i) * 0.2, k_idx=g(shape.b, shape.n, shape.d_i) * 0.2,
             w_idx=g(shape.b, shape.n, shape.h_i))
    for n in ("q_idx", "k_idx", "w_idx"):
        x[n].requires_grad_(True)
    x["topk_indices"] = None if shape.topk is None else make_topk(shape, device)
    return x


def _timer(device: str):
    if device == "cuda":
        return lambda fn: do_bench_ms(fn, rep=100, warmup=25)
    return lambda fn: wall_ms(fn, iters=2, device="cpu", warmup=0)  # the CPU smoke check: only that it runs


def _peak(device: str, fn) -> int | None:
    """Peak bytes allocated while ``fn`` runs beyond what was allocated before (CUDA only)."""
    if device != "cuda":
        fn()
        return None
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _grad(loss: torch.Tensor, targets: list, retain: bool = False):
    return torch.autograd.grad(loss, targets, retain_graph=retain)


def bench_fused(shape: Shape, x: dict, device: str, backend: str, timer) -> list[Record]:
    sd = asdict(shape)
    targets = [x["q_idx"], x["k_idx"], x["w_idx"]]
    kw = dict(topk_indices=x["topk_indices"], backend=backend, check_indices=False)
    names = ("q", "k", "q_idx", "k_idx", "w_idx")
    fwd = lambda lse=None: indexer_kl(*(x[n] for n in names), lse=lse, **kw)
    impl = "triton" if backend == "triton" else "reference"
    with torch.no_grad():
        _, lse_h, _, _ = indexer_forward_impl(*(x[n] for n in names), None, x["topk_indices"], None, True,
                                              shape.d ** -0.5, impl)
    out = []
    with torch.no_grad():
        out.append(Record("fused", "fwd", sd, ms=timer(fwd)))
        out.append(Record("fused", "fwd-lse", sd, ms=timer(lambda: fwd(lse_h))))
    y = fwd()
    out.append(Record("fused", "bwd", sd, ms=timer(lambda: _grad(y, targets, retain=True))))
    y = None  # free the retained graph
    out.append(Record("fused", "fwd+bwd", sd, ms=timer(lambda: _grad(fwd(), targets))))
    out.append(Record("fused", "mem", sd, peak_bytes=_peak(device, lambda: _grad(fwd(), targets))))
    for r in out:
        if r.ms is not None:
            floor_ms = shape.flops(r.mode) / BF16_FLOOR_FLOPS * 1e3
            r.extra.update(floor_ms=floor_ms, floor_fraction=floor_ms / r.ms)
    return out


def bench_naive(shape: Shape, x: dict, device: str, timer, memory_bytes: float | None) -> list[Record]:
    sd = asdict(shape)
    if memory_bytes is not None and shape.naive_bytes() > 0.9 * memory_bytes:
        return [Record("naive", "fwd+bwd", sd, status=f"OOM (estimated {shape.naive_bytes() / 2**30:.0f} GiB)")]
    targets = [x["q_idx"], x["k_idx"], x["w_idx"]]
    fwd = lambda: megatron_style_indexer_loss(*(x[n] for n in ("q", "k", "q_idx", "k_idx", "w_idx")),
                                              scale=shape.d ** -0.5, topk_indices=x["topk_indices"])
    out = []
    try:
        with torch.no_grad():
            out.append(Record("naive", "fwd", sd, ms=timer(fwd)))
        out.append(Record("naive", "fwd+bwd", sd, ms=timer(lambda: _grad(fwd(), targets))))
        out.append(Record("naive", "mem", sd, peak_bytes=_peak(device, lambda: _grad(fwd(), targets))))
    except torch.OutOfMemoryError:
        out.append(Record("naive", "fwd+bwd", sd, status="OOM"))
    return out


def agreement(shape: Shape, x: dict, backend: str) -> float:
    """Relative difference of the fused and the naive loss on these inputs (the naive one in fp32)."""
    names = ("q", "k", "q_idx", "k_idx", "w_idx")
    with torch.no_grad():
        fused = indexer_kl(*(x[n] for n in names), topk_indices=x["topk_indices"], backend=backend,
                           check_indices=False)
        naive = megatron_style_indexer_loss(*(x[n] for n in names), scale=shape.d ** -0.5,
                                            topk_indices=x["topk_indices"])
    return abs(float(fused) - float(naive)) / max(abs(float(naive)), 1e-30)


def grid(smoke: bool) -> list[Shape]:
    if smoke:
        tiny = dict(d=16, h_i=2, d_i=16, dtype="float32")
        return [Shape(32, 2, **tiny), Shape(48, 2, topk=8, h_kv=2, **tiny)]
    dense = [Shape(n, h) for n, h in ((4096, 16), (4096, 64), (8192, 16), (8192, 64), (16384, 16), (32768, 16),
                                     (65536, 16))]
    sparse = [Shape(n, h, topk=2048) for n, h in ((4096, 16), (8192, 16), (8192, 64), (16384, 64), (32768, 64),
                                                 (65536, 64))]
    sparse.append(Shape(8192, 16, topk=2048, h_kv=16))  # MHA: every head gathers its own keys
    return sorted(dense + sparse, key=lambda s: (s.n, s.h, s.topk is not None, s.h_kv))  # long N last (budget)


def table(records: list[dict]) -> str:
    """Markdown table: one row per shape, fused times and floor fractions, naive times, peak memory."""
    by_shape: dict[str, dict] = {}
    for r in records:
        key = json.dumps(r["shape"], sort_keys=True)
        by_shape.setdefault(key, {"shape": r["shape"]})[f"{r['provider']}/{r['mode']}"] = r

    def ms(row, name):
        r = row.get(name)
        if r is None:
            return "-"
        return f"{r['ms']:.2f}" if r["ms"] is not None else r["status"]

    def frac(row, name):
        r = row.get(name)
        return f"{r['extra']['floor_fraction']:.0%}" if r and "floor_fraction" in r.get("extra", {}) else "-"

    def gib(row, name):
        r = row.get(name)
        if r is None or (r["peak_bytes"] is None and r["status"] == "ok"):
            return "-"
        return f"{r['peak_bytes'] / 2**30:.2f}" if r["peak_bytes"] is not None else r["status"]

    lines = ["| stage | N | H | H_kv | fused fwd ms (floor) | fwd, lse given | bwd ms (floor) | fwd+bwd ms (floor) | "
             "fused peak GiB | naive fwd ms | naive fwd+bwd ms | naive peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in by_shape.values():
        s = row["shape"]
        stage = "dense" if s["topk"] is None else f"sparse K={s['topk']}"
        naive_fb = ms(row, "naive/fwd+bwd")
        lines.append(
            f"| {stage} | {s['n']} | {s['h']} | {s['h_kv']} | {ms(row, 'fused/fwd')} ({frac(row, 'fused/fwd')}) | "
            f"{ms(row, 'fused/fwd-lse')} ({frac(row, 'fused/fwd-lse')}) | {ms(row, 'fused/bwd')} "
            f"({frac(row, 'fused/bwd')}) | {ms(row, 'fused/fwd+bwd')} ({frac(row, 'fused/fwd+bwd')}) | "
            f"{gib(row, 'fused/mem')} | {ms(row, 'naive/fwd')} | {naive_fb} | {gib(row, 'naive/mem')} |"
        )
    return "\n".join(lines)


DOCS_PAGE = os.path.join(ROOT, "docs", "guides", "indexer.md")


def docs_block(result: dict, source: str) -> str:
    """The guide's block for a run: where it comes from, then :func:`table`."""
    measured = result.get("bf16_matmul_flops_measured")
    rate = f" (an 8192³ bf16 matmul measured {measured / 1e12:.0f} TFLOP/s in the same run)" if measured else ""
    return (f"`{source}`: {result['device']}, torch {result['torch']}, Triton {result['triton']}. Times in ms "
            f"(medians), in brackets the share of the bf16 floor at {BF16_FLOOR_FLOPS / 1e12:.0f} TFLOP/s{rate}; "
            "peak memory of forward+backward in GiB.\n\n" + table(result["records"]))


def write_docs(path: str, page: str = DOCS_PAGE) -> str:
    """Write :func:`docs_block` of the result file ``path`` between the ``indexer-gpu`` markers of ``page``."""
    with open(path) as f:
        block = docs_block(json.load(f), os.path.relpath(os.path.abspath(path), ROOT))
    write_blocks(page, {"indexer-gpu": block})
    return block


def _name(device: str, smoke: bool) -> str:
    return "indexer_smoke_cpu.json" if smoke else f"indexer_{gpu_tag(device)}.json"


def run(smoke: bool, budget_s: float, folder: str) -> dict:
    """Benchmark every shape of the grid; the JSON is rewritten into ``folder`` after every shape, so a run that is
    stopped keeps what it measured."""
    device = "cpu" if smoke else "cuda"
    backend = "auto" if smoke else "triton"
    timer = _timer(device)
    meta = {"device": "cpu" if smoke else torch.cuda.get_device_name(), "torch": torch.__version__,
            "host": platform.node(), "bf16_floor_flops_reference": BF16_FLOOR_FLOPS, "smoke": smoke}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    memory_bytes = None
    if not smoke:
        torch.backends.cuda.matmul.allow_tf32 = False
        memory_bytes = torch.cuda.get_device_properties(0).total_memory
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        meta["bf16_matmul_flops_measured"] = 2 * 8192**3 / (timer(lambda: a @ a) * 1e-3)
        del a
        print(f"bf16 matmul here: {meta['bf16_matmul_flops_measured'] / 1e12:.0f} TFLOP/s", flush=True)
    records: list[Record] = []
    start, path = time.time(), os.path.join(folder, _name(meta["device"], smoke))
    for shape in grid(smoke):
        sd = asdict(shape)
        if time.time() - start > budget_s:
            records.append(Record("fused", "fwd+bwd", sd, status="skipped: time budget"))
            continue
        t0 = time.time()
        torch.manual_seed(0)
        x = make_inputs(shape, device)
        recs = bench_fused(shape, x, device, backend, timer)
        recs += bench_naive(shape, x, device, timer, memory_bytes)
        if any(r.provider == "naive" and r.status == "ok" for r in recs):
            recs[0].extra["loss_rel_diff_vs_naive"] = agreement(shape, x, backend)
        records += recs
        del x
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        summary = {f"{r.provider}/{r.mode}": (round(r.ms, 3) if r.ms is not None else r.status) for r in recs
                   if r.mode != "mem"}
        print(f"{shape.stage} N={shape.n} H={shape.h} H_kv={shape.h_kv}: {summary} ({time.time() - t0:.0f}s)",
              flush=True)
        write_json(path, {**meta, "records": [asdict(x) for x in records]})
    result = {**meta, "records": [asdict(r) for r in records]}
    write_json(path, result)  # with the skipped shapes
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (reference backend)")
    parser.add_argument("--out", default=RESULTS, help="directory of the JSON (default: benchmarks/results)")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="stop starting new shapes after this many seconds")
    parser.add_argument("--docs", metavar="RESULT_JSON", default=None,
                        help="render a committed run into docs/guides/indexer.md and exit (no GPU needed)")
    args = parser.parse_args(argv)
    if args.docs:
        print(write_docs(args.docs))
        with open(args.docs) as f:
            return json.load(f)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench_indexer.py needs a CUDA GPU (or --smoke for the CPU check).")
    result = run(args.smoke, args.budget_s, args.out)
    print(f"wrote {os.path.join(args.out, _name(result['device'], args.smoke))}")
    print(table(result["records"]))
    return result


if __name__ == "__main__":
    main()
