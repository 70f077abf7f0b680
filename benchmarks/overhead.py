"""Host (CPU) overhead of attention_kl, and forward+backward at a BERT-sized shape (issue 14's short-context targets).

On a GPU it measures, for the default (Triton) path in bf16:

* host µs per call at a tiny problem (B=1, H=4, N=128, D=64, causal), where the GPU work is negligible and
  the time per call is the launch path (validation, autograd, allocations, Triton launches): forward under
  ``no_grad``, forward+backward, and SDPA forward+backward (+ ``.sum()``) for scale;
* wall ms (``do_bench`` medians) of forward+backward at B=8, H=12, N=512, D=64, bf16 (non-causal): streamkl,
  SDPA (the default backend, with a ``.sum()`` loss) and the naive materialising loss under ``torch.compile``, each
  called eagerly and replayed from a CUDA graph (what ``torch.compile(mode="reduce-overhead")`` does);
* the host µs of the pieces a tiny forward+backward is made of (torch's own floor: an allocation, a kernel, an
  autograd Function that does nothing, a graph of two native ops, SDPA; then the op's stages), and the top cProfile
  and torch.profiler entries;
* the host µs of the real-batches table's host-bound rows (N=5000 causal, the BERT shape), uninstrumented and split by
  stage (:func:`host_stages`), which ``python benchmarks/blocks.py --write`` renders into docs/concepts/kernels.md from
  ``results/nvidia-h200-overhead.json``;
* with ``--against DIR`` (a copy of an earlier ``kernels/streamkl``), both versions in alternating rounds in the same
  process: the per-round ratios and an exact sign test (host speed differs between machines and drifts within a run,
  so only such paired comparisons show a change of the host path).

``--out DIR`` writes ``DIR/<device>-overhead<tag>.json``. Without a GPU, ``--cpu-stub`` measures the Python side of
the same tiny calls on CPU tensors: the kernels' compiled launchers are replaced by no-ops behind a fake Triton
driver, so validation, autograd, the launch plans and Triton's own launch path all run, the GPU work does not::

    PYTHONPATH=kernels:. python benchmarks/overhead.py --out benchmarks/results   # GPU, < 4 minutes
    PYTHONPATH=kernels:. python benchmarks/ab.py <rev> --bench overhead --rounds 15  # against another revision
    PYTHONPATH=kernels:. python benchmarks/overhead.py --cpu-stub [--profile]      # no GPU needed
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import sys
import time

import torch
import torch.nn.functional as F

from streamkl import attention_kl
from streamkl.naive import naive_attention_kl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Shape, do_bench_ms, gpu_tag, make_inputs, per_call_us, write_json

TINY = dict(b=1, h=4, n=128, d=64, causal=True)
BERT = dict(b=8, h=12, n=512, d=64, causal=False)


def tiny_inputs(device: str):
    s = TINY
    q_t, k_t, q_s, k_s = (torch.randn(s["b"], s["h"], s["n"], s["d"], device=device, dtype=torch.bfloat16)
                          for _ in range(4))
    q_s.requires_grad_(True)
    k_s.requires_grad_(True)
    return q_t, k_t, q_s, k_s


def streamkl_calls(inputs, **kw):
    def fwd():
        with torch.no_grad():
            attention_kl(*inputs, causal=TINY["causal"], backend="triton", **kw)

    def fwd_bwd():
        attention_kl(*inputs, causal=TINY["causal"], backend="triton", **kw).backward()

    return fwd, fwd_bwd


def profile_top(fn, n: int, sync=lambda: None, top: int = 18) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    sync()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


# ------------------------------------------------------------------------------------------------- GPU run
def measure_gpu(profile: bool) -> dict:
    sync = torch.cuda.synchronize
    inputs = tiny_inputs("cuda")
    fwd, fwd_bwd = streamkl_calls(inputs)
    v = torch.randn_like(inputs[0])
    q_s, k_s = inputs[2], inputs[3]

    def sdpa_fwd_bwd():
        F.scaled_dot_product_attention(q_s, k_s, v, is_causal=True).sum().backward()

    host = {
        "streamkl_fwd_us": per_call_us(fwd, 300, sync),
        "streamkl_fwd_bwd_us": per_call_us(fwd_bwd, 300, sync),
        "sdpa_fwd_bwd_us": per_call_us(sdpa_fwd_bwd, 300, sync),
    }
    # no host synchronisation anywhere in the op (raises on an implicit sync)
    torch.cuda.set_sync_debug_mode("error")
    try:
        fwd_bwd()
        host["host_sync_free"] = True
    except RuntimeError:
        host["host_sync_free"] = False
    finally:
        torch.cuda.set_sync_debug_mode("default")
    result = {"tiny_shape": {**TINY, "dtype": "bfloat16"}, "host": host}
    result["breakdown_us"] = host_breakdown(sync)
    result["host_stages"] = host_stages(sync=sync)
    result["bert_shape"] = {**BERT, "dtype": "bfloat16"}
    result["bert_fwd_bwd_ms"] = bert_wall_times()
    if profile:  # last: no timing follows a use of torch's profiler (benchmarks/real_batches.py, kernel_ms)
        result["profile_fwd_bwd"] = profile_top(fwd_bwd, 200, sync)
        result["torch_profile_fwd_bwd"] = torch_profile_table(fwd_bwd, 100, sync)
    return result


def host_breakdown(sync) -> dict:
    """Host µs per call of the pieces a tiny forward+backward is made of (same tiny problem, same timing as
    :func:`measure_gpu`), so that the op's host time can be attributed: torch's own floor (an allocation, an
    elementwise kernel, an autograd Function that does nothing, a graph of two native ops, SDPA), then the op's
    stages."""
    from streamkl._validation import prepare_problem
    from streamkl.autograd import AttentionKLFunction
    from streamkl.options import AttentionKLOptions

    inputs = tiny_inputs("cuda")
    q_t, k_t, q_s, k_s = inputs
    small = torch.zeros(4, device="cuda")
    leaf = torch.zeros(4, device="cuda", requires_grad=True)

    class Noop(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k):
            return q.new_empty(())

        @staticmethod
        def backward(ctx, grad):
            return None, None

    options = AttentionKLOptions(causal=True, backend="triton")
    problem = prepare_problem(q_t, k_t, q_s, k_s, options)
    kernel_inputs, spec = problem.kernel_problem()
    rows = q_t.shape[0] * q_t.shape[1] * q_t.shape[2]

    def apply(reduction="mean"):
        return AttentionKLFunction.apply(*kernel_inputs[:-1], spec, "triton", False, True, reduction, rows, True, False,
                                         kernel_inputs.lengths)[0]

    def sdpa_fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q_s, k_s, q_t, is_causal=True)

    pieces = {
        "torch_empty": lambda: torch.empty(4, device="cuda"),
        "torch_elementwise": lambda: small.mul_(1.0),
        "torch_sum": lambda: small.sum(),
        "noop_function_fwd_bwd": lambda: Noop.apply(q_s, k_s).backward(),
        "native_two_ops_fwd_bwd": lambda: (leaf * 2).sum().backward(),
        "sdpa_fwd": sdpa_fwd,
        "sdpa_fwd_bwd": lambda: F.scaled_dot_product_attention(q_s, k_s, q_t, is_causal=True).sum().backward(),
        "prepare_problem": lambda: prepare_problem(q_t, k_t, q_s, k_s,
                                                   AttentionKLOptions(causal=True, backend="triton")),
        "function_fwd_no_grad": lambda: torch.no_grad()(apply)(),
        "function_fwd_grad": apply,
        "function_fwd_bwd": lambda: apply().backward(),
        "function_fwd_bwd_per_row": lambda: apply("none").sum().backward(),
        "op_fwd_grad": lambda: attention_kl(*inputs, causal=True, backend="triton"),
        "op_fwd_bwd": lambda: attention_kl(*inputs, causal=True, backend="triton").backward(),
    }
    return {name: per_call_us(fn, 300, sync) for name, fn in pieces.items()}


def ab_cases(device: str = "cuda", quick: bool = True) -> dict:
    """For ``benchmarks/ab.py``: the tiny forward+backward (host-bound) and the BERT-sized one, each a function of a
    ``streamkl`` package returning the call."""
    backend = {"backend": "triton"} if device != "cpu" else {}

    def tiny(pkg):
        inputs = tiny_inputs(device)
        return lambda: pkg.attention_kl(*inputs, causal=True, **backend).backward()

    def bert(pkg):
        s = BERT if device != "cpu" else {**BERT, "b": 1, "h": 2, "n": 64}
        q_t, k_t, q_s, k_s = (torch.randn(s["b"], s["h"], s["n"], s["d"], device=device, dtype=torch.bfloat16)
                              for _ in range(4))
        q_s.requires_grad_(True)
        k_s.requires_grad_(True)
        return lambda: torch.autograd.grad(pkg.attention_kl(q_t, k_t, q_s, k_s, causal=s["causal"], **backend),
                                           (q_s, k_s))

    return {"tiny fwd+bwd (B1 H4 N128 causal)": tiny, "BERT-sized fwd+bwd (B8 H12 N512)": bert}


def torch_profile_table(fn, n: int, sync) -> str:
    """torch.profiler's CPU-side table (both threads: the caller's and the autograd engine's) of ``n`` calls."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(20):
        fn()
    sync()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            fn()
        sync()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)


def bert_wall_times() -> dict:
    s = BERT
    shape = (s["b"], s["h"], s["n"], s["d"])
    q_t, k_t = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q_s, k_s, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    targets = (q_s, k_s)

    def bench(loss_fn) -> float:
        def fb():
            torch.autograd.grad(loss_fn(), targets)

        return do_bench_ms(fb)

    naive = torch.compile(lambda *x: naive_attention_kl(*x, causal=s["causal"], compute_dtype=torch.float32),
                          dynamic=False)
    out = {
        "streamkl": bench(lambda: attention_kl(q_t, k_t, q_s, k_s, causal=s["causal"])),
        "sdpa_default": bench(lambda: F.scaled_dot_product_attention(q_s, k_s, v, is_causal=s["causal"]).sum()),
    }
    try:
        out["naive_compile"] = bench(lambda: naive(q_t, k_t, q_s, k_s))
    except Exception as exc:  # a baseline that cannot compile here is recorded, not fatal
        out["naive_compile_error"] = f"{type(exc).__name__}: {exc}"[:300]
    if "naive_compile" in out:
        out["naive_compile_over_streamkl"] = out["naive_compile"] / out["streamkl"]
    out["streamkl_over_sdpa"] = out["streamkl"] / out["sdpa_default"]
    # the same steps captured in a CUDA graph (what torch.compile(mode="reduce-overhead") does): no host time left
    graphed = {
        "streamkl_cuda_graph": lambda: attention_kl(q_t, k_t, q_s, k_s, causal=s["causal"]),
        "sdpa_default_cuda_graph": lambda: F.scaled_dot_product_attention(q_s, k_s, v, is_causal=s["causal"]).sum(),
        "naive_compile_cuda_graph": lambda: naive(q_t, k_t, q_s, k_s),
    }
    for name, loss_fn in graphed.items():
        try:
            out[name] = graphed_ms(loss_fn, targets)
        except Exception as exc:  # recorded, not fatal
            out[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
    if "streamkl_cuda_graph" in out and "sdpa_default_cuda_graph" in out:
        out["streamkl_over_sdpa_cuda_graph"] = out["streamkl_cuda_graph"] / out["sdpa_default_cuda_graph"]
    if "streamkl_cuda_graph" in out and "naive_compile_cuda_graph" in out:
        out["naive_compile_over_streamkl_cuda_graph"] = out["naive_compile_cuda_graph"] / out["streamkl_cuda_graph"]
    return out


def graphed_ms(loss_fn, targets) -> float:
    """``do_bench`` median (ms) of replaying a CUDA graph of ``autograd.grad(loss_fn(), targets)`` (warmed up on a
    side stream first, so that compilation and the allocator's first allocations stay outside the capture)."""
    def step():
        return torch.autograd.grad(loss_fn(), targets)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return do_bench_ms(graph.replay)


# ----------------------------------------------------------------------------------------- host time by stage
#: The host-bound rows of the real-batches table (``benchmarks/real_batches.py``), by name, whose host time
#: :func:`host_stages` splits by stage: the same problems, called the same way (bf16, frozen teacher,
#: ``reduction="mean"``, then ``torch.autograd.grad`` of the student's query and key).
STAGE_ROWS = ("H=16 N=5000 D=64 causal", "BERT B=8 H=12 N=512 D=64, 1 pair")
#: The stages, in the order the table lists them: (label, what it holds). Each is timed exclusive of the stages
#: nested in it (:class:`StageTimer`).
STAGES = (
    ("front", "the op's front: options, checks, autocast cast, masks and offsets, the backend"),
    ("autograd Function and glue", "the autograd Function's forward and the training call's Python around the passes: "
                                   "output buffers, the reduction, the gradient of the mean"),
    ("training forward", "its kernel's choice, output buffers, grid and arguments (streamkl.dispatch.forward), the "
                         "launch excluded"),
    ("key pass", "likewise for the key pass, run in the forward (streamkl.dispatch.backward)"),
    ("TMA descriptors", "the Gluon kernels' host-side tensor descriptors, four a launch"),
    ("kernel launches", "streamkl's launcher and Triton's compiled launcher, per call of the op"),
    ("backward node", "the backward of the op's autograd node: the gradients computed ahead times the upstream "
                      "gradient"),
    ("autograd engine", "torch.autograd.grad around that node (the engine and its device thread)"),
)


class StageTimer:
    """Host time by stage: :meth:`wrap` makes a function record its time under a stage, exclusive of the stages
    called inside it; :meth:`per_call` gives µs per call over the calls made since :meth:`reset`.

    Example:
        >>> timer = StageTimer()
        >>> outer = timer.wrap("outer", lambda: inner())
        >>> inner = timer.wrap("inner", lambda: sum(range(1000)))
        >>> _ = outer()
        >>> sorted(timer.per_call(1))
        ['inner', 'outer']
    """

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self._stack: list[list] = []

    def wrap(self, stage: str, fn):
        def timed(*args, **kwargs):
            frame = [0.0]  # time spent in nested stages
            self._stack.append(frame)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self._stack.pop()
                if self._stack:
                    self._stack[-1][0] += elapsed
                self.totals[stage] = self.totals.get(stage, 0.0) + elapsed - frame[0]

        return timed

    def reset(self) -> None:
        self.totals.clear()

    def per_call(self, calls: int) -> dict[str, float]:
        return {stage: total / calls * 1e6 for stage, total in self.totals.items()}


def _stage_patches(timer: StageTimer) -> list[tuple[object, str, object]]:
    """``(owner, attribute, timed replacement)`` for every function a stage of :data:`STAGES` starts in (the Gluon
    modules only where they import)."""
    import streamkl.api as api
    import streamkl.autograd as ag
    import streamkl.dispatch as dispatch
    from streamkl._triton_common.launch import KernelLauncher

    patches = [(api, "attention_kl_per_row", "autograd Function and glue"), (dispatch, "forward", "training forward"),
               (dispatch, "backward", "key pass"), (KernelLauncher, "__call__", "kernel launches"),
               (ag, "_ahead_backward", "backward node")]
    for name in ("_hopper.forward", "_hopper.fused_forward", "_hopper.backward"):
        module = dispatch._module(name)
        if module is not None:
            patches.append((module, "_descriptor", "TMA descriptors"))
    return [(owner, attr, timer.wrap(stage, getattr(owner, attr))) for owner, attr, stage in patches]


def stage_shapes(smoke: bool = False) -> dict[str, Shape]:
    """The shapes of :data:`STAGE_ROWS`, as the real-batches table defines them (``smoke``: its tiny CPU shapes).

    Example:
        >>> stage_shapes()["H=16 N=5000 D=64 causal"].n
        5000
    """
    import real_batches

    shapes = {row.name: row.shape for row in real_batches.rows(smoke)}
    return {name: shapes[name] for name in STAGE_ROWS}


def host_stages(device: str = "cuda", calls: int = 200, sync=torch.cuda.synchronize,
                rows: dict[str, Shape] | None = None, rounds: int = 5, warmup: int = 10) -> dict:
    """For each row of ``rows`` (default: :func:`stage_shapes`): the host µs per forward+backward call, uninstrumented
    and by stage (:data:`STAGES`, timed by :class:`StageTimer`; their sum is the instrumented call), and SDPA's
    forward+backward on the student's shapes (torch's own floor is :func:`host_breakdown`'s); ``rounds`` of each
    loop, after ``warmup`` calls."""
    timer = StageTimer()
    out = {"rows": {}}
    for name, shape in (rows or stage_shapes()).items():
        out["rows"][name] = _row_stages(shape, timer, device, calls, sync, rounds, warmup)
    return out


def _row_stages(shape: Shape, timer: StageTimer, device: str, calls: int, sync, rounds: int, warmup: int) -> dict:
    """One row of :func:`host_stages`."""
    q_t, k_t, q_s, k_s = make_inputs(shape, device)
    v, grad_out = torch.randn_like(k_s, requires_grad=True), torch.randn_like(q_s)

    def call():
        return attention_kl(q_t, k_t, q_s, k_s, causal=shape.causal, reduction="mean", backend="triton")

    def ours():
        torch.autograd.grad(call(), (q_s, k_s))

    timed_call, timed_grad = timer.wrap("front", call), timer.wrap("autograd engine", torch.autograd.grad)

    def ours_timed():
        timed_grad(timed_call(), (q_s, k_s))

    def sdpa():
        torch.autograd.grad(F.scaled_dot_product_attention(q_s, k_s, v, is_causal=shape.causal), (q_s, k_s, v),
                            grad_out)

    row = {"sdpa_host_us": per_call_us(sdpa, calls, sync, rounds, warmup, wait=False), "host_us": float("inf"),
           "instrumented_host_us": float("inf")}
    patches = _stage_patches(timer)
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patches]
    # rounds of a loop of plain calls and a loop with the stages timed: the host's speed drifts within a run, so each
    # is the fastest of its loops, and the two are taken in alternation
    for _ in range(rounds):
        row["host_us"] = min(row["host_us"], per_call_us(ours, calls, sync, repeats=1, warmup=warmup, wait=False))
        try:
            for owner, attr, timed in patches:
                setattr(owner, attr, timed)
            for _ in range(warmup):
                ours_timed()
            sync()
            timer.reset()
            start = time.perf_counter()
            for _ in range(calls):
                ours_timed()
            host = (time.perf_counter() - start) / calls * 1e6
            if host < row["instrumented_host_us"]:
                row["instrumented_host_us"], row["stages_us"] = host, timer.per_call(calls)
            sync()
        finally:
            for owner, attr, original in saved:
                setattr(owner, attr, original)
    return row


def stages_markdown(result: dict) -> str:
    """The host-stages table of a GPU run's results (:func:`host_stages`), for the kernel design page."""
    stages = result["host_stages"]
    rows = stages["rows"]
    env = result["env"]
    lines = [f"{env['device']}, torch {env['torch']}, Triton {env['triton']}; host µs per forward+backward call "
             "(the fastest of five loops of back-to-back calls, the GPU not waited for inside; "
             "`python benchmarks/overhead.py`). The stages are timed in five loops taken in turn with those, each "
             "stage's functions wrapped (the wrappers' own time is in the sum) and each stage exclusive of the stages "
             "nested in it: the fastest loop's.", "",
             "| stage | what it holds | " + " | ".join(rows) + " |", "|---|---|" + "---|" * len(rows)]
    for stage, what in STAGES:
        cells = [f"{r['stages_us'][stage]:.0f}" if stage in r["stages_us"] else "–" for r in rows.values()]
        lines.append(f"| {stage} | {what} | " + " | ".join(cells) + " |")
    lines.append("| **sum of the stages** | (the instrumented call) | "
                 + " | ".join(f"{sum(r['stages_us'].values()):.0f}" for r in rows.values()) + " |")
    lines.append("| **the call, uninstrumented** | | " + " | ".join(f"{r['host_us']:.0f}" for r in rows.values())
                 + " |")
    lines.append("| SDPA forward+backward, the student's shapes | | "
                 + " | ".join(f"{r['sdpa_host_us']:.0f}" for r in rows.values()) + " |")
    floor = result["breakdown_us"]
    lines += ["", "torch's own floor in the same run (tiny tensors, the script's `host_breakdown`): an autograd "
                  f"Function that does nothing, forward and backward, {floor['noop_function_fwd_bwd']:.0f} µs; "
                  f"a graph of two native ops (`(x * 2).sum()`), {floor['native_two_ops_fwd_bwd']:.0f} µs."]
    return "\n".join(lines)


def blocks(result: dict) -> dict[str, str]:
    """The generated blocks of a GPU run's results: block name -> markdown (``benchmarks/blocks.py`` renders them)."""
    return {"overhead:host-stages": stages_markdown(result)}


# -------------------------------------------------------------------------------------------- CPU stub run
def install_cpu_stub() -> None:
    """Run the Triton path on CPU tensors with no GPU: a fake driver (device 0, stream 0, an sm_90 target), and
    each kernel's first launch returns a stand-in compiled kernel whose launcher only reads the tensors' data
    pointers (as the real C launcher does) instead of compiling and launching."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    import streamkl.dispatch as dispatch
    from streamkl._triton import backward, forward

    class FakeDriver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    class StubKernel:
        function = None
        packed_metadata = None

        def launch_metadata(self, grid, stream, *args):
            return None

        @staticmethod
        def run(*args):
            for a in args:
                if isinstance(a, torch.Tensor):
                    a.data_ptr()

    def never_compile(fn):
        def _do_compile(key, signature, device, constexprs, options, attrs, warmup):
            kernel = StubKernel()
            fn.device_caches[device][0][key] = kernel
            return kernel

        fn._do_compile = _do_compile

    driver.set_active(FakeDriver())
    for fn in (forward._attention_kl_fwd_kernel, backward._attention_kl_bwd_dk_kernel,
               backward._attention_kl_bwd_dq_kernel):
        never_compile(fn)
    dispatch.triton_interpreter_enabled = lambda: True  # let backend="triton" take CPU tensors


def measure_cpu_stub(profile: bool) -> dict:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("--cpu-stub measures the compiled-kernel launch path: unset TRITON_INTERPRET")
    install_cpu_stub()
    torch.set_num_threads(1)
    fwd, fwd_bwd = streamkl_calls(tiny_inputs("cpu"))
    result = {
        "tiny_shape": {**TINY, "dtype": "bfloat16"},
        "host": {"streamkl_fwd_us": per_call_us(fwd, 1000), "streamkl_fwd_bwd_us": per_call_us(fwd_bwd, 1000)},
        "note": "CPU tensors, kernel launches stubbed (fake Triton driver); Python-side cost only",
    }
    if profile:
        result["profile_fwd_bwd"] = profile_top(fwd_bwd, 1000)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="directory for <device>-overhead.json")
    parser.add_argument("--cpu-stub", action="store_true", help="no GPU: Python-side cost with stubbed launches")
    parser.add_argument("--profile", action="store_true", help="also print the top cProfile entries")
    args = parser.parse_args(argv)
    if args.cpu_stub:
        result = measure_cpu_stub(args.profile)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --cpu-stub for the Python-side cost")
        result = measure_gpu(profile=True)
    import triton

    result["env"] = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.cpu_stub
                     else platform.processor() or platform.machine(),
                     "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()}
    for key, value in result.items():
        if not key.startswith(("profile_", "torch_profile_")):
            print(f"{key}: {json.dumps(value)}")
    if args.profile or not args.cpu_stub:
        print(result.get("profile_fwd_bwd", ""))
        print(result.get("torch_profile_fwd_bwd", ""))
    if args.out:
        tag = "cpu-stub" if args.cpu_stub else gpu_tag(result["env"]["device"])
        path = os.path.join(args.out, f"{tag}-overhead.json")
        write_json(path, result)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
