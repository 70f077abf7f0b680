"""The Lightning-free engine: plain PyTorch use, a teacher that costs what it must (stops after the deepest paired
layer, keeps its dtype, loads by name with from_pretrained options), and a teacher fed what its live counterpart
receives. Tiny Hugging Face models built from configs (no downloads)."""

from __future__ import annotations

import copy
import weakref
from typing import ClassVar

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from lightning_streamkl import AttentionDistiller, StreamKLDistillation, uniform_pairs
from lightning_streamkl import teacher as teacher_module
from lightning_streamkl.loss import LossStream
from streamkl import attention_kl

from ._models import VOCAB, CausalLM, loader, tiny_llama, trainer
from .test_callback import LAST, Recorder, make_student, make_teacher, manual_kl


def test_plain_pytorch_step_equals_the_manual_kl():
    teacher, student = make_teacher(), make_student().model
    batch = next(iter(loader(4, 4)))
    distiller = AttentionDistiller(teacher, {"pairs": [LAST], "weight": 0.5})
    assert distiller.setup(student) == [("model.layers.1.self_attn", "model.layers.1.self_attn")]
    distiller.begin_step(batch)
    with distiller.student_recording():
        task = student(**batch).loss
    terms = distiller.end_step(batch)
    _, expected = manual_kl(teacher, copy.deepcopy(student), batch, "model.layers.1.self_attn",
                            "model.layers.1.self_attn")
    torch.testing.assert_close(terms.per_pair["last"], expected)
    (task + distiller.weight_at(0) * terms.total).backward()
    assert student.model.layers[1].self_attn.q_proj.weight.grad is not None
    assert distiller.teacher_capture.records == {} and distiller.student_capture.records == {}


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_each_pair_is_taken_while_the_teacher_runs(backend, monkeypatch):
    """The teacher runs after the student's forward pass, and each pair's loss runs as soon as its teacher layer has
    recorded: when the teacher's deepest paired layer starts, the first pair's records are gone from both captures,
    and with the fused op (a frozen teacher, a reduced loss) nothing holds that pair's teacher queries any more (the
    op kept only the student's gradients). The loss and the student's gradients equal the whole loss taken from every
    record at the end."""
    if backend == "triton":
        pytest.importorskip("triton")
    teacher = tiny_llama(hidden=32, heads=4, kv_heads=2, layers=4, seed=0, init=0.3)
    student = tiny_llama(hidden=16, heads=2, kv_heads=1, layers=2, seed=1, init=0.3)
    config = {"pairs": uniform_pairs(teacher, student, head_map="group"), "backend": backend, "fuse_pairs": False}
    batch = {"input_ids": torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))}
    first_t, first_s = "model.layers.1.self_attn", "model.layers.0.self_attn"
    teacher_queries: dict[str, weakref.ref] = {}
    add = LossStream.add
    monkeypatch.setattr(LossStream, "add", lambda self, layer, record, students: (
        teacher_queries.setdefault(layer, weakref.ref(record.q)), add(self, layer, record, students))[1])
    seen = {}

    def at_the_deepest_layer(*_):
        seen["teacher records"] = set(distiller.teacher_capture.records)
        seen["student records"] = set(distiller.student_capture.records)
        seen["first teacher queries alive"] = teacher_queries[first_t]() is not None

    teacher.model.layers[3].register_forward_pre_hook(at_the_deepest_layer)
    distiller = AttentionDistiller(teacher, config, student=student)
    whole_student = copy.deepcopy(student)
    distiller.begin_step(batch)
    with distiller.student_recording():
        task = student(**batch).logits.square().mean()
    terms = distiller.end_step(batch)
    (task + terms.total).backward()
    assert seen["teacher records"] == set() and seen["student records"] == {"model.layers.1.self_attn"}
    assert seen["first teacher queries alive"] is (backend == "reference")  # the reference saves its inputs

    whole = AttentionDistiller(teacher, config, student=whole_student)
    whole.begin_step(batch)
    with whole.student_recording():
        whole_task = whole_student(**batch).logits.square().mean()
    whole.run_teacher(batch)  # every record first, then the loss from all of them
    assert set(whole.teacher_capture.records) == {first_t, "model.layers.3.self_attn"}
    expected = whole.compute(batch)
    (whole_task + expected.total).backward()
    torch.testing.assert_close(terms.total, expected.total)
    assert terms.per_pair.keys() == expected.per_pair.keys() and first_s in distiller.resolved[0]
    for (name, p), q in zip(student.named_parameters(), whole_student.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def _counting(model: nn.Module, names: list[str]) -> dict[str, int]:
    calls = dict.fromkeys(names, 0)
    for name in names:
        model.get_submodule(name).register_forward_pre_hook(lambda *_, n=name: calls.__setitem__(n, calls[n] + 1))
    return calls


def test_a_teacher_layer_that_never_runs_is_named_with_the_layers_that_did():
    """A paired teacher layer that does not run on the batch: the error lists the layers that did record, also those
    whose pairs were already taken during the teacher's pass (their records are gone by then)."""
    teacher, student = make_teacher(), make_student().model
    distiller = AttentionDistiller(teacher, {"pairs": [[0, 0], [1, 1]]}, student=student)
    teacher.model.layers[1].forward = lambda hidden_states, *args, **kwargs: hidden_states  # skips its attention
    batch = next(iter(loader(4, 4)))
    distiller.begin_step(batch)
    with distiller.student_recording():
        student(**batch)
    with pytest.raises(RuntimeError, match=r"teacher layer 'model.layers.1.self_attn' was not recorded .*recorded: "
                                           r"\['model.layers.0.self_attn'\]\)"):
        distiller.end_step(batch)
    assert distiller.teacher_capture.records == {} and distiller.student_capture.records == {}


@pytest.mark.parametrize("pair", [{"teacher": 1, "student": -1, "name": "mid"}, {"teacher": 0, "student": 0}])
def test_the_teacher_stops_after_the_deepest_paired_layer(pair):
    """The teacher ran every layer and its LM head on every batch (at 16k tokens and a 128k vocabulary the logits
    alone are 4 GiB in bf16). Its forward pass now stops once the paired layers are captured, inside the nested
    attention module of a Hugging Face model, and the KL is the full teacher's."""
    teacher = tiny_llama(hidden=32, heads=4, kv_heads=2, layers=4, seed=0, init=0.3)
    later = [f"model.layers.{i}" for i in range(pair["teacher"] + 1, 4)]
    calls = _counting(teacher, ["lm_head", "model.norm", *later, f"model.layers.{pair['teacher']}"])
    student = make_student(seed=1)
    values = {}
    for early_exit in (True, False):
        rec = Recorder("train/attn_kl/total_step")
        cb = StreamKLDistillation(teacher, pairs=[pair], teacher_early_exit=early_exit)
        calls.update(dict.fromkeys(calls, 0))
        trainer(max_steps=2, callbacks=[cb, rec], log_every_n_steps=1).fit(copy.deepcopy(student), loader(8, 4))
        values[early_exit] = rec.values["train/attn_kl/total_step"]
        if early_exit:
            assert calls[f"model.layers.{pair['teacher']}"] == 2  # the paired layer ran, once per step
            assert all(calls[name] == 0 for name in ["lm_head", "model.norm", *later]), calls
        else:
            assert calls["lm_head"] == 2
    assert values[True] == pytest.approx(values[False], rel=1e-6)


def test_a_stopped_teacher_leaves_no_activation_alive(monkeypatch):
    """On an H100 (Python 3.12) the early-exit step peaked at 2.9x the plain step's memory where the full teacher
    peaked at 1.1x: the stopped frames, and the residual stream and layer inputs they held, outlived the teacher's
    pass. Even when something keeps the exception object, the stopped frames are now cleared, so nothing that only
    the teacher's forward pass held survives it (only the captured queries and keys do)."""
    kept: list[BaseException] = []

    class KeptDone(teacher_module._TeacherDone):  # a holder of the exception, as seen on the GPU machine
        def __init__(self, *args: object) -> None:
            super().__init__(*args)
            kept.append(self)

    monkeypatch.setattr(teacher_module, "_TeacherDone", KeptDone)
    teacher = tiny_llama(hidden=32, heads=4, kv_heads=2, layers=4, seed=0, init=0.3)
    alive: list[weakref.ref] = []
    for layer in teacher.model.layers:  # every decoder layer's input: the residual stream at that depth
        layer.register_forward_pre_hook(lambda _m, args, kwargs: alive.append(weakref.ref(args[0])) if args else
                                        alive.append(weakref.ref(kwargs["hidden_states"])), with_kwargs=True)
    distiller = AttentionDistiller(teacher, {"pairs": [{"teacher": 1, "student": 0}]})
    distiller.setup(make_student(seed=1))
    distiller.run_teacher({"input_ids": torch.randint(0, VOCAB, (2, 8))})
    assert kept, "the teacher did not stop early"
    assert len(alive) == 2 and all(ref() is None for ref in alive)
    assert distiller.teacher_capture.records  # what the step needs is still there


def test_a_teacher_by_name_takes_from_pretrained_options(tmp_path):
    make_teacher().save_pretrained(tmp_path / "teacher")
    cb = StreamKLDistillation(str(tmp_path / "teacher"), pairs=[LAST],
                              teacher_from_pretrained={"dtype": "bfloat16", "attn_implementation": "eager"})
    rec = Recorder("train/attn_kl/last_step")
    trainer(max_steps=1, callbacks=[cb, rec], log_every_n_steps=1).fit(make_student(), loader(4, 4))
    assert {p.dtype for p in cb.teacher.parameters()} == {torch.bfloat16}  # kept: teacher_dtype="auto"
    assert cb.teacher.config._attn_implementation == "eager" and rec.values["train/attn_kl/last_step"][0] > 0


class EmbeddedLM(CausalLM):
    """A LightningModule that embeds the tokens itself and runs the decoder on ``inputs_embeds``."""

    def __init__(self) -> None:
        super().__init__(tiny_llama(hidden=32, heads=4, kv_heads=2, layers=2, seed=3, init=0.3), lr=0.0)
        self.embed = nn.Embedding(50, 32)

    def training_step(self, batch, batch_idx):
        hidden = self.model.model(inputs_embeds=self.embed(batch["input_ids"]) * 3.0,
                                  attention_mask=batch["attention_mask"]).last_hidden_state
        loss = hidden.pow(2).mean()
        self.task_losses.append(float(loss.detach()))
        return loss


@pytest.mark.parametrize("teacher_inputs", ["auto", "model.model"])
def test_a_teacher_that_is_a_copy_of_the_student_gets_its_inputs(teacher_inputs):
    """A teacher that is a copy of a student submodule is fed exactly what that submodule receives in the step
    (``teacher_inputs``, detected with "auto"), not the batch: at lr = 0 the KL is 0."""
    student = EmbeddedLM()
    teacher = copy.deepcopy(student.model.model)
    rec = Recorder("train/attn_kl/last_step")
    cb = StreamKLDistillation(teacher, pairs=[LAST], teacher_inputs=teacher_inputs)
    trainer(max_steps=2, callbacks=[cb, rec], log_every_n_steps=1).fit(student, loader(8, 4))
    assert cb.distiller.inputs_from == "model.model"
    assert max(rec.values["train/attn_kl/last_step"]) <= 1e-6
    fed_the_batch = StreamKLDistillation(teacher, pairs=[LAST], teacher_inputs="batch")
    rec = Recorder("train/attn_kl/last_step")
    trainer(max_steps=1, callbacks=[fed_the_batch, rec], log_every_n_steps=1).fit(EmbeddedLM(), loader(4, 4))
    assert rec.values["train/attn_kl/last_step"][0] > 1e-3  # what the batch gives the teacher is not what the student saw


def test_a_teacher_fed_a_submodule_that_did_not_run_fails_clearly():
    cb = StreamKLDistillation(make_teacher(), pairs=[LAST], teacher_inputs="model.lm_head")
    with pytest.raises(RuntimeError, match=r"fed the inputs of the student's Linear, but it did not run during this step"):
        trainer(max_steps=1, callbacks=[cb]).fit(HeadlessLM(), loader(4, 4))
    with pytest.raises(ValueError, match=r"Expected `teacher_inputs` to be 'auto', 'batch' or a submodule of CausalLM, "
                                         r"but it has no 'modle'\. Closest: \['model'"):
        trainer(max_steps=1, callbacks=[StreamKLDistillation(make_teacher(), pairs=[LAST], teacher_inputs="modle")]).fit(
            make_student(), loader(4, 4))


class HeadlessLM(CausalLM):
    def training_step(self, batch, batch_idx):
        return self.model.model(**{k: v for k, v in batch.items() if k != "labels"}).last_hidden_state.pow(2).mean()


def test_default_pair_names_are_short_in_the_logs():
    rec = Recorder("train/attn_kl/t1_s1_step", "train/attn_kl/t0_s0_step")
    cb = StreamKLDistillation(make_teacher(), pairs=[["model.layers.1.self_attn", "model.model.layers.1.self_attn"],
                                                     ["model.layers.0.self_attn", 0]])
    trainer(max_steps=1, callbacks=[cb, rec], log_every_n_steps=1).fit(make_student(), loader(4, 4))
    assert cb.distiller.loss.pair_names == ["t1_s1", "t0_s0"] and all(v[0] > 0 for v in rec.values.values())


def test_kl_of_a_bf16_teacher_on_an_fp32_student_matches_the_op():
    """Teacher and student dtypes may differ: the op takes each side in its own dtype."""
    teacher, student = make_teacher(dtype=torch.bfloat16), make_student().model
    batch = next(iter(loader(4, 4)))
    distiller = AttentionDistiller(teacher, {"pairs": [LAST]})
    distiller.setup(student)
    distiller.begin_step(batch)
    with distiller.student_recording():
        student(**batch)
    s = distiller.student_capture.records["model.layers.1.self_attn"]
    got = distiller.end_step(batch).per_pair["last"]
    distiller.run_teacher(batch)  # again, to read its record (the step's is released as its loss is taken)
    t = distiller.teacher_capture.records["model.layers.1.self_attn"]
    assert t.q.dtype == torch.bfloat16 and s.q.dtype == torch.float32
    mask = batch["attention_mask"].bool()
    expected = attention_kl(t.q, t.k, s.q, s.k, causal=True, scale_t=t.scale, scale_s=s.scale,
                            key_padding_mask=mask, query_mask=mask)
    torch.testing.assert_close(got, expected)


def test_a_teacher_spread_with_device_map_is_never_moved(monkeypatch):
    """A model dispatched over devices with ``device_map`` (``hf_device_map``) stays where it is, whatever
    ``teacher_device`` says, and its inputs go to the device of its first tensor; any other teacher is moved."""
    from lightning_streamkl.teacher import FrozenTeacher

    def refuse(*args, **kwargs):
        raise AssertionError("moved")

    for spread in (True, False):
        teacher = make_teacher()
        if spread:
            teacher.hf_device_map = {"": "cpu"}
        monkeypatch.setattr(teacher, "to", refuse)
        frozen = FrozenTeacher(teacher, device="student")
        frozen.prepare()
        if spread:
            with frozen.placed(torch.device("meta")) as device:
                assert device == torch.device("cpu")
        else:
            with pytest.raises(AssertionError, match="moved"), frozen.placed(torch.device("meta")):
                pass


def test_from_pretrained_options_reach_the_loader_in_the_mixin_and_the_engine(tmp_path):
    from lightning_streamkl import AttentionDistillationMixin, AttentionDistiller

    make_teacher().save_pretrained(tmp_path / "teacher")
    options = {"dtype": "float64", "attn_implementation": "eager", "local_files_only": True}
    engine = AttentionDistiller(str(tmp_path / "teacher"), {"pairs": [LAST], "teacher_from_pretrained": options},
                                student=make_student())

    class Mixed(AttentionDistillationMixin, type(make_student())):
        def __init__(self):
            super().__init__(tiny_llama(hidden=16, heads=4, kv_heads=1, layers=2, seed=1))
            self.configure_attention_distillation(str(tmp_path / "teacher"), pairs=[LAST],
                                                  teacher_from_pretrained=options)

    mixed = Mixed()
    mixed._streamkl_ready()
    for teacher in (engine.teacher_module, mixed._streamkl.teacher_module):
        assert {p.dtype for p in teacher.parameters()} == {torch.float64}
        assert teacher.config._attn_implementation == "eager"


def test_default_forwards_pass_packed_keys_to_models_and_every_key_to_wrappers():
    """A model whose forward takes **kwargs gets the packed-sequence keys besides its named ones; a wrapper
    (forward(*args, **kwargs), PEFT's PeftModel) naming none of the keys gets every key; labels only to the student;
    ``use_cache=False`` to both (issue 34: the student's cache kept transformers from reading packed documents)."""
    from lightning_streamkl.engine import PACKED_SEQUENCE_KEYS, default_student_forward, default_teacher_forward

    class Model(nn.Module):
        def forward(self, input_ids, labels=None, use_cache=None, **kwargs):
            return {"input_ids": input_ids, "labels": labels, "use_cache": use_cache, **kwargs}

    class Wrapper(nn.Module):
        def forward(self, *args, **kwargs):
            return kwargs

    batch = {"input_ids": 1, "labels": 2, "other": 3, **{k: 4 for k in PACKED_SEQUENCE_KEYS}}
    teacher_seen = default_teacher_forward(Model(), batch)
    assert teacher_seen["labels"] is None and teacher_seen["use_cache"] is False and "other" not in teacher_seen
    assert all(teacher_seen[k] == 4 for k in PACKED_SEQUENCE_KEYS)
    student_seen = default_student_forward(Model(), batch)
    assert student_seen["labels"] == 2 and student_seen["use_cache"] is False
    assert all(student_seen[k] == 4 for k in PACKED_SEQUENCE_KEYS)
    assert default_teacher_forward(Wrapper(), batch) == {k: v for k, v in batch.items() if k != "labels"}
    assert default_student_forward(Wrapper(), batch) == batch


def test_placing_the_teacher_lists_its_tensors_once_and_still_sees_a_move(monkeypatch):
    """Each pass checks that every teacher tensor is where (and in the dtype) it should be. Walking the modules for
    that cost milliseconds per step at BERT-base size; the tensors are listed once, and a teacher someone else moved
    or cast between passes (the parameters keep their objects, buffers are replaced) is still put back."""
    from lightning_streamkl.teacher import FrozenTeacher

    module = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    frozen = FrozenTeacher(module, dtype="float64")
    frozen.prepare()
    walks = []
    original = nn.Module.named_modules

    def counting(self, *args, **kwargs):
        if self is module:
            walks.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "named_modules", counting)
    for _ in range(3):
        with frozen.placed(torch.device("cpu")):
            assert module[0].weight.dtype == torch.float64 and module[1].running_mean.dtype == torch.float64
    first = len(walks)
    for _ in range(3):
        with frozen.placed(torch.device("cpu")):
            pass
    assert len(walks) == first  # no walk once the tensors are listed and in place
    module.float()  # cast behind the teacher's back: parameters keep their objects, buffers are new tensors
    with frozen.placed(torch.device("cpu")):
        assert module[0].weight.dtype == torch.float64 and module[1].running_mean.dtype == torch.float64
    module[1].running_var = torch.ones(3)  # a new float32 buffer object, then a cast of the parameters
    module[0].float()
    with frozen.placed(torch.device("cpu")):
        assert module[1].running_var.dtype == torch.float64 and module[0].weight.dtype == torch.float64


def test_a_models_forward_signature_is_read_once_per_function(monkeypatch):
    """Host time: ``inspect.signature(model.forward)`` ran on every pass of both models (a hundred microseconds or
    more each). It is read once per forward function; a forward replaced on the instance (a hook's partial) is read
    every time, so it always matches what runs, and both get the batch keys they name."""
    import functools
    import inspect

    from lightning_streamkl.engine import default_student_forward, default_teacher_forward

    class Model(nn.Module):
        def forward(self, input_ids, attention_mask=None, labels=None, use_cache=True):
            return {"ids": input_ids, "mask": attention_mask, "labels": labels, "use_cache": use_cache}

    reads = []
    original = inspect.signature

    def counting(fn, *args, **kwargs):
        reads.append(fn)
        return original(fn, *args, **kwargs)

    monkeypatch.setattr(inspect, "signature", counting)
    batch = {"input_ids": torch.ones(2, 3), "attention_mask": torch.ones(2, 3), "labels": torch.zeros(2, 3), "x": 1}
    a, b = Model(), Model()
    for _ in range(3):
        out = default_teacher_forward(a, batch)
        assert out["labels"] is None and out["use_cache"] is False and out["mask"] is batch["attention_mask"]
        assert default_student_forward(b, batch)["labels"] is batch["labels"]
    assert len(reads) == 1
    b.forward = functools.partial(lambda self, input_ids: {"only": input_ids}, b)
    assert default_student_forward(b, batch) == {"only": batch["input_ids"]}
    assert len(reads) == 2


class _MoveSpy(torch.Tensor):
    """A tensor that notes the ``non_blocking`` of every ``.to`` it gets."""

    moves: ClassVar[list[tuple[str, bool]]] = []

    def to(self, *args, **kwargs):
        _MoveSpy.moves.append((str(args[0] if args else kwargs.get("device")), kwargs.get("non_blocking", False)))
        return super().to(*args, **kwargs)


def test_copies_to_the_host_complete_before_they_are_read():
    """A copy to an accelerator does not wait, one to the host does: an asynchronous copy from a GPU returns a host
    tensor whose contents are undefined until the device is synchronised (a teacher kept on the host read token ids
    that had not arrived: an embedding's index error, seen in the GPU suite). Every copy of a batch, a capture or a
    mask goes through :func:`lightning_streamkl.transfer.to_device`."""
    from lightning_streamkl.transfer import to_device

    _MoveSpy.moves.clear()
    batch = {"input_ids": torch.arange(4).as_subclass(_MoveSpy), "nested": [torch.ones(2).as_subclass(_MoveSpy)]}
    to_device(batch, torch.device("cpu"))
    to_device(batch, "meta")  # (an accelerator's kind of device, without one)
    assert _MoveSpy.moves == [("cpu", False)] * 2 + [("meta", True)] * 2
