"""On a GPU: the capture under the real flash-attention 2 (when ``flash_attn`` imports) and a student compiled with
the default ``torch.compile`` backend (inductor). Skipped without CUDA::

    python -m pytest -m gpu tests/lightning_streamkl/test_capture_gpu.py
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from lightning_streamkl import HFAttentionCapture

from ._hf import distil, packed_row, tiny
from ._models import token_batch
from .test_capture_training import _assert_same, _step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _on_gpu(batch):
    return {k: v.cuda() for k, v in batch.items()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("packed", [False, True])
def test_real_flash_attention_2_reads_the_same_masks_as_sdpa(packed):
    pytest.importorskip("flash_attn")
    teacher = tiny("mistral", seed=0, hidden=128, heads=4, kv_heads=2, dtype=torch.bfloat16).cuda()
    student = tiny("mistral", seed=1, hidden=64, heads=4, kv_heads=1, dtype=torch.bfloat16).cuda()
    batch = _on_gpu(packed_row([6, 3, 7])[0] if packed else token_batch(3, 11, pad="left"))
    results = {}
    for impl in ("sdpa", "flash_attention_2"):
        for model in (teacher, student):
            model.set_attn_implementation(impl)  # transformers' own check: flash_attn must load
        capture = HFAttentionCapture(teacher)
        with torch.no_grad(), capture.recording():
            teacher(**batch, use_cache=False)
            assert teacher.config._attn_implementation == impl
        out, t_rec, _, _ = distil(teacher, student, batch, [[0, 0], [-1, -1]])
        rec = t_rec["model.layers.0.self_attn"]
        results[impl] = (out, rec.masking().summary())
    (sdpa, sdpa_masks), (flash, flash_masks) = results["sdpa"], results["flash_attention_2"]
    assert flash_masks == sdpa_masks == ("causal, window (3, 0), 3 packed sequences" if packed
                                         else "causal, window (3, 0), key padding")
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
