"""The attention-KL op registered with ``torch.library``: custom forward/backward ops, fake
(meta) implementations and autograd, so ``torch.compile(fullgraph=True)`` traces through it.

Two ops, both over the canonical ``(B, H, N, D)`` views and computing ``KL(P_a ‖ P_b)``:

* ``streamkl::attention_kl_fwd`` -> ``(kl, lse_a, lse_b)``, each ``[B, H, N_q]`` fp32 (fp64 for
  fp64 inputs): the per-row KL and the two log-sum-exps (nats) that the backward needs. This is all
  the state that is saved: three numbers per query row.
* ``streamkl::attention_kl_bwd`` -> ``(dq_a, dk_a, dq_b, dk_b)``; a gradient that was not asked for
  is returned as an empty tensor (custom ops cannot return None).

``backend`` is ``"reference"`` (chunked PyTorch, any device) or ``"triton"`` (fused kernels);
``allow_tf32`` lets float32 products use TF32 tensor cores (Triton only); ``deterministic`` asks the
backward for bitwise-reproducible gradients (the reference is always deterministic).
"""

from __future__ import annotations

import torch

from . import reference
from ._validation import result_dtype

_EMPTY_SHAPE = (0,)


def _triton_kernels():
    from ._triton import backward, forward  # lazy: importing streamkl must not need a working triton

    return forward, backward


@torch.library.custom_op("streamkl::attention_kl_fwd", mutates_args=())
def attention_kl_fwd_op(
    q_a: torch.Tensor,
    k_a: torch.Tensor,
    q_b: torch.Tensor,
    k_b: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    query_mask: torch.Tensor | None,
    causal: bool,
    scale_a: float,
    scale_b: float,
    backend: str,
    allow_tf32: bool,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row ``KL(P_a ‖ P_b)`` plus ``lse_a``/``lse_b`` (see the module docstring)."""
    if backend == "triton":
        return _triton_kernels()[0].attention_kl_fwd(
            q_a, k_a, q_b, k_b, key_padding_mask, query_mask, causal, scale_a, scale_b, allow_tf32
        )
    return reference.chunked_attention_kl_fwd(
        q_a, k_a, q_b, k_b, key_padding_mask, query_mask, causal, scale_a, scale_b
    )


@attention_kl_fwd_op.register_fake
def _attention_kl_fwd_fake(q_a, k_a, q_b, k_b, key_padding_mask, query_mask, causal, scale_a, scale_b,
                           backend, allow_tf32, deterministic):
    shape = q_a.shape[:3]
    dtype = result_dtype(q_a, k_a, q_b, k_b)
    return tuple(q_a.new_empty(shape, dtype=dtype) for _ in range(3))


@torch.library.custom_op("streamkl::attention_kl_bwd", mutates_args=())
def attention_kl_bwd_op(
    grad_kl: torch.Tensor,
    q_a: torch.Tensor,
    k_a: torch.Tensor,
    q_b: torch.Tensor,
    k_b: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    kl: torch.Tensor,
    lse_a: torch.Tensor,
    lse_b: torch.Tensor,
    causal: bool,
    scale_a: float,
    scale_b: float,
    need_grad_a: bool,
    need_grad_b: bool,
    backend: str,
    allow_tf32: bool,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``Σ grad_kl · KL`` (empty tensors for the side that was not asked for)."""
    if backend == "triton":
        grads = _triton_kernels()[1].attention_kl_bwd(
            grad_kl, q_a, k_a, q_b, k_b, key_padding_mask, kl, lse_a, lse_b, causal, scale_a, scale_b,
            need_grad_a, need_grad_b, allow_tf32, deterministic,
        )
    else:
        grads = reference.chunked_attention_kl_bwd(
            grad_kl, q_a, k_a, q_b, k_b, key_padding_mask, kl, lse_a, lse_b, causal, scale_a, scale_b,
            need_grad_a, need_grad_b,
        )
    inputs = (q_a, k_a, q_b, k_b)
    return tuple(
        x.new_empty(_EMPTY_SHAPE) if g is None else g.to(x.dtype) for g, x in zip(grads, inputs)
    )


@attention_kl_bwd_op.register_fake
def _attention_kl_bwd_fake(grad_kl, q_a, k_a, q_b, k_b, key_padding_mask, kl, lse_a, lse_b, causal,
                           scale_a, scale_b, need_grad_a, need_grad_b, backend, allow_tf32, deterministic):
    need = (need_grad_a, need_grad_a, need_grad_b, need_grad_b)
    inputs = (q_a, k_a, q_b, k_b)
    return tuple(
        torch.empty_like(x, memory_format=torch.contiguous_format) if n else x.new_empty(_EMPTY_SHAPE)
        for n, x in zip(need, inputs)
    )


def _setup_context(ctx, inputs, output) -> None:
    (q_a, k_a, q_b, k_b, key_padding_mask, _query_mask, causal, scale_a, scale_b, backend, allow_tf32,
     deterministic) = inputs
    kl, lse_a, lse_b = output
    ctx.save_for_backward(q_a, k_a, q_b, k_b, key_padding_mask, kl, lse_a, lse_b)
    ctx.causal, ctx.scale_a, ctx.scale_b = causal, scale_a, scale_b
    ctx.backend, ctx.allow_tf32 = backend, allow_tf32
    ctx.deterministic = deterministic
    ctx.mark_non_differentiable(lse_a, lse_b)


def _backward(ctx, grad_kl, _grad_lse_a, _grad_lse_b):
    q_a, k_a, q_b, k_b, key_padding_mask, kl, lse_a, lse_b = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_a, need_b = bool(need[0] or need[1]), bool(need[2] or need[3])
    if grad_kl is None or not (need_a or need_b):
        return (None,) * 12
    dq_a, dk_a, dq_b, dk_b = attention_kl_bwd_op(
        grad_kl.contiguous(), q_a, k_a, q_b, k_b, key_padding_mask, kl, lse_a, lse_b, ctx.causal,
        ctx.scale_a, ctx.scale_b, need_a, need_b, ctx.backend, ctx.allow_tf32, ctx.deterministic,
    )
    return (
        dq_a if need_a else None,
        dk_a if need_a else None,
        dq_b if need_b else None,
        dk_b if need_b else None,
    ) + (None,) * 8


attention_kl_fwd_op.register_autograd(_backward, setup_context=_setup_context)

