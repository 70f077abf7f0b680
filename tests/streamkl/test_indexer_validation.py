"""Every input error of indexer_kl names the argument, what was expected and what was given."""

from __future__ import annotations

import math

import pytest
import torch

from streamkl import indexer_kl, naive_indexer_kl


def _inputs(b=2, h=4, h_kv=2, n=8, d=16, h_i=3, d_i=8):
    return dict(q=torch.randn(b, h, n, d), k=torch.randn(b, h_kv, n, d), q_idx=torch.randn(b, h_i, n, d_i),
                k_idx=torch.randn(b, n, d_i), w_idx=torch.randn(b, n, h_i))


def _with(**changes):
    return lambda x: {**x, **{n: f(x) for n, f in changes.items()}}


@pytest.mark.parametrize(
    ("mutate", "error", "match"),
    [
        (_with(q=lambda x: x["q"][0]), ValueError, r"`q` to be a 4-D tensor \[B, H, N, D\], but got shape \(4, 8, 16\)"),
        (_with(k_idx=lambda x: x["k_idx"][None]), ValueError, r"`k_idx` to be a 3-D tensor \[B, N_k, D_I\], but got shape \(1, 2, 8, 8\)"),
        (_with(w_idx=lambda x: x["w_idx"].long()), TypeError, r"`w_idx` to have a floating dtype .* but got torch.int64"),
        (_with(q_idx=lambda x: x["q_idx"].numpy()), TypeError, r"`q_idx` to be a torch.Tensor, but got ndarray"),
        (_with(k=lambda x: x["k"][..., :15]), ValueError, r"`q` and `k` to share the head dim D, but got 16 and 15"),
        (_with(k=lambda x: x["k"][:1]), ValueError, r"same batch size B=2 for all inputs, but got layout 'bhnd': q=\(2, 4, 8, 16\), k=\(1, 2, 8, 16\)"),
        (_with(k=lambda x: torch.randn(2, 3, 8, 16)), ValueError, r"H=4 of `q` to be divisible by the key heads H_kv=3"),
        (_with(q_idx=lambda x: x["q_idx"][:, :, :5]), ValueError, r"`q_idx` to have N_q=8 query positions like `q`"),
        (_with(k_idx=lambda x: x["k_idx"][:, :5]), ValueError, r"`k_idx` to have shape \[B, N_k, D_I\] = \(2, 8, 8\), but got \(2, 5, 8\)"),
        (_with(k_idx=lambda x: x["k_idx"][..., :4]), ValueError, r"`k_idx` to have shape \[B, N_k, D_I\] = \(2, 8, 8\), but got \(2, 8, 4\)"),
        (_with(w_idx=lambda x: x["w_idx"][..., :2]), ValueError, r"`w_idx` to have shape \[B, N_q, H_I\] = \(2, 8, 3\), but got \(2, 8, 2\)"),
        (_with(k=lambda x: x["k"].double()), TypeError, r"`q` and `k` to have the same dtype, but got torch.float32 and torch.float64"),
        (_with(k_idx=lambda x: x["k_idx"].half()), TypeError, r"`q_idx` and `k_idx` to have the same dtype, but got torch.float32 and torch.float16"),
        (_with(lse=lambda x: torch.zeros(2, 4, 7)), ValueError, r"`lse` to have shape \[B, H, N_q\] \(the layout does not apply to it\) = \(2, 4, 8\), but got \(2, 4, 7\)"),
        (_with(lse=lambda x: torch.zeros(2, 4, 8, dtype=torch.int32)), TypeError, r"`lse` to have a floating dtype"),
        (_with(topk_indices=lambda x: torch.zeros(2, 8, 3)), TypeError, r"`topk_indices` to be int32 or int64, but got torch.float32"),
        (_with(topk_indices=lambda x: torch.zeros(2, 7, 3, dtype=torch.long)), ValueError, r"`topk_indices` to have shape \[B, N_q, K\] = \(2, 8, K\) with K >= 1, but got \(2, 7, 3\)"),
        (_with(topk_indices=lambda x: torch.zeros(2, 8, 0, dtype=torch.long)), ValueError, r"with K >= 1, but got \(2, 8, 0\)"),
        (_with(topk_indices=lambda x: torch.full((2, 8, 3), 8)), ValueError, r"-1 \(empty slot\) or a key position in \[0, N_k\) = \[0, 8\), but got 8 at \(b, t, slot\) = \(0, 0, 0\)"),
        (_with(topk_indices=lambda x: torch.full((2, 8, 3), -2, dtype=torch.int32)), ValueError, r"but got -2 at"),
        (_with(topk_indices=lambda x: torch.tensor([0, 1, -1, -1]).expand(2, 8, 4).clone().index_put_((torch.tensor(1), torch.tensor(5), torch.tensor(3)), torch.tensor(1))), ValueError, r"distinct within a row \(-1 may repeat\), but row \(b=1, t=5\) lists key 1 twice"),
        (_with(key_padding_mask=lambda x: torch.ones(2, 8)), TypeError, r"`key_padding_mask` to have dtype torch.bool \(True = real key\), but got torch.float32"),
        (_with(key_padding_mask=lambda x: torch.ones(2, 9, dtype=torch.bool)), ValueError, r"`key_padding_mask` to have shape \[B, N_k\] = \(2, 8\), but got \(2, 9\)"),
    ],
    ids=["rank-q", "rank-k_idx", "int-w", "not-tensor", "head-dim", "batch", "gqa", "n_q", "n_k", "d_i", "h_i",
         "qk-dtype", "index-dtype", "lse-shape", "lse-dtype", "topk-dtype", "topk-shape", "topk-empty", "topk-high",
         "topk-low", "topk-duplicate", "kpm-dtype", "kpm-shape"],
)
def test_input_errors(mutate, error, match):
    for fn in (indexer_kl, naive_indexer_kl):
        with pytest.raises(error, match=match):
            fn(**mutate(_inputs()))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(reduction="batchmean"), ValueError, r"`reduction` to be one of \['none', 'sum', 'mean'\], but got 'batchmean'"),
        (dict(layout="bshd"), ValueError, r"`layout` to be one of \['bhnd', 'bnhd'\], but got 'bshd'"),
        (dict(backend="cuda"), ValueError, r"`backend` to be one of \['auto', 'triton', 'reference'\], but got 'cuda'"),
        (dict(causal=1), TypeError, r"`causal` to be a bool, but got int"),
        (dict(scale=0.0), ValueError, r"`scale` to be a finite float > 0, but got 0.0"),
        (dict(scale=math.nan), ValueError, r"`scale` to be a finite float > 0, but got nan"),
        (dict(scale="1"), TypeError, r"`scale` to be None or a Python float, but got str"),
        (dict(check_indices=None), TypeError, r"`check_indices` to be a bool, but got NoneType"),
    ],
    ids=["reduction", "layout", "backend", "causal", "scale-zero", "scale-nan", "scale-str", "check_indices"],
)
def test_option_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        indexer_kl(**_inputs(), **kwargs)


def test_layout_is_named_in_shape_errors():
    x = {n: (v.transpose(1, 2) if v.dim() == 4 else v) for n, v in _inputs().items()}
    x["q_idx"] = x["q_idx"][:, :5]
    with pytest.raises(ValueError, match=r"N_q=8 query positions like `q`, but got layout 'bnhd': q=\(2, 8, 4, 16\)"):
        indexer_kl(**x, layout="bnhd")


def test_mixed_devices_are_named():
    x = _inputs()
    x["w_idx"] = x["w_idx"].to("meta")
    with pytest.raises(ValueError, match=r"`q` is on cpu and `w_idx` is on meta"):
        indexer_kl(**x)


def test_unchecked_indices_are_the_callers_promise():
    """check_indices=False skips the sort and the synchronisation; valid indices give the same loss."""
    x = _inputs()
    topk = torch.stack([torch.randperm(8)[:3] for _ in range(16)]).view(2, 8, 3)
    checked = indexer_kl(**x, topk_indices=topk)
    assert torch.equal(indexer_kl(**x, topk_indices=topk, check_indices=False), checked)


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"backend='triton' needs CUDA tensors \(got tensors on cpu\)"):
        indexer_kl(**_inputs(), backend="triton")
