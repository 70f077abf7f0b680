"""Self-distillation under LoRA: the teacher is the student with its adapters switched off (PEFT's
``disable_adapter()``), with no second copy of the weights, in the engine, the callback and the continual
regulariser; and none of it imports peft."""

from __future__ import annotations

import copy
import subprocess
import sys

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_streamkl import AttentionDistiller, ContinualAttentionRegularizer, StreamKLDistillation
from lightning_streamkl.teacher import AdaptersOff

from ._models import token_batch

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

F64 = torch.float64


def lora_llama(seed: int = 0, dtype=F64):
    """A tiny Llama with LoRA on q/k/v, and a copy of its base model taken before the adapters went in; the adapters'
    B matrices are random (PEFT starts them at 0, where the adapters change nothing)."""
    from ._models import tiny_llama

    base = tiny_llama(seed=seed, dtype=dtype, layers=2)
    reference = copy.deepcopy(base).eval()
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"],
                                                      lora_dropout=0.0))
    torch.manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.2)
    return model, reference


def test_adapters_off_equals_a_frozen_copy_of_the_base_model():
    student, base = lora_llama()
    batch = token_batch()
    off = AttentionDistiller(AdaptersOff(), {"pairs": [[0, 0], [-1, -1]]}, student=student)
    copied = AttentionDistiller(base, {"pairs": [[0, 0], [-1, -1]]}, student=student)
    assert off.teacher_module is student and off.inputs_from is None  # the student itself, fed the batch
    with torch.no_grad():
        ours, ref = off(batch).detach(), copied(batch).detach()
    assert float(ref) > 1e-3  # the adapters change the attention: a non-trivial comparison
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)


def test_the_student_is_left_as_it_was_and_only_the_adapters_learn():
    student, _ = lora_llama()
    student.train()
    trainable = {n for n, p in student.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    distiller = AttentionDistiller(AdaptersOff(), {"pairs": [[-1, -1]]}, student=student)
    loss = distiller(token_batch())
    loss.backward()
    assert student.training and all(m.training for m in student.modules())  # eval() only for the teacher's pass
    assert {n for n, p in student.named_parameters() if p.requires_grad} == trainable
    with_grad = {n for n, p in student.named_parameters() if p.grad is not None}
    assert with_grad <= trainable and any("layers.1.self_attn.q_proj.lora_B" in n for n in with_grad)
    with torch.no_grad():  # adapters are on again: the student's output differs from the base model's
        on = student(**token_batch()).logits
        with student.disable_adapter():
            off = student(**token_batch()).logits
    assert not torch.allclose(on, off)


def test_no_weight_is_copied():
    student, _ = lora_llama(dtype=torch.float32)
    distiller = AttentionDistiller(AdaptersOff(), {"pairs": [[-1, -1]]}, student=student)
    student_storage = {p.untyped_storage().data_ptr() for p in student.parameters()}
    teacher_storage = {p.untyped_storage().data_ptr() for p in distiller.teacher_module.parameters()}
    assert teacher_storage <= student_storage
    assert all(p.dtype == torch.float32 for p in student.parameters())  # nothing cast either


class LoraModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model, _ = lora_llama(dtype=torch.float32)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=0.05)


def _loader():
    batch = token_batch(batch=4)
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return DataLoader([batch] * 4, batch_size=None)  # four copies of one ready-made batch


QUIET = dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
             enable_model_summary=False)


def test_the_callback_with_adapters_off_feeds_the_peft_model_its_own_inputs():
    module = LoraModule()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    callback = StreamKLDistillation(AdaptersOff(), pairs=[[-1, -1]], name="self_kd")
    trainer = L.Trainer(max_steps=4, callbacks=[callback], **QUIET)
    trainer.fit(module, _loader())
    assert callback.teacher is module.model and callback.distiller.inputs_from == "model"
    assert float(trainer.callback_metrics["train/self_kd/total_epoch"]) > 0  # the adapters moved away from the base
    changed = {n for n, p in module.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)  # the base weights, the teacher's, never moved


def test_the_continual_regulariser_regularises_toward_the_base_model_without_a_copy():
    module = LoraModule()
    regularizer = ContinualAttentionRegularizer(reference="adapters_off", weight=1.0, layers=[-1])
    trainer = L.Trainer(max_steps=4, callbacks=[regularizer], **QUIET)
    trainer.fit(module, _loader())
    assert regularizer.snapshots == [] and regularizer.task == 0  # no copy, no task boundary
    logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/continual_kl/")}
    assert any(v > 0 for k, v in logged.items() if "total" in k), logged
    with pytest.raises(ValueError, match=r"reference=.adapters_off.*no snapshot"):
        regularizer.snapshot(module)


def test_adapters_off_without_adapters_fails_naming_what_is_missing():
    from ._models import tiny_llama

    with pytest.raises(ValueError, match="no submodule of LlamaForCausalLM can switch its adapters off"):
        AttentionDistiller(AdaptersOff(), {"pairs": [[-1, -1]]}, student=tiny_llama())
    student, _ = lora_llama()
    with pytest.raises(ValueError, match=r"AdaptersOff\(module='base_model.model.lm_head'\) to be a module whose "):
        AttentionDistiller(AdaptersOff("base_model.model.lm_head"), {"pairs": [[-1, -1]]}, student=student)
    with pytest.raises(ValueError, match=r"Expected a `teacher_device` other than 'offload' with AdaptersOff, but "
                                         r"got teacher_device='offload': the teacher is the student itself"):
        AttentionDistiller(AdaptersOff(), {"pairs": [[-1, -1]], "teacher_device": "offload"})


def test_importing_the_package_never_imports_peft():
    code = ("import sys, lightning_streamkl; from lightning_streamkl.teacher import AdaptersOff; "
            "from lightning_streamkl import AttentionDistiller; assert 'peft' not in sys.modules, 'peft imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_transformers_model_with_an_adapter_loaded_is_found_too():
    from ._models import tiny_llama

    model = tiny_llama(dtype=F64)
    reference = copy.deepcopy(model)
    model.add_adapter(peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj"], init_lora_weights=False))
    distiller = AttentionDistiller(AdaptersOff(), {"pairs": [[-1, -1]]}, student=model)
    copied = AttentionDistiller(reference, {"pairs": [[-1, -1]]}, student=model)
    assert distiller.teacher.path == ""  # the model itself: disable_adapters()/enable_adapters()
    with torch.no_grad():
        torch.testing.assert_close(distiller(token_batch()), copied(token_batch()), rtol=1e-10, atol=1e-12)


def test_adapters_off_works_where_peft_cannot_be_imported():
    code = """
import sys
sys.modules["peft"] = None  # `import peft` raises ImportError from here on
import torch
from torch import nn
from lightning_streamkl import AttentionDistiller
from lightning_streamkl.teacher import AdaptersOff

class Adapted(nn.Module):  # an adapter that any library could provide
    def __init__(self):
        super().__init__()
        self.layers = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dropout=0.0), 1,
                                            enable_nested_tensor=False)
        self.delta, self.on = nn.Linear(8, 8), True
    def disable_adapters(self): self.on = False
    def enable_adapters(self): self.on = True
    def forward(self, x):
        return self.layers(x + self.delta(x) if self.on else x)

model = Adapted()
kd = AttentionDistiller(AdaptersOff(), {"pairs": [[0, 0]], "causal": False}, student=model)(torch.randn(2, 3, 8))
kd.backward()
assert float(kd) > 0 and model.delta.weight.grad is not None and model.on
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "ok"


def test_the_mixin_and_yaml_take_adapters_off():
    from lightning_streamkl import AttentionDistillationMixin, load_config

    class Mixed(AttentionDistillationMixin, LoraModule):
        def __init__(self):
            super().__init__()
            self.configure_attention_distillation(AdaptersOff(), pairs=[[-1, -1]])

    module = Mixed()
    batch = token_batch()
    with module.capture_student_attention():
        module.model(**batch)
    loss = module.attention_distillation_loss(batch)
    assert float(loss.detach()) > 0 and loss.requires_grad and module._streamkl.teacher_module is module.model
    # no teacher weights were added to the module (nothing more to checkpoint or optimise)
    assert sum(p.numel() for p in module.parameters()) == sum(p.numel() for p in module.model.parameters())

    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser()
    parser.add_class_arguments(StreamKLDistillation, "distill")
    cfg = parser.parse_object({"distill": {"teacher": {"class_path": "lightning_streamkl.AdaptersOff"},
                                           "pairs": [[-1, -1]], "relations": ["qq", "kk"]}})
    callback = parser.instantiate_classes(cfg).distill
    assert isinstance(callback.distiller.teacher.spec, AdaptersOff)
    assert callback.config.relations == load_config("pairs: [[-1, -1]]\nrelations: [qq, kk]").relations
