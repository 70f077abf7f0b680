r"""
Job outputs
^^^^^^^^^^^

Turn the results of a :class:`~lightning_streamkl.jobs.DistillationJob` into files: ``eval.csv``,
``steps.csv``, three PNG plots and ``report.md``, whose first paragraph states the outcome as the numbers show
it (including where attention KL did not help).
"""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["LABELS", "RUNS", "WINDOW", "first_step_reaching", "headline_table", "outcome", "render_report",
           "sample_results", "write_outputs"]

#: The three runs of a job, in the order they are trained.
RUNS = ("teacher", "student_kl", "student_base")
#: How the report names them.
LABELS = {"teacher": "teacher", "student_kl": "student, with attention KL", "student_base": "student, without"}
#: A difference in accuracy (absolute) below this is reported as "no clear difference".
MARGIN = 0.02
#: Steps in the moving average of the training accuracy that the steps-to-target are read from.
WINDOW = 20


def sample_results() -> dict[str, Any]:
    """A small made-up ``results`` dict with every key the report reads (for the examples).

    Example:
        >>> sorted(sample_results())
        ['environment', 'eval', 'naive_loss', 'runs', 'setup']
    """
    history = {"student_kl": [{"step": s, "train/acc": min(1.0, s / 30), "train/attn_kl/l0": 1 / s, "elapsed_s": s / 10}
                              for s in range(1, 61)],
               "student_base": [{"step": s, "train/acc": 0.02, "elapsed_s": s / 20} for s in range(1, 81)]}
    target = {"student_kl": {"accuracy": 0.9, "step": 37, "elapsed_s": 3.7, "max_steps": 80, "window": WINDOW},
              "student_base": {"accuracy": 0.9, "step": None, "elapsed_s": None, "max_steps": 80, "window": WINDOW}}
    runs = {"teacher": {"steps": 100, "wall_s": 9.0, "step_ms_median": 90.0, "peak_cuda_bytes": None, "history": []}}
    for run in ("student_kl", "student_base"):
        runs[run] = {"steps": len(history[run]), "budget": 50, "wall_s": 4.0, "step_ms_median": 50.0,
                     "peak_cuda_bytes": None, "batch_shape": [4, 32], "history": history[run], "target": target[run]}
    return {
        "runs": runs,
        "eval": {"lengths": [32, 64], "sequences": 8, "attention_kl_seq_len": 32,
                 "accuracy": {"teacher": {32: 0.95, 64: 0.5}, "student_kl": {32: 0.9, 64: 0.4},
                              "student_base": {32: 0.02, 64: 0.02}},
                 "attention_kl": {"student_kl": {"l0": 0.1}, "student_base": {"l0": 2.0}}},
        "setup": {"train_seq_len": 32, "chance": 1 / 64, "student_steps": 50, "teacher_steps": 100, "seed": 0,
                  "job": {"kl_eval_sequences": 4, "teacher_checkpoint": None},
                  "distillation": {"name": "attn_kl", "pairs": [{"teacher": 0, "student": 0, "name": "l0"}],
                                   "weight": 1.0, "temperature": 1.0, "direction": "forward"},
                  "data": {"batch_size": 4, "seq_len": 32}, "teacher_data": {"batch_size": 8, "seq_len": 32},
                  "teacher_params": 10, "student_params": 10},
        "naive_loss": {"batch_size": 4, "seq_len": 32, "heads": [2], "pairs": 1, "maps": 65536, "with_grad": 98304},
        "environment": {"device": "cpu", "torch": "2", "lightning": "2", "threads": 2},
    }


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average (shorter at the start).

    Example:
        >>> smooth([0, 1, 2, 3], 2)
        [0.0, 0.5, 1.5, 2.5]
    """
    values = list(values)
    return [sum(values[max(0, i + 1 - window):i + 1]) / min(i + 1, window) for i in range(len(values))]


def first_step_reaching(history: Sequence[Mapping[str, float]], key: str, threshold: float,
                        window: int = 20) -> int | None:
    """The first step at which the moving average of ``key`` over ``window`` steps reaches ``threshold``
    (``None``: never).

    Example:
        >>> first_step_reaching([{"step": s, "acc": s / 10} for s in range(1, 11)], "acc", 0.5, window=1)
        5
    """
    rows = [r for r in history if key in r]
    first = min(window, len(rows)) - 1  # only full windows (a short run: its whole length)
    for row, value in list(zip(rows, smooth([r[key] for r in rows], window)))[max(first, 0):]:
        if value >= threshold:
            return int(row["step"])
    return None


def _at(table: Mapping[Any, float], length: int) -> float | None:
    for k, v in table.items():
        if int(k) == int(length):
            return float(v)
    return None


def outcome(results: Mapping[str, Any]) -> dict[str, Any]:
    """The verdict and per-length comparison of a job's results.

    Returns ``{"verdict", "summary" (sentences), "per_length" (rows), "train_seq_len", "steps_to_half",
    "to_target"}``; the verdict is one of ``"helped"``, ``"hurt"``, ``"no clear difference"``, ``"teacher failed"``
    and ``"no baseline"``; ``to_target`` maps each student to ``{"accuracy", "step", "elapsed_s", "max_steps"}``
    (``step`` ``None``: not reached within ``max_steps``), or is empty when the job had no target.

    Example:
        >>> out = outcome(sample_results())
        >>> out["verdict"], out["to_target"]["student_kl"]["step"], out["to_target"]["student_base"]["step"]
        ('helped', 37, None)
        >>> out["summary"][1]
        'Trained on until its training accuracy (moving average over 20 steps, on batches it had not seen) reached \
90%, the student with attention KL needed 37 steps (4 s), the one without not within 80 steps.'
    """
    setup, ev = results["setup"], results["eval"]
    acc = ev["accuracy"]
    lengths = [int(n) for n in ev["lengths"]]
    n_train = int(setup["train_seq_len"])
    ref = n_train if n_train in lengths else min(lengths, key=lambda n: abs(n - n_train))
    chance = setup.get("chance")
    steps = setup.get("student_steps")
    rows = []
    for n in lengths:
        t = _at(acc.get("teacher", {}), n)
        w = _at(acc.get("student_kl", {}), n)
        b = _at(acc.get("student_base", {}), n)
        rows.append({"length": n, "teacher": t, "with_kl": w, "without_kl": b,
                     "difference": None if w is None or b is None else w - b})
    ref_row = next(r for r in rows if r["length"] == ref)
    half = {}
    for run in ("student_kl", "student_base"):
        history = results["runs"].get(run, {}).get("history", [])
        half[run] = first_step_reaching(history, "train/acc", 0.5) if history else None
    to_target = steps_to_target(results)

    def pct(x: float | None) -> str:
        return "–" if x is None else f"{100 * x:.1f}%"

    lines = []
    t_ref = ref_row["teacher"]
    if t_ref is not None and t_ref < 0.5:
        verdict = "teacher failed"
        lines.append(f"The teacher did not learn the task ({pct(t_ref)} at N={ref}), so this run says nothing about "
                     "distillation: give it more steps (`job.teacher_steps`) and run again.")
    elif ref_row["without_kl"] is None:
        verdict = "no baseline"
        lines.append(f"The student trained with attention KL reaches {pct(ref_row['with_kl'])} held-out accuracy at "
                     f"N={ref} (teacher {pct(t_ref)}); no student was trained without it (`job.baseline: false`).")
    else:
        d = ref_row["difference"]
        w, b = ref_row["with_kl"], ref_row["without_kl"]
        budget = f"the same {steps} steps, initial weights, seed and batches" if steps else "the same budget"
        if d >= MARGIN:
            verdict = "helped"
            lines.append(f"**Attention KL helped.** With {budget}, the student trained with attention KL reaches "
                         f"{pct(w)} held-out accuracy at the training length N={ref}; the one trained without it "
                         f"{pct(b)} (teacher {pct(t_ref)}" + (f", chance {pct(chance)})." if chance else ")."))
        elif d <= -MARGIN:
            verdict = "hurt"
            lines.append(f"**Attention KL hurt.** With {budget}, the student with attention KL reaches {pct(w)} at "
                         f"N={ref}, the one without {pct(b)} (teacher {pct(t_ref)}).")
        else:
            verdict = "no clear difference"
            lines.append(f"**No clear difference.** With {budget}, the students reach {pct(w)} (with attention KL) "
                         f"and {pct(b)} (without) at N={ref} (teacher {pct(t_ref)}).")
        if not to_target and (half["student_kl"] is not None or half["student_base"] is not None):
            def when(s: int | None) -> str:
                return f"after {s} steps" if s is not None else f"not within {steps} steps"

            lines.append(f"Training accuracy (moving average) first reached 50% {when(half['student_kl'])} with "
                         f"attention KL and {when(half['student_base'])} without.")
        same = [r["length"] for r in rows if r["difference"] is not None and abs(r["difference"]) < MARGIN]
        worse = [r["length"] for r in rows if r["difference"] is not None and r["difference"] <= -MARGIN]
        better = [r["length"] for r in rows if r["difference"] is not None and r["difference"] >= MARGIN]
        if better and (same or worse):
            lines.append(f"The difference holds at N={_list(better)}" + (f"; there is none at N={_list(same)}" if same
                                                                          else "")
                         + (f"; attention KL is worse at N={_list(worse)}" if worse else "") + ".")
        elif worse and verdict != "hurt":
            lines.append(f"Attention KL is worse at N={_list(worse)}.")
        longer = [r for r in rows if r["length"] > n_train and r["teacher"] is not None]
        if longer and t_ref is not None and all(r["teacher"] < 0.5 * t_ref for r in longer):
            lines.append(f"Beyond the training length (N > {n_train}) every model degrades, the teacher included: "
                         "none of them was trained on retrieval distances that long.")
    if to_target:
        lines.append(_target_sentence(to_target))
    kl = ev.get("attention_kl", {})
    if kl.get("student_kl") and kl.get("student_base"):
        pairs = list(kl["student_kl"])
        lines.append("Held-out attention KL to the teacher, per pair (" + ", ".join(pairs) + "): "
                     + ", ".join(f"{kl['student_kl'][p]:.3g}" for p in pairs) + " with, "
                     + ", ".join(f"{kl['student_base'][p]:.3g}" for p in pairs) + " without.")
    return {"verdict": verdict, "summary": lines, "per_length": rows, "train_seq_len": n_train,
            "steps_to_half": half, "to_target": to_target}


def steps_to_target(results: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per student, what its run recorded about reaching the job's target training accuracy (see
    :func:`outcome`); empty when the job had no target.

    Example:
        >>> runs = {"student_kl": {"target": {"accuracy": 0.9, "step": 150, "elapsed_s": 12.0, "max_steps": 3000}}}
        >>> steps_to_target({"runs": runs})["student_kl"]["step"]
        150
    """
    out = {}
    for run in ("student_kl", "student_base"):
        target = results["runs"].get(run, {}).get("target")
        if target and target.get("accuracy") is not None:
            out[run] = {k: target.get(k) for k in ("accuracy", "step", "elapsed_s", "max_steps")}
    return out


def _reach(entry: Mapping[str, Any]) -> str:
    if entry["step"] is None:
        return f"not within {entry['max_steps']} steps"
    return f"{entry['step']} steps ({entry['elapsed_s']:.0f} s)"


def _target_sentence(to_target: Mapping[str, Mapping[str, Any]]) -> str:
    kl, base = to_target.get("student_kl"), to_target.get("student_base")
    first = kl or base
    assert first is not None
    text = (f"Trained on until its training accuracy (moving average over {WINDOW} steps, on batches it had not "
            f"seen) reached {100 * first['accuracy']:g}%, the student with attention KL needed "
            f"{_reach(kl) if kl else '–'}")
    if base is None:
        return text + "."
    text += f", the one without {_reach(base)}"
    if kl and kl["step"] is not None and base["step"] is not None:
        text += (f": {base['step'] / kl['step']:.1f}× the steps and {base['elapsed_s'] / kl['elapsed_s']:.1f}× the "
                 "wall-clock time without it")
    return text + "."


def _list(values: Sequence[int]) -> str:
    return ", ".join(str(v) for v in values)


# ---------------------------------------------------------------------------------------------- files
def write_outputs(results: dict[str, Any], run_dir: str | Path, *, plots: bool = True) -> dict[str, Any]:
    """Write ``eval.csv``, ``steps.csv``, the plots and ``report.md`` into ``run_dir``; adds ``results["outcome"]``.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as run_dir:
        ...     _ = write_outputs(sample_results(), run_dir, plots=False)
        ...     sorted(p.name for p in Path(run_dir).iterdir())
        ['eval.csv', 'report.md', 'steps.csv']
    """
    run_dir = Path(run_dir)
    results["outcome"] = outcome(results)
    _write_eval_csv(results, run_dir / "eval.csv")
    _write_steps_csv(results, run_dir / "steps.csv")
    images = []
    if plots:
        try:
            images = make_plots(results, run_dir)
        except ImportError:  # pragma: no cover - matplotlib missing
            print("matplotlib is not installed: no plots (pip install matplotlib, or the `cli` extra).")
    (run_dir / "report.md").write_text(render_report(results, images))
    return results


def _write_eval_csv(results: Mapping[str, Any], path: Path) -> None:
    ev = results["eval"]
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "seq_len", "accuracy"])
        for run in RUNS:
            for n, a in ev["accuracy"].get(run, {}).items():
                w.writerow([run, int(n), f"{a:.6f}"])


def _write_steps_csv(results: Mapping[str, Any], path: Path) -> None:
    keys: list[str] = []
    for run in RUNS:
        for row in results["runs"].get(run, {}).get("history", []):
            keys += [k for k in row if k not in keys]
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", *keys])
        for run in RUNS:
            for row in results["runs"].get(run, {}).get("history", []):
                w.writerow([run, *("" if row.get(k) is None else f"{row[k]:.6g}" for k in keys)])


def make_plots(results: Mapping[str, Any], run_dir: Path) -> list[tuple[str, str]]:
    """``accuracy.png`` (training accuracy, with vs without), ``attn_kl.png`` (per-pair KL over steps) and
    ``accuracy_vs_length.png``; returns ``[(file, caption)]``.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as run_dir:
        ...     [file for file, _ in make_plots(sample_results(), Path(run_dir))]
        ['accuracy.png', 'attn_kl.png', 'accuracy_vs_length.png']
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, ev, setup = results["runs"], results["eval"], results["setup"]
    out = results.get("outcome") or outcome(results)
    n_train = out["train_seq_len"]
    colors = {"teacher": "#555555", "student_kl": "#1f77b4", "student_base": "#d62728"}
    images = []

    # 1. training accuracy, with vs without
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for run in ("student_kl", "student_base"):
        hist = [r for r in runs.get(run, {}).get("history", []) if "train/acc" in r]
        if hist:
            ax.plot([r["step"] for r in hist], smooth([r["train/acc"] for r in hist], 20), color=colors[run],
                    label=LABELS[run])
    t = _at(ev["accuracy"].get("teacher", {}), n_train) if "teacher" in ev["accuracy"] else None
    if t is not None:
        ax.axhline(t, color=colors["teacher"], ls=":", label=f"teacher (held-out, N={n_train})")
    if setup.get("chance"):
        ax.axhline(setup["chance"], color="#999999", ls="--", lw=0.8, label="chance")
    if any(runs.get(run, {}).get("steps", 0) > setup["student_steps"] for run in ("student_kl", "student_base")):
        ax.axvline(setup["student_steps"], color="#999999", ls=":", lw=1,
                   label=f"step budget ({setup['student_steps']}): held-out comparison")
    ax.set(xlabel="optimizer step", ylabel="accuracy on the step's (unseen) batch",
           title=f"task accuracy during training (N={n_train}, moving average of 20)", ylim=(-0.02, 1.02))
    ax.legend(loc="center right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(run_dir / "accuracy.png", dpi=110)
    plt.close(fig)
    images.append(("accuracy.png", "Task accuracy during training, with and without attention KL."))

    # 2. per-pair KL over steps
    hist = runs.get("student_kl", {}).get("history", [])
    prefix = f"train/{setup['distillation'].get('name', 'attn_kl')}/"
    pairs = [k[len(prefix):] for k in (hist[-1] if hist else {}) if k.startswith(prefix) and not k.endswith("/total")]
    if pairs:
        fig, ax = plt.subplots(figsize=(6.4, 4))
        cmap = plt.get_cmap("tab10")
        for i, pair in enumerate(pairs):
            rows = [r for r in hist if prefix + pair in r]
            ax.plot([r["step"] for r in rows], [r[prefix + pair] for r in rows], color=cmap(i), lw=1,
                    label=f"{pair}, student with attention KL (training batch)")
            base = ev.get("attention_kl", {}).get("student_base", {}).get(pair)
            if base is not None:
                ax.axhline(base, color=cmap(i), ls="--", lw=1,
                           label=f"{pair}, student without (held-out, end of training)")
        ax.set_yscale("log")
        ax.set(xlabel="optimizer step", ylabel="attention KL(teacher ‖ student), mean per row",
               title="per-pair attention KL")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, which="both")
        fig.tight_layout()
        fig.savefig(run_dir / "attn_kl.png", dpi=110)
        plt.close(fig)
        images.append(("attn_kl.png", "Per-pair attention KL between teacher and student over training."))

    # 3. accuracy vs context length
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for run in RUNS:
        table = ev["accuracy"].get(run)
        if table:
            xs = sorted(int(n) for n in table)
            ax.plot(xs, [_at(table, n) for n in xs], "o-", color=colors[run], label=LABELS[run])
    ax.axvline(n_train, color="#999999", ls=":", lw=1, label=f"training length {n_train}")
    if setup.get("chance"):
        ax.axhline(setup["chance"], color="#999999", ls="--", lw=0.8, label="chance")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="context length N (retrieval distances up to N/2)", ylabel="held-out accuracy",
           title="accuracy vs context length", ylim=(-0.02, 1.02))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(run_dir / "accuracy_vs_length.png", dpi=110)
    plt.close(fig)
    images.append(("accuracy_vs_length.png", "Held-out accuracy against context length."))
    return images


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _gib(x: float | None) -> str:
    return "–" if x is None else f"{x / 2**30:.2f} GiB"


def render_report(results: Mapping[str, Any], images: Sequence[tuple[str, str]] = ()) -> str:
    """The markdown report (``results`` with its ``"outcome"``).

    Example:
        >>> results = sample_results()
        >>> results["outcome"] = outcome(results)
        >>> report = render_report(results)
        >>> report.splitlines()[0], "| student, without | not reached | – | 80 |" in report
        ('# streamkl-distill report', True)
    """
    out, setup, ev, runs = results["outcome"], results["setup"], results["eval"], results["runs"]
    env = results.get("environment", {})
    job, dist = setup["job"], setup["distillation"]
    data, tdata = setup.get("data", {}), setup.get("teacher_data", {})
    lines = ["# streamkl-distill report", "", *out["summary"], ""]

    lines += ["## Held-out accuracy", "",
              f"Next-token accuracy inside the repeated segment, {ev['sequences']} held-out sequences per length "
              "(retrieval distances up to N/2)" + (f"; chance is {_pct(setup['chance'])}." if setup.get("chance")
                                                    else "."), "",
              "| context length N | teacher | student with attention KL | student without | with − without |",
              "|---|---|---|---|---|"]
    for r in out["per_length"]:
        mark = " (training length)" if r["length"] == out["train_seq_len"] else ""
        diff = "–" if r["difference"] is None else f"{100 * r['difference']:+.1f} pts"
        lines.append(f"| {r['length']}{mark} | {_pct(r['teacher'])} | {_pct(r['with_kl'])} | {_pct(r['without_kl'])} "
                     f"| {diff} |")
    lines += ["", f"(Each student's weights after the step budget of {setup['student_steps']} steps.)", ""]

    if out.get("to_target"):
        first = next(iter(out["to_target"].values()))
        lines += ["## Steps to the target", "",
                  f"Optimizer steps (and wall-clock time since training started) until the moving average over "
                  f"{WINDOW} steps of the training accuracy, on batches not seen before, reached "
                  f"{100 * first['accuracy']:g}%; a student below it at the budget kept training, up to the cap.", "",
                  "| student | steps | wall-clock | cap |", "|---|---|---|---|"]
        for run, entry in out["to_target"].items():
            steps = "not reached" if entry["step"] is None else str(entry["step"])
            wall = "–" if entry["elapsed_s"] is None else f"{entry['elapsed_s']:.1f} s"
            lines.append(f"| {LABELS[run]} | {steps} | {wall} | {entry['max_steps']} |")
        lines.append("")

    kl = ev.get("attention_kl", {})
    if kl:
        pairs = list(next(iter(kl.values())))
        lines += [f"Attention KL(teacher ‖ student) per pair, mean over rows and heads, on {job['kl_eval_sequences']} "
                  f"held-out sequences of N={ev['attention_kl_seq_len']}:", "",
                  "| pair | " + " | ".join(LABELS[r] for r in kl) + " |", "|---|" + "---|" * len(kl)]
        for p in pairs:
            lines.append(f"| {p} | " + " | ".join(f"{kl[r][p]:.4g}" for r in kl) + " |")
        lines.append("")

    for file, caption in images:
        lines += [f"![{caption}]({file})", ""]

    lines += ["## Setup", ""]
    pairs = ", ".join(f"{p['name'] or 't' + str(p['teacher']) + '_s' + str(p['student'])} "
                      f"(`{p['teacher']}` → `{p['student']}`)" for p in dist["pairs"])
    lines += [
        f"- Data: {type_note(data)}; the teacher's: {type_note(tdata)}.",
        f"- Teacher: {setup['teacher_params']:,} parameters, {setup['teacher_steps']} steps"
        + (f" (loaded from `{job['teacher_checkpoint']}`)" if job.get("teacher_checkpoint") else "") + ".",
        f"- Students: {setup['student_params']:,} parameters, {setup['student_steps']} steps each, from the same "
        f"initial weights, with the same seed ({setup['seed']}) and the same batches.",
        f"- Attention KL: pairs {pairs}; weight {dist['weight']:g}, temperature {dist['temperature']:g}, "
        f"direction {dist['direction']}.",
        f"- Environment: {env.get('device', '?')}, torch {env.get('torch', '?')}, "
        f"lightning {env.get('lightning', '?')}, {env.get('threads', '?')} threads; "
        f"whole job {results.get('total_wall_s', 0):.0f} s.",
        "",
        "| run | steps | wall time | median step | peak CUDA memory |",
        "|---|---|---|---|---|",
    ]
    for run in RUNS:
        r = runs.get(run)
        if r:
            lines.append(f"| {LABELS[run]} | {r['steps']} | {r['wall_s']:.1f} s | {r['step_ms_median']:.1f} ms "
                         f"| {_gib(r['peak_cuda_bytes']) if r.get('peak_cuda_bytes') is not None else 'n/a (CPU)'} |")
    lines.append("")
    naive = results.get("naive_loss")
    if naive:
        peak = runs.get("student_kl", {}).get("peak_cuda_bytes")
        lines += [
            f"The materialised (naive) attention-KL loss on these shapes (B={naive['batch_size']}, "
            f"N={naive['seq_len']}, heads {naive['heads']}, {naive['pairs']} pair(s)) would hold "
            f"{_gib(naive['maps'])} of fp32 probability maps (2 · B·H·N² · 4 bytes per pair) and "
            f"{_gib(naive['with_grad'])} with one map-sized gradient per pair in the backward"
            + (f"; the whole StreamKL training step peaked at {_gib(peak)}." if peak is not None else "."), ""]
    lines += ["## Files", "",
              "`config.yaml` (the resolved config), `results.json` (everything below), `eval.csv` (held-out accuracy), "
              "`steps.csv` (per-step values of every run), `<run>/metrics.csv` (Lightning's CSV logs), the plots.", ""]
    return "\n".join(lines)


def type_note(hp: Mapping[str, Any]) -> str:
    """``batch_size x seq_len`` plus the other data settings.

    Example:
        >>> type_note({"batch_size": 16, "seq_len": 128, "vocab_size": 64})
        'batches of 16 × N=128 (vocab_size=64)'
    """
    if not hp:
        return "–"
    rest = {k: v for k, v in hp.items() if k not in ("batch_size", "seq_len", "train_batches")}
    head = f"batches of {hp.get('batch_size')} × N={hp.get('seq_len')}"
    return head + (" (" + ", ".join(f"{k}={v}" for k, v in rest.items()) + ")" if rest else "")


def headline_table(results: Mapping[str, Any]) -> str:
    """The README's table of a job: held-out accuracy at the training length after the step budgets, and the
    steps (wall-clock) each student needed to reach the target training accuracy.

    Example:
        >>> res = {"setup": {"train_seq_len": 8, "chance": 0.5, "teacher_steps": 10, "student_steps": 5},
        ...        "eval": {"lengths": [8], "accuracy": {"teacher": {8: 1.0}, "student_kl": {8: 0.9},
        ...                                              "student_base": {8: 0.5}}},
        ...        "runs": {"student_kl": {"target": {"accuracy": 0.9, "step": 4, "elapsed_s": 1.0, "max_steps": 50}},
        ...                 "student_base": {"target": {"accuracy": 0.9, "step": None, "elapsed_s": None,
        ...                                             "max_steps": 50}}}}
        >>> print(headline_table(res))
        | N = 8 (the training length) | teacher | student with attention KL | student without |
        |---|---|---|---|
        | held-out accuracy after 10 / 5 / 5 steps | 100.0% | **90.0%** | 50.0% (chance 50.0%) |
        | steps (wall-clock) to 90% training accuracy | – | **4 (1 s)** | not within 50 |
    """
    setup, acc = results["setup"], results["eval"]["accuracy"]
    n = int(setup["train_seq_len"])
    t, w, b = (_at(acc.get(run, {}), n) for run in RUNS)
    budget = setup["student_steps"]
    chance = f" (chance {_pct(setup['chance'])})" if setup.get("chance") else ""
    better = "with" if (w or 0) >= (b or 0) else "without"
    cells = {"with": _pct(w), "without": _pct(b)}
    cells[better] = f"**{cells[better]}**"
    lines = [f"| N = {n} (the training length) | teacher | student with attention KL | student without |",
             "|---|---|---|---|",
             f"| held-out accuracy after {setup['teacher_steps']} / {budget} / {budget} steps | {_pct(t)} | "
             f"{cells['with']} | {cells['without']}{chance} |"]
    to_target = steps_to_target(results)
    if to_target:
        first = next(iter(to_target.values()))

        def reach(run: str) -> str:
            entry = to_target.get(run)
            if entry is None:
                return "–"
            if entry["step"] is None:
                return f"not within {entry['max_steps']}"
            return f"{entry['step']} ({entry['elapsed_s']:.0f} s)"

        steps = {run: to_target.get(run, {}).get("step") for run in ("student_kl", "student_base")}
        reached = [run for run, s in steps.items() if s is not None]
        fastest = min(reached, key=lambda run: steps[run]) if reached else None
        shown = {run: f"**{reach(run)}**" if run == fastest else reach(run) for run in steps}
        lines.append(f"| steps (wall-clock) to {100 * first['accuracy']:g}% training accuracy | – | "
                     f"{shown['student_kl']} | {shown['student_base']} |")
    return "\n".join(lines)
