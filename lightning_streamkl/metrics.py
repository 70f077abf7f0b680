r"""
Attention-KL metric
^^^^^^^^^^^^^^^^^^^

A torchmetrics ``Metric`` that tracks, per layer pair, the mean attention KL over query rows (each row
weighs the same, whatever batch it came from), summed across processes under DDP.

.. math::

    \overline{\mathrm{KL}}_p = \frac{\sum_{\text{batches}} \sum_{b,h,i} \mathrm{KL}_{p,bhi}}
                                    {\sum_{\text{batches}} \#\{\text{counted rows}\}}

KL is asymmetric: the pair's direction (forward KL(teacher‖student) or reverse) decides which one is tracked.

The sums are float64 where the device has float64, and float32 on the devices that have none (Apple's MPS): the
states' dtype follows the device they are moved to (:func:`state_dtype`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torchmetrics import Metric

__all__ = ["FLOAT32_DEVICES", "AttentionKLDivergence", "state_dtype"]

#: Device types without float64, where the metric's sums are float32.
FLOAT32_DEVICES = ("mps",)


def state_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype of the metric's sums on ``device``: float64, or float32 on a device type without float64 (MPS).

    Example:
        >>> state_dtype("cpu"), state_dtype("mps"), state_dtype(torch.device("cuda", 1))
        (torch.float64, torch.float32, torch.float64)
    """
    return torch.float32 if torch.device(device).type in FLOAT32_DEVICES else torch.float64


def _attention_kl_update(kl_sums: Tensor, rows: Tensor, num_pairs: int, dtype: torch.dtype = torch.float64,
                         validate_args: bool = True) -> tuple[Tensor, Tensor]:
    """Check one batch's per-pair KL sums and row counts; return them as ``[P]`` vectors of ``dtype``."""
    kl_sums, rows = torch.as_tensor(kl_sums), torch.as_tensor(rows)
    for name, x in (("kl_sums", kl_sums), ("rows", rows)):
        if x.dim() != 1 or x.shape[0] != num_pairs:
            raise ValueError(f"Expected `{name}` to have shape ({num_pairs},) (one per pair), got {tuple(x.shape)}.")
    if validate_args and bool((rows < 0).any()):
        raise ValueError(f"Expected `rows` to be >= 0, but got {rows.tolist()}.")
    return kl_sums.detach().to(dtype), rows.detach().to(dtype)


def _attention_kl_compute(kl_sum: Tensor, rows: Tensor) -> Tensor:
    """Per-pair mean KL ``kl_sum / rows`` (0 for a pair that counted no rows)."""
    return torch.where(rows > 0, kl_sum / rows.clamp_min(1), torch.zeros_like(kl_sum))


class AttentionKLDivergence(Metric):
    """Per-pair mean attention KL, row-weighted and synced across processes.

    As input to ``forward`` and ``update``:

    - ``kl_sums`` (:class:`~torch.Tensor`): ``[P]``, each pair's KL summed over this batch's counted rows
      (``attention_kl(..., reduction="sum")``).
    - ``rows`` (:class:`~torch.Tensor`): ``[P]``, the number of counted rows per pair (``B·H·valid rows``).

    As output of ``compute``: a dict ``{"<prefix><pair>": mean KL}`` (float32 scalars) and, when ``weights``
    are given, ``"<prefix>total"``: ``Σ_p weight_p · mean_p``.

    Args:
        pair_names: one name per pair, unique.
        weights: optional per-pair weights for the total.
        prefix: prepended to every key. Default: ``"attn_kl/"``.
        validate_args: check that ``rows`` are ``>= 0`` on every update, which reads them on the host (one
            synchronisation per update when they are on a GPU). The distillation engine passes ``False``: its rows
            are the op's counts. Shapes are always checked.
        kwargs: passed to :class:`torchmetrics.Metric` (``sync_on_compute``, ``process_group``, ...).

    Raises:
        TypeError: ``pair_names`` is not a sequence of strings.
        ValueError: no or duplicate pair names, or ``weights`` of another length.

    Example:
        >>> import torch
        >>> metric = AttentionKLDivergence(["last", "mid"], weights=[1.0, 0.5])
        >>> metric.update(torch.tensor([2.0, 1.0]), torch.tensor([4.0, 4.0]))
        >>> metric.update(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0]))
        >>> {k: round(float(v), 4) for k, v in metric.compute().items()}
        {'attn_kl/last': 0.6, 'attn_kl/mid': 0.25, 'attn_kl/total': 0.725}
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False
    plot_lower_bound = 0.0

    kl_sum: Tensor
    rows: Tensor

    def __init__(self, pair_names: Sequence[str], weights: Sequence[float] | None = None, prefix: str = "attn_kl/",
                 validate_args: bool = True, **kwargs: object) -> None:
        super().__init__(**kwargs)
        if isinstance(pair_names, str) or not all(isinstance(n, str) for n in pair_names):
            raise TypeError(f"Expected `pair_names` to be a sequence of str, but got {pair_names!r}.")
        names = list(pair_names)
        if not names or len(set(names)) != len(names):
            raise ValueError(f"Expected `pair_names` to be non-empty and unique, but got {names}.")
        if weights is not None and len(weights) != len(names):
            raise ValueError(f"Expected `weights` to have {len(names)} entries (one per pair), but got {len(weights)}.")
        if not isinstance(prefix, str):
            raise TypeError(f"Expected `prefix` to be a str, but got {type(prefix).__name__}.")
        self.pair_names = names
        self.weights = None if weights is None else [float(w) for w in weights]
        self.prefix = prefix
        self.validate_args = bool(validate_args)
        dtype = state_dtype("cpu")
        self.add_state("kl_sum", torch.zeros(len(names), dtype=dtype), dist_reduce_fx="sum")
        self.add_state("rows", torch.zeros(len(names), dtype=dtype), dist_reduce_fx="sum")

    def _apply(self, fn: Callable[[Tensor], Tensor], exclude_state: Sequence[str] = "") -> AttentionKLDivergence:
        """Move the states as :class:`torchmetrics.Metric` does, first casting them (and their defaults) to the
        :func:`state_dtype` of the target device, where they still are (MPS cannot hold float64)."""
        dtype = state_dtype(fn(torch.zeros(1)).device)
        if self.kl_sum.dtype != dtype:
            for key in ("kl_sum", "rows"):
                setattr(self, key, getattr(self, key).to(dtype))
                self._defaults[key] = self._defaults[key].to(dtype)
        return super()._apply(fn, exclude_state)

    def update(self, kl_sums: Tensor, rows: Tensor) -> None:
        """Accumulate one batch's per-pair KL sums and row counts."""
        kl_sums, rows = _attention_kl_update(kl_sums, rows, len(self.pair_names), self.kl_sum.dtype,
                                              self.validate_args)
        # out of place: under `ddp_spawn` on CPU the state tensors arrive in every process in shared memory (torch's
        # multiprocessing pickling; Lightning un-shares only parameters and buffers), so `+=` would sum all processes
        self.kl_sum = self.kl_sum + kl_sums.to(self.kl_sum.device)
        self.rows = self.rows + rows.to(self.rows.device)

    def compute(self) -> dict[str, Tensor]:
        """``{"<prefix><pair>": mean KL}`` (and ``"<prefix>total"`` with weights)."""
        means = _attention_kl_compute(self.kl_sum, self.rows)
        out = {f"{self.prefix}{n}": means[i].float() for i, n in enumerate(self.pair_names)}
        if self.weights is not None:
            w = torch.tensor(self.weights, dtype=means.dtype, device=means.device)
            out[f"{self.prefix}total"] = (w * means).sum().float()
        return out
