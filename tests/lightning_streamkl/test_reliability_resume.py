"""Killing a run and resuming it from its last checkpoint reproduces the uninterrupted run bitwise (CPU).

The uninterrupted run, the run that is killed and the resumed run use the same seed, data order and teacher; every
value Lightning logs (per-step KL, epoch KL, task loss), every backpropagated loss and the final parameters and
optimizer state are compared with ``==`` / ``torch.equal``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch.utils.data import DataLoader

pytest.importorskip("transformers")

from lightning_streamkl import AttentionKLDivergence, StreamKLDistillation
from lightning_streamkl.adapter import load_metric_state, metric_state
from lightning_streamkl.capture.base import _RECORDING

from ._models import TokenDataset, trainer
from .test_callback import LAST, make_student, make_teacher

FIRST = {"teacher": 0, "student": 0, "name": "first", "weight": 0.5}


class MemoryLogger(Logger):
    """Keeps every ``log_metrics`` call as ``(step, {key: float})``: what Lightning logged, nothing else."""

    def __init__(self) -> None:
        super().__init__()
        self.history: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    @rank_zero_only
    def log_metrics(self, metrics, step=None) -> None:
        self.history.append((step, {k: float(v) for k, v in metrics.items() if k != "epoch"}))


class ResumableLoader(DataLoader):
    """A DataLoader that restores its position in the epoch (Lightning's ``state_dict``/``load_state_dict`` protocol).

    A plain DataLoader restarts the epoch from its first batch after a mid-epoch resume (Lightning warns about it).
    Lightning does not fetch ahead from a loader with a length, so the batches handed out are the batches consumed.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._yielded = self._skip = 0

    def __iter__(self):
        skip, self._skip = self._skip, 0
        self._yielded = skip
        for i, batch in enumerate(super().__iter__()):
            if i >= skip:
                self._yielded += 1
                yield batch

    def state_dict(self) -> dict[str, int]:
        return {"batches": self._yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._skip = state["batches"] % len(self)


class Kill(Callback):
    """Crashes the run inside the training step at ``global_step == at``, after both models' forward passes."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at:
            forward = pl_module.model.forward

            def crash(*args, **kwargs):
                forward(*args, **kwargs)  # the student's (q, k) are recorded
                raise RuntimeError("simulated kill")

            pl_module.model.forward = crash


CHECKPOINTS = {
    # name: (ModelCheckpoint options, validation loop, kill at step, last checkpoint's step, epoch values after it).
    # Only the mid-epoch case needs the resumable loader; the others use a plain DataLoader.
    "mid-epoch": (dict(every_n_train_steps=3, save_on_train_epoch_end=False), False, 8, 6, 2),
    "last-batch": (dict(every_n_train_steps=4, save_on_train_epoch_end=False), False, 10, 8, 1),
    "validation-end": ({}, True, 10, 8, 1),  # the default with a validation loop: saved after each validation
}


def _run(tmp_path, checkpoint, *, kill=False, ckpt_path=None):
    options, val, kill_at, _, _ = CHECKPOINTS[checkpoint]
    torch.manual_seed(0)
    student = make_student(lr=0.01, optimizer="adam")
    distill = StreamKLDistillation(make_teacher(), pairs=[LAST, FIRST], weight=2.0, warmup_steps=5)
    logger = MemoryLogger()
    callbacks = [distill, ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=-1, **options)]
    if kill:
        callbacks.append(Kill(kill_at))
    t = trainer(max_steps=12, callbacks=callbacks, logger=logger, log_every_n_steps=1, enable_checkpointing=True,
                limit_val_batches=None if val else 0)
    loader_cls = ResumableLoader if checkpoint == "mid-epoch" else DataLoader
    data = loader_cls(TokenDataset(8, 12), batch_size=2, shuffle=False)  # 4 batches per epoch
    val_data = DataLoader(TokenDataset(4, 12, seed=1), batch_size=2) if val else None
    try:
        t.fit(student, data, val_data, ckpt_path=ckpt_path)
    except RuntimeError as err:
        assert kill and "simulated kill" in str(err)
    return t, student, distill, logger


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
def test_kill_and_resume_from_the_last_checkpoint_is_bitwise_identical(tmp_path, checkpoint):
    _, _, kill_at, saved_at, epoch_values = CHECKPOINTS[checkpoint]
    full_t, full, _, full_log = _run(tmp_path / "full", checkpoint)
    kill_t, killed, kill_cb, kill_log = _run(tmp_path / "killed", checkpoint, kill=True)

    # the kill left nothing behind: step method restored, nothing recorded, no capture open
    assert kill_t.global_step == kill_at and "training_step" not in killed.__dict__
    assert kill_cb._distiller.student_capture.records == {} and kill_cb._distiller.teacher_capture.records == {}
    assert _RECORDING == []
    # two runs with the same seed are bitwise identical up to the kill
    assert kill_log.history == full_log.history[: len(kill_log.history)]
    assert killed.step_losses == full.step_losses[:kill_at]

    last = tmp_path / "killed" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == saved_at
    res_t, resumed, res_cb, res_log = _run(tmp_path / "resumed", checkpoint, ckpt_path=str(last))

    # every loss, every logged value (per step and per epoch, train and validation), parameters and optimizer state
    assert resumed.step_losses == full.step_losses[saved_at:]
    tail = [(step, metrics) for step, metrics in full_log.history if step >= saved_at]
    assert [metrics for _, metrics in res_log.history] == [metrics for _, metrics in tail]
    assert sum("train/attn_kl/last_epoch" in m for _, m in tail) == epoch_values
    steps, full_steps = [step for step, _ in res_log.history], [step for step, _ in tail]
    # Lightning's own quirk: after resuming from a checkpoint written at validation end, the logger's step is one ahead
    assert steps == [s + (checkpoint == "validation-end") for s in full_steps]
    for (name, p), q in zip(full.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), name
    full_opt, res_opt = full_t.optimizers[0].state_dict()["state"], res_t.optimizers[0].state_dict()["state"]
    for i in full_opt:
        assert all(torch.equal(full_opt[i][k], res_opt[i][k]) for k in full_opt[i])
    full_state, res_state = full_t.callbacks[0].state_dict(), res_cb.state_dict()
    assert full_state.pop("train_metric")["updates"] == res_state.pop("train_metric")["updates"] == 0  # epoch ended
    assert res_state == full_state and res_state["train_batches"] == 12


def test_checkpointed_metric_state_goes_to_global_rank_zero_only():
    """Every process loads the same checkpoint; only global rank 0 takes the saved (group-wide) sums, so the synced
    epoch value counts them once. (The sum over processes at save time is checked under DDP in test_ddp.py.)"""
    metric = AttentionKLDivergence(["a", "b"])
    metric.update(torch.tensor([2.0, 1.0]), torch.tensor([4.0, 2.0]))
    state = metric_state(metric, None)
    assert state["updates"] == 1 and state["kl_sum"].tolist() == [2.0, 1.0] and state["rows"].tolist() == [4.0, 2.0]
    for rank, kl_sum in ((0, [2.0, 1.0]), (1, [0.0, 0.0])):
        restored = AttentionKLDivergence(["a", "b"])
        load_metric_state(restored, state, SimpleNamespace(global_rank=rank))
        assert restored.kl_sum.tolist() == kl_sum and restored.update_count == 1  # every rank logs the epoch

    cb = StreamKLDistillation(make_teacher(), pairs=[LAST, FIRST])
    cb.load_state_dict({"version": 1, "name": "attn_kl", "pairs": ["last", "first"], "train_batches": 3,
                        "val_batches": 0})  # a checkpoint from before the metric state was saved
    assert cb._train_batches == 3 and cb.train_metric.update_count == 0
    with pytest.warns(UserWarning, match=r"written with pairs \['last'\], this run distils \['last', 'first'\]"):
        cb.load_state_dict({**cb.state_dict(), "pairs": ["last"], "train_metric": metric_state(metric, None)})
    assert cb.train_metric.update_count == 0  # another set of pairs: the saved sums are not used


def _run_mixin(tmp_path, *, kill=False, ckpt_path=None):
    from .test_mixin import DistilledLM

    torch.manual_seed(0)
    model = DistilledLM(make_teacher(), weight=2.0, warmup_steps=5)
    logger = MemoryLogger()
    callbacks = [ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=-1, every_n_train_steps=3,
                                 save_on_train_epoch_end=False)]
    if kill:
        callbacks.append(Kill(8))
    t = trainer(max_steps=12, callbacks=callbacks, logger=logger, log_every_n_steps=1, enable_checkpointing=True,
                limit_val_batches=0)
    data = ResumableLoader(TokenDataset(8, 12), batch_size=2, shuffle=False)  # 4 batches per epoch
    try:
        t.fit(model, data, ckpt_path=ckpt_path)
    except RuntimeError as err:
        assert kill and "simulated kill" in str(err)
    return model, logger


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mixin_resumed_mid_epoch_logs_the_uninterrupted_epoch_values(tmp_path):
    full, full_log = _run_mixin(tmp_path / "full")
    killed, _ = _run_mixin(tmp_path / "killed", kill=True)
    # the crash inside the step left no recording open (Lightning skips the batch-end hook that closes it)
    assert _RECORDING == [] and killed._streamkl_recording is None and killed._streamkl.student_capture.records == {}
    last = tmp_path / "killed" / "last.ckpt"
    saved = torch.load(last, weights_only=False)
    assert saved["global_step"] == 6  # in the middle of the second epoch (steps 4-7)
    assert saved["AttentionDistillationMixin[attn_kl]"]["train_metric"]["updates"] == 2
    resumed, res_log = _run_mixin(tmp_path / "resumed", ckpt_path=str(last))

    assert resumed.step_losses == full.step_losses[6:]
    tail = [metrics for step, metrics in full_log.history if step >= 6]
    assert [metrics for _, metrics in res_log.history] == tail
    # 6 per-step values (steps 6-11) and 2 epoch values, the first of which includes the 2 batches before the
    # checkpoint: all equal to the uninterrupted run's
    assert sum(("train/attn_kl/last_step" in m) + ("train/attn_kl/last_epoch" in m) for m in tail) == 8
