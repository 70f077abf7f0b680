"""Host (CPU) overhead of attention_kl, and forward+backward at a BERT-sized shape (issue 14's short-context targets).

On a GPU it measures, for the default (Triton) path in bf16:

* host µs per call at a tiny problem (B=1, H=4, N=128, D=64, causal), where the GPU work is negligible and
  the time per call is the launch path (validation, autograd, allocations, Triton launches): forward under
  ``no_grad``, forward+backward, and SDPA forward+backward (+ ``.sum()``) for scale;
* wall ms (``do_bench`` medians) of forward+backward at B=8, H=12, N=512, D=64, bf16 (non-causal): streamkl,
  SDPA (the default backend, with a ``.sum()`` loss) and the naive materialising loss under ``torch.compile``, each
  called eagerly and replayed from a CUDA graph (what ``torch.compile(mode="reduce-overhead")`` does);
* the host µs of the pieces a tiny forward+backward is made of (torch's own floor: an allocation, a kernel, an
  autograd Function that does nothing, SDPA; then the op's stages), and the top cProfile and torch.profiler entries;
* with ``--against DIR`` (a copy of an earlier ``kernels/streamkl``), both versions in alternating rounds in the same
  process: the per-round ratios and an exact sign test (host speed differs between machines and drifts within a run,
  so only such paired comparisons show a change of the host path).

``--out DIR`` writes ``DIR/<device>-overhead<tag>.json``. Without a GPU, ``--cpu-stub`` measures the Python side of
the same tiny calls on CPU tensors: the kernels' compiled launchers are replaced by no-ops behind a fake Triton
driver, so validation, autograd, the launch plans and Triton's own launch path all run, the GPU work does not::

    PYTHONPATH=kernels:. python benchmarks/overhead.py --out benchmarks/results   # GPU, < 4 minutes
    git archive 3aeb7b1 kernels/streamkl | tar -x -C /tmp && mv /tmp/kernels/streamkl /tmp/streamkl_v8
    PYTHONPATH=kernels:. python benchmarks/overhead.py --against /tmp/streamkl_v8 --tag=-v9 --out benchmarks/results
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
import re
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from streamkl import attention_kl
from streamkl.naive import naive_attention_kl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # report.py, beside this file

TINY = dict(b=1, h=4, n=128, d=64, causal=True)
BERT = dict(b=8, h=12, n=512, d=64, causal=False)


def per_call_us(fn, n: int, sync=lambda: None, repeats: int = 5) -> float:
    """Best of ``repeats`` averages over ``n`` back-to-back calls, in µs (synchronised before and after)."""
    for _ in range(20):
        fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


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
    if profile:
        result["profile_fwd_bwd"] = profile_top(fwd_bwd, 200, sync)
        result["torch_profile_fwd_bwd"] = torch_profile_table(fwd_bwd, 100, sync)
    result["breakdown_us"] = host_breakdown(sync)
    result["bert_shape"] = {**BERT, "dtype": "bfloat16"}
    result["bert_fwd_bwd_ms"] = bert_wall_times()
    return result


def host_breakdown(sync) -> dict:
    """Host µs per call of the pieces a tiny forward+backward is made of (same tiny problem, same timing as
    :func:`measure_gpu`), so that the op's host time can be attributed: torch's own floor (an allocation, an
    elementwise kernel, an autograd Function that does nothing, SDPA), then the op's stages."""
    from streamkl._validation import prepare_problem
    from streamkl.autograd import AttentionKLFunction
    from streamkl.options import AttentionKLOptions

    inputs = tiny_inputs("cuda")
    q_t, k_t, q_s, k_s = inputs
    small = torch.zeros(4, device="cuda")

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
        return AttentionKLFunction.apply(*kernel_inputs, spec, "triton", False, True, reduction, rows, True)[0]

    def sdpa_fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q_s, k_s, q_t, is_causal=True)

    pieces = {
        "torch_empty": lambda: torch.empty(4, device="cuda"),
        "torch_elementwise": lambda: small.mul_(1.0),
        "torch_sum": lambda: small.sum(),
        "noop_function_fwd_bwd": lambda: Noop.apply(q_s, k_s).backward(),
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


def paired_against(baseline, rounds: int = 15) -> dict:
    """This version against ``baseline`` (an earlier copy of the package, :func:`report.load_package`) in alternating
    rounds: host µs per tiny forward+backward and the BERT-sized eager forward+backward (ms, ``do_bench`` median,
    SDPA's in the same round), with the per-round ratios and an exact sign test (host speed drifts within a run and
    differs between machines, so only paired, same-run comparisons are reported)."""
    from report import sign_test_p
    from triton.testing import do_bench

    sync = torch.cuda.synchronize
    tiny = tiny_inputs("cuda")
    s = BERT
    shape = (s["b"], s["h"], s["n"], s["d"])
    q_t, k_t = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q_s, k_s, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    ops = {"new": attention_kl, "base": baseline.attention_kl}

    def tiny_call(op):
        return lambda: op(*tiny, causal=True, backend="triton").backward()

    def bert_ms(loss_fn) -> float:
        return float(do_bench(lambda: torch.autograd.grad(loss_fn(), (q_s, k_s)), warmup=10, rep=60,
                              return_mode="median"))

    def bert_loss(op):
        return lambda: op(q_t, k_t, q_s, k_s, causal=s["causal"])

    per_round = []
    for r in range(rounds):
        names = ("new", "base") if r % 2 == 0 else ("base", "new")
        row = {}
        for name in names:
            row[f"tiny_fwd_bwd_us_{name}"] = per_call_us(tiny_call(ops[name]), 200, sync, repeats=3)
        for name in names:
            row[f"bert_fwd_bwd_ms_{name}"] = bert_ms(bert_loss(ops[name]))
        row["bert_fwd_bwd_ms_sdpa"] = bert_ms(
            lambda: F.scaled_dot_product_attention(q_s, k_s, v, is_causal=s["causal"]).sum())
        per_round.append(row)

    def summary(key: str) -> dict:
        new = [row[f"{key}_new"] for row in per_round]
        base = [row[f"{key}_base"] for row in per_round]
        faster = sum(n < b for n, b in zip(new, base))
        return {"median_new": statistics.median(new), "median_base": statistics.median(base),
                "median_ratio_base_over_new": statistics.median(b / n for n, b in zip(new, base)),
                "rounds": len(new), "rounds_new_faster": faster, "sign_test_p": sign_test_p(faster, len(new))}

    sdpa = [row["bert_fwd_bwd_ms_sdpa"] for row in per_round]
    bert = summary("bert_fwd_bwd_ms")
    bert["median_sdpa"] = statistics.median(sdpa)
    bert["median_new_over_sdpa"] = statistics.median(row["bert_fwd_bwd_ms_new"] / row["bert_fwd_bwd_ms_sdpa"]
                                                     for row in per_round)
    bert["median_base_over_sdpa"] = statistics.median(row["bert_fwd_bwd_ms_base"] / row["bert_fwd_bwd_ms_sdpa"]
                                                      for row in per_round)
    return {"tiny_fwd_bwd_us": summary("tiny_fwd_bwd_us"), "bert_fwd_bwd_ms": bert, "per_round": per_round}


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
    from triton.testing import do_bench

    s = BERT
    shape = (s["b"], s["h"], s["n"], s["d"])
    q_t, k_t = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q_s, k_s, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    targets = (q_s, k_s)

    def bench(loss_fn) -> float:
        def fb():
            torch.autograd.grad(loss_fn(), targets)

        return float(do_bench(fb, warmup=25, rep=200, return_mode="median"))

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
    from triton.testing import do_bench

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
    return float(do_bench(graph.replay, warmup=25, rep=200, return_mode="median"))


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


def device_slug() -> str:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu-stub-{platform.machine()}"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="directory for <device>-overhead.json")
    parser.add_argument("--cpu-stub", action="store_true", help="no GPU: Python-side cost with stubbed launches")
    parser.add_argument("--profile", action="store_true", help="also print the top cProfile entries")
    parser.add_argument("--against", metavar="DIR",
                        help="also compare, in alternating rounds, with the package in DIR (a copy of an earlier "
                             "kernels/streamkl)")
    parser.add_argument("--tag", default="", help="suffix of the result file: <device>-overhead<tag>.json")
    args = parser.parse_args(argv)
    if args.cpu_stub:
        result = measure_cpu_stub(args.profile)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --cpu-stub for the Python-side cost")
        result = measure_gpu(profile=True)
        if args.against:
            from report import load_package

            baseline = load_package(args.against, "streamkl_base")
            result["against"] = {"baseline": os.path.normpath(args.against), **paired_against(baseline)}
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
        os.makedirs(args.out, exist_ok=True)
        slug = "cpu-stub" if args.cpu_stub else device_slug()
        path = os.path.join(args.out, f"{slug}-overhead{args.tag}.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
