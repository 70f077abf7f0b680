"""The continual-learning baselines of the Split-Digits benchmark, written here (no CL library installs offline
next to torch 2.13 without pulling a vision stack and dataset downloads along).

Each is a small object with no Lightning in it, used by the benchmark's LightningModule (``digits.py``):

- :class:`EWC`: elastic weight consolidation (Kirkpatrick et al. 2017), one quadratic penalty per finished task,
  weighted by the diagonal of that task's Fisher information (:func:`fisher_diagonal`, the expectation over the
  model's own predictive distribution, per example, not the squared batch gradient);
- :func:`distillation`: Learning without Forgetting's term (Li & Hoiem 2016): KL between the previous model's
  and the current model's softened outputs on the current inputs, times ``T²``;
- :class:`ReservoirBuffer`: experience replay's memory, filled by reservoir sampling (Vitter's algorithm R) so that
  every example seen so far is in it with the same probability, whatever the task it came from.

Joint training (the upper bound) needs no object: it trains on the union of the tasks seen so far.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jacrev, vmap

__all__ = ["EWC", "ReservoirBuffer", "distillation", "fisher_diagonal"]

def fisher_diagonal(model: nn.Module, inputs: torch.Tensor, classes: Sequence[int], *,
                    batch_size: int = 64) -> dict[str, torch.Tensor]:
    r"""The diagonal of the Fisher information of ``model``'s predictive distribution over ``classes`` at
    ``inputs``:

    .. math::

        F_i = \frac{1}{n} \sum_{x} \sum_{y \in \text{classes}} p_\theta(y \mid x)\,
              \Bigl(\frac{\partial \log p_\theta(y \mid x)}{\partial \theta_i}\Bigr)^2,

    with :math:`p_\theta(\cdot \mid x)` the softmax of the logits of ``classes`` only (the output units the task
    trains). Exact: per-example gradients of every class's log-probability (``torch.func``), weighted by its
    probability; no label sampling, and not the squared gradient of a batch mean. ``model`` runs in ``eval()``
    mode, one example at a time under ``vmap``.

    Args:
        model: maps ``[B, ...]`` inputs to ``[B, C]`` logits; its parameters with ``requires_grad`` are measured.
        inputs: ``[n, ...]`` inputs of the task.
        classes: the output units of the task.
        batch_size: examples per vectorised chunk.

    Returns:
        ``{name: F}`` for every trainable parameter, shaped like it.

    Example:
        Logistic regression with logits ``(0, w·x)``: :math:`F = \overline{\sigma(1-\sigma)\,x^2}`.

        >>> class Logit(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = nn.Parameter(torch.tensor(0.7))
        ...     def forward(self, x):
        ...         return torch.stack([torch.zeros_like(x), self.w * x], -1)
        >>> x = torch.tensor([1.0, -2.0, 0.5])
        >>> s = torch.sigmoid(0.7 * x)
        >>> torch.isclose(fisher_diagonal(Logit(), x, [0, 1])["w"], (s * (1 - s) * x**2).mean()).item()
        True
    """
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    buffers = dict(model.named_buffers())
    index = torch.as_tensor(list(classes), device=inputs.device)

    def log_probs(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, (p, buffers), (x.unsqueeze(0),), strict=False)[0, index]
        return F.log_softmax(logits, -1)

    fisher = {k: torch.zeros_like(v) for k, v in params.items()}
    was_training = model.training
    model.eval()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "There is a performance drop")  # vmap's fallback for fused kernels
            for start in range(0, len(inputs), batch_size):
                x = inputs[start:start + batch_size]
                with torch.no_grad():
                    probs = vmap(log_probs, in_dims=(None, 0))(params, x).exp()  # [b, C]
                jac = vmap(jacrev(log_probs), in_dims=(None, 0))(params, x)  # name -> [b, C, *shape]
                for k, g in jac.items():
                    w = probs.reshape(*probs.shape, *([1] * (g.dim() - 2)))
                    fisher[k] += (w * g.pow(2)).sum((0, 1))
    finally:
        model.train(was_training)
    return {k: v / len(inputs) for k, v in fisher.items()}


class EWC:
    r"""Elastic weight consolidation: after each task, keep the parameters :math:`\theta^*_t` and the diagonal
    Fisher :math:`F_t` of that task; while learning later tasks, add

    .. math::

        \frac{\lambda}{2} \sum_t \sum_i F_{t,i}\,(\theta_i - \theta^*_{t,i})^2.

    One penalty per finished task (Kirkpatrick et al. 2017), not the online running average.

    Args:
        weight: :math:`\lambda`.
        samples: examples of a task used for its Fisher (the first ``samples`` of the inputs given; ``None``: all).

    Example:
        >>> model = nn.Linear(3, 2)
        >>> ewc = EWC(weight=10.0)
        >>> float(ewc.penalty(model))  # no task finished yet
        0.0
        >>> ewc.consolidate(model, torch.randn(8, 3), classes=[0, 1])
        >>> ewc.penalty(model).item()  # at the consolidated parameters
        0.0
        >>> with torch.no_grad():
        ...     _ = model.bias.add_(1.0)
        >>> expected = 5.0 * ewc.tasks[0][1]["bias"].sum()
        >>> torch.isclose(ewc.penalty(model), expected).item()
        True
    """

    def __init__(self, weight: float, *, samples: int | None = None) -> None:
        self.weight = weight
        self.samples = samples
        #: one ``(anchor parameters, Fisher diagonal)`` per finished task
        self.tasks: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []

    def consolidate(self, model: nn.Module, inputs: torch.Tensor, classes: Sequence[int]) -> None:
        """Close a task: store the current parameters and the task's Fisher diagonal (on ``inputs``, over the
        task's output units ``classes``)."""
        if self.samples is not None:
            inputs = inputs[: self.samples]
        fisher = fisher_diagonal(model, inputs, classes)
        anchor = {k: v.detach().clone() for k, v in model.named_parameters() if k in fisher}
        self.tasks.append((anchor, fisher))

    def penalty(self, model: nn.Module) -> torch.Tensor:
        """The penalty at ``model``'s current parameters (differentiable; 0 before the first task ends)."""
        params = dict(model.named_parameters())
        device = next(iter(params.values())).device
        total = torch.zeros((), device=device)
        for anchor, fisher in self.tasks:
            for k, f in fisher.items():
                total = total + (f * (params[k] - anchor[k]).pow(2)).sum()
        return 0.5 * self.weight * total


def distillation(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 2.0,
                 ) -> torch.Tensor:
    r"""Learning without Forgetting's term, :math:`T^2 \cdot \mathrm{KL}(\mathrm{softmax}(z_{old}/T) \,\|\,
    \mathrm{softmax}(z/T))`, averaged over the batch (logits ``[B, C]`` of the same output units; the teacher's
    carry no gradient). The ``T²`` keeps the gradient's scale independent of ``T`` (Hinton et al. 2015).

    Example:
        >>> z = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
        >>> float(distillation(z, z))
        0.0
        >>> p, q = torch.softmax(z / 2, -1), torch.softmax(torch.zeros(2, 2), -1)
        >>> by_hand = 4 * (p * (p.log() - q.log())).sum(-1).mean()
        >>> torch.isclose(distillation(torch.zeros(2, 2), z), by_hand).item()
        True
    """
    t = temperature
    old = F.log_softmax(teacher_logits.detach() / t, -1)
    new = F.log_softmax(student_logits / t, -1)
    return t * t * F.kl_div(new, old, log_target=True, reduction="none").sum(-1).mean()


class ReservoirBuffer:
    """A replay memory of at most ``capacity`` examples, filled by reservoir sampling: after ``n`` examples were
    offered, each of them is in the buffer with probability ``capacity / n`` (algorithm R).

    Examples are rows of tensors given together (``add(x, y, task)``); :meth:`sample` draws a batch uniformly
    without replacement.

    Args:
        capacity: the most examples kept.
        seed: seeds the buffer's own generator (which slots are replaced, which examples are drawn).

    Example:
        >>> buffer = ReservoirBuffer(capacity=3, seed=0)
        >>> buffer.add(torch.arange(10.0).unsqueeze(1), torch.arange(10))
        >>> len(buffer), buffer.seen
        (3, 10)
        >>> x, y = buffer.sample(2)
        >>> x.shape, y.shape
        (torch.Size([2, 1]), torch.Size([2]))
    """

    def __init__(self, capacity: int, seed: int = 0) -> None:
        if capacity < 1:
            raise ValueError(f"Expected `capacity` to be >= 1, but got {capacity}.")
        self.capacity = capacity
        self.seen = 0
        self.generator = torch.Generator().manual_seed(seed)
        self.rows: list[tuple[torch.Tensor, ...]] = []

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, *columns: torch.Tensor) -> None:
        """Offer every row of ``columns`` (tensors with the same first dimension), in order."""
        for row in zip(*columns):
            if len(self.rows) < self.capacity:
                self.rows.append(tuple(row))
            else:
                slot = int(torch.randint(0, self.seen + 1, (), generator=self.generator))
                if slot < self.capacity:
                    self.rows[slot] = tuple(row)
            self.seen += 1

    def sample(self, n: int) -> tuple[torch.Tensor, ...]:
        """``min(n, len(self))`` rows drawn uniformly without replacement, stacked per column."""
        if not self.rows:
            raise ValueError("The replay buffer is empty.")
        pick = torch.randperm(len(self.rows), generator=self.generator)[:n].tolist()
        return tuple(torch.stack(column) for column in zip(*(self.rows[i] for i in pick)))
