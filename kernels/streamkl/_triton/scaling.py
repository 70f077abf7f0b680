"""Side b's gradients computed ahead, times the loss's upstream gradient, in one launch at memory bandwidth.

A call that computes its gradients in its forward (:func:`streamkl.dispatch.gradients_ahead`) keeps side b's query
and key gradients per unit gradient of the loss; its backward multiplies each by the upstream gradient, a 0-dim tensor
on the device. ``torch.mul`` by a 0-dim CUDA tensor broadcasts it (stride 0), which takes PyTorch's non-vectorised
elementwise kernel, several times slower than a copy. :func:`scaled_copies` computes both products in one launch
with the bits of ``torch.mul`` on CUDA: the factor is read in the input's dtype (a bf16 input's factor is rounded to
bf16, as the dtype torch computes a bf16 product in), the product is taken in fp32 and rounded once to the output
dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_common.launch import KernelLauncher
from ._helpers import _to_bf16_nearest_even

#: Elements per program, and the warps that take them (16 per thread: two 16-byte loads of bf16, four of fp32).
BLOCK = 4096
WARPS = 8


@triton.jit
def _scale_one(X, Y, FACTOR, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    factor = tl.load(FACTOR).to(tl.float32)
    if X.dtype.element_ty == tl.bfloat16:  # (the interpreter's cast truncates)
        factor = _to_bf16_nearest_even(factor).to(tl.float32)
    elif X.dtype.element_ty == tl.float16:
        factor = factor.to(tl.float16).to(tl.float32)
    y = tl.load(X + offs, mask=inside).to(tl.float32) * factor
    if Y.dtype.element_ty == tl.bfloat16:  # (the interpreter's cast truncates)
        y = _to_bf16_nearest_even(y)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=inside)


@triton.jit
def _scale_pair_kernel(X0, Y0, F0, X1, Y1, F1, n0, n1, BLOCK: tl.constexpr):
    """``Y_i = X_i · F_i[0]`` (``torch.mul``'s bits, module docstring) for ``i`` = ``program_id(1)``; both
    contiguous, ``n_i`` elements (the grid spans the larger; programs past a tensor's end store nothing)."""
    if tl.program_id(1) == 0:
        _scale_one(X0, Y0, F0, n0, BLOCK)
    else:
        _scale_one(X1, Y1, F1, n1, BLOCK)


_launch = KernelLauncher(_scale_pair_kernel)


def scaled_copies(first: torch.Tensor, first_factor: torch.Tensor, second: torch.Tensor | None,
                  second_factor: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(first · first_factor, second · second_factor)`` as new contiguous tensors of ``dtype`` (``None`` for a
    missing ``second``), each factor a 0-dim tensor on the tensors' device; one launch. ``first`` and ``second`` must
    be contiguous.

    Example (on the CPU under ``TRITON_INTERPRET=1``, as the test suite runs it):
        >>> x = torch.ones(3, dtype=torch.bfloat16)
        >>> a, b = scaled_copies(x, torch.tensor(0.5), None, torch.tensor(2.0), torch.bfloat16)
        >>> a.tolist(), b
        ([0.5, 0.5, 0.5], None)
    """
    out_first = torch.empty(first.shape, dtype=dtype, device=first.device)
    out_second = None if second is None else torch.empty(second.shape, dtype=dtype, device=second.device)
    n_first = first.numel()
    n_second = 0 if second is None else second.numel()
    if n_first + n_second == 0:
        return out_first, out_second
    grid = (triton.cdiv(max(n_first, n_second), BLOCK), 1 if second is None else 2)
    # a missing second tensor: the first stands in (the grid never reaches it)
    tensors = (first, out_first, first_factor,
               first if second is None else second, out_first if second is None else out_second, second_factor)
    _launch(grid, tensors, (n_first, n_second), (("BLOCK", BLOCK), ("num_warps", WARPS)))
    return out_first, out_second
