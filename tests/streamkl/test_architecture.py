"""The op package's import graph points one way: the public API → autograd → the dispatch table → the kernels, over
a foundation of the problem, its checks and options. The oracles (``naive``, ``indexer_naive``, ``reference``) reach no
kernel; the portable kernels (``_triton``) and the Hopper ones (``_hopper``) never import each other, only what they
share (``_triton_common``). Read from the source (every import statement, including those inside functions; imports
under ``if TYPE_CHECKING:`` are annotations, not imports), so a violation fails here before it surprises a reader.
The rules are data (:data:`LAYERS`, :data:`ORACLES`, :data:`KERNELS`, :data:`APART`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .._import_graph import import_cycle, import_graph, internal_edges, layer_unit

PACKAGE = Path(__file__).resolve().parents[2] / "kernels" / "streamkl"

#: Module (or subpackage) -> layer; a module imports only from its own layer or below.
LAYERS = {
    # the foundation: constants, the canonical problem, its checks, the options and the precision rules
    "_constants": 0, "_problem": 0, "_reduction": 0, "_traced_precision": 0,
    "_validation": 1, "precision": 1, "_indexer_problem": 2, "options": 2,
    # a right-padded batch or packed sequences as dense problems, one per batch row or sequence
    "_pieces": 2,
    # the kernels (and what the Triton and Gluon kernels share), the chunked PyTorch backends and the oracles
    "_triton_common": 3,
    "_triton": 4, "_hopper": 4, "reference": 4, "indexer_reference": 4, "naive": 4, "indexer_naive": 4,
    # which kernel runs
    "dispatch": 5,
    # autograd over the dispatch
    "autograd": 6, "indexer_autograd": 6,
    # the public op, and what is built on it
    "api": 7, "indexer": 7, "sharded": 7,
    "nn": 8,
    "__init__": 9,
}
#: The oracles: the definition of "correct" may not depend on any kernel, directly or through another module.
ORACLES = ("naive", "indexer_naive", "reference", "indexer_reference")
#: The kernel packages (reachable from the API only through the dispatch table).
KERNELS = ("_triton", "_hopper", "_triton_common")
#: Units that never import each other (what they share lives in ``_triton_common``).
APART = (("_triton", "_hopper"),)


MODULES, GRAPH = import_graph(PACKAGE, runtime_only=True)


EDGES = internal_edges(MODULES, GRAPH)


def test_every_module_has_a_layer():
    assert {layer_unit(m) for m in MODULES} <= set(LAYERS), sorted({layer_unit(m) for m in MODULES} - set(LAYERS))


def test_no_import_cycles():
    cycle = import_cycle(EDGES)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down_the_layers(module):
    """api → autograd → dispatch → kernels, over the foundation; never the other way."""
    unit = layer_unit(module)
    for target, _ in GRAPH[module]:
        if not target.startswith("streamkl"):
            continue
        other = layer_unit(target)
        if other == unit:
            continue
        assert LAYERS[other] <= LAYERS[unit], f"{module} imports {target}: a higher layer ({other} > {unit})"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_only_the_dispatch_reaches_the_kernels(module):
    """Outside the kernel packages, no module imports a kernel: the dispatch table imports them by name when a call
    needs them (so importing the API imports no Triton)."""
    if layer_unit(module) in (*KERNELS, "dispatch"):
        return
    kernels = [t for t, _ in GRAPH[module] if t.startswith("streamkl.") and layer_unit(t) in ("_triton", "_hopper")]
    assert not kernels, f"{module} imports the kernels {kernels}"


@pytest.mark.parametrize("oracle", ORACLES)
def test_the_oracles_reach_no_kernel(oracle):
    """Everything an oracle imports, directly or through other modules, is below the kernels: the definition of
    "correct" does not run through the code it checks."""
    seen, todo = set(), [f"streamkl.{oracle}"]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo += sorted(EDGES[module])
    reached = sorted(m for m in seen if layer_unit(m) in (*KERNELS, "dispatch", "autograd", "indexer_autograd", "api"))
    assert not reached, f"streamkl.{oracle} reaches {reached}"


@pytest.mark.parametrize(("first", "second"), APART)
def test_the_portable_and_hopper_kernels_import_nothing_of_each_other(first, second):
    for module in MODULES:
        unit = layer_unit(module)
        if unit in (first, second):
            other = second if unit == first else first
            crossing = [t for t, _ in GRAPH[module] if t.startswith("streamkl.") and layer_unit(t) == other]
            assert not crossing, f"{module} imports {crossing}: share it through _triton_common instead"
