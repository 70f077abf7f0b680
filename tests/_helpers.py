"""Test helpers: relative-error comparison with a readable mismatch report; loading a script as a module."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch


def load_script(path: Path, name: str):
    """Import the script at ``path`` as module ``name`` (its folder on ``sys.path`` while it loads, as when run)."""
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(path.parent))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``‖actual − expected‖₂ / ‖expected‖₂`` in float64 (absolute norm when ``expected`` is all 0)."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if a.shape != e.shape:
        raise AssertionError(f"shape mismatch: {tuple(a.shape)} vs {tuple(e.shape)}")
    diff = torch.linalg.vector_norm(a - e).item()
    ref = torch.linalg.vector_norm(e).item()
    return diff / ref if ref > 0 else diff


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, name: str = "tensor") -> None:
    """Fail when the relative L2 error exceeds ``rtol`` or when NaN/Inf appear where the oracle has none."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if a.shape != e.shape:
        raise AssertionError(f"{name}: shape {tuple(a.shape)} != expected {tuple(e.shape)}")
    bad = ~torch.isfinite(a) & torch.isfinite(e)
    if bad.any():
        idx = bad.nonzero()[0].tolist()
        raise AssertionError(f"{name}: non-finite value {a[tuple(idx)].item()} at {idx} (expected finite)")
    err = relative_error(a, e)
    if not err <= rtol:
        flat = (a - e).abs().flatten()
        i = int(flat.argmax())
        idx = list(torch.unravel_index(torch.tensor(i), a.shape)) if a.dim() else []
        idx = [int(j) for j in idx]
        raise AssertionError(
            f"{name}: relative L2 error {err:.3e} > {rtol:.1e}; max |diff| {flat[i].item():.3e} at {idx} "
            f"(got {a.flatten()[i].item():.6g}, expected {e.flatten()[i].item():.6g})"
        )
