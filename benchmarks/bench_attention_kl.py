"""Benchmark the attention-KL op against the naive loss and FlashAttention-class attention (GPU).

Times, with ``triton.testing.do_bench`` medians in one run: streamkl forward / backward / forward+backward,
the naive materialising loss (eager, and under ``torch.compile``; both imported from ``streamkl.naive``),
and torch SDPA forward / forward+backward with the default backend (cuDNN on H100) and with the
FLASH_ATTENTION backend on the same shapes. It also measures the card's ceilings (exp2 rate, bf16 matmul,
copy bandwidth) in the same run and derives the exp-bound and matmul-bound times, and records the peak
memory of each forward+backward (``"OOM"`` when it does not fit).

    python benchmarks/bench_attention_kl.py                 # full grid -> benchmarks/results/<gpu>.json
    python benchmarks/bench_attention_kl.py --quick         # a few shapes -> benchmarks/results/runs/<gpu>-quick.json
    python benchmarks/bench_attention_kl.py --max-n 4096    # re-measure the short rows, merged into <gpu>.json
    python benchmarks/bench_attention_kl.py --memory-only   # memory rows only -> results/runs/<gpu>-memory.json
    python benchmarks/bench_attention_kl.py --merge RUN --note "..."  # fold RUN's records into <gpu>.json
    python benchmarks/bench_attention_kl.py --out RUN.json --resume  # continue the run stopped in RUN.json.partial
    python benchmarks/report.py                             # tables + plots under docs/

Only a full run replaces the grid ``benchmarks/results/<gpu>.json``; a partial run never does: ``--quick`` writes a
run file of its own (fold it in with ``--merge``) and ``--max-n`` merges its records into the grid, keeping every row
it did not re-measure. While a run measures, its records go to ``<out>.partial`` (the output is only written at the
end, atomically); an interrupted run leaves the output untouched, and ``--merge <out>.partial`` keeps what it measured,
or ``--resume`` (with the options it was started with) measures the rest on the same kind of card, with the first
part's ceilings (the full grid can be measured over several calls).

Run it from an installed checkout (``pip install -e .``) or with ``PYTHONPATH=kernels``.

Timing assertions never go into tests; the numbers here are ratios measured in one run.
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
import torch.nn.functional as F

from streamkl import attention_kl
from streamkl.naive import naive_attention_kl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS, Shape, do_bench_ms, gpu_tag, make_inputs, write_json


@dataclass
class Record:
    provider: str
    mode: str  # fwd | bwd | fwd+bwd | mem
    shape: dict
    ms: float | None = None
    peak_bytes: int | None = None
    status: str = "ok"
    extra: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------- ceilings
def measure_ceilings() -> dict:
    """exp2 rate (MUFU), bf16 matmul rate and device copy bandwidth, measured on this card now."""
    import triton
    import triton.language as tl

    @triton.jit
    def _exp2_chain(X, Y, ITERS: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + offs)
        a = x
        b = x + 1.0
        c = x + 2.0
        d = x + 3.0
        for _ in range(ITERS):  # four independent chains keep the MUFU pipe busy
            a = tl.exp2(a * -0.5)
            b = tl.exp2(b * -0.5)
            c = tl.exp2(c * -0.5)
            d = tl.exp2(d * -0.5)
        tl.store(Y + offs, a + b + c + d)

    n, iters, block = 1 << 24, 256, 1024
    x = torch.rand(n, device="cuda")
    y = torch.empty_like(x)
    ms = do_bench_ms(lambda: _exp2_chain[(n // block,)](x, y, ITERS=iters, BLOCK=block, num_warps=8))
    exp_rate = n * iters * 4 / (ms * 1e-3)

    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    bm = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    ms = do_bench_ms(lambda: a @ bm)
    mm_rate = 2 * m**3 / (ms * 1e-3)

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = do_bench_ms(lambda: dst.copy_(src))
    copy_bw = 2 * src.numel() / (ms * 1e-3)
    return {"exp2_per_s": exp_rate, "bf16_matmul_flops": mm_rate, "copy_bytes_per_s": copy_bw}


def bounds(shape: Shape, ceilings: dict) -> dict:
    """Lower bounds (ms) of the forward and of the student backward from the measured ceilings."""
    e = shape.elements()
    d_s = shape.d_s or shape.d
    exp_fwd = 2 * e / ceilings["exp2_per_s"] * 1e3
    mm_fwd = 2 * e * (shape.d + d_s) / ceilings["bf16_matmul_flops"] * 1e3
    exp_bwd = 2 * e / ceilings["exp2_per_s"] * 1e3
    mm_bwd = 2 * e * (shape.d + d_s + 2 * d_s) / ceilings["bf16_matmul_flops"] * 1e3
    return {
        "fwd_exp_ms": exp_fwd, "fwd_matmul_ms": mm_fwd, "fwd_bound_ms": max(exp_fwd, mm_fwd),
        "bwd_exp_ms": exp_bwd, "bwd_matmul_ms": mm_bwd, "bwd_bound_ms": max(exp_bwd, mm_bwd),
    }


# ---------------------------------------------------------------------------------------------- providers
def _grad_targets(inputs):
    return [x for x in inputs if x.requires_grad]


def streamkl_fns(shape: Shape, inputs, deterministic: bool = True):
    kw = dict(causal=shape.causal, backend="triton", deterministic=deterministic)
    fwd = lambda: attention_kl(*inputs, **kw)
    return fwd, kw


def naive_fn(shape: Shape, inputs, compiled: bool):
    fn = lambda *x: naive_attention_kl(*x, causal=shape.causal, compute_dtype=torch.float32)
    if compiled:
        fn = torch.compile(fn, dynamic=False)
    return lambda: fn(*inputs)


def sdpa_fn(shape: Shape, backend: str | None):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dt = getattr(torch, shape.dtype)
    q, k, v = (torch.randn(shape.b, shape.h, shape.n, shape.d, device="cuda", dtype=dt, requires_grad=True)
               for _ in range(3))

    def run():
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)

    return run, (q, k, v)


def time_fwd_bwd(provider: str, shape: Shape, make_fwd, targets) -> list[Record]:
    """Forward, backward (graph retained) and forward+backward times of one provider."""
    out = []
    sd = asdict(shape)
    try:
        fwd = make_fwd
        with torch.no_grad():
            ms_f = do_bench_ms(fwd)
        out.append(Record(provider, "fwd", sd, ms=ms_f))
        y = fwd()
        grad = torch.randn_like(y) if y.dim() else None
        ms_b = do_bench_ms(lambda: torch.autograd.grad(y, targets, grad, retain_graph=True))
        out.append(Record(provider, "bwd", sd, ms=ms_b))
        y = None  # free the retained graph before timing forward+backward

        def fb():
            z = fwd()
            torch.autograd.grad(z, targets, grad)

        out.append(Record(provider, "fwd+bwd", sd, ms=do_bench_ms(fb)))
    except torch.OutOfMemoryError:
        out.append(Record(provider, "fwd+bwd", sd, status="OOM"))
    except Exception as exc:  # a baseline that cannot run this shape is recorded, not fatal
        out.append(Record(provider, "fwd+bwd", sd, status=f"error: {type(exc).__name__}: {exc}"[:300]))
    gc.collect()
    torch.cuda.empty_cache()
    return out


def peak_memory(provider: str, shape: Shape, make) -> Record:
    """Peak bytes allocated by one forward+backward beyond the inputs (``OOM`` if it does not fit)."""
    sd = asdict(shape)
    gc.collect()
    torch.cuda.empty_cache()
    try:
        fwd, targets = make()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        y = fwd()
        torch.autograd.grad(y, targets, torch.randn_like(y) if y.dim() else None)
        torch.cuda.synchronize()
        rec = Record(provider, "mem", sd, peak_bytes=torch.cuda.max_memory_allocated() - base)
        del y, fwd, targets
    except torch.OutOfMemoryError:
        rec = Record(provider, "mem", sd, status="OOM")
    gc.collect()
    torch.cuda.empty_cache()
    return rec


# -------------------------------------------------------------------------------------------------- grid
def time_grid(quick: bool, max_n: int | None = None) -> list[Shape]:
    if max_n is not None:  # re-measure the short-context rows only
        return [Shape(1, 16, n, d, c) for d in (64, 128) for c in (False, True) for n in (1024, 2048, 4096, 8192)
                if n <= max_n]
    if quick:
        return [Shape(1, 16, 8192, d, c) for d in (64, 128) for c in (False, True)]
    shapes = [Shape(1, h, n, d, c) for h in (16, 32) for d in (64, 128) for c in (False, True)
              for n in (1024, 2048, 4096, 8192, 16384, 32768)]
    shapes += [
        Shape(1, 16, 8192, 64, False, dtype="float16"),
        Shape(1, 16, 4096, 64, False, dtype="float32"),
        Shape(1, 16, 8192, 128, True, h_kt=4),  # GQA teacher
        Shape(1, 16, 8192, 128, True, d_s=64),  # D_t != D_s
        Shape(1, 16, 8192, 64, False, teacher_grad=True),
        Shape(1, 16, 8192, 64, True, teacher_grad=True),
    ]
    return shapes


def memory_grid(quick: bool, max_n: int | None = None) -> list[Shape]:
    if max_n is not None:
        return []
    if quick:
        return [Shape(1, 16, n, 64, True) for n in (8192, 16384)]
    shapes = [Shape(1, 16, n, 64, True) for n in (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)]
    shapes += [Shape(1, 32, 131072, 128, True)]
    return shapes


def _rows(quick: bool, max_n: int | None, memory_only: bool) -> dict:
    """The options that choose a run's rows, as its results file records them (``--resume`` checks them)."""
    return {"quick": quick, "max_n": max_n, "memory_only": memory_only}


def shape_key(shape: dict) -> str:
    """A record's shape (``asdict(Shape)``) as a hashable key: two records are of the same row when their keys match."""
    return json.dumps(shape, sort_keys=True)


def measured(records: list[dict]) -> tuple[set, set]:
    """What ``records`` (a run's, possibly interrupted) already hold: the ``(shape, provider)`` pairs of its memory
    rows and the shapes of its timed rows, each shape as its :func:`shape_key`. A timed
    shape's records are written together, after all its providers, so any timed record marks the shape done."""
    memory = {(shape_key(r["shape"]), r["provider"]) for r in records if r["mode"] == "mem"}
    timed = {shape_key(r["shape"]) for r in records if r["mode"] != "mem"}
    return memory, timed


def run(quick: bool, naive_max_n: int, compile_n: int, progress: str | None = None,
        max_n: int | None = None, memory_only: bool = False, resume: dict | None = None) -> dict:
    """Measure the grid (``quick``: the headline rows; ``max_n``: the H=16 rows up to that N; ``memory_only``: the
    full grid's memory rows and nothing else) and return this run's results file (its metadata and its records
    only). After every shape the records so far are written to ``progress``. ``resume`` (the progress file of an
    interrupted run of the same rows on the same card) continues that run: its ceilings and records are kept and
    only the shapes it lacks are measured."""
    torch.backends.cuda.matmul.allow_tf32 = False
    if resume is None:
        ceilings = measure_ceilings()
        records: list[Record] = []
        meta = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": __import__("triton").__version__,
            "host": platform.node(),
            "ceilings": ceilings,
            "rows": _rows(quick, max_n, memory_only),
        }
    else:
        meta = {k: v for k, v in resume.items() if k != "records"}
        meta["resumed_on"] = [*meta.get("resumed_on", []), platform.node()]
        ceilings = meta["ceilings"]
        records = [Record(**r) for r in resume["records"]]
    done_memory, done_timed = measured([asdict(r) for r in records])
    print(f"ceilings: exp2 {ceilings['exp2_per_s']:.3e}/s, bf16 matmul {ceilings['bf16_matmul_flops'] / 1e12:.0f} "
          f"TFLOP/s, copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s", flush=True)

    def result() -> dict:
        return {**meta, "records": [asdict(r) for r in records]}

    def save():  # after every shape, so an interrupted run keeps what it measured (never in the output itself)
        if progress:
            write_json(progress, result())

    for shape in memory_grid(quick and not memory_only, max_n):
        def make_streamkl(shape=shape):
            inputs = make_inputs(shape)
            return streamkl_fns(shape, inputs)[0], _grad_targets(inputs)

        def make_naive(shape=shape):
            inputs = make_inputs(shape)
            return naive_fn(shape, inputs, False), _grad_targets(inputs)

        for provider, make in (("streamkl", make_streamkl), ("naive-eager", make_naive)):
            if (shape_key(asdict(shape)), provider) in done_memory:
                continue
            rec = peak_memory(provider, shape, make)
            records.append(rec)
            print(f"mem {provider} {shape}: {rec.peak_bytes if rec.status == 'ok' else rec.status}", flush=True)
            save()
    for shape in [] if memory_only else time_grid(quick, max_n):
        if shape_key(asdict(shape)) in done_timed:
            continue
        t0 = time.time()
        inputs = make_inputs(shape)
        targets = _grad_targets(inputs)
        fwd, _ = streamkl_fns(shape, inputs)
        recs = time_fwd_bwd("streamkl", shape, fwd, targets)
        atomic_fwd, _ = streamkl_fns(shape, inputs, deterministic=False)
        recs += [r for r in time_fwd_bwd("streamkl-atomic", shape, atomic_fwd, targets) if r.mode == "bwd"]
        if shape.dtype == "bfloat16" and shape.h_kt is None and shape.d_s is None and not shape.teacher_grad:
            for name, backend in (("sdpa-default", None), ("sdpa-flash", "FLASH_ATTENTION")):
                sfn, sin = sdpa_fn(shape, backend)
                recs += time_fwd_bwd(name, shape, sfn, list(sin))
                del sin
            if shape.n <= naive_max_n:
                recs += time_fwd_bwd("naive-eager", shape, naive_fn(shape, inputs, False), targets)
            if shape.n == compile_n and shape.d == 64 and shape.h == 16:
                recs += time_fwd_bwd("naive-compile", shape, naive_fn(shape, inputs, True), targets)
        for r in recs:
            r.extra.update(bounds(shape, ceilings))
        records += recs
        del inputs, targets
        gc.collect()
        torch.cuda.empty_cache()
        summary = {f"{r.provider}/{r.mode}": (round(r.ms, 3) if r.ms is not None else r.status) for r in recs}
        print(f"{shape}: {summary} ({time.time() - t0:.0f}s)", flush=True)
        save()
    return result()


def ab_cases(device: str = "cuda", quick: bool = True) -> dict:
    """The grid's timed calls for ``ab.py``: ``"<shape> fwd"`` (no grad) and ``"<shape> fwd+bwd"`` -> a function of a
    ``streamkl`` package returning the call; the quick rows (N = 8192) or every timed row, and on the CPU two tiny
    float32 problems through the op's default backend.

    Example:
        >>> import streamkl
        >>> cases = ab_cases("cpu")
        >>> sorted(cases)[:2]
        ['H2 D16 N64 causal float32 fwd', 'H2 D16 N64 causal float32 fwd+bwd']
        >>> cases['H2 D16 N64 causal float32 fwd'](streamkl)()
    """
    shapes = time_grid(quick) if device != "cpu" else [Shape(1, 2, 64, 16, c, dtype="float32") for c in (False, True)]
    kw = {"backend": "triton"} if device != "cpu" else {}
    cases = {}
    for shape in shapes:
        name = " ".join(x for x in (f"H{shape.h} D{shape.d}" + (f"/{shape.d_s}" if shape.d_s else ""), f"N{shape.n}",
                                    "causal" * shape.causal, shape.dtype, f"GQA{shape.h_kt}" * bool(shape.h_kt),
                                    "teacher grad" * shape.teacher_grad) if x)

        def fwd(pkg, shape=shape):
            inputs = make_inputs(shape, device)

            def call():
                with torch.no_grad():
                    pkg.attention_kl(*inputs, causal=shape.causal, **kw)
            return call

        def fwd_bwd(pkg, shape=shape):
            inputs = make_inputs(shape, device)
            targets = _grad_targets(inputs)
            return lambda: torch.autograd.grad(pkg.attention_kl(*inputs, causal=shape.causal, **kw), targets)

        cases[f"{name} fwd"], cases[f"{name} fwd+bwd"] = fwd, fwd_bwd
    return cases


def merge_records(previous: dict, new: list[dict], note: str) -> dict:
    """``previous`` (a results file) with ``new`` records replacing the ones of the same shape, provider and mode;
    the previous run's metadata is kept and ``note`` is appended to its notes."""
    def key(r: dict) -> tuple:
        return shape_key(r["shape"]), r["provider"], r["mode"]

    remeasured = {key(r) for r in new}
    kept = [r for r in previous["records"] if key(r) not in remeasured]
    notes = [*previous.get("notes", []), note]
    return {**{k: v for k, v in previous.items() if k != "records"}, "notes": notes, "records": kept + new}


# -------------------------------------------------------------------------------------------------- files
def default_out(device: str, quick: bool = False, memory_only: bool = False) -> str:
    """Where a run of ``device`` writes without ``--out``: its grid ``results/<gpu>.json`` (a full run replaces it,
    ``--max-n`` and ``--merge`` merge into it), or for ``--quick`` a run file of its own,
    ``results/runs/<gpu>-quick.json``: a few rows are not a grid to replace the merged one with."""
    if quick or memory_only:
        kind = "quick" if quick else "memory"
        return os.path.join(RESULTS, "runs", f"{gpu_tag(device)}-{kind}.json")
    return os.path.join(RESULTS, f"{gpu_tag(device)}.json")


def read_grid(path: str, why: str) -> dict:
    """The results file at ``path``, which ``why`` (an option) merges into; it must exist and hold records."""
    if not os.path.exists(path):
        raise SystemExit(f"{why} merges into an existing results file, and {path} does not exist (pass --out).")
    with open(path) as f:
        previous = json.load(f)
    if not isinstance(previous, dict) or "records" not in previous:
        raise SystemExit(f"{path} is not a results file of this script (it has no 'records').")
    return previous


def merge_into(out: str, run_: dict, note: str, why: str) -> dict:
    """Merge the records of ``run_`` (a results file's content) into the results file ``out`` and write it back."""
    merged = merge_records(read_grid(out, why), run_["records"], note)
    write_json(out, merged)
    return merged


def _read_progress(progress: str, rows: dict) -> dict:
    """The interrupted run that ``--resume`` continues: ``progress`` must exist, come from this card and have
    measured the rows the options now choose (``rows``)."""
    if not os.path.exists(progress):
        raise SystemExit(f"--resume continues the run in {progress}, which does not exist (pass the --out of the "
                         "interrupted run, or leave --resume out to start one).")
    with open(progress) as f:
        previous = json.load(f)
    device = torch.cuda.get_device_name()
    if previous.get("device") != device:
        raise SystemExit(f"--resume: {progress} was measured on {previous.get('device')!r}, this card is {device!r}; "
                         "one run's rows must come from one kind of card.")
    if previous.get("rows") != rows:
        raise SystemExit(f"--resume: {progress} measured the rows of {previous.get('rows')}, the options given now "
                         f"choose {rows}; pass the options the interrupted run was started with.")
    return previous


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a few shapes only, written to their own run file (default "
                             "benchmarks/results/runs/<gpu>-quick.json; fold them into the grid with --merge)")
    parser.add_argument("--memory-only", action="store_true",
                        help="only the memory rows of the full grid, written to their own run file (default "
                             "benchmarks/results/runs/<gpu>-memory.json; fold them into the grid with --merge)")
    parser.add_argument("--max-n", type=int, default=None,
                        help="only the H=16 rows with N <= this, merged into the existing --out file")
    parser.add_argument("--out", default=None,
                        help="JSON output (default: the device's grid benchmarks/results/<gpu>.json; for --quick, "
                             "benchmarks/results/runs/<gpu>-quick.json)")
    parser.add_argument("--naive-max-n", type=int, default=8192, help="largest N for the eager naive loss")
    parser.add_argument("--compile-n", type=int, default=8192,
                        help="the N at which the torch.compile'd naive loss is timed (compiling costs ~1 min a shape)")
    parser.add_argument("--merge", default=None, metavar="RUN",
                        help="measure nothing: merge the records of RUN (a results file of this script, e.g. a "
                             "--quick run after a kernel change) into --out (default: the grid of RUN's device), "
                             "with --note")
    parser.add_argument("--note", default="", help="the note --merge and --max-n append to the results file")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run that <out>.partial holds (one stopped by a time limit): pass the "
                             "options it was started with; only the shapes it lacks are measured, with its ceilings")
    args = parser.parse_args(argv)
    if sum((args.quick, args.max_n is not None, args.memory_only)) > 1:
        parser.error("--quick, --max-n and --memory-only choose different rows; pass one of them")
    if args.merge:
        if args.quick or args.max_n is not None or args.memory_only or args.resume:
            parser.error("--merge measures nothing; it takes no --quick, --max-n, --memory-only or --resume")
        with open(args.merge) as f:
            run_ = json.load(f)
        out = args.out or default_out(run_["device"])
        merge_into(out, run_, args.note or f"records of {os.path.basename(args.merge)} ({run_.get('torch')}, "
                   f"triton {run_.get('triton')}) merged", "--merge")
        print(f"merged {len(run_['records'])} records of {args.merge} into {out}")
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention_kl.py needs a CUDA GPU.")
    out = args.out or default_out(torch.cuda.get_device_name(), args.quick, args.memory_only)
    if args.max_n is not None:
        read_grid(out, "--max-n")  # fail before measuring
    progress = f"{out}.partial"
    resume = _read_progress(progress, _rows(args.quick, args.max_n, args.memory_only)) if args.resume else None
    print(f"records are saved to {progress} as they are measured; if the run stops, merge them with "
          f"--merge {progress} --out {out}", flush=True)
    result = run(args.quick, args.naive_max_n, args.compile_n, progress, args.max_n, args.memory_only, resume)
    if args.max_n is None:
        write_json(out, result)
        print(f"wrote {out}")
    else:
        note = args.note or (f"{len(result['records'])} records re-measured with --max-n {args.max_n} on "
                             f"{result['torch']}")
        merge_into(out, result, note, "--max-n")
        print(f"merged {len(result['records'])} re-measured records into {out}")
    if os.path.exists(progress):
        os.remove(progress)


if __name__ == "__main__":
    main()
