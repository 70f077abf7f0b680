"""Mixed precision through every front door: under autocast (Lightning's ``bf16-mixed``, or a plain loop's
``torch.autocast``) the captured queries and keys reach ``streamkl.attention_kl`` in the autocast dtype, as the layers'
sdpa received them, and the logged KL is the exact KL of those bf16 attention distributions; a bf16 teacher beside
a float32 student keeps each side's dtype; the pairing line names each pair's product precision at the first step.

(A float32 Llama query leaves the rotary embedding in float32 under autocast, since its fp32 ``cos``/``sin`` promote
the bf16 projection; sdpa then casts it to bf16. The capture used to keep float32, and the KL ran IEEE-fp32 products:
10x the plain step on an H100.)"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

pytest.importorskip("transformers")

from lightning_streamkl import AttentionDistiller, StreamKLDistillation
from lightning_streamkl import terms as terms_module
from lightning_streamkl.capture.hf import _PENDING
from streamkl import naive_attention_kl

from ._models import CausalLM, loader, token_batch, trainer
from .test_callback import LAST, Recorder, make_student, make_teacher
from .test_mixin import DistilledLM

BF16 = torch.bfloat16


class OpSpy:
    """Wraps the ``attention_kl`` the loss calls: the dtypes of the four tensors of every call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dtypes: list[tuple[torch.dtype, ...]] = []
        op = terms_module.attention_kl

        def spy(q_t, k_t, q_s, k_s, **kwargs):
            self.dtypes.append(tuple(x.dtype for x in (q_t, k_t, q_s, k_s)))
            return op(q_t, k_t, q_s, k_s, **kwargs)

        monkeypatch.setattr(terms_module, "attention_kl", spy)


class SdpaSpy:
    """What each ``F.scaled_dot_product_attention`` call of the models received, cast as autocast casts it for the
    kernel: the independent account of the distributions the layers computed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor, float, bool]] = []
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def spy(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
            device = query.device.type
            dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
            assert attn_mask is None, "the test batches carry no padding"
            self.calls.append((query.detach().to(dtype), key.detach().to(dtype), scale, is_causal))
            return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)

    def last_layers_kl(self) -> float:
        """The float64 KL between the distributions of the teacher's and the student's last layer in one step (the
        teacher's layers are those of head dim 8, the student's of 4; either model may run first)."""
        assert len(self.calls) == 4, "one step of two two-layer models"
        teacher, student = ([c for c in self.calls if c[0].shape[-1] == d] for d in (8, 4))
        (q_t, k_t, scale_t, causal), (q_s, k_s, scale_s, _) = teacher[-1], student[-1]
        return float(naive_attention_kl(q_t.double(), k_t.double(), q_s.double(), k_s.double(), causal=causal,
                                        scale_t=scale_t, scale_s=scale_s, compute_dtype=torch.float64))


def unpadded(n: int = 8, length: int = 12) -> torch.utils.data.DataLoader:
    batches = [token_batch(n, length, pad="none", seed=seed) for seed in range(2)]
    data = [{**b, "labels": b["input_ids"]} for b in batches]
    return torch.utils.data.DataLoader(data, batch_size=None)


def test_the_callback_under_bf16_mixed_hands_the_op_bf16_and_logs_the_kl_of_the_bf16_distributions(monkeypatch,
                                                                                                      caplog):
    ops, sdpa = OpSpy(monkeypatch), SdpaSpy(monkeypatch)
    rec = Recorder("train/attn_kl/last_step")
    callback = StreamKLDistillation(make_teacher(), pairs=[LAST])
    with caplog.at_level(logging.INFO):
        trainer(max_steps=1, precision="bf16-mixed", callbacks=[callback, rec], log_every_n_steps=1).fit(
            make_student(), unpadded())
    assert ops.dtypes == [(BF16,) * 4]
    assert {c[0].dtype for c in sdpa.calls} == {BF16}
    assert rec.values["train/attn_kl/last_step"][0] == pytest.approx(sdpa.last_layers_kl(), rel=1e-4)
    assert "last (model.layers.1.self_attn -> model.model.layers.1.self_attn, bf16)" in caplog.text


def test_the_mixin_under_bf16_mixed_hands_the_op_bf16(monkeypatch):
    ops, sdpa = OpSpy(monkeypatch), SdpaSpy(monkeypatch)
    rec = Recorder("train/attn_kl/last_step")
    model = DistilledLM(make_teacher())
    trainer(max_steps=1, precision="bf16-mixed", callbacks=[rec], log_every_n_steps=1).fit(model, unpadded())
    assert ops.dtypes == [(BF16,) * 4]
    assert rec.values["train/attn_kl/last_step"][0] == pytest.approx(sdpa.last_layers_kl(), rel=1e-4)


def test_the_engine_in_a_plain_autocast_loop_hands_the_op_bf16(monkeypatch):
    ops, sdpa = OpSpy(monkeypatch), SdpaSpy(monkeypatch)
    teacher, student = make_teacher(), make_student().model
    distiller = AttentionDistiller(teacher, {"pairs": [LAST]}, student=student)
    batch = token_batch(4, 10, pad="none")
    with torch.autocast("cpu", dtype=BF16):
        kd = distiller({**batch, "labels": batch["input_ids"]})
        loss = distiller.student_output.loss + kd
    loss.backward()
    assert ops.dtypes == [(BF16,) * 4]
    assert float(kd) == pytest.approx(sdpa.last_layers_kl(), rel=1e-4)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in student.parameters() if p.requires_grad)
    assert distiller.describe().endswith("(model.layers.1.self_attn -> model.layers.1.self_attn, bf16)")


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gradient_checkpointing_under_autocast_gives_the_gradients_without_it(use_reentrant):
    """The record is cast under autocast; with reentrant checkpointing its leaf copies stay float32 and the
    recomputation adds their gradients through the cast."""
    teacher, student = make_teacher(), make_student().model.train()
    batch = {**token_batch(3, 11, pad="none"), "labels": None}
    batch["labels"] = batch["input_ids"]

    def grads(model):
        distiller = AttentionDistiller(teacher, {"pairs": [LAST, {"teacher": 0, "student": 0}]}, student=model)
        with torch.autocast("cpu", dtype=BF16):
            kd = distiller(batch)
        # reentrant checkpointing: the leaf copies waiting for the recomputation are the records' dtype (a float32
        # leaf would keep the layer's float32 query alive beside its bf16 record)
        assert {leaf.dtype for p in _PENDING.values() for leaf in p.leaves if leaf is not None} <= {BF16}
        assert bool(_PENDING) is (use_reentrant and model is student)
        (kd + distiller.student_output.loss).backward()
        return float(kd), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    expected = grads(copy.deepcopy(student))
    student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    got = grads(student)
    assert got[0] == expected[0]
    assert got[1].keys() == expected[1].keys() and any(g.abs().max() > 0 for g in got[1].values())
    for name, ref in expected[1].items():
        torch.testing.assert_close(got[1][name], ref, msg=name)


def test_a_bf16_teacher_beside_a_float32_student_keeps_each_sides_dtype(monkeypatch, caplog):
    """``teacher_dtype="bfloat16"`` under ``32-true``: the teacher's products in bf16, the student's in float32
    (IEEE under the default ``torch.get_float32_matmul_precision()``), and the pairing line says so."""
    ops = OpSpy(monkeypatch)
    callback = StreamKLDistillation(make_teacher(), pairs=[LAST], teacher_dtype="bfloat16")
    with caplog.at_level(logging.INFO):
        trainer(max_steps=1, callbacks=[callback]).fit(CausalLM(make_student().model), loader(4, 4))
    assert ops.dtypes == [(BF16, BF16, torch.float32, torch.float32)]
    assert "last (model.layers.1.self_attn -> model.model.layers.1.self_attn, teacher bf16, student fp32 (IEEE))" \
        in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_a_gpu_fit_under_mixed_precision_hands_the_op_the_autocast_dtype(monkeypatch, precision):
    """The user path of the mixed-precision issue on the GPU: a Lightning fit of a Hugging Face student (sdpa) with
    the callback; the op receives the autocast dtype (the Triton kernels run it), the logged KL is the exact KL of what
    sdpa received, and under ``16-mixed`` the GradScaler's scaled step leaves finite gradients that train."""
    ops, sdpa = OpSpy(monkeypatch), SdpaSpy(monkeypatch)
    low = BF16 if precision == "bf16-mixed" else torch.float16
    rec = Recorder("train/attn_kl/last_step")
    student = make_student()
    before = [p.detach().clone() for p in student.parameters()]
    t = trainer(max_steps=1, accelerator="gpu", precision=precision, log_every_n_steps=1,
                callbacks=[StreamKLDistillation(make_teacher(), pairs=[LAST]), rec])
    t.fit(student, unpadded())
    assert ops.dtypes == [(low,) * 4]
    assert rec.values["train/attn_kl/last_step"][0] == pytest.approx(sdpa.last_layers_kl(), rel=1e-3)
    after = list(student.parameters())
    assert all(torch.isfinite(p).all() for p in after)
    trained = any(not torch.equal(a.detach().cpu(), b.cpu()) for a, b in zip(after, before))
    if precision == "16-mixed":  # the GradScaler either stepped or skipped an overflowing step and lowered its scale
        scaler = t.precision_plugin.scaler
        assert scaler is not None and (trained or scaler.get_scale() < 2.0**16)
    else:
        assert trained
