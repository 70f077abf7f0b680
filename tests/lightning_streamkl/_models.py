"""Tiny models, data and LightningModules shared by the lightning_streamkl tests (CPU, no downloads)."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

VOCAB = 50


def tiny_llama(*, hidden: int = 32, heads: int = 4, kv_heads: int = 2, layers: int = 2, seed: int = 0,
               impl: str = "sdpa", dtype: torch.dtype = torch.float32, init: float = 0.02):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      num_hidden_layers=layers, intermediate_size=2 * hidden, vocab_size=VOCAB,
                      max_position_embeddings=64, attn_implementation=impl, pad_token_id=0,
                      initializer_range=init)
    return LlamaForCausalLM(cfg).to(dtype)


def tiny_bert(*, hidden: int = 32, heads: int = 4, layers: int = 2, seed: int = 0, impl: str = "sdpa",
              dtype: torch.dtype = torch.float32, init: float = 0.02):
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    cfg = BertConfig(hidden_size=hidden, num_attention_heads=heads, num_hidden_layers=layers,
                     intermediate_size=2 * hidden, vocab_size=VOCAB, max_position_embeddings=64,
                     attn_implementation=impl, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     initializer_range=init)
    return BertModel(cfg, add_pooling_layer=False).to(dtype)


def token_batch(batch: int = 2, length: int = 12, *, pad: str = "right", seed: int = 0) -> dict[str, torch.Tensor]:
    """Random token ids with one padded sequence (``pad`` = "right", "left" or "none")."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    if pad == "right":
        mask[-1, length - 4:] = 0
    elif pad == "left":
        mask[-1, :4] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask}


class TokenDataset(Dataset):
    """A fixed set of sequences with a learnable pattern (each token predicts the next: t -> (t * 7 + 3) % V)."""

    def __init__(self, n: int = 16, length: int = 12, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(1, VOCAB, (n, 1), generator=g)
        seq = [start]
        for _ in range(length - 1):
            seq.append((seq[-1] * 7 + 3) % (VOCAB - 1) + 1)
        self.ids = torch.cat(seq, 1)
        self.mask = torch.ones_like(self.ids)
        self.mask[1::2, length - 3:] = 0  # every other sequence has 3 padding tokens
        self.ids = self.ids.masked_fill(self.mask == 0, 0)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i].masked_fill(self.mask[i] == 0, -100)
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": labels}


class CausalLM(L.LightningModule):
    """A LightningModule around a Hugging Face causal LM; logs and returns the task loss."""

    def __init__(self, model: nn.Module | None = None, lr: float = 0.05, optimizer: str = "sgd") -> None:
        super().__init__()
        self.model = model if model is not None else tiny_llama(hidden=16, heads=4, kv_heads=1, seed=1)
        self.lr = lr
        self.optimizer = optimizer
        self.task_losses: list[float] = []
        self.step_losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.task_losses.append(float(loss.detach()))
        self.log("train/task_loss", loss)
        return loss

    def on_before_backward(self, loss):
        self.step_losses.append(float(loss.detach()))

    def validation_step(self, batch, batch_idx):
        self.log("val/task_loss", self.model(**batch).loss)

    def configure_optimizers(self):
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class RecordedAttention(nn.Module):
    """A bidirectional self-attention block of our own that reports its ``(q, k)`` through ``record()``
    (only when ``report``); ``qkv_std`` re-initialises the projection's weights with that std."""

    def __init__(self, dim: int = 16, heads: int = 4, report: bool = True, qkv_std: float | None = None) -> None:
        super().__init__()
        self.heads, self.report = heads, report
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        if qkv_std is not None:
            nn.init.normal_(self.qkv.weight, std=qkv_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from lightning_streamkl import record

        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.report:
            record(self, q, k, causal=False)
        y = nn.functional.scaled_dot_product_attention(q, k, v)
        return x + self.out(y.transpose(1, 2).reshape(b, n, d))


class Regressor(L.LightningModule):
    """A plain-PyTorch model on ``(x, y)`` tuple batches: ``nn.TransformerEncoder`` (``kind="mha"``, i.e.
    nn.MultiheadAttention) or two :class:`RecordedAttention` blocks (``kind="custom"``); records its task and step
    losses. ``seed`` seeds the initialisation (``None``: the current RNG state)."""

    def __init__(self, kind: str = "mha", report: bool = True, seed: int | None = None) -> None:
        super().__init__()
        if seed is not None:
            torch.manual_seed(seed)
        if kind == "mha":
            layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        else:
            self.encoder = nn.Sequential(RecordedAttention(report=report), RecordedAttention(report=report))
        self.head = nn.Linear(16, 1)
        self.task_losses, self.step_losses = [], []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.head(self.encoder(x)).squeeze(-1), y)
        self.task_losses.append(float(loss.detach()))
        return loss

    def on_before_backward(self, loss):
        self.step_losses.append(float(loss.detach()))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def loader(n: int = 8, batch_size: int = 4, length: int = 12, seed: int = 0) -> DataLoader:
    return DataLoader(TokenDataset(n, length, seed), batch_size=batch_size, shuffle=False)


class ShutDownProcessGroup(L.Callback):
    """Destroys the process group when a spawned process's run ends (``ddp_spawn`` on CPU).

    Lightning destroys only NCCL groups at exit; a gloo group is left to the interpreter's shutdown, and a spawned
    process exits through it, tearing down gloo's worker threads in C++ static destructors. That aborted a spawned
    process now and then after a successful run ("terminate called without an active exception", SIGABRT, seen once
    in CI), so the spawn failed a test that had passed. Shutting the group down here joins those threads while the
    interpreter is alive (after a barrier: no process leaves a collective behind).
    """

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def trainer(**kwargs) -> L.Trainer:
    """A quiet CPU ``Trainer``; a ``ddp_spawn`` one also gets :class:`ShutDownProcessGroup`."""
    defaults = dict(accelerator="cpu", devices=1, enable_progress_bar=False, logger=False, enable_checkpointing=False,
                    enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    defaults.update(kwargs)
    if defaults.get("strategy") == "ddp_spawn":
        defaults["callbacks"] = [*defaults.get("callbacks", []), ShutDownProcessGroup()]
    return L.Trainer(**defaults)
