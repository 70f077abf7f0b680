"""StreamKLDistillation in real Trainer runs (CPU, tiny Hugging Face models built from configs)."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

pytest.importorskip("transformers")

from lightning_streamkl import HFAttentionCapture, StreamKLDistillation
from streamkl import attention_kl

from ._models import CausalLM, RecordedAttention, Regressor, TokenDataset, loader, tiny_llama, trainer

LAST = {"teacher": -1, "student": -1, "name": "last"}


def make_teacher(seed: int = 0, **kw):
    return tiny_llama(hidden=32, heads=4, kv_heads=2, layers=2, seed=seed, init=0.3, **kw)


def make_student(seed: int = 1, **kw):
    return CausalLM(tiny_llama(hidden=16, heads=4, kv_heads=1, layers=2, seed=seed), **kw)


class Recorder(L.Callback):
    """Collects logged values after every training batch."""

    def __init__(self, *keys: str) -> None:
        self.keys, self.values = keys, {k: [] for k in keys}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        for k in self.keys:
            self.values[k].append(float(trainer.callback_metrics[k]))


def manual_kl(teacher, student_lm, batch, t_layer, s_layer, temperature=1.0):
    """The pair's mean KL computed by hand: capture both models, call the op with the batch's masks."""
    t_cap, s_cap = HFAttentionCapture(teacher), HFAttentionCapture(student_lm)
    with torch.no_grad(), t_cap.recording():
        teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    with s_cap.recording():
        out = student_lm(**batch)
    t, s = t_cap.records[t_layer], s_cap.records[s_layer]
    mask = batch["attention_mask"].bool()
    kl = attention_kl(t.q, t.k, s.q, s.k, causal=True, scale_t=t.scale, scale_s=s.scale, temperature=temperature,
                      key_padding_mask=mask, query_mask=mask)
    return out.loss, kl


def test_distillation_lowers_the_pair_kl_and_the_task_loss_still_trains():
    teacher = make_teacher()
    student = make_student(lr=0.01, optimizer="adam")
    batch = next(iter(loader(4, 4)))
    layer = "model.layers.0.self_attn"
    with torch.no_grad():
        _, kl_before = manual_kl(teacher, student.model, batch, layer, layer)
    rec = Recorder("train/attn_kl/first_step", "train/attn_kl/total_step")
    cb = StreamKLDistillation(teacher, pairs=[{"teacher": 0, "student": 0, "name": "first"}], weight=10.0)
    trainer(max_steps=40, callbacks=[cb, rec], log_every_n_steps=1).fit(student, loader(16, 4))
    with torch.no_grad():
        _, kl_after = manual_kl(teacher, student.model, batch, layer, layer)

    kls = rec.values["train/attn_kl/first_step"]
    assert kl_after < 0.4 * kl_before, (float(kl_before), float(kl_after))
    assert sum(kls[-4:]) < 0.4 * sum(kls[:4])
    assert student.task_losses[-1] < 0.2 * student.task_losses[0]
    # the loss that was backpropagated is the task loss plus weight · Σ w_p KL_p
    for task, step, total in zip(student.task_losses, student.step_losses, rec.values["train/attn_kl/total_step"]):
        assert step == pytest.approx(task + 10.0 * total, rel=1e-5)
    # the teacher stayed frozen and the module's training_step was restored
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    assert "training_step" not in student.__dict__ and "validation_step" not in student.__dict__
    assert teacher.config._attn_implementation == student.model.config._attn_implementation == "sdpa"


def test_gradient_accumulation_equals_the_summed_manual_loss():
    teacher = make_teacher()
    student = make_student(lr=0.5)
    reference = copy.deepcopy(student.model)
    data = loader(4, 2)

    cb = StreamKLDistillation(teacher, pairs=[LAST, {"teacher": 0, "student": 0, "weight": 0.5}], weight=0.7,
                              temperature=2.0)
    trainer(max_steps=1, accumulate_grad_batches=2, callbacks=[cb]).fit(student, data)

    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for batch in data:
        task, kl_last = manual_kl(teacher, reference, batch, "model.layers.1.self_attn", "model.layers.1.self_attn", 2.0)
        _, kl_first = manual_kl(teacher, reference, batch, "model.layers.0.self_attn", "model.layers.0.self_attn", 2.0)
        ((task + 0.7 * (kl_last + 0.5 * kl_first)) / 2).backward()
    opt.step()
    for (name, p), q in zip(student.model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_mixed_on_cpu():
    teacher = make_teacher()
    student = make_student(lr=0.1)
    before = [p.detach().clone() for p in student.parameters()]
    rec = Recorder("train/attn_kl/last_step", "train/attn_kl/total_step")
    trainer(max_steps=3, precision="bf16-mixed", callbacks=[StreamKLDistillation(teacher, pairs=[LAST]), rec],
            log_every_n_steps=1).fit(student, loader(12, 4))
    assert all(0 < v < 10 for v in rec.values["train/attn_kl/last_step"])
    for task, step, total in zip(student.task_losses, student.step_losses, rec.values["train/attn_kl/total_step"]):
        assert step == pytest.approx(task + total, rel=1e-2)  # one loss, the sum (bf16 rounding of the task loss)
    assert any(not torch.equal(a, b) for a, b in zip(before, student.parameters()))
    assert next(teacher.parameters()).dtype == torch.float32  # follows the student's (fp32) parameters


def test_16_mixed_grad_scaler_sees_one_loss():
    """fp16 autocast with a GradScaler (Lightning maps '16-mixed' to bf16 on CPU, so the plugin is explicit)."""
    from lightning.pytorch.plugins import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaled = []
    scale = scaler.scale
    scaler.scale = lambda loss: scaled.append(float(loss.detach())) or scale(loss)
    student = make_student(lr=0.1)
    rec = Recorder("train/attn_kl/total_step")
    plugin = MixedPrecision(precision="16-mixed", device="cpu", scaler=scaler)
    trainer(max_steps=3, plugins=[plugin], callbacks=[StreamKLDistillation(make_teacher(), pairs=[LAST]), rec],
            log_every_n_steps=1).fit(student, loader(12, 4))
    assert len(scaled) == 3
    for task, loss, total in zip(student.task_losses, scaled, rec.values["train/attn_kl/total_step"]):
        assert loss == pytest.approx(task + total, rel=1e-5)
    assert student.step_losses == pytest.approx([1024.0 * x for x in scaled], rel=1e-5)


def test_resume_from_checkpoint_reproduces_the_next_losses(tmp_path):
    def run(max_epochs, ckpt=None):
        torch.manual_seed(0)
        student = make_student(lr=0.01, optimizer="adam")
        cb = StreamKLDistillation(make_teacher(), pairs=[LAST], weight=2.0, warmup_steps=3)
        t = trainer(max_epochs=max_epochs, callbacks=[cb])
        t.fit(student, loader(4, 2), ckpt_path=ckpt)
        return t, student, cb

    _, full, _ = run(3)
    t, first, cb = run(1)
    t.save_checkpoint(tmp_path / "mid.ckpt")
    state = torch.load(tmp_path / "mid.ckpt", weights_only=False)["callbacks"][cb.state_key]
    assert state.pop("train_metric")["updates"] == 0  # saved after the epoch's end: nothing carried over
    assert state == {"version": 2, "name": "attn_kl", "pairs": ["last"], "train_batches": 2, "val_batches": 0}
    _, resumed, cb2 = run(3, ckpt=str(tmp_path / "mid.ckpt"))

    assert first.step_losses == full.step_losses[:2]
    assert len(resumed.step_losses) == 4 and cb2._train_batches == 6
    assert resumed.step_losses == pytest.approx(full.step_losses[2:], rel=1e-6, abs=1e-7)
    assert resumed.step_losses != pytest.approx(resumed.task_losses)  # the KL term (warm-up included) was there


def test_two_callbacks_coexist():
    t1, t2 = make_teacher(seed=0), make_teacher(seed=5)
    student = make_student()
    a = StreamKLDistillation(t1, pairs=[LAST], name="kl_a")
    b = StreamKLDistillation(t2, pairs=[{"teacher": 0, "student": 0, "name": "first"}], weight=0.5, name="kl_b")
    assert a.state_key != b.state_key
    rec = Recorder("train/kl_a/total_step", "train/kl_b/total_step", "train/kl_a/last_step", "train/kl_b/first_step")
    t = trainer(max_steps=3, callbacks=[a, b, rec], log_every_n_steps=1)
    t.fit(student, loader(12, 4))
    for i, (task, step) in enumerate(zip(student.task_losses, student.step_losses)):
        expected = task + rec.values["train/kl_a/total_step"][i] + 0.5 * rec.values["train/kl_b/total_step"][i]
        assert step == pytest.approx(expected, rel=1e-5)
    assert {"train/kl_a/last_step", "train/kl_b/first_step", "train/kl_a/last_epoch"} <= set(t.callback_metrics)
    assert "training_step" not in student.__dict__

    clash = [StreamKLDistillation(t1, pairs=[LAST]), StreamKLDistillation(t2, pairs=[[0, 0]])]
    with pytest.raises(MisconfigurationException, match="Two StreamKLDistillation callbacks use the name 'attn_kl'"):
        trainer(max_steps=1, callbacks=clash).fit(make_student(), loader(4, 4))


def test_validation_logs_and_epoch_values_are_row_weighted():
    teacher = make_teacher()
    student = make_student()
    cb = StreamKLDistillation(teacher, pairs=[LAST], log_on_step=False)
    data = loader(8, 4)
    t = trainer(max_epochs=1, limit_val_batches=None, callbacks=[cb])
    t.fit(student, data, data)
    assert {"val/attn_kl/last", "val/attn_kl/total", "train/attn_kl/last_epoch"} <= set(t.callback_metrics)
    assert not any(k.endswith("_step") for k in t.callback_metrics if "attn_kl" in k)  # log_on_step=False
    # the validation value is the row-weighted mean over the two validation batches, from the final weights
    sums, rows = 0.0, 0.0
    for batch in data:
        with torch.no_grad():
            _, kl = manual_kl(teacher, student.model, batch, "model.layers.1.self_attn", "model.layers.1.self_attn")
        n = batch["attention_mask"].sum() * 4  # 4 heads, causal rows all have a real key (right padding)
        sums, rows = sums + float(kl) * n, rows + n
    assert float(t.callback_metrics["val/attn_kl/last"]) == pytest.approx(float(sums / rows), rel=1e-5)
    assert float(t.callback_metrics["val/attn_kl/total"]) == pytest.approx(float(sums / rows), rel=1e-5)


def test_dict_and_none_outputs():
    class DictOut(CausalLM):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1:
                return None  # skipped batch: nothing is added, nothing breaks
            loss = self.model(**batch).loss
            self.task_losses.append(float(loss.detach()))
            return {"loss": loss, "extra": 1}

    student = DictOut(tiny_llama(hidden=16, heads=4, kv_heads=1, seed=1))
    trainer(max_steps=3, callbacks=[StreamKLDistillation(make_teacher(), pairs=[LAST])]).fit(student, loader(12, 4))
    assert len(student.step_losses) == 2 and all(s > t for s, t in zip(student.step_losses, student.task_losses))


def test_teacher_keeps_its_own_dtype_unless_told():
    """``teacher_dtype="auto"`` used to follow the student's parameters (under bf16-mixed: the fp32 master weights,
    so a bf16 teacher was upcast to fp32, doubling its memory); it now keeps the teacher's own dtype."""
    teacher = make_teacher(dtype=torch.bfloat16)
    rec = Recorder("train/attn_kl/last_step")
    trainer(max_steps=2, precision="bf16-mixed", callbacks=[StreamKLDistillation(teacher, pairs=[LAST]), rec],
            log_every_n_steps=1).fit(make_student(), loader(8, 4))
    assert {p.dtype for p in teacher.parameters()} == {torch.bfloat16} and all(v > 0 for v in rec.values[
        "train/attn_kl/last_step"])
    student = CausalLM(tiny_llama(hidden=16, heads=4, kv_heads=1, seed=1, dtype=torch.float64))
    trainer(max_steps=1, callbacks=[StreamKLDistillation(teacher, pairs=[LAST], teacher_dtype="auto")]).fit(
        student, loader(4, 4))
    assert {p.dtype for p in teacher.parameters()} == {torch.bfloat16}  # not the student's float64 either
    trainer(max_steps=1, callbacks=[StreamKLDistillation(teacher, pairs=[LAST], teacher_dtype="float32")]).fit(
        student, loader(4, 4))
    assert {p.dtype for p in teacher.parameters()} == {torch.float32}


def test_custom_teacher_forward_and_tuple_batches():
    calls = []

    def forward(teacher, batch):
        calls.append(batch["input_ids"].shape)
        return teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])

    cb = StreamKLDistillation(make_teacher(), pairs=[LAST], teacher_forward=forward)
    trainer(max_steps=2, callbacks=[cb]).fit(make_student(), loader(8, 4))
    assert calls == [torch.Size([4, 12])] * 2

    class Sub(StreamKLDistillation):
        def teacher_forward(self, teacher, batch):
            calls.append("sub")
            return teacher(input_ids=batch["input_ids"])

    trainer(max_steps=1, callbacks=[Sub(make_teacher(), pairs=[LAST])]).fit(make_student(), loader(4, 4))
    assert calls[-1] == "sub"


# ------------------------------------------------------------------------------------------------ errors
def test_unknown_layer_path_fails_in_setup_with_close_matches():
    cb = StreamKLDistillation(make_teacher(), pairs=[{"teacher": "model.layer.1.self_attn", "student": -1}])
    with pytest.raises(ValueError, match=r"Unknown teacher layer of pairs\[0\].*'model.layer.1.self_attn'.*Closest: "
                                         r"\['model.layers.1.self_attn'"):
        trainer(max_steps=1, callbacks=[cb]).fit(make_student(), loader(4, 4))
    cb = StreamKLDistillation(make_teacher(), pairs=[{"teacher": 0, "student": "model.layers.0.attn"}])
    with pytest.raises(ValueError, match=r"Unknown student layer.*Closest: \['model.model.layers.0.self_attn'"):
        trainer(max_steps=1, callbacks=[cb]).fit(make_student(), loader(4, 4))


def test_mismatched_sequence_lengths_fail_with_both_shapes():
    def truncating(teacher, batch):
        return teacher(input_ids=batch["input_ids"][:, :8])

    cb = StreamKLDistillation(make_teacher(), pairs=[LAST], teacher_forward=truncating)
    with pytest.raises(ValueError, match=r"pair 'last'.*different shapes: teacher q \(4, 4, 8, 8\).*student q \(4, 4, 12, 4\)"):
        trainer(max_steps=1, callbacks=[cb]).fit(make_student(), loader(4, 4))


def test_manual_optimization_is_rejected():
    class Manual(CausalLM):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            self.manual_backward(self.model(**batch).loss)

    with pytest.raises(MisconfigurationException, match=r"manual optimization.*AttentionDistillationMixin"):
        trainer(max_steps=1, callbacks=[StreamKLDistillation(make_teacher(), pairs=[LAST])]).fit(Manual(), loader(4, 4))


def test_returned_value_without_loss_is_rejected():
    class NoLoss(CausalLM):
        def training_step(self, batch, batch_idx):
            return {"value": self.model(**batch).loss}

    with pytest.raises(Exception, match="returned a mapping without a 'loss' key"):
        trainer(max_steps=1, callbacks=[StreamKLDistillation(make_teacher(), pairs=[LAST])]).fit(NoLoss(), loader(4, 4))


def test_dataset_is_deterministic():
    assert torch.equal(TokenDataset(4).ids, TokenDataset(4).ids)


# ------------------------------------------------------------------------------------------------ plain PyTorch
def test_plain_pytorch_models_with_tuple_batches():
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(RecordedAttention(qkv_std=0.5), RecordedAttention(qkv_std=0.5))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 6, 16), torch.randn(32, 6)),
                                       batch_size=8)
    student = Regressor("mha")
    rec = Recorder("train/attn_kl/deep_step", "train/attn_kl/total_step")
    cb = StreamKLDistillation(teacher, pairs=[{"teacher": "1", "student": "encoder.layers.1.self_attn", "name": "deep"}])
    trainer(max_steps=12, callbacks=[cb, rec], log_every_n_steps=1).fit(student, data)
    assert cb._distiller.teacher_capture.kind == "recorder" and cb._distiller.student_capture.kind == "mha"
    for task, step, total in zip(student.task_losses, student.step_losses, rec.values["train/attn_kl/total_step"]):
        assert step == pytest.approx(task + total, rel=1e-5)
    kls = rec.values["train/attn_kl/deep_step"]
    assert kls[-1] < kls[0]


def test_teacher_by_local_hugging_face_path(tmp_path):
    make_teacher().save_pretrained(tmp_path / "teacher")
    cb = StreamKLDistillation(str(tmp_path / "teacher"), pairs=[LAST])
    rec = Recorder("train/attn_kl/last_step")
    trainer(max_steps=1, callbacks=[cb, rec], log_every_n_steps=1).fit(make_student(), loader(4, 4))
    assert type(cb.teacher).__name__ == "LlamaModel" and rec.values["train/attn_kl/last_step"][0] > 0
    assert cb._distiller.resolved == [("layers.1.self_attn", "model.model.layers.1.self_attn")]
