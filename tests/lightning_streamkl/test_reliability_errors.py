"""Misconfigurations the callback meets at run time: a teacher on another device or dtype, a teacher without data.
The strategies it refuses (DeepSpeed, XLA's FSDP, tensor parallelism) are tested in test_fsdp.py. Unknown layers and
paired layers with different N are tested in test_callback.py (``test_unknown_layer_path_fails_in_setup_with_close_matches``,
``test_mismatched_sequence_lengths_fail_with_both_shapes``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from lightning_streamkl import StreamKLDistillation

from ._models import CausalLM, loader, tiny_llama, trainer
from .test_callback import LAST, Recorder, make_student, make_teacher


def test_a_teacher_partly_elsewhere_is_moved_whole():
    """The teacher used to be placed by looking at its first parameter only: a teacher whose first tensors were
    already on the requested device/dtype and the rest not was left as it was, and its forward failed with a dtype
    (or device) mismatch inside the model. On CPU a partly cast teacher shows it; test_ddp_gpu.py moves a teacher
    that is partly on the GPU."""
    teacher = make_teacher()
    teacher.model.embed_tokens.to(torch.float64)  # the first parameter already has the requested dtype
    student = CausalLM(tiny_llama(hidden=16, heads=4, kv_heads=1, seed=1, dtype=torch.float64))
    rec = Recorder("train/attn_kl/last_step")
    cb = StreamKLDistillation(teacher, pairs=[LAST], teacher_dtype="float64")
    trainer(max_steps=1, callbacks=[cb, rec], log_every_n_steps=1).fit(student, loader(4, 4))
    assert {p.dtype for p in teacher.parameters()} == {torch.float64} and rec.values["train/attn_kl/last_step"][0] > 0


def test_a_teacher_without_data_fails_in_setup():
    with torch.device("meta"):
        teacher = make_teacher()
    cb = StreamKLDistillation(teacher, pairs=[LAST])
    with pytest.raises(ValueError, match=r"The teacher has \d+ parameters/buffers on the meta device \(no data\), e\.g\. "
                                         r"'model.embed_tokens.weight'; load or materialise its weights"):
        trainer(max_steps=1, callbacks=[cb]).fit(make_student(), loader(4, 4))
