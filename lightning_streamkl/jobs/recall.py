r"""
Long-range recall
^^^^^^^^^^^^^^^^^

(Part of the demo job, :mod:`lightning_streamkl.jobs`; the library never imports it.)

The synthetic task of the ``streamkl-distill`` job: a task where a model must look far back to succeed, and
where *where it looks* is easy to state.

Every sequence is random tokens whose last ``h`` tokens repeat the ``h`` tokens before them (``h`` drawn per
sequence between ``min_copy`` and ``seq_len // 2``). Inside the repeat, the next token is always the one that
followed the current token ``h`` positions back, so predicting it means *retrieving* it from up to half the
context away; everywhere else the next token is random and is not scored. A small transformer solves it with
two attention patterns, the classic induction circuit: a *previous-token* head in the first layer (each
position attends to the one before it) and an *induction* head in the second (each position of the repeat
attends to the position right after the earlier occurrence of its token). Both patterns are sharp, so a
teacher that solved the task tells a student exactly where to look; from the task loss alone a student first
sits on a long plateau, because until the first-layer pattern exists the second has no signal.

The model is plain PyTorch (pre-LayerNorm, rotary position embedding on part of each head, no MLP by default)
and hands its queries and keys to the distillation through :func:`lightning_streamkl.capture.record`, the way
any custom attention module can.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_streamkl import record

__all__ = ["CausalSelfAttention", "RecallData", "RecallModel", "TinyTransformer", "make_recall_batch"]

#: Label of positions that are not scored (``torch.nn.functional.cross_entropy``'s ``ignore_index``).
IGNORE = -100


# ---------------------------------------------------------------------------------------------- data
def make_recall_batch(batch_size: int, seq_len: int, vocab_size: int, *, min_copy: int = 4,
                      max_copy: int | None = None, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """One batch of the recall task.

    Args:
        batch_size: ``B``.
        seq_len: ``N``.
        vocab_size: tokens are drawn uniformly from ``[0, vocab_size)``.
        min_copy: the shortest repeated segment ``h`` (the shortest retrieval distance).
        max_copy: the longest one; default ``N // 2`` (the repeat then covers up to half the sequence).
        generator: the random generator (for reproducible batches).

    Returns:
        ``{"input_ids": [B, N] int64, "labels": [B, N] int64}``; ``labels[b, i]`` is the next token where it is
        predictable (inside the repeat) and :data:`IGNORE` elsewhere.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> batch = make_recall_batch(2, 12, 50, min_copy=3, generator=g)
        >>> x, y = batch["input_ids"][0], batch["labels"][0]
        >>> h = int((y != IGNORE).sum()) + 1         # the repeated segment's length
        >>> torch.equal(x[-h:], x[-2 * h:-h])         # the last h tokens repeat the h before them
        True
        >>> torch.equal(y[-h:-1], x[-h + 1:])         # scored: the next token inside the repeat
        True
    """
    max_copy = seq_len // 2 if max_copy is None else min(max_copy, seq_len // 2)
    if not 1 <= min_copy <= max_copy:
        raise ValueError(f"Expected 1 <= min_copy <= max_copy (<= seq_len // 2), but got min_copy={min_copy}, "
                         f"max_copy={max_copy}, seq_len={seq_len}.")
    x = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
    h = torch.randint(min_copy, max_copy + 1, (batch_size, 1), generator=generator)
    pos = torch.arange(seq_len)[None]
    repeat = pos >= seq_len - h
    x = torch.where(repeat, x.gather(1, (pos - h).clamp_min(0)), x)
    scored = repeat & (pos < seq_len - 1)
    labels = torch.where(scored, torch.roll(x, -1, dims=1), torch.full_like(x, IGNORE))
    return {"input_ids": x, "labels": labels}


class _RecallBatches(Dataset):
    """``num_batches`` whole batches; batch ``i`` is generated from its own seed, so every run sees the same."""

    def __init__(self, num_batches: int, batch_size: int, seq_lens: Sequence[int], vocab_size: int,
                 min_copy: int, max_copy: int | None, seed: int) -> None:
        self.num_batches, self.batch_size, self.seq_lens = num_batches, batch_size, list(seq_lens)
        self.vocab_size, self.min_copy, self.max_copy, self.seed = vocab_size, min_copy, max_copy, seed

    def __len__(self) -> int:
        return self.num_batches

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        n = self.seq_lens[i % len(self.seq_lens)]
        return make_recall_batch(self.batch_size, n, self.vocab_size, min_copy=self.min_copy,
                                 max_copy=self.max_copy, generator=g)


class RecallData(L.LightningDataModule):
    """Batches of the long-range recall task, generated on the fly (nothing to download).

    Args:
        seq_len: the training sequence length ``N``; a list cycles through several lengths batch by batch
            (e.g. a teacher trained on ``[1024, 4096, 16384]``).
        batch_size: sequences per batch.
        vocab_size: number of distinct tokens.
        min_copy: shortest repeated segment (retrieval distance).
        max_copy: longest one; default ``N // 2``.
        train_batches: batches in one training epoch (the job stops after ``max_steps`` anyway).
        seed: seed of the training batches; evaluation batches use other seeds.

    Example:
        >>> dm = RecallData(seq_len=32, batch_size=4)
        >>> batch = next(iter(dm.train_dataloader()))
        >>> tuple(batch["input_ids"].shape), dm.vocab_size, dm.max_seq_len
        ((4, 32), 64, 32)
    """

    def __init__(self, seq_len: int | list[int] = 128, batch_size: int = 16, vocab_size: int = 64,
                 min_copy: int = 4, max_copy: int | None = None, train_batches: int = 100_000, seed: int = 0) -> None:
        super().__init__()
        lens = [seq_len] if isinstance(seq_len, int) else list(seq_len)
        if not lens or any(isinstance(n, bool) or not isinstance(n, int) or n < 2 * min_copy for n in lens):
            raise ValueError(f"Expected `seq_len` to be an int (or a list of ints) >= 2 * min_copy = {2 * min_copy}, "
                             f"but got {seq_len!r}.")
        if vocab_size < 2 or batch_size < 1 or train_batches < 1:
            raise ValueError(f"Expected vocab_size >= 2, batch_size >= 1 and train_batches >= 1, but got {vocab_size}, "
                             f"{batch_size} and {train_batches}.")
        self.save_hyperparameters()
        self.seq_lens = lens
        self.batch_size = batch_size
        self.vocab_size = vocab_size

    @property
    def max_seq_len(self) -> int:
        """The longest training sequence length."""
        return max(self.seq_lens)

    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        data = _RecallBatches(hp.train_batches, hp.batch_size, self.seq_lens, hp.vocab_size, hp.min_copy,
                              hp.max_copy, hp.seed)
        return DataLoader(data, batch_size=None, shuffle=False)

    def eval_batches(self, seq_len: int, num_sequences: int, batch_size: int = 64,
                     seed: int = 1) -> Iterator[dict[str, torch.Tensor]]:
        """Held-out batches at one length (a seed the training batches never use; distances scale with ``seq_len``)."""
        g = torch.Generator().manual_seed(10_007 * (seed + 1) + seq_len)
        left = num_sequences
        while left > 0:
            b = min(batch_size, left)
            left -= b
            yield make_recall_batch(b, seq_len, self.hparams.vocab_size, min_copy=self.hparams.min_copy,
                                    generator=g)

    def with_overrides(self, **overrides: Any) -> RecallData:
        """A copy with some constructor arguments changed (e.g. the teacher's ``seq_len`` or ``batch_size``)."""
        hparams = {k: v for k, v in self.hparams.items() if not k.startswith("_")}  # LightningCLI adds _class_path
        return type(self)(**{**hparams, **overrides})


# ---------------------------------------------------------------------------------------------- model
def _rotate(x: torch.Tensor, dims: int, base: float) -> torch.Tensor:
    """Rotary position embedding on the first ``dims`` features of ``x`` ``[B, H, N, D]`` (``dims`` even)."""
    if dims == 0:
        return x
    n, half = x.shape[-2], dims // 2
    inv = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angle = torch.arange(n, device=x.device, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    a, b, rest = x[..., :half], x[..., half:dims], x[..., dims:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos, rest], dim=-1)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention that hands its ``(q, k)`` to :func:`~lightning_streamkl.capture.record`.

    Args:
        d_model: model width.
        num_heads: heads (``d_model`` divisible by it).
        rotary_fraction: share of each head's dims that get the rotary position embedding (the rest carry
            content only, which helps the learned retrieval hold at lengths beyond training).
        rope_base: rotary base.

    Example:
        >>> attn = CausalSelfAttention(d_model=16, num_heads=2)
        >>> tuple(attn(torch.randn(3, 5, 16)).shape), attn.rotary_dims
        ((3, 5, 16), 4)
    """

    def __init__(self, d_model: int, num_heads: int, rotary_fraction: float = 0.5, rope_base: float = 10_000.0):
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"Expected `d_model` ({d_model}) to be divisible by `num_heads` ({num_heads}).")
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.rotary_dims = 2 * int(self.head_dim * rotary_fraction / 2)
        self.rope_base = rope_base
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = _rotate(q, self.rotary_dims, self.rope_base), _rotate(k, self.rotary_dims, self.rope_base)
        record(self, q, k, causal=True)  # no-op unless a capture is recording
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


class _Block(nn.Module):
    def __init__(self, d_model: int, num_heads: int, mlp_ratio: int, rotary_fraction: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, num_heads, rotary_fraction)
        self.mlp = None
        if mlp_ratio:
            self.norm2 = nn.LayerNorm(d_model)
            self.mlp = nn.Sequential(nn.Linear(d_model, mlp_ratio * d_model), nn.GELU(),
                                     nn.Linear(mlp_ratio * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        if self.mlp is not None:
            x = x + self.mlp(self.norm2(x))
        return x


class TinyTransformer(nn.Module):
    """A small causal transformer language model; layer ``i``'s attention is ``blocks.<i>.attn``.

    Example:
        >>> model = TinyTransformer(vocab_size=10, d_model=16, num_layers=2, num_heads=2)
        >>> tuple(model(torch.randint(0, 10, (3, 7))).shape)
        (3, 7, 10)
    """

    def __init__(self, vocab_size: int, d_model: int = 64, num_layers: int = 2, num_heads: int = 4,
                 mlp_ratio: int = 0, rotary_fraction: float = 0.5) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, num_heads, mlp_ratio, rotary_fraction)
                                    for _ in range(num_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class RecallModel(L.LightningModule):
    """A :class:`TinyTransformer` trained on the recall task (next-token loss on the scored positions).

    Used for the teacher and the students of the ``streamkl-distill`` job. Logs ``train/loss`` and ``train/acc``
    (the accuracy on the step's batch, which is fresh data every step, so it is a held-out estimate).
    Layer paths for :class:`~lightning_streamkl.LayerPair`: ``model.blocks.<i>.attn``.

    Args:
        vocab_size: linked from the data module by the CLI.
        d_model, num_layers, num_heads, mlp_ratio, rotary_fraction: see :class:`TinyTransformer`.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.

    Example:
        >>> model = RecallModel(vocab_size=64, d_model=32, num_heads=2)
        >>> batch = make_recall_batch(2, 16, 64, generator=torch.Generator().manual_seed(0))
        >>> correct, total = model.count_correct(batch)
        >>> 0 <= correct <= total == int((batch["labels"] != IGNORE).sum())
        True
    """

    def __init__(self, vocab_size: int = 64, d_model: int = 64, num_layers: int = 2, num_heads: int = 4,
                 mlp_ratio: int = 0, rotary_fraction: float = 0.5, lr: float = 3e-3, weight_decay: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = TinyTransformer(vocab_size, d_model, num_layers, num_heads, mlp_ratio, rotary_fraction)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self(batch["input_ids"])
        labels = batch["labels"]
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE)
        scored = labels != IGNORE
        acc = (logits.argmax(-1)[scored] == labels[scored]).float().mean()
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", acc, prog_bar=True)
        return loss

    @torch.no_grad()
    def count_correct(self, batch: dict[str, torch.Tensor]) -> tuple[int, int]:
        """``(correct, scored)`` next-token predictions on a batch (the job's evaluation protocol)."""
        labels = batch["labels"].to(self.device)
        pred = self(batch["input_ids"].to(self.device)).argmax(-1)
        scored = labels != IGNORE
        return int((pred[scored] == labels[scored]).sum()), int(scored.sum())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


def chance_accuracy(vocab_size: int) -> float:
    """Accuracy of guessing uniformly: ``1 / vocab_size``.

    Example:
        >>> chance_accuracy(64)
        0.015625
    """
    return 1.0 / vocab_size

