r"""
Snapshots
^^^^^^^^^

What a task boundary keeps: a frozen copy of the model (:func:`frozen_copy`), or, after a resume, the
checkpointed weights until :func:`rebuild` loads them into a copy of the live module's structure.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from ..engine import AttentionDistiller
from ..step_wrapper import copy_memo, strip_wrappers

__all__ = ["Snapshot", "frozen_copy", "rebuild"]


@dataclass
class Snapshot:
    """One kept snapshot.

    Attributes:
        task: the task whose end produced it.
        module: the frozen copy; ``None`` until a checkpointed one is rebuilt.
        pending: checkpointed weights waiting for a module structure.
        distiller: the engine that runs it as a teacher (built at its first step).

    Example:
        >>> Snapshot(task=2, pending={"weight": torch.zeros(1)}).state()
        {'task': 2, 'state_dict': {'weight': tensor([0.])}}
    """

    task: int
    module: nn.Module | None = None
    pending: dict[str, torch.Tensor] | None = None
    distiller: AttentionDistiller | None = None

    def state(self) -> dict[str, Any]:
        """``{"task", "state_dict"}`` for a checkpoint (host tensors).

        Example:
            >>> Snapshot(task=0, module=nn.Linear(1, 1)).state()["state_dict"].keys()
            dict_keys(['weight', 'bias'])
        """
        weights = self.pending if self.module is None else self.module.state_dict()
        return {"task": self.task, "state_dict": {k: v.detach().cpu() for k, v in (weights or {}).items()}}

    def release(self) -> None:
        """Drop the engine (and what it captured); it is rebuilt at the next step."""
        if self.distiller is not None:
            self.distiller.clear()
            self.distiller = None


def frozen_copy(root: nn.Module, pl_module: nn.Module) -> nn.Module:
    """A frozen deep copy of ``root`` (``pl_module`` or one of its submodules), without the trainer or the step
    wrappers of ``pl_module``.

    Example:
        >>> frozen = frozen_copy(nn.Linear(2, 2), nn.Module())
        >>> frozen.training, frozen.weight.requires_grad
        (False, False)
    """
    memo = copy_memo(pl_module)
    trainer = getattr(pl_module, "_trainer", None)
    if trainer is not None:
        memo[id(trainer)] = None
    try:
        frozen = copy.deepcopy(root, memo)
    except (RuntimeError, TypeError) as err:
        raise RuntimeError(
            f"ContinualAttentionRegularizer could not copy {type(root).__name__} for the snapshot ({err}). A module "
            "holding non-leaf tensors (e.g. a stored loss) or unpicklable objects cannot be deep-copied; set `module` "
            "to the network submodule (e.g. module='model') or drop those attributes."
        ) from err
    if root is pl_module:
        strip_wrappers(frozen)
    frozen.eval()
    frozen.requires_grad_(False)
    return frozen


def rebuild(snapshot: Snapshot, root: nn.Module, pl_module: nn.Module, name: str) -> nn.Module:
    """A frozen copy of ``root``'s structure (on the host) loaded with the checkpointed weights of ``snapshot``.

    Raises:
        RuntimeError: the weights do not fit the structure, or hold tensors it lacks.

    Example:
        >>> live = nn.Linear(2, 2)
        >>> saved = Snapshot(task=0, pending={k: torch.ones_like(v) for k, v in live.state_dict().items()})
        >>> rebuilt = rebuild(saved, live, live, "continual_kl")
        >>> rebuilt.weight.sum().item(), rebuilt.weight.requires_grad, live.weight.sum().item() == 4.0
        (4.0, False, False)
    """
    assert snapshot.pending is not None
    frozen = frozen_copy(root, pl_module)
    frozen.to("cpu")
    where = f"ContinualAttentionRegularizer {name!r}: the snapshot of task {snapshot.task} in the checkpoint"
    try:
        result = frozen.load_state_dict(snapshot.pending, strict=False)
    except RuntimeError as err:
        raise RuntimeError(f"{where} does not fit {type(root).__name__} ({err}).") from err
    if result.unexpected_keys:
        raise RuntimeError(
            f"{where} has weights {result.unexpected_keys[:5]} that {type(root).__name__} lacks; resume with the model "
            "the checkpoint was written with."
        )
    if result.missing_keys:
        rank_zero_warn(f"{where} has no weights for {result.missing_keys[:5]} (added after it was taken); they keep "
                       "the current values.")
    return frozen
