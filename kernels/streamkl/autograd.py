"""Autograd for the attention-KL op, two ways over one implementation.

* Eager mode: :class:`AttentionKLFunction`, a plain ``torch.autograd.Function`` (a few microseconds of
  host overhead per call).
* Under ``torch.compile``: the same forward/backward registered with ``torch.library`` as the custom
  ops ``streamkl::attention_kl_fwd`` / ``streamkl::attention_kl_bwd`` with fake (meta) implementations
  and autograd, so ``torch.compile(fullgraph=True)`` traces through without graph breaks. (A Python
  custom op costs tens of microseconds of dispatch per call in eager mode, which is why eager calls
  take the Function.)

Both compute ``KL(P_a ‖ P_b)`` over the canonical problem of :mod:`streamkl._problem` (:class:`KLInputs`,
:class:`KLSpec`). The forward returns ``(kl, lse_a, lse_b)``, each ``[B, H, N_q]`` fp32 (fp64 for fp64 inputs):
the per-row KL and the two log-sum-exps (nats, sinks included): three numbers per query row, all the state saved
for the backward, except with side a frozen (:func:`streamkl.dispatch.fuses_dq_b`), where the Triton forward also
accumulates side b's query gradient per unit upstream gradient (bf16 for bf16 inputs from ``NARROW_DQ_MIN_BYTES`` of
fp32 up, else fp32; the size of ``q_b``) and the backward runs only its key pass. A fused call reduced to one number
(:func:`streamkl.dispatch.gradients_ahead`) runs that key pass in its forward too and saves only side b's two
gradients per unit of the loss (:func:`forward_with_gradients`): none of the four inputs is kept. ``backend`` is
``"reference"`` (chunked PyTorch, any device) or ``"triton"`` (fused kernels); which kernel computes each pass is
:mod:`streamkl.dispatch`'s choice. ``allow_tf32`` lets float32 products use TF32 tensor cores (Triton only);
``deterministic`` selects the atomic-free backward (the reference is always deterministic). The sinks'
gradients are per-row quantities of the saved state (:func:`sink_gradients`), the same for every backend.
"""

from __future__ import annotations

import dataclasses

import torch

from . import dispatch
from ._pieces import Piece, per_row_result, piece_problems
from ._problem import AttentionKLProblem, KLInputs, KLSpec
from ._reduction import reduce_per_row_kl
from ._validation import result_dtype
from .dispatch import fuses_dq_b, gradients_ahead
from .precision import no_autocast

_EMPTY_SHAPE = (0,)


def forward_impl(inputs: KLInputs, spec: KLSpec, backend: str, allow_tf32: bool, dq_b: torch.Tensor | None = None,
                 dq_scale: float = 1.0):
    """``(kl, lse_a, lse_b)`` from the kernel :mod:`streamkl.dispatch` selects; with ``dq_b`` (Triton only, a buffer
    from :func:`streamkl.dispatch.new_dq_b_buffer`) the same pass also fills side b's query gradient per unit upstream
    gradient, times ``dq_scale`` (see :func:`fused_forward`). Autocast is off inside (the inputs arrive cast
    already)."""
    with no_autocast(inputs.q_a.device):
        return dispatch.forward(inputs, spec, backend, allow_tf32, dq_b, dq_scale)


def fused_forward(inputs: KLInputs, spec: KLSpec, backend: str, allow_tf32: bool, dq_scale: float = 1.0,
                  dtype: torch.dtype | None = None):
    """``(kl, lse_a, lse_b, dq_b)``: the forward that also accumulates side b's query gradient per unit upstream
    gradient, times ``dq_scale`` (Triton), ``dq_b`` shaped like ``q_b`` in ``dtype`` (default: the dtype it is saved
    in, :func:`streamkl.dispatch.saved_dq_b_dtype`)."""
    buffer = dispatch.new_dq_b_buffer(inputs, dtype)
    return (*forward_impl(inputs, spec, backend, allow_tf32, buffer, dq_scale), buffer)


def forward_with_gradients(inputs: KLInputs, spec: KLSpec, backend: str, allow_tf32: bool, deterministic: bool,
                           reduction: str, rows: int | None, defer_count: bool = False):
    """``(loss, lse_a, lse_b, dq_b, dk_b, dq_factor)``: the training forward (:func:`fused_forward`), its reduction
    (see :func:`_reduce`), and then the backward's key pass, with the gradient of the reduction as upstream gradient;
    so ``dq_b`` and ``dk_b`` (in :func:`streamkl.dispatch.ahead_gradient_dtype` of their inputs' dtype) are side b's
    gradients per unit gradient of ``loss``, ``dq_b`` times ``dq_factor`` where that is not None. Only for the calls
    :func:`streamkl.dispatch.gradients_ahead` selects.

    Where that gradient is known on the host (a sum: 1; a mean over ``rows`` the host knows: ``1/rows``), the
    training forward applies it to ``dq_b`` before its store rounds, and the key pass at its store: no pass over
    ``dq_b`` follows. A mean whose count is taken on the device multiplies ``dq_b`` by it afterwards, or, with
    ``defer_count``, leaves that to the backward, which multiplies ``dq_b`` by the loss's upstream gradient anyway
    (:func:`scaled_gradients`): ``dq_factor`` is then ``1/count`` (a 0-dim tensor), else None."""
    host_scale = 1.0 if reduction == "sum" else None if rows is None else 1.0 / rows
    defer = defer_count and host_scale is None
    grad_dtype = dispatch.ahead_gradient_dtype(inputs.q_b.dtype)
    # a final dq_b is written in the dtype it is kept in (one rounding, as a copy to it would round): no copy follows
    kl, lse_a, lse_b, dq_unit = fused_forward(inputs, spec, backend, allow_tf32,
                                              1.0 if host_scale is None else host_scale,
                                              None if host_scale is None and not defer else grad_dtype)
    loss, divisor = _reduce(kl, lse_a, reduction, rows)
    if host_scale is None:  # counted on the device
        per_row = divisor.to(torch.float32).reciprocal()
    else:
        per_row = torch.full((), host_scale, dtype=torch.float32, device=kl.device)
    # one number for every row (stride 0), as the backward of a reduced loss hands it to the kernels
    with no_autocast(inputs.q_a.device):
        _, _, dq_b, dk_b = dispatch.backward(per_row.expand(kl.shape), inputs, spec, kl, lse_a, lse_b, False, True,
                                             backend, allow_tf32, deterministic, dq_unit, grad_dtype,
                                             dq_b_final=host_scale is not None or defer)
    return loss, lse_a, lse_b, dq_b, dk_b, (per_row if defer else None)


def scaled_gradients(grad_loss: torch.Tensor | None, dq_b: torch.Tensor, dk_b: torch.Tensor, need_k_b: bool,
                     dtype: torch.dtype, dq_factor: torch.Tensor | None = None, traced: bool = False):
    """``(dq_b, dk_b)`` times the loss's upstream gradient (``dq_b`` also times ``dq_factor``, a 0-dim tensor, where
    given: :func:`forward_with_gradients`), in side b's input ``dtype`` (None without one, and ``dk_b`` None unless
    ``need_k_b``); new tensors, so a second backward (``retain_graph``) finds the saved ones unchanged. One
    elementwise launch for both (:func:`streamkl.dispatch.scaled_copies`; ``traced``: torch ops, for the custom op's
    backward, which the compiler traces): each product rounds to ``dtype`` as it is written."""
    if grad_loss is None:
        return None, None
    dq_scale = grad_loss if dq_factor is None else grad_loss * dq_factor
    return dispatch.scaled_copies(dq_b, dq_scale, dk_b if need_k_b else None, grad_loss, dtype, traced)


def backward_impl(grad_kl, inputs: KLInputs, spec: KLSpec, kl, lse_a, lse_b, need_grad_a: bool,
                  need_grad_b: bool, backend: str, allow_tf32: bool, deterministic: bool,
                  dq_b: torch.Tensor | None = None):
    """``(dq_a, dk_a, dq_b, dk_b)`` in the input dtypes, None where not requested; ``dq_b``: the forward's fused
    query gradient of side b (Triton only). Autocast is off inside: a backward run under autocast (``loss.backward()``
    inside the block, on the CPU, runs in the caller's thread) computes as the forward did."""
    with no_autocast(inputs.q_a.device):
        grads = dispatch.backward(grad_kl, inputs, spec, kl, lse_a, lse_b, need_grad_a, need_grad_b, backend,
                                  allow_tf32, deterministic, dq_b)
    return tuple(g if g is None or g.dtype == x.dtype else g.to(x.dtype) for g, x in zip(grads, inputs[:4]))


def sink_gradients(grad_kl, kl, lse_a, lse_b, sink_a, sink_b, need_a: bool, need_b: bool):
    """Gradients of ``Σ grad_kl · KL`` w.r.t. the sink logits ``[H]`` of each side (None where not requested).

    A sink is one more outcome with score ``σ``: ``∂KL/∂σ_b = P_b(σ) − P_a(σ)`` and
    ``∂KL/∂σ_a = P_a(σ)[(σ_a − lse_a) − (σ_b − lse_b) − KL]`` per row, with ``P(σ) = exp(σ − lse)`` (0 on rows
    with no allowed key, whose ``lse`` is +inf), summed over the batch and the rows of each head.

    Example:
        >>> kl, la, lb = torch.zeros(1, 2, 3), torch.zeros(1, 2, 3), torch.zeros(1, 2, 3)
        >>> _, d_b = sink_gradients(torch.ones(1, 2, 3), kl, la, lb, torch.zeros(2), torch.zeros(2), False, True)
        >>> d_b.tolist()  # equal distributions: no gradient
        [0.0, 0.0]
    """
    if not (need_a or need_b) or sink_a is None:
        return None, None
    g = grad_kl.to(kl.dtype)
    sa, sb = sink_a.to(kl.dtype)[None, :, None], sink_b.to(kl.dtype)[None, :, None]
    p_a, p_b = torch.exp(sa - lse_a), torch.exp(sb - lse_b)
    d_a = d_b = None
    if need_b:
        d_b = (g * (p_b - p_a)).sum((0, 2)).to(sink_b.dtype)
    if need_a:
        empty = torch.isposinf(lse_a)
        la, lb = lse_a.masked_fill(empty, 0.0), lse_b.masked_fill(empty, 0.0)
        d_a = (g * p_a * ((sa - la) - (sb - lb) - kl)).sum((0, 2)).to(sink_a.dtype)
    return d_a, d_b


def _save(ctx, inputs: KLInputs, kl, lse_a, lse_b, spec: KLSpec, options, dq_b=None) -> None:
    """Save the inputs, the three per-row statistics and, when the forward fused it, side b's query gradient per
    unit upstream gradient (the only state kept for the backward)."""
    ctx.save_for_backward(*inputs, kl, lse_a, lse_b, dq_b)
    ctx.spec = spec
    ctx.options = options  # (backend, allow_tf32, deterministic)
    ctx.mark_non_differentiable(lse_a, lse_b)


def _backward_from_ctx(ctx, grad_kl, backward_fn) -> tuple:
    """The input gradients (None for non-tensors and for what nobody asked for) via ``backward_fn``."""
    *saved, kl, lse_a, lse_b, dq_b = ctx.saved_tensors
    inputs = KLInputs(*saved)
    need = ctx.needs_input_grad
    need_a, need_b = bool(need[0] or need[1]), bool(need[2] or need[3])
    n_inputs = len(need)
    if grad_kl is None or not any(need[:6]):
        return (None,) * n_inputs
    dq_a, dk_a, dq_b, dk_b, ds_a, ds_b = backward_fn(grad_kl, inputs, ctx.spec, kl, lse_a, lse_b, need_a, need_b,
                                                     bool(need[4]), bool(need[5]), *ctx.options, dq_b)
    side_a = (dq_a, dk_a) if need_a else (None, None)
    side_b = (dq_b, dk_b) if need_b else (None, None)
    sinks = (ds_a if need[4] else None, ds_b if need[5] else None)
    return (*side_a, *side_b, *sinks, *(None,) * (n_inputs - 6))


def _eager_backward(grad_kl, inputs, spec, kl, lse_a, lse_b, need_a, need_b, need_sink_a, need_sink_b, backend,
                    allow_tf32, deterministic, dq_b=None):
    grads = (None,) * 4
    if need_a or need_b:
        grads = backward_impl(grad_kl, inputs, spec, kl, lse_a, lse_b, need_a, need_b, backend, allow_tf32,
                              deterministic, dq_b)
    sinks = sink_gradients(grad_kl, kl, lse_a, lse_b, inputs.sink_a, inputs.sink_b, need_sink_a, need_sink_b)
    return (*grads, *sinks)


class AttentionKLFunction(torch.autograd.Function):
    """Eager autograd of the op: ``apply(q_a, k_a, q_b, k_b, sink_a, sink_b, key_padding_mask, query_mask,
    cu_seqlens_q, cu_seqlens_k, attn_mask, spec, backend, allow_tf32, deterministic[, reduction, rows, fuse_dq_b,
    ahead, lengths]) -> (kl, lse_a, lse_b)`` (``lengths``: :attr:`KLInputs.lengths`); only ``kl`` is differentiable.
    With ``reduction`` "sum" or "mean" (default "none") the first output is the reduced loss instead of the per-row KL
    (see :func:`attention_kl_per_row`). ``fuse_dq_b`` (see :func:`fuses_dq_b`; decided by the caller, since grad mode
    is always off inside ``forward``) makes the forward
    accumulate side b's query gradient, which is then saved for the backward; ``ahead`` (see
    :func:`streamkl.dispatch.gradients_ahead`) makes it compute both of side b's gradients and save only them.

    Example:
        >>> q = torch.randn(1, 2, 5, 8, requires_grad=True)
        >>> spec = KLSpec(scale_a=0.3, scale_b=0.3)
        >>> kl, lse_a, lse_b = AttentionKLFunction.apply(q, q.detach(), q, q.detach() * 2, *[None] * 7, spec,
        ...                                              "reference", False, True)
        >>> kl.sum().backward()
        >>> tuple(q.grad.shape)
        (1, 2, 5, 8)
    """

    @staticmethod
    def forward(ctx, q_a, k_a, q_b, k_b, sink_a, sink_b, key_padding_mask, query_mask, cu_seqlens_q, cu_seqlens_k,
                attn_mask, spec, backend, allow_tf32, deterministic, reduction="none", rows=None, fuse_dq_b=False,
                ahead=False, lengths=None):
        inputs = KLInputs(q_a, k_a, q_b, k_b, sink_a, sink_b, key_padding_mask, query_mask, cu_seqlens_q,
                          cu_seqlens_k, attn_mask, lengths)
        # lse_a/lse_b never get gradients: leave theirs None instead of materialising two zero tensors per backward
        ctx.set_materialize_grads(False)
        ctx.ahead = ahead
        if ahead:  # the gradients are computed now; nothing else is kept
            loss, lse_a, lse_b, dq_b, dk_b, ctx.dq_factor = forward_with_gradients(
                inputs, spec, backend, allow_tf32, deterministic, reduction, rows, defer_count=True)
            ctx.save_for_backward(dq_b, dk_b)
            ctx.input_dtype = q_b.dtype
            ctx.mark_non_differentiable(lse_a, lse_b)
            return loss, lse_a, lse_b
        if fuse_dq_b:
            kl, lse_a, lse_b, dq_b = fused_forward(inputs, spec, backend, allow_tf32)
        else:
            (kl, lse_a, lse_b), dq_b = forward_impl(inputs, spec, backend, allow_tf32), None
        _save(ctx, inputs, kl, lse_a, lse_b, spec, (backend, allow_tf32, deterministic), dq_b)
        ctx.reduction, ctx.rows_shape = reduction, kl.shape
        if reduction == "none":
            return kl, lse_a, lse_b
        loss, ctx.divisor = _reduce(kl, lse_a, reduction, rows)
        return loss, lse_a, lse_b

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_kl, _grad_lse_a, _grad_lse_b):
        if ctx.ahead:
            return _ahead_backward(ctx, grad_kl)
        if ctx.reduction != "none" and grad_kl is not None:
            # the gradient of the reduction, as SumBackward/DivBackward would form it: one number for every row
            # (expanded, stride 0), which the kernels read in place
            if ctx.reduction == "mean":
                grad_kl = grad_kl / ctx.divisor
            grad_kl = grad_kl.expand(ctx.rows_shape)
        return _backward_from_ctx(ctx, grad_kl, _eager_backward)


def _mean_of_all(kl, rows: int):
    """The mean over every row (``rows == kl.numel()``) in one kernel; 0 when there are none (``rows`` is then 1)."""
    return kl.mean() if kl.numel() else kl.sum() / rows


def _reduce(kl, lse_a, reduction: str, rows: int | None):
    """``(loss, divisor)``: ``reduction`` ("sum" | "mean") of the per-row KL, computed exactly as the separate torch
    ops of :func:`reduce_per_row_kl` do (bitwise the same value). ``rows`` is the number of counted rows when the
    host knows it (no row can be empty: every row counts, ``rows == kl.numel()``), and the mean is then ``kl.mean()``,
    one kernel; else None: the count is taken on the device (no synchronisation). ``divisor`` is what the mean
    divided by (None for "sum")."""
    if reduction == "sum":
        return kl.sum(), None
    if rows is not None:
        return _mean_of_all(kl, rows), rows
    divisor = (~torch.isposinf(lse_a)).sum().clamp_min(1).to(kl.dtype)
    return kl.sum() / divisor, divisor


# ------------------------------------------------------------------------------ torch.library custom ops
#: The problem's arguments of every custom op, in this order: the fields of :class:`KLInputs` but ``lengths`` (a
#: compiled call never reads masks, see :func:`_op_tensors`), then those of :class:`KLSpec`, then the execution options.
_TENSORS = len(KLInputs._fields) - 1
_SPEC = len(dataclasses.fields(KLSpec))
_PROBLEM_SCHEMA = ", ".join(
    [f"Tensor{'' if i < 4 else '?'} {name}" for i, name in enumerate(KLInputs._fields[:_TENSORS])]
    + [f"{getattr(field.type, '__name__', field.type)} {field.name}" for field in dataclasses.fields(KLSpec)]
    + ["str backend", "bool allow_tf32", "bool deterministic"])
_PROBLEM_ARGS = _TENSORS + _SPEC + 3


def _problem_of(args: tuple) -> tuple[KLInputs, KLSpec, str, bool, bool]:
    """``(inputs, spec, backend, allow_tf32, deterministic)`` from a custom op's leading problem arguments."""
    return (KLInputs(*args[:_TENSORS]), KLSpec(*args[_TENSORS:_TENSORS + _SPEC]), *args[_TENSORS + _SPEC:_PROBLEM_ARGS])


def _problem_args(inputs: KLInputs, spec: KLSpec, backend: str, allow_tf32: bool, deterministic: bool) -> tuple:
    """A custom op's leading problem arguments (the inverse of :func:`_problem_of`)."""
    return (*_op_tensors(inputs), *dataclasses.astuple(spec), backend, allow_tf32, deterministic)


@torch.library.custom_op("streamkl::attention_kl_fwd", mutates_args=(),
                         schema=f"({_PROBLEM_SCHEMA}, bool fuse_dq_b) -> (Tensor, Tensor, Tensor, Tensor)")
def attention_kl_fwd_op(*args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row ``KL(P_a ‖ P_b)`` plus ``lse_a``/``lse_b`` and, with ``fuse_dq_b``, side b's query gradient per unit
    upstream gradient (else an empty tensor; see the module docstring): ``(*problem, fuse_dq_b)``, the problem's
    arguments as :func:`_problem_args` lists them."""
    (inputs, spec, backend, allow_tf32, _), fuse_dq_b = _problem_of(args), args[_PROBLEM_ARGS]
    if fuse_dq_b and backend != "triton":
        raise ValueError(f"Expected `backend='triton'` with `fuse_dq_b=True`, but got backend={backend!r}.")
    if fuse_dq_b:
        return fused_forward(inputs, spec, backend, allow_tf32)
    return (*forward_impl(inputs, spec, backend, allow_tf32),
            inputs.q_b.new_empty(_EMPTY_SHAPE, dtype=torch.float32))


@attention_kl_fwd_op.register_fake
def _attention_kl_fwd_fake(q_a, k_a, q_b, k_b, *args):
    shape = q_a.shape[:3]
    dtype = result_dtype(q_a, k_a, q_b, k_b)
    if args[-1]:  # fuse_dq_b
        dq_b = q_b.new_empty(q_b.shape, dtype=dispatch.saved_dq_b_dtype(q_b.dtype, q_b.numel()))
    else:
        dq_b = q_b.new_empty(_EMPTY_SHAPE, dtype=torch.float32)
    return (*(q_a.new_empty(shape, dtype=dtype) for _ in range(3)), dq_b)


@torch.library.custom_op(
    "streamkl::attention_kl_bwd", mutates_args=(),
    schema=f"({_PROBLEM_SCHEMA}, Tensor grad_kl, Tensor kl, Tensor lse_a, Tensor lse_b, bool need_grad_a, "
           "bool need_grad_b, bool need_sink_a, bool need_sink_b, Tensor? dq_b) -> (Tensor, Tensor, Tensor, Tensor, "
           "Tensor, Tensor)")
def attention_kl_bwd_op(*args) -> tuple[torch.Tensor, ...]:
    """Gradients of ``Σ grad_kl · KL`` (``(*problem, grad_kl, kl, lse_a, lse_b, need_grad_a, need_grad_b,
    need_sink_a, need_sink_b, dq_b)``); a gradient that was not asked for is an empty tensor (custom ops cannot return
    None). ``dq_b``: the forward's fused query gradient of side b, or None."""
    inputs, spec, backend, allow_tf32, deterministic = _problem_of(args)
    grad_kl, kl, lse_a, lse_b, need_a, need_b, need_sink_a, need_sink_b, dq_b = args[_PROBLEM_ARGS:]
    grads = _eager_backward(grad_kl, inputs, spec, kl, lse_a, lse_b, need_a, need_b, need_sink_a, need_sink_b, backend,
                            allow_tf32, deterministic, dq_b)
    like = (*inputs[:4], kl, kl)
    return tuple(x.new_empty(_EMPTY_SHAPE) if g is None else g for g, x in zip(grads, like))


@attention_kl_bwd_op.register_fake
def _attention_kl_bwd_fake(*args):
    inputs = KLInputs(*args[:_TENSORS])
    _, kl, _, _, need_a, need_b, need_sink_a, need_sink_b, _ = args[_PROBLEM_ARGS:]
    need = (need_a, need_a, need_b, need_b)
    grads = [
        torch.empty_like(x, memory_format=torch.contiguous_format) if n else x.new_empty(_EMPTY_SHAPE)
        for n, x in zip(need, inputs[:4])
    ]
    for n, sink in ((need_sink_a, inputs.sink_a), (need_sink_b, inputs.sink_b)):
        grads.append(torch.empty_like(sink) if n and sink is not None else kl.new_empty(_EMPTY_SHAPE))
    return tuple(grads)


def _setup_context(ctx, inputs, output) -> None:
    tensors, spec, *options = _problem_of(inputs)
    kl, lse_a, lse_b, dq_b = output
    _save(ctx, tensors, kl, lse_a, lse_b, spec, tuple(options), dq_b if inputs[_PROBLEM_ARGS] else None)
    ctx.mark_non_differentiable(dq_b)


def _compiled_backward(grad_kl, inputs, spec, kl, lse_a, lse_b, need_a, need_b, need_sink_a, need_sink_b, backend,
                       allow_tf32, deterministic, dq_b=None):
    return attention_kl_bwd_op(*_problem_args(inputs, spec, backend, allow_tf32, deterministic), grad_kl, kl, lse_a,
                               lse_b, need_a, need_b, need_sink_a, need_sink_b, dq_b)


def _backward(ctx, grad_kl, _grad_lse_a, _grad_lse_b, _grad_dq_b=None):
    return _backward_from_ctx(ctx, grad_kl, _compiled_backward)


attention_kl_fwd_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("streamkl::attention_kl_loss_ahead", mutates_args=(),
                         schema=f"({_PROBLEM_SCHEMA}, str reduction, int rows) -> (Tensor, Tensor, Tensor, Tensor, "
                                "Tensor)")
def attention_kl_loss_ahead_op(*args) -> tuple[torch.Tensor, ...]:
    """:func:`forward_with_gradients` as a custom op (``(*problem, reduction, rows)``, ``rows``: 0 where the count
    is taken on the device): the reduced loss, ``lse_a``, ``lse_b`` and side b's gradients per unit gradient of the
    loss, the only state its backward keeps."""
    (inputs, spec, backend, allow_tf32, deterministic), (reduction, rows) = _problem_of(args), args[_PROBLEM_ARGS:]
    if backend != "triton" or reduction not in ("sum", "mean"):
        raise ValueError(f"Expected `backend='triton'` and reduction 'sum' or 'mean', but got backend={backend!r}, "
                         f"reduction={reduction!r}.")
    return forward_with_gradients(inputs, spec, backend, allow_tf32, deterministic, reduction, rows or None)[:5]


@attention_kl_loss_ahead_op.register_fake
def _attention_kl_loss_ahead_fake(q_a, k_a, q_b, k_b, *args):
    dtype = result_dtype(q_a, k_a, q_b, k_b)
    lse = [q_a.new_empty(q_a.shape[:3], dtype=dtype) for _ in range(2)]
    saved = dispatch.ahead_gradient_dtype(q_b.dtype)
    grads = [torch.empty_like(x, dtype=saved, memory_format=torch.contiguous_format) for x in (q_b, k_b)]
    return q_a.new_empty((), dtype=dtype), *lse, *grads


def _setup_ahead_context(ctx, inputs, output) -> None:
    _, lse_a, lse_b, dq_b, dk_b = output
    ctx.save_for_backward(dq_b, dk_b)
    ctx.input_dtype = inputs[2].dtype
    ctx.dq_factor = None  # (the op applied it)
    ctx.mark_non_differentiable(lse_a, lse_b, dq_b, dk_b)


def _ahead_backward(ctx, grad_loss, *_unused, traced: bool = False):
    """The backward of a call that computed side b's gradients ahead (the Function's and, ``traced``, the custom
    op's)."""
    dq_b, dk_b = scaled_gradients(grad_loss, *ctx.saved_tensors, ctx.needs_input_grad[3], ctx.input_dtype,
                                  ctx.dq_factor, traced)
    return None, None, dq_b, dk_b, *(None,) * (len(ctx.needs_input_grad) - 4)


def _traced_ahead_backward(ctx, grad_loss, *_unused):
    return _ahead_backward(ctx, grad_loss, traced=True)


attention_kl_loss_ahead_op.register_autograd(_traced_ahead_backward, setup_context=_setup_ahead_context)


def _training_path(inputs: KLInputs, backend: str, reduction: str) -> tuple[bool, bool]:
    """``(fuse, ahead)`` of a call on ``inputs`` in the current grad mode: whether its forward accumulates side b's
    query gradient (:func:`streamkl.dispatch.fuses_dq_b`) and whether it computes side b's gradients ahead
    (:func:`streamkl.dispatch.gradients_ahead`)."""
    grad = torch.is_grad_enabled()  # (inside a Function's forward it is always off: decided before)
    fuse = fuses_dq_b(backend, *(grad and x.requires_grad for x in (inputs.q_a, inputs.k_a, inputs.q_b)))
    sinks_train = grad and any(s is not None and s.requires_grad for s in (inputs.sink_a, inputs.sink_b))
    return fuse, gradients_ahead(fuse, reduction, sinks_train)


def attention_kl_per_row(inputs: KLInputs, spec: KLSpec, backend: str, allow_tf32: bool, deterministic: bool,
                         reduction: str = "none", rows: int | None = None):
    """Dispatch: the custom op while ``torch.compile`` traces, the autograd Function in eager mode.

    Returns ``(loss, lse_a, lse_b)``: ``loss`` is the per-row KL for ``reduction="none"``, else its sum or mean
    (over counted rows; ``rows`` is their number when the host knows it). In eager mode the Function reduces
    inside its forward and its backward hands the one upstream gradient straight to the kernels (no separate
    autograd nodes for the reduction); under ``torch.compile`` the reduction is traced as torch ops around the
    custom op (the compiler fuses them), with the same value. A call :func:`streamkl.dispatch.gradients_ahead`
    selects computes side b's gradients in its forward, in both modes (the Function, or the custom op
    ``streamkl::attention_kl_loss_ahead``, which reduces inside).
    """
    fuse, ahead = _training_path(inputs, backend, reduction)
    if ahead and torch.compiler.is_compiling():
        loss, lse_a, lse_b, _, _ = attention_kl_loss_ahead_op(
            *_problem_args(inputs, spec, backend, allow_tf32, deterministic), reduction, rows or 0)
        return loss, lse_a, lse_b
    if torch.compiler.is_compiling():
        problem = _problem_args(inputs, spec, backend, allow_tf32, deterministic)
        kl, lse_a, lse_b, _ = attention_kl_fwd_op(*problem, fuse)
        if reduction == "none":
            return kl, lse_a, lse_b
        if reduction == "mean" and rows is not None:  # every row counts
            return _mean_of_all(kl, rows), lse_a, lse_b
        return reduce_per_row_kl(kl, ~torch.isposinf(lse_a), reduction), lse_a, lse_b
    return AttentionKLFunction.apply(*_op_tensors(inputs), spec, backend, allow_tf32, deterministic, reduction, rows,
                                     fuse, ahead, inputs.lengths)


def _op_tensors(inputs: KLInputs) -> tuple:
    """The fields of ``inputs`` the custom ops take, all but :attr:`KLInputs.lengths`: masks are not read while
    ``torch.compile`` traces (:func:`streamkl.dispatch.read_masks`), so a compiled call never has lengths."""
    return tuple(inputs)[:-1]


# ------------------------------------------------------------------------------ a batch as dense pieces
class _PiecesAhead(torch.autograd.Function):
    """The reduced loss of a batch split into dense pieces (:mod:`streamkl._pieces`: a right-padded batch, packed
    sequences) whose pieces compute side b's gradients ahead (:func:`forward_with_gradients`), as one autograd node:
    ``apply(q_b, k_b, parts, backend, allow_tf32, deterministic, reduction, rows)``, ``q_b``/``k_b`` the whole batch's
    side-b tensors and ``parts`` the pieces (:func:`streamkl._pieces.piece_problems`, views of them). Each piece's
    gradients are written into one buffer per tensor (zero outside the pieces), so the backward returns them without a
    slice's backward per piece.
    """

    @staticmethod
    def forward(ctx, q_b, k_b, parts, backend, allow_tf32, deterministic, reduction, rows):
        saved = dispatch.ahead_gradient_dtype(q_b.dtype)
        dq = torch.zeros(q_b.shape, dtype=saved, device=q_b.device)
        dk = torch.zeros(k_b.shape, dtype=saved, device=k_b.device)
        total = None
        for piece, inputs, spec in parts:
            loss, _, _, dq_piece, dk_piece, _ = forward_with_gradients(inputs, spec, backend, allow_tf32,
                                                                       deterministic, "sum", None)
            dq[piece.batch:piece.batch + 1, :, piece.q_start:piece.q_start + piece.n_q] = dq_piece
            dk[piece.batch:piece.batch + 1, :, piece.k_start:piece.k_start + piece.n_k] = dk_piece
            total = loss if total is None else total + loss
        ctx.save_for_backward(dq, dk)
        ctx.input_dtype = q_b.dtype
        ctx.divisor = rows if reduction == "mean" else None
        return total if ctx.divisor is None else total / rows

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        if ctx.divisor is not None and grad_loss is not None:
            grad_loss = grad_loss / ctx.divisor
        return (*scaled_gradients(grad_loss, *ctx.saved_tensors, ctx.needs_input_grad[1], ctx.input_dtype),
                *(None,) * 6)


def attention_kl_pieces(problem: AttentionKLProblem, pieces: tuple[Piece, ...], backend: str,
                        allow_tf32: bool, deterministic: bool) -> tuple[torch.Tensor, int]:
    """``(result, rows)``: what :func:`streamkl.attention_kl` returns for ``problem`` (its per-row KL ``[B, H, N_q]``,
    sum or mean, as ``problem.reduction`` says) from one call per piece of :mod:`streamkl._pieces` (a right-padded
    batch, packed sequences), and the number of counted rows (every row of every piece). A reduced call that computes
    its gradients ahead (:func:`streamkl.dispatch.gradients_ahead`) is one autograd node (:class:`_PiecesAhead`); any
    other runs each piece through :func:`attention_kl_per_row`.

    Example:
        >>> from streamkl._pieces import Piece
        >>> from streamkl._validation import prepare_problem
        >>> from streamkl.options import AttentionKLOptions
        >>> q = torch.randn(2, 2, 6, 8)
        >>> problem = prepare_problem(q, q, q, q + 1, AttentionKLOptions(reduction="none"))
        >>> kl, rows = attention_kl_pieces(problem, (Piece(0, 0, 6, 0, 6), Piece(1, 0, 4, 0, 4)), "reference", False,
        ...                                True)
        >>> tuple(kl.shape), rows, float(kl[1, :, 4:].abs().sum())
        ((2, 2, 6), 20, 0.0)
    """
    parts = piece_problems(problem, pieces)
    rows = problem.heads * sum(p.n_q for p in pieces)
    reduction = problem.reduction
    first = parts[0][1]
    if _training_path(first, backend, reduction)[1]:
        q_b, k_b = (problem.q_t, problem.k_t) if problem.reverse else (problem.q_s, problem.k_s)
        return _PiecesAhead.apply(q_b, k_b, parts, backend, allow_tf32, deterministic, reduction, rows), rows
    each = "none" if reduction == "none" else "sum"
    results = [attention_kl_per_row(inputs, spec, backend, allow_tf32, deterministic, each)[0]
               for _, inputs, spec in parts]
    if each == "none":
        return per_row_result(problem, parts, results), rows
    total = sum(results[1:], results[0])
    return (total / rows if reduction == "mean" else total), rows
