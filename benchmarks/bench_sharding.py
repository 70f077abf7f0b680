"""Beyond one GPU, measured on two: a sharded teacher (FSDP) against a replicated one (DDP), and the
sequence-sharded KL against one GPU.

    PYTHONPATH=kernels:. python benchmarks/bench_sharding.py            # 2 GPUs (minutes on 2 H200s)
    PYTHONPATH=kernels:. python benchmarks/bench_sharding.py --smoke    # 2 CPU processes (gloo), tiny sizes

One command, two processes (spawned here, NCCL), one JSON file: ``<--results>/sharding_<device>.json`` (default
``benchmarks/results``). Needs torch (with Triton) only: no Lightning,
transformers or omegaconf. The teacher is sharded with the library's own FSDP2 layout
(``lightning_streamkl.teacher.shard_module``, the code ``StreamKLDistillation`` runs under ``FSDPStrategy`` and
``ModelParallelStrategy``), loaded from its file because the package itself needs omegaconf.

1. ``layouts``: one distillation step (a frozen bf16 teacher's pass with its last layer's queries and keys captured,
   the student's forward, task loss + ``attention_kl``, backward, AdamW) under three layouts:

   - ``ddp``: the student in DistributedDataParallel, a whole teacher on each GPU;
   - ``fsdp``: student and teacher sharded with FSDP2 (``fully_shard`` per block, then the root);
   - ``ddp+sharded-teacher``: the student in DDP, the teacher sharded (``teacher_sharding="shard"``).

   The teacher (about 40 B parameters, 74 GiB in bf16: two copies do not fit in one H200's 139 GiB) and the student
   are built from the same seeds in every layout, and every rank trains on its own batch. Per GPU: the memory held
   at rest and the peak over the timed steps (``torch.cuda.max_memory_allocated``), the median step time, and the
   first step's KL (the layouts must agree).
2. ``context_parallel``: ``streamkl.sharded.context_parallel_attention_kl`` on a causal sequence of N = 262144
   tokens split over the 2 GPUs (131072 each) against ``attention_kl`` on one GPU at N = 131072 (the same tokens
   per GPU) and at N = 262144 (the same problem): forward + backward time and peak memory, and the exactness of
   the sharded per-row KL and gradients against the one-GPU op at N = 262144.

    python benchmarks/bench_sharding.py --docs benchmarks/results/sharding_nvidia-h200.json

renders a committed run (no GPU needed) into ``docs/guides/sharding.md``, between its ``sharding-gpu`` and
``sharding-gpu-context`` markers.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
import types
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import rel_l2, write_blocks, write_json  # noqa: E402

WORLD = 2


@dataclass
class Sizes:
    """What is measured (the GPU defaults; ``--smoke`` shrinks everything)."""

    teacher_dim: int = 8192
    teacher_layers: int = 46
    teacher_heads: int = 64
    teacher_kv_heads: int = 8
    teacher_ffn: int = 28672
    student_dim: int = 2048
    student_layers: int = 12
    student_heads: int = 64  # attention_kl pairs query heads one to one: as many as the teacher's
    student_kv_heads: int = 8
    student_ffn: int = 5632
    vocab: int = 32000
    batch: int = 2
    seq: int = 4096
    warmup_steps: int = 2
    timed_steps: int = 5
    cp_tokens: int = 262144  # the whole sequence; each GPU holds half
    cp_heads: int = 32
    cp_kv_heads: int = 8
    cp_dim_t: int = 128
    cp_dim_s: int = 64
    cp_repeats: int = 3


SMOKE = Sizes(teacher_dim=64, teacher_layers=2, teacher_heads=4, teacher_kv_heads=2, teacher_ffn=128,
              student_dim=32, student_layers=2, student_heads=4, student_kv_heads=2, student_ffn=64, vocab=100,
              batch=2, seq=16, warmup_steps=1, timed_steps=2, cp_tokens=64, cp_heads=4, cp_kv_heads=2, cp_dim_t=16,
              cp_dim_s=8, cp_repeats=1)


# ---------------------------------------------------------------------------------------------- models
class Block(nn.Module):
    """A pre-norm decoder block (grouped-query causal attention, SwiGLU); keeps its ``(q, k)`` when asked."""

    def __init__(self, dim: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.up = nn.Linear(dim, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)
        self.keep = False
        self.captured: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(b, n, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.keep:
            self.captured = (q, k)
        # key/value heads repeated, not enable_gqa: with float32 inputs (the student) SDPA's fused kernels refuse
        # enable_gqa and it falls back to its math backend, which keeps every layer's B·H·N² attention map
        group = self.heads // self.kv_heads
        y = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                           is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, n, -1))
        gate, up = self.up(self.norm2(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


class Decoder(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, kv_heads: int, ffn: int, head: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([Block(dim, heads, kv_heads, ffn) for _ in range(layers)])
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False) if head else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        return self.head(x) if self.head is not None else x


def _library_teacher_module():
    """``lightning_streamkl/teacher.py`` (torch and its torch-only siblings), loaded from its file as a module of a
    package that is never initialised: the package's ``__init__`` needs omegaconf."""
    package = "_streamkl_teacher_layout"
    if package not in sys.modules:
        shell = types.ModuleType(package)
        shell.__path__ = [str(ROOT / "lightning_streamkl")]  # its relative imports find the siblings' files
        sys.modules[package] = shell
    spec = importlib.util.spec_from_file_location(f"{package}.teacher", ROOT / "lightning_streamkl" / "teacher.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------- measurement
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def _memory(device: torch.device, peak: bool) -> int | None:
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) if peak else torch.cuda.memory_allocated(device)


def _build(sizes: Sizes, device: torch.device, backend_kl: str, layout: str, mesh: Any) -> dict:
    """One layout's teacher, student and optimizer."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    layout_lib = _library_teacher_module()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # the teacher is built in bf16: never a float32 copy of it
    try:
        torch.manual_seed(0)
        with device:
            teacher = Decoder(sizes.vocab, sizes.teacher_dim, sizes.teacher_layers, sizes.teacher_heads,
                              sizes.teacher_kv_heads, sizes.teacher_ffn, head=False)
    finally:
        torch.set_default_dtype(default)
    teacher.eval().requires_grad_(False)
    if layout in ("fsdp", "ddp+sharded-teacher"):
        layout_lib.shard_module(teacher, mesh)
    torch.manual_seed(1)
    with device:
        student = Decoder(sizes.vocab, sizes.student_dim, sizes.student_layers, sizes.student_heads,
                          sizes.student_kv_heads, sizes.student_ffn, head=True)
    teacher.layers[-1].keep = student.layers[-1].keep = True
    if layout == "fsdp":
        for block in student.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(student, mesh=mesh)
        wrapped = student
    else:
        wrapped = DistributedDataParallel(student, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-4)
    return {"teacher": teacher, "student": student, "wrapped": wrapped, "optimizer": optimizer,
            "reshard": layout_lib.reshard, "backend": backend_kl}


def _step(parts: dict, ids: torch.Tensor) -> float:
    from streamkl import attention_kl

    teacher, student = parts["teacher"], parts["student"]
    with torch.no_grad():
        teacher(ids)
    parts["reshard"](teacher)
    q_t, k_t = teacher.layers[-1].captured
    logits = parts["wrapped"](ids)
    q_s, k_s = student.layers[-1].captured
    task = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    kl = attention_kl(q_t, k_t, q_s, k_s, causal=True, backend=parts["backend"])
    (task + kl).backward()
    parts["optimizer"].step()
    parts["optimizer"].zero_grad(set_to_none=True)
    teacher.layers[-1].captured = student.layers[-1].captured = None
    return float(kl.detach())


def measure_layouts(rank: int, sizes: Sizes, device: torch.device, backend_kl: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (WORLD,))
    g = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(0, sizes.vocab, (sizes.batch, sizes.seq), generator=g).to(device)
               for _ in range(sizes.warmup_steps + sizes.timed_steps)]
    results = {}
    for layout in ("ddp", "fsdp", "ddp+sharded-teacher"):
        parts = _build(sizes, device, backend_kl, layout, mesh)
        teacher_local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                            for p in parts["teacher"].parameters())
        teacher_total = sum(p.numel() for p in parts["teacher"].parameters())
        kls, times = [], []
        for i, ids in enumerate(batches):
            if i == sizes.warmup_steps:
                _sync(device)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                at_rest = _memory(device, peak=False)
            _sync(device)
            start = time.perf_counter()
            kls.append(_step(parts, ids))
            _sync(device)
            if i >= sizes.warmup_steps:
                times.append(time.perf_counter() - start)
        results[layout] = {
            "teacher_params": teacher_total, "teacher_params_on_this_gpu": teacher_local,
            "memory_at_rest_bytes": at_rest, "peak_memory_bytes": _memory(device, peak=True),
            "step_time_s": statistics.median(times), "step_times_s": times, "kl_per_step": kls,
        }
        del parts
        _free(device)
        _progress(rank, f"layout {layout}: step {results[layout]['step_time_s']:.3f} s, peak "
                        f"{_gib(results[layout]['peak_memory_bytes'])} on GPU 0")
    return results


def _progress(rank: int, message: str) -> None:
    """One line of progress from the first process (the JSON is written only at the end)."""
    if rank == 0:
        print(f"[bench_sharding] {message}", flush=True)


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.1f} GiB"


def _cp_tensors(sizes: Sizes, device: torch.device, dtype: torch.dtype, n: int, seed: int = 7):
    g = torch.Generator(device=device).manual_seed(seed)
    shapes = [(1, sizes.cp_heads, n, sizes.cp_dim_t), (1, sizes.cp_kv_heads, n, sizes.cp_dim_t),
              (1, sizes.cp_heads, n, sizes.cp_dim_s), (1, sizes.cp_kv_heads, n, sizes.cp_dim_s)]
    return [torch.randn(s, generator=g, device=device, dtype=dtype) for s in shapes]


def _timed(fn, device: torch.device, repeats: int) -> tuple[float, int | None]:
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up, and the peak memory of those runs."""
    fn()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), _memory(device, peak=True)


def _timed_backward(kl, q_t: torch.Tensor, k_t: torch.Tensor, q_s: torch.Tensor, k_s: torch.Tensor, opts: dict,
                    device: torch.device, repeats: int) -> tuple[float, int | None]:
    """:func:`_timed` forward + backward of ``kl(q_t, k_t, q_s, k_s, **opts)`` (gradients of the student's side)."""
    q_s.requires_grad_(True)
    k_s.requires_grad_(True)

    def run() -> None:
        q_s.grad = k_s.grad = None
        kl(q_t, k_t, q_s, k_s, **opts).backward()

    return _timed(run, device, repeats)


def measure_context_parallel(rank: int, sizes: Sizes, device: torch.device, backend_kl: str) -> dict:
    """Each measurement holds only its own inputs (the peaks include them): this GPU's half for the sharded run,
    the whole sequence for one GPU."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n, half = sizes.cp_tokens, sizes.cp_tokens // WORLD
    opts = dict(causal=True, backend=backend_kl, reduction="sum")
    out, sharded_result = _measure_sharded(rank, sizes, device, dtype, opts)
    _progress(rank, f"context parallel N={n} on {WORLD} GPUs: {out['sharded_2gpu']['time_s']:.3f} s on GPU 0")
    for tokens in (half, n):
        out[f"one_gpu_{tokens}"], exactness = _measure_one_gpu(sizes, device, dtype, tokens, opts,
                                                               sharded_result if tokens == n else None, rank)
        if exactness is not None:
            out["exactness_vs_one_gpu"] = exactness
        _free(device)
        _progress(rank, f"one GPU N={tokens}: {out[f'one_gpu_{tokens}']['time_s']:.3f} s")
    return out


def _measure_one_gpu(sizes: Sizes, device: torch.device, dtype: torch.dtype, tokens: int, opts: dict,
                     sharded: tuple[torch.Tensor, ...] | None, rank: int) -> tuple[dict, dict | None]:
    """attention_kl on one GPU over ``tokens`` (only its own inputs resident); with the sharded run's results, the
    same problem: how far this GPU's rows of the sharded KL and gradients are from it."""
    from streamkl import attention_kl

    q_t, k_t, q_s, k_s = _cp_tensors(sizes, device, dtype, tokens, seed=7 if sharded is not None else 8)
    seconds, peak = _timed_backward(attention_kl, q_t, k_t, q_s, k_s, opts, device, sizes.cp_repeats)
    if sharded is None:
        return {"time_s": seconds, "peak_memory_bytes": peak}, None
    q_s.grad = k_s.grad = None
    reference = attention_kl(q_t, k_t, q_s, k_s, **{**opts, "reduction": "none"})
    reference.sum().backward()
    half = sizes.cp_tokens // WORLD
    rows = slice(rank * half, (rank + 1) * half)
    kl, dq, dk = sharded
    exactness = {
        "kl_rel_error": rel_l2(kl, reference.detach()[:, :, rows]),
        "dq_s_rel_error": rel_l2(dq, q_s.grad[:, :, rows]),
        "dk_s_rel_error": rel_l2(dk, k_s.grad[:, :, rows]),
        "kl_sum_sharded": float(kl.double().sum()),
        "kl_sum_one_gpu": float(reference.detach()[:, :, rows].double().sum()),
    }
    return {"time_s": seconds, "peak_memory_bytes": peak}, exactness


def _measure_sharded(rank: int, sizes: Sizes, device: torch.device, dtype: torch.dtype, opts: dict
                     ) -> tuple[dict, tuple[torch.Tensor, ...]]:
    """The sharded run's time and peak (this GPU's half of the inputs resident), its per-row KL and gradients."""
    from streamkl.sharded import context_parallel_attention_kl

    n, half = sizes.cp_tokens, sizes.cp_tokens // WORLD
    q_t, k_t, q_s, k_s = (x[:, :, rank * half:(rank + 1) * half].clone()
                          for x in _cp_tensors(sizes, device, dtype, n))
    _free(device)
    seconds, peak = _timed_backward(context_parallel_attention_kl, q_t, k_t, q_s, k_s, opts, device,
                                    sizes.cp_repeats)
    q_s.grad = k_s.grad = None
    per_row = context_parallel_attention_kl(q_t, k_t, q_s, k_s, **{**opts, "reduction": "none"})
    per_row.sum().backward()
    out = {"tokens": n, "tokens_per_gpu": half, "sharded_2gpu": {"time_s": seconds, "peak_memory_bytes": peak}}
    return out, (per_row.detach(), q_s.grad, k_s.grad)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- driver
def _worker(rank: int, port: int, smoke: bool, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available() and not smoke
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=WORLD)
    try:
        sizes = SMOKE if smoke else Sizes()
        backend_kl = "triton" if cuda else "reference"
        result = {"rank": rank, "layouts": measure_layouts(rank, sizes, device, backend_kl),
                  "context_parallel": measure_context_parallel(rank, sizes, device, backend_kl)}
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def device_name(smoke: bool) -> str:
    if smoke or not torch.cuda.is_available():
        return "cpu-smoke"
    return torch.cuda.get_device_name(0).lower().replace(" ", "-")


def summarise(ranks: list[dict]) -> dict:
    """Per layout and measurement: each GPU's numbers, the larger of the two, and the layouts' agreement."""
    layouts = {}
    for name in ranks[0]["layouts"]:
        per_gpu = [r["layouts"][name] for r in ranks]
        layouts[name] = {
            "per_gpu": per_gpu,
            "peak_memory_bytes_max": _max(g["peak_memory_bytes"] for g in per_gpu),
            "memory_at_rest_bytes_max": _max(g["memory_at_rest_bytes"] for g in per_gpu),
            "step_time_s_max": max(g["step_time_s"] for g in per_gpu),
            "first_step_kl": [g["kl_per_step"][0] for g in per_gpu],
        }
    base = layouts["ddp"]["first_step_kl"]
    for entry in layouts.values():
        entry["first_step_kl_max_rel_diff_vs_ddp"] = max(abs(a - b) / max(abs(b), 1e-30)
                                                         for a, b in zip(entry["first_step_kl"], base))
    cp = [r["context_parallel"] for r in ranks]
    context = {
        "tokens": cp[0]["tokens"], "tokens_per_gpu": cp[0]["tokens_per_gpu"],
        "sharded_2gpu": {"time_s_max": max(c["sharded_2gpu"]["time_s"] for c in cp),
                         "peak_memory_bytes_max": _max(c["sharded_2gpu"]["peak_memory_bytes"] for c in cp),
                         "per_gpu": [c["sharded_2gpu"] for c in cp]},
        "exactness_vs_one_gpu": {k: max(c["exactness_vs_one_gpu"][k] for c in cp)
                                 for k in ("kl_rel_error", "dq_s_rel_error", "dk_s_rel_error")},
        "exactness_per_gpu": [c["exactness_vs_one_gpu"] for c in cp],
    }
    for key in cp[0]:
        if key.startswith("one_gpu_"):
            context[key] = cp[0][key]  # measured on GPU 0 (GPU 1 ran the same, concurrently)
    return {"layouts": layouts, "context_parallel": context}


def _max(values) -> int | None:
    values = [v for v in values if v is not None]
    return max(values) if values else None


# ---------------------------------------------------------------------------------------------- the guide's tables
DOCS_PAGE = ROOT / "docs" / "guides" / "sharding.md"
LAYOUT_NAMES = {"ddp": "DDP (a whole teacher on each GPU)", "fsdp": "FSDP2 (student and teacher sharded)",
                "ddp+sharded-teacher": "DDP, teacher sharded (`teacher_sharding=\"shard\"`)"}


def _gib_cell(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def _billions(n: int) -> str:
    return f"{n / 1e9:.1f} B"


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or not b else f"{a / b:.2f}×"


def _error(x: float) -> str:
    return "0" if x == 0 else f"{x:.1e}"


def kl_steps_rel_diff(result: dict, layout: str) -> float:
    """The largest relative difference of ``layout``'s KL from DDP's, over every step (warm-up included) and GPU."""
    pairs = zip(result["layouts"][layout]["per_gpu"], result["layouts"]["ddp"]["per_gpu"])
    return max(abs(a - b) / max(abs(b), 1e-30) for run, ddp in pairs
               for a, b in zip(run["kl_per_step"], ddp["kl_per_step"]))


def layouts_block(result: dict, source: str) -> str:
    """The guide's ``sharding-gpu`` block: the run, and DDP against FSDP2 and against DDP with a sharded teacher."""
    s, lay = result["sizes"], result["layouts"]
    ddp = lay["ddp"]
    teacher = ddp["per_gpu"][0]["teacher_params"]
    lines = [
        f"`{source}`: {result['world']} × {result['device']} (one host, NCCL), torch {result['torch']}; one run of "
        f"`bench_sharding.py` ({result['wall_s']:.1f} s in all). Teacher: {s['teacher_layers']} blocks of width "
        f"{s['teacher_dim']} ({s['teacher_heads']} query and {s['teacher_kv_heads']} key/value heads, FFN "
        f"{s['teacher_ffn']}), {_billions(teacher)} parameters ({result['teacher_gb_bf16']:.1f} GB in bf16), frozen; "
        f"student: {s['student_layers']} blocks of width {s['student_dim']} (FFN {s['student_ffn']}), float32, AdamW; "
        f"{s['batch']} × {s['seq']} tokens per GPU and step, the KL on the last layers' pair. Step time: the median of "
        f"{s['timed_steps']} steps after {s['warmup_steps']} warm-up steps, on the slower GPU. Memory: "
        "`torch.cuda.memory_allocated` before the timed steps (at rest) and `max_memory_allocated` over them (peak), "
        "on the GPU that holds more. KL: the largest relative difference of a step's KL from DDP's on the same GPU "
        "(0: bitwise equal).",
        "",
        "| layout | teacher parameters per GPU | memory at rest per GPU | peak memory per GPU | peak vs DDP "
        "| step time | time vs DDP | KL vs DDP, first step "
        f"| KL vs DDP, all {s['warmup_steps'] + s['timed_steps']} steps |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in lay.items():
        local = max(g["teacher_params_on_this_gpu"] for g in entry["per_gpu"])
        share = "all" if local == teacher else f"1/{round(teacher / local)}"
        diffs = ("–", "–") if name == "ddp" else (_error(entry["first_step_kl_max_rel_diff_vs_ddp"]),
                                                  _error(kl_steps_rel_diff(result, name)))
        lines.append(
            f"| {LAYOUT_NAMES.get(name, name)} | {_billions(local)} ({share}) | "
            f"{_gib_cell(entry['memory_at_rest_bytes_max'])} | {_gib_cell(entry['peak_memory_bytes_max'])} | "
            f"{_ratio(entry['peak_memory_bytes_max'], ddp['peak_memory_bytes_max'])} | "
            f"{entry['step_time_s_max']:.3f} s | {_ratio(entry['step_time_s_max'], ddp['step_time_s_max'])} | "
            f"{diffs[0]} | {diffs[1]} |")
    return "\n".join(lines)


def context_block(result: dict, source: str) -> str:
    """The guide's ``sharding-gpu-context`` block: the sequence-sharded KL against one GPU, and its exactness."""
    s, cp, world = result["sizes"], result["context_parallel"], result["world"]
    n, half = cp["tokens"], cp["tokens_per_gpu"]
    sharded = cp["sharded_2gpu"]
    lengths = sorted(int(k.removeprefix("one_gpu_")) for k in cp if k.startswith("one_gpu_"))

    def ratios(seconds: float) -> str:
        return " | ".join(_ratio(seconds, cp[f"one_gpu_{m}"]["time_s"]) for m in lengths)

    lines = [
        f"`{source}` ({result['world']} × {result['device']}, the same run): causal, bf16, B = 1, {s['cp_heads']} "
        f"query and {s['cp_kv_heads']} key/value heads, head dims {s['cp_dim_t']} (teacher) and {s['cp_dim_s']} "
        f"(student); the forward and the backward (the student's gradients), the median of {s['cp_repeats']} runs "
        "after one warm-up; the peak (`max_memory_allocated`) with only that run's inputs resident: for the sharded "
        "run, one GPU's part of the sequence.",
        "",
        "| run | tokens per GPU | forward+backward | " + " | ".join(f"time vs one GPU at N = {m}" for m in lengths)
        + " | peak memory per GPU |",
        "|---|---|---|" + "---|" * len(lengths) + "---|",
        f"| `context_parallel_attention_kl`, N = {n} over {world} GPUs | {half} | {sharded['time_s_max']:.3f} s "
        f"(slower GPU) | {ratios(sharded['time_s_max'])} | "
        + " / ".join(_gib_cell(g["peak_memory_bytes"]) for g in sharded["per_gpu"])
        + f" (GPU {' / '.join(map(str, range(world)))}) |",
    ]
    for m in lengths:
        one = cp[f"one_gpu_{m}"]
        lines.append(f"| `attention_kl`, one GPU, N = {m} | {m} | {one['time_s']:.3f} s | {ratios(one['time_s'])} | "
                     f"{_gib_cell(one['peak_memory_bytes'])} |")
    lines += [
        "",
        f"Exactness of the {world}-GPU run against `attention_kl` on one GPU at N = {n} on the same bf16 inputs: the "
        "relative L2 error over each GPU's part (the KL and the query gradient of its rows, the gradient of its keys; "
        "0: bitwise equal).",
        "",
        "| GPU | tokens | per-row KL | student query gradient | student key gradient |",
        "|---|---|---|---|---|",
    ]
    for rank, e in enumerate(cp["exactness_per_gpu"]):
        lines.append(f"| {rank} | {rank * half} to {(rank + 1) * half - 1} | {_error(e['kl_rel_error'])} | "
                     f"{_error(e['dq_s_rel_error'])} | {_error(e['dk_s_rel_error'])} |")
    return "\n".join(lines)


DOCS_BLOCKS = {"sharding-gpu": layouts_block, "sharding-gpu-context": context_block}


def write_docs(path: str, page: Path = DOCS_PAGE) -> dict[str, str]:
    """Write each block of :data:`DOCS_BLOCKS`, rendered from the result file ``path``, into ``page``."""
    result = json.loads(Path(path).read_text())
    source = os.path.relpath(os.path.abspath(path), ROOT)
    blocks = {name: render(result, source) for name, render in DOCS_BLOCKS.items()}
    write_blocks(str(page), blocks)
    return blocks


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="2 CPU processes (gloo), tiny sizes: the script runs")
    parser.add_argument("--results", default=str(RESULTS), help="folder of the committed results")
    parser.add_argument("--docs", metavar="RESULT_JSON", default=None,
                        help="render a committed run into docs/guides/sharding.md and exit (no GPU needed)")
    args = parser.parse_args(argv)
    if args.docs:
        print("\n\n".join(write_docs(args.docs).values()))
        return json.loads(Path(args.docs).read_text())
    if not args.smoke and torch.cuda.device_count() < WORLD:
        sys.exit(f"needs {WORLD} CUDA devices (found {torch.cuda.device_count()}); --smoke runs on the CPU")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        # CUDA cannot be used in forked processes; the CPU smoke run forks (it starts in well under a second)
        mp.start_processes(_worker, args=(port, args.smoke, tmp), nprocs=WORLD,
                           start_method="fork" if args.smoke else "spawn")
        ranks = [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    sizes = SMOKE if args.smoke else Sizes()
    result = {
        "device": device_name(args.smoke), "world": WORLD, "torch": torch.__version__,
        "sizes": asdict(sizes), "wall_s": round(time.time() - started, 1),
        "teacher_gb_bf16": round(ranks[0]["layouts"]["ddp"]["teacher_params"] * 2 / 1e9, 1),
        **summarise(ranks),
    }
    path = Path(args.results) / f"sharding_{result['device']}.json"
    write_json(str(path), result)
    print(f"wrote {path}")
    lay, cp = result["layouts"], result["context_parallel"]
    for layout, entry in lay.items():
        print(f"{layout:>22}: step {entry['step_time_s_max']:.3f} s, peak {_gib(entry['peak_memory_bytes_max'])} "
              f"per GPU, first-step KL vs ddp "
              f"{entry['first_step_kl_max_rel_diff_vs_ddp']:.1e}")
    print(f"context parallel, N={cp['tokens']} on 2: {cp['sharded_2gpu']['time_s_max']:.3f} s; "
          f"exactness {cp['exactness_vs_one_gpu']}")
    assert math.isfinite(cp["exactness_vs_one_gpu"]["kl_rel_error"])
    return result


if __name__ == "__main__":
    main()
