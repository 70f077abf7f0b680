r"""
Hugging Face transformers capture
^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^

Capture through the attention interface of transformers (5.x; 4.48+ best effort): while recording, the
model's attention implementation is switched to ``"streamkl_<original>"``, a registered attention function
that records the post-RoPE queries and the un-repeated (GQA) keys of each layer and then calls the original
implementation, so sdpa / flash / eager keep computing the model's output.

The same name is registered as a *mask* function too (the original's mask builder): transformers builds the
causal / padding mask only for names it finds in ``AttentionMaskInterface``, and a name registered only as an
attention function would get ``attention_mask=None`` and silently lose causal masking. When recording ends the
original implementation name is restored, so nothing is left behind in the model's config.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from .base import AttentionCapture

log = logging.getLogger(__name__)

#: Prefix of the attention implementation names registered by this module.
CAPTURE_PREFIX = "streamkl_"

# id(attention module) -> the HF captures that currently record it
_OWNERS: dict[int, list[HFAttentionCapture]] = {}
# id(config) -> [config, original implementation, number of captures that switched it]
_SWITCHED: dict[int, list[Any]] = {}
_REGISTERED: set[str] = set()
_USES_INTERFACE: dict[type, bool] = {}
# attention kwargs that make the layer's distribution differ from softmax(q kᵀ · scale) under causal/padding masks
_INEXACT_KWARGS = ("sliding_window", "softcap", "position_bias", "s_aux", "sinks")


def transformers_available() -> bool:
    """True when transformers can be imported (the import is attempted only when it was not loaded yet).

    Example:
        >>> transformers_available()
        True
    """
    if "transformers" in sys.modules:
        return True
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def is_hf_model(model: nn.Module) -> bool:
    """True when ``model`` is, or contains, a transformers ``PreTrainedModel`` (never imports transformers).

    Example:
        >>> from torch import nn
        >>> is_hf_model(nn.Linear(2, 2))
        False
    """
    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    return any(isinstance(m, PreTrainedModel) for m in model.modules())


def _interfaces() -> tuple[Any, Any, Any | None, Any | None]:
    try:
        from transformers import AttentionInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError as err:  # pragma: no cover - transformers < 4.48
        raise ImportError(
            "Capturing a Hugging Face model needs transformers>=4.48 (the AttentionInterface); upgrade it, or call "
            "lightning_streamkl.capture.record(...) from the attention code and use the 'recorder' capture."
        ) from err
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:  # pragma: no cover - transformers 4.x before masking_utils: masks are built per model
        ALL_MASK_ATTENTION_FUNCTIONS = AttentionMaskInterface = None
    return AttentionInterface, ALL_ATTENTION_FUNCTIONS, AttentionMaskInterface, ALL_MASK_ATTENTION_FUNCTIONS


def uses_attention_interface(module: nn.Module) -> bool:
    """True when ``type(module).forward`` dispatches through transformers' ``ALL_ATTENTION_FUNCTIONS``.

    Example:
        >>> from transformers import LlamaConfig
        >>> from transformers.models.llama.modeling_llama import LlamaAttention
        >>> uses_attention_interface(LlamaAttention(LlamaConfig(hidden_size=8, num_attention_heads=2), 0))
        True
        >>> uses_attention_interface(nn.MultiheadAttention(8, 2))
        False
    """
    cls = type(module)
    if cls not in _USES_INTERFACE:
        fn = inspect.unwrap(cls.forward)
        code = getattr(fn, "__code__", None)
        found = code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names
        if not found and code is not None:
            try:
                found = "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(fn)
            except (OSError, TypeError):
                found = False
        _USES_INTERFACE[cls] = found
    return _USES_INTERFACE[cls]


def _original_function(original: str, module: nn.Module) -> Callable[..., Any]:
    _, all_attention, _, _ = _interfaces()
    if original != "eager":
        return all_attention[original]
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise RuntimeError(
            f"{type(module).__name__} runs the 'eager' attention implementation, but its module "
            f"{type(module).__module__} defines no `eager_attention_forward` to delegate to; switch the model to "
            "attn_implementation='sdpa' before distilling."
        )
    return fn


def _capturing_attention(original: str) -> Callable[..., Any]:
    def streamkl_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
        for capture in tuple(_OWNERS.get(id(module), ())):
            if capture.is_recording:
                capture._record_call(module, query, key, kwargs)
        return _original_function(original, module)(module, query, key, value, attention_mask, *args, **kwargs)

    streamkl_attention.__name__ = f"{CAPTURE_PREFIX}{original}_attention"
    return streamkl_attention


def capture_implementation(original: str) -> str:
    """Register (once) and return the capturing implementation name that wraps ``original``.

    Example:
        >>> capture_implementation("sdpa")
        'streamkl_sdpa'
    """
    name = f"{CAPTURE_PREFIX}{original}"
    if name not in _REGISTERED:
        attention_interface, _, mask_interface, all_masks = _interfaces()
        attention_interface.register(name, _capturing_attention(original))
        # Same name as a mask function, or transformers would build no causal/padding mask for it.
        if mask_interface is not None and original in all_masks._global_mapping:
            mask_interface.register(name, all_masks[original])
        _REGISTERED.add(name)
    return name


def _set_implementation(config: Any, name: str) -> None:
    if hasattr(config, "_attn_implementation_internal"):
        config._attn_implementation_internal = name  # the setter of `_attn_implementation` recurses into sub-configs
    else:  # pragma: no cover - older configs
        config._attn_implementation = name


class HFAttentionCapture(AttentionCapture):
    """Capture ``(q, k)`` from transformers models through a registered attention function.

    Every module whose ``forward`` dispatches through ``ALL_ATTENTION_FUNCTIONS`` is a layer (Llama's
    ``model.layers.<i>.self_attn``, BERT's ``encoder.layer.<i>.attention.self``, ...); a layer's index is its
    position in module order, which equals ``layer_idx`` for decoder-only and encoder-only models. The record
    holds the post-RoPE query ``[B, H, N, D]``, the key ``[B, H_kv, N, D]`` before GQA repetition, the layer's
    ``scaling``, its causality (the ``is_causal`` call argument, else ``module.is_causal``) and ``layer_idx``.

    Args:
        model: a ``PreTrainedModel`` or any module containing them (e.g. a LightningModule).
        exclude: submodules to ignore.

    Example:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> cfg = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        ...                   intermediate_size=64, vocab_size=50, attn_implementation="sdpa")
        >>> model = LlamaForCausalLM(cfg)
        >>> capture = HFAttentionCapture(model)
        >>> capture.layer_names()
        ['model.layers.0.self_attn', 'model.layers.1.self_attn']
        >>> with capture.recording():
        ...     _ = model(torch.randint(0, 50, (2, 6)))
        >>> r = capture.records["model.layers.1.self_attn"]
        >>> tuple(r.q.shape), tuple(r.k.shape), r.scale, r.causal, r.layer_idx, model.config._attn_implementation
        ((2, 4, 6, 8), (2, 2, 6, 8), 0.3535533905932738, True, 1, 'sdpa')
    """

    kind = "hf"

    def __init__(self, model: nn.Module, *, exclude: Iterable[nn.Module] = ()) -> None:
        super().__init__(model, exclude=exclude)
        _interfaces()  # fail early without a usable transformers
        self._configs: list[Any] = []
        self._owned: list[nn.Module] = []
        self._warned: set[str] = set()

    def find_layers(self) -> list[str]:
        """Module paths of the attention modules that use transformers' attention interface."""
        return [name for name, m in self.named_modules() if uses_attention_interface(m)]

    def _model_configs(self) -> list[Any]:
        from transformers import PreTrainedModel

        configs: dict[int, Any] = {}
        for _, m in self.named_modules():
            owns_config = isinstance(m, PreTrainedModel) or uses_attention_interface(m)
            if owns_config and hasattr(getattr(m, "config", None), "_attn_implementation"):
                configs.setdefault(id(m.config), m.config)
        return list(configs.values())

    def _attach(self) -> None:
        names = self.layer_names()
        wanted = names if self.selected is None else [n for n in names if n in self.selected]
        modules = dict(self.named_modules())
        self._owned = [modules[n] for n in wanted]
        for m in self._owned:
            _OWNERS.setdefault(id(m), []).append(self)
        self._configs = self._model_configs()
        for config in self._configs:
            entry = _SWITCHED.get(id(config))
            if entry is None:
                original = config._attn_implementation or "eager"
                if isinstance(original, str) and original.startswith(CAPTURE_PREFIX):  # pragma: no cover
                    original = original[len(CAPTURE_PREFIX):]
                entry = _SWITCHED[id(config)] = [config, original, 0]
                _set_implementation(config, capture_implementation(original))
            entry[2] += 1

    def _detach(self) -> None:
        for m in self._owned:
            owners = _OWNERS.get(id(m), [])
            if self in owners:
                owners.remove(self)
            if not owners:
                _OWNERS.pop(id(m), None)
        self._owned = []
        for config in self._configs:
            entry = _SWITCHED.get(id(config))
            if entry is None:  # pragma: no cover - defensive
                continue
            entry[2] -= 1
            if entry[2] <= 0:
                _set_implementation(config, entry[1])
                del _SWITCHED[id(config)]
        self._configs = []

    def _record_call(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, kwargs: dict[str, Any]) -> None:
        name = self.module_path(module)
        if name is None:  # pragma: no cover - defensive
            return
        causal = kwargs.get("is_causal")
        if causal is None:
            causal = getattr(module, "is_causal", None)
        if causal is not None and getattr(getattr(module, "config", None), "is_causal", True) is False:
            causal = False  # decoder used bidirectionally (config.is_causal=False)
        odd = [k for k in _INEXACT_KWARGS if kwargs.get(k) is not None]
        if getattr(module, "sliding_window", None) is not None and "sliding_window" not in odd:
            odd.append("sliding_window")
        note = None
        if odd:
            note = f"{type(module).__name__} attention uses {odd}, which attention_kl does not model"
        scale = kwargs.get("scaling")
        self.record(name, query, key, scale=None if scale is None else float(scale),
                    causal=None if causal is None else bool(causal), exact=not odd, note=note,
                    layer_idx=getattr(module, "layer_idx", None))
