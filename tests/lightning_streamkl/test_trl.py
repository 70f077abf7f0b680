"""Attention KL in TRL's trainers (:mod:`lightning_streamkl.integrations.trl`), on tiny models built from configs on
the CPU: a padded and a padding-free ``SFTTrainer`` batch give the KL of their documents run alone through the engine;
a trainer that runs its teacher itself (``GKDTrainer``, ``DistillationTrainer``) runs it once per step; the per-pair
KL is logged beside the trainer's own metrics; the term keeps its weight under gradient accumulation."""

from __future__ import annotations

import itertools
import subprocess
import sys
import tempfile

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("trl")

import trl
from datasets import Dataset
from packaging.version import Version
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Trainer, TrainingArguments
from trl import DistillationConfig, DistillationTrainer, SFTConfig, SFTTrainer
from trl.experimental.gkd import GKDConfig, GKDTrainer

from lightning_streamkl.integrations.trl import AttentionKLMixin

from ._hf import VOCAB, cpu_flash, distil, tiny

PAIRS = [{"teacher": -1, "student": -1, "name": "last"}]
QUIET = dict(report_to=[], use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True, logging_steps=1, seed=0)


def tokenizer(padding_side: str = "right") -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``<pad> <eos> w2 ... w{VOCAB-1}`` (no hub), with a plain chat template."""
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", padding_side=padding_side)
    out.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if not add_generation_prompt %}<eos>{% endif %}"
    return out


def words(n: int, g: torch.Generator) -> str:
    return " ".join(f"w{int(i)}" for i in torch.randint(2, VOCAB, (n,), generator=g))


def texts(count: int = 8, seed: int = 0) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    return Dataset.from_dict({"text": [words(int(torch.randint(3, 9, (1,), generator=g)), g) for _ in range(count)]})


def models_(impl: str = "sdpa"):
    """The teacher (wider, 2 KV heads) and the student (1 KV head), float64, peaked attention."""
    return tiny("llama", seed=0, hidden=32, kv_heads=2, impl=impl), tiny("llama", seed=1, hidden=16, kv_heads=1, impl=impl)


def count_calls(module: torch.nn.Module) -> list[int]:
    calls: list[int] = []
    module.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


class Spied(AttentionKLMixin):
    """Keeps each step's inputs (as the trainer hands them over) and the engine's loss terms."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen, self.terms = [], []
        end_step = self.attention_distiller.end_step

        def spy(batch):
            self.terms.append(end_step(batch))
            return self.terms[-1]

        self.attention_distiller.end_step = spy

    def compute_loss(self, model, inputs, *args, **kwargs):
        self.seen.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})
        return super().compute_loss(model, inputs, *args, **kwargs)


class SFT(Spied, SFTTrainer):
    pass


def sft(tmp, teacher, student, *, padding_free: bool, steps: int = 1, **args) -> SFT:
    config = SFTConfig(output_dir=tmp, max_steps=steps, per_device_train_batch_size=4, padding_free=padding_free,
                       max_length=None, learning_rate=0.0, **{**QUIET, **args})  # (lr 0: the models stay as they were)
    return SFT(model=student, args=config, train_dataset=texts(), processing_class=tokenizer(), attention_teacher=teacher,
               attention_kl={"pairs": PAIRS})


def documents(batch: dict) -> list[torch.Tensor]:
    """The batch's documents: a packed row split where ``position_ids`` restart, or each padded row's real tokens."""
    ids = batch["input_ids"]
    if "attention_mask" not in batch:
        starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
        return [ids[:, a:b] for a, b in itertools.pairwise(starts)]
    return [row[mask.bool()][None] for row, mask in zip(ids, batch["attention_mask"])]


def kl_alone(teacher, student, docs) -> torch.Tensor:
    """The mean KL over every row of every document, each run alone through the engine."""
    outs = [distil(teacher, student, {"input_ids": d}, PAIRS)[0] for d in docs]
    rows = [o.rows[0].double() for o in outs]  # (the per-pair means are float64 here, the sums float32)
    return sum(o.per_pair["last"].detach() * n for o, n in zip(outs, rows)) / sum(rows)


# ---------------------------------------------------------------------------------------------- the library
def test_importing_the_library_never_imports_trl():
    code = ("import sys, lightning_streamkl, lightning_streamkl.integrations, lightning_streamkl.integrations.trl; "
            "assert 'trl' not in sys.modules, 'trl was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------- SFTTrainer
@pytest.mark.parametrize(("padding_free", "impl"), [(False, "sdpa"), (True, "sdpa"), (True, "flash_attention_2")],
                         ids=["padded-sdpa", "padding_free-sdpa", "padding_free-flash_attention_2"])
def test_sft_batches_give_the_kl_of_their_documents_run_alone(tmp_path, padding_free, impl):
    """A padded batch counts real tokens only; a padding-free row (restarting ``position_ids``, and the collator's
    ``cu_seq_lens_*``, which flash-attention reads) gives the per-document KL, not the KL of one long sequence."""
    teacher, student = models_(impl)
    teacher_calls = count_calls(teacher)
    with cpu_flash():
        trainer = sft(str(tmp_path), teacher, student, padding_free=padding_free)
        trainer.train()
        assert len(teacher_calls) == 1  # one teacher pass in the step
        (batch,), (terms,) = trainer.seen, trainer.terms
        assert ("attention_mask" in batch) is not padding_free and ("position_ids" in batch) is padding_free
        if padding_free:  # TRL 1.16's collator adds the flash-attention kwargs; older ones give position_ids only
            assert "cu_seq_lens_q" in batch or Version(trl.__version__) < Version("1.16")
        docs = documents(batch)
        expected = kl_alone(teacher, student, docs)
        assert len(docs) == 4
        whole = kl_alone(teacher, student, [batch["input_ids"]])  # the row as one sequence
    torch.testing.assert_close(terms.per_pair["last"].detach(), expected, rtol=1e-9, atol=0)
    logged = trainer.state.log_history[0]
    assert logged["attn_kl/last"] == pytest.approx(float(expected), rel=1e-6)
    assert logged["attn_kl/total"] == logged["attn_kl/last"]
    assert {"loss", "entropy", "mean_token_accuracy", "num_tokens"} <= logged.keys()  # SFT's own metrics beside
    if padding_free:  # ignoring the documents would be visibly wrong
        assert abs(float(whole) - float(expected)) > 0.01


def test_sft_logs_eval_kl_and_adds_the_term_to_the_loss(tmp_path):
    """Evaluation logs ``eval_attn_kl/<pair>``; the loss the trainer reports is its own plus weight · KL."""
    teacher, student = models_()
    trainer = sft(str(tmp_path), teacher, student, padding_free=False, eval_strategy="no")
    trainer.attention_distiller.config.weight = 3.0
    batch = next(iter(trainer.get_train_dataloader()))
    student.train()
    with torch.no_grad():
        total = trainer.compute_loss(student, dict(batch))
        task = SFTTrainer.compute_loss(trainer, student, dict(batch))
    assert float(total) == pytest.approx(float(task) + 3.0 * float(trainer.terms[-1].total), rel=1e-6)  # (float32)
    metrics = trainer.evaluate(texts(4, seed=1))
    assert metrics["eval_attn_kl/last"] > 0 and metrics["eval_attn_kl/total"] == metrics["eval_attn_kl/last"]
    assert "eval_loss" in metrics and "eval_entropy" in metrics


@pytest.mark.skipif(Version(trl.__version__) < Version("1.15"),
                    reason="SFTTrainer's label smoothing fails in TRL 1.14 itself (no `num_valid_tokens` in its outputs)")
def test_a_second_student_pass_without_gradients_is_not_recorded(tmp_path):
    """With label smoothing SFT runs the student twice, the second time under ``no_grad`` for its metrics: the KL must
    come from the first pass, the one the loss backpropagates through."""
    teacher, student = models_()
    trainer = sft(str(tmp_path), teacher, student, padding_free=False, label_smoothing_factor=0.1)
    forwards = count_calls(student)
    trainer.train()
    assert len(forwards) == 2 and trainer.terms[0].total.requires_grad
    assert trainer.state.log_history[0]["attn_kl/last"] > 0


def test_a_lora_fine_tune_distils_toward_its_base_model(tmp_path):
    """``AdaptersOff()``: SFT with a PEFT adapter, the teacher the student itself with its adapters off."""
    peft = pytest.importorskip("peft")
    from lightning_streamkl import AdaptersOff

    _, student = models_()
    forwards = count_calls(student)
    config = SFTConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, padding_free=True,
                       max_length=None, learning_rate=0.01, **QUIET)
    trainer = SFT(model=student, args=config, train_dataset=texts(), processing_class=tokenizer(),
                  peft_config=peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), attention_teacher=AdaptersOff(),
                  attention_kl={"pairs": PAIRS})
    trainer.train()
    assert len(forwards) == 4  # per step: the student, and the base model (the same module, adapters off)
    first, second = (float(t.per_pair["last"]) for t in trainer.terms)
    assert first == 0.0 and second > 0  # LoRA starts as the identity; one update moves the attention off the base


# ---------------------------------------------------------------------------------------------- teacher-running trainers
class GKD(Spied, GKDTrainer):
    pass


class Distillation(Spied, DistillationTrainer):
    pass


def test_gkd_runs_its_teacher_once_per_step(tmp_path):
    """The engine records the teacher's paired layers during GKD's own teacher pass (on-policy batches included)."""
    teacher, student = models_()
    teacher_calls = count_calls(teacher)
    g = torch.Generator().manual_seed(0)
    data = Dataset.from_dict({"messages": [[{"role": "user", "content": words(5, g)},
                                            {"role": "assistant", "content": words(4, g)}] for _ in range(8)]})
    args = GKDConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, max_new_tokens=3, lmbda=0.5,
                     learning_rate=0.0, **QUIET)
    trainer = GKD(model=student, teacher_model=teacher, args=args, train_dataset=data, processing_class=tokenizer(),
                  attention_kl={"pairs": PAIRS})
    assert trainer.trainer_runs_teacher
    trainer.train()
    assert len(trainer.seen) == 3 and len(teacher_calls) == 3
    for entry in trainer.state.log_history[:3]:
        assert entry["attn_kl/last"] > 0 and "loss" in entry
    # the KL is that of the batch GKD trained on (its own teacher pass, recorded), not of another pass
    batch = trainer.seen[-1]
    expected = distil(teacher, student, {k: batch[k] for k in ("input_ids", "attention_mask")}, PAIRS)[0]
    torch.testing.assert_close(trainer.terms[-1].per_pair["last"].detach(), expected.per_pair["last"], rtol=1e-9, atol=0)


def test_distillation_trainer_runs_its_teacher_once_per_step(tmp_path):
    """TRL's stable logit-distillation trainer runs its teacher's backbone itself; that pass is the one recorded."""
    teacher, student = models_()
    backbone_calls = count_calls(teacher.model)
    g = torch.Generator().manual_seed(0)
    data = Dataset.from_dict({"prompt": [words(4, g) for _ in range(8)]})
    args = DistillationConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2,
                              max_completion_length=3, **QUIET)
    trainer = Distillation(model=student, teacher_model=teacher, args=args, train_dataset=data,
                           processing_class=tokenizer("left"), attention_kl={"pairs": PAIRS})
    assert trainer.trainer_runs_teacher
    trainer.train()
    assert len(trainer.seen) == 2 and len(backbone_calls) == 2
    logged = trainer.state.log_history[0]
    assert logged["attn_kl/last"] > 0 and {"loss", "entropy"} <= logged.keys()


def test_another_attention_teacher_is_run_by_the_engine(tmp_path):
    """A teacher that is not the trainer's own is run by the engine, beside the trainer's teacher."""
    teacher, student = models_()
    other = tiny("llama", seed=2, hidden=32, kv_heads=2)
    g = torch.Generator().manual_seed(0)
    data = Dataset.from_dict({"messages": [[{"role": "user", "content": words(3, g)},
                                            {"role": "assistant", "content": words(3, g)}] for _ in range(4)]})
    args = GKDConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, lmbda=0.0, **QUIET)
    calls = count_calls(teacher), count_calls(other)
    trainer = GKD(model=student, teacher_model=teacher, args=args, train_dataset=data, processing_class=tokenizer(),
                  attention_teacher=other, attention_kl={"pairs": PAIRS})
    assert not trainer.trainer_runs_teacher
    trainer.train()
    assert [len(c) for c in calls] == [1, 1]


# ---------------------------------------------------------------------------------------------- the loss's scale
class ZeroTask(Trainer):
    """A trainer whose own loss is zero: what reaches the backward is the attention term alone."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(**inputs)
        return out.logits.sum() * 0.0


class ZeroTaskKL(Spied, ZeroTask):
    pass


@pytest.mark.parametrize("scaled", [False, True], ids=["trainer-divides", "loss-already-scaled"])
def test_the_term_keeps_its_weight_under_gradient_accumulation(monkeypatch, scaled):
    """Whether ``Trainer.training_step`` divides the loss by the accumulation steps or not (the loss is normalised over
    the accumulated batch already), the backward gets ``weight · KL / steps`` per micro-batch."""
    teacher, student = models_()
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(2, VOCAB, (6,), generator=g)} for _ in range(4)]
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(tmp, max_steps=1, per_device_train_batch_size=1, gradient_accumulation_steps=4,
                                 **QUIET)
        monkeypatch.setattr(ZeroTask, "loss_is_scaled_for_ga", scaled, raising=False)
        trainer = ZeroTaskKL(model=student, args=args, train_dataset=rows, attention_teacher=teacher,
                             attention_kl={"pairs": PAIRS, "weight": 2.0})
        backward = []
        original = trainer.accelerator.backward
        monkeypatch.setattr(trainer.accelerator, "backward", lambda loss, **kw: (backward.append(loss.detach()),
                                                                                  original(loss, **kw))[1])
        trainer.train()
    assert len(backward) == 4
    for loss, terms in zip(backward, trainer.terms):
        torch.testing.assert_close(loss, 2.0 * terms.total.detach() / 4, rtol=1e-9, atol=0)


# ---------------------------------------------------------------------------------------------- errors
def test_errors_name_the_argument(tmp_path):
    teacher, student = models_()
    args = SFTConfig(output_dir=str(tmp_path), max_steps=1, **QUIET)
    with pytest.raises(ValueError, match=r"Expected `attention_teacher` .* SFT has no `teacher_model`"):
        SFT(model=student, args=args, train_dataset=texts(), processing_class=tokenizer(), attention_kl={"pairs": PAIRS})
    with pytest.raises(ValueError, match="`weight`"):
        SFT(model=student, args=args, train_dataset=texts(), processing_class=tokenizer(), attention_teacher=teacher,
            attention_kl={"pairs": PAIRS, "weight": -1.0})
    with pytest.raises(TypeError, match="attention_kl"):
        SFT(model=student, args=args, train_dataset=texts(), processing_class=tokenizer(), attention_teacher=teacher)
    with pytest.raises(ValueError, match="Closest"):
        SFT(model=student, args=args, train_dataset=texts(), processing_class=tokenizer(), attention_teacher=teacher,
            attention_kl={"pairs": [{"teacher": "model.layers.9.self_attn", "student": -1}]})
