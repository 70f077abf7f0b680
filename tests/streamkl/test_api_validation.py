"""Every input error a user can hit names the argument, what was expected and what was given."""

from __future__ import annotations

import math

import pytest
import torch

from streamkl import AttentionKLLoss, attention_kl


def _inputs(b=2, h=4, h_k=4, n_q=8, n_k=8, d_t=16, d_s=8):
    return (torch.randn(b, h, n_q, d_t), torch.randn(b, h_k, n_k, d_t),
            torch.randn(b, h, n_q, d_s), torch.randn(b, h_k, n_k, d_s))


@pytest.mark.parametrize(
    ("mutate", "error", "match"),
    [
        (lambda x: (x[0][0],) + x[1:], ValueError, r"`q_t` to be a 4-D tensor \(layout 'bhnd'\), but got shape \(4, 8, 16\)"),
        (lambda x: x[:3] + (x[3].long(),), TypeError, r"`k_s` to have a floating dtype .* but got torch.int64"),
        (lambda x: (x[0].numpy(),) + x[1:], TypeError, r"`q_t` to be a torch.Tensor, but got ndarray"),
        (lambda x: (x[0], x[1][..., :15]) + x[2:], ValueError, r"`q_t` and `k_t` to share the head dim D_t"),
        (lambda x: x[:2] + (x[2][:1],) + x[3:], ValueError, r"same batch size B"),
        (lambda x: x[:2] + (x[2][:, :2],) + x[3:], ValueError, r"same number of query heads H"),
        (lambda x: x[:2] + (x[2][:, :, :5],) + x[3:], ValueError, r"same number of queries \(N\)"),
        (lambda x: x[:3] + (x[3][:, :, :5],), ValueError, r"same number of keys \(N\)"),
        (lambda x: (x[0], x[1].double()) + x[2:], TypeError, r"`q_t` and `k_t` to have the same dtype, but got torch.float32 and torch.float64"),
        (lambda x: (x[0], x[1][:, :3]) + x[2:], ValueError, r"H=4 to be divisible by the key heads of `k_t` \(H_k=3\)"),
    ],
    ids=["rank", "int-dtype", "not-tensor", "head-dim", "batch", "heads", "n_q", "n_k", "qk-dtype", "gqa"],
)
def test_shape_and_dtype_errors(mutate, error, match):
    with pytest.raises(error, match=match):
        attention_kl(*mutate(_inputs()))


def test_shape_error_names_layout_and_shapes():
    q_t, k_t, q_s, k_s = (x.transpose(1, 2) for x in _inputs())
    with pytest.raises(ValueError, match=r"q_t=\(2, 8, 4, 16\).*layout \(B, N, H, D\)"):
        attention_kl(q_t, k_t, q_s[:, :5], k_s, layout="bnhd")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(direction="backward"), ValueError, r"`direction` to be one of \['forward', 'reverse'\], but got 'backward'"),
        (dict(reduction="batchmean"), ValueError, r"`reduction` to be one of \['none', 'sum', 'mean'\]"),
        (dict(layout="bshd"), ValueError, r"`layout` to be one of \['bhnd', 'bnhd', 'thd'\], but got 'bshd'"),
        (dict(backend="cuda"), ValueError, r"`backend` to be one of \['auto', 'triton', 'reference'\]"),
        (dict(temperature=0.0), ValueError, r"`temperature` to be finite and > 0, but got 0.0"),
        (dict(temperature=-1), ValueError, r"`temperature` to be finite and > 0, but got -1"),
        (dict(temperature=math.inf), ValueError, r"`temperature` to be finite and > 0, but got inf"),
        (dict(temperature=math.nan), ValueError, r"`temperature` to be finite and > 0, but got nan"),
        (dict(temperature="2"), TypeError, r"`temperature` to be a Python float or int, but got str"),
        (dict(temperature=torch.tensor(2.0)), TypeError, r"`temperature` to be a Python float or int, but got Tensor"),
        (dict(scale_t=math.nan), ValueError, r"`scale_t` to be a finite float > 0, but got nan"),
        (dict(scale_s=0.0), ValueError, r"`scale_s` to be a finite float > 0, but got 0.0"),
        (dict(scale_s=-0.5), ValueError, r"`scale_s` to be a finite float > 0, but got -0.5"),
        (dict(causal=1), TypeError, r"`causal` to be a bool, but got int"),
        (dict(allow_tf32="yes"), TypeError, r"`allow_tf32` to be None or a bool, but got str"),
        (dict(deterministic=1), TypeError, r"`deterministic` to be a bool, but got int"),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else "",
)
def test_option_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        attention_kl(*_inputs(), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(key_padding_mask=torch.ones(2, 8)), TypeError, r"`key_padding_mask` to have dtype torch.bool .* but got torch.float32"),
        (dict(key_padding_mask=torch.ones(2, 7, dtype=torch.bool)), ValueError, r"`key_padding_mask` to have shape \(B, N_k\) = \(2, 8\), but got \(2, 7\)"),
        (dict(query_mask=torch.ones(8, dtype=torch.bool)), ValueError, r"`query_mask` to have shape \(B, N_q\) = \(2, 8\), but got \(8,\)"),
        (dict(query_mask=[True] * 8), TypeError, r"`query_mask` to be None or a torch.Tensor, but got list"),
    ],
    ids=["kpm-dtype", "kpm-shape", "qmask-shape", "qmask-type"],
)
def test_mask_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        attention_kl(*_inputs(), **kwargs)


def test_mixed_devices_error():
    q_t, k_t, q_s, k_s = _inputs()
    meta = torch.empty(k_s.shape, device="meta")
    with pytest.raises(ValueError, match=r"all inputs on one device, but `q_t` is on cpu and `k_s` is on meta"):
        attention_kl(q_t, k_t, q_s, meta)


def test_mask_on_other_device_error():
    kpm = torch.ones(2, 8, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match=r"`key_padding_mask` to be on cpu like q_t, or on the CPU, but got meta"):
        attention_kl(*_inputs(), key_padding_mask=kpm)


def test_triton_backend_without_cuda_or_interpreter_is_an_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises((ValueError, NotImplementedError), match="backend='triton'"):
        attention_kl(*_inputs(), backend="triton")


def test_module_validates_at_construction():
    with pytest.raises(ValueError, match="`direction`"):
        AttentionKLLoss(direction="sideways")
    with pytest.raises(ValueError, match="`temperature`"):
        AttentionKLLoss(temperature=0)
