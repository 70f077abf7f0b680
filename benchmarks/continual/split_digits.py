"""Split-Digits: the continual-learning benchmark of the attention regulariser against the standard baselines.

Five tasks of two digit classes (``digits.py``), learned one ``trainer.fit`` per task by a small vision transformer,
in the task-incremental and the class-incremental setting, with

- ``finetune``: nothing against forgetting;
- ``ewc``, ``lwf``, ``replay`` (a reservoir buffer of 50 images), ``joint`` (the union of the tasks so far: the upper
  bound): the baselines (``baselines.py``);
- ``attention``: :class:`lightning_streamkl.ContinualAttentionRegularizer` toward the previous task's snapshot;
- ``attention+lwf``, ``attention+replay``: the regulariser on top of a baseline.

Protocol: λ of EWC, LwF and the regulariser is chosen per setting on the tuning seeds (a validation split carved out
of the training examples; ``tune``), then every method runs on the evaluation seeds × the three class orders
(``run``). Every run is appended to ``benchmarks/results/split_digits/runs.jsonl`` as it finishes, so an interrupted
command resumes where it stopped; ``report`` rebuilds the summary, the paired tests, the docs tables and the plots
from that file alone::

    python benchmarks/continual/split_digits.py tune
    python benchmarks/continual/split_digits.py run
    python benchmarks/continual/split_digits.py report
    python benchmarks/continual/split_digits.py smoke        # every method, 2 tasks × 3 steps (CI)

One core (``torch.set_num_threads(1)``), one run at a time. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from typing import Any

import lightning as L
import torch
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from common import write_blocks  # noqa: E402
from digits import SplitLearner, TinyViT, split_tasks  # noqa: E402
from runs_file import append, fingerprint, load_runs, run_key, unique, wait_for  # noqa: E402
from stats import compute as paired_compute  # noqa: E402
from stats import markdown as paired_markdown  # noqa: E402
from stats import mean_std, p_text, quiet  # noqa: E402

CONFIG = os.path.join(HERE, "split_digits.yaml")
OUT = os.path.join(ROOT, "benchmarks", "results", "split_digits")
DOC = os.path.join(ROOT, "docs", "guides", "continual.md")
IMG = os.path.join(ROOT, "docs", "img", "split_digits.png")
#: the options a tuning grid can set, and the method tuned alone for each
TUNED = {"ewc_weight": "ewc", "lwf_weight": "lwf", "attention_weight": "attention"}
#: (method, baseline) pairs tested, within each setting
COMPARISONS = (("attention", "finetune"), ("ewc", "finetune"), ("lwf", "finetune"), ("replay", "finetune"),
               ("attention", "ewc"), ("attention", "lwf"), ("attention+lwf", "lwf"),
               ("attention+replay", "replay"))
#: metric -> (name, higher is better)
METRICS = {"final_accuracy": ("average accuracy", True), "forgetting": ("forgetting", False),
           "bwt": ("backward transfer", True), "learning_accuracy": ("accuracy right after learning", True)}


# ---------------------------------------------------------------------------------------------- metrics
def metrics(matrix: list[list[float | None]]) -> dict[str, float]:
    """Average accuracy at the end, average forgetting (Chaudhry et al. 2018), backward transfer (Lopez-Paz &
    Ranzato 2017), the accuracy right after learning each task, and the first task's final accuracy, from the
    accuracy matrix ``R[i][j]`` (task ``i`` after training task ``j``).

    Example:
        >>> m = metrics([[1.0, 0.5, 0.25], [None, 0.75, 0.5], [None, None, 1.0]])
        >>> m["final_accuracy"], m["forgetting"], m["bwt"], m["learning_accuracy"]
        (0.5833333333333334, 0.5, -0.5, 0.9166666666666666)
    """
    num = len(matrix)
    last = num - 1
    final = [matrix[i][last] for i in range(num)]
    forgetting = [max(matrix[i][j] for j in range(i, last)) - matrix[i][last] for i in range(last)]
    return {"final_accuracy": sum(final) / num,
            "forgetting": sum(forgetting) / len(forgetting) if forgetting else 0.0,
            "bwt": sum(matrix[i][last] - matrix[i][i] for i in range(last)) / last if last else 0.0,
            "learning_accuracy": sum(matrix[j][j] for j in range(num)) / num,
            "first_task_final": matrix[0][last]}


# ---------------------------------------------------------------------------------------------- one run
def options_of(cfg: dict[str, Any], method: str, setting: str, chosen: dict[str, dict[str, float]] | None,
               ) -> dict[str, Any]:
    """The options of ``method`` in ``setting``: the config's ``method_options``, with ``tuned`` replaced by the
    tuning's choice (``chosen[setting][option]``)."""
    out = {}
    for key, value in cfg["method_options"][method].items():
        if value == "tuned":
            if not chosen or key not in chosen.get(setting, {}):
                raise ValueError(f"{method} takes {key} from the tuning, which has not chosen it for {setting}; run "
                                 "`split_digits.py tune` first.")
            value = chosen[setting][key]
        out[key] = value
    return out


class SnapshotMemory(L.Callback):
    """What the regulariser's snapshots hold at the end of each fit (after the snapshot in use has been trimmed,
    before the next one replaces it)."""

    def __init__(self, regularizer: Any) -> None:
        self.regularizer = regularizer
        self.memory: list[dict[str, Any]] = []

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.memory = self.regularizer.snapshot_memory()


def run_one(cfg: dict[str, Any], setting: str, method: str, seed: int, order: int, options: dict[str, Any], *,
            validation: bool = False) -> dict[str, Any]:
    """Learn the task sequence once; returns the accuracy matrix, the seconds and steps of every fit, and what the
    snapshots held (attention methods)."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_streamkl import ContinualAttentionRegularizer

    quiet()
    torch.set_num_threads(1)
    tasks = split_tasks(cfg["orders"][order], seed, test_fraction=cfg["test_fraction"],
                        validation=validation)[: cfg["tasks"]]
    torch.manual_seed(seed)
    net = TinyViT(**cfg["model"])
    learner = SplitLearner(net, tasks, setting, lr=cfg["lr"], ewc_weight=options.get("ewc_weight", 0.0),
                           lwf_weight=options.get("lwf_weight", 0.0), lwf_temperature=cfg["lwf_temperature"],
                           replay=cfg["replay"]["capacity"] if options.get("replay") else 0,
                           replay_batch=cfg["replay"]["batch_size"], seed=seed)
    callbacks, probe = [], None
    if options.get("attention_weight", 0.0) > 0:
        reg = ContinualAttentionRegularizer(weight=options["attention_weight"], **cfg.get("attention_options", {}))
        probe = SnapshotMemory(reg)
        callbacks = [reg, probe]
    num = len(tasks)
    matrix: list[list[float | None]] = [[None] * num for _ in range(num)]
    seconds, memory = [], []
    for j in range(num):
        parts = tasks[: j + 1] if options.get("joint") else [tasks[j]]
        x, y, t = (torch.cat(c) for c in zip(*(task.train for task in parts)))
        loader = DataLoader(TensorDataset(x, y, t), batch_size=cfg["batch_size"], shuffle=True,
                            generator=torch.Generator().manual_seed(1000 * seed + 10 * order + j))
        trainer = L.Trainer(max_steps=cfg["steps_per_task"], accelerator="cpu", devices=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=callbacks)
        start = time.perf_counter()
        trainer.fit(learner, loader)
        seconds.append(time.perf_counter() - start)
        if probe is not None and probe.memory:
            memory.append(probe.memory)
        learner.end_task()
        for i in range(j + 1):
            matrix[i][j] = learner.accuracy(i)
    return {"setting": setting, "method": method, "options": options, "seed": seed, "order": order,
            "validation": validation, "matrix": matrix, "fit_seconds": seconds, "steps": cfg["steps_per_task"],
            "snapshot_memory": memory}


# ---------------------------------------------------------------------------------------------- the runs file
def config_key(cfg: dict[str, Any]) -> str:
    """A fingerprint of everything that changes a run's outcome (not the seeds, orders, methods or grid lists)."""
    return fingerprint(cfg, ("model", "test_fraction", "tasks", "steps_per_task", "batch_size", "lr",
                             "lwf_temperature", "replay", "orders", "attention_options"))


def execute(cfg: dict[str, Any], jobs: list[tuple[str, str, int, int, dict[str, Any], bool]], path: str,
            shard: tuple[int, int] = (0, 1)) -> None:
    """Run the jobs not yet in ``path`` (same config fingerprint), appending each run as it finishes; with
    ``shard=(i, n)`` only every ``n``-th of them, from the ``i``-th (``n`` processes share the work)."""
    key = config_key(cfg)
    done = {run_key(r) for r in load_runs(path) if r.get("config") == key}
    pending = [j for j in jobs if run_key({"setting": j[0], "method": j[1], "seed": j[2], "order": j[3],
                                           "options": j[4], "validation": j[5]}) not in done]
    todo = pending[shard[0]::shard[1]]
    print(f"{len(jobs)} runs, {len(jobs) - len(pending)} already in {os.path.relpath(path, ROOT)}; this process runs "
          f"{len(todo)}", flush=True)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for n, (setting, method, seed, order, options, validation) in enumerate(todo, 1):
        start = time.perf_counter()
        run = run_one(cfg, setting, method, seed, order, options, validation=validation)
        run.update(config=key, date=datetime.now(timezone.utc).strftime("%Y-%m-%d"), device=_device(),
                   torch=torch.__version__.split("+")[0])
        append(path, run)
        m = metrics(run["matrix"])
        print(f"[{n}/{len(todo)}] {setting} {method} {options} seed {seed} order {order}: average accuracy "
              f"{100 * m['final_accuracy']:.1f}% ({time.perf_counter() - start:.1f} s)", flush=True)


# ---------------------------------------------------------------------------------------------- tuning
def tuning_jobs(cfg: dict[str, Any]) -> list[tuple[str, str, int, int, dict[str, Any], bool]]:
    tune = cfg["tuning"]
    jobs = []
    for setting in cfg["settings"]:
        for seed, order in tune["runs"]:
            jobs.append((setting, "finetune", seed, order, {}, True))
            for option, values in tune["grid"].items():
                jobs += [(setting, TUNED[option], seed, order, {option: v}, True) for v in values]
    return jobs


def choose(cfg: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per setting and tuned option: the mean validation average accuracy of every λ of the grid, and the choice
    (the best; ties to the smaller λ)."""
    key = config_key(cfg)
    tune = cfg["tuning"]
    runs = unique(runs)
    out: dict[str, Any] = {"criterion": "mean final average accuracy on the validation split of the tuning runs",
                           "runs": tune["runs"], "chosen": {}, "grid": {}}
    for setting in cfg["settings"]:
        base = [metrics(r["matrix"])["final_accuracy"] for r in runs if r["validation"] and r.get("config") == key
                and r["setting"] == setting and r["method"] == "finetune"]
        out["grid"].setdefault(setting, {"finetune": statistics.mean(base) if base else None})
        out["chosen"][setting] = {}
        for option, values in tune["grid"].items():
            scores = {}
            for v in values:
                group = [metrics(r["matrix"])["final_accuracy"] for r in runs if r["validation"]
                         and r.get("config") == key and r["setting"] == setting and r["options"] == {option: v}]
                expected = len(tune["runs"])
                if len(group) != expected:
                    raise ValueError(f"tuning of {option}={v} in {setting}: {len(group)} of {expected} runs; run "
                                     "`split_digits.py tune`.")
                scores[v] = statistics.mean(group)
            best = max(scores.values())
            out["grid"][setting][option] = {str(v): s for v, s in scores.items()}
            out["chosen"][setting][option] = min(v for v, s in scores.items() if s == best)
    return out


# ---------------------------------------------------------------------------------------------- report
def evaluation_jobs(cfg: dict[str, Any], chosen: dict[str, Any]) -> list[tuple[str, str, int, int, dict, bool]]:
    return [(setting, method, seed, order, options_of(cfg, method, setting, chosen), False)
            for setting in cfg["settings"] for method in cfg["methods"] for order in range(len(cfg["orders"]))
            for seed in cfg["seeds"]]


def summarise(cfg: dict[str, Any], runs: list[dict[str, Any]], chosen: dict[str, Any]) -> dict[str, Any]:
    """Mean ± std over seeds × orders of every metric, the mean accuracy matrix, ms per step and snapshot bytes,
    per setting and method, and the paired tests; only the evaluation runs of the planned jobs."""
    key = config_key(cfg)
    runs = unique(runs)
    planned = {run_key({"setting": s, "method": m, "seed": sd, "order": o, "options": op, "validation": v})
               for s, m, sd, o, op, v in evaluation_jobs(cfg, chosen)}
    runs = [r for r in runs if r.get("config") == key and run_key(r) in planned]
    if len({run_key(r) for r in runs}) != len(planned):
        raise ValueError(f"{len(planned) - len({run_key(r) for r in runs})} planned runs are missing; run "
                         "`split_digits.py run`.")
    out: dict[str, Any] = {"runs": len(runs), "settings": {}}
    for setting in cfg["settings"]:
        out["settings"][setting] = {}
        for method in cfg["methods"]:
            group = [r for r in runs if r["setting"] == setting and r["method"] == method]
            ms = [metrics(r["matrix"]) for r in group]
            num = len(group[0]["matrix"])
            entry: dict[str, Any] = {k: mean_std([m[k] for m in ms]) for k in ms[0]}
            entry["options"] = group[0]["options"]
            entry["n"] = len(group)
            entry["matrix_mean"] = [[None if group[0]["matrix"][i][j] is None else
                                     statistics.mean(r["matrix"][i][j] for r in group) for j in range(num)]
                                    for i in range(num)]
            later = [1000 * s / r["steps"] for r in group for s in r["fit_seconds"][1:]]
            entry["ms_per_step_later_tasks"] = statistics.median(later)
            memory = [m for r in group for per_fit in r["snapshot_memory"] for m in per_fit if m["trimmed_tensors"]]
            if memory:
                entry["snapshot_bytes"] = {"held": memory[0]["bytes"], "trimmed": memory[0]["trimmed_bytes"]}
            out["settings"][setting][method] = entry
    tested = [{"scenario": r["setting"], "method": r["method"], "seed": f"{r['seed']}/{r['order']}",
               "matrix": r["matrix"]} for r in runs]
    out["stats"] = paired_compute({"runs": tested}, os.path.join(OUT, "runs.jsonl"), comparisons=COMPARISONS,
                                  metric_fn=metrics, metric_names=METRICS)
    out["stats"]["pairs"] = "seed/order"
    _holm(out["stats"]["comparisons"])
    return out


def _holm(rows: list[dict[str, Any]]) -> None:
    """Holm's step-down adjustment of the paired t-test p-values within each (setting, metric) family."""
    families: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        families.setdefault((row["scenario"], row["metric"]), []).append(row)
    for family in families.values():
        ranked = sorted(family, key=lambda r: 1.0 if r["p_t"] is None else r["p_t"])
        running = 0.0
        for i, row in enumerate(ranked):
            p = 1.0 if row["p_t"] is None else row["p_t"]
            running = max(running, min(1.0, (len(ranked) - i) * p))
            row["p_holm"] = running


def _pm(v: tuple[float, float] | list[float]) -> str:
    return f"{100 * v[0]:.1f} ± {100 * v[1]:.1f}"


def _label(method: str, options: dict[str, Any]) -> str:
    names = {"ewc_weight": "λ", "lwf_weight": "λ", "attention_weight": "λ"}
    parts = [f"{names[k]}={v:g}" for k, v in options.items() if k in names]
    if method in ("attention+lwf",) and len(parts) == 2:
        parts = [f"attention λ={options['attention_weight']:g}", f"lwf λ={options['lwf_weight']:g}"]
    return f"{method} ({', '.join(parts)})" if parts else method


def results_table(results: dict[str, Any], setting: str) -> str:
    """The docs table of one setting: every method's metrics, mean ± std over seeds × orders."""
    s = results["summary"]["settings"][setting]
    cfg = results["config"]
    n = len(cfg["seeds"]) * len(cfg["orders"])
    lines = [f"**{setting}** ({cfg['tasks']} tasks of 2 classes; {len(cfg['seeds'])} seeds × {len(cfg['orders'])} "
             f"class orders = {n} runs per method; accuracies in %, mean ± std over the runs)", "",
             "| method | average accuracy ↑ | forgetting ↓ | backward transfer ↑ | accuracy right after learning ↑ "
             "| ms per step, later tasks |", "|---|---|---|---|---|---|"]
    for method, e in s.items():
        lines.append(f"| {_label(method, e['options'])} | {_pm(e['final_accuracy'])} | {_pm(e['forgetting'])} | "
                     f"{_pm(e['bwt'])} | {_pm(e['learning_accuracy'])} | {e['ms_per_step_later_tasks']:.1f} |")
    return "\n".join(lines)


def stats_table(results: dict[str, Any]) -> str:
    """The paired tests (pairs: seed × order), with Holm's adjustment within each setting and metric."""
    stats = results["summary"]["stats"]
    body = paired_markdown(stats, metric_keys=("final_accuracy", "forgetting", "bwt"), names=METRICS,
                           extra=("p, Holm", lambda e: p_text(e["p_holm"])))
    first = body.split("\n", 1)[0]
    intro = (f"Paired by run (the same seed and class order: same data split, initialisation and batches) over "
             f"{len(stats['seeds'])} pairs of `benchmarks/results/split_digits/runs.jsonl`; differences in points "
             f"(method − baseline), mean ± s.e.; two-sided p-values; *significant* when the paired t-test and the "
             f"exact sign-flip test both give p < {stats['alpha']:g}, *not significant* when both give p ≥ it. "
             f"\"p, Holm\" adjusts the t-test's p for the {len(COMPARISONS)} comparisons of each setting and metric. "
             "Written by `python benchmarks/continual/split_digits.py report`.")
    return body.replace(first, intro, 1)


def tuning_table(results: dict[str, Any]) -> str:
    t = results["tuning"]
    runs = ", ".join(f"seed {s} with order {o}" for s, o in t["runs"])
    lines = [f"Validation average accuracy (%, mean over the tuning runs: {runs}; the validation split is carved out "
             "of the training examples, the test examples are never seen); **bold**: chosen.", "",
             "| setting | option | finetune | λ: validation average accuracy |", "|---|---|---|---|"]
    for setting, grid in t["grid"].items():
        for option, scores in grid.items():
            if option == "finetune":
                continue
            chosen = t["chosen"][setting][option]
            cells = ", ".join((f"**{float(v):g}: {100 * s:.1f}**" if float(v) == chosen else
                               f"{float(v):g}: {100 * s:.1f}") for v, s in scores.items())
            lines.append(f"| {setting} | {option} | {100 * grid['finetune']:.1f} | {cells} |")
    return "\n".join(lines)


def meta_line(results: dict[str, Any]) -> str:
    m = results["meta"]
    return (f"Config `{m['config']}` (fingerprint {m['config_key']}), {m['device']}, torch {m['torch']}, "
            f"{m['eval_seconds'] / 60:.0f} min of training (wall, one thread, a machine shared with other jobs) for "
            f"the {results['summary']['runs']} evaluation runs and {m['tune_seconds'] / 60:.0f} min for the "
            f"{m['tune_runs']} tuning runs, {m['date']}.")


BLOCKS = {
    "split-digits:tuning": tuning_table,
    "split-digits:task-incremental": lambda r: results_table(r, "task-incremental"),
    "split-digits:class-incremental": lambda r: results_table(r, "class-incremental") + "\n\n" + meta_line(r),
    "split-digits:stats": stats_table,
}


def update_docs(results: dict[str, Any], doc: str = DOC) -> None:
    write_blocks(doc, {name: render(results) for name, render in BLOCKS.items()})


def plot(results: dict[str, Any], path: str = IMG) -> None:
    """Per setting: the mean accuracy over the tasks seen so far after each task, and the first task's accuracy
    over the sequence, one line per method (mean over seeds × orders)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = results["summary"]["settings"]
    colors = {"finetune": "#888888", "ewc": "#9467bd", "lwf": "#ff7f0e", "replay": "#8c564b", "joint": "#000000",
              "attention": "#1f77b4", "attention+lwf": "#2ca02c", "attention+replay": "#d62728"}
    fig, axes = plt.subplots(len(settings), 2, figsize=(11, 3.8 * len(settings)), squeeze=False)
    for row, (setting, methods) in enumerate(settings.items()):
        for col, title in enumerate(("mean accuracy on the tasks seen so far", "accuracy on the first task")):
            ax = axes[row][col]
            for method, e in methods.items():
                m = e["matrix_mean"]
                num = len(m)
                ys = [sum(m[i][j] for i in range(j + 1)) / (j + 1) for j in range(num)] if col == 0 else \
                    [m[0][j] for j in range(num)]
                ax.plot(range(1, num + 1), [100 * y for y in ys], marker="o", color=colors.get(method),
                        linestyle="--" if method == "joint" else "-", label=method)
            ax.set_xticks(range(1, num + 1))
            ax.set_xlabel("after training task")
            ax.set_ylabel("%")
            ax.set_title(f"{setting}: {title}", fontsize=10)
            ax.grid(alpha=0.3)
        axes[row][0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build(cfg: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The results file's content (tuning choice, summary, paired tests) from the raw runs alone."""
    tuning = choose(cfg, runs)
    summary = summarise(cfg, runs, tuning["chosen"])
    key = config_key(cfg)
    ours = [r for r in runs if r.get("config") == key]
    evaluated = [r for r in ours if not r["validation"]]
    return {
        "meta": {"config": os.path.relpath(CONFIG, ROOT), "config_key": key, "device": evaluated[0]["device"],
                 "torch": evaluated[0]["torch"], "date": max(r["date"] for r in evaluated),
                 "eval_seconds": sum(sum(r["fit_seconds"]) for r in evaluated),
                 "tune_seconds": sum(sum(r["fit_seconds"]) for r in ours if r["validation"]),
                 "tune_runs": sum(r["validation"] for r in ours)},
        "config": cfg, "tuning": tuning, "summary": summary}


def report(cfg: dict[str, Any], *, docs: bool = True) -> dict[str, Any]:
    """Build the results from the committed runs file (nothing is trained), write them, the docs tables and the
    plot."""
    results = build(cfg, load_runs(os.path.join(OUT, "runs.jsonl")))
    with open(os.path.join(OUT, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    if docs:
        update_docs(results)
        plot(results)
    return results


def _device() -> str:
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), 1 thread"


# ---------------------------------------------------------------------------------------------- main
def smoke(cfg: dict[str, Any], steps: int = 3) -> list[dict[str, Any]]:
    """Every method in both settings on 2 tasks of ``steps`` steps, with the smallest λ of the grid (CI)."""
    small = copy.deepcopy(cfg)
    small.update(tasks=2, steps_per_task=steps)
    chosen = {s: {k: v[0] for k, v in cfg["tuning"]["grid"].items()} for s in cfg["settings"]}
    return [run_one(small, setting, method, 0, order=1, options=options_of(small, method, setting, chosen))
            for setting in cfg["settings"] for method in cfg["methods"]]


def main(argv: list[str] | None = None) -> Any:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("tune", "run", "report", "smoke"))
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--no-docs", action="store_true", help="report: do not rewrite the docs tables and plot")
    parser.add_argument("--shard", default="0/1", help="i/n: run every n-th pending job from the i-th (n processes)")
    args = parser.parse_args(argv)
    shard = tuple(int(x) for x in args.shard.split("/"))
    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    path = os.path.join(OUT, "runs.jsonl")
    if args.command == "smoke":
        for run in smoke(cfg):
            print(run["setting"], run["method"], metrics(run["matrix"]))
        return None
    if args.command == "tune":
        execute(cfg, tuning_jobs(cfg), path, shard)
        if shard[0] != 0:
            return None
        tuning = choose(cfg, load_runs(path))
        print(json.dumps(tuning["chosen"], indent=1))
        return tuning
    if args.command == "run":
        tuning = wait_for(lambda: choose(cfg, load_runs(path)))
        execute(cfg, evaluation_jobs(cfg, tuning["chosen"]), path, shard)
        if shard[0] != 0:
            return None
        wait_for(lambda: summarise(cfg, load_runs(path), tuning["chosen"]))
    results = report(cfg, docs=not args.no_docs)
    for setting in cfg["settings"]:
        print(results_table(results, setting), "\n")
    print(stats_table(results))
    return results


if __name__ == "__main__":
    main()
