"""The benchmark's model: a small transformer encoder with one classification head per task, as a LightningModule.

Two output layouts: one head per task (task-incremental: the task is known at test time and picks the head), or
one head shared by all tasks (domain-incremental: the tokens of the input are all that tells the tasks apart).

The LightningModule also carries the classic baseline, output distillation (LwF, Li & Hoiem 2016): on each batch
of the current task, the previous-task model's soft predictions are the targets of the current model's predictions
(KL at temperature ``T``, scaled by ``T²``): for every earlier task's head with one head per task (averaged over
them), for the shared head otherwise. The attention regulariser is not in here: it is the
``ContinualAttentionRegularizer`` callback.
"""

from __future__ import annotations

import copy

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn


class TinyTransformer(nn.Module):
    """Token + learned position embeddings, a pre-norm ``nn.TransformerEncoder``, one linear head per task on CLS.

    ``forward(ids [B, N]) -> logits [B, num_tasks, classes]`` (every head, so old heads can be distilled).
    """

    def __init__(self, vocab: int, num_tasks: int, classes: int, *, d_model: int = 32, heads: int = 4,
                 layers: int = 2, ff: int = 64, max_len: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(0.02 * torch.randn(max_len, d_model))
        layer = nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.heads = nn.ModuleList(nn.Linear(d_model, classes) for _ in range(num_tasks))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.pos[: ids.shape[1]]
        cls = self.norm(self.encoder(h))[:, 0]
        return torch.stack([head(cls) for head in self.heads], 1)


class ContinualClassifier(L.LightningModule):
    """Trains ``net``'s head for the current task on ``(ids, labels)`` batches; optional LwF term.

    Args:
        net: the :class:`TinyTransformer` (with one head per task, or a single shared head).
        lr: Adam learning rate (a fresh optimizer per task: one ``fit`` per task).
        lwf_weight: the weight of the output-distillation term (0: off).
        lwf_temperature: its temperature ``T``.
    """

    def __init__(self, net: TinyTransformer, *, lr: float, lwf_weight: float = 0.0, lwf_temperature: float = 2.0):
        super().__init__()
        self.net = net
        self.lr = lr
        self.lwf_weight = lwf_weight
        self.lwf_temperature = lwf_temperature
        self.task = 0
        self._lwf_teacher: list[nn.Module] = []  # a list, so the frozen copy is no submodule (not optimised)

    def end_task(self) -> None:
        """Move on to the next task; keep a frozen copy for LwF when it is on."""
        if self.lwf_weight > 0:
            teacher = copy.deepcopy(self.net).eval().requires_grad_(False)
            self._lwf_teacher[:] = [teacher]
        self.task += 1

    @property
    def shared_head(self) -> bool:
        return len(self.net.heads) == 1

    def head(self, task: int) -> int:
        return 0 if self.shared_head else task

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        logits = self.net(ids)
        loss = F.cross_entropy(logits[:, self.head(self.task)], labels)
        self.log("train/task_loss", loss, on_step=True, on_epoch=False)
        if self.lwf_weight > 0 and self.task > 0:
            teacher = self._lwf_teacher[0].to(ids.device)
            old_heads = slice(0, 1) if self.shared_head else slice(0, self.task)
            with torch.no_grad():
                old = teacher(ids)[:, old_heads]
            t = self.lwf_temperature
            kl = F.kl_div(F.log_softmax(logits[:, old_heads] / t, -1), F.log_softmax(old / t, -1),
                          log_target=True, reduction="none").sum(-1).mean()
            self.log("train/lwf_kl", kl, on_step=True, on_epoch=False)
            loss = loss + self.lwf_weight * t * t * kl
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    @torch.no_grad()
    def accuracy(self, ids: torch.Tensor, labels: torch.Tensor, task: int, batch_size: int = 1024) -> float:
        """Accuracy on a test set of task ``task`` (through its head, or the shared one)."""
        was_training = self.net.training
        self.net.eval()
        correct = 0
        for i in range(0, len(ids), batch_size):
            logits = self.net(ids[i:i + batch_size].to(self.device))[:, self.head(task)]
            correct += int((logits.argmax(-1).cpu() == labels[i:i + batch_size]).sum())
        self.net.train(was_training)
        return correct / len(ids)
