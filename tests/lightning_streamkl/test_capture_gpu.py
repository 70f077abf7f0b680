"""On a GPU: the capture under the real flash-attention kernels (2, 3 and 4, each when its package imports:
``flash_attn.flash_attn_interface``, ``flash_attn_interface``, ``flash_attn.cute`` of the ``flash-attn-4`` wheel, the optional extra
``fa4``), and a student compiled with the default ``torch.compile`` backend (inductor), also replayed from CUDA graphs
(``mode="reduce-overhead"``). Skipped without CUDA::

    python -m pytest -m gpu tests/lightning_streamkl/test_capture_gpu.py
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")


from ._hf import distil, packed_row, tiny
from ._models import token_batch
from .test_capture_training import _assert_same, _step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _on_gpu(batch):
    return {k: v.cuda() for k, v in batch.items()}


#: transformers' implementation name -> the module its kernels come from (``flash_attn`` alone does not tell
#: flash-attention 2 from the ``flash-attn-4`` wheel, which installs ``flash_attn.cute`` only)
FLASH = {"flash_attention_2": "flash_attn.flash_attn_interface", "flash_attention_3": "flash_attn_interface",
         "flash_attention_4": "flash_attn.cute"}


def _flash_batch(kind: str) -> dict:
    """A padded batch, a packed row read from restarting ``position_ids``, or the same row with flash-attention's
    ``cu_seq_lens_*`` keys (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``)."""
    if kind == "padded":
        return _on_gpu(token_batch(3, 11, pad="left"))
    batch = _on_gpu(packed_row([6, 3, 7])[0])
    if kind == "cu_seq_lens":
        cu = torch.tensor([0, 6, 9, 16], dtype=torch.int32, device="cuda")
        batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)
    return batch


def _skip_unless_the_model_runs(model, batch: dict, impl: str, kind: str) -> None:
    """Skip where the model itself, with nothing recording, cannot run ``batch`` under ``impl``: a limit of
    transformers' integration of that kernel, which the capture cannot lift (transformers 5.17 hands flash-attn-4's
    varlen kernel the packed row's ``max_length`` read from ``position_ids`` as a tensor, which it refuses)."""
    import transformers

    try:
        with torch.no_grad():
            model(**batch)
    except (ValueError, TypeError, RuntimeError) as err:
        pytest.skip(f"{impl} cannot run a {kind} batch in the model alone (transformers {transformers.__version__}, "
                    f"no capture recording): {type(err).__name__}: {err}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["padded", "position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("impl", list(FLASH))
def test_real_flash_attention_reads_the_same_masks_as_sdpa(impl, kind):
    """Sliding-window (Mistral) models, padded and packed: the capture under the real kernels of ``impl`` gives the
    masks, row counts and KL that it gives under sdpa."""
    pytest.importorskip(FLASH[impl])
    teacher = tiny("mistral", seed=0, hidden=128, heads=4, kv_heads=2, dtype=torch.bfloat16).cuda()
    student = tiny("mistral", seed=1, hidden=64, heads=4, kv_heads=1, dtype=torch.bfloat16).cuda()
    batch = _flash_batch(kind)
    sdpa_batch = {k: v for k, v in batch.items() if not k.startswith(("cu_seq_lens", "max_length"))}
    results = {}
    for name in ("sdpa", impl):
        for model in (teacher, student):
            model.set_attn_implementation(name)  # transformers' own check: the kernels must load
        if name == impl:
            _skip_unless_the_model_runs(teacher, batch, impl, kind)
        out, t_rec, _, _ = distil(teacher, student, batch if name == impl else sdpa_batch, [[0, 0], [-1, -1]])
        assert teacher.config._attn_implementation == name
        results[name] = (out, t_rec["model.layers.0.self_attn"].masking().summary())
    (sdpa, sdpa_masks), (flash, flash_masks) = results["sdpa"], results[impl]
    assert flash_masks == sdpa_masks == ("causal, window (3, 0), key padding" if kind == "padded"
                                         else "causal, window (3, 0), 3 packed sequences")
    # layer 0's queries and keys come before any attention: the same inputs to the op under both implementations
    torch.testing.assert_close(flash.per_pair["t0_s0"], sdpa.per_pair["t0_s0"], rtol=0, atol=0)
    torch.testing.assert_close(flash.per_pair["t-1_s-1"], sdpa.per_pair["t-1_s-1"], rtol=5e-2, atol=1e-3)
    assert torch.equal(flash.rows, sdpa.rows)


@pytest.mark.timeout(600)
def test_inductor_compiled_student_gives_the_same_kl_and_gradients():
    teacher = tiny("llama", seed=0, hidden=64, dtype=torch.float32).cuda()
    student = tiny("llama", seed=1, hidden=32, kv_heads=1, dtype=torch.float32).cuda().train()
    batch = _on_gpu(token_batch(3, 11, pad="right"))
    expected = _step(teacher, copy.deepcopy(student), batch, steps=2)
    torch._dynamo.reset()
    got = _step(teacher, student, batch, forward=torch.compile(student), steps=2)
    _assert_same(got, expected, rtol=1e-4)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("teacher_graphed", [False, True], ids=["student", "student-and-teacher"])
def test_a_student_replayed_from_cuda_graphs_gives_the_same_kl_and_gradients(teacher_graphed):
    """``torch.compile(mode="reduce-overhead")``: from its third step the student's forward and backward replay CUDA
    graphs, so the captured queries and keys live in the graphs' memory pool, which the next replay overwrites. The KL
    of every step, read within the step, and the student's gradients equal the eager student's; so they do with the
    teacher replayed from graphs too (its captures are outputs of another graph of the same pool)."""
    teacher = tiny("llama", seed=0, hidden=64, dtype=torch.float32).cuda()
    student = tiny("llama", seed=1, hidden=32, kv_heads=1, dtype=torch.float32).cuda().train()
    batch = _on_gpu(token_batch(3, 11, pad="right"))
    expected = _step(teacher, copy.deepcopy(student), batch, steps=4)
    torch._dynamo.reset()
    if teacher_graphed:
        teacher = copy.deepcopy(teacher)
        teacher.compile(mode="reduce-overhead")
    got = _step(teacher, student, batch, forward=torch.compile(student, mode="reduce-overhead"), steps=4)
    _assert_same(got, expected, rtol=1e-4)
