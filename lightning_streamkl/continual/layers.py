r"""
Regularised layers
^^^^^^^^^^^^^^^^^^

Which attention layers of a LightningModule the continual regulariser compares with its snapshot, and which
submodule it copies as the snapshot: :func:`resolve_layers` turns a :class:`ContinualConfig` and a module into a
:class:`LayerSelection`.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.model_helpers import is_overridden

from ..capture import AttentionCapture, build_capture, closest
from ..config import LayerPair
from .config import ContinualConfig

__all__ = ["LayerSelection", "resolve_layers"]


@dataclass
class LayerSelection:
    """The regularised layers of one module.

    Attributes:
        root: the path of the snapshotted submodule (``""``: the whole LightningModule).
        pairs: one :class:`~lightning_streamkl.LayerPair` per layer (snapshot path relative to ``root``, model
            path, weight ``1 / L`` or the normalised ``layer_weights``, name ``layer<i>`` or the path).
        probe: a capture of the module that records only the selected layers (checks the first step).

    Example:
        >>> from lightning_streamkl.capture import RecorderCapture
        >>> from torch import nn
        >>> LayerSelection("encoder", [], RecorderCapture(nn.Identity())).root
        'encoder'
    """

    root: str
    pairs: list[LayerPair]
    probe: AttentionCapture


def resolve_layers(pl_module: LightningModule, config: ContinualConfig) -> LayerSelection:
    """Find the attention layers, the snapshot root and the layer pairs for ``pl_module``.

    Raises:
        ValueError: no attention layer the capture adapters can find, an unknown layer or submodule (with the
            closest names), layers outside the snapshotted submodule, or ``layer_weights`` of the wrong length.

    Example:
        >>> import lightning as L
        >>> from torch import nn
        >>> class Model(L.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
        ...         self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        >>> selection = resolve_layers(Model(), ContinualConfig(layers=[-1]))
        >>> selection.root, [(p.teacher, p.student, p.label) for p in selection.pairs]
        ('encoder', [('layers.1.self_attn', 'encoder.layers.1.self_attn', 'layer1')])
        >>> weighted = resolve_layers(Model(), ContinualConfig(layer_weights=[1.0, 3.0]))
        >>> [(p.label, p.weight) for p in weighted.pairs]
        [('layer0', 0.25), ('layer1', 0.75)]
    """
    probe = build_capture(pl_module, config.capture)
    model = type(pl_module).__name__
    if probe.kind == "recorder" and config.layers is None:
        raise ValueError(
            f"ContinualAttentionRegularizer found no attention layer it can capture in {model}: no Hugging Face "
            "attention-interface layer and no nn.MultiheadAttention. For a custom attention, call "
            "lightning_streamkl.capture.record(self, q, k, ...) in its forward and name those modules with "
            "`layers=[...]`."
        )
    names = [] if probe.kind == "recorder" else probe.layer_names()
    if probe.kind != "recorder" and not names:
        raise ValueError(f"ContinualAttentionRegularizer: the {probe.kind!r} capture found no attention layer in "
                         f"{model}.")
    selected = _weighted(_select(probe, names, pl_module, config), config.layer_weights, model)
    root = _find_root(pl_module, [path for _, path, _ in selected], config.module)
    prefix = f"{root}." if root else ""
    pairs = []
    for index, path, weight in selected:
        if not path.startswith(prefix):
            raise ValueError(
                f"ContinualAttentionRegularizer: the layer {path!r} is outside the snapshotted submodule {root!r}; set "
                "`module` to a submodule that contains every selected layer."
            )
        label = f"layer{index}" if index is not None else path
        pairs.append(LayerPair(teacher=path[len(prefix):], student=path, weight=weight, name=label))
    probe.select({path for _, path, _ in selected})
    return LayerSelection(root, pairs, probe)


def _weighted(selected: list[tuple[int | None, str]], weights: list[float] | None, model: str,
              ) -> list[tuple[int | None, str, float]]:
    """``(index, path, weight)`` of the layers to regularise: ``weights`` normalised to sum to 1, layers of
    weight 0 left out; equal weights when ``weights`` is ``None``."""
    if weights is None:
        return [(index, path, 1.0 / len(selected)) for index, path in selected]
    if len(weights) != len(selected):
        raise ValueError(
            f"Expected `layer_weights` to have one weight per regularised layer, but {model} has {len(selected)} "
            f"({[path for _, path in selected]}) and got {len(weights)}."
        )
    total = sum(weights)
    return [(index, path, w / total) for (index, path), w in zip(selected, weights) if w > 0]


def _select(probe: AttentionCapture, names: list[str], pl_module: LightningModule, config: ContinualConfig,
            ) -> list[tuple[int | None, str]]:
    if config.layers is None:
        return list(enumerate(names))
    model = type(pl_module).__name__
    paths = {n for n, _ in pl_module.named_modules()}
    module = config.module
    selected: list[tuple[int | None, str]] = []
    for i, layer in enumerate(config.layers):
        role = f"layer layers[{i}]"
        if not names:  # recorder: module paths only, whatever calls record()
            if isinstance(layer, int):
                raise ValueError(
                    f"ContinualAttentionRegularizer: {role} is the index {layer}, but the attention of {model} is "
                    "captured through record() calls, which have no order before a forward pass; name the layer by "
                    "its module path."
                )
            if module and not layer.startswith(f"{module}.") and f"{module}.{layer}" in paths:
                layer = f"{module}.{layer}"
            selected.append((None, layer))
            continue
        if isinstance(layer, str) and layer not in names and module and f"{module}.{layer}" in names:
            layer = f"{module}.{layer}"
        path = probe.resolve(layer, role=role)
        selected.append((names.index(path), path))
    if len({p for _, p in selected}) != len(selected):
        raise ValueError(f"Expected `layers` to select each layer once, but {config.layers} repeat one.")
    return selected


def _find_root(pl_module: LightningModule, paths: list[str], module: str | None) -> str:
    if module is not None:
        if module:
            children = [n for n, _ in pl_module.named_modules() if n]
            try:
                pl_module.get_submodule(module)
            except AttributeError:
                near = closest(module, children)
                hint = f" Closest: {near}." if near else ""
                raise ValueError(
                    f"Expected `module` to name a submodule of {type(pl_module).__name__}, but it has no {module!r}."
                    f"{hint}"
                ) from None
        elif not is_overridden("forward", pl_module, LightningModule):
            raise ValueError(
                f"`module=''` snapshots the whole {type(pl_module).__name__}, which defines no forward() to run the "
                "snapshot with; set `module` to the network submodule (e.g. 'model') or define forward()."
            )
        return module
    firsts = {p.split(".", 1)[0] for p in paths}
    if len(firsts) == 1 and all("." in p for p in paths):
        return firsts.pop()
    if is_overridden("forward", pl_module, LightningModule):
        return ""
    raise ValueError(
        f"ContinualAttentionRegularizer: the attention layers of {type(pl_module).__name__} lie in several "
        f"submodules ({sorted(firsts)}) and it defines no forward(); set `module` to the submodule to copy and "
        "run as the snapshot, or define forward() and set module=''."
    )
