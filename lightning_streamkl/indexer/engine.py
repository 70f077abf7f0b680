r"""
Indexer engine
^^^^^^^^^^^^^^

The Lightning-free core of indexer training (:class:`IndexerDistiller`), what
:class:`~lightning_streamkl.IndexerDistillation` and :class:`~lightning_streamkl.IndexerDistillationMixin` adapt and
what a plain PyTorch loop uses directly. One model holds both sides: the main attention layers are captured as for
distillation (their ``(q, k)``, post-RoPE, detached: the target is a constant) and the indexers hand over their
``(q_idx, k_idx, w_idx)`` with :func:`~lightning_streamkl.indexer.record_indexer`. Per layer, the term is
:func:`streamkl.indexer_kl`: over every allowed key in the dense warm-up, over the indexer's own top-``K`` keys from
``sparse_from_step`` on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn

from streamkl import indexer_kl

from ..capture import AttentionCapture, build_capture, closest
from ..engine import DistillationMetrics, padding_mask_from_batch
from ..loss import LossOutput
from ..terms import count_rows
from .capture import CapturedIndexer, IndexerCapture
from .config import DEFAULT_INDEXER_CHILD, IndexerConfig, validate_indexer_config
from .module import LightningIndexer
from .selection import indexer_topk

__all__ = ["IndexerDistiller", "parameters_reached"]


def parameters_reached(tensors: Iterable[torch.Tensor], parameters: Mapping[int, str]) -> list[str]:
    """The names of ``parameters`` (``{id(parameter): name}``) that a backward pass from ``tensors`` would reach,
    in the order found (follows the autograd graph once; nothing is computed).

    Example:
        >>> lin = nn.Linear(2, 2)
        >>> x = lin(torch.randn(1, 2))
        >>> parameters_reached([x], {id(lin.weight): "weight"}), parameters_reached([x.detach()], {id(lin.weight): "w"})
        (['weight'], [])
    """
    found: list[str] = []
    seen: set[int] = set()
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        variable = getattr(fn, "variable", None)
        if variable is not None and id(variable) in parameters and parameters[id(variable)] not in found:
            found.append(parameters[id(variable)])
        stack.extend(f for f, _ in fn.next_functions if f is not None)
    return found


class IndexerDistiller:
    r"""Captures and loss of indexer training on one model; no Lightning needed.

    Per step: the model's forward pass runs inside :meth:`recording` (the main attention layers and the indexers
    are recorded), then :meth:`end_step` returns the :class:`~lightning_streamkl.loss.LossOutput` (``total`` is
    :math:`\sum_l w_l \overline{\mathrm{KL}}_l`, differentiable w.r.t. the indexers only; multiply it by
    :meth:`weight_at`) and releases what was captured. :meth:`stage_at` says which stage a step is in.

    Args:
        config: an :class:`~lightning_streamkl.IndexerConfig` or a mapping of its fields.
        padding_mask: ``fn(batch) -> [B, N] bool mask or None``; default: ``batch[config.mask_key]``.

    Example:
        A step in plain PyTorch, on a model whose attention is an ``nn.MultiheadAttention``:

        >>> from lightning_streamkl import LightningIndexer
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> model = nn.Sequential(nn.MultiheadAttention(16, 4, batch_first=True))
        >>> _ = LightningIndexer(16, heads=2, head_dim=8).attach(model[0])
        >>> distiller = IndexerDistiller({"layers": [0], "topk": 4, "sparse_from_step": 1, "causal": True})
        >>> distiller.setup(model)
        [('0', '0.indexer')]
        >>> x = torch.randn(2, 12, 16)
        >>> with distiller.recording():
        ...     _ = model[0](x, x, x, need_weights=False)
        >>> terms = distiller.end_step(x, step=0)
        >>> terms.total.backward()
        >>> list(terms.per_pair), distiller.stage_at(0), distiller.stage_at(1), model[0].in_proj_weight.grad
        (['l0'], 'dense', 'sparse', None)
    """

    def __init__(self, config: IndexerConfig | Mapping[str, Any],
                 *, padding_mask: Callable[[Any], torch.Tensor | None] | None = None) -> None:
        self.config = config = validate_indexer_config(config)
        self.padding_mask = padding_mask or functools.partial(padding_mask_from_batch, key=config.mask_key)
        self.layer_names = [layer.label for layer in config.layers]
        self.weights = [layer.weight for layer in config.layers]
        self.model: nn.Module | None = None
        self.attention_capture: AttentionCapture | None = None
        self.indexer_capture: IndexerCapture | None = None
        #: ``(attention layer path, indexer name)`` per configured layer, after :meth:`setup`.
        self.resolved: list[tuple[str, str]] = []
        self._detach_checked = not config.check_detached

    # ------------------------------------------------------------------------------------------ setup
    def setup(self, model: nn.Module) -> list[tuple[str, str]]:
        """Build the captures and resolve every layer's attention path and indexer name (idempotent for the same
        model). Returns the ``(attention layer, indexer)`` pairs.

        Raises:
            ValueError: an unknown attention layer (listing the closest names), or a layer without ``indexer`` whose
                attention layer has no ``indexer`` submodule (listing the indexer modules found).
        """
        if self.model is model:
            return self.resolved
        if not isinstance(model, nn.Module):
            raise TypeError(f"Expected argument `model` to be a torch.nn.Module, but got {type(model).__name__}.")
        capture = build_capture(model, self.config.capture)
        modules = dict(model.named_modules())
        resolved = []
        for i, layer in enumerate(self.config.layers):
            where = f"layers[{i}] ({layer.label!r})"
            attention = capture.resolve(layer.attention, role=f"attention layer of {where}")
            indexer = layer.indexer
            if indexer is None:
                indexer = f"{attention}.{DEFAULT_INDEXER_CHILD}" if attention else DEFAULT_INDEXER_CHILD
                if indexer not in modules:
                    found = [n for n, m in model.named_modules() if isinstance(m, LightningIndexer)
                             or n.rsplit(".", 1)[-1] == DEFAULT_INDEXER_CHILD]
                    near = closest(indexer, found)
                    raise ValueError(
                        f"Expected an indexer module at {indexer!r} for {where} (the default: the attention layer's "
                        f"`{DEFAULT_INDEXER_CHILD}` submodule), but {type(model).__name__} has none; set the layer's "
                        "`indexer` to the indexer module's path or the name it records under. Indexer modules found: "
                        f"{near or found or 'none'}."
                    )
            resolved.append((attention, indexer))
        capture.select({a for a, _ in resolved})
        indexers = IndexerCapture(model)
        indexers.select({i for _, i in resolved})
        self.attention_capture, self.indexer_capture = capture, indexers
        self.resolved = resolved
        self.model = model
        return resolved

    def describe(self) -> str:
        """One line saying what is trained, e.g. for the start of a run.

        Example:
            >>> model = nn.Sequential(nn.MultiheadAttention(8, 2))
            >>> model[0].indexer = LightningIndexer(8, heads=1, head_dim=4)
            >>> d = IndexerDistiller({"layers": [0], "topk": 16, "sparse_from_step": 100})
            >>> _ = d.setup(model)
            >>> d.describe()
            "StreamKL 'indexer_kl': training 1 indexer(s) on the main attention: l0 (0 <- 0.indexer); dense warm-up \
for 100 steps, then the sparse stage (top-16 keys)"
        """
        layers = ", ".join(f"{n} ({a} <- {i})" for n, (a, i) in zip(self.layer_names, self.resolved))
        start = self.config.sparse_from_step
        if start is None:
            stages = "dense stage throughout"
        elif start == 0:
            stages = f"sparse stage (top-{self.config.topk} keys) throughout"
        else:
            stages = f"dense warm-up for {start} steps, then the sparse stage (top-{self.config.topk} keys)"
        return f"StreamKL {self.config.name!r}: training {len(self.resolved)} indexer(s) on the main attention: " \
               f"{layers}; {stages}"

    def metrics(self) -> DistillationMetrics:
        """A fresh :class:`~lightning_streamkl.DistillationMetrics` for this setup's layers."""
        return DistillationMetrics(self.layer_names, self.weights, self.config.name)

    def stage_at(self, step: int) -> str:
        """``"dense"`` or ``"sparse"``: the stage of optimizer step ``step``.

        Example:
            >>> IndexerDistiller({"layers": [0], "sparse_from_step": 10}).stage_at(9)
            'dense'
        """
        start = self.config.sparse_from_step
        return "sparse" if start is not None and step >= start else "dense"

    def weight_at(self, step: int) -> float:
        """The global weight at optimizer step ``step`` (linear warm-up from 0 over ``warmup_steps``).

        Example:
            >>> IndexerDistiller({"layers": [0], "weight": 2.0, "warmup_steps": 4}).weight_at(1)
            0.5
        """
        cfg = self.config
        if cfg.warmup_steps <= 0:
            return cfg.weight
        return cfg.weight * min(1.0, max(step, 0) / cfg.warmup_steps)

    # ------------------------------------------------------------------------------------------ per step
    def _ready(self) -> tuple[nn.Module, AttentionCapture, IndexerCapture]:
        if self.model is None or self.attention_capture is None or self.indexer_capture is None:
            raise RuntimeError("IndexerDistiller.setup(model) must run before the first step.")
        return self.model, self.attention_capture, self.indexer_capture

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Record the main attention layers and the indexers during the forward passes run inside the block."""
        _, attention, indexers = self._ready()
        with ExitStack() as stack:
            stack.enter_context(attention.recording())
            stack.enter_context(indexers.recording())
            yield

    @property
    def recorded(self) -> bool:
        """True when something was recorded since the last :meth:`clear`."""
        return bool((self.attention_capture is not None and self.attention_capture.records)
                    or (self.indexer_capture is not None and self.indexer_capture.records))

    def end_step(self, batch: Any, *, step: int, training: bool = True) -> LossOutput:
        """The loss terms of this step (the stage of optimizer step ``step``), then release the records.

        ``batch`` gives the padding mask; ``training`` enables the one-time :attr:`~IndexerConfig.check_detached`
        check.

        Raises:
            RuntimeError: a configured attention layer or indexer recorded nothing in this step (listing what did).
            ValueError: an indexer whose sequence lengths differ from its attention layer's, no causality known
                (set ``causal``), or indexer inputs that reach the main model's parameters (``check_detached``).
        """
        try:
            return self._compute(batch, step=step, training=training)
        finally:
            self.clear()

    def _compute(self, batch: Any, *, step: int, training: bool) -> LossOutput:
        model, attention_capture, indexer_capture = self._ready()
        attention, indexers = attention_capture.pop(), indexer_capture.pop()
        mask = self.padding_mask(batch)
        sparse = self.stage_at(step) == "sparse"
        if training and not self._detach_checked:
            self._check_detached(model, indexers)
        totals, per_layer, sums, rows = [], {}, [], []
        for name, weight, (path, indexer) in zip(self.layer_names, self.weights, self.resolved):
            att = attention.get(path)
            if att is None:
                raise RuntimeError(
                    f"StreamKL {self.config.name!r}: the attention layer {path!r} of layer {name!r} recorded nothing "
                    f"in this step (recorded: {sorted(attention)}); run the model's forward pass inside the recording."
                )
            ind = indexers.get(indexer)
            if ind is None:
                raise RuntimeError(
                    f"StreamKL {self.config.name!r}: the indexer {indexer!r} of layer {name!r} recorded nothing in "
                    f"this step (recorded: {sorted(indexers)}); its forward must call record_indexer() "
                    "(LightningIndexer does; LightningIndexer.attach runs it with the attention layer)."
                )
            kl_sum, count = self._layer(name, att, ind, mask, sparse)
            mean = kl_sum / count.clamp_min(1.0)
            per_layer[name] = mean
            totals.append(weight * mean)
            sums.append(kl_sum.detach())
            rows.append(count)
        return LossOutput(torch.stack(totals).sum(), per_layer, torch.stack(sums).float(), torch.stack(rows))

    def _layer(self, name: str, att: Any, ind: CapturedIndexer, mask: torch.Tensor | None,
               sparse: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(KL summed over the counted rows, number of counted rows)`` of one layer."""
        cfg = self.config
        q, k = att.q.detach(), att.k.detach()
        batch, _, n_q, _ = q.shape
        n_k = k.shape[2]
        if ind.q_idx.shape[0] != batch or ind.n_q != n_q or ind.k_idx.shape[1] != n_k:
            raise ValueError(
                f"Expected the indexer of layer {name!r} to cover the attention's [B, N_q, N_k] = {[batch, n_q, n_k]}, "
                f"but it recorded q_idx {tuple(ind.q_idx.shape)} ([B, H_I, N_q, D_I]) and k_idx "
                f"{tuple(ind.k_idx.shape)} ([B, N_k, D_I])."
            )
        causal = cfg.causal if cfg.causal is not None else att.causal
        if causal is None:
            raise ValueError(f"The capture cannot tell whether the attention of layer {name!r} is causal; set "
                             "`causal` in the indexer config.")
        keys = att.key_padding_mask if att.key_padding_mask is not None else mask
        keys = None if keys is None else keys.to(device=q.device, dtype=torch.bool)
        queries = mask.to(device=q.device, dtype=torch.bool) if cfg.mask_queries and mask is not None else None
        if queries is not None and tuple(queries.shape) != (batch, n_q):
            queries = None  # a batch mask that is not the query rows' (cross-attention): keys only
        topk = None
        if sparse:
            topk = indexer_topk(ind.q_idx, ind.k_idx, ind.w_idx, cfg.topk, causal=causal, key_padding_mask=keys)
        kl = indexer_kl(q, k, ind.q_idx, ind.k_idx, ind.w_idx, causal=causal, scale=att.scale, topk_indices=topk,
                        key_padding_mask=keys, reduction="none", backend=cfg.backend, check_indices=False)
        if queries is not None:
            kl = kl * queries
        count = count_rows(batch, 1, n_q, n_k, causal=causal, device=q.device, key_padding_mask=keys,
                           query_mask=queries)
        return kl.sum(), count

    def _check_detached(self, model: nn.Module, indexers: Mapping[str, CapturedIndexer]) -> None:
        self._detach_checked = True
        modules = dict(model.named_modules())
        own = [path for _, path in self.resolved if path in modules]
        main = {id(p): n for n, p in model.named_parameters()
                if p.requires_grad and not any(n.startswith(path + ".") for path in own)}
        for _, path in self.resolved:
            record = indexers.get(path)
            if record is None:
                continue
            reached = parameters_reached((record.q_idx, record.k_idx, record.w_idx), main)
            if reached:
                shown = reached[:3] + ([f"... ({len(reached) - 3} more)"] if len(reached) > 3 else [])
                raise ValueError(
                    f"StreamKL {self.config.name!r}: the inputs of the indexer {path!r} depend on parameters of the "
                    f"main model ({', '.join(shown)}), so the indexer loss would train them. Detach the hidden states "
                    "the indexer reads (LightningIndexer(detach_input=True), the default, does), or set "
                    "`check_detached=False` to allow it."
                )

    def clear(self) -> None:
        """Release everything captured in this step."""
        for capture in (self.attention_capture, self.indexer_capture):
            if capture is not None:
                capture.clear()
