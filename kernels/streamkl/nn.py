"""Module interface: :class:`AttentionKLLoss` holds the options of :func:`streamkl.attention_kl`."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from .api import attention_kl
from .options import BATCH, EXECUTION, PROBLEM, AttentionKLOptions, KLWithCount, keyword_signature, option_names


class AttentionKLLoss(nn.Module):
    r"""KL divergence between teacher and student attention distributions, as an ``nn.Module``.

    The constructor takes the options of :func:`streamkl.attention_kl` (checked immediately, so a bad
    value fails where it is written) and keeps them as an :class:`~streamkl.options.AttentionKLOptions`
    (:attr:`options`; each option is also an attribute); ``forward`` takes the tensors and the per-batch ones:
    masks, sinks and packed-sequence offsets.

    Args:
        causal, scale_t, scale_s, temperature, direction, reduction, layout, backend, window, softcap_t,
        softcap_s, allow_tf32, deterministic, check_finite, return_count: as in :func:`streamkl.attention_kl`.
        options: an :class:`~streamkl.options.AttentionKLOptions` whose fields the keywords replace. Default:
            ``None`` (every default).

    Example:
        >>> import torch
        >>> from streamkl import AttentionKLLoss
        >>> loss_fn = AttentionKLLoss(causal=True, temperature=2.0)
        >>> q_t, k_t, q_s, k_s = (torch.randn(1, 2, 8, 16) for _ in range(4))
        >>> loss = loss_fn(q_t, k_t, q_s, k_s)
        >>> loss.shape, bool(loss >= 0), loss_fn.temperature
        (torch.Size([]), True, 2.0)
    """

    options: AttentionKLOptions

    def __init__(self, *, options: AttentionKLOptions | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.options = AttentionKLOptions.of("AttentionKLLoss", options, kwargs, kinds=(PROBLEM, EXECUTION))

    def forward(
        self,
        q_t: torch.Tensor,
        k_t: torch.Tensor,
        q_s: torch.Tensor,
        k_s: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        query_mask: torch.Tensor | None = None,
        **batch: Any,
    ) -> torch.Tensor | KLWithCount:
        """Compute the loss; see :func:`streamkl.attention_kl` for shapes, masks, sinks and packed offsets (the
        per-batch keywords: ``sinks_t``, ``sinks_s``, ``cu_seqlens_q``, ``cu_seqlens_k``, ``max_seqlen_q``,
        ``max_seqlen_k``, ``attn_mask``)."""
        batch.update(key_padding_mask=key_padding_mask, query_mask=query_mask)
        options = AttentionKLOptions.of(f"{type(self).__name__}.forward", self.options, batch, kinds=(BATCH,))
        return attention_kl(q_t, k_t, q_s, k_s, options=options)

    def extra_repr(self) -> str:
        o = self.options
        return (
            f"causal={o.causal}, temperature={o.temperature}, direction={o.direction!r}, "
            f"reduction={o.reduction!r}, layout={o.layout!r}, backend={o.backend!r}"
            + (f", window={o.window}" if o.window is not None else "")
            + (f", softcap_t={o.softcap_t}" if o.softcap_t is not None else "")
            + (f", softcap_s={o.softcap_s}" if o.softcap_s is not None else "")
        )


def _option_property(name: str) -> property:
    def get(self: AttentionKLLoss) -> Any:
        return getattr(self.options, name)

    def set_(self: AttentionKLLoss, value: Any) -> None:  # checked as in the constructor
        self.options = dataclasses.replace(self.options, **{name: value})

    return property(get, set_, doc=f"The ``{name}`` option (see :func:`streamkl.attention_kl`).")


for _name in option_names(PROBLEM, EXECUTION):
    setattr(AttentionKLLoss, _name, _option_property(_name))
AttentionKLLoss.__init__.__signature__ = keyword_signature(AttentionKLLoss.__init__, (PROBLEM, EXECUTION))
AttentionKLLoss.forward.__signature__ = keyword_signature(AttentionKLLoss.forward, (BATCH,))
