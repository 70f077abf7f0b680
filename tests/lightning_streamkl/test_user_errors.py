"""What a new user hit with bad input (issue 34): each case fails with a message that says what happened and what to
do, or works. Shared parameters between teacher and student are refused before the teacher is frozen (they would
otherwise be frozen in the student, silently); the teacher's forward failure names the ids' range and the teacher's
vocabulary; a teacher that is part of the student, a teacher without attention layers and a teacher path with a typo
say so; a ``torch.dtype`` is a valid ``teacher_dtype``; the mixin's term taken twice in a step says so; a
temperature whose reciprocal is not finite in float32 is refused; ``trainer.test()`` says it runs without the
callback; the default student forward of ``distiller(batch)`` passes ``use_cache=False`` like the teacher's."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from lightning_streamkl import AttentionDistillationMixin, StreamKLDistillation, validate_config
from lightning_streamkl.engine import AttentionDistiller, default_student_forward
from lightning_streamkl.teacher import TeacherForwardError, check_teacher_path, looks_like_path, shared_parameters
from streamkl import attention_kl

from ._hf import packed_row
from ._models import CausalLM, loader, tiny_llama, token_batch, trainer

LAST = {"teacher": -1, "student": -1, "name": "last"}


# ---------------------------------------------------------------------------------------------- shared parameters
def _same_size_pair():
    return tiny_llama(seed=0), tiny_llama(seed=1)


def test_a_student_module_taken_from_the_teacher_is_refused_before_anything_is_frozen():
    """The student reuses the teacher's embedding by reference: freezing the teacher froze it in the student."""
    teacher, net = _same_size_pair()
    net.model.embed_tokens = teacher.model.embed_tokens
    student = CausalLM(net)
    cb = StreamKLDistillation(teacher, pairs=[LAST])
    with pytest.raises(ValueError, match=r"The teacher and the student share 1 parameter\(s\): the student's submodule "
                                         r"'model\.model\.embed_tokens' is the teacher's 'model\.embed_tokens' .*"
                                         r"copy\.deepcopy.*load_state_dict"):
        trainer(max_steps=1, callbacks=[cb]).fit(student, loader(4, 4))
    assert net.model.embed_tokens.weight.requires_grad and teacher.model.embed_tokens.weight.requires_grad


def test_a_teacher_module_taken_from_the_student_is_refused_too():
    """The other direction: the teacher holds one of the student's layers."""
    teacher, student = _same_size_pair()
    teacher.model.layers[0].mlp = student.model.layers[0].mlp
    with pytest.raises(ValueError, match=r"share 3 parameter\(s\): the student's submodule 'model\.layers\.0\.mlp' is "
                                         r"the teacher's 'model\.layers\.0\.mlp'"):
        AttentionDistiller(teacher, {"pairs": [LAST]}, student=student)
    assert all(p.requires_grad for p in student.parameters())


def test_shared_storage_is_sharing_and_a_copy_is_not():
    teacher, student = _same_size_pair()
    student.lm_head.weight = nn.Parameter(teacher.lm_head.weight.data)  # a new parameter over the teacher's storage
    assert shared_parameters(teacher, student) == [("lm_head.weight", "lm_head.weight")]
    with pytest.raises(ValueError, match=r"the student's 'lm_head\.weight' is the teacher's 'lm_head\.weight' \(the "
                                         r"same parameter or storage\)"):
        AttentionDistiller(teacher, {"pairs": [LAST]}, student=student)
    # what the message recommends works: a deep copy of the module, or the weights loaded into the student's own
    student.lm_head = copy.deepcopy(teacher.lm_head)
    student.model.embed_tokens.load_state_dict(teacher.model.embed_tokens.state_dict())
    distiller = AttentionDistiller(teacher, {"pairs": [LAST]}, student=student)
    assert not shared_parameters(teacher, student) and distiller.resolved
    assert student.lm_head.weight.requires_grad and not teacher.lm_head.weight.requires_grad


def test_a_teacher_the_lightning_module_holds_whole_is_not_sharing():
    """A LightningModule may hold its teacher as an attribute: the callback freezes it, and that is what is meant."""
    teacher, net = _same_size_pair()
    student = CausalLM(net)
    student.teacher = teacher
    cb = StreamKLDistillation(teacher, pairs=[LAST])
    trainer(max_steps=1, callbacks=[cb]).fit(student, loader(4, 4))
    assert not any(p.requires_grad for p in teacher.parameters()) and all(p.requires_grad for p in net.parameters())


# ---------------------------------------------------------------------------------------------- the teacher itself
def test_a_submodule_of_the_student_as_the_teacher_is_the_teacher_is_part_of_the_student():
    student = CausalLM(tiny_llama(seed=1))
    with pytest.raises(ValueError, match=r"The teacher is part of the student: it is the student's submodule 'model' "
                                         r"\(LlamaForCausalLM\), which holds every parameter of CausalLM.*"
                                         r"copy\.deepcopy"):
        AttentionDistiller(student.model, {"pairs": [LAST]}, student=student)
    assert all(p.requires_grad for p in student.parameters())


def test_a_teacher_inside_the_student_holding_the_paired_layers_says_so():
    """The student has parameters of its own (a head), but every attention layer is in the teacher's subtree."""
    student = CausalLM(tiny_llama(seed=1))
    student.head = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"The teacher is part of the student: it is the student's submodule 'model', "
                                         r"whose layers then count as the teacher's"):
        AttentionDistiller(student.model, {"pairs": [LAST]}, student=student)


def test_a_teacher_the_module_holds_whole_keeps_the_message_of_an_unknown_layer():
    """Holding the teacher is fine: a typo in a student layer is reported as such, not as a teacher inside."""
    teacher, student = tiny_llama(seed=0), CausalLM(tiny_llama(seed=1))
    student.teacher = teacher
    with pytest.raises(ValueError, match=r"^Unknown student layer of pairs\[0\] .*Closest: \['model\.model\.layers\.1"):
        AttentionDistiller(teacher, {"pairs": [{**LAST, "student": "model.model.layers.1.self_atn"}]}, student=student)


def test_a_teacher_without_attention_layers_lists_what_is_supported():
    with pytest.raises(ValueError, match=r"The teacher layer of pairs\[0\] \('last'\) -1 is an index, but no attention "
                                         r"layers were found in Sequential; supported: Hugging Face models .*"
                                         r"nn\.MultiheadAttention.*record"):
        AttentionDistiller(nn.Sequential(nn.Linear(4, 4)), {"pairs": [LAST]}, student=tiny_llama(seed=1))


@pytest.mark.parametrize("name", ["./teachers/llama-typo", "/no/such/teacher", "~/no-such-dir/teacher"])
def test_a_teacher_path_with_a_typo_is_no_such_directory(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "teachers" / "llama").mkdir(parents=True)
    distiller = AttentionDistiller(name, {"pairs": [LAST]})
    with pytest.raises(FileNotFoundError, match=r"Expected `teacher` to be a Hugging Face hub id or a local model "
                                                r"directory, but there is no such directory: " + repr(name)):
        distiller.setup(tiny_llama(seed=1))
    if name.startswith("./"):
        with pytest.raises(FileNotFoundError, match=r"closest entries: \['llama'\]"):
            check_teacher_path(name)
    assert looks_like_path(name) and not looks_like_path("meta-llama/Llama-3.2-1B")


def test_a_teacher_path_to_a_file_says_it_is_a_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="it is a file, not a model directory"):
        check_teacher_path(str(tmp_path / "model.safetensors"))


def test_a_torch_dtype_is_a_teacher_dtype():
    cfg = validate_config({"pairs": [LAST], "teacher_dtype": torch.float64,
                           "teacher_from_pretrained": {"dtype": torch.bfloat16}})
    assert cfg.teacher_dtype == "float64" and cfg.teacher_from_pretrained == {"dtype": "bfloat16"}
    teacher = tiny_llama(seed=0)
    cb = StreamKLDistillation(teacher, pairs=[LAST], teacher_dtype=torch.float64)
    student = CausalLM(tiny_llama(hidden=16, heads=4, kv_heads=1, seed=1, dtype=torch.float64))
    trainer(max_steps=1, callbacks=[cb]).fit(student, loader(4, 4))
    assert {p.dtype for p in teacher.parameters()} == {torch.float64}
    with pytest.raises(ValueError, match=r"Expected `teacher_dtype` to be one of .*, but got 'int8'"):
        validate_config({"pairs": [LAST], "teacher_dtype": torch.int8})


# ---------------------------------------------------------------------------------------------- the teacher's forward
def test_ids_outside_the_teachers_vocabulary_name_the_range_and_the_vocabulary():
    teacher, student = tiny_llama(seed=0), tiny_llama(hidden=16, heads=4, kv_heads=1, seed=1)
    student.resize_token_embeddings(80)  # the student's tokenizer is larger than the teacher's
    distiller = AttentionDistiller(teacher, {"pairs": [LAST]}, student=student)
    batch = token_batch()
    batch["input_ids"][0, 3] = 77
    with pytest.raises(TeacherForwardError, match=r"The teacher's forward failed on this batch \(IndexError: index out "
                                                  r"of range in self\): the batch's token ids range over \[0, 77\], but "
                                                  r"the teacher's vocabulary has 50 tokens \(its input embedding is "
                                                  r"Embedding\(50, 32.*\)\)\. Teacher and student must share one "
                                                  r"tokenizer") as info:
        distiller(batch)
    assert info.value.__cause__ is None and info.value.__suppress_context__  # the message says it all


def test_another_failure_of_the_teachers_forward_says_it_was_the_teacher():
    teacher = tiny_llama(seed=0)
    distiller = AttentionDistiller(teacher, {"pairs": [LAST]}, student=tiny_llama(seed=1),
                                   teacher_forward=lambda m, b: m(b["input_ids"][:, :, None]))
    with pytest.raises(TeacherForwardError, match=r"The teacher's forward failed on this batch \(\w+Error: .*\); the "
                                                  r"traceback above shows where") as info:
        distiller(token_batch())
    assert info.value.__cause__ is not None  # the original traceback is kept


def test_our_own_errors_inside_the_teachers_forward_pass_through_unchanged():
    """A check of ours raised while the teacher runs (a refused layer, a bad option) keeps its own type and message."""
    distiller = AttentionDistiller(tiny_llama(seed=0), {"pairs": [LAST]}, student=tiny_llama(seed=1),
                                   teacher_forward=lambda m, b: validate_config({"pairs": [LAST], "temperature": -1}))
    with pytest.raises(ValueError, match=r"^Expected `temperature` to be a finite number > 0, but got -1\.0\.$"):
        distiller(token_batch())


# ---------------------------------------------------------------------------------------------- the mixin
class _Twice(AttentionDistillationMixin, CausalLM):
    def __init__(self, teacher):
        super().__init__(tiny_llama(hidden=16, heads=4, kv_heads=1, seed=1))
        self.configure_attention_distillation(teacher, pairs=[LAST])

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        return loss + self.attention_distillation_loss() + self.attention_distillation_loss()


def test_the_mixin_term_taken_twice_in_a_step_says_already_taken():
    with pytest.raises(RuntimeError, match=r"attention_distillation_loss\(\) was already taken in this step.*Call it "
                                           r"once per step"):
        trainer(max_steps=1).fit(_Twice(tiny_llama(seed=0)), loader(4, 4))


def test_the_mixin_term_can_be_taken_again_after_the_student_runs_again():
    module = _Twice(tiny_llama(seed=0))
    batch = token_batch()
    for _ in range(2):
        with module.capture_student_attention():
            module.model(**batch)
        assert module.attention_distillation_loss(batch).requires_grad
    with pytest.raises(RuntimeError, match="already taken in this step"):
        module.attention_distillation_loss(batch)


# ---------------------------------------------------------------------------------------------- temperature
@pytest.mark.parametrize("temperature", [1e-38, 1e-40, 5e-324])
def test_a_temperature_below_the_smallest_normal_float32_is_refused(temperature):
    """1e-38 passed "finite and > 0" and gave nan: in float32 it is subnormal and the scaled scores overflow."""
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"Expected argument `temperature` to be finite and > 0, at least "
                                         r"1\.1754944e-38"):
        attention_kl(q, q, q, q, temperature=temperature)
    with pytest.raises(ValueError, match=r"Expected `temperature` to be a finite number >= 1\.17549e-38 \(the smallest "
                                         r"normal float32; the op computes in float32\), but got"):
        validate_config({"pairs": [LAST], "temperature": temperature})
    with pytest.raises(ValueError, match=r"Expected `pairs\[0\]\.temperature` to be a finite number >= 1\.17549e-38"):
        validate_config({"pairs": [{**LAST, "temperature": temperature}]})
    smallest = torch.finfo(torch.float32).tiny
    assert math.isfinite(float(attention_kl(q, q, q, q, temperature=1e-3)))
    validate_config({"pairs": [LAST], "temperature": smallest})


# ---------------------------------------------------------------------------------------------- trainer.test
class _Tested(CausalLM):
    def test_step(self, batch, batch_idx):
        self.log("test/task_loss", self.model(**batch).loss)


def test_trainer_test_says_once_that_it_runs_without_the_callback():
    cb = StreamKLDistillation(tiny_llama(seed=0), pairs=[LAST])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(callbacks=[cb], limit_test_batches=2).test(_Tested(), loader(8, 4))
    said = [str(w.message) for w in caught if "trainer.test()" in str(w.message)]
    assert said == ["StreamKLDistillation ('attn_kl') does not take part in trainer.test(): the teacher does not run "
                    "and nothing is logged under test/attn_kl/. To measure the attention KL on held-out data, pass "
                    "that data to trainer.validate(model, dataloaders=...), which logs val/attn_kl/."]


def test_trainer_test_with_the_mixin_says_so_too():
    class Tested(AttentionDistillationMixin, _Tested):
        def __init__(self, teacher):
            super().__init__()
            self.configure_attention_distillation(teacher, pairs=[LAST])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(limit_test_batches=1).test(Tested(tiny_llama(seed=0)), loader(4, 4))
    assert any("Tested (AttentionDistillationMixin) ('attn_kl') does not take part in trainer.test()" in str(w.message)
               for w in caught)


# ---------------------------------------------------------------------------------------------- the student forward
def test_distiller_batch_works_on_packed_batches():
    """The default student forward passes ``use_cache=False`` as the teacher's does: with a cache, transformers does
    not read packed documents from restarting ``position_ids``, and the student attended across documents."""
    teacher, student = tiny_llama(seed=0, init=0.2), tiny_llama(hidden=16, heads=4, kv_heads=1, seed=1)
    batch, _ = packed_row([5, 7, 4])
    batch["labels"] = batch["input_ids"]
    distiller = AttentionDistiller(teacher, {"pairs": [LAST]}, student=student)
    loss = distiller(batch)
    assert loss.requires_grad and torch.isfinite(loss) and distiller.student_output.loss is not None
    assert distiller.student_output.past_key_values is None


def test_the_default_student_forward_passes_use_cache_false_only_when_the_model_takes_it():
    class Takes(nn.Module):
        def forward(self, input_ids, use_cache=True):
            return use_cache

    class Not(nn.Module):
        def forward(self, input_ids):
            return "ran"

    assert default_student_forward(Takes(), {"input_ids": torch.ones(1)}) is False
    assert default_student_forward(Takes(), {"input_ids": torch.ones(1), "use_cache": True}) is True  # the batch's own
    assert default_student_forward(Not(), {"input_ids": torch.ones(1)}) == "ran"
