r"""
Step wrapper
^^^^^^^^^^^^

Wrapping a LightningModule's ``training_step``/``validation_step`` so callbacks can add to the loss.

Lightning's callback hooks cannot change the loss. Instead, an instance attribute shadows the module's step
method for the duration of a run: it runs each registered runner's teacher pass, calls the original step with
the runners' student captures recording, then lets each runner add its term to the returned loss. The loss
therefore leaves ``training_step`` already complete, before Lightning's closure divides it for gradient
accumulation, scales it for fp16 and runs the one backward (under DDP as well, since the strategy calls
``training_step`` through the module). Several runners share one wrapper; the last to leave restores the method.
"""

from __future__ import annotations

import contextlib  # noqa: F401 - used by the doctest
import functools
from contextlib import ExitStack
from typing import Any, Protocol

from torch import nn

_REGISTRY_ATTR = "_streamkl_step_wrappers"


__all__ = ["StepRunner", "copy_memo", "install", "runners", "strip_wrappers", "uninstall"]


class StepRunner(Protocol):
    """What takes part in a wrapped step: begin (``False``: sit this step out), the student's recording around the
    original step, end (may change the returned value), cleanup (always). See :func:`install` for an example."""

    def _step_begin(self, stage: str, batch: Any) -> bool: ...
    def _student_recording(self) -> Any: ...
    def _step_end(self, stage: str, batch: Any, output: Any) -> Any: ...
    def _step_cleanup(self) -> None: ...


class _Wrapper:
    def __init__(self, module: nn.Module, method: str, stage: str) -> None:
        self.method = method
        self.stage = stage
        self.had_instance_attr = method in module.__dict__
        self.saved = module.__dict__.get(method)
        self.original = getattr(module, method)
        self.runners: list[StepRunner] = []

        @functools.wraps(self.original)
        def step(*args: Any, **kwargs: Any) -> Any:
            return self(args, kwargs)

        self.step = step

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        batch = args[0] if args else kwargs.get("batch")
        active: list[StepRunner] = []
        try:
            for runner in list(self.runners):
                if runner._step_begin(self.stage, batch):
                    active.append(runner)
            with ExitStack() as stack:
                for runner in active:
                    stack.enter_context(runner._student_recording())
                output = self.original(*args, **kwargs)
            for runner in active:
                output = runner._step_end(self.stage, batch, output)
            return output
        finally:
            for runner in active:
                runner._step_cleanup()


def install(module: nn.Module, method: str, stage: str, runner: StepRunner) -> None:
    """Make ``runner`` take part in ``module.<method>`` (wrapping it on first use).

    Example:
        >>> module = nn.Module()
        >>> module.training_step = lambda batch: batch
        >>> class Double:
        ...     def _step_begin(self, stage, batch): return True
        ...     def _student_recording(self): return contextlib.nullcontext()
        ...     def _step_end(self, stage, batch, output): return 2 * output
        ...     def _step_cleanup(self): pass
        >>> runner = Double()
        >>> install(module, "training_step", "train", runner)
        >>> module.training_step(3), runners(module, "training_step") == [runner]
        (6, True)
        >>> uninstall(module, "training_step", runner)
        >>> module.training_step(3)
        3
    """
    registry: dict[str, _Wrapper] = module.__dict__.setdefault(_REGISTRY_ATTR, {})
    wrapper = registry.get(method)
    if wrapper is None:
        wrapper = registry[method] = _Wrapper(module, method, stage)
        object.__setattr__(module, method, wrapper.step)
    if runner not in wrapper.runners:
        wrapper.runners.append(runner)


def uninstall(module: nn.Module, method: str, runner: StepRunner) -> None:
    """Remove ``runner``; restore the original method when no runner is left (see :func:`install`).

    Example:
        >>> uninstall(nn.Module(), "training_step", object())  # nothing installed: nothing to do
    """
    registry: dict[str, _Wrapper] = module.__dict__.get(_REGISTRY_ATTR, {})
    wrapper = registry.get(method)
    if wrapper is None:
        return
    if runner in wrapper.runners:
        wrapper.runners.remove(runner)
    if wrapper.runners:
        return
    del registry[method]
    if module.__dict__.get(method) is wrapper.step:
        if wrapper.had_instance_attr:
            object.__setattr__(module, method, wrapper.saved)
        else:
            del module.__dict__[method]
    if not registry:
        module.__dict__.pop(_REGISTRY_ATTR, None)


def runners(module: nn.Module, method: str) -> list[StepRunner]:
    """The runners currently taking part in ``module.<method>`` (see :func:`install`).

    Example:
        >>> runners(nn.Module(), "training_step")
        []
    """
    wrapper = module.__dict__.get(_REGISTRY_ATTR, {}).get(method)
    return list(wrapper.runners) if wrapper is not None else []


def copy_memo(module: nn.Module) -> dict[int, Any]:
    """A ``copy.deepcopy`` memo that leaves the step wrappers of ``module`` (and what they reference: callbacks,
    trainer) out of a copy; follow the copy with :func:`strip_wrappers`.

    Example:
        >>> import copy
        >>> module = nn.Linear(2, 2)
        >>> frozen = strip_wrappers(copy.deepcopy(module, copy_memo(module)))
        >>> type(frozen).__name__
        'Linear'
    """
    registry = module.__dict__.get(_REGISTRY_ATTR)
    return {} if registry is None else {id(registry): {}}


def strip_wrappers(copied: nn.Module) -> nn.Module:
    """Remove the step-wrapper attributes a copy made with :func:`copy_memo` carries (returns ``copied``).

    Example:
        >>> strip_wrappers(nn.Linear(1, 1)).__dict__.get("training_step") is None
        True
    """
    registry = copied.__dict__.pop(_REGISTRY_ATTR, None)
    if registry is not None:
        for method in ("training_step", "validation_step"):
            copied.__dict__.pop(method, None)
    return copied
