"""Real batches (issue 38): the op on the batches people train with, against cuDNN attention in the same run.

Forward+backward of ``attention_kl(..., reduction="mean")`` (frozen teacher, trainable student, the default dispatch;
bf16 unless a row says fp16), ``do_bench`` medians, for the headline reference rows and the "real batches" rows:
lengths off the tile grid, D_t=128 -> D_s=64, 8 packed documents (offsets on the GPU, and on the CPU), a right-padded
batch (and the same batch with an all-True key mask, both with the masks on the GPU and on the CPU, and without
masks), fp16, a sliding window, sinks (gpt-oss's attention; cuDNN runs the same shapes without them), GQA with
odd lengths and the BERT shape (1 and 12 pairs back to back, and 12 pairs
as the engine runs them: one call on their heads concatenated, ``lightning_streamkl.terms.run_terms``). Every row
records the kernels the dispatch table chose, where its time goes (:func:`time_split`, :func:`kernel_ms`: the host's
time to enqueue a call against the GPU's kernel time, per call of back-to-back calls; the kernel times are taken
after every row is timed, so no timing follows a use of torch's profiler: :func:`host_after_profiler` checks what
that use does to the host path), and its baselines:

* ``ratio_cudnn``: our time / torch SDPA forward+backward (random upstream gradients) with the cuDNN backend on the
  student's q, k and a v of k's shape, the same masks as SDPA takes them (causal; padding and the window as a bool
  ``attn_mask``); where cuDNN refuses, the default backend runs and ``cudnn_backend`` says so. Packed rows: SDPA has
  no packed layout, so cuDNN runs the documents separately (the sum of their times, one closure).
* ``ratio_separate``: packed rows, our time / the same documents through the op as separate dense calls. The window
  row: our time / the op on N/W dense non-causal problems of N=W (the same query rows, each seeing W keys), scaled to
  the window's allowed score elements (``ratio_cudnn_same_work``: the same for cuDNN, a tighter baseline than SDPA
  under the window's mask, which computes the whole N x N).
* ``ratio_same_work`` (padded rows): our time / (the dense B=4 row's time x ``allowed_fraction``, the allowed score
  elements over the dense batch's).
* ``ratio_back_to_back`` (the BERT rows, which the host bounds): our back-to-back time per call / SDPA's.

Each row's targets are the issue's (:data:`CUDNN_TARGET` and the others); ``met`` says whether every ratio is within
its target (None: no target, or a ratio missing). Timings are never asserted in tests.

    PYTHONPATH=kernels:. python benchmarks/real_batches.py                  # GPU -> results/<gpu>-real-batches.json
    PYTHONPATH=kernels:. python benchmarks/real_batches.py --cpu-smoke --out /tmp/rb.json  # tiny shapes, CPU
    python benchmarks/real_batches.py --render [RESULT]   # the table into docs/concepts/kernels.md
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import itertools
import math
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
from common import Shape, make_inputs  # noqa: E402

#: The run the docs render (one H200), its page and block.
RESULT = os.path.join(common.RESULTS, "nvidia-h200-real-batches.json")
DOC = os.path.join(common.ROOT, "docs", "concepts", "kernels.md")
BLOCK = "real-batches:table"
COMMAND = "PYTHONPATH=kernels:. python benchmarks/real_batches.py"
#: The issue's targets: fwd+bwd / cuDNN at N >= 4096; packed and window rows / the same documents run separately;
#: padded rows / a dense batch of the same work; an all-True mask costs what no mask costs (read: within 5%); the
#: BERT shape, one pair, / SDPA.
CUDNN_TARGET, SEPARATE_TARGET, SAME_WORK_TARGET, ALL_TRUE_TARGET, BERT_TARGET = 1.25, 1.25, 1.15, 1.05, 2.0
#: ``do_bench`` window (ms): about 0.2 s per timed call, for the whole run to take a few minutes on an H100 or H200.
REP_MS, WARMUP_MS = 100, 25


@dataclass(frozen=True)
class Row:
    """One row: a problem (``shape``: the teacher's heads and head dim, ``d_s`` the student's; a padded batch's
    sequence ``lengths`` as fractions of N with its ``masks``; ``docs`` packed documents of random lengths summing to
    N; a ``window`` of keys per row; ``pairs`` back-to-back calls) and the targets of its ratios."""

    name: str
    shape: Shape
    group: str = "real batches"
    lengths: tuple[float, ...] = ()
    masks: tuple[str, ...] = ()  # "key", "query"
    docs: int = 0
    window: int = 0
    pairs: int = 1
    against_sdpa_back_to_back: bool = False  # also SDPA's back-to-back time per call (the BERT rows)
    fused: bool = False  # the pairs as the engine runs them: one call on their heads concatenated (run_terms)
    on_cpu: bool = False  # packed rows' ``cu_seqlens``, padded rows' masks on the CPU, as a data collator makes them
    sinks: bool = False  # both sides' sink logits (gpt-oss), the student's trainable
    dense_row: str = ""  # padded rows: the row of the same batch without masks
    targets: tuple[tuple[str, float], ...] = (("ratio_cudnn", CUDNN_TARGET),)


#: ``--cpu-smoke``: each length's tiny stand-in (the lengths off the tile grid stay off it)
TINY_N = {512: 16, 4096: 16, 5000: 20, 8191: 31, 8192: 32, 12345: 37, 16384: 48, 32768: 64}


def rows(smoke: bool = False) -> list[Row]:
    """The rows, in order (the dense B=4 batch before its padded rows); ``smoke``: the same rows on tiny shapes
    (:data:`TINY_N`; heads / 16, GQA kept; head dims / 4; B=8 -> 2; 12 pairs -> 2) for the CPU interpreter."""
    def tiny(n: int) -> int:
        return TINY_N[n] if smoke else n

    def shape(b: int, h: int, n: int, d: int, causal: bool, **kw: Any) -> Shape:
        if smoke:
            b, h, n, d = (b if b <= 4 else b // 4), max(1, h // 16), tiny(n), d // 4
            kw = {k: (max(1, v // 16) if k == "h_kt" else v // 4 if k == "d_s" else v) for k, v in kw.items()}
        return Shape(b, h, n, d, causal, **kw)

    ref: tuple = ()
    out = [Row("B=1 H=16 N=8192 D=64 causal", shape(1, 16, 8192, 64, True), "headline", targets=ref),
           Row("H=32 N=8192 D=128 causal", shape(1, 32, 8192, 128, True), "headline", targets=ref),
           Row("GQA H=32/8 N=16384 D=128 causal", shape(1, 32, 16384, 128, True, h_kt=8), "headline", targets=ref),
           Row("H=8 N=32768 D=128 causal", shape(1, 8, 32768, 128, True), "headline", targets=ref)]
    out += [Row(f"H=16 N={n} D=64{' causal' if causal else ''}", shape(1, 16, n, 64, causal))
            for n in (5000, 8191, 12345) for causal in (True, False)]
    out.append(Row("D_t=128 → D_s=64, H=16 N=8192", shape(1, 16, 8192, 128, False, d_s=64)))
    packed = (("ratio_separate", SEPARATE_TARGET), ("ratio_cudnn", CUDNN_TARGET))
    out += [Row(f"packed: 8 documents in 32768 tokens (thd, offsets on the {where}), H=16 D=64 causal",
                shape(1, 16, 32768, 64, True), docs=8, on_cpu=where == "CPU", targets=packed)
            for where in ("GPU", "CPU")]
    dense, fractions = "B=4 H=16 N=8192 D=64 causal, no mask", (1.0, 0.8, 0.55, 0.3)
    out.append(Row(dense, shape(4, 16, 8192, 64, True)))
    for where in ("GPU", "CPU"):
        out += [Row(f"B=4 right-padded 100/80/55/30% (key and query masks on the {where})",
                    shape(4, 16, 8192, 64, True), lengths=fractions, masks=("key", "query"), dense_row=dense,
                    on_cpu=where == "CPU",
                    targets=(("ratio_same_work", SAME_WORK_TARGET), ("ratio_cudnn", CUDNN_TARGET))),
                Row(f"B=4 all-True key_padding_mask on the {where}", shape(4, 16, 8192, 64, True),
                    lengths=(1.0,) * 4, masks=("key",), dense_row=dense, on_cpu=where == "CPU",
                    targets=(("ratio_same_work", ALL_TRUE_TARGET), ("ratio_cudnn", CUDNN_TARGET)))]
    out += [Row("fp16 B=4 H=16 N=8192 D=64 causal", shape(4, 16, 8192, 64, True, dtype="float16")),
            Row("window 4096 at N=32768, H=16 D=64 causal", shape(1, 16, 32768, 64, True),
                window=tiny(4096), targets=packed)]
    out += [Row(f"GQA H=32/8 N={n} D=128 causal", shape(1, 32, n, 128, True, h_kt=8)) for n in (8191, 12345)]
    out.append(Row("sinks (gpt-oss), GQA H=64/8 N=8192 D=64 causal", shape(1, 64, 8192, 64, True, h_kt=8),
                   sinks=True))
    out += [Row(f"BERT B=8 H=12 N=512 D=64, {p} pair{'s' * (p > 1)}", shape(8, 12, 512, 64, False),
                pairs=2 if smoke and p > 1 else p, against_sdpa_back_to_back=True,
                targets=(("ratio_cudnn", BERT_TARGET),) if p == 1 else ())
            for p in (1, 12)]
    out.append(Row("BERT B=8 H=12 N=512 D=64, 12 pairs fused as the engine runs them", shape(8, 12, 512, 64, False),
                   pairs=2 if smoke else 12, against_sdpa_back_to_back=True, fused=True, targets=()))
    return out


# ---------------------------------------------------------------------------------------------- the problems
def doc_lengths(total: int, docs: int, seed: int = 0) -> list[int]:
    """``docs`` random lengths (each >= 1) summing to ``total``, the same for a seed on every machine.

    Example:
        >>> lengths = doc_lengths(32768, 8)
        >>> len(lengths), sum(lengths), min(lengths) >= 1
        (8, 32768, True)
    """
    cuts = sorted(random.Random(seed).sample(range(1, total), docs - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


def allowed_elements(row: Row) -> float:
    """Score elements the row's masks allow, over every (batch, head).

    Example:
        >>> allowed_elements(Row("w", Shape(1, 1, 8, 4, True), window=4))  # rows 0-3 see 1-4 keys, rows 4-7 four
        26.0
    """
    s = row.shape
    tri = (lambda n: n * (n + 1) / 2) if s.causal else (lambda n: float(n * n))
    if row.window:
        return s.b * s.h * (tri(row.window) + (s.n - row.window) * row.window)
    if row.docs:
        return s.h * sum(tri(n) for n in doc_lengths(s.n, row.docs))
    if row.lengths:
        return s.h * sum(tri(round(f * s.n)) for f in row.lengths)
    return s.b * s.h * tri(s.n) * row.pairs


def _leaf(x, grad: bool):
    return x.detach().contiguous().requires_grad_(grad)


def _sdpa_args(q_s, k_s, mask=None, causal: bool = False) -> tuple:
    import torch

    return (_leaf(q_s, True), _leaf(k_s, True), torch.randn_like(k_s).requires_grad_(), mask, causal)


def problem(row: Row, device: str) -> dict[str, Any]:
    """The tensors of a row: ``ours`` (a list of ``(q_t, k_t, q_s, k_s)`` and the op's options), ``sdpa`` (SDPA's
    ``(q, k, v, attn_mask, causal)`` per call), and the packed and window rows' ``separate`` problems (ours, SDPA's)."""
    import torch

    s = row.shape
    sets = [make_inputs(s, device, seed=i) for i in range(row.pairs)]
    kw: dict[str, Any] = {"causal": s.causal}
    out: dict[str, Any] = {"ours": (sets, kw), "sdpa": [_sdpa_args(x[2], x[3], causal=s.causal) for x in sets]}
    idx = torch.arange(s.n, device=device)
    if row.lengths:
        real = idx[None, :] < torch.tensor([round(f * s.n) for f in row.lengths], device=device)[:, None]
        given = real.cpu() if row.on_cpu else real
        kw.update({"key_padding_mask": given} if row.masks == ("key",) else
                  {"key_padding_mask": given, "query_mask": given.clone()})
        mask = real[:, None, None, :] & (idx[None, :] <= idx[:, None] if s.causal else True)
        out["sdpa"] = [_sdpa_args(sets[0][2], sets[0][3], mask)]
    if row.sinks:
        kw["sinks_t"] = torch.randn(s.h, device=device)
        kw["sinks_s"] = torch.randn(s.h, device=device, requires_grad=True)
    if row.window:
        kw["window"] = (row.window - 1, 0)
        band = (idx[None, :] <= idx[:, None]) & (idx[None, :] > idx[:, None] - row.window)
        out["sdpa"] = [_sdpa_args(sets[0][2], sets[0][3], band[None, None])]
        same = Shape(s.n // row.window, s.h, row.window, s.d, False, s.dtype, s.h_kt, s.d_s)
        base = make_inputs(same, device, seed=1)
        out["separate"] = ([base], {"causal": False}, [_sdpa_args(base[2], base[3])])
        out["separate_elements"] = float(same.b * same.h * same.n * same.n)
    if row.docs:
        lengths = doc_lengths(s.n, row.docs)
        thd = [_leaf(x[0].transpose(0, 1), x.requires_grad) for x in sets[0]]  # (N, H, D)
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
        given = cu.cpu() if row.on_cpu else cu
        kw.update(layout="thd", cu_seqlens_q=given, cu_seqlens_k=given, max_seqlen_q=max(lengths),
                  max_seqlen_k=max(lengths))
        out["ours"] = ([thd], kw)
        docs = [[_leaf(x[a:b].transpose(0, 1)[None], x.requires_grad) for x in thd]
                for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
        out["separate"] = (docs, {"causal": True}, [_sdpa_args(d[2], d[3], causal=True) for d in docs])
        out["sdpa"], out["doc_lengths"] = out["separate"][2], lengths  # SDPA has no packed layout
    return out


# ---------------------------------------------------------------------------------------------- the calls
def ours_fwd_bwd(sets: list, kw: dict, package: Any = None) -> Callable[[], None]:
    """One forward+backward of the op over ``sets`` (back-to-back calls, their losses summed); ``package``: the
    ``streamkl`` to call (default: this tree's; ``ab.py`` passes another revision's)."""
    import torch

    attention_kl = (package or importlib.import_module("streamkl")).attention_kl
    leaves = [x for s in sets for x in s if x.requires_grad]

    def run() -> None:
        loss = None
        for s in sets:
            kl = attention_kl(*s, reduction="mean", backend="triton", **kw)
            loss = kl if loss is None else loss + kl
        torch.autograd.grad(loss, leaves)

    return run


def engine_fwd_bwd(sets: list, kw: dict) -> Callable[[], None]:
    """One forward+backward of the pairs ``sets`` as the engine runs them (:func:`lightning_streamkl.terms.run_terms`:
    pairs of one shape and mask as one call on their heads concatenated), each pair's mean summed."""
    import torch

    from lightning_streamkl.capture.masks import Masking
    from lightning_streamkl.terms import TermCall, run_terms
    from streamkl.options import AttentionKLOptions

    calls = [TermCall(*s, Masking(causal=kw["causal"]), options=AttentionKLOptions(backend="triton")) for s in sets]
    leaves = [x for s in sets for x in s if x.requires_grad]

    def run() -> None:
        loss = sum((r.kl_sums / r.rows).sum() for r in run_terms(calls))
        torch.autograd.grad(loss, leaves)

    return run


def sdpa_fwd_bwd(calls: list[tuple], device: str) -> tuple[Callable[[], None], str, str]:
    """``(run, backend, note)``: SDPA forward+backward of ``calls`` back to back with random upstream gradients, on
    cuDNN if it takes them, else the default backend (the CPU: the math backend); ``note`` says why cuDNN refused."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = [x for c in calls for x in c[:3]]
    grads = [torch.randn(*c[0].shape[:-1], c[2].shape[-1], device=device, dtype=c[0].dtype) for c in calls]

    def runner(backend) -> Callable[[], None]:
        def run() -> None:
            with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                outs = [F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=c and m is None)
                        for q, k, v, m, c in calls]
            torch.autograd.grad(outs, leaves, grads)
        return run

    note = ""
    choices = [("math", SDPBackend.MATH)] if device == "cpu" else [("cudnn", SDPBackend.CUDNN_ATTENTION),
                                                                   ("default", None)]
    for name, backend in choices:
        try:
            runner(backend)()
            return runner(backend), name, note
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as err:
            note = f"{name} refused: {str(err).strip().splitlines()[0][:200]}"
    raise RuntimeError(note)


@contextlib.contextmanager
def chosen_kernels() -> Iterator[dict[str, str]]:
    """Inside the block, the kernels that the dispatch table selects for each stage (stage -> kernel, or kernels
    joined by " + " in the order first selected: a right-padded batch runs one call per batch row), read by wrapping
    ``streamkl.dispatch.select``."""
    from streamkl import dispatch

    seen: dict[str, str] = {}
    select = dispatch.select

    def spy(stage: str, query: Any):
        route = select(stage, query)
        kernels = seen[stage].split(" + ") if stage in seen else []
        seen[stage] = " + ".join(kernels if route.kernel in kernels else [*kernels, route.kernel])
        return route

    dispatch.select = spy
    try:
        yield seen
    finally:
        dispatch.select = select


def bench_ms(fn: Callable[[], object], device: str) -> float:
    """A ``do_bench`` median on the GPU; one wall-clock call on the CPU (the smoke)."""
    if device == "cuda":
        return common.do_bench_ms(fn, rep=REP_MS, warmup=WARMUP_MS)
    return common.wall_ms(fn, iters=1, device="cpu", warmup=0)


#: Calls of a row timed back to back for :func:`time_split` (about this many ms of them; at least 3).
SPLIT_MS = 200.0


def time_split(fn: Callable[[], object], ms: float, device: str) -> dict[str, float | None]:
    """Where one call's time goes (``ms``: its ``do_bench`` time, which sets how many calls are timed):
    ``host_ms``, the host's time to enqueue one call of back-to-back calls (the GPU not waited for);
    ``back_to_back_ms``, the wall time per call of those calls, synchronised at the end. A call whose host time reaches
    its kernel time (:func:`kernel_ms`) is bound by the host. On the CPU (the smoke, whose ``ms`` is one call's wall
    time) only ``back_to_back_ms``: ``ms`` itself, so the interpreter runs no call again.

    Example:
        >>> time_split(lambda: None, 1.5, "cpu")
        {'host_ms': None, 'back_to_back_ms': 1.5}
    """
    import torch

    if device != "cuda":
        return {"host_ms": None, "back_to_back_ms": ms}
    calls = max(3, round(SPLIT_MS / max(ms, 1e-3)))
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return {"host_ms": host / calls * 1e3, "back_to_back_ms": wall / calls * 1e3}


def kernel_ms(fn: Callable[[], object], ms: float) -> float:
    """The GPU's kernel time per call of ``fn`` (ms; the CUDA activity torch's profiler records over back-to-back
    calls, about :data:`SPLIT_MS` / 4 of them by ``ms``, its ``do_bench`` time). :func:`run` takes it only after every
    row is timed, so that no timing follows a use of the profiler (a scratch probe once saw a host-bound call's host
    time rise after it; :func:`host_after_profiler` checks it in every run)."""
    import torch

    calls = max(2, round(SPLIT_MS / max(ms, 1e-3)) // 4)
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / calls / 1e3  # µs -> ms


def attempt(fn: Callable[[], Any]) -> Any:
    """``fn()``, or ``"OOM"`` / ``"error: ..."`` when it fails (a failed row is a result, not the end of the run)."""
    import torch

    try:
        return fn()
    except torch.OutOfMemoryError:
        return "OOM"
    except Exception as err:
        return f"error: {type(err).__name__}: {str(err).strip()[:200]}"


def ours_call(row: Row, p: dict[str, Any]) -> Callable[[], None]:
    """The forward+backward of ``row`` through the op, on its problem ``p`` (:func:`problem`)."""
    return (engine_fwd_bwd if row.fused else ours_fwd_bwd)(*p["ours"])


def measure(row: Row, device: str) -> dict[str, Any]:
    """One row's record: our time and the kernels chosen, its baselines' times, and what its ratios need (all but
    ``kernels_ms``, which :func:`add_kernel_time` adds once every row is timed)."""
    rec: dict[str, Any] = {"name": row.name, "group": row.group, "shape": asdict(row.shape), "pairs": row.pairs,
                           "lengths": list(row.lengths), "masks": list(row.masks), "docs": row.docs,
                           "window": row.window, "sinks": row.sinks, "dense_row": row.dense_row,
                           "targets": dict(row.targets), "allowed_elements": allowed_elements(row)}
    p = attempt(lambda: problem(row, device))
    if isinstance(p, str):
        return {**rec, "ms": p}
    ours = ours_call(row, p)

    def time_ours() -> float:
        with chosen_kernels() as kernels:
            first = bench_ms(ours, "cpu")  # compiles on the GPU; on the CPU (one call) the time itself
        rec["kernels"] = kernels
        return first if device == "cpu" else bench_ms(ours, device)

    rec["ms"] = attempt(time_ours)
    sdpa = attempt(lambda: sdpa_fwd_bwd(p["sdpa"], device))
    ok = isinstance(sdpa, tuple)
    rec["cudnn_backend"], rec["cudnn_note"] = (sdpa[1], sdpa[2]) if ok else (None, sdpa)
    rec["cudnn_ms"] = attempt(lambda: bench_ms(sdpa[0], device)) if ok else sdpa
    if "separate" in p:
        sets, kw, calls = p["separate"]
        rec["separate_ms"] = attempt(lambda: bench_ms(ours_fwd_bwd(sets, kw), device))
        rec["separate_elements"] = p.get("separate_elements", rec["allowed_elements"])
        if row.window:
            same = attempt(lambda: sdpa_fwd_bwd(calls, device))
            rec["cudnn_same_work_ms"] = attempt(lambda: bench_ms(same[0], device)) if isinstance(same, tuple) else same
            rec["cudnn_same_work_backend"] = same[1] if isinstance(same, tuple) else None
    if "doc_lengths" in p:
        rec["doc_lengths"] = p["doc_lengths"]
    if isinstance(rec["ms"], float):
        split = attempt(lambda: time_split(ours, rec["ms"], device))
        rec.update(split if isinstance(split, dict) else {"back_to_back_ms": split})
    if row.against_sdpa_back_to_back and ok and isinstance(rec["cudnn_ms"], float):
        split = attempt(lambda: time_split(sdpa[0], rec["cudnn_ms"], device))
        rec["sdpa_back_to_back_ms"] = split["back_to_back_ms"] if isinstance(split, dict) else split
    return rec


def add_kernel_time(rec: dict[str, Any], row: Row, device: str) -> dict[str, Any]:
    """``rec`` with ``kernels_ms``, our call's GPU kernel time (:func:`kernel_ms`; None on the CPU or without a timed
    call)."""
    if device != "cuda" or not isinstance(rec.get("ms"), float):
        return {**rec, "kernels_ms": None}
    p = attempt(lambda: problem(row, device))
    timed = p if isinstance(p, str) else attempt(lambda: kernel_ms(ours_call(row, p), rec["ms"]))
    return {**rec, "kernels_ms": timed}


#: The row whose host time :func:`host_after_profiler` takes again once the profiler has run (a host-bound one).
PROFILER_PROBE_ROW = "H=16 N=5000 D=64 causal"


def host_after_profiler(records: list[dict[str, Any]]) -> dict[str, Any]:
    """What the profiler's use did to the host path: :data:`PROFILER_PROBE_ROW`'s host time per call
    (:func:`time_split`), timed before the profiler first ran (its record's) and again now, after it ran for every
    row's kernel time."""
    row = next(r for r in rows() if r.name == PROFILER_PROBE_ROW)
    before = next(r for r in records if r["name"] == row.name)
    after = time_split(ours_call(row, problem(row, "cuda")), before["ms"], "cuda")
    return {"row": row.name, "host_ms_before": before.get("host_ms"), "host_ms_after": after["host_ms"]}


def ab_cases(device: str = "cuda", quick: bool = True) -> dict[str, Callable[[Any], Callable[[], None]]]:
    """The rows' forward+backward calls for ``benchmarks/ab.py --bench real``: row name -> a function of a
    ``streamkl`` package returning the call; ``quick``: the "real batches" group only (else the headline rows too);
    on the CPU the smoke's tiny shapes.

    Example:
        >>> import streamkl
        >>> cases = ab_cases("cpu")
        >>> cases["fp16 B=4 H=16 N=8192 D=64 causal"](streamkl)()
    """
    def case(row: Row) -> Callable[[Any], Callable[[], None]]:
        def make(package: Any) -> Callable[[], None]:
            sets, kw = problem(row, device)["ours"]
            return ours_fwd_bwd(sets, kw, package)
        return make

    return {row.name: case(row) for row in rows(smoke=device == "cpu")
            if not row.fused and (not quick or row.group == "real batches")}


# ---------------------------------------------------------------------------------------------- ratios
def _ratio(a: Any, b: Any, scale: float = 1.0) -> float | None:
    ok = all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in (a, b))
    return a / (b * scale) if ok and scale > 0 else None


def derive(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every record with its ratios (None where a time is missing) and ``met``: every target's ratio within it (None
    without targets or with a ratio missing).

    Example:
        >>> derive([{"name": "r", "ms": 1.3, "cudnn_ms": 1.0, "targets": {"ratio_cudnn": 1.25}}])[0]["met"]
        False
    """
    by_name = {r["name"]: r for r in records}
    out = []
    for r in records:
        r = dict(r)
        r["ratio_cudnn"] = _ratio(r.get("ms"), r.get("cudnn_ms"))
        if "separate_ms" in r:
            work = r["allowed_elements"] / r["separate_elements"]
            r["ratio_separate"] = _ratio(r["ms"], r["separate_ms"], work)
            if "cudnn_same_work_ms" in r:
                r["ratio_cudnn_same_work"] = _ratio(r["ms"], r["cudnn_same_work_ms"], work)
        if r.get("dense_row"):
            dense = by_name.get(r["dense_row"], {})
            r["allowed_fraction"] = r["allowed_elements"] / dense.get("allowed_elements", math.nan)
            r["ratio_same_work"] = _ratio(r.get("ms"), dense.get("ms"), r["allowed_fraction"])
        if "sdpa_back_to_back_ms" in r:
            r["ratio_back_to_back"] = _ratio(r.get("back_to_back_ms"), r["sdpa_back_to_back_ms"])
        ratios = [r.get(k) for k in r.get("targets", {})]
        r["met"] = (None if not ratios or None in ratios else
                    all(r[k] <= goal for k, goal in r["targets"].items()))
        out.append(r)
    return out


# ---------------------------------------------------------------------------------------------- the run
def run(smoke: bool, out: str) -> dict[str, Any]:
    """Measure every row (``smoke``: the tiny rows on the CPU), writing ``out`` after each row."""
    import torch

    device = "cpu" if smoke else "cuda"
    data: dict[str, Any] = {
        "device": "cpu (smoke)" if smoke else torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": __import__("triton").__version__, "host": platform.node(), "smoke": smoke,
        "do_bench_ms": {"rep": REP_MS, "warmup": WARMUP_MS}, "complete": False, "rows": []}
    began = time.perf_counter()
    for row in rows(smoke):
        start = time.perf_counter()
        data["rows"].append(measure(row, device))
        data["rows"] = derive(data["rows"])
        _release(device)
        r = data["rows"][-1]
        print(f"{row.name}: {r['ms'] if isinstance(r['ms'], str) else round(r['ms'], 3)} ms, "
              f"/cuDNN {r['ratio_cudnn'] and round(r['ratio_cudnn'], 2)} ({r.get('cudnn_backend')}), "
              f"met {r['met']} ({time.perf_counter() - start:.1f} s)", flush=True)
        common.write_json(out, data)
    # the kernels' time last: no timing follows a use of torch's profiler (kernel_ms)
    for i, row in enumerate(rows(smoke)):
        data["rows"][i] = add_kernel_time(data["rows"][i], row, device)
        _release(device)
    if device == "cuda":
        data["after_profiler"] = attempt(lambda: host_after_profiler(data["rows"]))
    data["complete"], data["wall_s"] = True, time.perf_counter() - began
    common.write_json(out, data)
    return data


def _release(device: str) -> None:
    """Free what the last row left (its tensors, and on the GPU the allocator's cached blocks) before the next."""
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- the table
def _f(x: Any, digits: int = 2, unit: str = "") -> str:
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return f"{x:.{digits}f}{unit}"
    return "–" if x is None else str(x).split(":")[0]


def _targets(targets: dict[str, float], group: str) -> str:
    names = {"ratio_cudnn": "÷ cuDNN", "ratio_separate": "÷ separate", "ratio_same_work": "÷ same work"}
    return ("; ".join(f"{names[k]} ≤ {goal:g}" for k, goal in targets.items())
            or ("(reference row)" if group == "headline" else "(no target)"))


#: QK^T-sized products per score element of a frozen-teacher training call, by the head dim they run at: the
#: teacher's scores in the training forward and again in the key pass; the student's scores in both, the two query-
#: gradient products of the training forward and the key gradient of the key pass. cuDNN's forward+backward on the
#: student's shapes runs seven at the student's head dim (the scores and P·V; the scores again, dP, dV, dQ and dK).
TEACHER_PRODUCTS, STUDENT_PRODUCTS, CUDNN_PRODUCTS = 2, 5, 7


def products_over_cudnn(shape: dict[str, Any]) -> float:
    """The tensor-core work of our training call over cuDNN's forward+backward on the student's shapes, per score
    element (:data:`TEACHER_PRODUCTS`, ...): 1 where teacher and student share their head dim.

    Example:
        >>> products_over_cudnn({"d": 128, "d_s": 64}), products_over_cudnn({"d": 64, "d_s": None})
        (1.2857142857142858, 1.0)
    """
    d_t, d_s = shape["d"], shape.get("d_s") or shape["d"]
    return (TEACHER_PRODUCTS * d_t + STUDENT_PRODUCTS * d_s) / (CUDNN_PRODUCTS * d_s)


def _other(r: dict[str, Any]) -> str:
    work = products_over_cudnn(r["shape"]) if "shape" in r else 1.0
    if work == 1.0:
        return _baseline_ratio(r)
    ratio = r.get("ratio_cudnn")
    per_work = ratio / work if isinstance(ratio, float) else None
    return "; ".join(filter(None, (f"products ÷ cuDNN's {_f(work)}×; ÷ cuDNN × that: {_f(per_work)}×",
                                   _baseline_ratio(r))))


def _baseline_ratio(r: dict[str, Any]) -> str:
    if r.get("ratio_separate") is not None or "separate_ms" in r:
        what = "the documents run separately" if r.get("docs") else "the op on the same work, dense"
        extra = f"; cuDNN same work {_f(r.get('ratio_cudnn_same_work'))}×" if "cudnn_same_work_ms" in r else ""
        return f"÷ {what}: {_f(r.get('ratio_separate'))}×{extra}"
    if r.get("dense_row"):
        return f"÷ dense × allowed {_f(r.get('allowed_fraction'))}: {_f(r.get('ratio_same_work'))}×"
    if "sdpa_back_to_back_ms" in r:
        per_pair = [x * 1e3 / r.get("pairs", 1) if isinstance(x, float) else x
                    for x in (r.get("back_to_back_ms"), r["sdpa_back_to_back_ms"])]
        return f"back to back {_f(per_pair[0], 0)} µs per pair, SDPA {_f(per_pair[1], 0)}"
    return ""


def _split(r: dict[str, Any]) -> str:
    return f"{_f(r.get('host_ms'))} · {_f(r.get('kernels_ms'))}"


def table(data: dict[str, Any]) -> str:
    """The results as a markdown table (a preamble line, then one line per row)."""
    done = "" if data.get("complete", True) else " **The run stopped before its last row.**"
    lines = [f"{data['device']}, torch {data['torch']}, Triton {data['triton']}; `do_bench` medians (ms) of "
             "forward+backward, each baseline measured in the same run; cuDNN: SDPA on the student's shapes "
             "(the backend that ran in brackets); host · GPU: per call of back-to-back calls, the host's time to "
             "enqueue it and its kernels' time on the GPU (ms; a row whose host time reaches its kernel time is "
             f"bound by the host).{done}", "",
             "| batch | fwd+bwd (ms) | cuDNN (ms) | ÷ cuDNN | other ratio | target | met | host · GPU (ms) "
             "| kernels: fwd, key pass |",
             "|---|---|---|---|---|---|---|---|---|"]
    probe = data.get("after_profiler")
    if isinstance(probe, dict):
        lines[0] += (f" The kernels' times are taken after every row is timed; the {probe['row']} row's host time "
                     f"per call was {_f(probe['host_ms_before'])} ms before torch's profiler first ran and "
                     f"{_f(probe['host_ms_after'])} ms after.")
    for r in data["rows"]:
        k = r.get("kernels", {})
        kernels = ", ".join(f"`{k[s]}`" for s in ("training forward", "forward", "key pass") if s in k)
        met = {True: "met", False: "**missed**", None: "–"}[r.get("met")]
        lines.append(f"| {r['name']} | {_f(r.get('ms'), 3)} | {_f(r.get('cudnn_ms'), 3)} "
                     f"({r.get('cudnn_backend') or '–'}) | {_f(r.get('ratio_cudnn'))}× | {_other(r)} | "
                     f"{_targets(r.get('targets', {}), r.get('group', ''))} | {met} | {_split(r)} | {kernels} |")
    return "\n".join(lines)


def not_run() -> str:
    """The block while no GPU has run this section: the command, and the rows it will measure."""
    lines = [f"This section has not been run on a GPU yet: no numbers. `{COMMAND}` on one GPU writes "
             "`benchmarks/results/<gpu>-real-batches.json`, and `python benchmarks/real_batches.py --render` (the "
             "rendered run's file, or the one given) puts its table here. The rows it measures, with the issue's "
             "targets:",
             "", "| batch | target |", "|---|---|"]
    lines += [f"| {r.name} | {_targets(dict(r.targets), r.group)} |" for r in rows()]
    return "\n".join(lines)


def load(path: str | None = None) -> dict[str, Any] | None:
    """The results file at ``path`` (default :data:`RESULT`); None while the committed run does not exist."""
    path = path or RESULT
    return None if path == RESULT and not os.path.exists(path) else common.read_json(path)


def blocks(data: dict[str, Any] | None) -> dict[str, str]:
    """docs/concepts/kernels.md's block: the table of ``data``, or what to run while there is none."""
    return {BLOCK: not_run() if data is None else table(data)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="results file (default: benchmarks/results/<gpu>-real-batches.json)")
    parser.add_argument("--cpu-smoke", action="store_true", help="the same rows on tiny shapes, on the CPU")
    parser.add_argument("--render", nargs="?", const="", help="write a results file's table (default: the rendered "
                        "committed run, or what to run while there is none) into docs/concepts/kernels.md")
    args = parser.parse_args(argv)
    if args.render is not None:
        common.write_blocks(DOC, blocks(load(args.render)))
        print(f"wrote {BLOCK} into {os.path.relpath(DOC, common.ROOT)}")
        return
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        raise SystemExit("real_batches.py needs a CUDA GPU (or --cpu-smoke)")
    tag = "cpu-smoke" if args.cpu_smoke else common.gpu_tag(torch.cuda.get_device_name())
    out = args.out or os.path.join(common.RESULTS, f"{tag}-real-batches.json")
    data = run(args.cpu_smoke, out)
    print(table(data))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
