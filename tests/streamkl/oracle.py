"""Compare a backend of :func:`streamkl.attention_kl` with the float64 oracle on one :class:`Case`."""

from __future__ import annotations

import torch

from streamkl import attention_kl, naive_attention_kl
from tests._helpers import assert_close
from tests.streamkl.cases import Case, make_inputs

#: Relative L2 tolerances (forward, gradients) of a backend against the float64 oracle, per input dtype.
TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 2e-2),
}


def counted_rows(case: Case, kpm: torch.Tensor | None, qm: torch.Tensor | None) -> torch.Tensor:
    """``[B, 1, N_q]`` bool: rows with at least one allowed key that the query mask keeps."""
    rows = torch.arange(case.n_q)[:, None]
    cols = torch.arange(case.n_k)[None, :]
    allowed = torch.ones(case.n_q, case.n_k, dtype=torch.bool)
    if case.causal:
        allowed = cols <= rows + (case.n_k - case.n_q)
    allowed = allowed[None].expand(case.b, -1, -1)
    if kpm is not None:
        allowed = allowed & kpm.cpu()[:, None, :]
    counted = allowed.any(-1)
    if qm is not None:
        counted = counted & qm.cpu()
    return counted[:, None, :]


def check_against_oracle(
    case: Case,
    dtype: torch.dtype,
    backend: str,
    device: str = "cpu",
    tolerances: tuple[float, float] | None = None,
    reduction_checks: bool = True,
) -> None:
    """Forward (per row and reduced) and every gradient of ``backend`` vs the float64 oracle.

    The oracle runs on the very same (rounded) inputs upcast to float64, so only the arithmetic of
    the backend is measured. Rows the contract defines as empty must be exactly 0.
    """
    rtol_fwd, rtol_grad = tolerances or TOLERANCES[dtype]
    q_t, k_t, q_s, k_s, kpm, qm = make_inputs(case, dtype, device)
    kw = case.kwargs()
    out = attention_kl(q_t, k_t, q_s, k_s, key_padding_mask=kpm, query_mask=qm, reduction="none",
                       backend=backend, **kw)
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    grad_out = torch.randn(out.shape, dtype=torch.float64).to(device)
    (out * grad_out.to(out.dtype)).sum().backward()

    ref_inputs = [x.detach().double().requires_grad_(x.requires_grad) for x in (q_t, k_t, q_s, k_s)]
    ref = naive_attention_kl(*ref_inputs, key_padding_mask=kpm, query_mask=qm, reduction="none",
                             compute_dtype=torch.float64, **kw)
    (ref * grad_out).sum().backward()

    assert_close(out, ref, rtol_fwd, "kl")
    empty = ~counted_rows(case, kpm, qm).to(out.device)
    assert torch.all(out.detach()[empty.expand_as(out)] == 0), "rows without keys must be exactly 0"
    names = ("q_t", "k_t", "q_s", "k_s")
    for name, x, r in zip(names, (q_t, k_t, q_s, k_s), ref_inputs):
        if r.requires_grad:
            assert x.grad is not None, f"{name} requires grad but got none"
            assert x.grad.dtype == x.dtype and x.grad.shape == x.shape
            assert_close(x.grad, r.grad, rtol_grad, f"d{name}")
        else:
            assert x.grad is None, f"{name} does not require grad but received one"

    if reduction_checks:
        for reduction in ("sum", "mean"):
            val = attention_kl(q_t.detach(), k_t.detach(), q_s.detach(), k_s.detach(), key_padding_mask=kpm,
                               query_mask=qm, reduction=reduction, backend=backend, **kw)
            expect = naive_attention_kl(*(x.detach() for x in ref_inputs), key_padding_mask=kpm,
                                        query_mask=qm, reduction=reduction, compute_dtype=torch.float64, **kw)
            assert val.shape == ()
            assert_close(val, expect, rtol_fwd, reduction)
