r"""
Indexer recorder
^^^^^^^^^^^^^^^^

The lightning indexer hands its ``(q_idx, k_idx, w_idx)`` over with :func:`record_indexer`, the counterpart of
:func:`lightning_streamkl.capture.record` for the main attention's ``(q, k)``: it costs nothing unless an
:class:`IndexerCapture` is recording, and it holds the tensors only until the loss of the step takes them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["CapturedIndexer", "IndexerCapture", "indexer_recording", "record_indexer"]

#: The indexer captures whose recording block is open, innermost last.
_RECORDING: list[IndexerCapture] = []

INDEXER_LAYOUTS = ("bhnd", "bnhd")


@dataclass
class CapturedIndexer:
    """The inputs of one indexer call, in the layout :func:`streamkl.indexer_kl` takes as ``"bhnd"``.

    Attributes:
        q_idx: indexer queries ``[B, H_I, N_q, D_I]`` (a view of what was recorded, never a copy).
        k_idx: indexer keys ``[B, N_k, D_I]``, one per token, shared by the indexer heads.
        w_idx: indexer head weights ``[B, N_q, H_I]``, any scale folded in.

    Example:
        >>> r = CapturedIndexer(torch.randn(2, 4, 8, 16), torch.randn(2, 8, 16), torch.randn(2, 8, 4))
        >>> r.heads, r.n_q
        (4, 8)
    """

    q_idx: torch.Tensor
    k_idx: torch.Tensor
    w_idx: torch.Tensor

    @property
    def heads(self) -> int:
        """``H_I``, the number of indexer heads."""
        return self.q_idx.shape[1]

    @property
    def n_q(self) -> int:
        """``N_q``, the number of query positions."""
        return self.q_idx.shape[2]


def _check(q_idx: object, k_idx: object, w_idx: object, layout: object) -> CapturedIndexer:
    if layout not in INDEXER_LAYOUTS:
        raise ValueError(f"Expected argument `layout` to be one of {list(INDEXER_LAYOUTS)}, but got {layout!r}.")
    shapes = {"q_idx": ("[B, N_q, H_I, D_I]" if layout == "bnhd" else "[B, H_I, N_q, D_I]", 4),
              "k_idx": ("[B, N_k, D_I]", 3), "w_idx": ("[B, N_q, H_I]", 3)}
    for name, x in (("q_idx", q_idx), ("k_idx", k_idx), ("w_idx", w_idx)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            got = f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"Expected argument `{name}` of record_indexer to be a floating-point tensor, but got "
                            f"{got}.")
        doc, rank = shapes[name]
        if x.dim() != rank:
            raise ValueError(f"Expected argument `{name}` of record_indexer to be {doc} (layout {layout!r}), but got "
                             f"shape {tuple(x.shape)}.")
    assert isinstance(q_idx, torch.Tensor) and isinstance(k_idx, torch.Tensor) and isinstance(w_idx, torch.Tensor)
    q = q_idx.transpose(1, 2) if layout == "bnhd" else q_idx
    return CapturedIndexer(q, k_idx, w_idx)


def indexer_recording() -> bool:
    """True while any :class:`IndexerCapture` is recording (an indexer whose outputs serve only the loss can skip its
    forward otherwise).

    Example:
        >>> indexer_recording()
        False
    """
    return bool(_RECORDING)


def record_indexer(layer: str | nn.Module, q_idx: torch.Tensor, k_idx: torch.Tensor, w_idx: torch.Tensor, *,
                   layout: str = "bhnd") -> None:
    """Hand the inputs of one lightning-indexer call to the indexer captures that are recording.

    Call it from the indexer's ``forward`` (:class:`~lightning_streamkl.LightningIndexer` does); outside a
    recording block it does nothing. The indexer logits these define are
    :math:`I_{ts} = \\sum_j w_{tj}\\,\\mathrm{ReLU}(q^I_{j,t} \\cdot k^I_s)`, with no other scale.

    Args:
        layer: the indexer module itself (its path in the captured model becomes the name, and only the captures
            of models that contain it receive the call), or a name of your choosing.
        q_idx: indexer queries, ``[B, H_I, N_q, D_I]`` (``layout="bhnd"``) or ``[B, N_q, H_I, D_I]``
            (``"bnhd"``, what a linear projection gives).
        k_idx: indexer keys ``[B, N_k, D_I]``.
        w_idx: indexer head weights ``[B, N_q, H_I]``.
        layout: the layout of ``q_idx``. Default: ``"bhnd"``.

    Raises:
        TypeError: an input that is not a floating-point tensor (only checked while recording).
        ValueError: an input of the wrong rank, or an unknown ``layout`` (only checked while recording).

    Example:
        >>> capture = IndexerCapture(nn.Identity())
        >>> with capture.recording():
        ...     record_indexer("idx0", torch.randn(2, 8, 4, 16), torch.randn(2, 8, 16), torch.randn(2, 8, 4),
        ...                    layout="bnhd")
        >>> tuple(capture.records["idx0"].q_idx.shape)
        (2, 4, 8, 16)
    """
    if not _RECORDING:
        return
    record = _check(q_idx, k_idx, w_idx, layout)
    for capture in tuple(_RECORDING):
        name = capture.module_path(layer) if isinstance(layer, nn.Module) else str(layer)
        if name is not None:  # a module outside this capture's model is not its business
            capture.record(name, record)


class IndexerCapture:
    """Records what the indexers of ``model`` hand to :func:`record_indexer` while :meth:`recording` is open.

    Args:
        model: the module that contains the indexers; names of indexer modules are their paths in it.
        exclude: submodules to ignore, with everything below them.

    Attributes:
        records: ``{name: CapturedIndexer}`` recorded since the last :meth:`pop` (a name recorded twice keeps its
            last call).
        selected: the names to record, or ``None`` for every name.

    Example:
        >>> class Indexer(nn.Module):
        ...     def forward(self, x):                                   # x: [B, N, 8]
        ...         record_indexer(self, x.unsqueeze(2), x, x[..., :1], layout="bnhd")
        ...         return x
        >>> model = nn.Sequential(Indexer(), Indexer())
        >>> capture = IndexerCapture(model)
        >>> capture.select(["1"])
        >>> with capture.recording():
        ...     _ = model(torch.randn(2, 5, 8))
        >>> sorted(capture.pop()), capture.records
        (['1'], {})
    """

    def __init__(self, model: nn.Module, *, exclude: Iterable[nn.Module] = ()) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Expected argument `model` to be a torch.nn.Module, but got {type(model).__name__}.")
        self.model = model
        self._exclude = [m for m in exclude if m is not model]
        self.records: dict[str, CapturedIndexer] = {}
        self.selected: set[str] | None = None
        self._paths: dict[int, str] | None = None
        self._depth = 0

    def module_path(self, module: nn.Module) -> str | None:
        """The path of ``module`` inside the model (``None`` when it is not part of it, or excluded)."""
        if self._paths is None:
            skip = {id(m) for m in self._exclude}
            paths: dict[int, str] = {}
            excluded: list[str] = []
            for name, m in self.model.named_modules():
                if any(name == e or name.startswith(e + ".") for e in excluded):
                    continue
                if id(m) in skip:
                    excluded.append(name)
                    continue
                paths.setdefault(id(m), name)
            self._paths = paths
        return self._paths.get(id(module))

    def select(self, names: Iterable[str] | None) -> None:
        """Record only these names (``None``: all)."""
        self.selected = None if names is None else set(names)

    def record(self, name: str, record: CapturedIndexer) -> None:
        """Store one call's inputs under ``name`` (ignored when ``name`` is not selected)."""
        if self.selected is None or name in self.selected:
            self.records[name] = record

    @property
    def is_recording(self) -> bool:
        """True while a :meth:`recording` block is open."""
        return self._depth > 0

    @contextmanager
    def recording(self) -> Iterator[IndexerCapture]:
        """Receive the :func:`record_indexer` calls made inside the block (re-entrant)."""
        self._depth += 1
        _RECORDING.append(self)
        try:
            yield self
        finally:  # drop the innermost occurrence, even if blocks close out of order
            del _RECORDING[len(_RECORDING) - 1 - _RECORDING[::-1].index(self)]
            self._depth -= 1

    def pop(self) -> dict[str, CapturedIndexer]:
        """Hand over the records and forget them."""
        records, self.records = self.records, {}
        return records

    def clear(self) -> None:
        """Drop every record (releases the captured tensors)."""
        self.records = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model={type(self.model).__name__}, recording={self.is_recording})"
