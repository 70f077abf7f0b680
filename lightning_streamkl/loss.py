r"""
Layer-pair loss
^^^^^^^^^^^^^^^

Assemble the distillation loss from captured ``(q, k)`` (and ``v``): resolve each
:class:`~lightning_streamkl.LayerPair` against the teacher's and the student's captures, map heads, decide causality
and masks, call :func:`streamkl.attention_kl` per pair and relation (the attention distributions ``"qk"``, or
MiniLM-v2's self-attention relations ``"qq"``, ``"kk"``, ``"vv"`` after re-splitting the heads into relation heads)
and return the weighted sum together with per-term sums and row counts (what the metric accumulates). Also the
helpers for common pairings.

Each layer's mask comes from its own attention call when the capture read it there (Hugging Face,
``nn.MultiheadAttention``): causal, sliding window, key padding, packed documents (the op's ``layout="thd"``) or a
general mask; soft-caps, sinks and scales are per side. The two layers of a pair must allow the same keys for every
query row (the KL compares two distributions over the same keys); when they do not, the pair is refused. A relation
is computed over the same keys as the layer's attention (its mask, not its scale, soft-cap or sinks, which belong to
``q kᵀ``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import torch
from torch import nn

from streamkl.options import AttentionKLOptions

from .capture import build_capture
from .capture.base import AttentionCapture, CapturedAttention, closest
from .capture.masks import Masking, canonical_window, dense_allowed, same_keys_on_host, same_mask
from .config import LayerPair, StreamKLConfig, validate_config
from .terms import TermCall, TermResult, run_terms
from .transfer import to_device

log = logging.getLogger(__name__)

__all__ = ["AttentionDistillationLoss", "LossOutput", "LossStream", "explicit_pairs", "last_k_pairs", "last_to_last",
           "layer_count", "relation_heads_split", "uniform_pairs", "weighted_sum"]


def last_to_last(*, weight: float = 1.0, name: str | None = "last", **options: object) -> list[LayerPair]:
    """One pair: the teacher's last attention layer to the student's last (MiniLM's choice).

    Example:
        >>> [(p.teacher, p.student, p.label) for p in last_to_last()]
        [(-1, -1, 'last')]
    """
    return [LayerPair(teacher=-1, student=-1, weight=weight, name=name, **options)]


def layer_count(model: nn.Module | int, capture: str = "auto", *, name: str = "model") -> int:
    """The number of attention layers of ``model`` that its capture finds (``capture``: as in
    :func:`~lightning_streamkl.capture.build_capture`); an ``int`` is returned as it is. ``name`` names the argument
    in errors.

    Raises:
        ValueError: an int < 1, or a model in which the capture finds no attention layer.

    Example:
        >>> encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16), 3, enable_nested_tensor=False)
        >>> layer_count(encoder), layer_count(12)
        (3, 12)
    """
    if isinstance(model, nn.Module):
        found = len(build_capture(model, capture).layer_names())
        if found == 0:
            raise ValueError(f"Expected `{name}` ({type(model).__name__}) to have attention layers, but the "
                             f"{capture!r} capture found none; pass the number of layers instead.")
        return found
    if isinstance(model, bool) or not isinstance(model, int) or model < 1:
        raise ValueError(f"Expected `{name}` to be a model or a number of layers >= 1, but got {model!r}.")
    return model


def uniform_pairs(teacher: nn.Module | int, student: nn.Module | int, *, weight: float = 1.0,
                  **options: object) -> list[LayerPair]:
    """Pair every student layer with a teacher layer at the same relative depth.

    Student layer ``i`` (of ``L_s``) takes teacher layer ``round((i + 1) · L_t / L_s) - 1``, so the last
    layers are paired and the others are spread evenly. Each pair gets ``weight / L_s``, so the sum is
    ``weight`` times the mean over pairs. ``teacher`` and ``student`` are the layer counts, or the models
    themselves (their attention layers are counted with :func:`layer_count`). Other keyword arguments are
    :class:`~lightning_streamkl.LayerPair` fields.

    Example:
        >>> [(p.teacher, p.student, p.weight) for p in uniform_pairs(12, 4)]
        [(2, 0, 0.25), (5, 1, 0.25), (8, 2, 0.25), (11, 3, 0.25)]
        >>> deep = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16), 6, enable_nested_tensor=False)
        >>> shallow = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16), 2, enable_nested_tensor=False)
        >>> [(p.teacher, p.student) for p in uniform_pairs(deep, shallow)]
        [(2, 0), (5, 1)]
    """
    num_teacher_layers, num_student_layers = layer_count(teacher, name="teacher"), layer_count(student, name="student")
    if num_student_layers > num_teacher_layers:
        raise ValueError(
            f"Expected the student's layers to be at most the teacher's, but got {num_student_layers} > "
            f"{num_teacher_layers}; pair layers explicitly with explicit_pairs() or LayerPair."
        )
    return [
        LayerPair(teacher=round((i + 1) * num_teacher_layers / num_student_layers) - 1, student=i,
                  weight=weight / num_student_layers, **options)
        for i in range(num_student_layers)
    ]


def last_k_pairs(k: int, teacher: nn.Module | int | None = None, student: nn.Module | int | None = None, *,
                 weight: float = 1.0, **options: object) -> list[LayerPair]:
    """Pair the last ``k`` student layers with the last ``k`` teacher layers, in order (``k=1``: MiniLM's last
    layer to last layer). Layers are negative indices, so no count is needed; given the models (or their counts),
    ``k`` is checked against both. Each pair gets ``weight / k``; names are ``last``, ``last-1``, ...

    Raises:
        ValueError: ``k < 1``, or more layers than a model has.

    Example:
        >>> [(p.teacher, p.student, p.label, p.weight) for p in last_k_pairs(2)]
        [(-2, -2, 'last-1', 0.5), (-1, -1, 'last', 0.5)]
        >>> last_k_pairs(3, teacher=12, student=2)
        Traceback (most recent call last):
        ...
        ValueError: Expected `k` to be at most the student's 2 attention layers, but got 3.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"Expected `k` to be an int >= 1, but got {k!r}.")
    for side, model in (("teacher", teacher), ("student", student)):
        if model is not None and k > (count := layer_count(model, name=side)):
            raise ValueError(f"Expected `k` to be at most the {side}'s {count} attention layers, but got {k}.")
    return [LayerPair(teacher=-i, student=-i, weight=weight / k, name="last" if i == 1 else f"last-{i - 1}",
                      **options) for i in range(k, 0, -1)]


def explicit_pairs(mapping: Mapping[int | str, int | str], *, weight: float = 1.0,
                   **options: object) -> list[LayerPair]:
    """One pair per entry of ``{student layer: teacher layer}`` (indices or module paths), each weighing
    ``weight / len(mapping)``.

    Raises:
        ValueError: an empty mapping.

    Example:
        >>> [(p.teacher, p.student, p.label) for p in explicit_pairs({0: 3, 1: 7})]
        [(3, 0, 't3_s0'), (7, 1, 't7_s1')]
    """
    if not isinstance(mapping, Mapping) or not mapping:
        raise ValueError(f"Expected `mapping` to be a non-empty {{student layer: teacher layer}} mapping, but got "
                         f"{mapping!r}.")
    return [LayerPair(teacher=t, student=s, weight=weight / len(mapping), **options) for s, t in mapping.items()]


def relation_heads_split(x: torch.Tensor, heads: int, *, what: str = "x") -> torch.Tensor:
    """MiniLM-v2's re-split: the heads of ``x [B, H, N, D]`` concatenated (``[B, N, H·D]``, as the layer's output
    projection sees them) and split again into ``heads`` relation heads, ``[B, heads, N, H·D / heads]``.

    Raises:
        ValueError: ``H·D`` is not a multiple of ``heads`` (``what`` names the tensor in the message).

    Example:
        >>> x = torch.arange(2 * 3 * 4.0).view(1, 2, 3, 4)     # 2 heads of size 4, 3 tokens
        >>> relation_heads_split(x, 4).shape                   # 4 relation heads of size 2
        torch.Size([1, 4, 3, 2])
        >>> relation_heads_split(x, 4)[0, 2, 0].tolist()       # token 0, the first half of head 1
        [12.0, 13.0]
        >>> relation_heads_split(x, 3, what="teacher keys")
        Traceback (most recent call last):
        ...
        ValueError: Expected the number of relation heads to divide the teacher keys' concatenated heads (2 heads × 4 \
= 8), but got 3.
    """
    b, h, n, d = x.shape
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or (h * d) % heads:
        raise ValueError(f"Expected the number of relation heads to divide the {what}' concatenated heads ({h} heads "
                         f"× {d} = {h * d}), but got {heads}.")
    return x.transpose(1, 2).reshape(b, n, heads, h * d // heads).transpose(1, 2)
@dataclass
class LossOutput:
    """What :class:`AttentionDistillationLoss` returns for one batch.

    Attributes:
        total: ``Σ_p weight_p · KL_p`` (differentiable; before the config's global ``weight`` and warm-up).
        per_pair: ``{term name: KL_p}``, the mean KL over counted rows of each term (differentiable). A term is
            a pair, or ``<pair>/<relation>`` for a pair that compares relations (see
            :attr:`AttentionDistillationLoss.pair_names`).
        kl_sums: ``[P]`` float32, the per-term KL summed over counted rows (detached), for the metric.
        rows: ``[P]`` float32, the per-term counted rows (for the metric).

    Example:
        >>> out = LossOutput(torch.tensor(0.5), {"last": torch.tensor(0.5)}, torch.tensor([2.0]), torch.tensor([4.0]))
        >>> float(out.kl_sums[0] / out.rows[0]) == float(out.per_pair["last"])
        True
    """

    total: torch.Tensor
    per_pair: dict[str, torch.Tensor]
    kl_sums: torch.Tensor
    rows: torch.Tensor


@dataclass
class _ResolvedPair:
    pair: LayerPair
    teacher: str
    student: str


def _relations(pair: LayerPair, config: StreamKLConfig) -> list[str]:
    return list(pair.relations if pair.relations is not None else config.relations)


def _term_names(pair: LayerPair, config: StreamKLConfig) -> list[str]:
    relations = _relations(pair, config)
    return [pair.label] if relations == ["qk"] else [f"{pair.label}/{r}" for r in relations]


class AttentionDistillationLoss:
    """The weighted sum of per-pair :func:`streamkl.attention_kl` terms between two captures' records.

    Args:
        config: a :class:`~lightning_streamkl.StreamKLConfig` or a mapping (validated).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from lightning_streamkl.capture import RecorderCapture
        >>> teacher, student = RecorderCapture(nn.Identity(), names=["a"]), RecorderCapture(nn.Identity(), names=["b"])
        >>> loss_fn = AttentionDistillationLoss({"pairs": [{"teacher": "a", "student": "b"}], "causal": True})
        >>> loss_fn.resolve(teacher, student)
        [('a', 'b')]
        >>> q = torch.randn(2, 4, 8, 16)
        >>> out = loss_fn({"a": CapturedAttention(q, q)}, {"b": CapturedAttention(q.clone(), q.clone())})
        >>> round(float(out.total), 6), out.rows.tolist()
        (0.0, [64.0])
    """

    def __init__(self, config: StreamKLConfig | Mapping[str, object]) -> None:
        self.config = validate_config(config)
        #: The names of the terms (what is logged): a pair's ``label``, or ``<label>/<relation>`` for each relation
        #: of a pair that compares relations.
        self.pair_names = [name for p in self.config.pairs for name in _term_names(p, self.config)]
        #: Each term's weight (its pair's ``weight``).
        self.weights = [p.weight for p in self.config.pairs for _ in _term_names(p, self.config)]
        self._resolved: list[_ResolvedPair] | None = None
        self._memo: dict[tuple[str, int, int], tuple[torch.Tensor, torch.Tensor, object]] = {}
        #: ``{term name: the precision of its products}`` as of the last call, e.g. ``"bf16"``, or
        #: ``"teacher bf16, student fp32 (TF32)"`` when the sides differ (:func:`streamkl.precision.product_precision`).
        self.precisions: dict[str, str] = {}

    def term_names(self, pair: LayerPair) -> list[str]:
        """The names of ``pair``'s terms: its label, or ``<label>/<relation>`` per relation it compares.

        Example:
            >>> loss = AttentionDistillationLoss({"pairs": [{"teacher": 0, "student": 0, "name": "a"}],
            ...                                   "relations": ["qq", "kk"]})
            >>> loss.term_names(loss.config.pairs[0])
            ['a/qq', 'a/kk']
        """
        return _term_names(pair, self.config)

    @property
    def needs_values(self) -> bool:
        """True when a pair compares the value relation ``"vv"`` (the captures must record values).

        Example:
            >>> AttentionDistillationLoss({"pairs": [[0, 0]], "relations": ["qq", "vv"]}).needs_values
            True
        """
        return any("vv" in _relations(p, self.config) for p in self.config.pairs)

    def resolve(self, teacher: AttentionCapture, student: AttentionCapture) -> list[tuple[str, str]]:
        """Map every pair's layer references to module paths, and make the captures record only those.

        Raises:
            ValueError: an unknown layer path (listing the closest names) or an index out of range, naming the pair.
        """
        resolved = []
        for i, pair in enumerate(self.config.pairs):
            where = f"pairs[{i}] ({pair.label!r})"
            resolved.append(_ResolvedPair(
                pair,
                teacher.resolve(pair.teacher, role=f"teacher layer of {where}"),
                student.resolve(pair.student, role=f"student layer of {where}"),
            ))
        self._resolved = resolved
        teacher.select({r.teacher for r in resolved})
        student.select({r.student for r in resolved})
        return [(r.teacher, r.student) for r in resolved]

    def __call__(
        self,
        teacher_records: Mapping[str, CapturedAttention],
        student_records: Mapping[str, CapturedAttention],
        *,
        key_padding_mask: torch.Tensor | None = None,
        query_mask: torch.Tensor | None = None,
    ) -> LossOutput:
        """Compute every pair's term from the records of one forward pass of each model.

        Args:
            teacher_records: ``{layer path: CapturedAttention}`` of the teacher.
            student_records: the same for the student.
            key_padding_mask: ``[B, N_k]`` bool, True = real key (from the batch), used only for records whose
                masks do not come from their call (the manual recorder) and that carry none.
            query_mask: ``[B, N_q]`` bool, False excludes a query row; likewise only for such records (a record
                from the call carries its own query mask, used when ``mask_queries`` is on).

        Raises:
            RuntimeError: a paired layer was not recorded during the forward pass (the message lists what was).
            ValueError: paired layers whose batch size or sequence lengths differ, or whose head counts differ
                under ``head_map="error"`` (or are not multiples of each other), whose causality disagrees, that
                allow different keys (windows, packed documents, padding, masks), with sinks on one side only, or a
                record marked inexact; a relation whose heads do not split into the relation heads, a relation with
                a per-head mask, or a ``"vv"`` relation on a record without values.
        """
        return self.stream(key_padding_mask=key_padding_mask, query_mask=query_mask).finish(teacher_records,
                                                                                             student_records)

    def stream(self, *, key_padding_mask: torch.Tensor | None = None,
               query_mask: torch.Tensor | None = None) -> LossStream:
        """The loss of one batch, taken pair by pair as the records arrive (:class:`LossStream`); the masks are
        those of :meth:`__call__`."""
        if self._resolved is None:
            self._resolved = [_ResolvedPair(p, p.teacher, p.student) for p in self.config.pairs]
        return LossStream(self, self._resolved, key_padding_mask, query_mask)

    # ------------------------------------------------------------------------------------------ one pair
    def _term_call(self, r: _ResolvedPair, t: CapturedAttention, s: CapturedAttention,
                   key_padding_mask: torch.Tensor | None, query_mask: torch.Tensor | None, relation: str = "qk",
                   ) -> TermCall:
        cfg, pair = self.config, r.pair
        label = f"pair {pair.label!r} (teacher {r.teacher!r}, student {r.student!r})"
        for rec, side in ((t, "teacher"), (s, "student")):
            if not rec.exact:
                raise ValueError(
                    f"StreamKL {label}: the {side} layer was recorded as inexact ({rec.note}); attention_kl would not "
                    "compute the KL between the layers' own distributions. Pair other layers."
                )
        device = s.q.device  # the teacher may run elsewhere: its queries and keys travel, not the models
        q_t, k_t, q_s, k_s = to_device(t.q, device), to_device(t.k, device), s.q, s.k
        if q_t.dim() != 4 or q_s.dim() != 4 or k_t.dim() != 4 or k_s.dim() != 4:
            raise ValueError(
                f"StreamKL {label}: expected 4-d [B, H, N, D] queries and keys, but got teacher q {tuple(q_t.shape)}, "
                f"k {tuple(k_t.shape)} and student q {tuple(q_s.shape)}, k {tuple(k_s.shape)}."
            )
        (b_t, h_t, n_qt, _), (b_s, h_s, n_qs, _) = q_t.shape, q_s.shape
        if (b_t, n_qt, k_t.shape[2]) != (b_s, n_qs, k_s.shape[2]):
            raise ValueError(
                f"StreamKL {label}: the paired layers see different shapes: teacher q {tuple(q_t.shape)}, "
                f"k {tuple(k_t.shape)} vs student q {tuple(q_s.shape)}, k {tuple(k_s.shape)} ([B, H, N, D]); "
                "both models must see the same batch and sequence lengths (same tokenizer)."
            )
        sinks_t = None if t.sinks is None else to_device(t.sinks, device)
        sinks_s = s.sinks
        if relation == "qk" and (sinks_t is None) != (sinks_s is None):
            side, other = ("teacher", "student") if sinks_t is not None else ("student", "teacher")
            raise ValueError(
                f"StreamKL {label}: the {side} layer has attention sinks and the {other} layer has none; the sink's "
                "probability mass would have no counterpart. Pair layers that both have sinks or both have none."
            )
        causal = self._causality(label, pair, t, s)
        n_k = k_t.shape[2]
        masking = self._masking(label, t, s, causal, key_padding_mask, query_mask, b_t, n_qt, n_k, device)
        scale_t, scale_s, softcap_t, softcap_s = t.scale, s.scale, t.softcap, s.softcap
        if relation != "qk":
            if masking.attn_mask is not None and masking.attn_mask.shape[1] != 1:
                raise ValueError(
                    f"StreamKL {label}, relation {relation!r}: the layers' attention mask differs per head, and a "
                    "relation's heads are not the layer's heads; use relations=['qk'] for this pair."
                )
            q_t, k_t, q_s, k_s = self._relation_inputs(pair, label, relation, t, s, q_t, k_t, q_s, k_s)
            # softmax(x xᵀ / sqrt(d_r)) over the keys the layer allows: the scale, soft-cap and sinks belong to q kᵀ
            scale_t = scale_s = softcap_t = softcap_s = sinks_t = sinks_s = None
        elif h_t != h_s:
            if masking.attn_mask is not None and masking.attn_mask.shape[1] != 1:
                raise ValueError(
                    f"StreamKL {label}: the layers have {h_t} and {h_s} query heads and a per-head attention mask; "
                    "head_map='group' cannot map a per-head mask. Pair layers with equal head counts."
                )
            q_t, q_s, sinks_t, sinks_s = self._map_heads(pair, label, q_t, q_s, sinks_t, sinks_s)
        if k_t.dtype != q_t.dtype:
            k_t = k_t.to(q_t.dtype)
        if k_s.dtype != q_s.dtype:
            k_s = k_s.to(q_s.dtype)
        options = AttentionKLOptions(
            scale_t=scale_t, scale_s=scale_s, softcap_t=softcap_t, softcap_s=softcap_s,
            temperature=pair.temperature if pair.temperature is not None else cfg.temperature,
            direction=pair.direction or cfg.direction, backend=cfg.backend,
        )
        return TermCall(q_t, k_t, q_s, k_s, masking, sinks_t, sinks_s, options)

    def _relation_inputs(self, pair: LayerPair, label: str, relation: str, t: CapturedAttention,
                         s: CapturedAttention, q_t: torch.Tensor, k_t: torch.Tensor, q_s: torch.Tensor,
                         k_s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x_t, x_t, x_s, x_s)``: one side's queries, keys or values re-split into the relation heads, as both
        the queries and the keys of its relation ``softmax(x xᵀ / sqrt(d_r))``."""
        if q_t.shape[2] != k_t.shape[2]:
            raise ValueError(
                f"StreamKL {label}: the relation {relation!r} compares a layer's tokens with themselves, so it needs "
                f"self-attention (as many queries as keys), but the layers have N_q={q_t.shape[2]} and "
                f"N_k={k_t.shape[2]}; use relations=['qk'] for this pair."
            )
        heads = pair.relation_heads or self.config.relation_heads or q_s.shape[1]
        if relation == "qq":
            x_t, x_s = q_t, q_s
        elif relation == "kk":
            x_t, x_s = k_t, k_s
        else:
            for rec, side in ((t, "teacher"), (s, "student")):
                if getattr(rec, "v", None) is None:
                    raise ValueError(
                        f"StreamKL {label}: the value relation 'vv' needs the {side} layer's values, but its record "
                        "holds none. A capture keeps them only when made with capture_values=True (the engine, "
                        "callback and mixin ask for them when a pair compares 'vv'; by hand: build_capture(..., "
                        "capture_values=True)), and a custom attention must hand them over with record(self, q, k, "
                        "v=v); or drop 'vv' from the pair's relations."
                    )
            x_t, x_s = to_device(t.v, q_s.device), s.v  # type: ignore[union-attr]
            if x_t.dim() != 4 or x_s.dim() != 4 or x_t.shape[2] != q_t.shape[2] or x_s.shape[2] != q_s.shape[2]:
                raise ValueError(
                    f"StreamKL {label}: expected 4-d [B, H, N, D] values with the layers' N={q_t.shape[2]} tokens, "
                    f"but got teacher v {tuple(x_t.shape)} and student v {tuple(x_s.shape)}."
                )
        what = {"qq": "queries", "kk": "keys", "vv": "values"}[relation]
        try:
            x_t = relation_heads_split(x_t, heads, what=f"teacher {what}")
            x_s = relation_heads_split(x_s, heads, what=f"student {what}")
        except ValueError as err:
            raise ValueError(f"StreamKL {label}, relation {relation!r}: {err} Set `relation_heads` (of the pair or "
                             "the config) to a common divisor.") from None
        return x_t, x_t, x_s, x_s

    def _causality(self, label: str, pair: LayerPair, t: CapturedAttention, s: CapturedAttention) -> bool:
        causal = pair.causal if pair.causal is not None else self.config.causal
        if causal is not None:
            return bool(causal)
        if t.causal is not None and s.causal is not None and t.causal != s.causal:
            raise ValueError(
                f"StreamKL {label}: the teacher layer is {'causal' if t.causal else 'bidirectional'} but the "
                f"student layer is {'causal' if s.causal else 'bidirectional'}; set `causal` in the pair or the "
                "config to choose one masking for both."
            )
        causal = t.causal if t.causal is not None else s.causal
        if causal is None:
            raise ValueError(
                f"StreamKL {label}: neither capture knows whether the layers are causal; pass causal= to "
                "record() or set `causal` in the pair or the config."
            )
        return bool(causal)

    def _masking(self, label: str, t: CapturedAttention, s: CapturedAttention, causal: bool,
                 key_padding_mask: torch.Tensor | None, query_mask: torch.Tensor | None, batch: int, n_q: int,
                 n_k: int, device: torch.device) -> Masking:
        """The one mask of the pair: each side's own, which must allow the same keys for every counted row."""
        (mt, legacy_t), (ms, legacy_s) = (
            self._side(label, rec, key_padding_mask, query_mask, batch, n_q, n_k, device, causal) for rec in (t, s))
        qm = self._both(mt.query_mask, ms.query_mask)
        if legacy_t or legacy_s:  # a record without its call's masks: the batch's padding fills in, combined
            kpm = self._both(mt.key_padding_mask, ms.key_padding_mask)
            rows = next((m.key_rows for m in (mt, ms) if m.key_padding_mask is kpm), None)
            mt, ms = (replace(m, key_padding_mask=kpm, key_rows=rows) for m in (mt, ms))
        same = mt.window == ms.window and self._same_keys(mt, ms) and \
            self._same_mask(mt.attn_mask, ms.attn_mask) and (
                (mt.packed is None and ms.packed is None)
                or (mt.packed is not None and ms.packed is not None and mt.packed.same_as(ms.packed)))
        if not same:  # described differently: compare the keys each counted row sees
            dt, ds = (dense_allowed(replace(m, query_mask=qm), batch, n_q, n_k, device, causal) for m in (mt, ms))
            if not same_mask(dt, ds):
                raise ValueError(
                    f"StreamKL {label}: the two layers attend to different keys (teacher: {mt.summary()}; student: "
                    f"{ms.summary()}). The KL compares two distributions over the same keys, so both layers must "
                    f"allow the same keys for every query row.{_mismatch_hint(mt, ms)}"
                )
        return replace(mt, causal=causal, query_mask=None if mt.packed is not None else qm)

    def _both(self, a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
        """The entries both optional bool masks keep (``None`` keeps everything). Within one call of the loss the
        same two masks give the same tensor (every layer of a model reads one mask), so the terms that share them
        can fuse (:func:`~lightning_streamkl.terms.run_terms`)."""
        if a is None or b is None or a is b:
            return a if b is None else b
        return self._per_call("both", a, b, lambda: a & b.to(a.device))

    def _same_keys(self, a: Masking, b: Masking) -> bool:
        """Whether the key padding of ``a`` and ``b`` keeps the same keys: from the rows each capture read on the host
        where both are runs (a right- or left-padded batch: no synchronisation), else :meth:`_same_mask`."""
        on_host = same_keys_on_host(a, b)
        return self._same_mask(a.key_padding_mask, b.key_padding_mask) if on_host is None else on_host

    def _same_mask(self, a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
        """:func:`~lightning_streamkl.capture.masks.same_mask`, compared once per call of the loss for each two
        masks (a comparison reads the result on the host: one synchronisation per step, not one per pair)."""
        if a is b:
            return True
        if a is None or b is None:
            return same_mask(a, b)
        return self._per_call("same", a, b, lambda: same_mask(a, b))

    def _per_call(self, what: str, a: torch.Tensor, b: torch.Tensor, compute):
        key = (what, id(a), id(b))
        if key not in self._memo:  # (a and b are kept alive with the result: their ids stay theirs)
            self._memo[key] = (a, b, compute())
        return self._memo[key][2]

    def _side(self, label: str, rec: CapturedAttention, key_padding_mask: torch.Tensor | None,
              query_mask: torch.Tensor | None, batch: int, n_q: int, n_k: int, device: torch.device,
              causal: bool) -> tuple[Masking, bool]:
        """One record's masks on ``device`` (the batch's fill in for a record without its call's masks), and whether
        it is such a record."""
        def move(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else to_device(x.bool(), device)

        m = rec.masking()
        kpm, qm = move(m.key_padding_mask), move(m.query_mask) if self.config.mask_queries else None
        if not rec.masks_from_call:
            if kpm is None and key_padding_mask is not None:
                if tuple(key_padding_mask.shape) != (batch, n_k):
                    raise ValueError(
                        f"StreamKL {label}: the batch's padding mask has shape {tuple(key_padding_mask.shape)}, but "
                        f"the layers have B={batch} and N_k={n_k}."
                    )
                kpm = move(key_padding_mask)
            qm = move(query_mask) if query_mask is not None and tuple(query_mask.shape) == (batch, n_q) else None
        rows = m.key_rows if m.key_padding_mask is not None else None  # (the rows of the record's own mask)
        packed = None if m.packed is None else m.packed.to(device)
        window = canonical_window(m.window, causal, n_q, n_k, kpm, packed, None if rows is None else rows.span)
        return Masking(causal, window, kpm, qm, packed, move(m.attn_mask), rows), not rec.masks_from_call

    def _map_heads(self, pair: LayerPair, label: str, q_t: torch.Tensor, q_s: torch.Tensor,
                   sinks_t: torch.Tensor | None = None, sinks_s: torch.Tensor | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        h_t, h_s = q_t.shape[1], q_s.shape[1]
        mode = pair.head_map or self.config.head_map
        if mode == "error":
            raise ValueError(
                f"StreamKL {label}: the teacher layer has {h_t} query heads and the student layer {h_s}; "
                "attention_kl compares head by head. Pair layers with equal head counts, or set head_map='group' "
                "(when one count is a multiple of the other) to compare each head with its group's head."
            )
        big, small = max(h_t, h_s), min(h_t, h_s)
        if big % small:
            raise ValueError(
                f"StreamKL {label}: head_map='group' needs one head count to be a multiple of the other, but the "
                f"teacher layer has {h_t} query heads and the student layer {h_s}."
            )

        # Repeat the queries (and sinks) of the side with fewer heads; its keys keep their heads, since the op maps
        # query head h to key head h // (H // H_k), which is the right key head for the repeated query.
        def repeat(x: torch.Tensor | None, dim: int) -> torch.Tensor | None:
            return None if x is None else x.repeat_interleave(big // small, dim=dim)

        if h_t < h_s:
            return repeat(q_t, 1), q_s, repeat(sinks_t, 0), sinks_s
        return q_t, repeat(q_s, 1), sinks_t, repeat(sinks_s, 0)


class LossStream:
    """One batch's :class:`AttentionDistillationLoss`, taken pair by pair: :meth:`add` runs the terms of the pairs a
    teacher record completes as soon as it is made, so that the engine can drop both layers' captures while the
    teacher is still running (with a frozen teacher the op then keeps only the student's gradients, see
    :func:`streamkl.dispatch.gradients_ahead`); :meth:`finish` runs the rest and returns the
    :class:`LossOutput`, the same as the whole loss on all the records. Terms that would fuse with others
    (``fuse_pairs``, launch-bound sizes: :func:`~lightning_streamkl.terms.run_terms`) wait for :meth:`finish`, so they
    still run as one call. Made by :meth:`AttentionDistillationLoss.stream`.

    Example:
        >>> from lightning_streamkl.capture import RecorderCapture
        >>> loss_fn = AttentionDistillationLoss({"pairs": [{"teacher": "a", "student": "b"}], "causal": True,
        ...                                      "fuse_pairs": False})
        >>> recorder = lambda name: RecorderCapture(nn.Identity(), names=[name])
        >>> _ = loss_fn.resolve(recorder("a"), recorder("b"))
        >>> q = torch.randn(1, 2, 8, 16, requires_grad=True)
        >>> stream = loss_fn.stream()
        >>> stream.add("a", CapturedAttention(q.detach(), q.detach()), {"b": CapturedAttention(q, q)})
        (True, ['b'])
        >>> out = stream.finish({}, {})   # both records are released: the pair already ran
        >>> round(float(out.total), 6), out.total.requires_grad
        (0.0, True)
    """

    def __init__(self, loss: AttentionDistillationLoss, resolved: list[_ResolvedPair],
                 key_padding_mask: torch.Tensor | None, query_mask: torch.Tensor | None) -> None:
        self.loss, self.resolved = loss, resolved
        self.key_padding_mask, self.query_mask = key_padding_mask, query_mask
        #: The grad mode of the step: the terms :meth:`add` runs inside the teacher's ``no_grad`` pass use it.
        self.grad = torch.is_grad_enabled()
        # each pair's first index into the loss's terms (pair_names: a pair's relations, in order)
        self.first_term = [sum(len(_relations(r.pair, loss.config)) for r in resolved[:i])
                           for i in range(len(resolved))]
        self.taken: set[int] = set()  # the pairs whose calls are made
        self.seen: dict[str, set[str]] = {"teacher": set(), "student": set()}  # layers add() was handed
        self.waiting: list[tuple[int, TermCall]] = []  # (term index, call) left for finish(): they fuse
        self.results: list[tuple[list[int], TermResult]] = []  # (term indices, result)
        loss.precisions = {}

    def _take(self, i: int, t: CapturedAttention, s: CapturedAttention) -> None:
        r, cfg = self.resolved[i], self.loss.config
        with torch.set_grad_enabled(self.grad):  # (head mapping and relation heads are differentiable too)
            calls = [self.loss._term_call(r, t, s, self.key_padding_mask, self.query_mask, relation)
                     for relation in _relations(r.pair, cfg)]
            terms = [self.first_term[i] + j for j in range(len(calls))]
            for term, call in zip(terms, calls):
                self.loss.precisions[self.loss.pair_names[term]] = call.precision()
            self.taken.add(i)
            if cfg.fuse_pairs and any(call.fuse_key() is not None for call in calls):
                self.waiting.extend(zip(terms, calls))
            else:
                self._run(terms, calls, fuse=cfg.fuse_pairs)

    def _run(self, terms: list[int], calls: list[TermCall], *, fuse: bool) -> None:
        for result in run_terms(calls, fuse=fuse):
            self.results.append(([terms[j] for j in result.indices], result))

    def add(self, teacher_layer: str, record: CapturedAttention,
            student_records: Mapping[str, CapturedAttention]) -> tuple[bool, list[str]]:
        """Take every pair of ``teacher_layer`` whose student layer is in ``student_records``: run its terms now, or
        make them and leave them to :meth:`finish` when they fuse. Returns whether every pair of that teacher layer is
        taken, and the student layers whose pairs all are (their records are no longer needed)."""
        self.seen["teacher"].add(teacher_layer)
        self.seen["student"].update(student_records)
        for i, r in enumerate(self.resolved):
            if r.teacher == teacher_layer and i not in self.taken and r.student in student_records:
                self._take(i, record, student_records[r.student])
        teacher_done = all(i in self.taken for i, r in enumerate(self.resolved) if r.teacher == teacher_layer)
        students_done = {r.student for r in self.resolved} - {
            r.student for i, r in enumerate(self.resolved) if i not in self.taken}
        return teacher_done, sorted(students_done)

    def finish(self, teacher_records: Mapping[str, CapturedAttention],
               student_records: Mapping[str, CapturedAttention]) -> LossOutput:
        """Run the pairs :meth:`add` has not run, from these records, and the terms left to fuse; return the loss.

        Raises:
            RuntimeError, ValueError: as :meth:`AttentionDistillationLoss.__call__`.
        """
        loss = self.loss
        try:
            for i, r in enumerate(self.resolved):
                if i not in self.taken:
                    self._take(i, _lookup(teacher_records, r.teacher, "teacher", r.pair.label, self.seen["teacher"]),
                               _lookup(student_records, r.student, "student", r.pair.label, self.seen["student"]))
            if self.waiting:
                terms, calls = zip(*self.waiting)
                self.waiting = []
                self._run(list(terms), list(calls), fuse=loss.config.fuse_pairs)
        finally:
            loss._memo.clear()
        count = len(loss.pair_names)
        means: list[torch.Tensor | None] = [None] * count
        sums: list[torch.Tensor | None] = [None] * count
        rows: list[torch.Tensor | None] = [None] * count
        total = None
        for terms, result in self.results:
            group_means = result.kl_sums / result.rows.clamp_min(1.0)
            weights = [loss.weights[i] for i in terms]
            if len(set(weights)) == 1:  # one product for the group (uniform_pairs, last_k_pairs: equal weights)
                term = (group_means.sum() if len(weights) > 1 else group_means[0]) * weights[0]
            else:
                term = sum(group_means[j] * w for j, w in enumerate(weights))
            total = term if total is None else total + term
            detached = result.kl_sums.detach().float()
            for j, i in enumerate(terms):
                means[i], sums[i], rows[i] = group_means[j], detached[j], result.rows
        assert total is not None
        per_pair = dict(zip(loss.pair_names, means))
        return LossOutput(total, per_pair, torch.stack(sums), torch.stack(rows))  # type: ignore[arg-type]


def _mismatch_hint(t: Masking, s: Masking) -> str:
    if t.window != s.window:
        return (" Their sliding windows differ: pair layers with the same window (e.g. the global-attention layers of"
                " a model that alternates local and global layers with global layers of the other).")
    if (t.packed is None) != (s.packed is None):
        return (" One sees packed documents and the other one sequence per row: transformers builds the packed-"
                "document mask of sdpa and eager only when the model runs without a cache, so call both models with"
                " use_cache=False (the teacher's default forward does), or give both the same attention_mask.")
    return ""


def _lookup(records: Mapping[str, CapturedAttention], name: str, side: str, label: str,
            taken: Iterable[str] = ()) -> CapturedAttention:
    """``records[name]``, or the error naming what was recorded (``taken``: layers recorded and already used)."""
    if name in records:
        return records[name]
    recorded = sorted(set(records) | taken)
    near = closest(name, recorded)
    hint = f" Closest: {near}." if near else ""
    raise RuntimeError(
        f"StreamKL pair {label!r}: the {side} layer {name!r} was not recorded during the {side}'s forward pass "
        f"(recorded: {recorded}).{hint} Check the layer path, that the layer runs on this batch, and for "
        "custom modules that they call lightning_streamkl.capture.record()."
    )




def weighted_sum(outputs: list[LossOutput], weights: list[float]) -> LossOutput:
    """``Σ_k weights_k · outputs_k`` of loss outputs computed on the same batch (e.g. one per teacher); the row
    counts are those of the first (the same batch and masks give the same counts).

    Example:
        >>> one = LossOutput(torch.tensor(1.0), {"p": torch.tensor(1.0)}, torch.tensor([4.0]), torch.tensor([4.0]))
        >>> two = LossOutput(torch.tensor(3.0), {"p": torch.tensor(3.0)}, torch.tensor([12.0]), torch.tensor([4.0]))
        >>> out = weighted_sum([one, two], [0.75, 0.25])
        >>> float(out.total), float(out.per_pair["p"]), out.kl_sums.tolist(), out.rows.tolist()
        (1.5, 1.5, [6.0], [4.0])
    """
    if len(outputs) != len(weights) or not outputs:
        raise ValueError(f"Expected one weight per output (and at least one), but got {len(weights)} weights for "
                         f"{len(outputs)} outputs.")
    if len(outputs) == 1 and weights[0] == 1.0:
        return outputs[0]
    total = sum(w * o.total for w, o in zip(weights, outputs))
    per_pair = {k: sum(w * o.per_pair[k] for w, o in zip(weights, outputs)) for k in outputs[0].per_pair}
    kl_sums = sum(w * o.kl_sums for w, o in zip(weights, outputs))
    return LossOutput(total, per_pair, kl_sums, outputs[0].rows)  # type: ignore[arg-type]
