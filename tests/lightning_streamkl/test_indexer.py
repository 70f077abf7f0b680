"""Indexer training in Lightning (lightning_streamkl.indexer): the term equals the KL computed from the model's own
attention probabilities in both stages, the main model gets nothing from it, the stages switch at the configured
step, and the callback, the mixin, the config and the recorder behave like their distillation counterparts."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch

pytest.importorskip("transformers")

from lightning_streamkl import AttentionKLOptions
from lightning_streamkl.indexer import (
    IndexerCapture,
    IndexerConfig,
    IndexerDistillation,
    IndexerDistillationMixin,
    IndexerLayer,
    LightningIndexer,
    best_topk_attention_mass,
    indexer_logits,
    indexer_topk,
    record_indexer,
    topk_attention_mass,
    validate_indexer_config,
)
from lightning_streamkl.indexer.config import SHARED_OPTIONS
from lightning_streamkl.indexer.engine import IndexerDistiller
from lightning_streamkl.options import field_check

from ._models import CausalLM, loader, tiny_llama, token_batch, trainer
from .test_callback import Recorder

INDEXER = dict(heads=3, head_dim=16)


def llama_with_indexers(*, seed: int = 0, impl: str = "sdpa", detach_input: bool = True, init: float = 0.3):
    """A tiny Llama (4 heads, 2 key heads, head dim 8) with a LightningIndexer on each attention layer."""
    model = tiny_llama(hidden=32, heads=4, kv_heads=2, layers=2, seed=seed, impl=impl, init=init)
    for layer in model.model.layers:
        LightningIndexer(32, **INDEXER, detach_input=detach_input).attach(layer.self_attn)
    return model


def kl_from_probabilities(probs, logits, allowed, rows):
    """The mean KL of the definition, in float64, from the model's own per-head probabilities ``[B, H, N, N]``
    (renormalised over ``allowed`` per head, then averaged) and the indexer logits ``[B, N, N]``."""
    p_h = probs.detach().double() * allowed[:, None]
    p_h = p_h / p_h.sum(-1, keepdim=True).clamp_min(1e-300)
    p = p_h.mean(1)
    log_q = torch.log_softmax(logits.double().masked_fill(~allowed, -math.inf), -1)
    kl = torch.where(p > 0, p * (p.clamp_min(1e-300).log() - log_q.masked_fill(~allowed, 0.0)), 0.0).sum(-1)
    return float((kl * rows).sum() / rows.sum())


@pytest.mark.parametrize("stage", ["dense", "sparse"])
def test_the_term_is_the_kl_of_the_models_own_attention(stage):
    """Capture + op on an eager Llama with padding equal the KL computed from output_attentions, per layer."""
    model = llama_with_indexers(impl="eager")
    batch = token_batch(2, 12, pad="right")
    distiller = IndexerDistiller({"layers": [0, "model.layers.1.self_attn"], "topk": 4,
                                  "sparse_from_step": 0 if stage == "sparse" else None})
    assert distiller.setup(model) == [("model.layers.0.self_attn", "model.layers.0.self_attn.indexer"),
                                      ("model.layers.1.self_attn", "model.layers.1.self_attn.indexer")]
    with distiller.recording():
        out = model(**batch, output_attentions=True)
    records = dict(distiller.indexer_capture.records)
    terms = distiller.end_step(batch, step=0)

    mask = batch["attention_mask"].bool()
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    for name, (_, indexer), probs in zip(["l0", "l1"], distiller.resolved, out.attentions):
        r = records[indexer]
        allowed = causal[None] & mask[:, None, :]
        if stage == "sparse":
            sel = indexer_topk(r.q_idx, r.k_idx, r.w_idx, 4, key_padding_mask=mask)
            slots = sel.masked_fill(sel < 0, 12)  # an empty slot marks a 13th column, dropped below
            chosen = torch.zeros(2, 12, 13, dtype=torch.bool).scatter_(-1, slots, True)[..., :12]
            assert (chosen.sum(-1) == allowed.sum(-1).clamp_max(4)).all()  # K keys per row, or all it may see
            allowed = allowed & chosen
        expected = kl_from_probabilities(probs, indexer_logits(r.q_idx, r.k_idx, r.w_idx), allowed, mask)
        assert float(terms.per_pair[name].detach()) == pytest.approx(expected, rel=1e-4)
    assert terms.rows.tolist() == [float(mask.sum())] * 2  # padded query rows count for nothing
    assert float(terms.total.detach()) == pytest.approx(sum(float(v.detach()) for v in terms.per_pair.values()),
                                                        rel=1e-6)


def test_only_the_indexers_get_gradients():
    model = llama_with_indexers()
    distiller = IndexerDistiller({"layers": [0, 1], "topk": 4, "sparse_from_step": 1})
    distiller.setup(model)
    for step in (0, 1):  # dense, then sparse
        model.zero_grad()
        with distiller.recording():
            model(**token_batch(2, 10))
        distiller.end_step(token_batch(2, 10), step=step).total.backward()
        for name, p in model.named_parameters():
            if ".indexer." in name:
                assert p.grad is not None and bool(p.grad.abs().sum() > 0), name
            else:
                assert p.grad is None, name


def test_training_the_indexers_lowers_their_kl_in_both_stages():
    model = llama_with_indexers()
    batch = token_batch(2, 16)
    indexers = [p for n, p in model.named_parameters() if ".indexer." in n]
    optimizer = torch.optim.Adam(indexers, lr=0.02)
    distiller = IndexerDistiller({"layers": [0, 1], "topk": 4, "sparse_from_step": 12})
    distiller.setup(model)
    kl = []
    for step in range(24):
        with distiller.recording():
            model(**batch)
        terms = distiller.end_step(batch, step=step)
        optimizer.zero_grad()
        terms.total.backward()
        optimizer.step()
        kl.append(float(terms.total.detach()))
    assert kl[11] < 0.5 * kl[0] and kl[23] < 0.5 * kl[12], kl  # each stage at least halves its KL


def _indexed_lm(seed: int = 1, **indexer_options):
    return CausalLM(llama_with_indexers(seed=seed, init=0.02, **indexer_options), lr=0.01, optimizer="adam")


def test_the_callback_trains_the_indexers_and_leaves_the_main_model_to_its_own_loss():
    """Main model trained by its task loss, with and without the callback: its weights end bit-identical; with the
    callback the indexers are trained, by the indexer loss alone."""
    plain, indexed = _indexed_lm(), _indexed_lm()
    trainer(max_steps=4).fit(plain, loader(16, 4))
    rec = Recorder("train/indexer_kl/l0_step", "train/indexer_kl/total_step", "train/indexer_kl/sparse_step")
    callback = IndexerDistillation(layers=[0, 1], topk=4, sparse_from_step=2, weight=1.0)
    trainer(max_steps=4, callbacks=[callback, rec], log_every_n_steps=1).fit(indexed, loader(16, 4))

    for (name, a), b in zip(plain.named_parameters(), indexed.parameters()):
        if ".indexer." in name:
            assert not torch.equal(a, b), name  # trained by the indexer loss only
        else:
            assert torch.equal(a, b), name  # the indexer loss never reaches the main model
    assert rec.values["train/indexer_kl/sparse_step"] == [0.0, 0.0, 1.0, 1.0]
    # the step's loss is the task loss plus the logged total (weight 1)
    for task, step, total in zip(indexed.task_losses, indexed.step_losses, rec.values["train/indexer_kl/total_step"]):
        assert step == pytest.approx(task + total, rel=1e-5)
    assert callback.state_dict()["train_batches"] == 4


def test_an_indexer_reading_the_models_graph_is_refused():
    model = _indexed_lm(detach_input=False)
    with pytest.raises(ValueError, match=r"depend on parameters of the main model \(model\.model\.embed_tokens"):
        trainer(max_steps=1, callbacks=[IndexerDistillation(layers=[0])]).fit(model, loader(4, 4))
    # with the main model frozen the same indexer is fine: nothing but the indexers can be trained
    model = _indexed_lm(detach_input=False)
    for name, p in model.named_parameters():
        p.requires_grad_(".indexer." in name)
    trainer(max_steps=1, callbacks=[IndexerDistillation(layers=[0])]).fit(model, loader(4, 4))


def test_the_callback_validates_and_logs_epoch_values():
    model = _indexed_lm()
    data = loader(4, 4)
    t = trainer(max_epochs=1, limit_val_batches=None, callbacks=[IndexerDistillation(layers=[-1], name="idx")])
    t.fit(model, data, data)
    assert {"train/idx/l-1_step", "train/idx/l-1_epoch", "train/idx/total_step", "train/idx/total_epoch",
            "train/idx/sparse_step", "val/idx/l-1", "val/idx/total"} <= set(t.callback_metrics)
    assert "train/idx/l-1" not in t.callback_metrics  # one key, one meaning
    assert float(t.callback_metrics["val/idx/l-1"]) > 0


def test_the_callback_state_round_trips():
    cb = IndexerDistillation(layers=[0, 1])
    cb.train_metric.update(torch.tensor([2.0, 1.0]), torch.tensor([4.0, 4.0]))
    state = cb.state_dict()
    resumed = IndexerDistillation(layers=[0, 1])
    resumed.load_state_dict(state)
    assert {k: float(v) for k, v in resumed.train_metric.compute().items()} == {
        "indexer_kl/l0": 0.5, "indexer_kl/l1": 0.25, "indexer_kl/total": 0.75}
    with pytest.warns(UserWarning, match="written with layers"):
        IndexerDistillation(layers=[0]).load_state_dict(state)


class IndexedMixinLM(IndexerDistillationMixin, CausalLM):
    def __init__(self, **options):
        super().__init__(llama_with_indexers(seed=1, init=0.02), lr=0.01, optimizer="adam")
        self.configure_indexer_distillation(layers=[0, 1], **options)

    def training_step(self, batch, batch_idx):
        task = self.model(**batch).loss
        self.task_losses.append(float(task.detach()))
        return task + self.indexer_distillation_loss()

    def validation_step(self, batch, batch_idx):
        self.model(**batch)
        self.indexer_distillation_loss()


def test_the_mixin_matches_the_callback_step_for_step():
    mixed = IndexedMixinLM(topk=4, sparse_from_step=1, weight=0.5)
    trainer(max_steps=2).fit(mixed, loader(8, 4))
    plain = _indexed_lm()
    trainer(max_steps=2, callbacks=[IndexerDistillation(layers=[0, 1], topk=4, sparse_from_step=1, weight=0.5)]).fit(
        plain, loader(8, 4))
    assert mixed.step_losses == pytest.approx(plain.step_losses, rel=1e-6)
    data = loader(4, 4)
    t = trainer(max_epochs=1, limit_val_batches=None)
    t.fit(IndexedMixinLM(), data, data)
    assert {"train/indexer_kl/l0_step", "train/indexer_kl/l0_epoch", "val/indexer_kl/l1",
            "val/indexer_kl/total"} <= set(t.callback_metrics)


def test_the_mixin_says_what_is_missing():
    module = IndexedMixinLM()
    with pytest.raises(RuntimeError, match="capture_indexer_inputs"):
        module.indexer_distillation_loss(token_batch())
    with pytest.raises(RuntimeError, match="configure_indexer_distillation"):
        type("Bare", (IndexerDistillationMixin, CausalLM), {})().indexer_distillation_loss()


# ------------------------------------------------------------------------------------------------ setup errors
def test_a_missing_indexer_is_named_with_the_ones_found():
    model = tiny_llama(hidden=32, heads=4, kv_heads=2)
    model.model.layers[1].self_attn.idx = LightningIndexer(32, **INDEXER)
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.indexer'.*found: \['model.layers.1.self_attn.idx'"):
        IndexerDistiller({"layers": [0]}).setup(model)
    with pytest.raises(ValueError, match="Unknown attention layer of layers"):
        IndexerDistiller({"layers": ["model.layers.0.attn"]}).setup(model)
    # an explicit name is what the indexer records under
    assert IndexerDistiller({"layers": [{"attention": 1, "indexer": "model.layers.1.self_attn.idx"}]}).setup(model)


def test_an_indexer_that_records_nothing_is_reported():
    model = tiny_llama(hidden=32, heads=4, kv_heads=2)
    model.model.layers[0].self_attn.indexer = LightningIndexer(32, **INDEXER)  # a submodule, never run
    distiller = IndexerDistiller({"layers": [0]})
    distiller.setup(model)
    with distiller.recording():
        model(**token_batch())
    with pytest.raises(RuntimeError, match=r"indexer 'model.layers.0.self_attn.indexer' of layer 'l0' recorded "
                                           r"nothing.*record_indexer"):
        distiller.end_step(token_batch(), step=0)
    assert not distiller.recorded  # released anyway


def test_record_indexer_checks_its_arguments_while_recording():
    record_indexer("x", None, None, None)  # not recording: nothing happens, nothing is checked
    with IndexerCapture(torch.nn.Identity()).recording():
        with pytest.raises(TypeError, match=r"`k_idx` of record_indexer to be a floating-point tensor, but got a "
                                            r"torch\.int64 tensor"):
            record_indexer("x", torch.randn(1, 2, 3, 4), torch.zeros(1, 3, 4, dtype=torch.long), torch.randn(1, 3, 2))
        with pytest.raises(ValueError, match=r"`q_idx` of record_indexer to be \[B, N_q, H_I, D_I\] \(layout 'bnhd'\)"):
            record_indexer("x", torch.randn(2, 3, 4), torch.randn(1, 3, 4), torch.randn(1, 3, 2), layout="bnhd")
        with pytest.raises(ValueError, match="`layout` to be one of"):
            record_indexer("x", torch.randn(1, 2, 3, 4), torch.randn(1, 3, 4), torch.randn(1, 3, 2), layout="nhd")


def test_a_length_mismatch_names_the_layer():
    model = tiny_llama(hidden=32, heads=4, kv_heads=2)
    model.model.layers[0].self_attn.indexer = torch.nn.Identity()
    distiller = IndexerDistiller({"layers": [0]})
    distiller.setup(model)
    with distiller.recording():
        model(**token_batch(2, 12))
        record_indexer("model.layers.0.self_attn.indexer", torch.randn(2, 1, 11, 4), torch.randn(2, 11, 4),
                       torch.randn(2, 11, 1))
    with pytest.raises(ValueError, match=r"indexer of layer 'l0' to cover the attention's \[B, N_q, N_k\] = "
                                         r"\[2, 12, 12\]"):
        distiller.end_step(token_batch(2, 12), step=0)


# ------------------------------------------------------------------------------------------------ config
def test_the_shared_options_are_declared_once():
    own = {f.name: f for f in dataclasses.fields(IndexerConfig)}
    base = {f.name: f for f in dataclasses.fields(AttentionKLOptions)}
    for name in SHARED_OPTIONS:  # the same check object and default as the attention-KL options
        assert field_check(own[name]) is field_check(base[name]) and own[name].default == base[name].default, name
    assert set(own) & set(base) == set(SHARED_OPTIONS) | {"name"}  # name: the same check kind, another default
    assert own["name"].default == "indexer_kl"
    documented = inspect.getdoc(IndexerConfig) + inspect.getdoc(IndexerLayer)
    for cls in (IndexerConfig, IndexerLayer):
        for f in dataclasses.fields(cls):
            assert field_check(f) is not None, f"{cls.__name__}.{f.name} has no check"
            assert f"{f.name}:" in documented or f"``{f.name}``" in documented, f"{cls.__name__}.{f.name}"
    callback = inspect.signature(IndexerDistillation).parameters
    assert set(callback) == set(own)
    assert all(callback[n].default == getattr(IndexerConfig(), n) for n in own if n != "layers")


@pytest.mark.parametrize(("raw", "error", "message"), [
    ({"layers": []}, ValueError, "Expected `layers` to be a non-empty list of indexer layers, but got []."),
    ({"layers": [0], "topk": 0}, ValueError, "Expected `topk` to be an int >= 1, but got 0."),
    ({"layers": [0], "sparse_from_step": -1}, ValueError, "Expected `sparse_from_step` to be an int >= 0 or None"),
    ({"layers": [0], "temperature": 2.0}, ValueError, "Unknown key `temperature` in the indexer config."),
    ({"layers": [0], "topk_": 3}, ValueError, "Did you mean `topk`?"),
    ({"layers": [0, 0]}, ValueError, "Expected `layers` to have unique names, but ['l0'] occur more than once"),
    ({"layers": [{"attention": 0, "name": "sparse"}]}, ValueError, "Expected no layer to be named ['sparse']"),
    ({"layers": [{"indexer": "x"}]}, ValueError, "Missing `layers[0].attention`"),
    ({"layers": [{"attention": 0, "weight": -1}]}, ValueError, "Expected `layers[0].weight` to be a finite number"),
    ({"layers": [0], "causal": "yes"}, TypeError, "Expected `causal` to be a bool or None, but got 'yes'."),
    ({"layers": [1.5]}, TypeError, "Expected `layers[0]` to be an IndexerLayer, a mapping of its fields"),
])
def test_bad_configs_name_the_option(raw, error, message):
    with pytest.raises(error) as info:
        validate_indexer_config(raw)
    assert message in str(info.value)


# ------------------------------------------------------------------------------------------------ selection
def test_topk_and_mass_match_the_materialised_forms():
    torch.manual_seed(3)
    b, h, h_kv, n, d, h_i, d_i, k = 2, 4, 2, 23, 8, 3, 5, 6
    q, kk = torch.randn(b, h, n, d), torch.randn(b, h_kv, n, d)
    q_idx, k_idx, w_idx = torch.randn(b, h_i, n, d_i), torch.randn(b, n, d_i), torch.randn(b, n, h_i)
    pad = torch.ones(b, n, dtype=torch.bool)
    pad[1, -5:] = False
    allowed = torch.ones(n, n, dtype=torch.bool).tril()[None] & pad[:, None]
    logits = torch.einsum("bjtd,bsd->btjs", q_idx, k_idx).relu().mul(w_idx[..., None]).sum(2)
    values, expected = logits.masked_fill(~allowed, -math.inf).topk(k, -1)
    expected = expected.masked_fill(values == -math.inf, -1)
    for max_elements in (1, 100, 1 << 20):  # one row per block, a few rows, everything at once
        got = indexer_topk(q_idx, k_idx, w_idx, k, key_padding_mask=pad, max_elements=max_elements)
        assert torch.equal(got, expected)
        assert torch.equal(indexer_topk(q_idx.transpose(1, 2), k_idx, w_idx, k, key_padding_mask=pad,
                                        layout="bnhd", max_elements=max_elements), expected)
    scores = (q @ kk.repeat_interleave(2, 1).transpose(-1, -2) / d ** 0.5).masked_fill(~allowed[:, None], -math.inf)
    p = torch.softmax(scores, -1).nan_to_num(0.0).mean(1)
    mass = p.gather(-1, expected.clamp_min(0)).masked_fill(expected < 0, 0).sum(-1)
    for max_elements in (1, 1 << 20):
        assert torch.allclose(topk_attention_mass(q, kk, expected, key_padding_mask=pad, max_elements=max_elements),
                              mass, atol=1e-6)
        assert torch.allclose(best_topk_attention_mass(q, kk, k, key_padding_mask=pad, max_elements=max_elements),
                              p.topk(k, -1).values.sum(-1), atol=1e-6)
    assert bool((mass <= best_topk_attention_mass(q, kk, k, key_padding_mask=pad) + 1e-6).all())


def test_selection_arguments_are_checked():
    x = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="`topk` to be an int >= 1, but got 0"):
        indexer_topk(x, torch.randn(1, 4, 8), torch.randn(1, 4, 2), 0)
    with pytest.raises(ValueError, match="`max_elements` to be an int >= 1"):
        indexer_topk(x, torch.randn(1, 4, 8), torch.randn(1, 4, 2), 2, max_elements=0)
    with pytest.raises(ValueError, match=r"`topk_indices` to have shape \[B, N_q, K\] = \(1, 4, K\)"):
        topk_attention_mass(x, x, torch.zeros(1, 3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="query heads H=2 to be divisible by the key heads H_kv=3"):
        best_topk_attention_mass(x, torch.randn(1, 3, 4, 8), 2)
    with pytest.raises(ValueError, match="head_dim >= 16"):
        LightningIndexer(32, heads=1, head_dim=8)(torch.randn(1, 4, 32), (torch.ones(1, 4, 16), torch.zeros(1, 4, 16)))


@pytest.mark.parametrize("module", ["config", "capture", "selection", "module", "engine"])
def test_the_indexer_engine_and_below_do_not_import_lightning(module):
    """The indexer package sits at the adapters' layer, but its engine works without Lightning, as the main one."""
    from .test_architecture import GRAPH

    imports = GRAPH[f"lightning_streamkl.indexer.{module}"]
    assert not [t for t, _ in imports if t.split(".")[0] in ("lightning", "pytorch_lightning")]
    adapters = {"lightning_streamkl.indexer.callback", "lightning_streamkl.indexer.mixin", "lightning_streamkl.adapter"}
    assert not [t for t, _ in imports if t in adapters or t.rsplit(".", 1)[0] in adapters]
