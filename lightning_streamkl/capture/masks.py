r"""
Masks of an attention call
^^^^^^^^^^^^^^^^^^^^^^^^^^

What the mask an attention implementation receives means, in the terms :func:`streamkl.attention_kl` takes:
causality, a sliding window, key padding, packed sequences (flash-attn's varlen form), or, when nothing structured
describes it, the mask itself as a boolean ``attn_mask``.

* :func:`allowed_map` turns a boolean, additive (``0`` / very negative) or FlexAttention ``BlockMask`` mask into a
  boolean map ``[B|1, H|1, N_q, N_k]``, True = the query may see the key; an additive mask with any other value is a
  bias, which the op cannot express, and is refused.
* :func:`describe_allowed` maps such a map to the structured options when they equal it *exactly* (tried in order:
  causal or not, a window, key padding; then packed documents), else keeps it as ``attn_mask``;
  :func:`describe_mask` is the two in one call, which reads a causal ``BlockMask`` without the map.
* :func:`flash_masking` reads what a flash-attention implementation receives instead (a ``[B, N]`` padding mask or
  none, ``cu_seq_lens_*`` / ``position_ids`` for packed sequences, ``sliding_window``), following transformers'
  ``_flash_attention_forward``.
* :func:`dense_allowed`, :func:`canonical_window`, :func:`same_mask`: what the loss uses to compare the teacher's and
  the student's masks and to count rows.

Every map built here is ``N_q × N_k`` booleans, the size of the mask the model already built (flash-attention calls
never build one unless the two sides disagree).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..transfer import to_device

#: Additive mask values at or below this are "masked": ``exp(-1e4)`` is 0 in every floating-point format.
MASKED_BELOW = -1.0e4


@dataclass(frozen=True)
class PackedSequences:
    """Packed sequences in flash-attn's varlen form, over the flattened ``[B · N]`` tokens of a call.

    Attributes:
        cu_seqlens_q: ``[S + 1]`` int32 offsets of the sequences among the kept query tokens.
        cu_seqlens_k: ``[S + 1]`` int32 offsets among the kept key tokens.
        max_seqlen_q: the longest query sequence.
        max_seqlen_k: the longest key sequence.
        index_q: ``[T_q]`` positions of the kept query tokens in the flattened ``[B · N_q]`` tokens; ``None``: all
            of them, in order.
        index_k: the same for keys.
        host_cu_seqlens_q: the query offsets' values on the CPU, where they were read (:meth:`from_offsets`), or
            ``None``; the op reads offsets on the CPU without a device synchronisation.
        host_cu_seqlens_k: the same for keys.

    Example:
        >>> cu = torch.tensor([0, 3, 5], dtype=torch.int32)
        >>> packed = PackedSequences(cu, cu, 3, 3)
        >>> tuple(packed.gather(torch.randn(1, 2, 5, 4), "q").shape)       # [B, H, N, D] -> [T, H, D]
        (5, 2, 4)
        >>> packed.same_as(PackedSequences(cu.clone(), cu.clone(), 3, 3, torch.arange(5), torch.arange(5)))
        True
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    index_q: torch.Tensor | None = None
    index_k: torch.Tensor | None = None
    host_cu_seqlens_q: torch.Tensor | None = None
    host_cu_seqlens_k: torch.Tensor | None = None

    @classmethod
    def from_offsets(cls, cu_q: torch.Tensor, cu_k: torch.Tensor, index_q: torch.Tensor | None = None,
                     index_k: torch.Tensor | None = None) -> PackedSequences:
        """The sequences of the offsets ``cu_q``, ``cu_k`` (any integer dtype; kept as int32), read on the host once
        (one device synchronisation for offsets on a GPU, for both): the longest sequences come from the values, which
        are kept on the CPU too, so that the op's calls on these sequences read them without one.

        Example:
            >>> packed = PackedSequences.from_offsets(torch.tensor([0, 3, 5]), torch.tensor([0, 3, 5]))
            >>> packed.max_seqlen_q, packed.host_cu_seqlens_q.tolist(), packed.cu_seqlens_q.dtype
            (3, [0, 3, 5], torch.int32)
        """
        cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
        if cu_q.shape == cu_k.shape:
            host_q, host_k = torch.stack([cu_q, cu_k]).cpu()
        else:  # not one set of sequences: the op says so, with the argument's name
            host_q, host_k = cu_q.cpu(), cu_k.cpu()
        longest = [int(torch.diff(h).max()) if h.numel() > 1 else 0 for h in (host_q, host_k)]
        return cls(cu_q, cu_k, *longest, index_q, index_k, host_q, host_k)

    @classmethod
    def from_lengths(cls, lengths: list[int], device: torch.device, index: torch.Tensor | None = None
                     ) -> PackedSequences:
        """One set of sequences (queries and keys alike) of the given lengths, known on the host: their offsets are
        sent to ``device`` without a synchronisation and kept on the CPU too; ``index`` as in the class.

        Example:
            >>> packed = PackedSequences.from_lengths([3, 2], torch.device("cpu"))
            >>> packed.max_seqlen_q, packed.host_cu_seqlens_k.tolist()
            (3, [0, 3, 5])
        """
        host = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        cu = to_device(host, device)
        longest = max(lengths, default=0)
        return cls(cu, cu, longest, longest, index, index, host, host)

    def op_offsets(self) -> dict:
        """The op's keywords for these sequences (:func:`streamkl.attention_kl` with ``layout="thd"``): the offsets,
        on the CPU where their values were read (no synchronisation in the op), and the longest sequences.

        Example:
            >>> cu = torch.tensor([0, 3, 5], dtype=torch.int32)
            >>> sorted(PackedSequences(cu, cu, 3, 3).op_offsets())
            ['cu_seqlens_k', 'cu_seqlens_q', 'max_seqlen_k', 'max_seqlen_q']
        """
        host = self.host_cu_seqlens_q is not None and self.host_cu_seqlens_k is not None
        return {"cu_seqlens_q": self.host_cu_seqlens_q if host else self.cu_seqlens_q,
                "cu_seqlens_k": self.host_cu_seqlens_k if host else self.cu_seqlens_k,
                "max_seqlen_q": self.max_seqlen_q, "max_seqlen_k": self.max_seqlen_k}

    def gather(self, x: torch.Tensor, side: str) -> torch.Tensor:
        """``x`` ``[B, H, N, D]`` as the packed ``[T, H, D]`` of the kept tokens (``side``: "q" or "k")."""
        b, h, n, d = x.shape
        flat = x.transpose(1, 2).reshape(b * n, h, d)
        index = self.index_q if side == "q" else self.index_k
        return flat if index is None else flat.index_select(0, index.to(flat.device))

    def to(self, device: torch.device) -> PackedSequences:
        """The same sequences with every tensor on ``device``."""
        move = (lambda t: None if t is None else to_device(t, device))
        return PackedSequences(move(self.cu_seqlens_q), move(self.cu_seqlens_k), self.max_seqlen_q,
                               self.max_seqlen_k, move(self.index_q), move(self.index_k), self.host_cu_seqlens_q,
                               self.host_cu_seqlens_k)

    def same_as(self, other: PackedSequences) -> bool:
        """True when both describe the same tokens and sequences (``None`` indices equal the full range). Offsets
        whose values both were read on the host (:meth:`from_offsets`) are compared there, and indices that are one
        tensor, or ``None`` on both, need no comparison: two models' reads of one packed batch are compared without
        reading the device.

        Example:
            >>> cu = torch.tensor([0, 3, 5])
            >>> PackedSequences.from_offsets(cu, cu).same_as(PackedSequences.from_offsets(cu.clone(), cu.clone()))
            True
        """
        hosts = (self.host_cu_seqlens_q, self.host_cu_seqlens_k, other.host_cu_seqlens_q, other.host_cu_seqlens_k)
        offsets = zip(hosts[:2], hosts[2:]) if all(h is not None for h in hosts) else (
            (self.cu_seqlens_q, other.cu_seqlens_q), (self.cu_seqlens_k, other.cu_seqlens_k))
        if not all(torch.equal(a.to(b.device).long(), b.long()) for a, b in offsets):
            return False

        def index(i: torch.Tensor | None, cu: torch.Tensor, host: torch.Tensor | None) -> torch.Tensor:
            total = int((cu if host is None else host)[-1])
            return torch.arange(total, device=cu.device) if i is None else i.to(cu.device)

        return all(a is b or torch.equal(index(a, cu_a, h_a).long(), index(b, cu_b, h_b).to(cu_a.device).long())
                   for a, b, cu_a, cu_b, h_a, h_b in (
                       (self.index_q, other.index_q, self.cu_seqlens_q, other.cu_seqlens_q, hosts[0], hosts[2]),
                       (self.index_k, other.index_k, self.cu_seqlens_k, other.cu_seqlens_k, hosts[1], hosts[3])))

    def describe(self) -> str:
        """E.g. ``"3 packed sequences"``."""
        return f"{len(self.cu_seqlens_q) - 1} packed sequences"


@dataclass(frozen=True)
class KeyRows:
    """What a ``[B, N_k]`` key padding mask keeps in each batch row, read on the host with the rest of its call's
    mask (:meth:`values` on the device, then one transfer): two masks of one shape whose rows are each one run of
    real keys (right or left padding) are compared here, without reading either again.

    Attributes:
        first: each row's first real key (``N_k`` for a row with none).
        stop: one past each row's last real key (0 for a row with none).
        count: each row's real keys.
        n_k: ``N_k``.

    Example:
        >>> rows = KeyRows.read(torch.tensor([[True, True, False], [False, True, True]]))
        >>> rows.runs, rows.span, rows.keeps_all
        (((0, 2), (1, 3)), (0, 2), False)
        >>> KeyRows.read(torch.tensor([[True, False, True]])).runs is None     # a hole: not one run
        True
    """

    first: tuple[int, ...]
    stop: tuple[int, ...]
    count: tuple[int, ...]
    n_k: int

    @staticmethod
    def values(real: torch.Tensor) -> torch.Tensor:
        """``[3, B]`` int64 on ``real``'s device (``[B, N_k]`` bool, True = a real key): the rows' ``first``,
        ``stop`` and ``count``, computed without reading the mask."""
        cols = torch.arange(real.shape[-1], device=real.device)
        return torch.stack([torch.where(real, cols, real.shape[-1]).amin(-1), torch.where(real, cols + 1, 0).amax(-1),
                            real.sum(-1)])

    @classmethod
    def from_values(cls, values: list[list[int]], n_k: int) -> KeyRows:
        """The rows from :meth:`values` read on the host (``.tolist()``)."""
        first, stop, count = (tuple(int(x) for x in row) for row in values)
        return cls(first, stop, count, n_k)

    @classmethod
    def read(cls, real: torch.Tensor) -> KeyRows:
        """:meth:`values` of ``real``, read on the host (one device synchronisation for a mask on a GPU)."""
        return cls.from_values(cls.values(real.bool()).tolist(), real.shape[-1])

    @property
    def keeps_all(self) -> bool:
        """Every row keeps every key."""
        return all(c == self.n_k for c in self.count)

    @property
    def runs(self) -> tuple[tuple[int, int], ...] | None:
        """Each row's real keys as one half-open run ``(start, stop)`` (``(0, 0)`` for a row with none), or ``None``
        when some row's real keys have a gap. Two masks of one shape with runs are equal exactly when their runs are."""
        if any(c and s - f != c for f, s, c in zip(self.first, self.stop, self.count)):
            return None
        return tuple((f, s) if c else (0, 0) for f, s, c in zip(self.first, self.stop, self.count))

    @property
    def span(self) -> tuple[int, int]:
        """The first and the last key any row keeps (``(N_k, -1)`` when none does)."""
        return min(self.first, default=self.n_k), max(self.stop, default=0) - 1


@dataclass
class Masking:
    """The complete mask of one attention call (see :class:`~lightning_streamkl.capture.CapturedAttention`).

    Attributes:
        causal: key ``j`` allowed only when ``j <= i + N_k - N_q`` (inside each sequence when packed); ``None``:
            unknown.
        window: ``(left, right)`` sliding window (flash-attn convention, −1 unbounded), or ``None``.
        key_padding_mask: ``[B, N_k]`` bool, True = real key, or ``None``.
        query_mask: ``[B, N_q]`` bool, True = a real query token (self-attention), or ``None``.
        packed: the call's packed sequences, or ``None``.
        attn_mask: ``[B|1, H|1, N_q, N_k]`` bool, True = allowed: a mask nothing structured describes (it then
            holds everything, padding included), or ``None``.
        key_rows: ``key_padding_mask``'s rows as read on the host where the mask was described, or ``None`` (not
            read, or no key padding).

    Example:
        >>> Masking(causal=True).summary()
        'causal'
        >>> Masking(causal=True, window=(3, 0), key_padding_mask=torch.tensor([[True, False]])).summary()
        'causal, window (3, 0), key padding'
    """

    causal: bool | None = None
    window: tuple[int, int] | None = None
    key_padding_mask: torch.Tensor | None = None
    query_mask: torch.Tensor | None = None
    packed: PackedSequences | None = None
    attn_mask: torch.Tensor | None = None
    key_rows: KeyRows | None = None

    def summary(self) -> str:
        """A short description for messages."""
        parts = ["causal" if self.causal else "bidirectional" if self.causal is False else "causality unknown"]
        if self.window is not None:
            parts.append(f"window {self.window}")
        if self.key_padding_mask is not None:
            parts.append("key padding")
        if self.packed is not None:
            parts.append(self.packed.describe())
        if self.attn_mask is not None:
            parts.append("a general attention mask")
        return ", ".join(parts)


# ------------------------------------------------------------------------------------------------ conversion
def allowed_map(mask: object, n_q: int, n_k: int, *, blocked: bool = False) -> torch.Tensor:
    """The boolean map ``[B|1, H|1, N_q, N_k]`` (True = allowed) of an attention mask.

    Args:
        mask: a bool tensor (True = allowed, or True = masked with ``blocked=True``, as ``nn.MultiheadAttention``
            takes it), an additive float tensor (0 = allowed, ``<= -1e4`` or ``-inf`` = masked), of 2 to 4 dims
            broadcastable to ``[B, H, N_q, N_k]`` (a longer last dim is cut to ``N_k``, as transformers does), or a
            FlexAttention ``BlockMask``.
        n_q: the call's query length.
        n_k: the call's key length.
        blocked: True when a bool mask marks the *masked* entries.

    Raises:
        ValueError: an additive mask with a value that is neither 0 nor masked (a bias, e.g. ALiBi or a relative
            position bias, which attention_kl cannot express), or a shape that does not fit.

    Example:
        >>> m = torch.tensor([[0.0, -1e9], [0.0, 0.0]])
        >>> allowed_map(m, 2, 2)
        tensor([[[[ True, False],
                  [ True,  True]]]])
        >>> try:
        ...     allowed_map(torch.tensor([[0.0, 0.5]]), 1, 2)
        ... except ValueError as err:
        ...     print(str(err)[:73])
        The attention mask adds values other than 0 and a masking value (e.g. 0.5
    """
    if _is_block_mask(mask):
        return _block_mask_map(mask, n_q, n_k)
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"Expected the attention mask to be a tensor or a BlockMask, but got {type(mask).__name__}.")
    if not 2 <= mask.dim() <= 4:
        raise ValueError(f"Expected a 2- to 4-d attention mask [.., N_q, N_k], but got shape {tuple(mask.shape)}.")
    if mask.shape[-1] > n_k:
        mask = mask[..., :n_k]
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    if mask.shape[-2] not in (1, n_q) or mask.shape[-1] not in (1, n_k):
        raise ValueError(f"The attention mask has shape {tuple(mask.shape)}, which does not fit N_q={n_q}, N_k={n_k}.")
    if mask.dtype == torch.bool:
        allowed = ~mask if blocked else mask
    else:
        allowed = mask == 0
        odd = ~allowed & ~(mask <= MASKED_BELOW)
        if bool(odd.any()):
            value = float(mask[odd].flatten()[0])
            raise ValueError(
                f"The attention mask adds values other than 0 and a masking value (e.g. {value:g}): a score bias, "
                "which attention_kl cannot express."
            )
    return allowed.expand(*allowed.shape[:2], n_q, n_k)


def describe_mask(mask: object, n_q: int, n_k: int, batch: int, *, self_attention: bool) -> Masking:
    """:func:`describe_allowed` of :func:`allowed_map` of ``mask``, with one shortcut: a FlexAttention ``BlockMask``
    that is causal and nothing else (what transformers builds for a causal LM without padding) is read from its
    block lists and its diagonal blocks alone, without the ``N_q × N_k`` map (tens of milliseconds per mask at
    N = 16384 on a GPU, for each model, each step).

    Example:
        >>> m = torch.tensor([[0.0, -1e9], [0.0, 0.0]])
        >>> describe_mask(m, 2, 2, 1, self_attention=True).summary()
        'causal'
    """
    if _is_block_mask(mask) and _is_causal_block_mask(mask, n_q, n_k):
        return Masking(causal=True)
    return describe_allowed(allowed_map(mask, n_q, n_k), batch, self_attention=self_attention)


def _is_causal_block_mask(block_mask, n_q: int, n_k: int) -> bool:
    """True when ``block_mask`` allows exactly the causal scores of an ``n_q × n_k`` call with ``n_q == n_k``: its full
    blocks are the blocks below the diagonal, its partial blocks the diagonal, and its ``mask_mod`` allows exactly
    ``kv <= q`` there, for every batch and head the mask has. False (the dense map then decides) for anything else,
    including shapes whose blocks do not tile the call or a mask without full-block lists."""
    b, h, q_len, kv_len = block_mask.shape
    q_block, kv_block = _block_sizes(block_mask)
    if not (q_len == kv_len == n_q == n_k and q_block == kv_block and n_q % q_block == 0) \
            or block_mask.full_kv_num_blocks is None:
        return False
    blocks = n_q // q_block
    full = _blocks_to_dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, blocks)
    partial = _blocks_to_dense(block_mask.kv_num_blocks, block_mask.kv_indices, blocks) & ~full
    if full.shape[-2] != blocks or partial.shape != full.shape:
        return False
    index = torch.arange(blocks, device=full.device)
    if not (torch.equal(full, (index[:, None] > index[None, :]).expand_as(full))
            and torch.equal(partial, (index[:, None] == index[None, :]).expand_as(partial))):
        return False
    q_idx = torch.arange(n_q, device=full.device)[:, None].expand(n_q, q_block)  # each query against its diagonal
    kv_idx = (q_idx // q_block) * q_block + torch.arange(q_block, device=full.device)  # block's keys
    grid = [x.flatten() for x in torch.meshgrid(torch.arange(b, device=full.device),
                                                torch.arange(h, device=full.device), indexing="ij")]
    per_row = q_idx.numel()
    b_idx, h_idx = (g.repeat_interleave(per_row) for g in grid)
    q_all, kv_all = q_idx.flatten().repeat(b * h), kv_idx.flatten().repeat(b * h)
    return torch.equal(_mask_mod_values(block_mask.mask_mod, b_idx, h_idx, q_all, kv_all), kv_all <= q_all)


def _block_sizes(block_mask) -> tuple[int, int]:
    """``(query block, key block)`` of a ``BlockMask`` (its ``BLOCK_SIZE`` is one int or a pair)."""
    size = block_mask.BLOCK_SIZE
    return (size, size) if isinstance(size, int) else tuple(size)


def _is_block_mask(mask: object) -> bool:
    return type(mask).__name__ == "BlockMask" and hasattr(mask, "mask_mod")


def _blocks_to_dense(num: torch.Tensor, indices: torch.Tensor, n_kv_blocks: int) -> torch.Tensor:
    """flex_attention's ordered block lists as a dense ``[B, H, Q_blocks, KV_blocks]`` bool map."""
    valid = torch.arange(indices.shape[-1], device=indices.device) < num[..., None]
    dense = torch.zeros(*indices.shape[:-1], n_kv_blocks + 1, dtype=torch.bool, device=indices.device)
    dense.scatter_(-1, torch.where(valid, indices.long(), n_kv_blocks), True)
    return dense[..., :n_kv_blocks]


def _block_mask_map(block_mask, n_q: int, n_k: int) -> torch.Tensor:
    """What flex_attention computes with ``block_mask``: full blocks are allowed whole, partial blocks where the
    ``mask_mod`` allows, other blocks never.

    The ``mask_mod`` is evaluated on the partial blocks only (a causal mask's diagonal: ``N / 128`` blocks of 128²
    instead of ``N²`` scores; evaluating it everywhere, as ``create_mask`` does, cost tens of milliseconds and
    gigabytes of index grids per pass at N = 16384).
    """
    b, h, q_len, kv_len = block_mask.shape
    if (q_len, kv_len) != (n_q, n_k):
        raise ValueError(f"The BlockMask covers {q_len} x {kv_len} scores, but the call has N_q={n_q}, N_k={n_k}.")
    device = block_mask.kv_indices.device
    q_block, kv_block = _block_sizes(block_mask)
    n_kv_blocks = -(-kv_len // kv_block)

    def tokens(blocks: torch.Tensor) -> torch.Tensor:  # [B|1, H|1, Q blocks, KV blocks] -> [B, H, N_q, N_k], one copy
        n_qb, n_kb = blocks.shape[-2:]
        dense = blocks.expand(b, h, n_qb, n_kb)[:, :, :, None, :, None].expand(b, h, n_qb, q_block, n_kb, kv_block)
        return dense.reshape(b, h, n_qb * q_block, n_kb * kv_block)[..., :q_len, :kv_len].contiguous()

    partial = _blocks_to_dense(block_mask.kv_num_blocks, block_mask.kv_indices, n_kv_blocks)
    full = None
    if block_mask.full_kv_num_blocks is not None:
        full = _blocks_to_dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, n_kv_blocks)
        partial = partial & ~full
    partial = partial.expand(b, h, *partial.shape[-2:])
    allowed = tokens(full) if full is not None else torch.zeros(b, h, q_len, kv_len, dtype=torch.bool, device=device)
    blocks = partial.nonzero()  # [P, 4]: (batch, head, query block, key block) of every partial block
    if len(blocks):
        q_off, kv_off = torch.arange(q_block, device=device), torch.arange(kv_block, device=device)
        q_idx = (blocks[:, 2, None, None] * q_block + q_off[None, :, None]).expand(-1, q_block, kv_block)
        kv_idx = (blocks[:, 3, None, None] * kv_block + kv_off[None, None, :]).expand(-1, q_block, kv_block)
        inside = (q_idx < q_len) & (kv_idx < kv_len)
        b_idx, h_idx = (blocks[:, i, None, None].expand(-1, q_block, kv_block)[inside] for i in (0, 1))
        q_idx, kv_idx = q_idx[inside], kv_idx[inside]
        allowed[b_idx, h_idx, q_idx, kv_idx] = _mask_mod_values(block_mask.mask_mod, b_idx, h_idx, q_idx, kv_idx)
    return allowed


def _mask_mod_values(mask_mod, b_idx: torch.Tensor, h_idx: torch.Tensor, q_idx: torch.Tensor,
                     kv_idx: torch.Tensor) -> torch.Tensor:
    """``mask_mod(b, h, q, kv)`` at each position of the index vectors (elementwise, through ``vmap`` as flex
    attention's own ``create_mask`` evaluates it)."""
    from torch.func import vmap

    return vmap(mask_mod)(b_idx, h_idx, q_idx, kv_idx).to(torch.bool)


# ------------------------------------------------------------------------------------------------ structure
def band(n_q: int, n_k: int, causal: bool | torch.Tensor, window: tuple[int, int] | None,
         device: torch.device, rows: slice = slice(None)) -> torch.Tensor:
    """``[N_q, N_k]`` bool: the keys each query may see under ``causal`` and ``window`` (bottom-right aligned).

    ``causal`` and the window's bounds may also be 0-d tensors on ``device``, read there and not on the host;
    ``rows`` builds only those query rows.

    Example:
        >>> band(3, 3, True, (1, 0), torch.device("cpu")).int()
        tensor([[1, 0, 0],
                [1, 1, 0],
                [0, 1, 1]], dtype=torch.int32)
    """
    i = torch.arange(n_q, device=device)[rows, None] + (n_k - n_q)
    j = torch.arange(n_k, device=device)[None, :]
    left, right = window if window is not None else (-1, -1)
    after_left = (j >= i - left) | (left < 0)
    before_right = torch.where(torch.as_tensor(causal), j <= i, (j <= i + right) | (right < 0))
    return after_left & before_right


def canonical_window(window: tuple[int, int] | None, causal: bool, n_q: int, n_k: int,
                     key_padding_mask: torch.Tensor | None = None,
                     packed: PackedSequences | None = None,
                     key_span: tuple[int, int] | None = None) -> tuple[int, int] | None:
    """``window`` with the bounds that exclude no key of this call made unbounded (``None`` when both are).

    Two calls that allow the same keys then have the same window, whichever way each was described (a
    flash-attention ``sliding_window`` longer than the documents, a mask whose window never bites).
    ``key_span``: :attr:`KeyRows.span` of ``key_padding_mask`` where the caller already read it on the host (the
    mask is then not read again).

    Example:
        >>> canonical_window((9, 9), True, 8, 8) is None                 # no row looks back more than 7 keys
        True
        >>> canonical_window((3, 9), True, 8, 8)
        (3, 0)
    """
    if window is None:
        return None
    left, right = window
    if causal:
        right = 0
    if packed is not None:
        # the offsets' host copies where the capture read them (no device synchronisation), else the offsets
        cu_q = packed.cu_seqlens_q if packed.host_cu_seqlens_q is None else packed.host_cu_seqlens_q
        cu_k = packed.cu_seqlens_k if packed.host_cu_seqlens_k is None else packed.host_cu_seqlens_k
        nq, nk = (cu_q[1:] - cu_q[:-1]).long(), (cu_k[1:] - cu_k[:-1]).long()
        reach_left = int((nk - 1).max()) if len(nk) else 0
        reach_right = int((nq - 1).max()) if len(nq) else 0
    else:
        if key_span is None:
            key_span = (0, n_k - 1) if key_padding_mask is None else KeyRows.read(key_padding_mask).span
        first, last = key_span
        if first > last:  # no real key: every bound excludes nothing
            first, last = 0, n_k - 1
        reach_left = n_k - 1 - first  # the last row (aligned to key N_k - 1) looking back to the first real key
        reach_right = last - (n_k - n_q)  # the first row (aligned to key N_k - N_q) looking ahead to the last one
    if left >= reach_left:
        left = -1
    if not causal and right >= reach_right:
        right = -1
    if left < 0 and (causal or right < 0):
        return None
    return (left, 0 if causal else right)


def describe_allowed(allowed: torch.Tensor, batch: int, *, self_attention: bool) -> Masking:
    """The structured options equal to ``allowed``, else ``allowed`` itself as ``attn_mask``.

    Tried in order, each verified against the whole map: causal or bidirectional, with the narrowest window the map
    shows, and key padding (the keys no query sees); then, for self-attention, packed documents (a block-diagonal
    map over the real tokens, each block causal or full, with a window inside). The query mask marks the real
    tokens of self-attention (a padded position's row is not a row of the layer's distribution).

    Args:
        allowed: ``[B|1, H|1, N_q, N_k]`` bool, True = the query may see the key.
        batch: the call's batch size.
        self_attention: queries and keys are the same tokens (not cross-attention).

    Example:
        >>> m = band(4, 4, True, None, torch.device("cpu")) & torch.tensor([True, True, True, False])
        >>> d = describe_allowed(m[None, None], 1, self_attention=True)
        >>> d.summary(), d.key_padding_mask.tolist()
        ('causal, key padding', [[True, True, True, False]])
        >>> docs = torch.block_diag(torch.ones(2, 2), torch.ones(3, 3)).bool() & band(5, 5, True, None, m.device)
        >>> describe_allowed(docs[None, None], 1, self_attention=True).summary()
        'causal, 2 packed sequences'
    """
    _, _, n_q, n_k = allowed.shape
    a = allowed.expand(batch, allowed.shape[1], n_q, n_k)
    device = a.device
    kpm = a.any(dim=2).any(dim=1)  # [B, N_k]: keys some query sees
    qmask = kpm[:, n_k - n_q:] if self_attention and n_q <= n_k else None
    rows = a.any(-1)  # [B, H, N_q]
    first, last = _row_extents(a)
    aligned = torch.arange(n_q, device=device) + (n_k - n_q)
    causal = ~((last > aligned) & rows).any()
    unbounded = torch.full((), -1, dtype=torch.long, device=device)
    left = torch.where(rows, aligned - first, -1).amax() if rows.numel() else unbounded
    right = torch.where(rows, last - aligned, -1).amax() if rows.numel() else unbounded
    # both candidates are compared with the map on the device, and all the choice needs is read in one transfer
    # (one synchronisation per mask, which every layer of a forward pass shares)
    facts = torch.cat([torch.stack([x.long() for x in (
        causal, left, right, qmask.all() if qmask is not None else kpm.new_ones(()),
        _equals_band(a, kpm, causal, None), _equals_band(a, kpm, causal, (left, right)))]),
        KeyRows.values(kpm).flatten()]).tolist()
    (causal, left, right, all_rows, plain, windowed), rows = facts[:6], facts[6:]
    key_rows = KeyRows.from_values([rows[i * batch:(i + 1) * batch] for i in range(3)], n_k)
    kpm_or_none, rows_or_none = (None, None) if key_rows.keeps_all else (kpm, key_rows)
    qmask_or_none = None if qmask is None or all_rows else qmask
    for window, equal in ((None, plain), ((left, -1 if causal else right), windowed)):
        if equal:
            window = canonical_window(window, bool(causal), n_q, n_k, kpm_or_none, key_span=key_rows.span)
            return Masking(bool(causal), window, kpm_or_none, qmask_or_none, key_rows=rows_or_none)
    if self_attention and n_q == n_k:
        packed = _packed_candidate(a, kpm, bool(causal), left, right, every_token=key_rows.keeps_all)
        if packed is not None:
            return packed
    return Masking(False, None, None, qmask_or_none, None, allowed)


#: The most elements of the map one step of :func:`describe_allowed` holds (a row block: at N = 32768 the map is 2³⁰
#: of them, and each step allocates a copy, a candidate or a comparison of the block's size, not of the map's).
COMPARE_BLOCK_ELEMENTS = 1 << 26


def _row_blocks(a: torch.Tensor) -> list[slice]:
    """The row blocks of a ``[B, H, N_q, N_k]`` map, each of at most :data:`COMPARE_BLOCK_ELEMENTS` elements."""
    b, h, n_q, n_k = a.shape
    step = max(1, COMPARE_BLOCK_ELEMENTS // max(1, b * h * n_k))
    return [slice(start, start + step) for start in range(0, n_q, step)]


def _row_extents(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first and the last allowed key of each row of ``a`` (``[B, H, N_q]`` each; a row with none gives 0 and
    ``N_k - 1``), by row blocks."""
    n_k = a.shape[-1]
    firsts, lasts = [], []
    for rows in _row_blocks(a):
        block = a[:, :, rows].to(torch.uint8)
        firsts.append(block.argmax(-1))  # (argmax returns the first maximum)
        lasts.append(n_k - 1 - block.flip(-1).argmax(-1))
    if not firsts:
        empty = torch.zeros(a.shape[:3], dtype=torch.long, device=a.device)
        return empty, empty
    return torch.cat(firsts, -1), torch.cat(lasts, -1)


def _equals_band(a: torch.Tensor, kpm: torch.Tensor, causal: torch.Tensor,
                 window: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """0-d bool on ``a``'s device: ``a`` equals :func:`band` ``& kpm`` (compared by row blocks, not read)."""
    n_q, n_k = a.shape[-2:]
    differs = torch.zeros((), dtype=torch.bool, device=a.device)
    for rows in _row_blocks(a):
        candidate = band(n_q, n_k, causal, window, a.device, rows)[None, None] & kpm[:, None, None, :]
        differs = differs | (candidate != a[:, :, rows]).any()
    return ~differs


def _packed_candidate(a: torch.Tensor, real: torch.Tensor, causal: bool, left: int, right: int, *,
                      every_token: bool) -> Masking | None:
    """Packed documents whose map equals ``a`` on the real query rows, or ``None``; ``every_token``: ``real`` keeps
    every token (the sequences' indices are then ``None``, all of them in order, and found without a read).

    A document starts at each real token that does not see the real token before it (or, not causal, is not seen by
    it). The candidate map (each document a band of ``left`` and ``right`` around the diagonal, over its tokens) is
    compared with ``a`` by the row blocks of :func:`_row_blocks`, on the device, and read with the documents' starts
    in one transfer: no ``N × N`` map beyond a block's is built.
    """
    batch, _, n, _ = a.shape
    device = a.device
    index = torch.arange(batch * n, device=device) if every_token else real.flatten().nonzero().flatten()
    tokens = index.numel()  # the real tokens, in [B·N] order
    if tokens < 2:
        return None
    b, pos = index // n, index % n
    joined = a[b[1:], :, pos[1:], pos[:-1]].any(-1)  # a token sees the real token before it: the same document
    if not causal:
        joined |= a[b[:-1], :, pos[:-1], pos[1:]].any(-1)
    start = torch.ones(tokens, dtype=torch.bool, device=device)
    start[1:] = ~((b[1:] == b[:-1]) & joined)
    order = torch.arange(tokens, device=device)
    doc = torch.full((batch * n,), -1, dtype=torch.long, device=device)  # each position's document (-1: padding)
    doc[index] = torch.cumsum(start, 0) - 1
    rank = torch.zeros(batch * n, dtype=torch.long, device=device)  # each token's place in its document
    rank[index] = order - torch.cummax(torch.where(start, order, 0), 0).values
    doc, rank = doc.view(batch, n), rank.view(batch, n)
    differs = torch.zeros((), dtype=torch.bool, device=device)
    for rows in _row_blocks(a):
        q_doc, q_rank, k_rank = doc[:, rows, None], rank[:, rows, None], rank[:, None, :]
        candidate = (q_doc == doc[:, None, :]) & (q_doc >= 0)
        if left >= 0:
            candidate &= k_rank >= q_rank - left
        if causal or right >= 0:
            candidate &= k_rank <= q_rank + (0 if causal else right)
        keep = real[:, None, rows, None]  # the real query rows: a padded position's row is not a document's row
        differs |= ((candidate[:, None] & keep) != (a[:, :, rows] & keep)).any()
    read = torch.cat([differs.view(1), start]).cpu()  # (the one read: whether they match, and where each starts)
    if bool(read[0]):
        return None
    starts = torch.cat([read[1:].nonzero().flatten(), torch.tensor([tokens])])
    packed = PackedSequences.from_lengths(torch.diff(starts).tolist(), device, None if every_token else index)
    longest = packed.max_seqlen_q
    window = canonical_window((left, -1 if causal else right), causal, longest, longest, packed=packed)
    return Masking(causal, window, None, None, packed)


# ------------------------------------------------------------------------------------------------ flash attention
def flash_masking(mask: torch.Tensor | None, batch: int, n_q: int, n_k: int, kwargs: dict, causal: bool | None, *,
                  self_attention: bool) -> Masking:
    """The mask a flash-attention implementation applies, from what it receives (transformers'
    ``_flash_attention_forward``, 5.17 to 5.23).

    * a ``[B, N_k]`` padding mask (1 = real): each row's real tokens are one sequence; left or right padding is
      key padding (the same keys at the same distances), padding inside a row makes the row's real tokens one
      packed sequence (flash-attn compresses them);
    * else ``cu_seq_lens_q``/``cu_seq_lens_k`` (with ``max_length_q``/``max_length_k``, or with packed
      ``position_ids``): packed sequences over the flattened tokens;
    * else ``position_ids`` of one batch row that restart (a new sequence wherever the position equals the
      smallest one);
    * ``sliding_window`` ``w`` when ``N_k > w``: the window ``(w - 1, w - 1)`` (right bound 0 when causal).

    Example:
        >>> pos = torch.tensor([[0, 1, 2, 0, 1]])
        >>> m = flash_masking(None, 1, 5, 5, {"position_ids": pos, "sliding_window": 2}, True, self_attention=True)
        >>> m.summary(), m.packed.cu_seqlens_q.tolist()
        ('causal, window (1, 0), 2 packed sequences', [0, 3, 5])
    """
    sliding = kwargs.get("sliding_window")
    window = None
    if sliding is not None and n_k > int(sliding):
        window = (int(sliding) - 1, 0 if causal else int(sliding) - 1)
    causal_ = bool(causal) if causal is not None else None
    if mask is not None:
        real = mask.bool()[:, -n_k:]
        rows = KeyRows.read(real)  # (one read of all the host needs)
        kpm, rows_or_none = (None, None) if rows.keeps_all else (real, rows)
        if not self_attention or n_q != n_k or rows.runs is not None:
            return Masking(causal_, canonical_window(window, bool(causal), n_q, n_k, kpm, key_span=rows.span), kpm,
                           kpm if self_attention and n_q == n_k else None, key_rows=rows_or_none)
        # each row's real tokens one sequence: their lengths were read with the rows
        packed = PackedSequences.from_lengths(list(rows.count), real.device, real.flatten().nonzero().flatten())
        m = packed.max_seqlen_q
        return Masking(causal_, canonical_window(window, bool(causal), m, m, packed=packed), None, None, packed)
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    position_ids = kwargs.get("position_ids")
    packed_positions = _packed_positions(position_ids, batch)
    given = cu_q is not None and cu_k is not None and (
        (kwargs.get("max_length_q") is not None and kwargs.get("max_length_k") is not None) or packed_positions)
    if given:
        packed = PackedSequences.from_offsets(cu_q, cu_k)
    elif packed_positions:
        flat = position_ids.reshape(-1)
        starts = (flat == flat.min()).nonzero().flatten()
        cu = torch.cat([starts, torch.tensor([flat.numel()], device=flat.device)]).to(torch.int32)
        packed = PackedSequences.from_offsets(cu, cu)
    else:
        return Masking(causal_, canonical_window(window, bool(causal), n_q, n_k))
    window = canonical_window(window, bool(causal), packed.max_seqlen_q, packed.max_seqlen_k, packed=packed)
    return Masking(causal_, window, None, None, packed)


def _packed_positions(position_ids: torch.Tensor | None, batch: int) -> bool:
    """transformers' ``_is_packed_sequence``: one batch row whose positions are not one increasing run."""
    if position_ids is None or batch != 1 or position_ids.shape[-1] == 1:
        return False
    run = torch.arange(position_ids.shape[-1], device=position_ids.device) + position_ids.min()
    return bool((run - position_ids).abs().sum())


# ------------------------------------------------------------------------------------------------ comparison
def same_keys_on_host(a: Masking, b: Masking) -> bool | None:
    """Whether the key padding of ``a`` and of ``b`` keeps the same keys, decided from their :class:`KeyRows` without
    reading a mask; ``None`` when that cannot decide it (a side's rows not read, or with a gap).

    Example:
        >>> right = torch.tensor([[True, True, False]])
        >>> same_keys_on_host(Masking(key_padding_mask=right, key_rows=KeyRows.read(right)),
        ...                   Masking(key_padding_mask=right.clone(), key_rows=KeyRows.read(right)))
        True
        >>> same_keys_on_host(Masking(), Masking(key_padding_mask=right, key_rows=KeyRows.read(right)))
        False
    """
    sides: list[KeyRows | None] = []
    for m in (a, b):
        if m.key_padding_mask is None:
            sides.append(None)  # every key
        elif m.key_rows is None or m.key_rows.runs is None:
            return None  # rows not read, or one with a gap
        else:
            sides.append(m.key_rows)
    known = [r for r in sides if r is not None]
    if not known:
        return True
    if len({(len(r.count), r.n_k) for r in known}) > 1:
        return None  # shapes that differ: the masks decide
    full = ((0, known[0].n_k),) * len(known[0].count)
    first, second = (full if r is None else r.runs for r in sides)
    return first == second


def same_mask(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """True when two optional boolean masks allow the same entries (``None`` = everything allowed).

    Example:
        >>> same_mask(None, torch.ones(2, 3, dtype=torch.bool)), same_mask(torch.tensor([True]), torch.tensor([False]))
        (True, False)
    """
    if a is None and b is None:
        return True
    if a is None or b is None:
        return bool((a if b is None else b).all())
    try:
        shape = torch.broadcast_shapes(a.shape, b.shape)
    except RuntimeError:
        return False
    return torch.equal(a.to(b.device).expand(shape), b.expand(shape))


def dense_allowed(masking: Masking, batch: int, n_q: int, n_k: int, device: torch.device,
                  causal: bool | None = None) -> torch.Tensor:
    """``[B, H|1, N_q, N_k]`` bool: the keys each counted query row sees under ``masking`` (rows that are not
    counted, by the query mask or as padding between packed sequences, are all False).

    Args:
        masking: the call's masks.
        batch: ``B``.
        n_q: ``N_q``.
        n_k: ``N_k``.
        device: where to build the map.
        causal: overrides ``masking.causal``.

    Example:
        >>> dense_allowed(Masking(causal=True, window=(1, 0)), 1, 3, 3, torch.device("cpu"))[0, 0].int()
        tensor([[1, 0, 0],
                [1, 1, 0],
                [0, 1, 1]], dtype=torch.int32)
    """
    causal = bool(masking.causal if causal is None else causal)
    if masking.packed is not None:
        return packed_allowed(masking.packed.to(device), causal, masking.window, batch, n_q, n_k)[:, None]
    allowed = band(n_q, n_k, causal, masking.window, device)[None, None].expand(batch, 1, n_q, n_k)
    if masking.key_padding_mask is not None:
        allowed = allowed & masking.key_padding_mask.to(device)[:, None, None, :]
    if masking.attn_mask is not None:
        allowed = allowed & masking.attn_mask.to(device)
    if masking.query_mask is not None:
        allowed = allowed & masking.query_mask.to(device)[:, None, :, None]
    return allowed


def packed_allowed(packed: PackedSequences, causal: bool, window: tuple[int, int] | None, batch: int, n_q: int,
                   n_k: int) -> torch.Tensor:
    """``[B, N_q, N_k]`` bool map of packed sequences laid out in the ``[B, N]`` tokens of a call (tokens that are in
    no sequence: all False).

    Raises:
        ValueError: a sequence that crosses batch rows (flattened varlen inputs), which no ``[B, N_q, N_k]`` map holds.

    Example:
        >>> cu = torch.tensor([0, 2, 3], dtype=torch.int32)
        >>> packed_allowed(PackedSequences(cu, cu, 2, 2), True, None, 1, 3, 3)[0].int()
        tensor([[1, 0, 0],
                [1, 1, 0],
                [0, 0, 1]], dtype=torch.int32)
    """
    device = packed.cu_seqlens_q.device
    iq = torch.arange(batch * n_q, device=device) if packed.index_q is None else packed.index_q.to(device)
    ik = torch.arange(batch * n_k, device=device) if packed.index_k is None else packed.index_k.to(device)
    nq, nk = torch.diff(packed.cu_seqlens_q.long()), torch.diff(packed.cu_seqlens_k.long())
    seq_q = torch.repeat_interleave(torch.arange(len(nq), device=device), nq)
    seq_k = torch.repeat_interleave(torch.arange(len(nk), device=device), nk)
    row_q, row_k = iq // n_q, ik // n_k
    if bool((row_q != row_q[packed.cu_seqlens_q.long()[:-1]][seq_q]).any()) or \
            bool((row_k != row_k[packed.cu_seqlens_k.long()[:-1]][seq_k]).any()):
        raise ValueError("Packed sequences cross batch rows; they have no [B, N_q, N_k] mask.")
    local_q = torch.arange(len(iq), device=device) - packed.cu_seqlens_q.long()[seq_q]
    local_k = torch.arange(len(ik), device=device) - packed.cu_seqlens_k.long()[seq_k]
    aligned = local_q + (nk - nq)[seq_q]
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    allowed = torch.zeros(batch, n_q, n_k, dtype=torch.bool, device=device)
    for b in range(batch):
        tq, tk = (row_q == b).nonzero().flatten(), (row_k == b).nonzero().flatten()
        keys, rows = local_k[tk][None, :], aligned[tq][:, None]  # (compared by broadcasting: no int64 map)
        ok = seq_q[tq][:, None] == seq_k[tk][None, :]
        if left >= 0:
            ok &= keys >= rows - left
        if right >= 0:
            ok &= keys <= rows + right
        allowed[b, (iq[tq] % n_q)[:, None], (ik[tk] % n_k)[None, :]] = ok
    return allowed
