"""The distillation job's pieces: the recall task, the job run from Python, and the report's honest verdicts."""

from __future__ import annotations

import pytest
import torch

from lightning_streamkl.jobs import (
    DistillationJob,
    JobConfig,
    RecallData,
    RecallModel,
    make_recall_batch,
    naive_loss_bytes,
    outcome,
    render_report,
)
from lightning_streamkl.jobs.recall import IGNORE
from lightning_streamkl.jobs.report import first_step_reaching


def test_recall_batches_are_deterministic_and_scored_only_inside_the_repeat():
    dm = RecallData(seq_len=[16, 24], batch_size=3, vocab_size=20, seed=3)
    again = RecallData(seq_len=[16, 24], batch_size=3, vocab_size=20, seed=3)
    a = [batch for batch, _ in zip(dm.train_dataloader(), range(2))]
    b = [batch for batch, _ in zip(again.train_dataloader(), range(2))]
    assert [x["input_ids"].shape[1] for x in a] == [16, 24]  # lengths cycle batch by batch
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b))
    for batch in a:
        for x, y in zip(batch["input_ids"], batch["labels"]):
            h = int((y != IGNORE).sum()) + 1
            assert 4 <= h <= len(x) // 2 and torch.equal(x[-h:], x[-2 * h:-h])
    held = next(dm.eval_batches(64, 5, batch_size=4))
    assert held["input_ids"].shape == (4, 64)
    assert not torch.equal(held["input_ids"][:3, :16], a[0]["input_ids"])  # other seeds than training


def test_recall_batch_rejects_impossible_lengths():
    with pytest.raises(ValueError, match="min_copy"):
        make_recall_batch(1, 6, 10, min_copy=4)
    with pytest.raises(ValueError, match="seq_len"):
        RecallData(seq_len=6)


def test_with_overrides_keeps_the_rest():
    dm = RecallData(seq_len=32, batch_size=4, vocab_size=30).with_overrides(batch_size=8)
    assert (dm.batch_size, dm.vocab_size, dm.max_seq_len) == (8, 30, 32)


def test_job_from_python_without_the_cli(tmp_path):
    torch.manual_seed(0)
    teacher, student = RecallModel(d_model=16, num_heads=2), RecallModel(d_model=16, num_heads=2)
    job = DistillationJob(
        teacher, student, RecallData(seq_len=16, batch_size=2),
        {"pairs": [{"teacher": "model.blocks.1.attn", "student": "model.blocks.1.attn", "name": "last"}]},
        JobConfig(run_dir=str(tmp_path), teacher_steps=3, eval_lengths=[16], eval_sequences=4, kl_eval_sequences=2,
                  plots=False),
        trainer_defaults={"max_steps": 3, "accelerator": "cpu", "enable_progress_bar": False,
                          "enable_model_summary": False},
    )
    res = job.run()
    assert set(res["eval"]["attention_kl"]["student_base"]) == {"last"}
    assert res["naive_loss"] == {"batch_size": 2, "seq_len": 16, "heads": [2], "pairs": 1,
                                 **naive_loss_bytes(2, [2], 16)}
    assert (tmp_path / "report.md").is_file() and not (tmp_path / "accuracy.png").exists()


def _results(acc_t, acc_w, acc_b, lengths=(32, 64, 128), n_train=64, with_history=True):
    hist_w = [{"step": s, "train/acc": min(1.0, s / 50)} for s in range(1, 101)] if with_history else []
    hist_b = [{"step": s, "train/acc": 0.02} for s in range(1, 101)] if with_history else []
    runs = {"teacher": {"steps": 10, "wall_s": 1.0, "step_ms_median": 1.0, "peak_cuda_bytes": None, "history": []},
            "student_kl": {"steps": 100, "wall_s": 1.0, "step_ms_median": 1.0, "peak_cuda_bytes": 2**30,
                           "history": hist_w, "batch_shape": [2, n_train]},
            "student_base": {"steps": 100, "wall_s": 1.0, "step_ms_median": 1.0, "peak_cuda_bytes": None,
                             "history": hist_b}}
    acc = {"teacher": dict(zip(lengths, acc_t)), "student_kl": dict(zip(lengths, acc_w))}
    if acc_b is not None:
        acc["student_base"] = dict(zip(lengths, acc_b))
    return {
        "runs": runs,
        "eval": {"lengths": list(lengths), "accuracy": acc, "sequences": 8, "attention_kl_seq_len": n_train,
                 "attention_kl": {"student_kl": {"l0": 0.1}, "student_base": {"l0": 2.0}}},
        "setup": {"train_seq_len": n_train, "chance": 1 / 64, "student_steps": 100, "teacher_steps": 10,
                  "job": {"kl_eval_sequences": 4, "teacher_checkpoint": None}, "seed": 0,
                  "distillation": {"name": "attn_kl", "pairs": [{"teacher": 0, "student": 0, "name": "l0"}],
                                   "weight": 1.0, "temperature": 1.0, "direction": "forward"},
                  "data": {"batch_size": 2, "seq_len": n_train}, "teacher_data": {}, "teacher_params": 10,
                  "student_params": 10},
        "naive_loss": {"batch_size": 2, "seq_len": n_train, "heads": [4], "pairs": 1, "maps": 2**31,
                       "with_grad": 3 * 2**30},
        "environment": {"device": "cpu"},
    }


def test_outcome_helped_and_where_it_did_not():
    out = outcome(_results([0.9, 0.95, 0.2], [0.85, 0.93, 0.1], [0.86, 0.05, 0.1]))
    assert out["verdict"] == "helped"
    text = " ".join(out["summary"])
    assert "93.0%" in text and "5.0%" in text and "after 35 steps" in text and "not within 100 steps" in text
    assert "there is none at N=32, 128" in text
    assert [r["difference"] for r in out["per_length"]] == pytest.approx([-0.01, 0.88, 0.0])


def test_outcome_hurt_no_difference_teacher_failed_and_no_baseline():
    assert outcome(_results([0.9] * 3, [0.5] * 3, [0.8] * 3))["verdict"] == "hurt"
    assert outcome(_results([0.9] * 3, [0.8] * 3, [0.81] * 3))["verdict"] == "no clear difference"
    failed = outcome(_results([0.3] * 3, [0.1] * 3, [0.1] * 3))
    assert failed["verdict"] == "teacher failed" and "job.teacher_steps" in failed["summary"][0]
    assert outcome(_results([0.9] * 3, [0.8] * 3, None))["verdict"] == "no baseline"


def test_report_renders_tables_and_memory():
    res = _results([0.9, 0.95, 0.2], [0.85, 0.93, 0.1], [0.86, 0.05, 0.1])
    res["outcome"] = outcome(res)
    text = render_report(res, [("accuracy.png", "caption")])
    assert "| 64 (training length) | 95.0% | 93.0% | 5.0% | +88.0 pts |" in text
    assert "![caption](accuracy.png)" in text and "2.00 GiB of fp32 probability maps" in text
    assert "peaked at 1.00 GiB" in text


def test_first_step_reaching_uses_a_moving_average():
    hist = [{"step": s, "acc": 1.0 if s % 2 else 0.0} for s in range(1, 11)]
    assert first_step_reaching(hist, "acc", 0.9, window=1) == 1
    assert first_step_reaching(hist, "acc", 0.9, window=4) is None
