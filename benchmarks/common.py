"""What the living benchmarks share: paths, problem shapes, timers, paired rounds with their tests, result files and
the generated blocks of the docs.

Scripts in ``benchmarks/`` import it as ``common`` (their folder is on ``sys.path`` when they run); the ones in its
sub-folders put ``benchmarks/`` on the path first. It imports torch only inside the timers, so the docs' renderer
(``blocks.py``) and the statistics run without it.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, ".."))
RESULTS = os.path.join(HERE, "results")
ALPHA = 0.05


# ------------------------------------------------------------------------------------------------------ shapes
@dataclass
class Shape:
    """One attention-KL problem: batch, heads, length, head dim, mask and dtype; GQA teacher key heads (``h_kt``), a
    student head dim other than the teacher's (``d_s``) and a trainable teacher (``teacher_grad``) when set."""

    b: int
    h: int
    n: int
    d: int
    causal: bool
    dtype: str = "bfloat16"
    h_kt: int | None = None
    d_s: int | None = None
    teacher_grad: bool = False

    def elements(self) -> float:
        """Score elements per distribution actually computed (causal: about half).

        Example:
            >>> Shape(1, 1, 4, 8, causal=True).elements()
            10.0
        """
        e = self.b * self.h * self.n * self.n
        return e * (self.n + 1) / (2 * self.n) if self.causal else float(e)


#: The long-context training calls the kernel work is measured on (bf16, a frozen teacher): name -> shape.
TRAINING_SHAPES = {
    "N8192-D64": Shape(1, 16, 8192, 64, False),
    "N8192-D64-causal": Shape(1, 16, 8192, 64, True),
    "N8192-D128": Shape(1, 16, 8192, 128, False),
    "N8192-D128-causal": Shape(1, 16, 8192, 128, True),
    "N16384-D128-H32-GQA8-causal": Shape(1, 32, 16384, 128, True, h_kt=8),
    "N4096-B2-H12-D64": Shape(2, 12, 4096, 64, False),
}


def make_inputs(shape: Shape, device: str = "cuda", seed: int = 0) -> tuple:
    """``(q_t, k_t, q_s, k_s)`` of ``shape``, ``[B, H, N, D]``; the student's (and a trainable teacher's) need grad.

    Example:
        >>> q_t, k_t, q_s, k_s = make_inputs(Shape(1, 4, 8, 16, False, "float32", h_kt=2, d_s=8), "cpu")
        >>> tuple(k_t.shape), tuple(q_s.shape), q_t.requires_grad, q_s.requires_grad
        ((1, 2, 8, 16), (1, 4, 8, 8), False, True)
    """
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    dt = getattr(torch, shape.dtype)

    def rand(heads: int, d: int, grad: bool):
        return torch.randn(shape.b, heads, shape.n, d, device=device, generator=g).to(dt).requires_grad_(grad)

    d_s = shape.d_s or shape.d
    return (rand(shape.h, shape.d, shape.teacher_grad), rand(shape.h_kt or shape.h, shape.d, shape.teacher_grad),
            rand(shape.h, d_s, True), rand(shape.h, d_s, True))


def rel_l2(a, b) -> float:
    """``‖a − b‖ / ‖b‖`` in float64.

    Example:
        >>> import torch
        >>> rel_l2(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 0.0]))
        1.3333333333333333
    """
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


# ------------------------------------------------------------------------------------------------------ timers
def do_bench_ms(fn: Callable[[], object], rep: int = 200, warmup: int = 25) -> float:
    """``triton.testing.do_bench``'s median (ms) of ``fn`` on the GPU."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def wall_ms(fn: Callable[[], object], iters: int = 10, device: str = "cuda", warmup: int = 3) -> float:
    """Median ms of ``iters`` calls of ``fn`` after ``warmup`` warm-up calls: CUDA events around each call on a GPU,
    the wall clock on the CPU.

    Example:
        >>> wall_ms(lambda: sum(range(100)), iters=3, device="cpu") >= 0
        True
    """
    for _ in range(warmup):
        fn()
    if device == "cpu":
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    import torch

    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def per_call_us(fn: Callable[[], object], n: int, sync: Callable[[], object] = lambda: None,
                repeats: int = 5, warmup: int = 20, wait: bool = True) -> float:
    """Best of ``repeats`` averages over ``n`` back-to-back calls, in µs (synchronised before and after, after
    ``warmup`` calls): host time per call where the device work is negligible. ``wait=False`` stops each loop's clock
    before it synchronises: the host's time to enqueue a call however long its device work takes.

    Example:
        >>> per_call_us(lambda: None, 10) < 1e6, per_call_us(lambda: None, 10, wait=False) < 1e6
        (True, True)
    """
    for _ in range(warmup):
        fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        if wait:
            sync()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
        sync()
    return best


# ------------------------------------------------------------------------------------------ paired comparisons
def sign_test_p(successes: int, n: int) -> float:
    """Two-sided exact sign test: the probability, with no difference (p = 1/2 per round), of a split at least as
    uneven as ``successes`` of ``n``.

    Example:
        >>> round(sign_test_p(10, 10), 4), sign_test_p(5, 10), round(sign_test_p(7, 7), 4)
        (0.002, 1.0, 0.0156)
    """
    k = max(successes, n - successes)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k, n + 1)) / 2**n)


def sign_flip_p(diffs: Sequence[float]) -> float:
    """Exact two-sided p-value of the mean of paired differences under the sign-flip null (each difference as likely
    to have either sign): the share of the ``2^n`` sign patterns whose |sum| is at least the observed one.

    Example:
        >>> sign_flip_p([0.5, 0.4, 0.3]), sign_flip_p([0.0, 0.0])
        (0.25, 1.0)
    """
    diffs = list(diffs)
    observed = abs(sum(diffs))
    if observed == 0:
        return 1.0
    if len(diffs) >= 12:
        import numpy as np

        bits = (np.arange(2 ** len(diffs))[:, None] >> np.arange(len(diffs))[None, :]) & 1
        sums = np.abs((1 - 2 * bits) @ np.asarray(diffs, dtype=np.float64))
        return float(np.count_nonzero(sums >= observed * (1 - 1e-12))) / 2 ** len(diffs)
    hits = sum(abs(sum(s * d for s, d in zip(signs, diffs))) >= observed * (1 - 1e-12)
               for signs in itertools.product((1, -1), repeat=len(diffs)))
    return hits / 2 ** len(diffs)


def t_test_p(diffs: Sequence[float]) -> tuple[float | None, float | None]:
    """``(t, two-sided p)`` of the paired t-test on ``diffs`` (scipy when present, else the closed forms for 1 and 2
    degrees of freedom); ``(None, None)`` below 2 differences; ``p = 0`` for identical non-zero differences.

    Example:
        >>> t, p = t_test_p([0.30, 0.32, 0.28])
        >>> round(t, 1), round(p, 4)
        (26.0, 0.0015)
    """
    n = len(diffs)
    if n < 2:
        return None, None
    mean, sd = statistics.mean(diffs), statistics.stdev(diffs)
    if sd == 0:
        return (math.copysign(math.inf, mean), 0.0) if mean else (0.0, 1.0)
    t = mean / (sd / math.sqrt(n))
    try:
        from scipy import stats

        return t, float(2 * stats.t.sf(abs(t), n - 1))
    except ImportError:
        return t, {2: 1 - abs(t) / math.sqrt(t * t + 2), 1: 1 - 2 * math.atan(abs(t)) / math.pi}.get(n - 1)


def paired_rounds(calls: dict[str, Callable[[], object]], rounds: int, timer: Callable[[Callable], float]
                  ) -> dict[str, list[float]]:
    """Time every call of ``calls`` (name -> call) once per round with ``timer``, in the given order in even rounds
    and reversed in odd ones, so that a drift of the machine falls on every call alike; name -> one time per round.

    Example:
        >>> runs = paired_rounds({"a": lambda: 1, "b": lambda: 2}, 3, timer=lambda fn: float(fn()))
        >>> runs
        {'a': [1.0, 1.0, 1.0], 'b': [2.0, 2.0, 2.0]}
    """
    runs: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(rounds):
        for name in list(calls) if r % 2 == 0 else list(calls)[::-1]:
            runs[name].append(timer(calls[name]))
    return runs


def compare(new: Sequence[float], base: Sequence[float]) -> dict:
    """Paired times (one pair per round) of a change against its baseline: the median of the per-round ratios
    new / base, how many rounds the change was faster in, the exact sign test, and the verdict (a difference only
    where the sign test's p is below :data:`ALPHA`).

    Example:
        >>> c = compare([0.9, 0.91, 0.92, 0.9, 0.89, 0.9, 0.93], [1.0] * 7)
        >>> round(c["ratio"], 2), c["faster"], round(c["p"], 4), c["verdict"]
        (0.9, 7, 0.0156, 'faster')
    """
    ratios = [x / y for x, y in zip(new, base)]
    faster = sum(r < 1 for r in ratios)
    p = sign_test_p(faster, len(ratios))
    ratio = statistics.median(ratios)
    verdict = "no difference" if p >= ALPHA else ("faster" if ratio < 1 else "slower")
    return {"ratio": ratio, "faster": faster, "rounds": len(ratios), "p": p, "verdict": verdict,
            "median_new": statistics.median(new), "median_base": statistics.median(base)}


# -------------------------------------------------------------------------------------------------- result files
def gpu_tag(device: str) -> str:
    """A device name as a file-name part.

    Example:
        >>> gpu_tag("NVIDIA H100 80GB HBM3")
        'nvidia-h100-80gb-hbm3'
    """
    return "".join(c if c.isalnum() else "-" for c in device.lower()).strip("-")


def write_json(path: str, data: dict) -> None:
    """Write ``data`` to ``path`` atomically (a crash mid-write leaves the previous file whole).

    Example:
        >>> import tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "run", "result.json")
        >>> write_json(path, {"ms": 1.5}); read_json(path)
        {'ms': 1.5}
    """
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(f"{path}.tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(f"{path}.tmp", path)


def read_json(path: str):
    """The JSON file at ``path`` (see :func:`write_json`)."""
    with open(path) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------- generated blocks
def _markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def read_block(text: str, name: str) -> str | None:
    """What lies between ``<!-- name:start -->`` and ``<!-- name:end -->`` in ``text`` (None without the markers).

    Example:
        >>> read_block("a\\n<!-- t:start -->\\n| 1 |\\n<!-- t:end -->\\n", "t")
        '| 1 |'
    """
    start, end = _markers(name)
    found = re.search(re.escape(start) + r"\n(.*?)\n?" + re.escape(end), text, re.S)
    return None if found is None else found.group(1)


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with what lies between the markers of ``name`` replaced by ``body``.

    Example:
        >>> replace_block("<!-- t:start -->\\nold\\n<!-- t:end -->", "t", "new")
        '<!-- t:start -->\\nnew\\n<!-- t:end -->'
    """
    start, end = _markers(name)
    if start not in text or end not in text:
        raise ValueError(f"the markers {start} ... {end} are missing")
    return re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: f"{start}\n{body}\n{end}", text, flags=re.S)


def write_blocks(path: str, blocks: dict[str, str]) -> None:
    """Rewrite the file at ``path`` with each ``name -> body`` of ``blocks`` between its markers.

    Example:
        >>> import tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "page.md")
        >>> with open(path, "w") as f:
        ...     _ = f.write("<!-- t:start -->\\n<!-- t:end -->\\n")
        >>> write_blocks(path, {"t": "| 1 |"}); read_block(open(path).read(), "t")
        '| 1 |'
    """
    with open(path) as f:
        text = f.read()
    for name, body in blocks.items():
        text = replace_block(text, name, body)
    with open(path, "w") as f:
        f.write(text)


# ------------------------------------------------------------------------------------------------------ packages
def load_package(path: str, name: str):
    """Import the package folder at ``path`` (relative imports only, as ``kernels/streamkl``) as module ``name``, so
    that two versions of it run in one process.

    Example:
        >>> import streamkl
        >>> copy = load_package(os.path.join(ROOT, "kernels", "streamkl"), "streamkl_load_example")
        >>> copy.__name__, copy.attention_kl is streamkl.attention_kl
        ('streamkl_load_example', False)
    """
    spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
