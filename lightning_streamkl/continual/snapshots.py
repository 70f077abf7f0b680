r"""
Snapshots
^^^^^^^^^

What a task boundary keeps: a frozen copy of the model (:func:`frozen_copy`), or, after a resume, the
checkpointed weights until :func:`rebuild` loads them into a copy of the live module's structure. A snapshot's
forward pass stops at its deepest regularised layer; :class:`FirstPass` finds what its first pass ran and read, and
:func:`drop` empties the tensors of the others (an output head, the layers past the deepest regularised one), so a
snapshot holds only what it computes with (:func:`tensor_bytes` measures it).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..engine import AttentionDistiller
from ..step_wrapper import copy_memo, strip_wrappers

__all__ = ["FirstPass", "Snapshot", "Trimmer", "drop", "frozen_copy", "rebuild", "tensor_bytes"]


@dataclass
class Snapshot:
    """One kept snapshot.

    Attributes:
        task: the task whose end produced it.
        module: the frozen copy; ``None`` until a checkpointed one is rebuilt.
        pending: checkpointed weights waiting for a module structure.
        distiller: the engine that runs it as a teacher (built at its first step).
        trimmed: the names (``state_dict`` keys) of the tensors dropped from it because its forward pass never
            reaches them; ``None`` until its first pass has been watched (or when trimming is off).
        trimmed_bytes: the bytes those tensors held.

    Example:
        >>> Snapshot(task=2, pending={"weight": torch.zeros(1)}).state()
        {'task': 2, 'state_dict': {'weight': tensor([0.])}}
    """

    task: int
    module: nn.Module | None = None
    pending: dict[str, torch.Tensor] | None = None
    distiller: AttentionDistiller | None = None
    trimmed: list[str] | None = None
    trimmed_bytes: int = 0

    def state(self) -> dict[str, Any]:
        """``{"task", "state_dict"}`` for a checkpoint (host tensors), and ``"trimmed"`` (the dropped names) when
        tensors were dropped; those are not saved.

        Example:
            >>> Snapshot(task=0, module=nn.Linear(1, 1)).state()["state_dict"].keys()
            dict_keys(['weight', 'bias'])
            >>> state = Snapshot(task=0, module=nn.Linear(1, 1), trimmed=["bias"]).state()
            >>> state["state_dict"].keys(), state["trimmed"]
            (dict_keys(['weight']), ['bias'])
        """
        weights = self.pending if self.module is None else self.module.state_dict()
        dropped = set(self.trimmed or ())
        kept = {k: v.detach().cpu() for k, v in (weights or {}).items() if k not in dropped}
        state: dict[str, Any] = {"task": self.task, "state_dict": kept}
        if dropped:
            state["trimmed"] = sorted(dropped)
        return state

    def memory(self) -> dict[str, Any]:
        """What the snapshot holds: ``{"task", "bytes": {device: bytes}, "trimmed_tensors", "trimmed_bytes"}``
        (checkpointed weights not yet rebuilt count where they are, on the host).

        Example:
            >>> Snapshot(task=1, module=nn.Linear(2, 2)).memory()
            {'task': 1, 'bytes': {'cpu': 24}, 'trimmed_tensors': 0, 'trimmed_bytes': 0}
        """
        if self.module is not None:
            held = tensor_bytes(self.module.parameters(), self.module.buffers())
        else:
            held = tensor_bytes((self.pending or {}).values())
        return {"task": self.task, "bytes": held, "trimmed_tensors": len(self.trimmed or ()),
                "trimmed_bytes": self.trimmed_bytes}

    def release(self) -> None:
        """Drop the engine (and what it captured); it is rebuilt at the next step."""
        if self.distiller is not None:
            self.distiller.clear()
            self.distiller = None


def tensor_bytes(*groups: Iterable[torch.Tensor]) -> dict[str, int]:
    """The bytes of the storages behind ``groups`` of tensors, per device; a storage shared by several tensors
    (tied weights, views) counts once.

    Example:
        >>> w = torch.zeros(4, 4)
        >>> tensor_bytes([w, w[0], torch.zeros(2, dtype=torch.float64)])
        {'cpu': 80}
    """
    seen: set[tuple[str, int]] = set()
    out: dict[str, int] = {}
    for t in itertools.chain(*groups):
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        out[str(t.device)] = out.get(str(t.device), 0) + storage.nbytes()
    return out


class _Uses(TorchFunctionMode):
    """Records the storage of every tensor passed to a torch function while it is active."""

    def __init__(self, used: set[tuple[str, int]]) -> None:
        super().__init__()
        self.used = used

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                self.used.add(_storage_key(t))
        return func(*args, **kwargs)


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


class FirstPass:
    """Watch the forward passes of ``module`` while :meth:`watching` is open: which of its submodules were entered,
    and which tensors any torch function read (by storage, so views and slices count).

    A tensor of ``module`` that no torch function read and that only modules never entered own was not needed:
    :meth:`unused` names them. Reading the functions' arguments, not only the module calls, keeps a weight that a
    module passes to a function without calling its owner (``nn.MultiheadAttention``'s ``out_proj``).

    Example:
        A pass stopped after the first layer (as a snapshot's pass stops after its deepest regularised layer):

        >>> from lightning_streamkl.teacher import stop_after
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        >>> first = FirstPass(model)
        >>> with first.watching(), stop_after([model[0]], lambda: True):
        ...     model(torch.ones(1, 2))
        >>> first.unused()
        ['1.weight', '1.bias']
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.ran: set[int] = set()
        self.used: set[tuple[str, int]] = set()

    @contextmanager
    def watching(self) -> Iterator[FirstPass]:
        """Record inside the block; a forward pass cut short by an exception (the early exit) is recorded up to
        there."""
        modes: list[_Uses] = []

        def enter(mod: nn.Module, args: Any) -> None:
            self.ran.add(id(mod))
            if mod is self.module:
                modes.append(_Uses(self.used))
                modes[-1].__enter__()

        def leave(mod: nn.Module, args: Any, output: Any) -> None:
            if modes:
                modes.pop().__exit__(None, None, None)

        handles = [m.register_forward_pre_hook(enter) for m in self.module.modules()]
        handles.append(self.module.register_forward_hook(leave, always_call=True))
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
            while modes:
                modes.pop().__exit__(None, None, None)

    def unused(self) -> list[str]:
        """The names (as in ``module.state_dict()``, non-persistent buffers included) of the tensors the watched
        passes did not need; nothing when ``module`` itself never ran."""
        if id(self.module) not in self.ran:
            return []
        owners: dict[int, list[nn.Module]] = {}
        for m in self.module.modules():
            for _, t in _own_tensors(m):
                owners.setdefault(id(t), []).append(m)
        return [f"{path}.{name}" if path else name
                for path, m in self.module.named_modules(remove_duplicate=False)
                for name, t in _own_tensors(m)
                if t.numel() > 0 and _storage_key(t) not in self.used
                and not any(id(o) in self.ran for o in owners[id(t)])]


class Trimmer:
    """Trims snapshots after their first forward pass, when ``enabled`` (``snapshot_trim``): :meth:`watch` before
    it (a no-op for a snapshot trimmed already, or being watched), :meth:`trim` after it (drops what the pass did not
    need and says so, naming the regulariser ``name``), :meth:`close` to stop every watch (after a failed step the
    next one watches again).

    Example:
        >>> from lightning_streamkl.teacher import stop_after
        >>> snap = Snapshot(task=0, module=nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 3)))
        >>> trimmer = Trimmer()
        >>> trimmer.watch(snap)
        >>> with stop_after([snap.module[0]], lambda: True):
        ...     snap.module(torch.ones(1, 2))
        >>> trimmer.trim([snap])
        >>> snap.trimmed, snap.memory()["bytes"]
        (['1.weight', '1.bias'], {'cpu': 24})
    """

    def __init__(self, enabled: bool = True, name: str = "continual_kl") -> None:
        self.enabled, self.name = enabled, name
        self._open: dict[int, tuple[ExitStack, FirstPass]] = {}

    def watch(self, snap: Snapshot) -> None:
        if not self.enabled or snap.trimmed is not None or snap.module is None or id(snap) in self._open:
            return
        stack = ExitStack()
        self._open[id(snap)] = (stack, stack.enter_context(FirstPass(snap.module).watching()))

    def trim(self, snapshots: Iterable[Snapshot]) -> None:
        for snap in snapshots:
            watch = self._open.pop(id(snap), None)
            if watch is None or snap.module is None:
                continue
            stack, first = watch
            stack.close()
            names = first.unused()
            snap.trimmed_bytes = drop(snap.module, names, why=TRIMMED) if names else 0
            snap.trimmed = names
            if names:
                rank_zero_info(f"ContinualAttentionRegularizer {self.name!r}: the snapshot of task {snap.task} "
                               f"stops at its deepest regularised layer; {len(names)} tensors past it "
                               f"({snap.trimmed_bytes} bytes) were dropped.")

    def close(self) -> None:
        for stack, _ in self._open.values():
            stack.close()
        self._open.clear()


def _own_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(recurse=False)
    yield from ((name, b) for name, b in module.named_buffers(recurse=False) if b is not None)


def drop(module: nn.Module, names: Iterable[str], *, why: str = "") -> int:
    """Replace the tensors ``names`` of ``module`` by empty ones (same dtype and device) and make their modules
    refuse to run (a forward pre-hook that raises, saying ``why``); returns the bytes released.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 3))
        >>> drop(model, ["1.weight", "1.bias"], why="unused")
        36
        >>> model[1].weight.shape, model[0](torch.ones(1, 2)).shape
        (torch.Size([0]), torch.Size([1, 2]))
        >>> model(torch.ones(1, 2))
        Traceback (most recent call last):
        ...
        RuntimeError: Snapshot module '1' (Linear) was trimmed (unused); set snapshot_trim=False to keep it.
    """
    names = list(names)
    released = tensor_bytes(t for name in names for t in [_tensor(module, name)] if t is not None)
    owners: dict[int, tuple[str, nn.Module]] = {}
    for name in names:
        path, _, attr = name.rpartition(".")
        owner = module.get_submodule(path)
        tensor = getattr(owner, attr, None)
        if isinstance(tensor, torch.Tensor) and tensor.numel() > 0:
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        owners.setdefault(id(owner), (path, owner))

    for path, owner in owners.values():
        def refuse(mod: nn.Module, args: Any, path: str = path) -> None:
            raise RuntimeError(
                f"Snapshot module {path!r} ({type(mod).__name__}) was trimmed ({why or 'it did not run'}); set "
                "snapshot_trim=False to keep it."
            )

        owner.register_forward_pre_hook(refuse)
    return sum(released.values())


def _tensor(module: nn.Module, name: str) -> torch.Tensor | None:
    path, _, attr = name.rpartition(".")
    try:
        value = getattr(module.get_submodule(path), attr, None)
    except AttributeError:
        return None
    return value if isinstance(value, torch.Tensor) else None


TRIMMED = "it did not run before the deepest regularised layer in the snapshot's first forward pass"


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
    trimmed = set(snapshot.trimmed or ())
    missing = [k for k in result.missing_keys if k not in trimmed]
    if missing:
        rank_zero_warn(f"{where} has no weights for {missing[:5]} (added after it was taken); they keep the current "
                       "values.")
    if trimmed:
        drop(frozen, [k for k in snapshot.trimmed or () if _tensor(frozen, k) is not None], why=TRIMMED)
    return frozen
