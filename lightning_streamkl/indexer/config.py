# ruff: noqa: UP045  - omegaconf < 2.4 reads typing.Optional, not `X | None`, in structured configs
r"""
Indexer configuration
^^^^^^^^^^^^^^^^^^^^^

:class:`IndexerLayer` (one main attention layer and the lightning indexer trained against it) and
:class:`IndexerConfig`, every option of :class:`~lightning_streamkl.IndexerDistillation` and
:class:`~lightning_streamkl.IndexerDistillationMixin`. The options an indexer term shares with the attention-KL
terms (``weight``, ``warmup_steps``, ``causal``, ``mask_key``, ``mask_queries``, ``validation``, ``log_on_step``,
``prog_bar``, ``backend``) are the fields of :class:`~lightning_streamkl.AttentionKLOptions`, taken with their
default and check (:func:`shared_option`), so they are declared once and fail with the same messages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import DictConfig

from ..capture import CAPTURE_KINDS
from ..config import AttentionKLOptions, LayerPair
from ..options import (
    Check,
    Choice,
    Count,
    Flag,
    LayerRef,
    Text,
    check_fields,
    field_check,
    invalid,
    option,
    plain,
    read_mapping,
)

__all__ = ["SHARED_OPTIONS", "IndexerConfig", "IndexerLayer", "load_indexer_config", "shared_option",
           "validate_indexer_config"]

#: The indexer submodule a layer's indexer is looked for under when :attr:`IndexerLayer.indexer` is not set
#: (DeepSeek-V3.2 keeps it at ``self_attn.indexer``).
DEFAULT_INDEXER_CHILD = "indexer"


def shared_option(owner: type, name: str) -> Any:
    """A new field with the default and the :class:`~lightning_streamkl.options.Check` of ``owner``'s field
    ``name``: an option that means the same in two configs is declared once, in ``owner``.

    Example:
        >>> @dataclass
        ... class Opts:
        ...     weight: float = shared_option(AttentionKLOptions, "weight")
        >>> check_fields(Opts, {"weight": -1})
        Traceback (most recent call last):
        ...
        ValueError: Expected `weight` to be a finite number >= 0, but got -1.0.
    """
    fields = {f.name: f for f in dataclasses.fields(owner)}
    if name not in fields:
        raise ValueError(f"Expected `name` to be a field of {owner.__name__} ({sorted(fields)}), but got {name!r}.")
    source = fields[name]
    if source.default_factory is not dataclasses.MISSING:
        return option(check=field_check(source), factory=source.default_factory)
    return option(source.default, field_check(source))


def _short(layer: Any) -> str:
    """A layer reference for a default name: an index, the last number in a module path, else the path."""
    if isinstance(layer, str):
        numbers = [part for part in layer.split(".") if part.isdigit()]
        return numbers[-1] if numbers else layer
    return str(layer)


@dataclass
class IndexerLayer:
    """One main attention layer and the lightning indexer trained to reproduce it.

    Args:
        attention: the main attention layer: an index into the model's attention layers in module order (negative
            from the end) or a module path (relative to the LightningModule).
        indexer: the name the indexer's inputs are recorded under: the indexer module's path (what
            :func:`~lightning_streamkl.indexer.record_indexer` called with the module records, e.g.
            ``"model.model.layers.3.self_attn.indexer"``) or the name given to ``record_indexer``. ``None``: the
            submodule ``indexer`` of the attention layer (``<attention path>.indexer``, DeepSeek's layout).
            Default: ``None``.
        weight: this layer's weight in the sum of the layers' terms, ``>= 0`` (as :attr:`LayerPair.weight`).
            Default: ``1.0``.
        name: the name in logs (``train/indexer_kl/<name>``). Default: ``"l<i>"``, ``i`` the layer index or the
            layer number in the module path.

    Example:
        >>> IndexerLayer(attention=0).label, IndexerLayer(attention="model.layers.5.self_attn").label
        ('l0', 'l5')
    """

    attention: Any = option(None, LayerRef())
    indexer: Optional[str] = option(None, Text(optional=True))
    weight: float = shared_option(LayerPair, "weight")
    name: Optional[str] = shared_option(LayerPair, "name")

    @property
    def label(self) -> str:
        """``name``, or ``"l<i>"`` from the attention layer reference."""
        return self.name if self.name is not None else f"l{_short(self.attention)}"


def _check_layer(raw: Any, where: str) -> IndexerLayer:
    raw = plain(raw)
    if isinstance(raw, IndexerLayer):
        raw = dataclasses.asdict(raw)
    elif isinstance(raw, (int, str)) and not isinstance(raw, bool):
        raw = {"attention": raw}
    elif not isinstance(raw, Mapping):
        raise invalid(where, "an IndexerLayer, a mapping of its fields, or an attention layer index or path", raw,
                      TypeError)
    if raw.get("attention") is None:
        raise ValueError(f"Missing `{where}.attention`: each layer names the main attention layer it trains an "
                         "indexer for.")
    return IndexerLayer(**check_fields(IndexerLayer, raw, prefix=f"{where}.", what="indexer config"))


class _Layers(Check):
    """A non-empty list of indexer layers with unique names (a single one is taken as a list of one)."""

    @property
    def expected(self) -> str:
        return "a non-empty list of indexer layers"

    def check(self, value: Any, where: str) -> list[IndexerLayer]:
        if isinstance(value, (IndexerLayer, Mapping, int, str)) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, (list, tuple)) or not value:
            raise self.fail(where, value, ValueError if isinstance(value, (list, tuple)) else TypeError)
        layers = [_check_layer(x, f"{where}[{i}]") for i, x in enumerate(value)]
        labels = [x.label for x in layers]
        reserved = {"total", "sparse"} & set(labels)
        if reserved:
            raise ValueError(f"Expected no layer to be named {sorted(reserved)} (logged under that name), but got "
                             f"{labels}.")
        dupes = sorted({x for x in labels if labels.count(x) > 1})
        if dupes:
            raise ValueError(f"Expected `{where}` to have unique names, but {dupes} occur more than once; set their "
                             "`name`.")
        return layers


#: The options :class:`IndexerConfig` takes from :class:`~lightning_streamkl.AttentionKLOptions`.
SHARED_OPTIONS = ("weight", "warmup_steps", "causal", "mask_key", "mask_queries", "validation", "log_on_step",
                  "prog_bar", "backend")


@dataclass
class IndexerConfig:
    """Every option of an indexer-training term (an omegaconf structured config).

    The options it shares with :class:`~lightning_streamkl.AttentionKLOptions`, declared there: ``weight``
    (multiplies the term), ``warmup_steps`` (ramps ``weight`` from 0), ``causal`` (``None``: from the captured
    layer), ``mask_key`` (the batch's padding mask), ``mask_queries`` (padded query rows count for nothing),
    ``validation`` (compute and log the KL on validation batches), ``log_on_step``, ``prog_bar`` and ``backend``
    (passed to :func:`streamkl.indexer_kl`); and:

    Args:
        layers: the layers whose attention an indexer learns (:class:`IndexerLayer`, mappings of its fields, or
            attention layer references); at least one, names unique.
        topk: ``K``, the keys each query keeps in the sparse stage, picked by the indexer's own scores among the
            keys the row may see. Default: ``2048`` (DeepSeek-V3.2's).
        sparse_from_step: the optimizer step from which the sparse stage runs: before it, the dense warm-up (every
            allowed key); from it on, the KL over the indexer's top-``topk`` keys. ``None``: the dense stage
            throughout. Default: ``None``.
        capture: how the main attention's queries and keys are captured: ``"auto"``, ``"hf"``, ``"mha"`` or
            ``"recorder"`` (see :func:`lightning_streamkl.capture.build_capture`). Default: ``"auto"``.
        check_detached: at the first training step, follow the autograd graph of the indexer's inputs and raise
            if it reaches a parameter of the model outside the indexer modules (the indexer must learn from this
            loss alone, and the loss must not train the main model: detach the hidden states the indexer reads,
            as :class:`~lightning_streamkl.LightningIndexer` does). Indexers recorded under a name that is not a
            module path are not checked. Default: ``True``.
        name: the log namespace (``<stage>/<name>/<layer>``, ``<stage>/<name>/total``) and part of the checkpoint
            state key. Default: ``"indexer_kl"``.

    Example:
        >>> cfg = IndexerConfig(layers=[IndexerLayer(attention=0)], topk=64, sparse_from_step=100)
        >>> validate_indexer_config(cfg) == cfg, cfg.mask_key, cfg.name
        (True, 'attention_mask', 'indexer_kl')
    """

    layers: list[IndexerLayer] = option(check=_Layers(), factory=list)
    topk: int = option(2048, Count(low=1))
    sparse_from_step: Optional[int] = option(None, Count(low=0, optional=True))
    capture: str = option("auto", Choice(CAPTURE_KINDS))
    check_detached: bool = option(True, Flag())
    name: str = option("indexer_kl", Text())
    weight: float = shared_option(AttentionKLOptions, "weight")
    warmup_steps: int = shared_option(AttentionKLOptions, "warmup_steps")
    causal: Optional[bool] = shared_option(AttentionKLOptions, "causal")
    mask_key: Optional[str] = shared_option(AttentionKLOptions, "mask_key")
    mask_queries: bool = shared_option(AttentionKLOptions, "mask_queries")
    validation: bool = shared_option(AttentionKLOptions, "validation")
    log_on_step: bool = shared_option(AttentionKLOptions, "log_on_step")
    prog_bar: bool = shared_option(AttentionKLOptions, "prog_bar")
    backend: str = shared_option(AttentionKLOptions, "backend")


def validate_indexer_config(config: IndexerConfig | Mapping[str, Any] | DictConfig | str) -> IndexerConfig:
    """Check every option and return a normalised :class:`IndexerConfig` (layers as :class:`IndexerLayer`).

    ``config`` may also be YAML text or the path of a YAML file.

    Raises:
        ValueError: an unknown key (with the closest valid one), a value out of range, no layers, or two layers
            with the same name.
        TypeError: a value of the wrong type.

    Example:
        >>> cfg = validate_indexer_config({"layers": [0, {"attention": -1, "name": "last"}], "topk": 16})
        >>> [(x.attention, x.label) for x in cfg.layers], cfg.topk
        ([(0, 'l0'), (-1, 'last')], 16)
        >>> validate_indexer_config({"layers": [0], "topk": 0})
        Traceback (most recent call last):
        ...
        ValueError: Expected `topk` to be an int >= 1, but got 0.
    """
    raw = read_mapping(config, IndexerConfig)
    values = check_fields(IndexerConfig, raw, what="indexer config")
    if not values["layers"]:
        raise ValueError("Missing `layers`: name at least one main attention layer to train an indexer for.")
    return IndexerConfig(**values)


def load_indexer_config(source: str | Any | Mapping[str, Any] | DictConfig, *, key: str | None = None,
                        ) -> IndexerConfig:
    """Load an :class:`IndexerConfig` from a YAML file, YAML text, a mapping or a ``DictConfig``; ``key`` selects a
    dotted section of a larger config.

    Example:
        >>> cfg = load_indexer_config("indexer:\\n  layers: [0, 1]\\n  sparse_from_step: 200", key="indexer")
        >>> [x.label for x in cfg.layers], cfg.sparse_from_step
        (['l0', 'l1'], 200)
        >>> from omegaconf import OmegaConf
        >>> load_indexer_config(OmegaConf.to_yaml(OmegaConf.structured(cfg))) == cfg
        True
    """
    return validate_indexer_config(read_mapping(source, IndexerConfig, key=key))
