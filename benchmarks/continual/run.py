"""Forgetting benchmark for the continual attention regulariser.

A small transformer learns a sequence of synthetic tasks (``tasks.py``), one ``trainer.fit`` per task, with

- ``finetune``: nothing against forgetting;
- ``attention``: :class:`lightning_streamkl.ContinualAttentionRegularizer` (attention KL toward the previous task's
  snapshot at every attention layer);
- ``lwf``: output distillation toward the previous task's model on the old tasks' heads (Learning without
  Forgetting, the classic baseline);
- ``attention+lwf``: both.

It records the accuracy matrix ``R[i][j]`` (task ``i``'s test accuracy after training task ``j``) for every seed,
and reports final average accuracy, average forgetting and the accuracy right after learning each task (mean ± std
over seeds), as JSON, PNG plots and the markdown table in ``docs/guides/continual.md``::

    python benchmarks/continual/run.py                                        # the CPU config, a few minutes
    python benchmarks/continual/run.py --config benchmarks/continual/gpu.yaml # larger, on a GPU

Nothing is downloaded: the tasks are generated from seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime, timezone
from typing import Any

import torch
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)

from model import ContinualClassifier, TinyTransformer  # noqa: E402
from tasks import CLASSES, make_task, vocab_size  # noqa: E402

WEIGHTS = {"attention_weight": "attention", "lwf_weight": "lwf"}


def methods_of(cfg: dict[str, Any], scenario: str) -> dict[str, dict[str, float]]:
    """The methods of a scenario: the config's ``methods``, with the scenario's own ``methods`` entries on top."""
    methods = {name: dict(options or {}) for name, options in cfg["methods"].items()}
    for name, options in (cfg["scenarios"][scenario].get("methods") or {}).items():
        if name in methods:
            methods[name].update(options or {})
    return methods


# ---------------------------------------------------------------------------------------------- one run
def _quiet() -> None:
    import logging

    from lightning.pytorch.utilities import disable_possible_user_warnings

    disable_possible_user_warnings()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*treespec, LeafSpec.*")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning_streamkl").setLevel(logging.ERROR)


def _setup(cfg: dict[str, Any], scenario: str, method: str, seed: int):
    """The tasks' data, the LightningModule and the callbacks of one run."""
    from lightning_streamkl import ContinualAttentionRegularizer

    options = methods_of(cfg, scenario)[method]
    setting = cfg["scenarios"][scenario]
    names = cfg["tasks"]
    num = len(names)
    data = []
    for i, name in enumerate(names):
        train = make_task(name, i, cfg["train_size"], cfg["length"], vocab=setting["vocab"],
                          seed=10_000 * seed + 2 * i)
        test = make_task(name, i, cfg["test_size"], cfg["length"], vocab=setting["vocab"],
                         seed=10_000 * seed + 2 * i + 1)
        data.append((train, test))
    torch.manual_seed(seed)
    heads = num if setting["heads"] == "per_task" else 1
    net = TinyTransformer(vocab_size(num, setting["vocab"]), heads, CLASSES, **cfg["model"])
    module = ContinualClassifier(net, lr=cfg["lr"], lwf_weight=options.get("lwf_weight", 0.0),
                                 lwf_temperature=cfg.get("lwf_temperature", 2.0))
    callbacks = []
    if options.get("attention_weight", 0.0) > 0:
        callbacks.append(ContinualAttentionRegularizer(weight=options["attention_weight"],
                                                       **cfg.get("attention_options", {})))
    return data, module, callbacks


def _trainer(cfg: dict[str, Any], steps: int, callbacks: list[Any]):
    import lightning as L

    return L.Trainer(max_steps=steps, accelerator=cfg.get("accelerator", "cpu"), devices=1, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=callbacks)


def _loader(x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int):
    from torch.utils.data import DataLoader, TensorDataset

    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True,
                      generator=torch.Generator().manual_seed(seed))


def run_one(cfg: dict[str, Any], scenario: str, method: str, seed: int) -> dict[str, Any]:
    """Train the task sequence once (one ``fit`` per task); return the accuracy matrix and fit times."""
    _quiet()
    torch.set_num_threads(cfg.get("threads_per_run", 1))
    device = torch.device("cuda" if cfg.get("accelerator", "cpu") == "gpu" else "cpu")
    data, module, callbacks = _setup(cfg, scenario, method, seed)
    num = len(data)
    matrix: list[list[float | None]] = [[None] * num for _ in range(num)]
    seconds = []
    for j in range(num):
        (x, y), _ = data[j]
        trainer = _trainer(cfg, cfg["steps_per_task"], callbacks)
        start = time.perf_counter()
        trainer.fit(module, _loader(x, y, cfg["batch_size"], seed * 7919 + j))
        seconds.append(time.perf_counter() - start)
        module.end_task()
        module.to(device)
        for i in range(j + 1):
            _, (xt, yt) = data[i]
            matrix[i][j] = module.accuracy(xt, yt, i)
    return {"scenario": scenario, "method": method, "seed": seed, "matrix": matrix, "fit_seconds": seconds}


def measure_cost(cfg: dict[str, Any], scenario: str, *, steps: int = 40, rounds: int = 3) -> dict[str, float]:
    """Milliseconds per training step of each method in a later task (a snapshot exists), Lightning included.

    The methods take turns, ``rounds`` times, and each keeps its fastest round, so that load from other
    processes affects them alike.
    """
    _quiet()
    torch.set_num_threads(cfg.get("threads_per_run", 1))
    setups = {}
    for method in methods_of(cfg, scenario):
        data, module, callbacks = _setup(cfg, scenario, method, seed=0)
        for reg in callbacks:
            reg.snapshot(module)
        module.end_task()  # now in the second task: every regulariser is active
        setups[method] = (data[1][0], module, callbacks)
    best = {m: float("inf") for m in setups}
    for r in range(rounds + 1):
        for method, ((x, y), module, callbacks) in setups.items():
            trainer = _trainer(cfg, steps, callbacks)
            start = time.perf_counter()
            trainer.fit(module, _loader(x, y, cfg["batch_size"], r))
            if r > 0:  # the first round warms up
                best[method] = min(best[method], 1000 * (time.perf_counter() - start) / steps)
    return best


def _run_one(args: tuple[dict[str, Any], str, str, int]) -> dict[str, Any]:
    return run_one(*args)


# ---------------------------------------------------------------------------------------------- metrics
def metrics(matrix: list[list[float | None]]) -> dict[str, float]:
    """Final average accuracy, average forgetting (Chaudhry et al. 2018) and accuracy right after learning."""
    num = len(matrix)
    final = [matrix[i][num - 1] for i in range(num)]
    forgetting = [max(matrix[i][j] for j in range(i, num - 1)) - matrix[i][num - 1] for i in range(num - 1)]
    return {
        "final_accuracy": sum(final) / num,
        "forgetting": sum(forgetting) / len(forgetting),
        "learning_accuracy": sum(matrix[j][j] for j in range(num)) / num,
        "first_task_final": matrix[0][num - 1],
    }


def mean_std(values: list[float]) -> tuple[float, float]:
    m = sum(values) / len(values)
    s = (sum((v - m) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0
    return m, s


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for run in runs:
        run["metrics"] = metrics(run["matrix"])
    for scenario in dict.fromkeys(r["scenario"] for r in runs):
        out[scenario] = {}
        for method in dict.fromkeys(r["method"] for r in runs):
            group = [r for r in runs if r["scenario"] == scenario and r["method"] == method]
            if not group:
                continue
            entry: dict[str, Any] = {k: mean_std([r["metrics"][k] for r in group]) for k in group[0]["metrics"]}
            num = len(group[0]["matrix"])
            entry["matrix_mean"] = [[None if group[0]["matrix"][i][j] is None else
                                     mean_std([r["matrix"][i][j] for r in group])[0] for j in range(num)]
                                    for i in range(num)]
            entry["seeds"] = len(group)
            out[scenario][method] = entry
        base = {r["seed"]: r["metrics"] for r in runs if r["scenario"] == scenario and r["method"] == "finetune"}
        for method, entry in out[scenario].items():
            # paired by seed (same data, same initialisation): mean difference to finetune, its standard error, wins
            diffs = [r["metrics"]["final_accuracy"] - base[r["seed"]]["final_accuracy"] for r in runs
                     if r["scenario"] == scenario and r["method"] == method and r["seed"] in base]
            if method != "finetune" and diffs:
                m, sd = mean_std(diffs)
                entry["final_vs_finetune"] = {"mean": m, "se": sd / len(diffs) ** 0.5,
                                              "wins": sum(d > 0 for d in diffs), "n": len(diffs)}
    return out


# ---------------------------------------------------------------------------------------------- report
def _pm(value: tuple[float, float], scale: float = 100.0) -> str:
    return f"{scale * value[0]:.1f} ± {scale * value[1]:.1f}"


def markdown(results: dict[str, Any]) -> str:
    cfg, summary = results["config"], results["summary"]
    lines = []
    for scenario, methods in summary.items():
        setting = cfg["scenarios"][scenario]
        heads = "one head per task" if setting["heads"] == "per_task" else "one shared head"
        lines.append(f"**{scenario}** ({setting['vocab']} vocabulary, {heads}; {len(cfg['tasks'])} tasks: "
                     f"{', '.join(cfg['tasks'])}; {len(cfg['seeds'])} seeds; accuracies in %, mean ± std)\n")
        lines.append("| method | final average accuracy ↑ | vs finetune, paired ± s.e. (seeds better) | average "
                     "forgetting ↓ | accuracy right after learning ↑ | first task at the end ↑ | ms per step, later "
                     "tasks |")
        lines.append("|---|---|---|---|---|---|---|")
        cost = results.get("cost", {}).get(scenario, {})
        for method, e in methods.items():
            weights = methods_of(cfg, scenario)[method]
            if "λ" in method or not weights:
                label = method
            elif len(weights) == 1:
                label = f"{method} (λ={next(iter(weights.values())):g})"
            else:
                label = f"{method} (" + ", ".join(f"{WEIGHTS[k]} λ={v:g}" for k, v in weights.items()) + ")"
            speed = "–"
            if method in cost and "finetune" in cost:
                speed = f"{cost[method]:.0f} ({cost[method] / cost['finetune']:.2f}×)"
            paired = "–"
            if "final_vs_finetune" in e:
                d = e["final_vs_finetune"]
                paired = f"{100 * d['mean']:+.1f} ± {100 * d['se']:.1f} ({d['wins']}/{d['n']})"
            lines.append(f"| {label} | {_pm(e['final_accuracy'])} | {paired} | {_pm(e['forgetting'])} | "
                         f"{_pm(e['learning_accuracy'])} | {_pm(e['first_task_final'])} | {speed} |")
        lines.append("")
        if cfg.get("sweep"):
            continue
        lines.append("Accuracy matrix, mean over seeds (row: task; column: after training task; %):\n")
        num = len(cfg["tasks"])
        header = "| method | task | " + " | ".join(f"after {cfg['tasks'][j]}" for j in range(num)) + " |"
        lines.append(header)
        lines.append("|---|---|" + "---|" * num)
        for method, e in methods.items():
            for i in range(num):
                cells = ["" if v is None else f"{100 * v:.1f}" for v in e["matrix_mean"][i]]
                lines.append(f"| {method if i == 0 else ''} | {cfg['tasks'][i]} | " + " | ".join(cells) + " |")
        lines.append("")
    meta = results["meta"]
    lines.append(f"Config `{meta['config']}`, {meta['device']}, {meta['wall_seconds']:.0f} s wall "
                 f"({meta['workers']} worker processes), torch {meta['torch']}, {meta['date']}."
                 + (f" Note: {meta['note']}." if meta.get("note") else ""))
    return "\n".join(lines)


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, summary = results["config"], results["summary"]
    scenarios = list(summary)
    num = len(cfg["tasks"])
    fig, axes = plt.subplots(len(scenarios), 2, figsize=(11, 3.6 * len(scenarios)), squeeze=False)
    colors = {"finetune": "#888888", "attention": "#1f77b4", "lwf": "#ff7f0e", "attention+lwf": "#2ca02c"}
    for row, scenario in enumerate(scenarios):
        methods = summary[scenario]
        ax = axes[row][0]
        xs = range(len(methods))
        for k, (key, title) in enumerate((("final_accuracy", "final avg accuracy"), ("forgetting", "avg forgetting"))):
            means = [100 * methods[m][key][0] for m in methods]
            stds = [100 * methods[m][key][1] for m in methods]
            ax.bar([x + 0.4 * k - 0.2 for x in xs], means, 0.4, yerr=stds, capsize=3,
                   color=[colors.get(m, "C0") for m in methods], alpha=1.0 if k == 0 else 0.45,
                   hatch=None if k == 0 else "//", label=title)
        ax.set_xticks(list(xs), list(methods))
        ax.set_ylabel("%")
        ax.set_title(f"{scenario}: final accuracy (solid), forgetting (hatched)")
        ax = axes[row][1]
        for m, e in methods.items():
            # the mean accuracy over the tasks learned so far, after each task
            seen = [sum(e["matrix_mean"][i][j] for i in range(j + 1)) / (j + 1) for j in range(num)]
            ax.plot(range(1, num + 1), [100 * v for v in seen], marker="o", color=colors.get(m, "C0"), label=m)
        ax.set_xticks(range(1, num + 1), [f"after {t}" for t in cfg["tasks"]], fontsize=8)
        ax.set_ylabel("mean accuracy on tasks so far (%)")
        ax.set_title(f"{scenario}: accuracy over the task sequence")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(results: dict[str, Any], path: str) -> None:
    """Final accuracy and forgetting against λ, one line per regulariser, finetune as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, summary = results["config"], results["summary"]
    fig, axes = plt.subplots(len(summary), 2, figsize=(10.5, 3.6 * len(summary)), squeeze=False)
    colors = {"attention": "#1f77b4", "lwf": "#ff7f0e"}
    for col, (scenario, methods) in enumerate(summary.items()):
        options = methods_of(cfg, scenario)
        for k, (key, title) in enumerate((("final_accuracy", "final average accuracy"),
                                          ("forgetting", "average forgetting"))):
            ax = axes[col][k]
            if "finetune" in methods:
                m, sd = methods["finetune"][key]
                ax.axhspan(100 * (m - sd), 100 * (m + sd), color="#888888", alpha=0.25)
                ax.axhline(100 * m, color="#888888", label="finetune")
            for weight, label in WEIGHTS.items():
                points = sorted((options[name][weight], e[key]) for name, e in methods.items()
                                if set(options[name]) == {weight})
                if points:
                    ax.errorbar([p[0] for p in points], [100 * p[1][0] for p in points],
                                yerr=[100 * p[1][1] for p in points], marker="o", capsize=3, color=colors[label],
                                label=label)
            ax.set_xscale("log")
            ax.set_xlabel("λ")
            ax.set_ylabel(f"{title} (%)")
            ax.set_title(f"{scenario}: {title}", fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def update_docs(results: dict[str, Any], doc: str, tag: str, *, prefix: str = "continual-results",
                render=None) -> None:
    """Replace the block between ``<!-- {prefix}:{tag}:start -->`` and its end marker in ``doc`` by
    ``render(results)`` (default: :func:`markdown`)."""
    start, end = f"<!-- {prefix}:{tag}:start -->", f"<!-- {prefix}:{tag}:end -->"
    if not os.path.exists(doc):
        return
    with open(doc) as f:
        text = f.read()
    if start not in text:
        return
    block = f"{start}\n{(render or markdown)(results)}\n{end}"
    text = re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    with open(doc, "w") as f:
        f.write(text)


# ---------------------------------------------------------------------------------------------- main
def report(path: str, *, docs: bool = True) -> None:
    """Rewrite the table and plot from a results file (no training)."""
    with open(path) as f:
        results = json.load(f)
    results["summary"] = summarise(results["runs"])
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    tag = os.path.splitext(os.path.basename(path))[0].removeprefix("continual_")
    print(markdown(results))
    if docs:
        img = os.path.join(ROOT, "docs", "img", f"continual_{tag}.png")
        (plot_sweep if results["config"].get("sweep") else plot)(results, img)
        update_docs(results, os.path.join(ROOT, "docs", "guides", "continual.md"), tag)
        print(f"wrote {os.path.relpath(img, ROOT)} and the table in docs/guides/continual.md")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=os.path.join(HERE, "cpu.yaml"))
    parser.add_argument("--report", metavar="RESULTS_JSON", help="only redraw the table and plot from a results file")
    parser.add_argument("--tag", default=None, help="output name: results/continual_<tag>.json (default: config name)")
    parser.add_argument("--seeds", type=int, nargs="*", help="override the config's seeds")
    parser.add_argument("--methods", nargs="*", help="run only these methods of the config")
    parser.add_argument("--scenarios", nargs="*", help="run only these scenarios of the config")
    parser.add_argument("--workers", type=int, help="parallel processes (default: the config's)")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite the docs table and plot")
    parser.add_argument("--no-cost", action="store_true", help="skip the per-step timing")
    parser.add_argument("--steps", type=int, help="override steps_per_task (smoke tests)")
    parser.add_argument("--accelerator", choices=("cpu", "gpu"), help="override the config's accelerator")
    args = parser.parse_args(argv)
    if args.report:
        report(args.report, docs=not args.no_docs)
        return {}

    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    if args.seeds:
        cfg["seeds"] = args.seeds
    if args.steps:
        cfg["steps_per_task"] = args.steps
    if args.accelerator:
        cfg["accelerator"] = args.accelerator
    if args.methods:
        cfg["methods"] = {m: cfg["methods"][m] for m in args.methods}
    if args.scenarios:
        cfg["scenarios"] = {s: cfg["scenarios"][s] for s in args.scenarios}
    tag = args.tag or os.path.splitext(os.path.basename(args.config))[0]
    workers = args.workers or cfg.get("workers", 1)
    jobs = [(cfg, s, m, seed) for s in cfg["scenarios"] for m in cfg["methods"] for seed in cfg["seeds"]]
    print(f"{len(jobs)} runs ({len(cfg['scenarios'])} scenarios × {len(cfg['methods'])} methods × "
          f"{len(cfg['seeds'])} seeds), {workers} worker(s)", flush=True)
    start = time.perf_counter()
    runs = []
    if workers > 1:
        import multiprocessing

        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            for run in pool.map(_run_one, jobs):
                runs.append(run)
                print(f"  {run['scenario']:9s} {run['method']:14s} seed {run['seed']}: "
                      f"final {100 * metrics(run['matrix'])['final_accuracy']:.1f}%", flush=True)
    else:
        for job in jobs:
            run = run_one(*job)
            runs.append(run)
            print(f"  {run['scenario']:9s} {run['method']:14s} seed {run['seed']}: "
                  f"final {100 * metrics(run['matrix'])['final_accuracy']:.1f}%", flush=True)
    cost = {}
    if not args.no_cost:
        print("timing the methods (ms per step in a later task) ...", flush=True)
        cost = {scenario: measure_cost(cfg, scenario) for scenario in cfg["scenarios"]}
    wall = time.perf_counter() - start
    if cfg.get("accelerator") == "gpu":
        device = torch.cuda.get_device_name()
    else:
        device = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    results = {
        "meta": {"config": os.path.relpath(args.config, ROOT), "device": device, "torch": torch.__version__,
                 "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "wall_seconds": wall, "workers": workers,
                 "command": "python " + " ".join([os.path.relpath(__file__, ROOT), *(argv or sys.argv[1:])])},
        "config": cfg,
        "summary": summarise(runs),
        "cost": cost,
        "runs": runs,
    }
    out = os.path.join(ROOT, "benchmarks", "results", f"continual_{tag}.json")
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(markdown(results))
    print(f"wrote {os.path.relpath(out, ROOT)} ({wall:.0f} s)")
    if not args.no_docs:
        img = os.path.join(ROOT, "docs", "img", f"continual_{tag}.png")
        (plot_sweep if cfg.get("sweep") else plot)(results, img)
        update_docs(results, os.path.join(ROOT, "docs", "guides", "continual.md"), tag)
        print(f"wrote {os.path.relpath(img, ROOT)} and the table in docs/guides/continual.md")
    return results


if __name__ == "__main__":
    main()
