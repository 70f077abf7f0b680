r"""Multi-query associative recall (MQAR) at long context, and the small models that learn it.

The task is Zoology's MQAR (Arora et al., 2023, *Zoology: Measuring and Improving Recall in Efficient Language
Models*): a sequence opens with ``D`` key-value pairs ``k1 v1 k2 v2 … kD vD``; later, keys come back as queries, and
at each query the model must output the value that followed that key in the opening block. Positions that are not
queries are filler and are not scored. As in Zoology, keys and values come from disjoint halves of the vocabulary,
each opening block holds distinct keys and distinct values, and the value is never written after its query (so a
later query cannot copy it from an earlier one). Two choices differ from Zoology's defaults, for long context:

- **filler from its own tokens**: Zoology fills with random tokens of the whole vocabulary; at 16k tokens and a small
  vocabulary that puts hundreds of copies of every key in the filler and makes the task ill-posed, so the filler is
  drawn from a separate noise vocabulary;
- **query depth uniform over the sequence**: Zoology draws query positions from a power law that keeps most queries
  near the opening block; here they are uniform over the rest of the sequence, so retrieval distances range from a
  few tokens to ``N`` (the needle-in-a-haystack depths, all at once). ``depth_bins`` of :func:`evaluate` reports
  accuracy per depth.

The models are small causal transformers whose attention has **no position encoding** (NoPE) and a short causal
depthwise convolution before each attention layer (the short convolutions of Zoology's and H3/Based's hybrids). The
convolution gives each position its previous token, so retrieval is a pure content lookup (the query ``k`` matches
the position whose previous token is ``k`` and copies its token, the value) that does not depend on where the pair
is; nothing in the model is tied to the training length except the softmax's dilution over more keys. The
attention hands its queries and keys to the distillation with :func:`lightning_streamkl.capture.record`.

This module is part of the long-context benchmark (``benchmarks/long_context/run.py``); the library never imports it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

IGNORE = -100


# ---------------------------------------------------------------------------------------------------- the task
@dataclass(frozen=True)
class MQAR:
    """The task's vocabulary and sizes; :meth:`batch` draws sequences.

    Token ids: keys ``[0, num_keys)``, values ``[num_keys, num_keys + num_values)``, filler after them.

    Args:
        num_keys: size of the key vocabulary (each sequence uses ``num_pairs`` distinct ones).
        num_values: size of the value vocabulary (chance accuracy is ``1 / num_values``).
        num_noise: size of the filler vocabulary.
        num_pairs: key-value pairs ``D`` in the opening block.
        num_queries: queries per sequence ``Q``; ``None``: ``D`` (each key asked once, as in Zoology), or one query
            per ``query_every`` positions after the opening block when that is set (at least ``D``). With ``Q > D``
            every key is asked at least once and the rest at random.
        query_every: the query density when ``num_queries`` is ``None`` (e.g. 16: one position in 16 is a query,
            at every length).

    Example:
        >>> task = MQAR(num_keys=16, num_values=16, num_noise=8, num_pairs=4)
        >>> b = task.batch(2, 64, generator=torch.Generator().manual_seed(0))
        >>> x, y = b["input_ids"][0], b["labels"][0]
        >>> scored = (y != IGNORE).nonzero().flatten()
        >>> len(scored), bool((x[scored] < 16).all())          # the queries are keys...
        (4, True)
        >>> kv = dict(zip(x[0:8:2].tolist(), x[1:8:2].tolist()))
        >>> all(kv[int(x[i])] == int(y[i]) for i in scored)    # ...labelled with their values
        True
    """

    num_keys: int = 256
    num_values: int = 256
    num_noise: int = 64
    num_pairs: int = 32
    num_queries: int | None = None
    query_every: int | None = None

    def __post_init__(self) -> None:
        if self.num_pairs > min(self.num_keys, self.num_values):
            raise ValueError(f"num_pairs ({self.num_pairs}) exceeds the key or value vocabulary.")

    @property
    def vocab_size(self) -> int:
        return self.num_keys + self.num_values + self.num_noise

    def queries(self, seq_len: int) -> int:
        """Queries per sequence of ``seq_len`` tokens."""
        if self.num_queries is not None:
            return self.num_queries
        if self.query_every is not None:
            return max(self.num_pairs, (seq_len - 2 * self.num_pairs) // self.query_every)
        return self.num_pairs

    @property
    def chance(self) -> float:
        return 1.0 / self.num_values

    def batch(self, batch_size: int, seq_len: int, *, generator: torch.Generator | None = None,
              device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """``{"input_ids": [B, N], "labels": [B, N], "depth": [B, N]}``; ``depth`` is the query's position relative
        to the sequence (``i / N``) where a label is, else ``-1``."""
        d, q = self.num_pairs, self.queries(seq_len)
        region = seq_len - 2 * d
        if region < q:
            raise ValueError(f"seq_len={seq_len} leaves {region} positions for {q} queries after {d} pairs.")
        g, b = generator, batch_size
        dev = g.device if g is not None else torch.device(device)  # drawn where the generator lives
        keys = torch.rand(b, self.num_keys, generator=g, device=dev).argsort(-1)[:, :d]
        values = self.num_keys + torch.rand(b, self.num_values, generator=g, device=dev).argsort(-1)[:, :d]
        x = self.num_keys + self.num_values + torch.randint(0, self.num_noise, (b, seq_len), generator=g, device=dev)
        x[:, 0:2 * d:2], x[:, 1:2 * d:2] = keys, values
        # query positions: Q distinct positions of the region, uniform; which pair each asks for
        pos = 2 * d + torch.rand(b, region, generator=g, device=dev).argsort(-1)[:, :q]
        if q <= d:
            which = torch.rand(b, d, generator=g, device=dev).argsort(-1)[:, :q]
        else:
            extra = torch.randint(0, d, (b, q - d), generator=g, device=dev)
            which = torch.cat([torch.arange(d, device=dev).expand(b, d), extra], 1)
            which = which.gather(1, torch.rand(b, q, generator=g, device=dev).argsort(-1))
        x.scatter_(1, pos, keys.gather(1, which))
        labels = torch.full_like(x, IGNORE)
        labels.scatter_(1, pos, values.gather(1, which))
        depth = torch.full(x.shape, -1.0, device=dev)
        depth.scatter_(1, pos, pos.float() / seq_len)
        return {"input_ids": x.to(device), "labels": labels.to(device), "depth": depth.to(device)}


# ---------------------------------------------------------------------------------------------------- the model
def _record(module: nn.Module, q: torch.Tensor, k: torch.Tensor) -> None:
    try:
        from lightning_streamkl import record
    except ImportError:  # the model also runs without the library (e.g. to time it alone)
        return
    record(module, q, k, causal=True)


def _rope(x: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary position embedding on all of ``x`` ``[B, H, N, D]``."""
    n, half = x.shape[-2], x.shape[-1] // 2
    inv = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angle = torch.arange(n, device=x.device, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Attention(nn.Module):
    """Causal multi-head attention, NoPE (default) or RoPE; hands ``(q, k)`` to the recording captures.

    Args:
        d_model: width.
        num_heads: heads.
        position: ``"nope"`` (no position encoding) or ``"rope"``.
        rope_base: the rotary base when ``position="rope"``.
        length_scale: multiply query ``i``'s scores by ``s_h · log(i + 1)`` with a learned ``s_h`` per head
            (scalable softmax, Nakanishi 2025), so a match keeps its share of the attention as the number of keys
            grows; the queries are recorded with the factor applied, so the distilled KL is the layer's own.
    """

    def __init__(self, d_model: int, num_heads: int, position: str = "nope", rope_base: float = 10_000.0,
                 length_scale: bool = False) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads}).")
        if position not in ("nope", "rope"):
            raise ValueError(f"position must be 'nope' or 'rope', got {position!r}.")
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.position, self.rope_base = position, rope_base
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        # s_h starts at 1 / log(128): factor 1 at the 128th position
        self.length_scale = nn.Parameter(torch.full((num_heads, 1, 1), 1 / math.log(128))) if length_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.position == "rope":
            q, k = _rope(q, self.rope_base), _rope(k, self.rope_base)
        if self.length_scale is not None:
            logn = torch.arange(1, n + 1, device=x.device, dtype=torch.float32).log()[:, None]
            q = q * (self.length_scale * logn).to(q.dtype)
        _record(self, q, k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


class ShortConv(nn.Module):
    """Depthwise causal convolution over the sequence (kernel ``k``): each position sees its ``k - 1`` predecessors."""

    def __init__(self, d_model: int, kernel: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(d_model, d_model, kernel, groups=d_model, padding=kernel - 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)


class Block(nn.Module):
    def __init__(self, d_model: int, num_heads: int, conv_kernel: int, mlp_ratio: int, position: str,
                 rope_base: float, length_scale: bool) -> None:
        super().__init__()
        self.conv = ShortConv(d_model, conv_kernel) if conv_kernel > 1 else None
        self.norm_conv = nn.LayerNorm(d_model) if self.conv is not None else None
        self.norm = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, num_heads, position, rope_base, length_scale)
        self.mlp = None
        if mlp_ratio:
            self.norm_mlp = nn.LayerNorm(d_model)
            self.mlp = nn.Sequential(nn.Linear(d_model, mlp_ratio * d_model), nn.GELU(),
                                     nn.Linear(mlp_ratio * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.conv is not None:
            x = x + self.conv(self.norm_conv(x))
        x = x + self.attn(self.norm(x))
        if self.mlp is not None:
            x = x + self.mlp(self.norm_mlp(x))
        return x


@dataclass
class ModelConfig:
    """A model of the benchmark; layer ``i``'s attention is ``blocks.<i>.attn``.

    Example:
        >>> ModelConfig(d_model=64, num_heads=4).build(vocab_size=100).blocks[1].attn.head_dim
        16
    """

    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 4
    position: str = "nope"  # or "rope"
    conv_kernel: int = 4  # the short convolution before each attention (1: none)
    mlp_ratio: int = 0
    rope_base: float = 10_000.0
    length_scale: bool = False

    def build(self, vocab_size: int) -> MQARModel:
        return MQARModel(vocab_size, self)


class MQARModel(nn.Module):
    """Embedding, ``num_layers`` blocks (short conv, attention, optional MLP), final norm and output head."""

    def __init__(self, vocab_size: int, config: ModelConfig) -> None:
        super().__init__()
        c = self.config = config
        self.embed = nn.Embedding(vocab_size, c.d_model)
        self.blocks = nn.ModuleList(Block(c.d_model, c.num_heads, c.conv_kernel, c.mlp_ratio, c.position,
                                          c.rope_base, c.length_scale) for _ in range(c.num_layers))
        self.norm = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------------- training
def task_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy and accuracy on the scored (query) positions only (the logits there, not ``B·N·V`` of them)."""
    scored = labels != IGNORE
    picked = logits[scored].float()
    target = labels[scored]
    return F.cross_entropy(picked, target), (picked.argmax(-1) == target).float().mean()


@dataclass
class Schedule:
    """Training lengths and batch sizes, step by step: ``stages`` is a list of ``(steps, [(seq_len, batch)...])``;
    within a stage the lengths take turns batch by batch.

    Example:
        >>> s = Schedule([(2, [(64, 8)]), (3, [(128, 4), (256, 2)])])
        >>> [s.at(i) for i in range(5)], s.steps
        ([(64, 8), (64, 8), (128, 4), (256, 2), (128, 4)], 5)
    """

    stages: list[tuple[int, list[tuple[int, int]]]] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return sum(s for s, _ in self.stages)

    def at(self, step: int) -> tuple[int, int]:
        for steps, shapes in self.stages:
            if step < steps:
                return tuple(shapes[step % len(shapes)])  # type: ignore[return-value]
            step -= steps
        steps, shapes = self.stages[-1]
        return tuple(shapes[step % len(shapes)])  # type: ignore[return-value]


def batch_for(task: MQAR, seed: int, step: int, shape: tuple[int, int],
              device: torch.device) -> dict[str, torch.Tensor]:
    """Training batch ``step`` of data seed ``seed`` (the same for every model trained with that seed)."""
    g = torch.Generator(device).manual_seed(1_000_003 * (seed + 1) + step)
    return task.batch(shape[1], shape[0], generator=g, device=device)


def autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class OutOfTime(RuntimeError):
    """Training passed the hard deadline (``abort_at``)."""


def train(model: nn.Module, task: MQAR, schedule: Schedule, *, seed: int, device: torch.device, lr: float = 1e-3,
          warmup: int = 50, weight_decay: float = 0.0, distiller: Any = None, kl_weight: float = 1.0,
          max_steps: int | None = None, time_limit_s: float | None = None, min_steps: int = 0,
          snapshots: Sequence[int] = (), snapshot_at_s: float | None = None, log_every: int = 10,
          on_log: Callable[[dict[str, float]], None] | None = None, data_seed: int | None = None,
          kl_rows: str = "all", thresholds: Sequence[float] = (0.5, 0.9), window: int = 20,
          abort_at: float | None = None) -> dict[str, Any]:
    """Train ``model`` (AdamW, linear warm-up, constant rate) on the schedule, with attention KL when a
    :class:`~lightning_streamkl.AttentionDistiller` (already ``setup`` on ``model``) is given.

    Stops at ``max_steps`` (default: the schedule's), or once ``time_limit_s`` of training time has passed and at
    least ``min_steps`` were made. Keeps a copy of the weights after each step in ``snapshots`` and after the first
    step at which the training time reaches ``snapshot_at_s``. Training time is the sum of synchronised step times
    (data generation included, evaluation excluded).

    ``thresholds``: the first step (and training time) at which the moving average over ``window`` steps of the
    training accuracy (each step's batch is fresh data) reaches each threshold. ``abort_at``: a ``time.time()`` at
    which training raises :class:`OutOfTime` (a hard deadline the caller's budget should never reach).

    Returns ``{"history": [...], "steps", "train_s", "step_ms" (every step), "peak_bytes", "reached": {threshold:
    {"step", "train_s"}}, "snapshots": {key: state}}``.
    """
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(warmup, 1)))
    total = schedule.steps if max_steps is None else max_steps
    history: list[dict[str, float]] = []
    step_ms: list[float] = []
    snaps: dict[str, dict[str, torch.Tensor]] = {}
    train_s = 0.0
    want = set(snapshots)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step = 0
    seed = seed if data_seed is None else data_seed
    accs: deque[float] = deque(maxlen=window)
    reached: dict[str, dict[str, float] | None] = {str(t): None for t in thresholds}
    while step < total:
        if abort_at is not None and time.time() > abort_at:
            raise OutOfTime(f"stopped at step {step}: past the phase's deadline")
        if time_limit_s is not None and train_s >= time_limit_s and step >= min_steps:
            break
        shape = schedule.at(step)
        _sync(device)
        t0 = time.perf_counter()
        batch = batch_for(task, seed, step, shape, device)
        with autocast(device):
            if distiller is not None:
                distiller.begin_step(batch)
                with distiller.student_recording():
                    logits = model(batch["input_ids"])
                terms = kl_terms(distiller, batch, kl_rows)
                ce, acc = task_loss(logits, batch["labels"])
                loss = ce + kl_weight * terms.total
            else:
                logits = model(batch["input_ids"])
                ce, acc = task_loss(logits, batch["labels"])
                loss, terms = ce, None
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        _sync(device)
        dt = time.perf_counter() - t0
        train_s += dt
        step += 1
        step_ms.append(1e3 * dt)
        accs.append(float(acc))
        if len(accs) == window:
            avg = sum(accs) / window
            for t in thresholds:
                if reached[str(t)] is None and avg >= t:
                    reached[str(t)] = {"step": step, "train_s": train_s}
        if step in want:
            snaps[f"step{step}"] = _copy_state(model)
        if snapshot_at_s is not None and "time" not in snaps and train_s >= snapshot_at_s:
            snaps["time"] = _copy_state(model)
            snaps["time_step"] = step  # type: ignore[assignment]
        if step % log_every == 0 or step == total:
            row = {"step": step, "seq_len": shape[0], "batch": shape[1], "loss": float(ce.detach()),
                   "acc": float(acc), "train_s": train_s}
            if terms is not None:
                row.update({f"kl/{k}": float(v.detach()) for k, v in terms.per_pair.items()})
            history.append(row)
            if on_log is not None:
                on_log(row)
    peak = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    return {"history": history, "steps": step, "train_s": train_s, "step_ms": step_ms, "peak_bytes": peak,
            "reached": reached, "snapshots": snaps}


def kl_terms(distiller: Any, batch: dict[str, torch.Tensor], rows: str = "all") -> Any:
    """The step's attention-KL terms: over every query row (``rows="all"``, the engine's ``end_step``) or over the
    scored rows only (``"queries"``: the task's query positions, through the engine's loss with a ``query_mask``)."""
    if rows == "all":
        return distiller.end_step(batch)
    if rows != "queries":
        raise ValueError(f"kl_rows must be 'all' or 'queries', got {rows!r}.")
    try:
        distiller.run_teacher(batch)  # (end_step would run it too, with the batch's own masks)
        return distiller.loss(distiller.teacher_capture.pop(), distiller.student_capture.pop(),
                              query_mask=batch["labels"] != IGNORE)
    finally:
        distiller.clear()


def distiller_for(teacher: torch.nn.Module, student: torch.nn.Module, pairs: list[list[int]], *,
                  early_exit: bool = True):
    """An :class:`~lightning_streamkl.AttentionDistiller` pairing ``blocks.<t>.attn`` with ``blocks.<s>.attn``."""
    from lightning_streamkl import AttentionDistiller

    config = {"pairs": [{"teacher": f"blocks.{t}.attn", "student": f"blocks.{s}.attn", "name": f"layer{t}_{s}"}
                        for t, s in pairs],
              "head_map": "group", "teacher_inputs": "batch", "mask_key": None, "teacher_early_exit": early_exit}
    distiller = AttentionDistiller(teacher, config)
    distiller.setup(student)
    return distiller


def _copy_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@torch.no_grad()
def evaluate(model: nn.Module, task: MQAR, lengths: Iterable[int], *, sequences: int, batch_size: int,
             device: torch.device, seed: int = 12345, depth_bins: int = 4) -> dict[str, Any]:
    """Held-out accuracy at each length (sequences from ``seed``, never a training seed), overall and per query depth
    (``depth_bins`` equal bins of the query's relative position). Returns ``{str(N): {"acc", "n", "by_depth"}}``."""
    was = model.training
    model.to(device).eval()
    out: dict[str, Any] = {}
    for n in lengths:
        g = torch.Generator(device).manual_seed(seed * 7919 + n)
        correct = total = 0
        bins_c, bins_t = [0] * depth_bins, [0] * depth_bins
        left = sequences
        while left > 0:
            b = min(batch_size, left)
            left -= b
            batch = task.batch(b, n, generator=g, device=device)
            with autocast(device):
                logits = model(batch["input_ids"])
            scored = batch["labels"] != IGNORE
            hit = logits[scored].argmax(-1) == batch["labels"][scored]
            correct += int(hit.sum())
            total += int(scored.sum())
            which = (batch["depth"][scored] * depth_bins).long().clamp(0, depth_bins - 1)
            for i in range(depth_bins):
                sel = which == i
                bins_c[i] += int(hit[sel].sum())
                bins_t[i] += int(sel.sum())
        out[str(n)] = {"acc": correct / max(total, 1), "n": total,
                       "by_depth": [c / max(t, 1) for c, t in zip(bins_c, bins_t)]}
    model.train(was)
    return out


def iter_chunks(values: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(values), size):
        yield values[i:i + size]


def describe(config: ModelConfig, vocab_size: int) -> dict[str, Any]:
    return {**asdict(config), "params": count_params(config.build(vocab_size)),
            "head_dim": config.d_model // config.num_heads}


def log2(n: int) -> int:
    return int(math.log2(n))
