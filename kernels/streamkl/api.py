"""The public op: :func:`attention_kl`, the KL divergence between two attention distributions."""

from __future__ import annotations

from typing import Any

import torch

from ._validation import prepare_problem
from .autograd import attention_kl_per_row, attention_kl_pieces
from .dispatch import read_masks, read_offsets, select_backend
from .options import BATCH, EXECUTION, PROBLEM, AttentionKLOptions, KLWithCount, keyword_signature
from .precision import cast_for_autocast, resolve_allow_tf32


def attention_kl(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    q_s: torch.Tensor,
    k_s: torch.Tensor,
    *,
    options: AttentionKLOptions | None = None,
    **kwargs: Any,
) -> torch.Tensor | KLWithCount:
    r"""KL divergence between a teacher's and a student's attention distributions, never materialised.

    With teacher scores :math:`a_{ij} = q^t_i \cdot k^t_j \cdot \mathrm{scale}_t / T` and student scores
    :math:`b_{ij} = q^s_i \cdot k^s_j \cdot \mathrm{scale}_s / T`, and :math:`P_t = \mathrm{softmax}(a)`,
    :math:`P_s = \mathrm{softmax}(b)` over the allowed keys of each query row :math:`i`:

    .. math::

        \mathrm{KL}_i = \sum_j P_{t,ij} \,(\log P_{t,ij} - \log P_{s,ij}) \quad (\text{direction="forward"}),
        \qquad \sum_j P_{s,ij} \,(\log P_{s,ij} - \log P_{t,ij}) \quad (\text{"reverse"}).

    The options that real teachers use change the distributions exactly as their attention does:

    * soft-capping (``softcap_t``/``softcap_s``, Gemma-2): :math:`a_{ij} = c \tanh(q^t_i \cdot k^t_j \cdot
      \mathrm{scale}_t / c) / T`;
    * sinks (``sinks_t``/``sinks_s``, gpt-oss): one more outcome per row with logit :math:`\mathrm{sink}_h / T`
      (never scaled or capped); the KL is then over :math:`N_k + 1` outcomes;
    * a sliding ``window=(left, right)`` (Mistral, Gemma): query :math:`i`, aligned bottom-right to key
      :math:`i' = i + N_k - N_q`, sees keys :math:`i' - \mathrm{left} \le j \le i' + \mathrm{right}` (−1 = unbounded,
      the flash-attn convention; ``causal=True`` sets ``right = 0``);
    * packed sequences (``layout="thd"`` with ``cu_seqlens_q``/``cu_seqlens_k``, flash-attn's varlen convention):
      each sequence is its own problem, bottom-right aligned inside it, and nothing crosses a boundary.

    The forward pass streams key tiles with online rescaling of both distributions and saves three
    fp32 numbers per row; the backward recomputes the probabilities tile by tile. Memory is ``O(N)``
    per head: no ``N_q × N_k`` map is ever stored. Key tiles outside every row's window, and tiles that would
    cross a packed sequence's boundary, are never visited: the cost follows the allowed band, not ``N²``.

    Precision, as torch's own attention: under ``torch.autocast`` the queries and keys are cast once to the autocast
    dtype of their device (float64 stays), as ``F.scaled_dot_product_attention``'s inputs are; the statistics,
    accumulators and the result are float32 whatever the input dtype. float32 inputs outside autocast follow
    ``torch.get_float32_matmul_precision()`` (see ``allow_tf32``). Teacher and student may have different dtypes;
    each side's products use its own.

    The keyword options are the fields of :class:`streamkl.options.AttentionKLOptions` (defined there once; the
    signature lists them all); ``options=`` takes an instance, and keywords given beside it replace its fields.

    Args:
        q_t: teacher queries ``[B, H, N_q, D_t]`` (layout "bhnd"), ``[B, N_q, H, D_t]`` ("bnhd") or
            ``[total_q, H, D_t]`` ("thd").
        k_t: teacher keys ``[B, H_kt, N_k, D_t]`` (or the other layouts' analogue); ``H`` must be divisible by
            ``H_kt`` (GQA/MQA: query head ``h`` reads key head ``h // (H // H_kt)``).
        q_s: student queries ``[B, H, N_q, D_s]``; ``D_s`` may differ from ``D_t``.
        k_s: student keys ``[B, H_ks, N_k, D_s]``.
        causal: mask keys after the query, aligned to the bottom-right corner when ``N_q != N_k``
            (key ``j`` is allowed for query ``i`` iff ``j <= i + N_k - N_q``). Default: ``False``.
        scale_t: teacher score scale. Default: ``1 / sqrt(D_t)``.
        scale_s: student score scale. Default: ``1 / sqrt(D_s)``.
        temperature: divides both scores (and sink logits), ``> 0`` and finite. Default: ``1.0``.
        direction: ``"forward"`` for KL(P_t‖P_s), ``"reverse"`` for KL(P_s‖P_t). Default: ``"forward"``.
        reduction: ``"none"`` (per-row ``[B, H, N_q]``; ``[total_q, H]`` for "thd"), ``"sum"`` or ``"mean"``
            (over counted rows: rows with at least one allowed key that ``query_mask`` keeps, over all sequences;
            0 when there are none). Default: ``"mean"``.
        key_padding_mask: ``[B, N_k]`` bool, True for real keys (not with "thd"), on the inputs' device or on the
            CPU: a mask the host holds (a data collator made it) is read without a device synchronisation where the
            dispatch reads it (an all-True mask is dropped; a right-padded batch splits by row where the call takes no
            Gluon training kernel) and copied to the device without one. Default: ``None``.
        query_mask: ``[B, N_q]`` bool, False excludes the row: KL 0, zero gradient (not with "thd"); on the inputs'
            device or on the CPU, likewise. Default: ``None``.
        layout: ``"bhnd"``, ``"bnhd"`` or ``"thd"``; any strides are accepted, nothing is copied.
            Default: ``"bhnd"``.
        backend: ``"auto"`` (Triton on CUDA, reference elsewhere), ``"triton"`` or ``"reference"``.
            Default: ``"auto"``.
        window: ``(left, right)`` sliding window, ints ``>= -1`` (−1 = unbounded). Default: ``None`` (no window).
        softcap_t: teacher logit soft-cap ``c > 0``, or None. Default: ``None``.
        softcap_s: student logit soft-cap, or None. Default: ``None``.
        sinks_t: teacher sink logits ``[H]`` (one per query head), or None; given on one side only it is an error
            (the sink's mass would have no counterpart). Gradients reach it when it requires grad.
            Default: ``None``.
        sinks_s: student sink logits ``[H]``, or None. Default: ``None``.
        cu_seqlens_q: ``[num_seqs + 1]`` int32 cumulative query offsets (layout "thd"), on the inputs' device or on
            the CPU: offsets the host holds (a data collator made them) are read without a device synchronisation,
            checked, and copied to the device without one. Default: ``None``.
        cu_seqlens_k: ``[num_seqs + 1]`` int32 cumulative key offsets (layout "thd"), likewise. Default: ``None``.
        max_seqlen_q: the longest query sequence (layout "thd"). Default: ``None``: read from ``cu_seqlens_q``,
            which costs a device synchronisation for offsets on the GPU and checks the offsets. With both maxima
            given, offsets on the GPU are trusted, as in flash-attn (the kernels still never read outside the
            tensors); the Gluon training kernels check on the device that no sequence is longer, and fail the call
            (a CUDA device-side assert) where one is.
        max_seqlen_k: the longest key sequence (layout "thd"). Default: ``None``.
        attn_mask: any other mask, ``[B or 1, H or 1, N_q, N_k]`` bool, True = the query may see the key (e.g. a
            prefix-LM or custom block mask a model built); combined with every other mask. It costs an ``N_q × N_k``
            bool read and every tile is masked, so prefer the structured options where they describe the mask
            (not with "thd"). Default: ``None``.
        allow_tf32: whether float32 inputs may use TF32 tensor-core products (Triton backend; the reference
            backend computes IEEE-fp32). Default: ``None``: follow ``torch.get_float32_matmul_precision()`` as
            ``torch.matmul`` does (``"highest"``: IEEE-fp32 products; ``"high"``, ``"medium"``: TF32). Under autocast
            the inputs are cast to the autocast dtype first (as ``F.scaled_dot_product_attention``'s are), so this
            applies only to float32 inputs outside autocast.
        deterministic: bitwise-reproducible gradients. ``True`` runs the two-pass backward (a key-stationary
            pass for dK, a query-stationary pass for dQ, no atomics), which was also the faster design on an
            H100 at D=64/128 (docs/concepts/kernels.md). ``False`` runs the one-pass backward that adds dQ with fp32
            atomics (the last bits vary from run to run); it is ignored while
            ``torch.use_deterministic_algorithms(True)`` is on. With a frozen teacher (``"forward"``, Triton
            backend, grad mode on) neither applies: the forward accumulates ``dQ_s`` itself (saved like ``q_s``, in
            bf16 for bf16 inputs from 32 MiB of fp32 up, else fp32) and the backward runs only the key pass, which is
            deterministic. Default: ``True``.
        check_finite: raise a ValueError naming the first input that holds a NaN or an infinity (costs one
            device synchronisation). Without it, non-finite values in entries a row never sees (padding, masked
            or out-of-window keys, other packed sequences, excluded rows) never reach that row's KL or any
            gradient of an allowed entry (one exception: the Hopper key pass reads the queries of some padding rows,
            excluded rows and the next packed sequence's first rows, and a non-finite value there reaches the
            student's key gradients; docs/guides/real-teachers.md), and a non-finite value in an allowed entry makes
            the rows that see it NaN (or inf), gradients included; the call never hangs or crashes.
            Default: ``False``.
        return_count: also return the number of counted rows (the denominator of ``"mean"``): the result is then a
            :class:`~streamkl.options.KLWithCount` ``(kl, rows)``, ``rows`` a float32 scalar on the inputs' device,
            counted without a host synchronisation. Default: ``False``.
        options: an :class:`~streamkl.options.AttentionKLOptions` holding any of the options above; keywords given
            with it replace its fields. Default: ``None`` (every default).

    Returns:
        The per-row KL ``[B, H, N_q]`` for ``reduction="none"`` (``[total_q, H]`` for layout "thd"), else a
        scalar; float32 (float64 when an input is float64); with ``return_count``, a
        :class:`~streamkl.options.KLWithCount` of it and the counted rows. Rows with no allowed key, or excluded by
        ``query_mask``, are exactly 0. Gradients flow to ``q_s``/``k_s`` (and ``sinks_s``) and, when they require
        grad, to ``q_t``/``k_t``/``sinks_t``.

    Raises:
        TypeError: a non-tensor or integer tensor input, a mask that is not bool, ``cu_seqlens`` that are not
            int32, a non-numeric option, an unknown keyword.
        ValueError: wrong rank, mismatched ``B``/``H``/``N``/``D``, ``H`` not divisible by the key heads,
            masks of the wrong shape or device, mixed devices, an unknown ``direction``/``reduction``/
            ``layout``/``backend``, a temperature or soft-cap that is not finite and > 0, a window bound < −1,
            sinks of the wrong shape or on one side only, offsets that do not start at 0, decrease or do not end
            at the number of tokens, masks with layout "thd".

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

        Two packed documents of 10 and 6 tokens, a 4-token sliding window, a soft-capped teacher with sinks:

        >>> cu = torch.tensor([0, 10, 16], dtype=torch.int32)
        >>> q_t, k_t, q_s, k_s = (torch.randn(16, 4, 8) for _ in range(4))
        >>> per_row = attention_kl(q_t, k_t, q_s, k_s, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu,
        ...                        causal=True, window=(4, 0), softcap_t=30.0, sinks_t=torch.zeros(4),
        ...                        sinks_s=torch.zeros(4), reduction="none")
        >>> tuple(per_row.shape)
        (16, 4)

        The sum and the rows it is over, in one call (what a loss averaged over several calls needs):

        >>> kl_sum, rows = attention_kl(q_t, k_t, q_s, k_s, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu,
        ...                             causal=True, reduction="sum", return_count=True)
        >>> float(rows)  # 16 tokens, 4 heads
        64.0
    """
    opts = AttentionKLOptions.of("attention_kl", options, kwargs)
    q_t, k_t, q_s, k_s = cast_for_autocast(q_t, k_t, q_s, k_s)
    problem, pieces = read_masks(prepare_problem(q_t, k_t, q_s, k_s, opts))
    pieces = pieces or read_offsets(problem)
    if opts.check_finite:
        named = (("q_t", q_t), ("k_t", k_t), ("q_s", q_s), ("k_s", k_s), ("sinks_t", opts.sinks_t),
                 ("sinks_s", opts.sinks_s))
        for name, x in named:
            if x is not None and not bool(torch.isfinite(x).all()):
                raise ValueError(
                    f"Expected argument `{name}` to hold only finite values (check_finite=True), but it contains "
                    f"{int(torch.isnan(x).sum())} NaN and {int(torch.isinf(x).sum())} infinite entries."
                )
    allow_tf32 = resolve_allow_tf32(opts.allow_tf32)
    deterministic = opts.deterministic or torch.are_deterministic_algorithms_enabled()
    impl = select_backend(
        opts.backend,
        problem.q_t.device,
        (problem.q_t.dtype, problem.q_s.dtype),
        (problem.q_t.shape[-1], problem.q_s.shape[-1]),
    )
    if pieces is not None:  # a right-padded batch or packed sequences: each piece as the dense problem it is
        result, counted = attention_kl_pieces(problem, pieces, impl, allow_tf32, deterministic)
        lse_a = None
    else:
        inputs, spec = problem.kernel_problem()
        all_rows = inputs.q_a.shape[0] * inputs.q_a.shape[1] * inputs.q_a.shape[2]
        # no row can be empty: the count is known on the host (saves four small kernels per call)
        counted = all_rows if problem.every_row_counts() else None
        rows = max(all_rows, 1) if problem.reduction == "mean" and counted is not None else None
        # "sum"/"mean" are reduced inside the op (one autograd node, the upstream gradient read without a copy)
        result, lse_a, _ = attention_kl_per_row(inputs, spec, impl, allow_tf32, deterministic, problem.reduction,
                                                rows)
    if problem.reduction == "none" and problem.packed:
        result = result[0].transpose(0, 1)  # (1, H, total) -> [total_q, H]
    if not opts.return_count:
        return result
    if counted is not None:
        count = torch.full((), float(counted), dtype=torch.float32, device=result.device)
    else:  # a row counts when it has an allowed key that the query mask keeps: its lse is finite (or NaN)
        count = (~torch.isposinf(lse_a)).sum().to(torch.float32)
    return KLWithCount(result, count)

attention_kl.__signature__ = keyword_signature(attention_kl, (PROBLEM, BATCH, EXECUTION))


def chunked_attention_kl(*args, **kwargs) -> torch.Tensor:
    """:func:`attention_kl` forced onto the chunked PyTorch backend (``backend="reference"``).

    Example:
        >>> q, k = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
        >>> float(chunked_attention_kl(q, k, q, k, causal=True))
        0.0
    """
    if "backend" in kwargs:
        raise TypeError("chunked_attention_kl() always uses backend='reference'; do not pass `backend`.")
    return attention_kl(*args, backend="reference", **kwargs)
