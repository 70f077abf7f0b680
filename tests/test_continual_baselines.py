"""The continual-learning baselines of the Split-Digits benchmark (benchmarks/continual/baselines.py), checked with the
care the method gets: EWC's Fisher against its closed form and a per-example loop, its penalty and gradient, the
reservoir's inclusion probabilities, LwF's term against its definition; and the benchmark's data and learner."""

from __future__ import annotations

import doctest
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ._helpers import load_script

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "benchmarks" / "continual"


@pytest.fixture(scope="module")
def baselines():
    return load_script(HERE / "baselines.py", "baselines")


@pytest.fixture(scope="module")
def digits(baselines):
    return load_script(HERE / "digits.py", "digits")


# ------------------------------------------------------------------------------------------------------------- EWC
def test_fisher_of_logistic_regression_is_its_closed_form(baselines):
    """Logits (0, w·x + b): F_w = mean σ(1−σ)x², F_b = mean σ(1−σ)."""

    class Logistic(nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.b = nn.Parameter(torch.tensor(-0.4)), nn.Parameter(torch.tensor(0.3))

        def forward(self, x):
            z = self.w * x + self.b
            return torch.stack([torch.zeros_like(z), z], -1)

    x = torch.linspace(-3, 3, 50, dtype=torch.float64)
    model = Logistic().double()
    fisher = baselines.fisher_diagonal(model, x, [0, 1], batch_size=16)
    s = torch.sigmoid(model.w.detach() * x + model.b.detach())
    assert fisher["w"].item() == pytest.approx((s * (1 - s) * x**2).mean().item(), rel=1e-12)
    assert fisher["b"].item() == pytest.approx((s * (1 - s)).mean().item(), rel=1e-12)


def test_fisher_matches_a_per_example_loop_over_every_class(baselines):
    """A 3-class MLP: the vectorised Fisher equals Σ_y p(y|x) (∂ log p(y|x))², averaged over examples by hand; the
    units outside ``classes`` are not part of the distribution."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 4)).double()
    x = torch.randn(7, 4, dtype=torch.float64)
    classes = [0, 2, 3]
    expected = {k: torch.zeros_like(v) for k, v in model.named_parameters()}
    for xi in x:
        logp = F.log_softmax(model(xi.unsqueeze(0))[0, classes], -1)
        for y in range(len(classes)):
            grads = torch.autograd.grad(logp[y], list(model.parameters()), retain_graph=True)
            for (k, _), g in zip(model.named_parameters(), grads):
                expected[k] += logp[y].exp().detach() * g.pow(2) / len(x)
    fisher = baselines.fisher_diagonal(model, x, classes, batch_size=3)
    for k, v in expected.items():
        torch.testing.assert_close(fisher[k], v, rtol=1e-10, atol=1e-14)
    assert model.training  # the mode is restored


def test_ewc_penalty_value_gradient_and_one_term_per_task(baselines):
    torch.manual_seed(1)
    model = nn.Linear(3, 2)
    ewc = baselines.EWC(weight=4.0)
    ewc.consolidate(model, torch.randn(20, 3), [0, 1])
    first = {k: v.detach().clone() for k, v in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    ewc.consolidate(model, torch.randn(20, 3), [0, 1])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(-0.2)
    penalty = ewc.penalty(model)
    anchor = ewc.tasks[0][0]
    assert all(torch.equal(anchor[k], first[k]) for k in first)
    params = dict(model.named_parameters())
    by_hand = sum(2.0 * (f[k] * (params[k] - a[k]) ** 2).sum() for a, f in ewc.tasks for k in f)
    assert penalty.item() == pytest.approx(by_hand.item(), rel=1e-6)
    penalty.backward()
    for k, p in params.items():  # ∂/∂θ (λ/2) Σ_t F_t (θ − θ*_t)² = λ Σ_t F_t (θ − θ*_t)
        grad = 4.0 * sum(f[k] * (p.detach() - a[k]) for a, f in ewc.tasks)
        torch.testing.assert_close(p.grad, grad, rtol=1e-5, atol=1e-7)
    assert ewc.samples is None and baselines.EWC(1.0, samples=5).samples == 5


def test_ewc_uses_the_first_samples_only(baselines):
    model = nn.Linear(3, 2)
    x = torch.randn(10, 3)
    a, b = baselines.EWC(1.0, samples=4), baselines.EWC(1.0)
    a.consolidate(model, x, [0, 1])
    b.consolidate(model, x[:4], [0, 1])
    assert all(torch.equal(a.tasks[0][1][k], b.tasks[0][1][k]) for k in a.tasks[0][1])


# ------------------------------------------------------------------------------------------------------------- LwF
def test_lwf_term_is_t_squared_kl_of_softened_outputs_and_trains_only_the_student(baselines):
    torch.manual_seed(2)
    student = torch.randn(6, 3, requires_grad=True)
    teacher = torch.randn(6, 3, requires_grad=True)
    for t in (1.0, 2.0, 4.0):
        term = baselines.distillation(student, teacher, t)
        p, q = F.softmax(teacher / t, -1), F.softmax(student / t, -1)
        by_hand = t * t * (p * (p.log() - q.log())).sum(-1).mean()
        assert term.item() == pytest.approx(by_hand.item(), rel=1e-6)
    baselines.distillation(student, teacher, 2.0).backward()
    assert teacher.grad is None and student.grad.abs().sum() > 0
    assert baselines.distillation(teacher, teacher, 2.0).item() == pytest.approx(0.0, abs=1e-7)
    # shifting all logits of a row changes nothing (a softmax)
    assert baselines.distillation(student + 5.0, teacher, 2.0).item() == pytest.approx(
        baselines.distillation(student, teacher, 2.0).item(), rel=1e-5)


# ------------------------------------------------------------------------------------------------------- replay
def test_reservoir_keeps_the_first_items_then_each_seen_item_with_probability_capacity_over_n(baselines):
    buffer = baselines.ReservoirBuffer(5, seed=0)
    buffer.add(torch.arange(5), torch.arange(5))
    assert [int(r[0]) for r in buffer.rows] == [0, 1, 2, 3, 4] and buffer.seen == 5
    n, capacity, trials = 40, 8, 3000
    counts = torch.zeros(n)
    for trial in range(trials):
        buffer = baselines.ReservoirBuffer(capacity, seed=trial)
        for i in range(0, n, 10):  # offered in several calls, as tasks end
            buffer.add(torch.arange(i, i + 10))
        assert len(buffer) == capacity and buffer.seen == n
        kept = torch.stack([r[0] for r in buffer.rows])
        assert len(set(kept.tolist())) == capacity  # no item twice
        counts[kept] += 1
    share = counts / trials
    # each item: probability 8/40 = 0.2; 3000 trials give a standard error of 0.0073, so a 5-sigma band
    assert (share - capacity / n).abs().max() < 5 * math.sqrt(0.2 * 0.8 / trials)
    # the early and the late items alike (no recency bias)
    assert abs(share[:10].mean() - share[-10:].mean()) < 0.02


def test_reservoir_sampling_draws_without_replacement_and_keeps_columns_together(baselines):
    buffer = baselines.ReservoirBuffer(6, seed=3)
    x = torch.arange(30.0).reshape(10, 3)
    buffer.add(x, torch.arange(10), torch.full((10,), 7))
    xs, ys, ts = buffer.sample(4)
    assert xs.shape == (4, 3) and len(set(ys.tolist())) == 4 and set(ts.tolist()) == {7}
    assert torch.equal(xs, x[ys])  # each row's columns travel together
    assert len(buffer.sample(100)[0]) == 6
    with pytest.raises(ValueError, match="empty"):
        baselines.ReservoirBuffer(2).sample(1)
    with pytest.raises(ValueError, match="capacity"):
        baselines.ReservoirBuffer(0)


# ------------------------------------------------------------------------------------------------- the benchmark
def test_split_digits_data_orders_and_masks(digits):
    tasks = digits.split_tasks([5, 6, 1, 2, 0, 8, 9, 3, 7, 4], seed=3)
    assert [t.classes for t in tasks] == [(5, 6), (1, 2), (0, 8), (9, 3), (7, 4)]
    for i, task in enumerate(tasks):
        for x, y, t in (task.train, task.test):
            assert set(y.tolist()) == set(task.classes) and set(t.tolist()) == {i} and x.shape[1] == 64
    # validation: scored on part of the training examples; the test examples are never used
    val = digits.split_tasks([5, 6, 1, 2, 0, 8, 9, 3, 7, 4], seed=3, validation=True)
    for task, held in zip(tasks, val):
        rows = sorted(map(tuple, torch.cat([held.train[0], held.test[0]]).tolist()))
        assert rows == sorted(map(tuple, task.train[0].tolist()))
        assert len(held.test[1]) == pytest.approx(0.3 * len(task.train[1]), abs=2)
    with pytest.raises(ValueError, match="order of the ten classes"):
        digits.split_tasks([0, 1, 2], seed=0)
    t = torch.tensor([0, 4])
    til = digits.allowed("task-incremental", tasks, t, current=4)
    assert [row.nonzero().squeeze(1).tolist() for row in til] == [[5, 6], [4, 7]]
    cil = digits.allowed("class-incremental", tasks, t, current=1)
    assert [row.nonzero().squeeze(1).tolist() for row in cil] == [[1, 2, 5, 6]] * 2


def test_a_class_is_split_the_same_way_in_every_order_and_seeds_differ(digits):
    def test_rows(tasks, c):
        task = next(t for t in tasks if c in t.classes)
        x, y, _ = task.test
        return sorted(map(tuple, x[y == c].tolist()))

    orders = ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [5, 6, 1, 2, 0, 8, 9, 3, 7, 4], [8, 7, 1, 5, 6, 9, 0, 4, 2, 3])
    splits = [digits.split_tasks(order, seed=1) for order in orders]
    for c in range(10):  # a shared generator drawn in task order would split a class differently per order
        assert test_rows(splits[0], c) == test_rows(splits[1], c) == test_rows(splits[2], c), c
    other = digits.split_tasks(orders[0], seed=2)
    assert any(test_rows(splits[0], c) != test_rows(other, c) for c in range(10))


def test_the_class_orders_are_the_seeded_permutations_the_config_says():
    import yaml

    cfg = yaml.safe_load((HERE / "split_digits.yaml").read_text())
    assert cfg["orders"][0] == list(range(10))
    for seed in (1, 2):
        assert cfg["orders"][seed] == torch.randperm(10, generator=torch.Generator().manual_seed(seed)).tolist()


def test_the_learner_closes_a_task_for_each_baseline(digits):
    tasks = digits.split_tasks(range(10), seed=0)
    learner = digits.SplitLearner(digits.TinyViT(), tasks, "task-incremental", lr=1e-3, ewc_weight=10.0,
                                  lwf_weight=1.0, replay=30)
    batch = tasks[0].train
    assert learner.training_step(batch, 0).item() > 0  # the first task: cross-entropy only
    learner.end_task()
    assert learner.task == 1 and len(learner.ewc.tasks) == 1 and len(learner.buffer) == 30
    teacher = learner._teacher[0]
    assert teacher is not learner.net and not any(p.requires_grad for p in teacher.parameters())
    # at the end of a task the model equals its teacher and anchor: LwF and EWC add nothing yet
    x = tasks[1].train[0][:8]
    assert learner._lwf(x, learner.net(x)).item() == pytest.approx(0.0, abs=1e-6)
    assert learner.ewc.penalty(learner.net).item() == 0.0
    # task-incremental LwF distils each previous task's two units; class-incremental all previous units
    logits = torch.randn(8, 10)
    old = teacher(x)
    expected = digits.distillation(logits[:, [0, 1]], old[:, [0, 1]], 2.0)
    assert learner._lwf(x, logits).item() == pytest.approx(expected.item(), rel=1e-6)
    # accuracies: task-incremental picks between the task's two classes, so chance is 50 %
    assert 0.0 <= learner.accuracy(0) <= 1.0


def test_the_benchmark_modules_docstring_examples_run(digits):
    for name in ("baselines", "digits", "text_tasks", "split_digits", "minilm_sequence"):
        module = load_script(HERE / f"{name}.py", name)
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, name
