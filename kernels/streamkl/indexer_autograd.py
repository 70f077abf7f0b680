"""Autograd of the indexer loss, two ways over one implementation (as :mod:`streamkl.autograd` does for the
attention KL).

* Eager mode: :class:`IndexerKLFunction`, a plain ``torch.autograd.Function``.
* Under ``torch.compile``: the same forward/backward registered with ``torch.library`` as the custom ops
  ``streamkl::indexer_kl_fwd`` / ``streamkl::indexer_kl_bwd`` with fake implementations and autograd, so
  ``torch.compile(fullgraph=True)`` traces through without graph breaks.

The forward returns ``(kl [B, N_q], lse_h [B, H, N_q], lse_index [B, N_q], psum [B, N_q])`` (see
:func:`streamkl.indexer_reference.chunked_indexer_kl_fwd`); only ``kl`` is differentiable, and only ``q_idx``,
``k_idx`` and ``w_idx`` get gradients. ``backend`` is ``"reference"`` or ``"triton"``.
"""

from __future__ import annotations

import torch

from . import dispatch


def indexer_forward_impl(q, k, q_idx, k_idx, w_idx, lse, topk_indices, key_padding_mask, causal, scale, backend):
    """``(kl, lse_h, lse_index, psum)`` from the backend (:func:`streamkl.dispatch.indexer_forward`)."""
    return dispatch.indexer_forward(q, k, q_idx, k_idx, w_idx, lse, topk_indices, key_padding_mask, causal, scale,
                                    backend)


def indexer_backward_impl(grad_kl, q, k, q_idx, k_idx, w_idx, lse_h, lse_index, psum, topk_indices,
                          key_padding_mask, causal, scale, backend):
    """``(dq_idx, dk_idx, dw_idx)`` in the dtypes of ``q_idx``, ``k_idx``, ``w_idx``."""
    grads = dispatch.indexer_backward(grad_kl, q, k, q_idx, k_idx, w_idx, lse_h, lse_index, psum, topk_indices,
                                      key_padding_mask, causal, scale, backend)
    return tuple(g.to(x.dtype) for g, x in zip(grads, (q_idx, k_idx, w_idx)))


_NON_TENSOR_ARGS = 3  # causal, scale, backend


def _save(ctx, inputs, outputs) -> None:
    q, k, q_idx, k_idx, w_idx, _lse, topk_indices, key_padding_mask, causal, scale, backend = inputs
    _kl, lse_h, lse_index, psum = outputs
    ctx.save_for_backward(q, k, q_idx, k_idx, w_idx, lse_h, lse_index, psum, topk_indices, key_padding_mask)
    ctx.options = (causal, scale, backend)


def _backward_from_ctx(ctx, grad_kl, backward_fn) -> tuple:
    """Gradients for the 11 inputs: ``q_idx``, ``k_idx``, ``w_idx`` where asked for, None elsewhere."""
    q, k, q_idx, k_idx, w_idx, lse_h, lse_index, psum, topk_indices, key_padding_mask = ctx.saved_tensors
    need = ctx.needs_input_grad[2:5]
    if grad_kl is None or not any(need):
        return (None,) * 11
    grads = backward_fn(grad_kl.contiguous(), q, k, q_idx, k_idx, w_idx, lse_h, lse_index, psum, topk_indices,
                        key_padding_mask, *ctx.options)
    return (None, None, *(g if n else None for g, n in zip(grads, need)), *(None,) * (3 + _NON_TENSOR_ARGS))


def _mark(ctx, outputs) -> None:
    ctx.mark_non_differentiable(*outputs[1:])


class IndexerKLFunction(torch.autograd.Function):
    """Eager autograd: ``apply(q, k, q_idx, k_idx, w_idx, lse, topk_indices, key_padding_mask, causal, scale,
    backend) -> (kl, lse_h, lse_index, psum)``; only ``kl`` is differentiable.

    Example:
        >>> q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
        >>> q_idx = torch.randn(1, 3, 5, 4, requires_grad=True)
        >>> k_idx, w_idx = torch.randn(1, 5, 4), torch.rand(1, 5, 3)
        >>> kl, *_ = IndexerKLFunction.apply(q, k, q_idx, k_idx, w_idx, None, None, None, True, 0.3, "reference")
        >>> kl.sum().backward()
        >>> tuple(q_idx.grad.shape)
        (1, 3, 5, 4)
    """

    @staticmethod
    def forward(ctx, q, k, q_idx, k_idx, w_idx, lse, topk_indices, key_padding_mask, causal, scale, backend):
        inputs = (q, k, q_idx, k_idx, w_idx, lse, topk_indices, key_padding_mask, causal, scale, backend)
        outputs = indexer_forward_impl(*inputs)
        _save(ctx, inputs, outputs)
        _mark(ctx, outputs)
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_kl, *_unused):
        return _backward_from_ctx(ctx, grad_kl, indexer_backward_impl)


# ------------------------------------------------------------------------------ torch.library custom ops
@torch.library.custom_op("streamkl::indexer_kl_fwd", mutates_args=())
def indexer_kl_fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w_idx: torch.Tensor,
    lse: torch.Tensor | None,
    topk_indices: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(kl, lse_h, lse_index, psum)`` (see the module docstring)."""
    return tuple(x.clone() if x is lse else x for x in indexer_forward_impl(
        q, k, q_idx, k_idx, w_idx, lse, topk_indices, key_padding_mask, causal, scale, backend))


@indexer_kl_fwd_op.register_fake
def _indexer_kl_fwd_fake(q, k, q_idx, k_idx, w_idx, lse, topk_indices, key_padding_mask, causal, scale, backend):
    dtype = torch.float64 if torch.float64 in (q.dtype, q_idx.dtype, w_idx.dtype) else torch.float32
    rows = q.new_empty((q.shape[0], q.shape[2]), dtype=dtype)
    return rows, q.new_empty(q.shape[:3], dtype=dtype), torch.empty_like(rows), torch.empty_like(rows)


@torch.library.custom_op("streamkl::indexer_kl_bwd", mutates_args=())
def indexer_kl_bwd_op(
    grad_kl: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w_idx: torch.Tensor,
    lse_h: torch.Tensor,
    lse_index: torch.Tensor,
    psum: torch.Tensor,
    topk_indices: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``Σ grad_kl · KL`` w.r.t. ``q_idx``, ``k_idx``, ``w_idx``."""
    return indexer_backward_impl(grad_kl, q, k, q_idx, k_idx, w_idx, lse_h, lse_index, psum, topk_indices,
                                 key_padding_mask, causal, scale, backend)


@indexer_kl_bwd_op.register_fake
def _indexer_kl_bwd_fake(grad_kl, q, k, q_idx, k_idx, w_idx, lse_h, lse_index, psum, topk_indices,
                         key_padding_mask, causal, scale, backend):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q_idx, k_idx, w_idx))


def _setup_context(ctx, inputs, output) -> None:
    _save(ctx, inputs, output)


def _backward(ctx, grad_kl, *_unused):
    return _backward_from_ctx(ctx, grad_kl, indexer_kl_bwd_op)


indexer_kl_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def indexer_kl_per_row(q, k, q_idx, k_idx, w_idx, lse, topk_indices, key_padding_mask, causal, scale, backend):
    """``(kl [B, N_q], lse_index [B, N_q])``: the custom op while ``torch.compile`` traces, the Function in eager."""
    args = (q, k, q_idx, k_idx, w_idx, lse, topk_indices, key_padding_mask, causal, scale, backend)
    fn = indexer_kl_fwd_op if torch.compiler.is_compiling() else IndexerKLFunction.apply
    kl, _lse_h, lse_index, _psum = fn(*args)
    return kl, lse_index
