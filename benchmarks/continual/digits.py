"""Split-Digits: the offline analogue of Split-MNIST, and the small vision transformer that learns it.

The data are scikit-learn's bundled 8×8 handwritten digits (``sklearn.datasets.load_digits``: 1797 images, ten
classes, pixel values 0..16; nothing is downloaded). A *task order* is a sequence of the ten classes; consecutive
pairs form the five tasks of two classes each (order ``0..9`` gives the classic {0,1}, {2,3}, ..., {8,9}).

Two settings (van de Ven & Tolias 2019):

- ``task-incremental``: the task is known at test time; the network scores only the two classes of the task
  (a ten-way head whose logits are restricted to the task's classes, i.e. one two-way head per task);
- ``class-incremental``: the task is not known; the network chooses among every class seen so far (all ten at the
  end). Training scores the classes seen so far as well.

:class:`TinyViT` cuts the image into 2×2 patches (16 tokens of 4 pixels), adds a CLS token and learned positions,
runs a pre-norm ``nn.TransformerEncoder`` and reads the CLS state with a linear head. :class:`SplitLearner` is the
LightningModule of every method: plain fine-tuning, plus EWC, LwF or replay (``baselines.py``) when configured; the
attention regulariser is the library's callback, added by the runner.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import lightning as L
import torch
import torch.nn.functional as F
from baselines import EWC, ReservoirBuffer, distillation
from torch import nn

SETTINGS = ("task-incremental", "class-incremental")
CLASSES = 10


@dataclass
class Task:
    """One task: its classes, and its train and test examples (``x [n, 64]`` floats in [0, 1], labels ``y [n]``,
    the task index ``t [n]``)."""

    classes: tuple[int, ...]
    train: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    test: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """``(x [1797, 64] in [0, 1], y [1797])`` from scikit-learn's bundled copy.

    Example:
        >>> x, y = load_digits()
        >>> tuple(x.shape), int(y.max()), float(x.max())
        ((1797, 64), 9, 1.0)
    """
    from sklearn.datasets import load_digits as sk_load

    data = sk_load()
    return torch.tensor(data.data, dtype=torch.float32) / 16.0, torch.tensor(data.target, dtype=torch.long)


def split_tasks(order: Sequence[int], seed: int, *, test_fraction: float = 0.3, validation: bool = False,
                ) -> list[Task]:
    """The five tasks of ``order`` (consecutive pairs of classes), each class split into train and test at random
    (seeded by ``seed`` and the class, stratified: ``test_fraction`` of every class is test; a class is split the
    same way whatever the order).

    ``validation=True`` (hyper-parameter selection) never touches the test examples: the training examples are split
    again, by the same fraction, into the training and the scored ("test") part.

    Example:
        >>> tasks = split_tasks(range(10), seed=0)
        >>> [t.classes for t in tasks][:2], len(tasks)
        ([(0, 1), (2, 3)], 5)
        >>> n_train, n_test = len(tasks[0].train[1]), len(tasks[0].test[1])
        >>> n_train + n_test == int((load_digits()[1] < 2).sum()), set(tasks[4].test[2].tolist())
        (True, {4})
    """
    order = list(order)
    if sorted(order) != list(range(CLASSES)):
        raise ValueError(f"Expected an order of the ten classes, but got {order}.")
    x, y = load_digits()
    tasks = []
    for t in range(CLASSES // 2):
        pair = tuple(order[2 * t: 2 * t + 2])
        train, test = [], []
        for c in pair:  # each class split by its own generator: the same split in every order and in validation
            idx = (y == c).nonzero().squeeze(1)
            idx = idx[torch.randperm(len(idx), generator=torch.Generator().manual_seed(1000 * seed + c))]
            cut = round(test_fraction * len(idx))
            test.append(idx[:cut])
            train.append(idx[cut:])
            if validation:  # score on part of the training examples, train on the rest
                inner = round(test_fraction * len(train[-1]))
                test[-1], train[-1] = train[-1][:inner], train[-1][inner:]
        tr, te = torch.cat(train), torch.cat(test)
        tr = tr[torch.randperm(len(tr), generator=torch.Generator().manual_seed(1000 * seed + 100 + t))]
        tasks.append(Task(pair, (x[tr], y[tr], torch.full((len(tr),), t)), (x[te], y[te], torch.full((len(te),), t))))
    return tasks


class TinyViT(nn.Module):
    """A vision transformer for 8×8 images: 2×2 patches (16 tokens), a CLS token, learned positions, a pre-norm
    ``nn.TransformerEncoder``, a final LayerNorm and a linear head on CLS.

    ``forward(x [B, 64]) -> logits [B, classes]``.

    Example:
        >>> net = TinyViT()
        >>> net(torch.rand(3, 64)).shape, sum(p.numel() for p in net.parameters())
        (torch.Size([3, 10]), 18218)
    """

    def __init__(self, classes: int = CLASSES, *, image: int = 8, patch: int = 2, d_model: int = 32, heads: int = 4,
                 layers: int = 2, ff: int = 64) -> None:
        super().__init__()
        self.image, self.patch = image, patch
        tokens = (image // patch) ** 2
        self.embed = nn.Linear(patch * patch, d_model)
        self.cls = nn.Parameter(torch.zeros(1, 1, d_model))
        self.pos = nn.Parameter(0.02 * torch.randn(1 + tokens, d_model))
        layer = nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, classes)

    def patches(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, 64]`` images -> ``[B, 16, 4]`` patches, row by row."""
        p, side = self.patch, self.image // self.patch
        img = x.reshape(-1, side, p, side, p)
        return img.permute(0, 1, 3, 2, 4).reshape(-1, side * side, p * p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(self.patches(x))
        h = torch.cat([self.cls.expand(len(h), -1, -1), h], 1) + self.pos
        return self.head(self.norm(self.encoder(h))[:, 0])


def allowed(setting: str, tasks: Sequence[Task], example_task: torch.Tensor, current: int) -> torch.Tensor:
    """``[B, 10]`` bool: the output units an example is scored on. Task-incremental: its own task's two classes;
    class-incremental: every class of the tasks ``0..current``.

    Example:
        >>> tasks = split_tasks(range(10), seed=0)
        >>> allowed("task-incremental", tasks, torch.tensor([1]), current=3).nonzero()[:, 1].tolist()
        [2, 3]
        >>> allowed("class-incremental", tasks, torch.tensor([1]), current=2).nonzero()[:, 1].tolist()
        [0, 1, 2, 3, 4, 5]
    """
    table = torch.zeros(len(tasks), CLASSES, dtype=torch.bool)
    for i, task in enumerate(tasks):
        table[i, list(task.classes)] = True
    if setting == "task-incremental":
        return table[example_task.cpu()].to(example_task.device)
    if setting == "class-incremental":
        row = table[: current + 1].any(0)
        return row.expand(len(example_task), -1).to(example_task.device)
    raise ValueError(f"Expected a setting in {SETTINGS}, but got {setting!r}.")


def masked(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``logits`` with the units outside ``mask`` at ``-inf`` (softmax and argmax ignore them)."""
    return logits.masked_fill(~mask, float("-inf"))


class SplitLearner(L.LightningModule):
    """Learns the tasks of Split-Digits one ``fit`` per task; call :meth:`end_task` after each.

    The loss of a step is the cross-entropy over the allowed output units (:func:`allowed`), plus

    - ``ewc_weight > 0``: the EWC penalty of the finished tasks;
    - ``lwf_weight > 0``: LwF's distillation toward the model at the end of the previous task, on the current
      batch, per previous task's classes (task-incremental, averaged over those tasks) or over all the previous
      classes (class-incremental);
    - ``replay > 0``: a replay batch of ``replay_batch`` examples from a reservoir buffer of ``replay`` examples,
      fed through the network together with the current batch (one forward pass, so the attention regulariser sees
      both), each example scored on its own allowed units.

    Args:
        net: the :class:`TinyViT`.
        tasks: the task sequence (for the classes of each task).
        setting: ``"task-incremental"`` or ``"class-incremental"``.
        lr: Adam's learning rate (a fresh optimizer per task).
        ewc_weight, lwf_weight, lwf_temperature, replay, replay_batch, seed: as above (``seed`` seeds the buffer).

    Example:
        >>> tasks = split_tasks(range(10), seed=0)
        >>> learner = SplitLearner(TinyViT(), tasks, "class-incremental", lr=1e-3, replay=20)
        >>> learner.end_task()
        >>> learner.task, len(learner.buffer), round(learner.accuracy(0), 1) <= 1.0
        (1, 20, True)
    """

    def __init__(self, net: TinyViT, tasks: Sequence[Task], setting: str, *, lr: float, ewc_weight: float = 0.0,
                 lwf_weight: float = 0.0, lwf_temperature: float = 2.0, replay: int = 0, replay_batch: int = 32,
                 seed: int = 0) -> None:
        super().__init__()
        if setting not in SETTINGS:
            raise ValueError(f"Expected a setting in {SETTINGS}, but got {setting!r}.")
        self.net = net
        self.tasks = list(tasks)
        self.setting = setting
        self.lr = lr
        self.task = 0
        self.ewc = EWC(ewc_weight) if ewc_weight > 0 else None
        self.lwf_weight, self.lwf_temperature = lwf_weight, lwf_temperature
        self._teacher: list[nn.Module] = []  # a list: the frozen copy is no submodule (not optimised, not saved)
        self.buffer = ReservoirBuffer(replay, seed=seed) if replay > 0 else None
        self.replay_batch = replay_batch

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        x, y, t = batch
        n = len(x)
        if self.buffer is not None and len(self.buffer):
            xr, yr, tr = (c.to(self.device) for c in self.buffer.sample(self.replay_batch))
            x, y, t = torch.cat([x, xr]), torch.cat([y, yr]), torch.cat([t, tr])
        logits = self.net(x)
        mask = allowed(self.setting, self.tasks, t, self.task)
        losses = F.cross_entropy(masked(logits, mask), y, reduction="none")
        loss = losses[:n].mean() + (losses[n:].mean() if len(x) > n else 0.0)
        if self.ewc is not None and self.ewc.tasks:
            loss = loss + self.ewc.penalty(self.net)
        if self.lwf_weight > 0 and self._teacher:
            loss = loss + self.lwf_weight * self._lwf(x[:n], logits[:n])
        return loss

    def _lwf(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            old = self._teacher[0](x)
        if self.setting == "class-incremental":
            units = [c for task in self.tasks[: self.task] for c in task.classes]
            return distillation(logits[:, units], old[:, units], self.lwf_temperature)
        terms = [distillation(logits[:, list(task.classes)], old[:, list(task.classes)], self.lwf_temperature)
                 for task in self.tasks[: self.task]]
        return sum(terms) / len(terms)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    def end_task(self) -> None:
        """Close the current task: the EWC penalty, the LwF teacher and the replay buffer take it in."""
        x, y, t = self.tasks[self.task].train
        if self.ewc is not None:
            classes = self.tasks[self.task].classes if self.setting == "task-incremental" else \
                [c for task in self.tasks[: self.task + 1] for c in task.classes]
            self.ewc.consolidate(self.net, x.to(self.device), classes)
        if self.lwf_weight > 0:
            self._teacher[:] = [copy.deepcopy(self.net).eval().requires_grad_(False)]
        if self.buffer is not None:
            self.buffer.add(x, y, t)
        self.task += 1

    @torch.no_grad()
    def accuracy(self, task: int, *, seen: int | None = None) -> float:
        """Test accuracy on task ``task``: among its own classes (task-incremental) or among every class of the
        tasks ``0..seen-1`` (class-incremental; default: the tasks finished so far)."""
        x, y, t = self.tasks[task].test
        seen = self.task if seen is None else seen
        was_training = self.net.training
        self.net.eval()
        logits = self.net(x.to(self.device))
        pred = masked(logits, allowed(self.setting, self.tasks, t.to(self.device), max(seen - 1, task))).argmax(-1)
        self.net.train(was_training)
        return float((pred.cpu() == y).float().mean())
