r"""
Hugging Face transformers capture
^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^

Capture through the attention interface of transformers (5.x): while a capture records, every function registered
in ``ALL_ATTENTION_FUNCTIONS`` (the mapping the attention modules' code reads) and the module-level
``eager_attention_forward`` of each captured module's code (what ``get_interface("eager", ...)`` falls back to)
are replaced by a wrapper that records the call of the captured modules and then calls the original function with
the same arguments. Nothing about the model changes: its config keeps its implementation name, so the mask
builder and flash-attention's loader see what they see without capture, and the implementation receives exactly
the name, arguments and mask it would have received. The replacements are counted and undone when the last
capture that needs them stops.

A record holds the post-RoPE query, the key (and, when asked, the value) before GQA repetition, the layer's
``scaling``, ``softcap`` and sinks (``s_aux``), and the complete mask of the call, read from what the
implementation received (:mod:`lightning_streamkl.capture.masks`): a 4D boolean or additive mask, or a
FlexAttention ``BlockMask``, is mapped to causal / window / key padding / packed documents when it equals them,
else kept as a general mask; flash-attention calls are read from their padding mask, ``cu_seq_lens_*``,
``position_ids`` and ``sliding_window``; no mask means what it means to the implementation (sdpa: causal from
``is_causal``; eager and flex: no mask).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from streamkl.precision import cast_for_autocast

from .base import AttentionCapture
from .masks import Masking, describe_mask, flash_masking

log = logging.getLogger(__name__)

#: Attention keyword arguments that add something attention_kl cannot express; a layer whose call carries one
#: is refused.
REFUSED_KWARGS = {
    "position_bias": "a score bias (a T5-style relative position bias)",
    "indices": "a sparse selection of keys per query (top-k key indices)",
    "block_indices": "a sparse selection of key blocks per query",
}
#: Call arguments of an attention module that make the call cross-attention when given.
CROSS_ATTENTION_ARGS = ("key_value_states", "encoder_hidden_states", "cross_attention_states")

# id(attention module) -> the HF captures that currently record it
_OWNERS: dict[int, list[HFAttentionCapture]] = {}
# (id(mapping), key) -> the replacement of one registered function
_PATCHES: dict[tuple[int, str], _Patch] = {}
# id(attention module) -> leaf copies of a call recorded without autograd (reentrant activation checkpointing)
_PENDING: dict[int, _Pending] = {}
# id(mask) -> (mask, key, Masking): a mask object's reading, shared by the layers of one forward pass
_MASKS: dict[int, tuple[Any, tuple, Masking]] = {}
# (implementation, shapes, flags, scalar and tensor arguments) -> (the tensors, their flash-attention Masking)
_FLASH_MASKS: dict[tuple, tuple[tuple, Masking]] = {}
#: the call arguments flash_masking reads: tensors (compared by identity and version) and scalars (by value)
FLASH_TENSOR_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "position_ids")
FLASH_SCALAR_KWARGS = ("sliding_window", "max_length_q", "max_length_k")
#: calls noted by compiled code while recording, as ``(function, arguments)``; :func:`settle_traced_calls` runs them
_TRACED: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
_CHECKPOINT_SIDE_EFFECTS = "skip_fwd_side_effects_in_bwd_under_checkpoint"
_USES_INTERFACE: dict[type, bool] = {}
_SIGNATURES: dict[Any, inspect.Signature | None] = {}
_POSITIONAL_NAMES: dict[Any, tuple[str, ...] | None] = {}


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


def _check_transformers() -> None:
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: F401
    except ImportError as err:  # pragma: no cover - transformers < 4.48
        raise ImportError(
            "Capturing a Hugging Face model needs transformers>=4.48 (the AttentionInterface); upgrade it, or call "
            "lightning_streamkl.capture.record(...) from the attention code and use the 'recorder' capture."
        ) from err


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


def implementation_kind(name: str) -> str:
    """How an implementation registered under ``name`` reads its mask: ``"eager"``, ``"sdpa"``, ``"flash"``,
    ``"flex"`` or ``"custom"`` (transformers' own test for flash is ``"flash" in name``).

    Example:
        >>> [implementation_kind(n) for n in ("eager", "paged|sdpa", "flash_attention_2", "flex_attention", "mine")]
        ['eager', 'sdpa', 'flash', 'flex', 'custom']
    """
    if name in ("eager", "paged|eager"):
        return "eager"
    if "flash" in name:
        return "flash"
    if "flex" in name:
        return "flex"
    if "sdpa" in name:
        return "sdpa"
    return "custom"


# ---------------------------------------------------------------------------------------------- the replacements
@dataclass
class _Patch:
    target: dict
    key: str
    original: Callable[..., Any]
    wrapper: Callable[..., Any]
    count: int = 0


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    if fn not in _SIGNATURES:
        try:
            _SIGNATURES[fn] = inspect.signature(fn)
        except (TypeError, ValueError):
            _SIGNATURES[fn] = None
    return _SIGNATURES[fn]


def _positional_names(fn: Callable[..., Any]) -> tuple[str, ...] | None:
    """The names of ``fn``'s leading positional-or-keyword parameters, when a call's positional arguments can be
    named by zipping them with these (no positional-only parameter, which a keyword could not name); else None."""
    if fn not in _POSITIONAL_NAMES:
        signature = _signature(fn)
        names: tuple[str, ...] | None = None
        params = () if signature is None else signature.parameters.values()
        if signature is not None and all(p.kind is not inspect.Parameter.POSITIONAL_ONLY for p in params):
            names = tuple(p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
        _POSITIONAL_NAMES[fn] = names
    return _POSITIONAL_NAMES[fn]


def _named_arguments(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """Every argument of a call of ``fn`` by parameter name, the ``**kwargs`` catch-all flattened in; None when the
    call does not bind. The usual call (positional arguments within the named parameters, keywords apart from them)
    is named by zipping, without ``Signature.bind`` (tens of microseconds per attention call)."""
    names = _positional_names(fn)
    if names is not None and len(args) <= len(names) and not any(k in kwargs for k in names[:len(args)]):
        return dict(zip(names, args)) | kwargs
    signature = _signature(fn)
    if signature is None:
        return None
    try:
        bound = signature.bind(*args, **kwargs).arguments
    except TypeError:
        return None
    call: dict[str, Any] = {}
    for key, value in bound.items():
        if signature.parameters[key].kind is inspect.Parameter.VAR_KEYWORD:
            call.update(value)
        else:
            call[key] = value
    return call


@functools.cache
def _capturing(original: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``original`` with the calls of captured modules recorded first; every argument passes through unchanged.

    One wrapper per function for the life of the process, so that a compiled model's guards (which check the
    function they traced) hold from one step to the next. Under ``torch.compile`` the call is noted in
    :data:`_TRACED` (a side effect dynamo replays after the graph runs, the tensors as graph outputs) and read when
    the records are (:func:`settle_traced_calls`): no graph break in the layer."""

    @functools.wraps(original)
    def streamkl_capturing_attention(*args: Any, **kwargs: Any) -> Any:
        module = args[0] if args else kwargs.get("module")
        if torch.compiler.is_compiling():
            if id(module) in _OWNERS:
                _TRACED.append((_observe, (original, name, *_cast_in_graph(args, kwargs))))
        elif id(module) in _OWNERS or id(module) in _PENDING:
            _observe(original, name, args, kwargs)
        return original(*args, **kwargs)

    return streamkl_capturing_attention


def _cast_in_graph(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A noted call's arguments with the query, key and value cast for autocast (what the record keeps,
    :meth:`~lightning_streamkl.capture.AttentionCapture.record`) inside the graph: the graph then outputs the bf16
    tensors, not the float32 ones a Llama layer's rotary embedding gives under autocast (which the noted call would
    hold alive beside the layer's own until the graph has run: 80 MiB a layer at N = 16384 for 16 heads of 64)."""
    names = ("query", "key", "value")
    head = cast_for_autocast(*args[1:4])
    named = dict(zip(names, cast_for_autocast(*(kwargs.get(n) for n in names))))
    return (*args[:1], *head, *args[4:]), {**kwargs, **{n: x for n, x in named.items() if n in kwargs}}


def settle_traced_calls() -> None:
    """Record the attention calls that ``torch.compile``'d code noted (:data:`_TRACED`), in the order they ran.

    Example:
        >>> settle_traced_calls()  # nothing traced: nothing to do
        >>> _TRACED
        []
    """
    while _TRACED:
        calls = _TRACED[:]
        _TRACED.clear()
        for fn, args in calls:
            fn(*args)


@contextlib.contextmanager
def _side_effects_in_checkpoints() -> Iterator[None]:
    """Let dynamo trace the capture's side effect inside an activation-checkpointed layer (without it, each
    checkpointed layer that records breaks the graph and runs eagerly). The noted call is not replayed when the
    backward recomputes the layer, as the eager capture ignores recomputations (:func:`_observe`)."""
    config = torch._dynamo.config
    if not hasattr(config, _CHECKPOINT_SIDE_EFFECTS):  # pragma: no cover - an older torch: graph breaks remain
        yield
        return
    with config.patch(**{_CHECKPOINT_SIDE_EFFECTS: True}):
        yield


def _patch_targets(module: nn.Module) -> list[tuple[dict, str, str]]:
    """``(mapping, key, implementation name)`` of every function the forward of ``module`` may dispatch to."""
    scope = getattr(inspect.unwrap(type(module).forward), "__globals__", {})
    targets = []
    interface = scope.get("ALL_ATTENTION_FUNCTIONS")
    mappings = (interface,) if isinstance(interface, dict) else (  # a plain dict before AttentionInterface (4.48)
        getattr(interface, "_global_mapping", None), getattr(interface, "_local_mapping", None))
    for mapping in mappings:
        if isinstance(mapping, dict):
            targets += [(mapping, key, key) for key, fn in mapping.items() if callable(fn)]
    if callable(scope.get("eager_attention_forward")):
        targets.append((scope, "eager_attention_forward", "eager"))
    return targets


def _retain(target: dict, key: str, name: str) -> tuple[int, str]:
    handle = (id(target), key)
    patch = _PATCHES.get(handle)
    if patch is None:
        original = target[key]
        patch = _PATCHES[handle] = _Patch(target, key, original, _capturing(original, name))
        target[key] = patch.wrapper
    elif target.get(key) is not patch.wrapper:  # another function was registered under the name meanwhile
        patch.original, patch.wrapper = target[key], _capturing(target[key], name)
        target[key] = patch.wrapper
    patch.count += 1
    return handle


def _release(handles: Iterable[tuple[int, str]]) -> None:
    for handle in handles:
        patch = _PATCHES.get(handle)
        if patch is None:  # pragma: no cover - defensive
            continue
        patch.count -= 1
        if patch.count <= 0:
            if patch.target.get(patch.key) is patch.wrapper:  # unless someone registered another function since
                patch.target[patch.key] = patch.original
            del _PATCHES[handle]


def _retain_again(handles: Iterable[tuple[int, str]]) -> list[tuple[int, str]]:
    kept = []
    for handle in handles:
        if handle in _PATCHES:
            _PATCHES[handle].count += 1
            kept.append(handle)
    return kept


# ---------------------------------------------------------------------------------------------- reentrant checkpointing
@dataclass
class _Pending:
    """Leaf copies of one call recorded without autograd, waiting for the call's recomputation in the backward."""

    leaves: tuple[torch.Tensor | None, ...]
    handles: list[tuple[int, str]]

    def attach(self, recomputed: tuple[torch.Tensor | None, ...]) -> None:
        for leaf, tensor in zip(self.leaves, recomputed):
            if leaf is not None and tensor is not None and tensor.requires_grad and tensor.shape == leaf.shape:
                tensor.register_hook(_adds_gradient_of(leaf))
        self.drop()

    def drop(self) -> None:
        _release(self.handles)
        self.handles = []


def _adds_gradient_of(leaf: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        extra, leaf.grad = leaf.grad, None
        return grad if extra is None else grad + extra.to(grad.dtype)

    return hook


def _drop_pending(module_id: int) -> None:
    pending = _PENDING.pop(module_id, None)
    if pending is not None:
        pending.drop()


def _in_reentrant_checkpoint(depth: int = 200) -> bool:
    """True when called from the first forward of reentrant activation checkpointing (``CheckpointFunction.forward``,
    which runs its segment under ``no_grad``)."""
    from torch.utils.checkpoint import CheckpointFunction

    code = inspect.unwrap(CheckpointFunction.forward).__code__
    frame = sys._getframe(1)
    while frame is not None and depth > 0:
        if frame.f_code is code:
            return True
        frame, depth = frame.f_back, depth - 1
    return False


def _without_graph() -> bool:
    """True for the first forward of a reentrant checkpointed segment: the call runs without autograd, so the
    recorded tensors carry no graph, and the backward will recompute it."""
    return not torch.is_grad_enabled() and not torch.is_inference_mode_enabled() and _in_reentrant_checkpoint()


# ---------------------------------------------------------------------------------------------- one call
@torch.compiler.disable
def _observe(original: Callable[..., Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    call = _named_arguments(original, args, kwargs)
    if call is None:  # an unusual signature: the documented positional order
        call = dict(zip(("module", "query", "key", "value", "attention_mask"), args)) | kwargs
    module = call.pop("module", None)
    query, key, value = call.pop("query", None), call.pop("key", None), call.pop("value", None)
    mask = call.pop("attention_mask", None)
    if module is None or query is None or key is None:  # pragma: no cover - not an attention call
        return
    if torch._C._current_graph_task_id() != -1:  # a recomputation inside the backward (activation checkpointing)
        pending = _PENDING.pop(id(module), None)
        if pending is not None and torch.is_grad_enabled():
            pending.attach((query, key, value))
        elif pending is not None:
            pending.drop()
        return
    for capture in tuple(_OWNERS.get(id(module), ())):
        if capture.is_recording:
            capture._record_call(name, module, query, key, value, mask, call)


def _causal_flag(module: nn.Module, kwargs: dict[str, Any]) -> bool | None:
    flag = kwargs.get("is_causal")
    if flag is None:
        flag = getattr(module, "is_causal", None)
    return None if flag is None else bool(flag)


def call_masking(name: str, module: nn.Module, query: torch.Tensor, key: torch.Tensor, mask: Any,
                 kwargs: dict[str, Any], *, self_attention: bool) -> Masking:
    """The complete mask of one attention call, as the implementation registered under ``name`` applies it.

    * a 4D (or 3D) boolean or additive mask, or a ``BlockMask``: the mask is the whole truth (``is_causal`` is not
      read, as sdpa, eager and flex do not read it then); mapped to structured options when it equals them;
    * a ``[B, N]`` mask (flash-attention, or a custom implementation): a padding mask, read as flash-attention reads
      it, with ``is_causal`` (call argument, else ``module.is_causal``) and ``sliding_window``;
    * no mask: sdpa is causal when ``is_causal`` (default True) and ``N_q > 1``; flash-attention and custom
      implementations follow ``is_causal``, ``sliding_window`` and packed sequences (flash-attention also reads
      restarting ``position_ids``); eager and flex attend to every key.

    Raises:
        ValueError: an additive mask holding a bias, or a ``[B, N]`` mask given to sdpa, eager or flex.

    Example:
        >>> from transformers import LlamaConfig
        >>> from transformers.models.llama.modeling_llama import LlamaAttention
        >>> attn = LlamaAttention(LlamaConfig(hidden_size=8, num_attention_heads=2), 0)
        >>> q = torch.randn(1, 2, 5, 4)
        >>> call_masking("sdpa", attn, q, q, None, {}, self_attention=True).summary()
        'causal'
        >>> call_masking("eager", attn, q, q, None, {}, self_attention=True).summary()
        'bidirectional'
        >>> pos = torch.tensor([[0, 1, 2, 0, 1]])
        >>> call_masking("flash_attention_2", attn, q, q, None, {"position_ids": pos}, self_attention=True).summary()
        'causal, 2 packed sequences'
    """
    kind = implementation_kind(name)
    batch, n_q, n_k = query.shape[0], query.shape[2], key.shape[2]
    flag = _causal_flag(module, kwargs)
    two_d = isinstance(mask, torch.Tensor) and mask.dim() == 2
    if mask is not None and not two_d:
        version = mask._version if isinstance(mask, torch.Tensor) and not mask.is_inference() else None
        cache_key = (kind, batch, n_q, n_k, self_attention, version)
        cached = _MASKS.get(id(mask))
        if cached is not None and cached[0] is mask and cached[1] == cache_key:
            return cached[2]
        masking = describe_mask(mask, n_q, n_k, batch, self_attention=self_attention)
        _MASKS[id(mask)] = (mask, cache_key, masking)
        return masking
    if two_d and kind in ("sdpa", "eager", "flex"):
        raise ValueError(
            f"{type(module).__name__} passed a [B, N] attention mask of shape {tuple(mask.shape)} to the {name!r} "
            "implementation, which takes a 4D mask; StreamKL cannot tell what it applied."
        )
    if kind in ("eager", "flex") or (kind == "sdpa" and mask is None and flag is False):
        return Masking(causal=False)
    if kind == "sdpa":
        return Masking(causal=n_q > 1)
    if kind != "flash":
        kwargs = {k: v for k, v in kwargs.items() if k != "position_ids"}  # only flash-attention infers packing
    # every layer of a pass gets the same mask and offsets: read them once (host synchronisations), and give every
    # layer the same Masking, whose tensors then let the loss fuse the layers' pairs (lightning_streamkl.terms)
    tensors = (mask, *(kwargs.get(k) for k in FLASH_TENSOR_KWARGS))
    key = (kind, batch, n_q, n_k, self_attention, flag, *(kwargs.get(k) for k in FLASH_SCALAR_KWARGS),
           *(None if t is None else (id(t), None if t.is_inference() else t._version) for t in tensors))
    cached = _FLASH_MASKS.get(key)
    if cached is not None and all(a is b for a, b in zip(cached[0], tensors)):
        return cached[1]
    masking = flash_masking(mask, batch, n_q, n_k, kwargs, flag, self_attention=self_attention)
    _FLASH_MASKS[key] = (tensors, masking)  # (holding the tensors keeps their ids theirs)
    return masking


class HFAttentionCapture(AttentionCapture):
    """Capture transformers attention calls (queries, keys, masks, soft-caps, sinks) through the attention interface.

    Every module whose ``forward`` dispatches through ``ALL_ATTENTION_FUNCTIONS`` is a layer (Llama's
    ``model.layers.<i>.self_attn``, BERT's ``encoder.layer.<i>.attention.self``, ...); a layer's index is its
    position in module order, which equals ``layer_idx`` for decoder-only and encoder-only models. Works under every
    implementation (eager, sdpa, flash-attention 2/3/4, flex, registered custom ones), whose name, arguments and mask
    are never changed. See :class:`~lightning_streamkl.capture.CapturedAttention` for what a record holds.

    Under reentrant activation checkpointing the first forward runs without autograd: the record then holds leaf
    copies of the query and key, and when the backward recomputes the call, their gradients are added to the
    recomputed tensors', so the distillation term trains the student as without checkpointing.

    Args:
        model: a ``PreTrainedModel`` or any module containing them (e.g. a LightningModule).
        exclude: submodules to ignore.
        capture_values: also record the values ``[B, H_kv, N, D_v]``.

    Raises:
        ValueError: (while recording) a captured call whose attention adds what attention_kl cannot express
            (:data:`REFUSED_KWARGS`, or an additive mask holding a bias).

    Example:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> cfg = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        ...                   intermediate_size=64, vocab_size=50, attn_implementation="sdpa")
        >>> model = LlamaForCausalLM(cfg)
        >>> capture = HFAttentionCapture(model)
        >>> capture.layer_names()
        ['model.layers.0.self_attn', 'model.layers.1.self_attn']
        >>> mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
        >>> with capture.recording():
        ...     _ = model(torch.randint(0, 50, (2, 6)), attention_mask=mask)
        >>> r = capture.records["model.layers.1.self_attn"]
        >>> tuple(r.q.shape), tuple(r.k.shape), r.scale, r.causal, r.layer_idx, model.config._attn_implementation
        ((2, 4, 6, 8), (2, 2, 6, 8), 0.3535533905932738, True, 1, 'sdpa')
        >>> r.key_padding_mask.int().tolist()
        [[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]]
    """

    kind = "hf"

    def __init__(self, model: nn.Module, *, exclude: Iterable[nn.Module] = (), capture_values: bool = False) -> None:
        super().__init__(model, exclude=exclude, capture_values=capture_values)
        _check_transformers()
        self._owned: list[nn.Module] = []
        self._handles: dict[int, list[tuple[int, str]]] = {}
        self._hooks: list[Any] = []
        self._cross: dict[int, bool] = {}
        self._compile_settings = contextlib.ExitStack()

    def find_layers(self) -> list[str]:
        """Module paths of the attention modules that use transformers' attention interface."""
        return [name for name, m in self.named_modules() if uses_attention_interface(m)]

    def _attach(self) -> None:
        names = self.layer_names()
        wanted = names if self.selected is None else [n for n in names if n in self.selected]
        self._owned = self.modules_at(wanted)
        for m in self._owned:
            _drop_pending(id(m))  # a previous step's copies whose backward never came
            _OWNERS.setdefault(id(m), []).append(self)
            self._handles[id(m)] = [_retain(target, key, name) for target, key, name in _patch_targets(m)]
            self._hooks.append(m.register_forward_pre_hook(self._note_call, with_kwargs=True))
        self._compile_settings.enter_context(_side_effects_in_checkpoints())

    def _settle(self) -> None:
        settle_traced_calls()

    def _detach(self) -> None:
        self._compile_settings.close()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for m in self._owned:
            owners = _OWNERS.get(id(m), [])
            if self in owners:
                owners.remove(self)
            if not owners:
                _OWNERS.pop(id(m), None)
            _release(self._handles.pop(id(m), []))
        self._owned = []
        self._cross = {}
        if not _OWNERS:
            _MASKS.clear()
            _FLASH_MASKS.clear()

    def _note_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Forward pre-hook: whether this call of ``module`` is cross-attention (keys from other states)."""
        cross = bool(getattr(module, "is_cross_attention", False))
        if not cross:
            named = kwargs
            if len(args) > 1:  # with the hidden states as the only positional argument the keywords say everything
                named = _named_arguments(type(module).forward, (module, *args), kwargs) or kwargs
            cross = any(named.get(arg) is not None for arg in CROSS_ATTENTION_ARGS)
        if torch.compiler.is_compiling():  # noted in call order, beside the attention calls (no dict write in a graph)
            _TRACED.append((self._cross.__setitem__, (id(module), cross)))
        else:
            self._cross[id(module)] = cross

    def _record_call(self, name: str, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor | None, mask: Any, kwargs: dict[str, Any]) -> None:
        path = self.module_path(module)
        if path is None:  # pragma: no cover - defensive
            return
        where = f"the attention layer {path!r} ({type(module).__name__}, implementation {name!r})"
        for arg, what in REFUSED_KWARGS.items():
            if kwargs.get(arg) is not None:
                raise ValueError(
                    f"StreamKL cannot distil {where}: its attention adds {what} (`{arg}`), which attention_kl cannot "
                    "express. Pair other layers, or record the layer's queries and keys yourself with "
                    "lightning_streamkl.capture.record()."
                )
        cross = self._cross.get(id(module), bool(getattr(module, "is_cross_attention", False)))
        try:
            masking = call_masking(name, module, query, key, mask, kwargs, self_attention=not cross)
        except ValueError as err:
            raise ValueError(f"StreamKL cannot distil {where}: {err}") from err
        if implementation_kind(name) == "sdpa" and mask is None and masking.causal and key.shape[2] > query.shape[2]:
            # sdpa's is_causal is top-left aligned: transformers keeps the first N_q keys (prefill of a static cache)
            key = key[:, :, :query.shape[2]]
            value = None if value is None else value[:, :, :query.shape[2]]
        sinks = kwargs.get("s_aux", kwargs.get("sinks"))
        if sinks is not None and (sinks.dim() != 1 or sinks.numel() != query.shape[1]):
            raise ValueError(
                f"StreamKL cannot distil {where}: expected one sink logit per query head ({query.shape[1]}), but the "
                f"call passed sinks of shape {tuple(sinks.shape)}."
            )
        softcap, scale = kwargs.get("softcap"), kwargs.get("scaling")
        value = value if self.capture_values else None
        if _without_graph():  # kept until the recomputation (or this module's next recording)
            # leaf copies of what the record keeps (cast under autocast first: a float32 leaf would hold the layer's
            # float32 query alive beside its bf16 record, 80 MiB a layer at N = 16384 for 16 heads of 64)
            query, key, value = (None if t is None else t.detach().requires_grad_()
                                 for t in cast_for_autocast(query, key, value))
            _drop_pending(id(module))
            _PENDING[id(module)] = _Pending((query, key, value), _retain_again(self._handles.get(id(module), [])))
        self.record(path, query, key, scale=None if scale is None else float(scale), causal=masking.causal,
                    key_padding_mask=masking.key_padding_mask, layer_idx=getattr(module, "layer_idx", None),
                    v=value, window=masking.window, softcap=None if softcap is None else float(softcap),
                    sinks=sinks, attn_mask=masking.attn_mask, query_mask=masking.query_mask, packed=masking.packed,
                    key_rows=masking.key_rows, masks_from_call=True)
