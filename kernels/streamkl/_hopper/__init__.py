"""Warp-group (sm_90) kernels written in Gluon, selected over the portable Triton kernels where they are faster.

:func:`hopper_forward` picks the Hopper forward (:mod:`streamkl._hopper.forward`) for a problem, or returns None so
that the portable kernel runs. Measured on an H100 (``benchmarks/bench_hopper.py``, docs/perf-notes.md v7) it is
faster than the portable forward only where the products weigh as much as the exponentials, head dim 128, and only
once the problem is large enough to hide its launch (building four TMA descriptors and launching a Gluon kernel
takes about twice a portable launch's host time, v10), so it runs for head dim 128 (either side) at
``HOPPER_MIN_SCORES`` score elements and more.

:func:`hopper_fused_forward` picks the Gluon training forward of a frozen teacher (KL, both log-sum-exps and the
student's query gradient in one pass, :mod:`streamkl._hopper.fused_forward`: a producer warp and two consumer
warpgroups), which gives the portable fused forward's bits. Measured on an H100 it is faster than the portable
forward at head dims 64 and 128, with and without a causal mask (``benchmarks/bench_ws_fused_forward.py``,
``benchmarks/bench_gluon_causal_order.py``, docs/perf-notes.md v17 and v18: it was slower at head dim 64 with a causal
mask until v18 gave its causal grid the portable forward's longest-first order), so it runs wherever it is in scope,
at ``HOPPER_MIN_SCORES`` score elements and more.

:func:`hopper_key_pass` does the same for the backward's key pass when only side b needs gradients (a frozen
teacher; :mod:`streamkl._hopper.backward`). Measured faster than the portable pass at head dims 64 and 128
(``benchmarks/bench_hopper_key_pass.py``, docs/perf-notes.md v10), it runs for both at ``HOPPER_MIN_SCORES`` score
elements and more. With a causal mask and head dim 128 that pass runs the warp-specialised kernel
(:mod:`streamkl._hopper.key_pass_ws`: a producer warp and two consumer warpgroups taking turns on the tensor cores),
measured faster there (``benchmarks/bench_ws_key_pass.py``, ``benchmarks/bench_peeled_key_pass.py``,
docs/perf-notes.md v13 and v14). Elsewhere the one-warpgroup kernel runs, its full steps pipelined at head dim 64 and
one at a time at head dim 128, where two steps in flight would spill (``benchmarks/bench_one_set_key_pass.py``, v16).

None of them runs on other GPUs, under the interpreter, outside its kernel's scope, when the installed Triton has no
usable Gluon, or with ``STREAMKL_HOPPER_KERNELS=0`` in the environment; ``STREAMKL_HOPPER_KERNELS=all`` also selects
them for small problems and the forward for head dim 64 (for measurements).
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable

from .._problem import KLInputs, KLSpec

#: Problems with fewer score elements per distribution (B·H·N_q·N_k) stay on the portable kernel.
HOPPER_MIN_SCORES = 1 << 28
#: ``0``: every call on the portable Triton kernels; ``all``: the Hopper forward wherever it applies.
ENV_SWITCH = "STREAMKL_HOPPER_KERNELS"


@functools.lru_cache(maxsize=4)
def _module(name: str = "forward"):
    """The Hopper module ``name`` (``forward`` or ``backward``), or None when this Triton has no usable Gluon (they
    are imported lazily: Gluon's Hopper API differs between Triton releases, and the portable kernels must never
    depend on it)."""
    try:
        return importlib.import_module(f".{name}", __name__)
    except (ImportError, AttributeError):
        return None


def _large_enough(inputs: KLInputs, mode: str) -> bool:
    """Whether a CUDA problem is big enough to hide the Hopper launch (always with ``mode == "all"``)."""
    q_a, k_a = inputs.q_a, inputs.k_a
    return mode == "all" or q_a.shape[0] * q_a.shape[1] * q_a.shape[2] * k_a.shape[2] >= HOPPER_MIN_SCORES


def hopper_forward(inputs: KLInputs, spec: KLSpec) -> Callable | None:
    """The Hopper forward for this problem (a function of ``(inputs, spec)`` returning ``(kl, lse_a, lse_b)``), or None.

    Example:
        >>> import torch
        >>> from streamkl._problem import KLInputs, KLSpec
        >>> q = torch.randn(1, 1, 8, 64)  # CPU tensors: the portable path
        >>> hopper_forward(KLInputs(q, q, q, q, None, None, None, None, None, None), KLSpec(0.125, 0.125)) is None
        True
    """
    mode = os.environ.get(ENV_SWITCH, "1")  # read on every call, so tests and benchmarks can switch it
    if not inputs.q_a.is_cuda or mode == "0" or not _large_enough(inputs, mode):
        return None
    if mode != "all" and max(inputs.q_a.shape[-1], inputs.q_b.shape[-1]) < 128:
        return None
    module = _module("forward")
    if module is None or not module.supports(inputs, spec):
        return None
    return module.attention_kl_fwd_hopper


def hopper_fused_forward(inputs: KLInputs, spec: KLSpec) -> Callable | None:
    """The Hopper training forward with a frozen teacher (a function of ``(inputs, spec, dq_b)`` returning ``(kl,
    lse_a, lse_b)`` and filling ``dq_b``, :mod:`streamkl._hopper.fused_forward`), or None: the forward of a training
    call whose side a needs no gradient (:func:`streamkl.autograd.fuses_dq_b`).

    Example:
        >>> import torch
        >>> from streamkl._problem import KLInputs, KLSpec
        >>> q = torch.randn(1, 1, 8, 64)  # CPU tensors: the portable path
        >>> hopper_fused_forward(KLInputs(q, q, q, q, *[None] * 6), KLSpec(0.125, 0.125)) is None
        True
    """
    mode = os.environ.get(ENV_SWITCH, "1")
    if not inputs.q_a.is_cuda or mode == "0" or not _large_enough(inputs, mode):
        return None
    module = _module("fused_forward")
    if module is None or not module.supports(inputs, spec):
        return None
    return module.attention_kl_fused_fwd_hopper


def hopper_key_pass(inputs: KLInputs, spec: KLSpec, need_grad_a: bool, need_grad_b: bool) -> Callable | None:
    """The Hopper key pass for this backward (a function of ``(grad_kl, inputs, spec, lse_a, lse_b)`` returning side
    b's key gradient), or None: it computes only side b's key gradient, so it applies when side a needs none.

    Example:
        >>> import torch
        >>> from streamkl._problem import KLInputs, KLSpec
        >>> q = torch.randn(1, 1, 8, 64)  # CPU tensors: the portable path
        >>> hopper_key_pass(KLInputs(q, q, q, q, *[None] * 6), KLSpec(0.125, 0.125), False, True) is None
        True
    """
    mode = os.environ.get(ENV_SWITCH, "1")
    if not inputs.q_a.is_cuda or mode == "0" or need_grad_a or not need_grad_b or not _large_enough(inputs, mode):
        return None
    module = _module("backward")
    if module is None or not module.supports(inputs, spec, need_grad_a, need_grad_b):
        return None
    return module.attention_kl_key_pass_hopper


__all__ = ["ENV_SWITCH", "HOPPER_MIN_SCORES", "hopper_forward", "hopper_fused_forward", "hopper_key_pass"]
