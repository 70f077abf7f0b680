"""The public op: :func:`attention_kl`, the KL divergence between two attention distributions."""

from __future__ import annotations

import os

import torch

from ._reduction import reduce_per_row_kl
from ._validation import prepare_problem
from .autograd import attention_kl_per_row


def resolve_backend(backend: str, device: torch.device, dtypes: tuple[torch.dtype, ...] = (),
                    head_dims: tuple[int, ...] = ()) -> str:
    """Map ``backend`` ("auto" | "triton" | "reference") to the implementation that will run.

    ``"auto"`` picks the fused Triton kernels for CUDA tensors and the chunked PyTorch reference on
    every other device, and for float64 inputs (the kernels compute in fp32; the reference computes
    float64 in float64). ``"triton"`` on a non-CUDA device is honoured only under Triton's CPU
    interpreter (``TRITON_INTERPRET=1``), which is how CI runs the real kernels. A request the kernels
    cannot serve raises; it is never silently replaced by the reference.

    Example:
        >>> resolve_backend("auto", torch.device("cpu"))
        'reference'
    """
    if backend == "reference":
        return "reference"
    fp64 = torch.float64 in dtypes
    if backend == "auto" and (device.type != "cuda" or fp64):
        return "reference"
    if backend == "triton" and device.type != "cuda" and not triton_interpreter_enabled():
        raise ValueError(
            f"backend='triton' needs CUDA tensors (got tensors on {device}); set TRITON_INTERPRET=1 before "
            "importing triton to run the kernels on the CPU interpreter, or use backend='reference'."
        )
    if fp64:
        raise TypeError(
            "backend='triton' computes in float32 and does not take float64 inputs; use backend='reference' "
            "(or 'auto', which routes float64 there)."
        )
    from ._triton.configs import MAX_HEAD_DIM

    if any(d > MAX_HEAD_DIM for d in head_dims):
        raise ValueError(
            f"The Triton kernels support head dims up to {MAX_HEAD_DIM}, but got D_t, D_s = {head_dims}; "
            "use backend='reference' for larger heads."
        )
    return "triton"


def attention_kl(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    q_s: torch.Tensor,
    k_s: torch.Tensor,
    *,
    causal: bool = False,
    scale_t: float | None = None,
    scale_s: float | None = None,
    temperature: float = 1.0,
    direction: str = "forward",
    reduction: str = "mean",
    key_padding_mask: torch.Tensor | None = None,
    query_mask: torch.Tensor | None = None,
    layout: str = "bhnd",
    backend: str = "auto",
    allow_tf32: bool = False,
    deterministic: bool = True,
    check_finite: bool = False,
) -> torch.Tensor:
    r"""KL divergence between a teacher's and a student's attention distributions, never materialised.

    With teacher scores :math:`a_{ij} = q^t_i \cdot k^t_j \cdot \mathrm{scale}_t / T` and student scores
    :math:`b_{ij} = q^s_i \cdot k^s_j \cdot \mathrm{scale}_s / T`, and :math:`P_t = \mathrm{softmax}(a)`,
    :math:`P_s = \mathrm{softmax}(b)` over the allowed keys of each query row :math:`i`:

    .. math::

        \mathrm{KL}_i = \sum_j P_{t,ij} \,(\log P_{t,ij} - \log P_{s,ij}) \quad (\text{direction="forward"}),
        \qquad \sum_j P_{s,ij} \,(\log P_{s,ij} - \log P_{t,ij}) \quad (\text{"reverse"}).

    The forward pass streams key tiles with online rescaling of both distributions and saves three
    fp32 numbers per row; the backward recomputes the probabilities tile by tile. Memory is ``O(N)``
    per head: no ``N_q × N_k`` map is ever stored.

    Args:
        q_t: teacher queries ``[B, H, N_q, D_t]`` (layout "bhnd") or ``[B, N_q, H, D_t]`` ("bnhd").
        k_t: teacher keys ``[B, H_kt, N_k, D_t]``; ``H`` must be divisible by ``H_kt`` (GQA/MQA: query
            head ``h`` reads key head ``h // (H // H_kt)``).
        q_s: student queries ``[B, H, N_q, D_s]``; ``D_s`` may differ from ``D_t``.
        k_s: student keys ``[B, H_ks, N_k, D_s]``.
        causal: mask keys after the query, aligned to the bottom-right corner when ``N_q != N_k``
            (key ``j`` is allowed for query ``i`` iff ``j <= i + N_k - N_q``). Default: ``False``.
        scale_t: teacher score scale. Default: ``1 / sqrt(D_t)``.
        scale_s: student score scale. Default: ``1 / sqrt(D_s)``.
        temperature: divides both scores, ``> 0`` and finite. Default: ``1.0``.
        direction: ``"forward"`` for KL(P_t‖P_s), ``"reverse"`` for KL(P_s‖P_t). Default: ``"forward"``.
        reduction: ``"none"`` (per-row ``[B, H, N_q]``), ``"sum"`` or ``"mean"`` (over counted rows:
            rows with at least one allowed key that ``query_mask`` keeps; 0 when there are none).
            Default: ``"mean"``.
        key_padding_mask: ``[B, N_k]`` bool, True for real keys. Default: ``None``.
        query_mask: ``[B, N_q]`` bool, False excludes the row (KL 0, zero gradient). Default: ``None``.
        layout: ``"bhnd"`` or ``"bnhd"``; any strides are accepted, nothing is copied. Default: ``"bhnd"``.
        backend: ``"auto"`` (Triton on CUDA, reference elsewhere), ``"triton"`` or ``"reference"``.
            Default: ``"auto"``.
        allow_tf32: let float32 inputs use TF32 tensor-core products (Triton backend). Default: ``False``
            (true fp32 products).
        deterministic: bitwise-reproducible gradients. ``True`` runs the two-pass backward (a key-stationary
            pass for dK, a query-stationary pass for dQ, no atomics), which was also the faster design on an
            H100 at D=64/128 (docs/perf-notes.md). ``False`` runs the one-pass backward that adds dQ with fp32
            atomics (the last bits vary from run to run); it is ignored while
            ``torch.use_deterministic_algorithms(True)`` is on. Default: ``True``.
        check_finite: raise a ValueError naming the first input that holds a NaN or an infinity (costs one
            device synchronisation). Without it, non-finite inputs propagate: the rows they touch come out
            NaN (or inf) and the call never hangs or crashes. Default: ``False``.

    Returns:
        The per-row KL ``[B, H, N_q]`` for ``reduction="none"``, else a scalar; float32 (float64 when an
        input is float64). Rows with no allowed key, or excluded by ``query_mask``, are exactly 0.
        Gradients flow to ``q_s``/``k_s`` and, when they require grad, to ``q_t``/``k_t``.

    Raises:
        TypeError: a non-tensor or integer tensor input, a mask that is not bool, a non-numeric option.
        ValueError: wrong rank, mismatched ``B``/``H``/``N``/``D``, ``H`` not divisible by the key heads,
            masks of the wrong shape or device, mixed devices, an unknown ``direction``/``reduction``/
            ``layout``/``backend``, a temperature that is not finite and > 0.

    Example:
        >>> import torch
        >>> from streamkl import attention_kl
        >>> q_t, k_t = torch.randn(2, 4, 16, 32), torch.randn(2, 4, 16, 32)   # teacher, D_t = 32
        >>> q_s = torch.randn(2, 4, 16, 16, requires_grad=True)                 # student, D_s = 16
        >>> k_s = torch.randn(2, 1, 16, 16, requires_grad=True)                 # one shared key head
        >>> loss = attention_kl(q_t, k_t, q_s, k_s, causal=True)
        >>> loss.backward()
        >>> bool(loss > 0), tuple(q_s.grad.shape), tuple(k_s.grad.shape)
        (True, (2, 4, 16, 16), (2, 1, 16, 16))
    """
    problem = prepare_problem(
        q_t,
        k_t,
        q_s,
        k_s,
        causal=causal,
        scale_t=scale_t,
        scale_s=scale_s,
        temperature=temperature,
        direction=direction,
        reduction=reduction,
        key_padding_mask=key_padding_mask,
        query_mask=query_mask,
        layout=layout,
        backend=backend,
    )
    if not isinstance(check_finite, bool):
        raise TypeError(f"Expected argument `check_finite` to be a bool, but got {type(check_finite).__name__}.")
    if check_finite:
        for name, x in (("q_t", q_t), ("k_t", k_t), ("q_s", q_s), ("k_s", k_s)):
            if not bool(torch.isfinite(x).all()):
                raise ValueError(
                    f"Expected argument `{name}` to hold only finite values (check_finite=True), but it contains "
                    f"{int(torch.isnan(x).sum())} NaN and {int(torch.isinf(x).sum())} infinite entries."
                )
    if not isinstance(allow_tf32, bool):
        raise TypeError(f"Expected argument `allow_tf32` to be a bool, but got {type(allow_tf32).__name__}.")
    if not isinstance(deterministic, bool):
        raise TypeError(f"Expected argument `deterministic` to be a bool, but got {type(deterministic).__name__}.")
    deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
    impl = resolve_backend(
        backend,
        problem.q_t.device,
        (problem.q_t.dtype, problem.q_s.dtype),
        (problem.q_t.shape[-1], problem.q_s.shape[-1]),
    )
    teacher = (problem.q_t, problem.k_t, problem.scale_t)
    student = (problem.q_s, problem.k_s, problem.scale_s)
    (q_a, k_a, scale_a), (q_b, k_b, scale_b) = (student, teacher) if problem.reverse else (teacher, student)
    kl, lse_a, _ = attention_kl_per_row(
        q_a, k_a, q_b, k_b, problem.key_padding_mask, problem.query_mask, problem.causal,
        scale_a, scale_b, impl, allow_tf32, deterministic,
    )
    if problem.reduction == "mean" and _every_row_counts(problem):
        # no mask can empty a row: the count is known on the host (saves four small kernels per call)
        return kl.sum() / max(kl.numel(), 1)
    return reduce_per_row_kl(kl, ~torch.isposinf(lse_a), problem.reduction)


def _every_row_counts(problem) -> bool:
    """True when no row can be empty: no masks, at least one key, and causal rows all see key 0."""
    return (
        problem.key_padding_mask is None
        and problem.query_mask is None
        and problem.n_k > 0
        and (not problem.causal or problem.n_q <= problem.n_k)
    )


def triton_interpreter_enabled() -> bool:
    """True when Triton's CPU interpreter is switched on (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
