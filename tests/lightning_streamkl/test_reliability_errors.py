"""Misconfigurations the callback meets at run time: a teacher on another device or dtype, a teacher without data,
sharded strategies (with Lightning's real strategy classes). Unknown layers and paired layers with different N are
tested in test_callback.py (``test_unknown_layer_path_fails_in_setup_with_close_matches``,
``test_mismatched_sequence_lengths_fail_with_both_shapes``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException

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


def test_model_parallel_strategy_is_rejected_in_a_real_run():
    student = make_student()
    cb = StreamKLDistillation(make_teacher(), pairs=[LAST])
    t = trainer(max_steps=1, strategy=ModelParallelStrategy(), callbacks=[cb])
    try:
        with pytest.raises(MisconfigurationException, match=r"does not support the ModelParallelStrategy strategy "
                                                            r"\(the teacher is not sharded.*use 'ddp' or a single device"):
            t.fit(student, loader(4, 4))
    finally:
        if torch.distributed.is_initialized():  # the strategy set up a 1-process gloo group in this process
            torch.distributed.destroy_process_group()
    assert "training_step" not in student.__dict__


def test_fsdp_and_deepspeed_strategies_are_rejected():
    """Lightning's FSDPStrategy needs CUDA to run, so on CPU the real strategy object is handed to ``setup``;
    test_ddp_gpu.py rejects it in a real 2-GPU run. DeepSpeed is not installed here, so its strategy cannot be
    constructed: an instance of Lightning's real DeepSpeedStrategy class is made without its __init__."""
    deepspeed = DeepSpeedStrategy.__new__(DeepSpeedStrategy)
    for strategy in (FSDPStrategy(), type("MyFSDP", (FSDPStrategy,), {})(), deepspeed):  # subclasses too
        cb = StreamKLDistillation(make_teacher(), pairs=[LAST])
        name = type(strategy).__name__
        with pytest.raises(MisconfigurationException, match=f"does not support the {name} strategy"):
            cb.setup(SimpleNamespace(strategy=strategy), make_student(), "fit")
