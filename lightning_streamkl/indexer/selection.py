r"""
Top-k selection and captured mass
^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^

What the sparse stage needs and what tells whether an indexer works, computed in blocks of query rows so that no
``N_q × N_k`` map of the whole problem is ever held (the memory of one block is bounded by ``max_elements``):

- :func:`indexer_topk`: each query's ``K`` keys with the highest indexer logits among the keys it may see (the
  selection of DeepSeek-V3.2's sparse attention, and of the sparse stage of the indexer loss);
- :func:`topk_attention_mass`: the share of the main attention's head-mean probability on a selection;
- :func:`best_topk_attention_mass`: the same for the main attention's own top ``K`` keys, the most any selection of
  ``K`` keys can capture.

Layouts as :func:`streamkl.indexer_kl`: ``q [B, H, N_q, D]``, ``k [B, H_kv, N_k, D]``, ``q_idx [B, H_I, N_q, D_I]``
(``layout="bnhd"``: heads second to last), ``k_idx [B, N_k, D_I]``, ``w_idx [B, N_q, H_I]``; ``causal`` is aligned
to the bottom-right corner when ``N_q != N_k``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

__all__ = ["allowed_keys", "best_topk_attention_mass", "indexer_logits", "indexer_topk", "topk_attention_mass"]

#: Default bound on the elements of one block's score tensor (fp32: 256 MiB).
MAX_ELEMENTS = 1 << 26


def _rows_per_block(per_row: int, n_q: int, max_elements: int) -> int:
    if isinstance(max_elements, bool) or not isinstance(max_elements, int) or max_elements < 1:
        raise ValueError(f"Expected argument `max_elements` to be an int >= 1, but got {max_elements!r}.")
    return max(1, min(n_q, max_elements // max(per_row, 1)))


def _blocks(n_q: int, rows: int) -> Iterator[slice]:
    for start in range(0, n_q, rows):
        yield slice(start, min(start + rows, n_q))


def allowed_keys(rows: slice, n_q: int, n_k: int, *, causal: bool, key_padding_mask: torch.Tensor | None,
                 device: torch.device, batch: int = 1) -> torch.Tensor:
    """``[B|1, rows, N_k]`` bool: which keys the query rows ``rows`` may see (causal, bottom-right aligned; real).

    Example:
        >>> allowed_keys(slice(0, 3), 3, 3, causal=True, key_padding_mask=None, device=torch.device("cpu")).int()
        tensor([[[1, 0, 0],
                 [1, 1, 0],
                 [1, 1, 1]]], dtype=torch.int32)
    """
    t = torch.arange(rows.start, rows.stop, device=device)
    ok = torch.ones(1, t.numel(), n_k, dtype=torch.bool, device=device)
    if causal:
        ok = ok & (torch.arange(n_k, device=device)[None, None, :] <= (t + n_k - n_q)[None, :, None])
    if key_padding_mask is not None:
        ok = ok & key_padding_mask.to(device=device, dtype=torch.bool)[:, None, :]
    return ok.expand(batch, -1, -1) if ok.shape[0] == 1 and batch > 1 else ok


def _indexer_bnhd(q_idx: torch.Tensor, layout: str) -> torch.Tensor:
    if layout not in ("bhnd", "bnhd"):
        raise ValueError(f"Expected argument `layout` to be 'bhnd' or 'bnhd', but got {layout!r}.")
    if q_idx.dim() != 4:
        raise ValueError(f"Expected argument `q_idx` to be 4-D ([B, H_I, N_q, D_I] for 'bhnd'), but got shape "
                         f"{tuple(q_idx.shape)}.")
    return q_idx if layout == "bnhd" else q_idx.transpose(1, 2)


@torch.no_grad()
def indexer_logits(q_idx: torch.Tensor, k_idx: torch.Tensor, w_idx: torch.Tensor, *, layout: str = "bhnd",
                   rows: slice | None = None) -> torch.Tensor:
    r"""The indexer logits :math:`I_{ts} = \sum_j w_{tj}\,\mathrm{ReLU}(q^I_{j,t} \cdot k^I_s)` of the query rows
    ``rows`` (default: all), ``[B, rows, N_k]`` fp32, without masking. Materialises ``[B, rows, H_I, N_k]``: pass
    a block of rows for long sequences.

    Example:
        >>> q_idx, k_idx, w_idx = torch.ones(1, 2, 3, 4), torch.ones(1, 3, 4), torch.full((1, 3, 2), 0.5)
        >>> indexer_logits(q_idx, k_idx, w_idx)
        tensor([[[4., 4., 4.],
                 [4., 4., 4.],
                 [4., 4., 4.]]])
    """
    q = _indexer_bnhd(q_idx, layout)
    rows = rows or slice(0, q.shape[1])
    qb = q[:, rows].float()  # [B, r, H_I, D_I]
    b, r, h, d = qb.shape
    scores = torch.bmm(qb.reshape(b, r * h, d), k_idx.float().transpose(1, 2)).relu_()  # [B, r·H_I, N_k]
    return torch.einsum("brhs,brh->brs", scores.view(b, r, h, -1), w_idx[:, rows].float())


@torch.no_grad()
def indexer_topk(q_idx: torch.Tensor, k_idx: torch.Tensor, w_idx: torch.Tensor, topk: int, *, causal: bool = True,
                 key_padding_mask: torch.Tensor | None = None, layout: str = "bhnd",
                 max_elements: int = MAX_ELEMENTS) -> torch.Tensor:
    """Each query's ``topk`` allowed keys with the highest indexer logits: ``[B, N_q, min(topk, N_k)]`` int64, ``-1``
    in the slots of a row that may see fewer keys. Distinct within a row, so valid ``topk_indices`` for
    :func:`streamkl.indexer_kl`. No gradient.

    Args:
        q_idx, k_idx, w_idx: the indexer's inputs (see the module docstring for the layouts).
        topk: ``K``, ``>= 1``.
        causal: only keys at or before the row (bottom-right aligned). Default: ``True``.
        key_padding_mask: ``[B, N_k]`` bool, True for real keys. Default: ``None``.
        layout: the layout of ``q_idx``. Default: ``"bhnd"``.
        max_elements: bound on the elements of one block of indexer scores (``B · rows · H_I · N_k``).

    Example:
        >>> k_idx = torch.eye(4)[None]                                   # key s scores w_t · ReLU(q_t[s])
        >>> q_idx = torch.tensor([[0.0, 3.0, 1.0, 2.0]]).expand(4, 4)[None, None]
        >>> indexer_topk(q_idx, k_idx, torch.ones(1, 4, 1), 2)
        tensor([[[ 0, -1],
                 [ 1,  0],
                 [ 1,  2],
                 [ 1,  3]]])
    """
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"Expected argument `topk` to be an int >= 1, but got {topk!r}.")
    q = _indexer_bnhd(q_idx, layout)
    b, n_q, h, _ = q.shape
    n_k = k_idx.shape[1]
    kk = min(topk, n_k)
    out = torch.empty(b, n_q, kk, dtype=torch.int64, device=q.device)
    for rows in _blocks(n_q, _rows_per_block(b * h * n_k, n_q, max_elements)):
        scores = indexer_logits(q, k_idx, w_idx, layout="bnhd", rows=rows)
        ok = allowed_keys(rows, n_q, n_k, causal=causal, key_padding_mask=key_padding_mask, device=q.device,
                          batch=b)
        values, idx = scores.masked_fill(~ok, -math.inf).topk(kk, dim=-1)
        out[:, rows] = idx.masked_fill(values == -math.inf, -1)
    return out


def _check_main(q: torch.Tensor, k: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    if layout not in ("bhnd", "bnhd"):
        raise ValueError(f"Expected argument `layout` to be 'bhnd' or 'bnhd', but got {layout!r}.")
    for name, x in (("q", q), ("k", k)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"Expected argument `{name}` to be a 4-D tensor, but got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}.")
    if layout == "bnhd":
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"Expected the query heads H={q.shape[1]} to be divisible by the key heads "
                         f"H_kv={k.shape[1]}, but got q {tuple(q.shape)} and k {tuple(k.shape)}.")
    return q, k


def _head_mean_blocks(q: torch.Tensor, k: torch.Tensor, *, causal: bool, scale: float | None,
                      key_padding_mask: torch.Tensor | None, max_elements: int,
                      ) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
    """``(rows, p [B, rows, N_k], allowed [B, rows, N_k])``: the main attention's head mean over the allowed keys."""
    b, h, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    kf = k.float().repeat_interleave(h // h_kv, dim=1)  # [B, H, N_k, D]
    for rows in _blocks(n_q, _rows_per_block(b * h * n_k, n_q, max_elements)):
        ok = allowed_keys(rows, n_q, n_k, causal=causal, key_padding_mask=key_padding_mask, device=q.device,
                          batch=b)
        logits = torch.matmul(q[:, :, rows].float(), kf.transpose(-1, -2)).mul_(scale)
        logits = logits.masked_fill_(~ok[:, None], -math.inf)
        probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)  # a row with no allowed key: all zero
        yield rows, probs.mean(1), ok


@torch.no_grad()
def topk_attention_mass(q: torch.Tensor, k: torch.Tensor, topk_indices: torch.Tensor, *, causal: bool = True,
                        scale: float | None = None, key_padding_mask: torch.Tensor | None = None,
                        layout: str = "bhnd", max_elements: int = MAX_ELEMENTS) -> torch.Tensor:
    r"""The share of the main attention's mass on the selected keys, per query row: ``[B, N_q]`` fp32,
    :math:`\sum_{s \in S_t} p_{ts}` with :math:`p_t` the **dense** head mean of the per-head softmaxes over the keys
    row ``t`` may see (1 means the selection loses nothing; 0 for a row with no allowed key). ``-1`` slots and
    selected keys the row may not see count for nothing.

    Args:
        q, k: the main attention's queries and keys (see the module docstring), after RoPE.
        topk_indices: ``[B, N_q, K]`` selected key positions, ``-1`` for an empty slot.
        causal, key_padding_mask: which keys a row may see. Defaults: ``True``, ``None``.
        scale: the main attention's score scale. Default: ``1/sqrt(D)``.
        layout: ``"bhnd"`` or ``"bnhd"`` for ``q`` and ``k``. Default: ``"bhnd"``.
        max_elements: bound on the elements of one block of scores (``B · H · rows · N_k``).

    Example:
        >>> q, k = torch.zeros(1, 2, 4, 8), torch.zeros(1, 1, 4, 8)          # uniform attention over the past
        >>> topk_attention_mass(q, k, torch.tensor([[[0, -1], [0, -1], [0, 1], [2, 3]]]))
        tensor([[1.0000, 0.5000, 0.6667, 0.5000]])
    """
    q, k = _check_main(q, k, layout)
    b, _, n_q, _ = q.shape
    if topk_indices.dim() != 3 or tuple(topk_indices.shape[:2]) != (b, n_q):
        raise ValueError(f"Expected argument `topk_indices` to have shape [B, N_q, K] = ({b}, {n_q}, K), but got "
                         f"{tuple(topk_indices.shape)}.")
    out = torch.zeros(b, n_q, device=q.device)
    for rows, p, _ in _head_mean_blocks(q, k, causal=causal, scale=scale, key_padding_mask=key_padding_mask,
                                        max_elements=max_elements):
        sel = topk_indices[:, rows].long()
        picked = p.gather(-1, sel.clamp_min(0)).masked_fill_(sel < 0, 0.0)
        out[:, rows] = picked.sum(-1)
    return out


@torch.no_grad()
def best_topk_attention_mass(q: torch.Tensor, k: torch.Tensor, topk: int, *, causal: bool = True,
                             scale: float | None = None, key_padding_mask: torch.Tensor | None = None,
                             layout: str = "bhnd", max_elements: int = MAX_ELEMENTS) -> torch.Tensor:
    """The most any selection of ``topk`` keys per row can capture: the mass on the main attention's own top
    ``topk`` keys, ``[B, N_q]`` fp32 (arguments as :func:`topk_attention_mass`).

    Example:
        >>> q, k = torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8)
        >>> best_topk_attention_mass(q, k, 2)
        tensor([[1.0000, 1.0000, 0.6667, 0.5000]])
    """
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"Expected argument `topk` to be an int >= 1, but got {topk!r}.")
    q, k = _check_main(q, k, layout)
    b, _, n_q, _ = q.shape
    out = torch.zeros(b, n_q, device=q.device)
    for rows, p, _ in _head_mean_blocks(q, k, causal=causal, scale=scale, key_padding_mask=key_padding_mask,
                                        max_elements=max_elements):
        out[:, rows] = p.topk(min(topk, p.shape[-1]), dim=-1).values.sum(-1)
    return out
