"""Train a DeepSeek-V3.2 lightning indexer on a small Llama's own attention, and measure what its top-k keeps.

Three stages, all in Lightning, nothing downloaded:

1. **The base model.** A small Llama (``LlamaForCausalLM`` from a ``LlamaConfig``: RoPE, grouped-query attention)
   learns an in-context lookup task: every sequence draws its own key → value table; most tokens show a (key, value)
   pair, and a query token shows a key alone, whose value the model must name. The answer sits wherever that key
   appeared earlier, anywhere in the context, so the trained attention is sharp and long-range (a randomly
   initialised model's attention is close to uniform, and there would be nothing for an indexer to learn).
2. **The indexers.** A :class:`~lightning_streamkl.LightningIndexer` is attached to every attention layer, the base
   model is frozen, and :class:`~lightning_streamkl.IndexerDistillation` trains the indexers against the main
   attention: a dense warm-up, then the sparse stage over each query's top-``K`` keys by the indexer's own scores.
3. **The measurement.** At several context lengths ``N``, with ``K = N/8``: the share of the main attention's mass
   (head mean, dense) that the indexer's top-``K`` keys capture, before and after training, next to the last ``K``
   keys (a sliding window) and the attention's own top ``K`` (the most any ``K`` keys can capture). Averaged over
   the query rows that see more than ``K`` keys (a row that sees at most ``K`` keeps them all).

    python examples/sparse_indexer.py --threads 1 --output benchmarks/results/indexer_example_cpu.json --docs
    python examples/sparse_indexer.py --config gpu --output benchmarks/results/indexer_example_gpu.json  # one GPU
    python examples/sparse_indexer.py --report benchmarks/results/indexer_example_cpu.json           # table only

``--docs`` replaces the table between the ``indexer-example`` markers of ``docs/guides/indexer.md`` with the run's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_streamkl import HFAttentionCapture, IndexerDistillation, LightningIndexer
from lightning_streamkl.indexer import (
    IndexerCapture,
    best_topk_attention_mass,
    indexer_topk,
    topk_attention_mass,
)
from streamkl import indexer_kl

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "guides" / "indexer.md"
MARKERS = ("<!-- indexer-example:start -->", "<!-- indexer-example:end -->")
IGNORE = -100


@dataclass
class Setup:
    """Every setting of a run (the presets are :data:`CONFIGS`)."""

    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    keys: int = 32  # distinct keys per task (vocabulary: values + keys·values pair tokens + keys query tokens)
    values: int = 8
    query_rate: float = 0.3
    train_lengths: list[int] = field(default_factory=lambda: [64, 128, 256, 512])
    tokens_per_batch: int = 2048  # batch size = tokens_per_batch // N
    base_steps: int = 800
    base_lr: float = 3e-3
    indexer_heads: int = 4
    indexer_dim: int = 32
    dense_steps: int = 150
    sparse_steps: int = 150
    train_topk: int = 64  # K of the sparse training stage (the largest training N / 8)
    indexer_lr: float = 1e-2
    eval_lengths: list[int] = field(default_factory=lambda: [64, 128, 256, 512])
    eval_tokens: int = 16384  # per evaluated N
    seed: int = 0

    @property
    def vocab(self) -> int:
        return self.values + self.keys * self.values + self.keys


CONFIGS = {
    "cpu": Setup(),
    "gpu": Setup(hidden=256, layers=4, heads=8, kv_heads=2, keys=256, values=16, train_lengths=[1024, 2048, 4096, 8192],
                 tokens_per_batch=32768, base_steps=2000, indexer_heads=16, indexer_dim=64, dense_steps=1000,
                 sparse_steps=1000, train_topk=1024, eval_lengths=[1024, 2048, 4096, 8192], eval_tokens=65536),
    "tiny": Setup(hidden=32, heads=2, kv_heads=1, keys=8, values=4, train_lengths=[32, 64], tokens_per_batch=256,
                  base_steps=30, indexer_heads=2, indexer_dim=16, dense_steps=8, sparse_steps=8, train_topk=8,
                  eval_lengths=[32, 64], eval_tokens=256),
}


# ---------------------------------------------------------------------------------------------- the task
def make_batch(setup: Setup, batch_size: int, seq_len: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """One batch of the lookup task: ``input_ids [B, N]`` and ``labels [B, N]`` (the value of a query token's key
    where that key was shown before, as a value token id; :data:`IGNORE` elsewhere).

    >>> b = make_batch(CONFIGS["tiny"], 2, 32, torch.Generator().manual_seed(0))
    >>> tuple(b["input_ids"].shape), bool((b["labels"] != IGNORE).any())
    ((2, 32), True)
    """
    s = setup
    key = torch.randint(0, s.keys, (batch_size, seq_len), generator=generator)
    value = torch.randint(0, s.values, (batch_size, s.keys), generator=generator).gather(1, key)
    query = torch.rand(batch_size, seq_len, generator=generator) < s.query_rate
    pair_id, query_id = s.values + key * s.values + value, s.values + s.keys * s.values + key
    shown = F.one_hot(key, s.keys) * (~query)[..., None]  # [B, N, keys]: a pair showed this key here
    before = (shown.cumsum(1) - shown).gather(2, key[..., None])[..., 0] > 0
    return {"input_ids": torch.where(query, query_id, pair_id),
            "labels": torch.where(query & before, value, torch.full_like(value, IGNORE))}


class LookupBatches(Dataset):
    """``steps`` batches cycling through ``lengths``; batch ``i`` comes from its own seed."""

    def __init__(self, setup: Setup, steps: int, lengths: list[int], seed: int) -> None:
        self.setup, self.steps, self.lengths, self.seed = setup, steps, lengths, seed

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        n = self.lengths[i % len(self.lengths)]
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return make_batch(self.setup, max(1, self.setup.tokens_per_batch // n), n, g)


def loader(setup: Setup, steps: int, seed: int) -> DataLoader:
    return DataLoader(LookupBatches(setup, steps, setup.train_lengths, seed), batch_size=None)


def build_model(setup: Setup):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(setup.seed)
    config = LlamaConfig(hidden_size=setup.hidden, num_hidden_layers=setup.layers, num_attention_heads=setup.heads,
                         num_key_value_heads=setup.kv_heads, intermediate_size=2 * setup.hidden, vocab_size=setup.vocab,
                         max_position_embeddings=max(setup.eval_lengths + setup.train_lengths), pad_token_id=0,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def lookup_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE)


class LookupLM(L.LightningModule):
    """Stage 1: the base model learns the task. Stage 2 (``indexers_only``): the base model is frozen, its task loss
    is still computed and logged, and the optimizer holds the indexers' parameters alone (the callback adds their
    loss)."""

    def __init__(self, model, lr: float, indexers_only: bool = False) -> None:
        super().__init__()
        self.model, self.lr, self.indexers_only = model, lr, indexers_only

    def training_step(self, batch, batch_idx):
        loss = lookup_loss(self.model(input_ids=batch["input_ids"]).logits, batch["labels"])
        self.log("train/task_loss", loss)
        return loss

    def configure_optimizers(self):
        params = [p for n, p in self.model.named_parameters() if (".indexer." in n) == self.indexers_only]
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.0)


class History(L.Callback):
    """Every ``every`` steps, the per-step values (``<prefix><name>_step``) logged under ``prefix``, by name."""

    def __init__(self, prefix: str, every: int = 10) -> None:
        self.prefix, self.every, self.rows = prefix, every, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step % self.every == 0 or step == trainer.max_steps:
            row = {k.removeprefix(self.prefix).removesuffix("_step"): round(float(v), 5)
                   for k, v in trainer.callback_metrics.items() if k.startswith(self.prefix) and k.endswith("_step")}
            self.rows.append({"step": step, **row})


def fit(module: L.LightningModule, data: DataLoader, steps: int, callbacks: list[L.Callback]) -> float:
    t0 = time.time()
    L.Trainer(accelerator="auto", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
              log_every_n_steps=1).fit(module, data)
    return time.time() - t0


# ---------------------------------------------------------------------------------------------- measuring
@torch.no_grad()
def measure(model, setup: Setup, seed: int) -> dict:
    """At every evaluated N (K = N/8): per layer, the mass captured by the indexer's top K, the last K keys and the
    attention's own top K (rows seeing more than K keys), the dense indexer KL; and the task accuracy."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    training = model.training
    model.to(device).eval()
    capture, indexers = HFAttentionCapture(model), IndexerCapture(model)
    paths = capture.layer_names()
    out: dict = {"indexer": {}, "window": {}, "best": {}, "kl": {}, "accuracy": {}}
    for n in setup.eval_lengths:
        k = n // 8
        batch = make_batch(setup, max(1, setup.eval_tokens // n), n, torch.Generator().manual_seed(seed + n))
        batch = {name: x.to(device) for name, x in batch.items()}
        with capture.recording(), indexers.recording():
            logits = model(input_ids=batch["input_ids"]).logits
        scored = batch["labels"] != IGNORE
        out["accuracy"][n] = float((logits.argmax(-1)[scored] == batch["labels"][scored]).float().mean())
        rows = torch.arange(n, device=device) >= k  # rows that see more than K keys
        t = torch.arange(n, device=device)[:, None]
        window = (t - torch.arange(k, device=device)).clamp_min(-1).expand(batch["input_ids"].shape[0], n, k)
        for i, path in enumerate(paths):
            att, ind = capture.records[path], indexers.records[f"{path}.indexer"]
            chosen = indexer_topk(ind.q_idx, ind.k_idx, ind.w_idx, k)
            for name, mass in (("indexer", topk_attention_mass(att.q, att.k, chosen, scale=att.scale)),
                               ("window", topk_attention_mass(att.q, att.k, window, scale=att.scale)),
                               ("best", best_topk_attention_mass(att.q, att.k, k, scale=att.scale))):
                out[name].setdefault(f"l{i}", {})[n] = float(mass[:, rows].mean())
            kl = indexer_kl(att.q, att.k, ind.q_idx, ind.k_idx, ind.w_idx, scale=att.scale, reduction="none")
            out["kl"].setdefault(f"l{i}", {})[n] = float(kl.mean())
        capture.clear()
        indexers.clear()
    model.train(training)
    return out


def run(setup: Setup, config_name: str) -> dict:
    """All three stages; returns the results (what ``--output`` writes)."""
    t_start = time.time()
    L.seed_everything(setup.seed, verbose=False)
    model = build_model(setup)

    base = History("train/", every=50)
    base_s = fit(LookupLM(model, setup.base_lr), loader(setup, setup.base_steps, setup.seed), setup.base_steps,
                 [base])

    torch.manual_seed(setup.seed + 1)
    for layer in model.model.layers:
        LightningIndexer(setup.hidden, heads=setup.indexer_heads, head_dim=setup.indexer_dim).attach(layer.self_attn)
    for name, p in model.named_parameters():
        p.requires_grad_(".indexer." in name)
    before = measure(model, setup, seed=10_000)

    steps = setup.dense_steps + setup.sparse_steps
    callback = IndexerDistillation(layers=list(range(setup.layers)), topk=setup.train_topk,
                                   sparse_from_step=setup.dense_steps)
    history = History("train/indexer_kl/", every=max(1, min(10, steps // 20)))
    indexer_s = fit(LookupLM(model, setup.indexer_lr, indexers_only=True),
                    loader(setup, steps, setup.seed + 1), steps, [callback, history])
    after = measure(model, setup, seed=10_000)
    return {
        "config": config_name,
        "setup": asdict(setup),
        "environment": {"torch": torch.__version__, "threads": torch.get_num_threads(),
                        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else
                        f"CPU ({platform.machine()}, {os.cpu_count()} cores)",
                        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d")},
        "base": {"history": base.rows, "accuracy": after["accuracy"], "wall_s": round(base_s, 1)},
        "indexer": {"history": history.rows, "wall_s": round(indexer_s, 1)},
        "before": {k: before[k] for k in ("indexer", "kl")},
        "after": {k: after[k] for k in ("indexer", "kl")},
        "window": after["window"],
        "best": after["best"],
        "wall_s": round(time.time() - t_start, 1),
    }


# ---------------------------------------------------------------------------------------------- reporting
def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def markdown(results: dict) -> str:
    """The docs' table of a run: per layer and N, the mass each selection captures, and the dense KL."""
    s, env = results["setup"], results["environment"]
    acc = results["base"]["accuracy"]
    lines = [
        f"`--config {results['config']}`: a {s['layers']}-layer Llama (d = {s['hidden']}, {s['heads']} heads, "
        f"{s['kv_heads']} key heads) trained for {s['base_steps']} steps on the lookup task ({s['keys']} keys, "
        f"{s['values']} values), held-out accuracy "
        + ", ".join(f"{_pct(acc[str(n)])} at N = {n}" for n in s["eval_lengths"])
        + f"; one indexer per layer ({s['indexer_heads']} heads of dim {s['indexer_dim']}), {s['dense_steps']} dense "
        f"then {s['sparse_steps']} sparse steps (K = {s['train_topk']}) at N ∈ "
        f"{{{', '.join(map(str, s['train_lengths']))}}}; "
        f"{env['device']}, torch {env['torch']}, {env['threads']} thread(s), {results['wall_s']:.0f} s in all, "
        f"{env['date']}.",
        "",
        "| layer | N | K = N/8 | untrained indexer | trained indexer | last K keys | attention's own top K | "
        "indexer KL, untrained → trained |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for layer in results["after"]["indexer"]:
        for n in s["eval_lengths"]:
            def get(part: dict, layer: str = layer, n: int = n) -> float:
                return part[layer][str(n)]

            lines.append(
                f"| {layer} | {n} | {n // 8} | {_pct(get(results['before']['indexer']))} | "
                f"**{_pct(get(results['after']['indexer']))}** | {_pct(get(results['window']))} | "
                f"{_pct(get(results['best']))} | "
                f"{get(results['before']['kl']):.2f} → {get(results['after']['kl']):.2f} |"
            )
    return "\n".join(lines)


def update_docs(results: dict, doc: Path = DOC) -> None:
    """Replace the table between the ``indexer-example`` markers of ``doc``."""
    text = doc.read_text()
    start, end = MARKERS
    if start not in text or end not in text:
        raise ValueError(f"{doc} has no {start} ... {end} markers")
    head, rest = text.split(start, 1)
    doc.write_text(head + start + "\n" + markdown(results) + "\n" + end + rest.split(end, 1)[1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="cpu", help="the preset (default: cpu)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--output", default=None, help="write the results to this JSON file")
    parser.add_argument("--docs", action="store_true", help="replace the table in docs/guides/indexer.md")
    parser.add_argument("--report", default=None, help="print the table of a results file and exit")
    args = parser.parse_args(argv)
    if args.report:
        results = json.loads(Path(args.report).read_text())
    else:
        if args.threads:
            torch.set_num_threads(args.threads)
        results = run(replace(CONFIGS[args.config]), args.config)
        results = json.loads(json.dumps(results))  # the JSON's own form (string keys), as --report reads it
        if args.output:
            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
            Path(args.output).write_text(json.dumps(results, indent=1) + "\n")
    if args.docs:
        update_docs(results)
    print(markdown(results))
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
