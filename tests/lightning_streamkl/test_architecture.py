"""The package's import graph points one way: transfer/options/config/capture → loss/metrics/teacher → engine → adapter base
→ adapters (callback, mixin, continual) → the package and its LightningCLI (cli) → the demo job. No cycles; the
engine and everything below it work without Lightning; an adapter never imports another adapter or a private name;
the library never imports the job, and the job uses the library's public names only. Read from the source (every
import statement, including those inside functions), so a violation fails here before it surprises a user."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from .._import_graph import import_cycle, import_graph, internal_edges, layer_unit

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_streamkl"

#: Module (or subpackage) -> layer; a module may import only from its own layer or below.
LAYERS = {
    "transfer": 0, "options": 0, "capture": 0, "config": 1,
    "terms": 2, "loss": 2, "metrics": 2, "teacher": 2,
    "engine": 3,
    "step_wrapper": 4, "adapter": 5,
    "callback": 6, "mixin": 6, "continual": 6, "indexer": 6, "integrations": 6,
    "__init__": 7, "cli": 7,
    "jobs": 8,
}
ADAPTERS = {"callback", "mixin", "continual", "indexer", "integrations"}
LIGHTNING_FREE = {"transfer", "options", "capture", "config", "terms", "loss", "metrics", "teacher", "engine", "integrations"}


MODULES, GRAPH = import_graph(PACKAGE, runtime_only=False)


def test_every_module_has_a_layer():
    assert {layer_unit(m) for m in MODULES} <= set(LAYERS), sorted({layer_unit(m) for m in MODULES} - set(LAYERS))


def test_no_import_cycles():
    cycle = import_cycle(internal_edges(MODULES, GRAPH))
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down_the_layers(module):
    unit = layer_unit(module)
    for target, names in GRAPH[module]:
        if not target.startswith("lightning_streamkl"):
            continue
        other = layer_unit(target) if target != "lightning_streamkl" else "__init__"
        if other == unit:
            continue
        assert LAYERS[other] <= LAYERS[unit], f"{module} imports {target}: a higher layer ({other} > {unit})"
        assert not (unit in ADAPTERS and other in ADAPTERS), f"adapter {module} imports adapter {target}"
        private = [n for n in names if n.startswith("_")]
        assert not private, f"{module} imports private names {private} from {target}"
        if unit == "jobs":
            assert target == "lightning_streamkl" or not target.split(".")[-1].startswith("_"), (module, target)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer_unit(m) in LIGHTNING_FREE))
def test_the_engine_and_below_do_not_import_lightning(module):
    lightning = [t for t, _ in GRAPH[module] if t.split(".")[0] in ("lightning", "pytorch_lightning")]
    assert not lightning, f"{module} imports {lightning}: the engine and everything below it are Lightning-free"


def test_the_library_never_imports_the_job():
    for module, imports in GRAPH.items():
        if layer_unit(module) != "jobs":
            assert not [t for t, _ in imports if t.startswith("lightning_streamkl.jobs")], module


def test_the_library_never_imports_the_integrations():
    """``lightning_streamkl.integrations.*`` (TRL, ...) are imported by their users only: ``import lightning_streamkl``
    must not pull in another training library."""
    for module, imports in GRAPH.items():
        if layer_unit(module) != "integrations":
            assert not [t for t, _ in imports if t.startswith("lightning_streamkl.integrations")], module


def test_no_module_holds_a_huge_class():
    """The continual regulariser was one 600-line class in an 893-line module."""
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno - node.lineno < 450, f"{module}.{node.name}: {node.end_lineno - node.lineno} lines"
