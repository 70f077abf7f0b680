"""Autograd for the attention-KL op, two ways over one implementation.

* Eager mode: :class:`AttentionKLFunction`, a plain ``torch.autograd.Function`` (a few microseconds of
  host overhead per call).
* Under ``torch.compile``: the same forward/backward registered with ``torch.library`` as the custom
  ops ``streamkl::attention_kl_fwd`` / ``streamkl::attention_kl_bwd`` with fake (meta) implementations
  and autograd, so ``torch.compile(fullgraph=True)`` traces through without graph breaks. (A Python
  custom op costs tens of microseconds of dispatch per call in eager mode, which is why eager calls
  take the Function.)

Both compute ``KL(P_a ‖ P_b)`` over canonical ``(B, H, N, D)`` views. The forward returns
``(kl, lse_a, lse_b)``, each ``[B, H, N_q]`` fp32 (fp64 for fp64 inputs): the per-row KL and the two
log-sum-exps (nats), which is all the state saved for the backward: three numbers per query row.
``backend`` is ``"reference"`` (chunked PyTorch, any device) or ``"triton"`` (fused kernels);
``allow_tf32`` lets float32 products use TF32 tensor cores (Triton only); ``deterministic`` selects the
atomic-free backward (the reference is always deterministic).
"""

from __future__ import annotations

import torch

from . import reference
from ._validation import result_dtype

_EMPTY_SHAPE = (0,)


def _triton_kernels():
    from ._triton import backward, forward  # lazy: importing streamkl must not need a working triton

    return forward, backward


def forward_impl(q_a, k_a, q_b, k_b, key_padding_mask, query_mask, causal, scale_a, scale_b, backend, allow_tf32):
    """``(kl, lse_a, lse_b)`` from the selected backend."""
    if backend == "triton":
        return _triton_kernels()[0].attention_kl_fwd(
            q_a, k_a, q_b, k_b, key_padding_mask, query_mask, causal, scale_a, scale_b, allow_tf32
        )
    return reference.chunked_attention_kl_fwd(q_a, k_a, q_b, k_b, key_padding_mask, query_mask, causal, scale_a,
                                              scale_b)


def backward_impl(grad_kl, q_a, k_a, q_b, k_b, key_padding_mask, kl, lse_a, lse_b, causal, scale_a, scale_b,
                  need_grad_a, need_grad_b, backend, allow_tf32, deterministic):
    """``(dq_a, dk_a, dq_b, dk_b)`` in the input dtypes, None where not requested."""
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
    return tuple(None if g is None else g.to(x.dtype) for g, x in zip(grads, (q_a, k_a, q_b, k_b)))


def _save(ctx, q_a, k_a, q_b, k_b, key_padding_mask, kl, lse_a, lse_b, options) -> None:
    """Save the inputs and the three per-row statistics (the only state kept for the backward)."""
    ctx.save_for_backward(q_a, k_a, q_b, k_b, key_padding_mask, kl, lse_a, lse_b)
    ctx.options = options  # (causal, scale_a, scale_b, backend, allow_tf32, deterministic)
    ctx.mark_non_differentiable(lse_a, lse_b)


def _backward_from_ctx(ctx, grad_kl, backward_fn) -> tuple:
    """The 12 input gradients (None for non-tensors and for the side nobody asked for) via ``backward_fn``."""
    q_a, k_a, q_b, k_b, key_padding_mask, kl, lse_a, lse_b = ctx.saved_tensors
    causal, scale_a, scale_b, backend, allow_tf32, deterministic = ctx.options
    need = ctx.needs_input_grad
    need_a, need_b = bool(need[0] or need[1]), bool(need[2] or need[3])
    if grad_kl is None or not (need_a or need_b):
        return (None,) * 12
    dq_a, dk_a, dq_b, dk_b = backward_fn(grad_kl.contiguous(), q_a, k_a, q_b, k_b, key_padding_mask, kl, lse_a,
                                         lse_b, causal, scale_a, scale_b, need_a, need_b, backend, allow_tf32,
                                         deterministic)
    side_a = (dq_a, dk_a) if need_a else (None, None)
    side_b = (dq_b, dk_b) if need_b else (None, None)
    return (*side_a, *side_b, *(None,) * 8)


class AttentionKLFunction(torch.autograd.Function):
    """Eager autograd of the op: ``apply(q_a, k_a, q_b, k_b, key_padding_mask, query_mask, causal, scale_a,
    scale_b, backend, allow_tf32, deterministic) -> (kl, lse_a, lse_b)``; only ``kl`` is differentiable.

    Example:
        >>> q = torch.randn(1, 2, 5, 8, requires_grad=True)
        >>> kl, lse_a, lse_b = AttentionKLFunction.apply(q, q.detach(), q, q.detach() * 2, None, None, False,
        ...                                              0.3, 0.3, "reference", False, True)
        >>> kl.sum().backward()
        >>> tuple(q.grad.shape)
        (1, 2, 5, 8)
    """

    @staticmethod
    def forward(ctx, q_a, k_a, q_b, k_b, key_padding_mask, query_mask, causal, scale_a, scale_b, backend,
                allow_tf32, deterministic):
        kl, lse_a, lse_b = forward_impl(q_a, k_a, q_b, k_b, key_padding_mask, query_mask, causal, scale_a, scale_b,
                                        backend, allow_tf32)
        _save(ctx, q_a, k_a, q_b, k_b, key_padding_mask, kl, lse_a, lse_b,
              (causal, scale_a, scale_b, backend, allow_tf32, deterministic))
        return kl, lse_a, lse_b

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_kl, _grad_lse_a, _grad_lse_b):
        return _backward_from_ctx(ctx, grad_kl, backward_impl)


# ------------------------------------------------------------------------------ torch.library custom ops
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
    return forward_impl(q_a, k_a, q_b, k_b, key_padding_mask, query_mask, causal, scale_a, scale_b, backend,
                        allow_tf32)


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
    """Gradients of ``Σ grad_kl · KL``; a gradient that was not asked for is an empty tensor (custom ops
    cannot return None)."""
    grads = backward_impl(grad_kl, q_a, k_a, q_b, k_b, key_padding_mask, kl, lse_a, lse_b, causal, scale_a,
                          scale_b, need_grad_a, need_grad_b, backend, allow_tf32, deterministic)
    return tuple(x.new_empty(_EMPTY_SHAPE) if g is None else g for g, x in zip(grads, (q_a, k_a, q_b, k_b)))


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
    _save(ctx, q_a, k_a, q_b, k_b, key_padding_mask, kl, lse_a, lse_b,
          (causal, scale_a, scale_b, backend, allow_tf32, deterministic))


def _backward(ctx, grad_kl, _grad_lse_a, _grad_lse_b):
    return _backward_from_ctx(ctx, grad_kl, attention_kl_bwd_op)


attention_kl_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def attention_kl_per_row(*args):
    """Dispatch: the custom op while ``torch.compile`` traces, the autograd Function in eager mode."""
    if torch.compiler.is_compiling():
        return attention_kl_fwd_op(*args)
    return AttentionKLFunction.apply(*args)
