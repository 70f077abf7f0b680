"""``teacher_device="offload"``: the teacher stays in host memory and is streamed to the student's device one block at
a time (:func:`~lightning_streamkl.teacher.streamed`). On the CPU the borrowing is made observable by a
``teacher_dtype`` other than the teacher's own: a borrowed tensor is float64, its host tensor float32."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from lightning_streamkl import AttentionDistiller, validate_config
from lightning_streamkl.teacher import FrozenTeacher, TeacherForwardError, streamed

from ._models import VOCAB, tiny_llama

F64 = torch.float64
LAYERS = 4


def _models():
    teacher = tiny_llama(hidden=32, heads=4, kv_heads=2, layers=LAYERS, seed=0, init=0.3)
    student = tiny_llama(hidden=16, heads=2, kv_heads=1, layers=2, seed=1, init=0.3)
    return teacher, student


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    return {"input_ids": ids, "attention_mask": mask}


class Spy:
    """Which blocks (decoder layers) of ``teacher`` are borrowed (float64) whenever any of its modules starts or
    ends; hooks registered after setup."""

    def __init__(self, teacher: nn.Module) -> None:
        self.layers = list(teacher.model.layers)
        self.seen: list[frozenset[int]] = []
        self.handles = []
        for m in teacher.modules():
            self.handles.append(m.register_forward_pre_hook(lambda *_: self.look()))
            self.handles.append(m.register_forward_hook(lambda *_: self.look()))

    def look(self) -> None:
        self.seen.append(frozenset(i for i, layer in enumerate(self.layers)
                                   if all(p.dtype == F64 for p in layer.parameters())))

    @property
    def ever(self) -> set[int]:
        return set().union(*self.seen)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _host(teacher: nn.Module) -> dict[str, tuple[int, torch.dtype]]:
    return {name: (t.data_ptr(), t.dtype) for name, t in (*teacher.named_parameters(), *teacher.named_buffers())}


def _step(teacher: nn.Module, student: nn.Module, pairs, device: str, **config):
    """One engine step on a copy of ``student``: the KD loss, the student's gradients, the spy and the teacher's
    host tensors before the step."""
    student = copy.deepcopy(student)
    distiller = AttentionDistiller(teacher, {"pairs": pairs, "teacher_device": device, "teacher_dtype": "float64",
                                             "fuse_pairs": False, "head_map": "group", **config},
                                   student=student)
    host = _host(distiller.teacher_module)
    spy = Spy(distiller.teacher_module)
    kd = distiller(_batch())
    spy.remove()
    kd.backward()
    grads = {n: p.grad for n, p in student.named_parameters() if p.grad is not None}
    return kd.detach(), grads, spy, host, distiller


@pytest.mark.parametrize("early_exit", [True, False])
def test_an_offloaded_teacher_borrows_two_blocks_at_most_and_changes_no_loss(early_exit):
    """At most two decoder layers are on the "device" (float64) at any point of the pass; the loss and the student's
    gradients equal those of the same teacher resident; afterwards every teacher tensor is its host tensor again.
    With the early exit, the layers past the deepest paired one are never borrowed (none is copied ahead either);
    without it, every layer is."""
    teacher, student = _models()
    pairs = [[0, 0], [1, 1]]  # the teacher's first two layers: the pass stops after layer 1 of 4
    kd, grads, spy, host, distiller = _step(copy.deepcopy(teacher), student, pairs, "offload",
                                            teacher_early_exit=early_exit)
    want, want_grads, _, _, _ = _step(copy.deepcopy(teacher), student, pairs, "student", teacher_early_exit=early_exit)
    assert max(len(s) for s in spy.seen) == 2
    assert spy.ever == ({0, 1} if early_exit else set(range(LAYERS)))
    torch.testing.assert_close(kd, want, rtol=0, atol=0)
    assert grads.keys() == want_grads.keys() and len(grads) > 0
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=0, atol=0, msg=name)
    assert _host(distiller.teacher_module) == host
    assert {t.dtype for t in distiller.teacher_module.state_dict().values() if t.is_floating_point()} == {torch.float32}
    assert "the teacher is streamed from host memory one block at a time" in distiller.describe()


def test_an_offloaded_teacher_is_cast_once_on_the_host_to_a_narrower_teacher_dtype():
    """An fp32 teacher run in bf16: its host copy is cast to bf16 once, when it is prepared (each pass then copies
    half the bytes), and the step is bitwise the resident teacher's; the host tensors are the same ones after a step
    (nothing is cast again). A wider ``teacher_dtype`` (the float64 of the tests above) leaves the host copy as it
    is."""
    teacher, student = _models()
    pairs = [[0, 0], [1, 1]]
    kd, grads, _, host, distiller = _step(copy.deepcopy(teacher), student, pairs, "offload",
                                          teacher_dtype="bfloat16")
    want, want_grads, _, _, _ = _step(copy.deepcopy(teacher), student, pairs, "student", teacher_dtype="bfloat16")
    floating = {t.dtype for t in distiller.teacher_module.state_dict().values() if t.is_floating_point()}
    assert floating == {torch.bfloat16}
    assert _host(distiller.teacher_module) == host
    torch.testing.assert_close(kd, want, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=0, atol=0, msg=name)


def test_what_lies_outside_the_blocks_is_borrowed_for_the_whole_pass():
    """The embeddings, the final norm and the rotary buffer are float64 whenever a block runs."""
    frozen = FrozenTeacher(_models()[0], dtype="float64", device="offload")
    module = frozen.prepare()
    outside = [module.model.embed_tokens.weight, module.model.norm.weight, module.model.rotary_emb.inv_freq]
    seen = []
    handles = [layer.register_forward_pre_hook(lambda *_: seen.append({t.dtype for t in outside}))
               for layer in module.model.layers]
    with torch.no_grad(), frozen.placed(torch.device("cpu")):
        module(input_ids=_batch()["input_ids"], use_cache=False)
    for handle in handles:
        handle.remove()
    assert seen == [{F64}] * LAYERS
    assert {t.dtype for t in outside} == {torch.float32}


def test_the_output_head_is_borrowed_only_when_it_runs():
    """The untied ``lm_head`` is not borrowed with the rest of what lies outside the blocks: while the layers run it is
    on the host; it is borrowed when it starts (its output is float64), and a pass that never reaches it (an early
    exit; here the base model alone) never copies it."""
    frozen = FrozenTeacher(_models()[0], dtype="float64", device="offload")
    module = frozen.prepare()
    assert module.lm_head.weight is not module.model.embed_tokens.weight
    during, outputs = [], []
    handles = [layer.register_forward_pre_hook(lambda *_: during.append(module.lm_head.weight.dtype))
               for layer in module.model.layers]
    handles.append(module.lm_head.register_forward_hook(lambda m, args, out: outputs.append(out.dtype)))
    ids = _batch()["input_ids"]
    with torch.no_grad(), frozen.placed(torch.device("cpu")):
        logits = module(input_ids=ids, use_cache=False).logits
    assert during == [torch.float32] * LAYERS and outputs == [F64] and logits.dtype == F64
    during.clear()
    with torch.no_grad(), frozen.placed(torch.device("cpu")):
        module.model(input_ids=ids, use_cache=False)
    assert during == [torch.float32] * LAYERS and outputs == [F64]
    for handle in handles:
        handle.remove()
    assert module.lm_head.weight.dtype == torch.float32


def test_an_error_in_the_teachers_forward_leaves_every_tensor_on_the_host():
    """A layer raising while its block runs and the next one is copied ahead: the step fails with the teacher's error,
    every teacher tensor is its host tensor again, and the next step runs normally."""
    teacher, student = _models()
    distiller = AttentionDistiller(teacher, {"pairs": [[-1, -1]], "teacher_device": "offload",
                                             "teacher_dtype": "float64", "head_map": "group"}, student=student)
    module = distiller.teacher_module
    host = _host(module)
    fail = [True]

    def boom(*_):
        if fail[0]:
            raise RuntimeError("boom")

    handle = module.model.layers[1].mlp.register_forward_hook(boom)
    with pytest.raises(TeacherForwardError, match="boom"):
        distiller(_batch())
    assert _host(module) == host
    fail[0] = False
    spy = Spy(module)
    kd = distiller(_batch())
    spy.remove()
    handle.remove()
    assert kd.isfinite() and max(len(s) for s in spy.seen) == 2 and _host(module) == host


class Blocks(nn.Module):
    """A module list run in a given order (blocks may repeat)."""

    def __init__(self, order: list[int]) -> None:
        super().__init__()
        self.order = order
        self.embed = nn.Linear(3, 4)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for i in self.order:
            x = self.blocks[i](x)
        return x


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [0, 0, 2, 1], [3, 2, 1, 0], [1, 3]], ids=str)
def test_blocks_out_of_list_order_or_run_twice_give_the_same_output(order):
    """A block that is not the one copied ahead is borrowed when it starts (the other given back): the output is
    the whole module's in float64, never more than two blocks are borrowed, and only the blocks that run (and the
    next one in list order) ever are."""
    torch.manual_seed(0)
    module = Blocks(order)
    x = torch.randn(2, 3, dtype=F64)
    want = copy.deepcopy(module).to(F64)(x)
    held = []
    handles = [m.register_forward_pre_hook(lambda *_: held.append(
        {i for i, b in enumerate(module.blocks) if b[0].weight.dtype == F64})) for m in module.modules()]
    with torch.no_grad(), streamed(module, torch.device("cpu"), F64):
        got = module(x)
    for handle in handles:
        handle.remove()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert max(len(h) for h in held) <= 2
    assert set().union(*held) <= set(order) | {0} | {i + 1 for i in order if i + 1 < 4}
    assert {p.dtype for p in module.parameters()} == {torch.float32}


def test_a_module_without_blocks_is_borrowed_whole():
    layer = nn.Linear(2, 2)
    with streamed(layer, torch.device("cpu"), F64):
        assert layer.weight.dtype == F64 and layer(torch.ones(1, 2, dtype=F64)).dtype == F64
    assert layer.weight.dtype == torch.float32


def test_the_config_names_offload_and_the_engine_refuses_what_contradicts_it():
    assert validate_config({"pairs": [[0, 0]], "teacher_device": "offload"}).teacher_device == "offload"
    with pytest.raises(ValueError, match=r"Expected `teacher_device` to be one of \('student', 'keep', 'offload'\) or a "
                                         r"torch device such as 'cpu' or 'cuda:1', but got 'offlaod'"):
        validate_config({"pairs": [[0, 0]], "teacher_device": "offlaod"})
    teacher, student = _models()
    distiller = AttentionDistiller(teacher, {"pairs": [[-1, -1]], "teacher_device": "offload"}, student=student)
    distiller.clear()
    with pytest.raises(ValueError, match=r"Expected the engine to run a teacher with teacher_device='offload'"), \
            distiller.teacher_recording():
        pass
