r"""
Dispatch
^^^^^^^^

Which implementation computes a call, decided in one table (:data:`TABLE`) from the device, the dtypes, the shapes
and the options: the backend (the chunked PyTorch reference or the Triton kernels), then, on the Triton backend, the
kernel of each stage of the op:

* ``forward``: the forward of a call without a fused query gradient (a metric, or a training call whose teacher
  trains too);
* ``training forward``: the forward of a training call with a frozen side a (the teacher, for ``direction="forward"``),
  which also accumulates side b's query gradient (:func:`fuses_dq_b`);
* ``key pass``: the backward pass that computes the key gradients;
* ``query gradient``: how the backward gets the query gradients;
* ``indexer``: the sparse-attention indexer loss (:func:`streamkl.indexer_kl`), whose backend follows the same rows.

Every stage's rows are tried in order and the first that applies runs. A row applies when its device requirement
holds (the Gluon kernels: a CUDA sm_90 device and a Triton whose Gluon API imports), its ``scope`` (what the kernel
can compute) holds and its ``pays`` (where it measured faster than the next row) holds; the last row of a stage
always applies. A stage with Gluon rows remembers its choice for a problem they may take, by everything its rows read
(:func:`select`). :func:`table_markdown` renders the table (docs/concepts/architecture.md shows it).

The one override, :func:`forced`, is for tests and benchmarks: ``forced("portable")`` keeps every call on the portable
kernels, ``forced("gluon")`` takes a Gluon kernel wherever one can compute the call, whatever its size and head dims.

This module imports no Triton: the kernels are imported when a call first needs them.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch

from . import indexer_reference, reference
from ._pieces import Piece, packed_pieces, padded_lengths, padded_pieces, piece_problems
from ._problem import AttentionKLProblem, KLInputs, KLSpec, key_head_split
from ._triton_common.interpreter import triton_interpreter_enabled

__all__ = [
    "FORCE_CHOICES",
    "GLUON_HEAD_DIMS",
    "GLUON_MIN_SCORES",
    "TABLE",
    "BackendQuery",
    "Problem",
    "Route",
    "ahead_gradient_dtype",
    "backward",
    "forced",
    "forward",
    "fuses_dq_b",
    "gradients_ahead",
    "in_scope",
    "indexer_backward",
    "indexer_forward",
    "new_dq_b_buffer",
    "read_masks",
    "read_offsets",
    "saved_dq_b_dtype",
    "scaled_copies",
    "select",
    "select_backend",
    "table_markdown",
    "triton_interpreter_enabled",
]

#: Problems with fewer score elements per distribution (``B·H·N_q·N_k``) stay on the portable kernels: below it the
#: Gluon kernels' launch (four TMA descriptors, about twice a portable launch's host time) is not hidden.
GLUON_MIN_SCORES = 1 << 28
#: The head dims (each side) the Gluon kernels are built for.
GLUON_HEAD_DIMS = (64, 128)
#: The values of :func:`forced`.
FORCE_CHOICES = ("portable", "gluon")
_GLUON_DTYPES = (torch.bfloat16, torch.float16)

_forced: list[str] = []


class BackendQuery(NamedTuple):
    """What the backend is chosen from: the ``backend`` option, the inputs' device and whether an input is float64."""

    backend: str
    device: torch.device
    float64: bool


class Problem(NamedTuple):
    """What a kernel is chosen from: the direction-free problem ``KL(P_a ‖ P_b)`` (:mod:`streamkl._problem`), which
    sides need gradients, whether the call asked for a deterministic backward (``deterministic=True`` or torch's
    deterministic mode), whether its forward accumulated side b's query gradient (``fused``) and, in the backward,
    whether the upstream gradient is one number for every row (``scalar_grad``: ``reduction="mean"``/``"sum"``)."""

    inputs: KLInputs
    spec: KLSpec
    need_a: bool = False
    need_b: bool = False
    deterministic: bool = True
    fused: bool = False
    scalar_grad: bool = True


@dataclass(frozen=True)
class Route:
    """One row of :data:`TABLE`: in ``stage``, ``kernel`` (its code in ``source``, below ``kernels/streamkl``) runs
    where ``device``, ``dtype`` and ``when`` say.

    ``scope`` (any device) and ``pays`` are the row's conditions as code (None: always); ``gluon`` rows also need a
    CUDA sm_90 device with a usable Gluon. ``impl`` is the module (below ``streamkl``) and function that run it, with
    the keyword arguments that pick the kernel's variant; None where the row is a part of the portable backward.
    """

    stage: str
    kernel: str
    source: str
    device: str
    dtype: str
    when: str
    impl: tuple[str, str, tuple[tuple[str, Any], ...]] | None = None
    scope: Callable[[Any], bool] | None = None
    pays: Callable[[Any], bool] | None = None
    gluon: bool = False


# ---------------------------------------------------------------------------------------------- the conditions
def _picks_reference(q: BackendQuery) -> bool:
    return q.backend == "reference" or (q.backend == "auto" and (q.device.type != "cuda" or q.float64))


def _scores(p: Problem) -> int:
    """``B·H·N_q·N_k``; packed sequences: ``H·N_q·max_seqlen_k``, a bound on their score elements."""
    q_a, k_a = p.inputs.q_a, p.inputs.k_a
    keys = k_a.shape[2] if p.inputs.cu_seqlens_q is None else p.spec.max_seqlen_k
    return q_a.shape[0] * q_a.shape[1] * q_a.shape[2] * keys


def _large(p: Problem) -> bool:
    return _scores(p) >= GLUON_MIN_SCORES


def _tma_ready(x: torch.Tensor) -> bool:
    """A TMA descriptor can address ``x``: bf16/fp16, unit last stride, 16-byte aligned base and other strides."""
    return (x.dtype in _GLUON_DTYPES and x.stride(-1) == 1 and x.data_ptr() % 16 == 0
            and all((s * x.element_size()) % 16 == 0 for s in x.stride()[:-1]))


def _dense(p: Problem) -> bool:
    """What every Gluon kernel needs: dense ``(B, H, N, D)`` tensors a TMA descriptor can address, one dtype on both
    sides, head dims in :data:`GLUON_HEAD_DIMS`; no masks, sinks, packing, soft-caps or windows; causal only with
    ``N_k >= N_q`` (every row sees a key)."""
    return (p.spec.window_left < 0 and p.inputs.sink_a is None and p.inputs.cu_seqlens_q is None
            and p.inputs.lengths is None and _training_dense(p))


def _training_dense(p: Problem) -> bool:
    """:func:`_dense`, or the same with a causal sliding window (``window_left >= 0``, ``window_right == 0``), bf16
    sinks, packed sequences, a masked batch, or any of them together (gpt-oss's layers; long-context packs; a Hugging
    Face batch of unequal sequences): what the training kernels (the training forward and the key passes) compute.
    Packed sequences need one offsets tensor for queries and keys (``cu_seqlens_q is cu_seqlens_k``, as self-attention
    passes them; offsets given on the CPU are one device tensor where their values agree), so that every sequence has as
    many keys as rows; ``key_padding_mask`` and ``query_mask`` need each batch row's lengths (:attr:`KLInputs.lengths`,
    which :func:`read_masks` sets). (fp16 with sinks, whose epilogue meets the fp16 query gradient's per-row scale,
    stays on the portable kernels: the GPU suite has not checked it.)"""
    i, spec = p.inputs, p.spec
    if i.attn_mask is not None or (i.lengths is None and (i.key_padding_mask is not None or i.query_mask is not None)):
        return False
    if i.cu_seqlens_q is not None and i.cu_seqlens_q is not i.cu_seqlens_k:
        return False
    if i.sink_a is not None and i.q_a.dtype != torch.bfloat16:
        return False
    if spec.softcap_a or spec.softcap_b or spec.window_right > 0 or (spec.window_left >= 0 and spec.window_right != 0):
        return False
    if spec.window_right == 0 and i.k_a.shape[2] < i.q_a.shape[2]:
        return False
    tensors = (i.q_a, i.k_a, i.q_b, i.k_b)
    return (all(x.dtype == i.q_a.dtype and _tma_ready(x) for x in tensors)
            and i.q_a.shape[-1] in GLUON_HEAD_DIMS and i.q_b.shape[-1] in GLUON_HEAD_DIMS)


def _widest(p: Problem) -> int:
    return max(p.inputs.q_a.shape[-1], p.inputs.q_b.shape[-1])


def _gluon_forward_pays(p: Problem) -> bool:
    """Measured faster than the portable forward where the products weigh as much as the exponentials: head dim 128
    (either side), at :data:`GLUON_MIN_SCORES` and more."""
    return _large(p) and _widest(p) >= 128


def _key_pass_scope(p: Problem) -> bool:
    """The Gluon key passes compute side b's key gradient alone (side a frozen), never beside atomic query
    gradients; bf16, or fp16 with a scalar upstream gradient (their fixed fp16 scale bounds ``|dS|`` by 1), and each
    program's query heads must share a teacher key head (:func:`key_head_split`)."""
    if p.need_a or not p.need_b or not (p.deterministic or p.fused) or not _training_dense(p):
        return False
    if p.inputs.q_a.dtype == torch.float16 and not p.scalar_grad:
        return False
    heads = p.inputs.q_a.shape[1]
    return key_head_split(heads // p.inputs.k_a.shape[1], heads // p.inputs.k_b.shape[1]) is not None


def _warp_specialised_case(p: Problem) -> bool:
    return p.spec.window_right == 0 and _widest(p) > 64


def _ws_key_pass_scope(p: Problem) -> bool:
    return _key_pass_scope(p) and _warp_specialised_case(p)


def _pipelined_key_pass_scope(p: Problem) -> bool:
    return _key_pass_scope(p) and not _warp_specialised_case(p) and p.inputs.q_b.shape[-1] <= 64


def _stepwise_key_pass_scope(p: Problem) -> bool:
    return _key_pass_scope(p) and not _warp_specialised_case(p) and p.inputs.q_b.shape[-1] > 64


_PORTABLE = "any CUDA GPU; the CPU under TRITON_INTERPRET=1"
_SM90 = "CUDA sm_90 (Hopper), Gluon available"
_LARGE = "B·H·N_q·N_k ≥ 2^28 (packed: H·N_q·max_seqlen_k)"
_KEY_PASS_DTYPES = "bf16; fp16 with one upstream gradient for every row"
_DENSE = ("dense (B, H, N, D) tensors TMA can address, head dims 64 or 128, no masks, sinks, packing, soft-caps or "
          "windows; causal only with N_k ≥ N_q")
_TRAINING_DENSE = ("dense (B, H, N, D) tensors TMA can address, or packed sequences with one offsets tensor for "
                   "queries and keys, head dims 64 or 128, no masks but key_padding_mask and query_mask with their "
                   "lengths (read_masks), no "
                   "soft-caps; sinks (bf16) or none; causal only with N_k ≥ N_q, with or without a sliding window "
                   "(window_left ≥ 0)")

#: The dispatch table: every stage's rows, in the order they are tried (see the module docstring).
TABLE: tuple[Route, ...] = (
    Route("backend", "reference", "reference.py, indexer_reference.py", "any", "any",
          'backend="reference"; or backend="auto" with tensors off CUDA or a float64 input (both ops)',
          scope=_picks_reference),
    Route("backend", "triton", "_triton/, _hopper/", _PORTABLE, "fp16, bf16, fp32",
          'otherwise (backend="triton" or "auto"); head dims ≤ 256 (the indexer: also ≤ 128 indexer heads)'),
    Route("indexer", "triton_indexer", "_triton/indexer_forward.py, _triton/indexer_backward.py", _PORTABLE,
          "fp16, bf16, fp32", "indexer_kl on the Triton backend: its one pair of kernels"),
    Route("forward", "gluon_forward", "_hopper/forward.py", _SM90, "bf16 or fp16, one dtype on both sides",
          f"{_DENSE}; {_LARGE} and a head dim of 128 (either side)",
          impl=("_hopper.forward", "attention_kl_fwd_hopper", ()), scope=_dense, pays=_gluon_forward_pays,
          gluon=True),
    Route("forward", "triton_forward", "_triton/forward.py", _PORTABLE, "fp16, bf16, fp32", "otherwise",
          impl=("_triton.forward", "attention_kl_fwd", ())),
    Route("training forward", "gluon_training_forward", "_hopper/fused_forward.py", _SM90,
          "bf16 or fp16, one dtype on both sides",
          f"a training call with side a frozen (fuses_dq_b); {_TRAINING_DENSE}; {_LARGE}",
          impl=("_hopper.fused_forward", "attention_kl_fused_fwd_hopper", ()), scope=_training_dense,
          pays=_large, gluon=True),
    Route("training forward", "triton_training_forward", "_triton/forward.py", _PORTABLE, "fp16, bf16, fp32",
          "otherwise",
          impl=("_triton.forward", "attention_kl_fwd", ())),
    Route("key pass", "gluon_key_pass_warp_specialised", "_hopper/key_pass_ws.py", _SM90, _KEY_PASS_DTYPES,
          f"a backward of side b alone (side a frozen), no atomic dQ; {_TRAINING_DENSE}; key-head groupings that "
          f"divide each other; causal with a head dim above 64; {_LARGE}",
          impl=("_hopper.backward", "attention_kl_key_pass_hopper", (("specialised", True), ("overlap", False))),
          scope=_ws_key_pass_scope, pays=_large, gluon=True),
    Route("key pass", "gluon_key_pass_pipelined", "_hopper/backward.py", _SM90, _KEY_PASS_DTYPES,
          f"as the warp-specialised row, but not causal with a head dim above 64; D_b ≤ 64 (the next step's "
          f"products in flight); {_LARGE}",
          impl=("_hopper.backward", "attention_kl_key_pass_hopper", (("specialised", False), ("overlap", True))),
          scope=_pipelined_key_pass_scope, pays=_large, gluon=True),
    Route("key pass", "gluon_key_pass_stepwise", "_hopper/backward.py", _SM90, _KEY_PASS_DTYPES,
          f"as the warp-specialised row, but not causal with a head dim above 64; D_b > 64 (one step at a time: "
          f"two in flight would spill); {_LARGE}",
          impl=("_hopper.backward", "attention_kl_key_pass_hopper", (("specialised", False), ("overlap", False))),
          scope=_stepwise_key_pass_scope, pays=_large, gluon=True),
    Route("key pass", "triton_key_pass", "_triton/backward.py", _PORTABLE, "fp16, bf16, fp32", "otherwise"),
    Route("query gradient", "from_training_forward", "_triton/backward.py", "any", "any",
          "the training forward accumulated it: its buffer, times the upstream gradient unless the forward applied "
          "one the host knew (a sum's, a mean's over rows the host counts)", scope=lambda p: p.fused),
    Route("query gradient", "triton_atomic_dq", "_triton/backward.py", _PORTABLE, "fp16, bf16, fp32",
          "deterministic=False (and torch's deterministic mode off): added up in the key pass with fp32 atomics",
          scope=lambda p: not p.deterministic),
    Route("query gradient", "triton_query_pass", "_triton/backward.py", _PORTABLE, "fp16, bf16, fp32",
          "otherwise: a query-stationary pass, no atomics"),
)

_STAGES: dict[str, tuple[Route, ...]] = {}
for _route in TABLE:
    _STAGES.setdefault(_route.stage, ())
    _STAGES[_route.stage] += (_route,)


# ---------------------------------------------------------------------------------- masks and offsets read on the host
def read_masks(problem: AttentionKLProblem) -> tuple[AttentionKLProblem, tuple[Piece, ...] | None]:
    """``(problem, pieces)``: ``problem`` as its kernels take its ``key_padding_mask`` and ``query_mask``.

    * Where the masked call's forward takes a Gluon training kernel, which runs the whole batch in one launch: the
      masks with the lengths of each batch row's dense problem (:func:`streamkl._pieces.padded_lengths`), computed on
      the device, without a synchronisation (masks given on the CPU: on the host, and those that keep everything are
      dropped). A right-padded row sweeps its prefixes; any other row all its tokens, reading its masks.
    * Else the masks are read on the host: dropped where they allow every key and row, and, where every mask left
      keeps a prefix of each batch row (a right-padded batch), the call split into the dense problem each batch row
      is (:func:`streamkl._pieces.padded_pieces`; else None) where the pieces pay. A mask sends the call to the
      portable kernels and costs a load per tile; the Hugging Face batch of equal-length sequences carries an
      all-True one, and a padded batch a prefix per row.

    Only on CUDA problems of at least :data:`GLUON_MIN_SCORES` score elements: reading masks on the GPU on the host
    costs one device synchronisation (as transformers' own check before sdpa; a second one checks the prefixes of a
    batch that would split), so smaller problems, whose host time is their cost, keep them; so do calls under
    ``torch.compile`` tracing and CUDA-graph capture. Masks given on the CPU (``AttentionKLProblem.host_masks``) are
    read there, with no synchronisation.

    Example:
        >>> from streamkl._validation import prepare_problem
        >>> from streamkl.options import AttentionKLOptions
        >>> q = torch.randn(1, 2, 8, 64)
        >>> opts = AttentionKLOptions.of("attention_kl", None, {"key_padding_mask": torch.ones(1, 8, dtype=torch.bool)})
        >>> problem, pieces = read_masks(prepare_problem(q, q, q, q, opts))
        >>> problem.key_padding_mask is None, pieces  # a CPU tensor: kept
        (False, None)
    """
    if not _reads_masks(problem):
        return problem, None
    present = {name: getattr(problem, name) for name in ("key_padding_mask", "query_mask")}
    present = {name: m for name, m in present.items() if m is not None}
    on_host = problem.host_masks is not None and problem.host_masks.keys() == present.keys()
    if on_host:
        present = problem.host_masks  # every mask given on the CPU: read there, without a synchronisation
    if _takes_gluon_with_lengths(problem):
        if on_host:  # (masks that keep everything go: the dense kernels run)
            problem = replace(problem, **{name: None for name, m in present.items() if bool(m.all())})
            present = {name: m for name, m in present.items() if getattr(problem, name) is not None}
        if not present:
            return replace(problem, host_masks=None), None
        lengths = padded_lengths(problem, present.get("query_mask"), present.get("key_padding_mask"))
        return replace(problem, host_masks=None, lengths=lengths.to(problem.q_t.device, non_blocking=True)), None
    kept = {name: m.sum(1) for name, m in present.items()}  # per mask and batch row: the entries it keeps
    lengths = dict(zip(kept, torch.stack(list(kept.values())).tolist()))  # one synchronisation for both masks
    full = {name: all(n == present[name].shape[1] for n in row) for name, row in lengths.items()}
    problem = replace(problem, host_masks=None, **{name: None for name in present if full[name]})
    if all(full.values()):
        return problem, None
    pieces = padded_pieces(problem, lengths.get("query_mask"), lengths.get("key_padding_mask"))
    if pieces is None or not _pieces_pay(problem.heads, pieces):
        return problem, None
    # the lengths hold for a right-padded batch only where each mask keeps the first entries of every row (the flag
    # of padded_lengths; a second synchronisation, taken only for a batch that would split)
    partial = {name: m for name, m in present.items() if not full[name]}
    if bool(padded_lengths(problem, partial.get("query_mask"), partial.get("key_padding_mask"))[2].any()):
        return problem, None
    return replace(problem, key_padding_mask=None, query_mask=None), pieces


def _takes_gluon_with_lengths(problem: AttentionKLProblem) -> bool:
    """Whether the masked call on ``problem`` (no ``attn_mask``, not packed) runs its forward on a Gluon training
    kernel once it has its lengths (:func:`read_masks`), called in the current grad mode."""
    if problem.attn_mask is not None or problem.packed:
        return False
    lengths = torch.empty((3, problem.batch), dtype=torch.int32)  # (its presence is what the scope reads)
    return _forward_takes_gluon(*replace(problem, lengths=lengths).kernel_problem())


def _pieces_pay(heads: int, pieces: tuple[Piece, ...]) -> bool:
    """Whether running a batch as its pieces measured faster than reading its masks or offsets in the kernels: where
    the pieces are :data:`GLUON_MIN_SCORES` score elements on average. Each piece is a call of its own, whose host time
    (a call's validation, autograd and launches) smaller pieces do not hide.

    Example:
        >>> from streamkl._pieces import Piece
        >>> _pieces_pay(16, (Piece(0, 0, 8192, 0, 8192), Piece(1, 0, 2458, 0, 2458)))
        True
        >>> _pieces_pay(16, (Piece(0, 0, 2048, 0, 2048),) * 32)
        False
    """
    return sum(heads * p.n_q * p.n_k for p in pieces) >= GLUON_MIN_SCORES * len(pieces)


def read_offsets(problem: AttentionKLProblem) -> tuple[Piece, ...] | None:
    """The dense problem each packed sequence of ``problem`` is (:func:`streamkl._pieces.packed_pieces`), where running
    them so pays: the packed call's own forward is not a Gluon kernel's (the Gluon training kernels take packed
    sequences in one launch, without reading the offsets), the pieces are large on average (:func:`_pieces_pay`) and
    the largest takes a Gluon kernel (the dense one runs on Gluon where it is large enough); else None.

    Only on CUDA problems whose heads times tokens times longest sequence, over the number of sequences (a bound,
    known without reading the offsets, on the score elements per sequence) reach :data:`GLUON_MIN_SCORES`: reading
    offsets that are on the GPU costs one device synchronisation (as flash-attn's varlen callers take one for the
    longest sequence), so packs that cannot split keep the packed layout without it; so do calls under
    ``torch.compile`` tracing and CUDA-graph capture. Offsets given on the CPU are read without one
    (``AttentionKLProblem.host_offsets``).

    Example:
        >>> from streamkl._validation import prepare_problem
        >>> from streamkl.options import AttentionKLOptions
        >>> q, cu = torch.randn(10, 2, 16), torch.tensor([0, 6, 10], dtype=torch.int32)
        >>> opts = AttentionKLOptions(causal=True, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu)
        >>> read_offsets(prepare_problem(q, q, q, q, opts)) is None  # a CPU tensor: the packed layout
        True
    """
    if not _reads_offsets(problem) or _forward_takes_gluon(*problem.kernel_problem()):
        return None
    offsets_q, offsets_k = problem.host_offsets or torch.stack([problem.cu_seqlens_q, problem.cu_seqlens_k]).tolist()
    pieces = packed_pieces(problem, offsets_q, offsets_k)
    if pieces is None or not _pieces_pay(problem.heads, pieces) or not _largest_takes_gluon(problem, pieces):
        return None
    return pieces


def _reads_offsets(problem: AttentionKLProblem) -> bool:
    """Whether :func:`read_offsets` reads the offsets of ``problem`` (see there)."""
    q = problem.q_t
    return not (not problem.packed or not q.is_cuda or torch.compiler.is_compiling()
                or torch.cuda.is_current_stream_capturing()) and _sequences_could_pay(problem)


def _sequences_could_pay(problem: AttentionKLProblem) -> bool:
    """Whether the sequences of the packed ``problem`` can be :data:`GLUON_MIN_SCORES` score elements on average
    (:func:`_pieces_pay`), from what the host knows without reading the offsets: the heads, the query tokens, the
    longest key sequence and the number of sequences.

    Example:
        >>> from streamkl._validation import prepare_problem
        >>> from streamkl.options import AttentionKLOptions
        >>> q, cu = torch.randn(32768, 16, 64), torch.tensor([0, 16384, 32768], dtype=torch.int32)
        >>> opts = AttentionKLOptions(layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu)
        >>> _sequences_could_pay(prepare_problem(q, q, q, q, opts))
        True
    """
    bound = problem.heads * problem.n_q * problem.max_seqlen_k  # Σ_i n_q,i · n_k,i <= N_q · max n_k,i
    return bound >= GLUON_MIN_SCORES * (problem.cu_seqlens_q.shape[0] - 1)


def _largest_takes_gluon(problem: AttentionKLProblem, pieces: tuple[Piece, ...]) -> bool:
    """Whether the largest of ``pieces`` runs its forward on a Gluon kernel, called in the current grad mode."""
    _, inputs, spec = piece_problems(problem, (max(pieces, key=lambda p: p.n_q * p.n_k),))[0]
    return _forward_takes_gluon(inputs, spec)


def _forward_takes_gluon(inputs: KLInputs, spec: KLSpec) -> bool:
    """Whether a call on ``inputs`` runs its forward on a Gluon kernel, called in the current grad mode."""
    grad = torch.is_grad_enabled()
    fused = fuses_dq_b("triton", *(grad and x.requires_grad for x in (inputs.q_a, inputs.k_a, inputs.q_b)))
    return select("training forward" if fused else "forward", Problem(inputs, spec, fused=fused)).gluon


def _reads_masks(problem: AttentionKLProblem) -> bool:
    """Whether :func:`read_masks` reads the masks of ``problem`` (see there)."""
    # (no assignment expression here: dynamo traces this function under torch.compile(fullgraph=True))
    q = problem.q_t
    if problem.key_padding_mask is None and problem.query_mask is None:
        return False
    return not (not q.is_cuda or torch.compiler.is_compiling()
                or q.shape[0] * q.shape[1] * q.shape[2] * problem.k_t.shape[2] < GLUON_MIN_SCORES
                or torch.cuda.is_current_stream_capturing())


# ---------------------------------------------------------------------------------------------- the override
@contextlib.contextmanager
def forced(kernels: str) -> Iterator[None]:
    """For tests and benchmarks: inside the block, ``"portable"`` keeps every call on the portable Triton kernels and
    ``"gluon"`` takes a Gluon kernel wherever one can compute the call, whatever its size and head dims (the rows'
    ``pays`` conditions are skipped; their ``scope`` and device still hold).

    The setting is process-wide (a backward that autograd runs on its device thread sees it) and blocks nest; it is
    the only override of :data:`TABLE`, and no environment variable changes the dispatch.

    Example:
        >>> q = torch.randn(1, 2, 8, 64)
        >>> with forced("portable"):
        ...     select("forward", Problem(KLInputs(q, q, q, q, *[None] * 6), KLSpec(0.125, 0.125))).kernel
        'triton_forward'
    """
    if kernels not in FORCE_CHOICES:
        raise ValueError(f"Expected argument `kernels` to be one of {list(FORCE_CHOICES)}, but got {kernels!r}.")
    _forced.append(kernels)
    try:
        yield
    finally:
        _forced.pop()


# ---------------------------------------------------------------------------------------------- choosing
@functools.lru_cache(maxsize=16)
def _is_sm90(index: int) -> bool:
    major, _ = torch.cuda.get_device_capability(index if index >= 0 else None)
    return major == 9


@functools.lru_cache(maxsize=8)
def _module(name: str):
    """``streamkl.<name>``, or None for a Gluon module this Triton cannot import (Gluon's Hopper API differs between
    Triton releases; the portable kernels never depend on it)."""
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except (ImportError, AttributeError):
        return None


def _gluon_device(x: torch.Tensor) -> bool:
    """Whether ``x`` is on a device the Gluon kernels run on: CUDA, sm_90."""
    return x.is_cuda and _is_sm90(-1 if x.device.index is None else x.device.index)


def _applies(route: Route, query: Any, forcing: str | None) -> bool:
    if route.gluon:
        if forcing == "portable" or not _gluon_device(query.inputs.q_a):
            return False
        if route.impl is not None and _module(route.impl[0]) is None:
            return False
    # the size condition first: it reads shapes only, and turns every Gluon row down for a short call before the
    # scope reads strides and options (the host time of a short call is the op's cost there)
    if route.pays is not None and forcing != "gluon" and not route.pays(query):
        return False
    return route.scope is None or route.scope(query)


def select(stage: str, query: Any) -> Route:
    """The row of :data:`TABLE` that runs ``stage`` for ``query`` (a :class:`BackendQuery` for ``"backend"``, else a
    :class:`Problem`).

    A stage with Gluon rows remembers its choice for a problem they may take (from :data:`GLUON_MIN_SCORES` score
    elements, or forced) by :func:`_conditions_read`: their scopes read the four tensors' strides and alignment,
    several times over a stage, on every call of a training loop otherwise.

    Example:
        >>> q = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16)  # CPU tensors: never a Gluon kernel
        >>> select("key pass", Problem(KLInputs(q, q, q, q, *[None] * 6), KLSpec(0.125, 0.125), need_b=True)).kernel
        'triton_key_pass'
    """
    forcing = _forced[-1] if _forced else None
    # below the size threshold no Gluon row pays and the walk reads shapes only: nothing worth remembering
    remembered = stage in _REMEMBERED_STAGES and (forcing == "gluon" or _large(query))
    key = _conditions_read(stage, query, forcing) if remembered else None
    route = _CHOSEN.get(key) if key is not None else None
    if route is not None:
        return route
    for route in _STAGES[stage]:
        if _applies(route, query, forcing):
            if key is not None:
                if len(_CHOSEN) >= _MAX_CHOSEN:  # shapes that change every call (packed pieces): stay bounded
                    _CHOSEN.clear()
                _CHOSEN[key] = route
            return route
    raise AssertionError(f"no row of stage {stage!r} applies")  # the last row of every stage always does


#: The stages whose choice :func:`select` remembers: those with Gluon rows, whose scopes read strides.
_REMEMBERED_STAGES = frozenset(r.stage for r in TABLE if r.gluon)
#: Remembered choices (:func:`select`); emptied when full.
_CHOSEN: dict[tuple, Route] = {}
_MAX_CHOSEN = 4096


def _conditions_read(stage: str, p: Problem, forcing: str | None) -> tuple:
    """Everything the conditions of ``stage``'s rows read from ``p``, as a hashable key: the four tensors' dtypes,
    shapes, strides and 16-byte alignment, which optional tensors are present, whether queries and keys share one
    offsets tensor, the options, the flags, whether the device runs Gluon kernels, the override and the size
    threshold."""
    i = p.inputs
    return (stage, forcing, GLUON_MIN_SCORES, _gluon_device(i.q_a),
            *[(x.dtype, x.shape, x.stride(), x.data_ptr() % 16) for x in (i.q_a, i.k_a, i.q_b, i.k_b)],
            *[x is None for x in i[4:]], i.cu_seqlens_q is i.cu_seqlens_k, p.spec, *p[2:])


def in_scope(kernel: str, query: Any) -> bool:
    """Whether ``kernel`` (a row's name) can compute ``query``, from shapes, strides, dtypes and options alone (any
    device; the size conditions are not part of it).

    Example:
        >>> q = torch.randn(1, 2, 256, 64, dtype=torch.bfloat16)
        >>> in_scope("gluon_forward", Problem(KLInputs(q, q, q, q, *[None] * 6), KLSpec(0.125, 0.125)))
        True
        >>> in_scope("gluon_forward", Problem(KLInputs(q, q, q, q, *[None] * 6), KLSpec(0.125, 0.125, softcap_a=30.0)))
        False
    """
    (route,) = [r for r in TABLE if r.kernel == kernel]
    return route.scope is None or route.scope(query)


def _implementation(route: Route) -> Callable:
    """The function that runs ``route`` (looked up on every call, so a test can wrap it), its variant bound."""
    name, attr, variant = route.impl
    fn = getattr(_module(name), attr)
    return functools.partial(fn, **dict(variant)) if variant else fn


def select_backend(backend: str, device: torch.device, dtypes: tuple[torch.dtype, ...] = (),
                   head_dims: tuple[int, ...] = ()) -> str:
    """The backend (``"reference"`` or ``"triton"``, see :data:`TABLE`) that runs a call with option ``backend``
    ("auto" | "triton" | "reference") on ``device``. A request the kernels cannot serve raises; it is never
    silently replaced by the reference. ``backend="triton"`` off CUDA needs Triton's CPU interpreter
    (``TRITON_INTERPRET=1``), which is how CI runs the real kernels.

    Example:
        >>> select_backend("auto", torch.device("cpu"))
        'reference'
    """
    fp64 = torch.float64 in dtypes
    if select("backend", BackendQuery(backend, device, fp64)).kernel == "reference":
        return "reference"
    if device.type != "cuda" and not triton_interpreter_enabled():
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


def fuses_dq_b(backend: str, need_q_a: bool, need_k_a: bool, need_q_b: bool) -> bool:
    """Whether a call's forward is the ``training forward`` (it also accumulates side b's query gradient): the Triton
    backend, with side a frozen (the default ``direction="forward"`` with a teacher that takes no gradient) and side
    b's queries trainable. The backward then runs only its key pass (7 products and 4 exponentials per score element
    instead of 8 and 6).

    Example:
        >>> fuses_dq_b("triton", need_q_a=False, need_k_a=False, need_q_b=True)  # frozen teacher, trainable student
        True
        >>> fuses_dq_b("triton", need_q_a=True, need_k_a=True, need_q_b=True)  # the teacher trains too
        False
    """
    return backend == "triton" and need_q_b and not (need_q_a or need_k_a)


def gradients_ahead(fused: bool, reduction: str, need_sinks: bool) -> bool:
    """Whether a training call computes side b's gradients in its forward and keeps only them: a fused call
    (:func:`fuses_dq_b`) reduced to one number (``reduction="sum"`` or ``"mean"``, whose upstream gradient is one number
    for every row, so the gradients per unit of it are the gradients up to that factor), and no sink that trains. The
    forward then runs the key pass too, and saves side b's two gradients per unit upstream gradient (in
    :func:`ahead_gradient_dtype`) instead of the four inputs: the teacher's query and key, and the student's, are free
    as soon as the caller drops them (the same kernels run, in the same order).

    Example:
        >>> gradients_ahead(True, "mean", need_sinks=False)  # a frozen teacher's training loss
        True
        >>> gradients_ahead(True, "none", need_sinks=False)  # one upstream gradient per row
        False
    """
    return fused and reduction != "none" and not need_sinks


def ahead_gradient_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype side b's gradients computed ahead (:func:`gradients_ahead`) are saved in for inputs of ``dtype``: the
    input dtype, except fp32 for fp16. A gradient per unit gradient of a mean over many rows is small, and a student
    close to its teacher makes it smaller still: fp16 would flush it to zero before a gradient scaler's factor (the
    upstream gradient) reaches it. fp32 keeps it; the backward multiplies by that factor and rounds to fp16 once, as
    the two-pass backward does. bf16 has fp32's range.

    Example:
        >>> ahead_gradient_dtype(torch.float16), ahead_gradient_dtype(torch.bfloat16)
        (torch.float32, torch.bfloat16)
    """
    return torch.float32 if dtype == torch.float16 else dtype


# ---------------------------------------------------------------------------------------------- running
def forward(inputs: KLInputs, spec: KLSpec, backend: str, allow_tf32: bool, dq_b: torch.Tensor | None = None,
            dq_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(kl, lse_a, lse_b)`` of the problem on ``backend``, by the kernel :data:`TABLE` selects; with ``dq_b`` (the
    Triton backend; a buffer from :func:`new_dq_b_buffer`) the training forward, which also fills it with side b's
    query gradient per unit upstream gradient, times ``dq_scale``."""
    if backend == "reference":
        return reference.chunked_attention_kl_fwd(inputs, spec)
    problem = Problem(inputs, spec)
    if dq_b is None:
        route = select("forward", problem)
        if route.gluon:
            return _implementation(route)(inputs, spec)
        return _implementation(route)(inputs, spec, allow_tf32)
    route = select("training forward", problem)
    if route.gluon:
        return _implementation(route)(inputs, spec, dq_b, dq_scale=dq_scale)
    return _implementation(route)(inputs, spec, allow_tf32, dq_b=dq_b, dq_scale=dq_scale)


def backward(grad_kl: torch.Tensor, inputs: KLInputs, spec: KLSpec, kl: torch.Tensor, lse_a: torch.Tensor,
             lse_b: torch.Tensor, need_a: bool, need_b: bool, backend: str, allow_tf32: bool, deterministic: bool,
             dq_b: torch.Tensor | None = None, grad_b_dtype: torch.dtype | None = None, dq_b_final: bool = False
             ) -> tuple[torch.Tensor | None, ...]:
    """``(dq_a, dk_a, dq_b, dk_b)`` of ``Σ grad_kl · KL`` (None where not requested) on ``backend``, the key pass and
    the query gradients by the rows :data:`TABLE` selects; ``dq_b``: the training forward's buffer, or None.
    ``grad_b_dtype`` (Triton, with ``dq_b``): the dtype of side b's gradients (default: its inputs'); ``dq_b_final``:
    the forward already scaled ``dq_b`` by the upstream gradient (its ``dq_scale``), so it is side b's query gradient
    as it is."""
    if backend == "reference":
        return reference.chunked_attention_kl_bwd(grad_kl, inputs, spec, kl, lse_a, lse_b, need_a, need_b)
    problem = Problem(inputs, spec, need_a, need_b, deterministic, dq_b is not None, not any(grad_kl.stride()))
    key_pass = select("key pass", problem)
    query = select("query gradient", problem)
    return _module("_triton.backward").attention_kl_bwd(
        grad_kl, inputs, spec, kl, lse_a, lse_b, need_a, need_b, allow_tf32,
        deterministic=query.kernel != "triton_atomic_dq", dq_b=dq_b, grad_b_dtype=grad_b_dtype,
        key_pass=_implementation(key_pass) if key_pass.gluon else None, dq_b_final=dq_b_final)


def indexer_forward(q, k, q_idx, k_idx, w_idx, lse, topk_indices, key_padding_mask, causal: bool, scale: float,
                    backend: str) -> tuple[torch.Tensor, ...]:
    """``(kl, lse_h, lse_index, psum)`` of the indexer loss (:func:`streamkl.indexer_kl`) on ``backend``: the
    ``indexer`` row of :data:`TABLE` (one kernel pair per backend)."""
    if backend == "reference":
        fn = indexer_reference.chunked_indexer_kl_fwd
    else:
        fn = _module("_triton.indexer_forward").indexer_kl_fwd
    return fn(q, k, q_idx, k_idx, w_idx, lse, topk_indices, key_padding_mask, causal, scale)


def indexer_backward(grad_kl, q, k, q_idx, k_idx, w_idx, lse_h, lse_index, psum, topk_indices, key_padding_mask,
                     causal: bool, scale: float, backend: str) -> tuple[torch.Tensor, ...]:
    """``(dq_idx, dk_idx, dw_idx)`` of the indexer loss on ``backend`` (see :func:`indexer_forward`)."""
    if backend == "reference":
        fn = indexer_reference.chunked_indexer_kl_bwd
    else:
        fn = _module("_triton.indexer_backward").indexer_kl_bwd
    return fn(grad_kl, q, k, q_idx, k_idx, w_idx, lse_h, lse_index, psum, topk_indices, key_padding_mask, causal,
              scale)


def new_dq_b_buffer(inputs: KLInputs, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The buffer the training forward fills with side b's query gradient
    (:func:`streamkl._triton.forward.new_dq_b_buffer`)."""
    return _module("_triton.forward").new_dq_b_buffer(inputs, dtype)


def saved_dq_b_dtype(dtype: torch.dtype, numel: int) -> torch.dtype:
    """The dtype the training forward saves side b's query gradient in
    (:func:`streamkl._triton.forward.saved_dq_b_dtype`)."""
    return _module("_triton.forward").saved_dq_b_dtype(dtype, numel)


#: Side-b gradients of at least this many elements are scaled by one Triton launch (:func:`scaled_copies`); smaller
#: ones, whose calls are bound by the host, by ``torch.mul``, whose launches cost the host less.
SCALE_KERNEL_MIN_ELEMENTS = 1 << 23


def scaled_copies(dq_b: torch.Tensor, dq_scale: torch.Tensor, dk_b: torch.Tensor | None, dk_scale: torch.Tensor,
                  dtype: torch.dtype, traced: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(dq_b · dq_scale, dk_b · dk_scale)`` (each scale a 0-dim tensor; ``dk_b`` may be None) as new tensors of
    ``dtype``, with ``torch.mul``'s bits: the backward of a call whose gradients were computed ahead
    (:func:`gradients_ahead`). Contiguous CUDA gradients from :data:`SCALE_KERNEL_MIN_ELEMENTS` up (and any contiguous
    CPU ones under the Triton interpreter) take one launch of :func:`streamkl._triton.scaling.scaled_copies`
    (``torch.mul`` by a 0-dim CUDA tensor takes PyTorch's non-vectorised kernel); anything else, and a traced call,
    ``torch.mul`` (``traced``: a backward the compiler traces, which it fuses).

    Example:
        >>> dq, dk = scaled_copies(torch.ones(2), torch.tensor(3.0), None, torch.tensor(1.0), torch.float32)
        >>> dq.tolist(), dk
        ([3.0, 3.0], None)
    """
    tensors = (dq_b,) if dk_b is None else (dq_b, dk_b)
    large = dq_b.is_cuda and dq_b.numel() >= SCALE_KERNEL_MIN_ELEMENTS
    if (not traced and not torch.compiler.is_compiling() and all(x.is_contiguous() for x in tensors)
            and (large or triton_interpreter_enabled())):
        return _module("_triton.scaling").scaled_copies(dq_b, dq_scale, dk_b, dk_scale, dtype)

    def scaled(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        return torch.mul(x, factor, out=torch.empty_like(x, dtype=dtype))

    return scaled(dq_b, dq_scale), (None if dk_b is None else scaled(dk_b, dk_scale))


# ---------------------------------------------------------------------------------------------- the table in words
def table_markdown() -> str:
    """:data:`TABLE` as a markdown table (stage, kernel, device, dtype, conditions), rows in the order they are
    tried; docs/concepts/architecture.md shows it.

    Example:
        >>> table_markdown().splitlines()[0]
        '| stage | kernel | device | dtype | when (tried in order; the first that applies runs) |'
    """
    lines = ["| stage | kernel | device | dtype | when (tried in order; the first that applies runs) |",
             "|---|---|---|---|---|"]
    for r in TABLE:
        lines.append(f"| {r.stage} | `{r.kernel}` (`{r.source}`) | {r.device} | {r.dtype} | {r.when} |")
    return "\n".join(lines)
