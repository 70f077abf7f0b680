"""Compare a backend of :func:`streamkl.attention_kl` with the float64 oracle on one :class:`Case`."""

from __future__ import annotations

import torch

from streamkl import attention_kl, naive_attention_kl
from streamkl._validation import prepare_problem
from streamkl.naive import allowed_keys
from streamkl.options import AttentionKLOptions
from tests._helpers import assert_close
from tests.streamkl.cases import Case, Inputs, make_inputs

#: Relative L2 tolerances (forward, gradients) of a backend against the float64 oracle, per input dtype.
TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 2e-2),
}


def counted_rows(case: Case, inputs: Inputs) -> torch.Tensor:
    """Bool map of counted rows (at least one allowed key, kept by the query mask), in the layout of the
    ``reduction="none"`` output, by the oracle's mask (the definition)."""
    tensors = {n: x.detach() for n, x in inputs.tensors.items()}
    options = AttentionKLOptions(**inputs.extras, reduction="none", **case.kwargs())
    problem = prepare_problem(tensors["q_t"], tensors["k_t"], tensors["q_s"], tensors["k_s"], options)
    counted = allowed_keys(problem).any(-1)  # [B or 1, 1, N_q]
    if problem.query_mask is not None:
        counted = counted & problem.query_mask[:, None, :]
    counted = counted.expand(problem.batch, problem.heads, problem.n_q)
    return counted[0].transpose(0, 1) if case.packed else counted


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
    inputs = make_inputs(case, dtype, device)
    kw = case.kwargs()
    out = inputs.call(attention_kl, reduction="none", backend=backend, **kw)
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    grad_out = torch.randn(out.shape, dtype=torch.float64).to(device)
    (out * grad_out.to(out.dtype)).sum().backward()

    ref_tensors = inputs.float64_copies()
    ref = naive_attention_kl(**ref_tensors, **inputs.extras, reduction="none", compute_dtype=torch.float64, **kw)
    (ref * grad_out).sum().backward()

    assert_close(out, ref, rtol_fwd, "kl")
    empty = ~counted_rows(case, inputs).to(out.device)
    assert torch.all(out.detach()[empty] == 0), "rows without keys must be exactly 0"
    for name, x in inputs.tensors.items():
        r = ref_tensors[name]
        if r.requires_grad:
            assert x.grad is not None, f"{name} requires grad but got none"
            assert x.grad.dtype == x.dtype and x.grad.shape == x.shape
            assert_close(x.grad, r.grad, rtol_grad, f"d{name}")
        else:
            assert x.grad is None, f"{name} does not require grad but received one"

    if reduction_checks:
        detached = {n: x.detach() for n, x in inputs.tensors.items()}
        ref_detached = {n: x.detach() for n, x in ref_tensors.items()}
        for reduction in ("sum", "mean"):
            val = attention_kl(**detached, **inputs.extras, reduction=reduction, backend=backend, **kw)
            expect = naive_attention_kl(**ref_detached, **inputs.extras, reduction=reduction,
                                        compute_dtype=torch.float64, **kw)
            assert val.shape == ()
            assert_close(val, expect, rtol_fwd, reduction)
