"""On one (or two) GPUs: a teacher that lives on another device than the student (its captured queries and keys
travel, not the model), a teacher kept in host memory and streamed one layer at a time, the continual
regulariser's host-memory snapshots, and the synchronisations a distilled step makes. Skipped without CUDA::

    python -m pytest -m gpu tests/lightning_streamkl/test_gpu.py
"""

from __future__ import annotations

import copy
import os
import traceback
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import lightning as L
from torch.utils.data import DataLoader

import lightning_streamkl
from lightning_streamkl import ContinualAttentionRegularizer, StreamKLDistillation

from ._models import VOCAB, loader, tiny_llama
from .test_callback import LAST, Recorder, make_student, make_teacher
from .test_continual import fit
from .test_continual import make_student as continual_student
from .test_ddp_gpu import gpu_trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _kl(teacher_device: str, teacher: torch.nn.Module) -> list[float]:
    rec = Recorder("train/attn_kl/last_step")
    cb = StreamKLDistillation(teacher, pairs=[LAST], teacher_device=teacher_device)
    gpu_trainer(max_steps=2, callbacks=[cb, rec], log_every_n_steps=1).fit(make_student(), loader(8, 4))
    return rec.values["train/attn_kl/last_step"]


@pytest.mark.timeout(300)
def test_a_teacher_on_the_host_sends_its_queries_and_keys_to_the_student():
    teacher = make_teacher()
    on_host = _kl("cpu", teacher)
    assert {p.device.type for p in teacher.parameters()} == {"cpu"}  # the model stayed where it was asked to run
    kept = _kl("keep", teacher)
    assert {p.device.type for p in teacher.parameters()} == {"cpu"}
    moved = _kl("student", teacher)
    assert {str(p.device) for p in teacher.parameters()} == {"cuda:0"}
    assert on_host == pytest.approx(moved, rel=1e-3) and kept == pytest.approx(moved, rel=1e-3)


@pytest.mark.timeout(300)
@pytest.mark.multi_gpu
def test_a_teacher_on_the_second_gpu():
    teacher = make_teacher()
    other = _kl("cuda:1", teacher)
    assert {str(p.device) for p in teacher.parameters()} == {"cuda:1"}
    assert other == pytest.approx(_kl("student", teacher), rel=1e-3)


@pytest.mark.timeout(300)
def test_cpu_offload_keeps_the_snapshot_on_the_host_with_the_same_losses():
    """``snapshot_device="cpu"``: the snapshot stays in (pinned) host memory and its weights are borrowed onto the
    GPU for each forward pass; the losses equal those of a snapshot kept on the GPU. Where the snapshot lives is
    read while the second task trains (after ``fit`` Lightning moves the model, and with it a new snapshot, to the
    host)."""
    from lightning.pytorch import Callback

    class Where(Callback):
        def __init__(self, reg):
            self.reg, self.seen = reg, []

        def on_train_batch_end(self, *args):
            snap = self.reg.snapshots[0]
            self.seen.append([(t.device.type, t.is_pinned()) for t in snap.state_dict().values() if t.numel()])

    losses = {}
    for device in ("same", "cpu"):
        student = continual_student()
        reg = ContinualAttentionRegularizer(snapshot_device=device, weight=2.0)
        fit(student, reg, loader(8, 4, seed=0), max_steps=2, accelerator="gpu")
        where = Where(reg)
        fit(student, reg, loader(8, 4, seed=1), where, max_steps=3, accelerator="gpu")
        losses[device] = student.step_losses
        assert len(where.seen) == 3 and all(where.seen)
        expected = ("cpu", True) if device == "cpu" else ("cuda", False)
        assert all(place == expected for step in where.seen for place in step), (device, where.seen[0][:3])
    assert losses["cpu"] == pytest.approx(losses["same"], rel=1e-5)


@pytest.mark.timeout(300)
def test_an_offloaded_teacher_streams_its_layers_with_the_same_losses():
    """``teacher_device="offload"`` on a GPU: the teacher stays in pinned host memory; during its pass the GPU holds at
    most two of its layers (the next one copied ahead on a side stream while the current one computes); over three
    steps the KD loss equals that of the same teacher resident bitwise (same kernels on the same weights: a copy that
    raced the compute would show here), and so do the student's gradients up to the embedding's backward, whose atomic
    adds differ from run to run by ~1e-7 relative (resident against resident too)."""

    from lightning_streamkl import AttentionDistiller

    def run(device: str):
        teacher = tiny_llama(hidden=512, heads=8, kv_heads=4, layers=8, seed=0, init=0.05, dtype=torch.bfloat16)
        student = tiny_llama(hidden=256, heads=4, kv_heads=2, layers=4, seed=1, init=0.05).cuda()
        pairs = [[1, 0], [3, 1], [5, 2], [7, 3]]
        distiller = AttentionDistiller(teacher, {"pairs": pairs, "teacher_device": device, "head_map": "group"},
                                       student=student)
        layers = list(distiller.teacher_module.model.layers)
        seen = []
        handles = [m.register_forward_pre_hook(lambda *_: seen.append(
            sum(p.is_cuda for layer in layers for p in layer.parameters()) // len(list(layers[0].parameters()))))
            for m in distiller.teacher_module.modules()]
        out = []
        g = torch.Generator().manual_seed(0)
        for _ in range(3):
            ids = torch.randint(1, VOCAB, (2, 2048), generator=g).cuda()
            kd = distiller({"input_ids": ids, "labels": ids})
            kd.backward()
            out.append((kd.detach(), {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}))
            student.zero_grad()
        for handle in handles:
            handle.remove()
        return out, seen, distiller.teacher_module

    resident, held, _ = run("student")
    offloaded, streamed_held, module = run("offload")
    assert max(held) == 8 and max(streamed_held) == 2
    assert all(not p.is_cuda and p.is_pinned() for p in module.parameters())
    for (kd, grads), (want, want_grads) in zip(offloaded, resident):
        assert torch.equal(kd, want)
        assert grads.keys() == want_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want_grads[name], rtol=1e-5, atol=1e-5 * float(grad.abs().max()),
                                       msg=name)


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [0, 0, 2, 1], [3, 2, 1, 0]], ids=str)
def test_streamed_blocks_out_of_list_order_on_a_gpu(order):
    """On CUDA, a block that is not the one copied ahead is borrowed on the compute stream (the copy in flight is
    waited for before it is given back): the output equals the module's on the GPU, and the host tensors are back
    afterwards, also after an error in a block."""
    from lightning_streamkl.teacher import streamed

    from .test_teacher_offload import Blocks

    module = Blocks(order)
    want = copy.deepcopy(module).cuda()(torch.ones(2, 3, device="cuda"))
    for t in (*module.parameters(), *module.buffers()):
        t.data = t.data.pin_memory()
    host = [t.data_ptr() for t in module.parameters()]
    with torch.no_grad(), streamed(module, torch.device("cuda", torch.cuda.current_device())):
        got = module(torch.ones(2, 3, device="cuda"))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert [t.data_ptr() for t in module.parameters()] == host
    handle = module.blocks[order[-1]].register_forward_hook(lambda *_: 1 / 0)
    with pytest.raises(ZeroDivisionError), streamed(module, torch.device("cuda", torch.cuda.current_device())):
        module(torch.ones(2, 3, device="cuda"))
    handle.remove()
    assert [t.data_ptr() for t in module.parameters()] == host and not any(p.is_cuda for p in module.parameters())


#: The folders of the packages whose synchronisations :class:`_OwnSyncs` counts: this package and the op's.
_OURS = tuple(os.path.dirname(m.__file__) + os.sep for m in (lightning_streamkl, __import__("streamkl")))
_TORCH = os.path.dirname(torch.__file__) + os.sep
_WARNINGS = ("warnings.py", "_py_warnings.py")


class _OwnSyncs(L.Callback):
    """Per training step, the host synchronisations made by this package's or the op's code: those whose innermost
    frame outside torch is theirs (torch's sync debug mode; the models' and Lightning's own are not counted)."""

    def __init__(self) -> None:
        self.steps: list[list[str]] = []

    def on_train_batch_start(self, *args) -> None:
        self.steps.append([])
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._note
        torch.cuda.set_sync_debug_mode("warn")

    def on_train_batch_end(self, *args) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self._warnings.__exit__(None, None, None)

    def _note(self, message, *args, **kwargs) -> None:
        if "synchronizing" not in str(message):
            return
        # (the frames of this hook's caller, the warnings module, are not the code that synchronised)
        outside_torch = [f for f in traceback.extract_stack()[:-1]
                         if not f.filename.startswith(_TORCH) and os.path.basename(f.filename) not in _WARNINGS]
        if outside_torch and outside_torch[-1].filename.startswith(_OURS):
            self.steps[-1].append(f"{os.path.basename(outside_torch[-1].filename)}:{outside_torch[-1].lineno} "
                                  f"{outside_torch[-1].name}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("pad", "expected"), [("none", []), ("right", ["describe_allowed"] * 2)],
                         ids=["dense", "right-padded"])
def test_a_distilled_step_synchronises_only_to_read_the_masks(pad, expected):
    """A distilled Lightning step under ``bf16-mixed`` (the callback, two pairs, sdpa, the metric logged): a dense
    batch makes no synchronisation of the package's or the op's own; a padded one reads each model's 4-D mask once
    (every layer of a pass shares it), and the two models' key padding is compared from those reads, on the host.
    The first step, which moves the metric to the GPU, is not counted."""
    from ._models import token_batch

    batch = {**token_batch(3, 40, pad=pad), "labels": token_batch(3, 40, pad=pad)["input_ids"]}
    syncs = _OwnSyncs()
    cb = StreamKLDistillation(make_teacher(), pairs=[{"teacher": 0, "student": 0, "name": "first"}, LAST])
    trainer = gpu_trainer(max_steps=4, precision="bf16-mixed", callbacks=[cb, syncs])
    trainer.fit(make_student(), DataLoader([batch] * 4, batch_size=None))
    assert len(syncs.steps) == 4
    for step in syncs.steps[1:]:
        assert sorted(s.split()[-1] for s in step) == sorted(expected), step


@pytest.mark.timeout(300)
def test_a_packed_step_synchronises_only_in_the_captures():
    """A packed row (documents of 14, 9 and 17 tokens, ``position_ids`` restarting, no attention mask, sdpa) under
    ``bf16-mixed``: the package's own synchronisations are each capture reading its model's block-diagonal mask as
    packed documents (in ``capture/masks.py``), the same with one pair as with two: the loss compares the two models'
    documents from their offsets' host copies, so no pair adds one."""
    lengths = (14, 9, 17)
    ids = torch.randint(1, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone(), "use_cache": False,
             "position_ids": torch.cat([torch.arange(n) for n in lengths])[None]}
    per_step = []
    for pairs in ([LAST], [{"teacher": 0, "student": 0, "name": "first"}, LAST]):
        syncs = _OwnSyncs()
        cb = StreamKLDistillation(make_teacher(), pairs=pairs)
        gpu_trainer(max_steps=3, precision="bf16-mixed", callbacks=[cb, syncs]).fit(
            make_student(), DataLoader([batch] * 3, batch_size=None))
        assert len(syncs.steps) == 3
        for step in syncs.steps[1:]:
            assert any(s.split()[-1] == "_packed_candidate" for s in step), step  # (read as packed documents)
            assert all(s.startswith("masks.py:") for s in step), step
        per_step.append(sorted(syncs.steps[-1]))
    assert per_step[0] == per_step[1], per_step
