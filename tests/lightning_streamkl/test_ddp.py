"""The callback under 2-process DDP on CPU (gloo, ddp_spawn) against one process on the same global batch.

What DDP optimises: each process returns its own loss (task mean + weighted KL mean over its rows) and DDP averages
the gradients, so the run follows the mean of the per-process losses. That equals the loss of one process on the
global batch when every process counts the same number of tokens and query rows; with padding that makes the counts
unequal it does not, and the tests pin down both cases. The epoch metric is row-weighted over all processes, so it
equals the single-process value in both.
"""

from __future__ import annotations

import copy
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

pytest.importorskip("transformers")

from lightning_streamkl import AttentionKLDivergence, StreamKLDistillation

from ._models import VOCAB, CausalLM, ShutDownProcessGroup, loader, tiny_llama, trainer
from .test_callback import LAST, make_student, make_teacher, manual_kl

PAIRS = [LAST, {"teacher": 0, "student": 0, "name": "first", "weight": 0.5}]
WORLD, ROWS_PER_PROCESS, STEPS = 2, 2, 3


def process_rows(n: int = WORLD * ROWS_PER_PROCESS * STEPS) -> list[list[int]]:
    """The dataset rows each DDP process trains on, in order: Lightning gives every process a shuffled
    DistributedSampler (seed 0, epoch 0), which this rebuilds for each rank."""
    return [list(DistributedSampler(range(n), num_replicas=WORLD, rank=r, shuffle=True, seed=0)) for r in range(WORLD)]


def step_rows(step: int, rank: int) -> list[int]:
    return process_rows()[rank][step * ROWS_PER_PROCESS:(step + 1) * ROWS_PER_PROCESS]


class GlobalBatches(Dataset):
    """12 random sequences of 12 tokens, some ending with 3 padding tokens, placed by where the DDP run reads them.

    In steps 0 and 1 each process gets one padded row (equal token and query-row counts); in step 2 process 1 gets
    two and process 0 none (unequal counts). :func:`single_process_order` lists the rows so that one process with
    batches of 4 sees, at every step, exactly the 4 rows the two processes see together.
    """

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        rows = process_rows()
        self.padded = [rows[0][1], rows[1][1], rows[0][2], rows[1][3], rows[1][4], rows[1][5]]
        self.ids = torch.randint(1, VOCAB, (len(rows[0]) * WORLD, 12), generator=g)
        self.mask = torch.ones_like(self.ids)
        self.mask[self.padded, -3:] = 0
        self.ids = self.ids.masked_fill(self.mask == 0, 0)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i].masked_fill(self.mask[i] == 0, -100)
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": labels}


def single_process_order() -> list[int]:
    return [i for step in range(STEPS) for rank in range(WORLD) for i in step_rows(step, rank)]


class DtypeLossLM(CausalLM):
    """The task loss computed in the model's dtype (transformers' loss upcasts logits to float32 only)."""

    def training_step(self, batch, batch_idx):
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                                                 ignore_index=-100)


class Probe(L.Callback):
    """Saves, per process, every step's backpropagated loss, gradients (after DDP's all-reduce), parameters after the
    step and the local metric state, plus the logged epoch values, to ``<out>/<tag>-rank<r>.pt``."""

    def __init__(self, out: Path, tag: str) -> None:
        self.out, self.tag = Path(out), tag
        self.record: dict[str, list] = {"loss": [], "grads": [], "params": [], "metric": [], "rows": []}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.record["rows"].append(sorted(batch["input_ids"].tolist()))

    def on_before_backward(self, trainer, pl_module, loss):
        self.record["loss"].append(loss.detach().cpu().double())

    def on_after_backward(self, trainer, pl_module):
        self.record["grads"].append({n: p.grad.detach().cpu().clone() for n, p in pl_module.named_parameters()
                                     if p.grad is not None})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.record["params"].append({n: p.detach().cpu().clone() for n, p in pl_module.named_parameters()})
        metric = next(cb for cb in trainer.callbacks if isinstance(cb, StreamKLDistillation)).train_metric
        self.record["metric"].append((metric.kl_sum.cpu().clone(), metric.rows.cpu().clone()))

    def on_train_end(self, trainer, pl_module):
        self.record["logged"] = {k: float(v) for k, v in trainer.callback_metrics.items()  # epoch values (synced)
                                 if "attn_kl" in k and k.endswith("_epoch")}
        teacher = next(cb for cb in trainer.callbacks if isinstance(cb, StreamKLDistillation)).teacher
        self.record["teacher_devices"] = sorted({str(p.device) for p in teacher.parameters()})
        torch.save(self.record, self.out / f"{self.tag}-rank{trainer.global_rank}.pt")


def equivalence_runs(out: Path, *, accelerator: str = "cpu", dtype: torch.dtype = torch.float64,
                     ) -> tuple[dict, list[dict], dict, CausalLM]:
    """One process on batches of 4 rows, then ``ddp_spawn`` on 2 processes with 2 rows each, same init and teacher.

    Returns the single run's record, the two DDP records, the DDP run's checkpoints by step (their StreamKL state)
    and the single run's student (for reference computations).
    """
    out = Path(out)
    torch.manual_seed(0)
    student = DtypeLossLM(tiny_llama(hidden=16, heads=4, kv_heads=1, layers=2, seed=1, dtype=dtype), lr=0.5)
    teacher = make_teacher()
    initial = copy.deepcopy(student)
    data = GlobalBatches()
    single = L.Trainer(accelerator=accelerator, devices=1, max_steps=STEPS, logger=False, enable_progress_bar=False,
                       enable_model_summary=False, enable_checkpointing=False,
                       callbacks=[StreamKLDistillation(copy.deepcopy(teacher), pairs=PAIRS), Probe(out, "single")])
    single.fit(student, DataLoader(data, batch_size=WORLD * ROWS_PER_PROCESS, sampler=single_process_order()))

    ckpt = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=1, save_top_k=-1)
    ddp = L.Trainer(accelerator=accelerator, devices=2, strategy="ddp_spawn", max_steps=STEPS, logger=False,
                    enable_progress_bar=False, enable_model_summary=False,
                    callbacks=[StreamKLDistillation(copy.deepcopy(teacher), pairs=PAIRS), Probe(out, "ddp"), ckpt,
                               ShutDownProcessGroup()])
    ddp.fit(initial, DataLoader(data, batch_size=ROWS_PER_PROCESS))  # Lightning adds its DistributedSampler

    records = [torch.load(out / f"{tag}.pt", weights_only=False) for tag in ("single-rank0", "ddp-rank0", "ddp-rank1")]
    states = {}
    for path in (out / "ckpt").glob("*.ckpt"):
        c = torch.load(path, weights_only=False)
        states[c["global_step"]] = next(v for k, v in c["callbacks"].items() if k.startswith("StreamKLDistillation"))
    return records[0], records[1:], states, student


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def assert_tensors_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float, atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def half_batch_gradients(student: CausalLM, params: dict[str, torch.Tensor], rows: list[int],
                         accelerator: str = "cpu") -> dict[str, torch.Tensor]:
    """The gradient one process computes on ``rows`` from ``params`` (a 1-step run with the callback)."""
    model = copy.deepcopy(student)
    model.load_state_dict(params)
    probe = Probe(Path("."), "unused")
    probe.on_train_end = lambda *args: None
    t = L.Trainer(accelerator=accelerator, devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False,
                  callbacks=[StreamKLDistillation(make_teacher(), pairs=PAIRS), probe])
    t.fit(model, DataLoader(Subset(GlobalBatches(), rows), batch_size=len(rows)))
    return probe.record["grads"][0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_matches_one_process_on_the_global_batch(tmp_path):
    single, (rank0, rank1), states, student = equivalence_runs(tmp_path)
    tight = dict(rtol=1e-10, atol=1e-12)  # float64 model: only summation order differs
    for step in range(STEPS):  # the two processes together see the single process's global batch
        assert single["rows"][step] == sorted(rank0["rows"][step] + rank1["rows"][step])

    # equal counts (steps 0 and 1): the mean of the per-process losses is the global loss, gradients and the
    # parameters after each step are the single process's
    for step in (0, 1):
        ddp_loss = (rank0["loss"][step] + rank1["loss"][step]) / 2
        torch.testing.assert_close(ddp_loss, single["loss"][step], **tight)
        assert_tensors_close(rank0["grads"][step], single["grads"][step], **tight)
        assert_tensors_close(rank0["params"][step], single["params"][step], **tight)
        assert max_abs_diff(rank0["params"][step], rank1["params"][step]) == 0  # the processes stay identical

    # unequal counts (step 2): DDP follows the mean of the per-process means, not the global mean
    ddp_loss = (rank0["loss"][2] + rank1["loss"][2]) / 2
    assert abs(float(ddp_loss - single["loss"][2])) > 1e-3
    assert max_abs_diff(rank0["grads"][2], single["grads"][2]) > 1e-4
    halves = [half_batch_gradients(student, single["params"][1], step_rows(2, rank)) for rank in range(WORLD)]
    expected = {k: (halves[0][k] + halves[1][k]) / 2 for k in halves[0]}
    assert_tensors_close(rank0["grads"][2], expected, rtol=1e-9, atol=1e-12)

    # the logged epoch metric is row-weighted over both processes: the single process's value (the forward passes of
    # all three steps ran at the same parameters), although step 2's rows were split unevenly
    assert single["logged"].keys() == rank0["logged"].keys() >= {"train/attn_kl/last_epoch", "train/attn_kl/first_epoch",
                                                                 "train/attn_kl/total_epoch"}
    for key, value in single["logged"].items():
        assert rank0["logged"][key] == pytest.approx(value, rel=1e-6), key
        assert rank1["logged"][key] == rank0["logged"][key]

    # each process's metric counts its own rows (its state is not shared with the other process)
    for step in range(STEPS):
        torch.testing.assert_close(rank0["metric"][step][1] + rank1["metric"][step][1], single["metric"][step][1])
    assert not torch.equal(rank0["metric"][2][1], rank1["metric"][2][1])
    # a mid-epoch checkpoint holds the metric state of the whole group: the single process's sums and rows
    for step in (1, 2):
        saved, (kl_sum, rows) = states[step]["train_metric"], single["metric"][step - 1]
        assert torch.equal(saved["rows"], rows) and not torch.equal(saved["rows"], rank0["metric"][step - 1][1])
        torch.testing.assert_close(saved["kl_sum"], kl_sum, rtol=1e-6, atol=0)


def test_metric_update_does_not_write_into_its_state_tensors():
    """``ddp_spawn`` on CPU hands every process the callback's metric with its state tensors in shared memory (torch's
    multiprocessing pickling; Lightning un-shares parameters and buffers only). In-place updates made each process
    add into the same storage, so every process counted every process's rows."""
    metric = AttentionKLDivergence(["a"])
    shared_sum, shared_rows = metric.kl_sum.share_memory_(), metric.rows.share_memory_()
    metric.update(torch.tensor([2.0]), torch.tensor([4.0]))
    assert shared_sum.tolist() == shared_rows.tolist() == [0.0] and metric.rows.tolist() == [4.0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_callback_under_ddp_spawn_syncs_the_validation_metric():
    teacher = make_teacher()
    student = make_student(lr=0.1)
    val = loader(8, 4)
    t = trainer(strategy="ddp_spawn", devices=2, max_steps=2, limit_val_batches=None,
                callbacks=[StreamKLDistillation(teacher, pairs=[LAST])])
    t.fit(student, loader(16, 4), val)

    # rank 0 saw only half of the validation set; the logged value is the row-weighted mean over both halves
    sums = rows = 0.0
    for batch in val:
        with torch.no_grad():
            _, kl = manual_kl(teacher, student.model, batch, "model.layers.1.self_attn", "model.layers.1.self_attn")
        n = float(batch["attention_mask"].sum() * 4)
        sums, rows = sums + float(kl) * n, rows + n
    assert float(t.callback_metrics["val/attn_kl/last"]) == pytest.approx(sums / rows, rel=1e-5)
    half = next(iter(val))
    with torch.no_grad():
        _, kl_half = manual_kl(teacher, student.model, {k: v[::2] for k, v in half.items()},
                               "model.layers.1.self_attn", "model.layers.1.self_attn")
    assert float(t.callback_metrics["val/attn_kl/last"]) != pytest.approx(float(kl_half), rel=1e-5)
