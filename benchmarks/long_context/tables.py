"""The long-context experiment's comparisons and tables, from its ``results.json`` (``run.py``) and the CPU checks'
files (``cpu_check.py``).

:func:`summarise` turns the per-seed records into paired comparisons (``paired.paired``); the ``*_table`` functions
render the markdown tables of ``docs/guides/long-context.md`` and :func:`blocks` all of them, from the committed
results (``benchmarks/blocks.py`` writes and checks them)::

    python benchmarks/long_context/tables.py [results.json]     # print every table
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from paired import paired  # noqa: E402

ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
GPU_RESULTS = os.path.join(ROOT, "benchmarks", "results", "long_context_h100", "results.json")
CPU_RESULTS = os.path.join(ROOT, "benchmarks", "results", "long_context_cpu.json")
THRESHOLDS = ("0.5", "0.9")


def _here_on_path() -> None:
    """This folder's modules (experiment, mqar, cpu_check) importable, also when a loader took it off ``sys.path``."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)


# ------------------------------------------------------------------------------------------------ comparisons
def done_seeds(results: dict[str, Any]) -> list[str]:
    seeds = results.get("students", {}).get("seeds", {})
    return sorted((s for s, r in seeds.items() if "kl" in r and "base" in r), key=int)


def summarise(results: dict[str, Any]) -> dict[str, Any]:
    """Paired comparisons over the finished seeds: accuracy per evaluation length (step- and wall-clock-matched),
    steps and seconds to 50 % / 90 % training accuracy, held-out attention KL, step time and peak memory.

    Example:
        >>> one = lambda acc: {"4096": {"acc": acc}}
        >>> seed = lambda k, b, t: {"kl": {"eval": one(k), "train_s": 10.0, "reached": {}},
        ...                         "base": {"eval_step": one(b), "eval_time": one(t), "train_s": 10.0, "reached": {}}}
        >>> s = summarise({"students": {"seeds": {"0": seed(0.9, 0.1, 0.2), "1": seed(0.8, 0.2, 0.3)}}})
        >>> s["seeds"], round(s["step_matched"]["4096"]["mean_diff"], 2)
        (['0', '1'], 0.7)
        >>> round(s["time_matched"]["4096"]["mean_diff"], 2)
        0.6
    """
    seeds = done_seeds(results)
    recs = [results["students"]["seeds"][s] for s in seeds]
    out: dict[str, Any] = {"seeds": seeds, "n": len(seeds)}
    if not recs:
        return out
    lengths = list(recs[0]["kl"]["eval"])
    out["step_matched"] = {n: paired([r["kl"]["eval"][n]["acc"] for r in recs],
                                     [r["base"]["eval_step"][n]["acc"] for r in recs]) for n in lengths}
    out["time_matched"] = {n: paired([r["kl"]["eval"][n]["acc"] for r in recs],
                                     [r["base"]["eval_time"][n]["acc"] for r in recs]) for n in lengths}
    out["reached"] = {t: {arm: [(r[arm].get("reached") or {}).get(t) for r in recs] for arm in ("kl", "base")}
                      for t in THRESHOLDS}
    out["train_s"] = {arm: [r[arm]["train_s"] for r in recs] for arm in ("kl", "base")}
    out["steps"] = {"kl": [r["kl"].get("steps") for r in recs],
                    "base_time_matched": [r["base"].get("time_matched_step") for r in recs]}
    out["step_ms_median"] = {arm: [r[arm].get("step_ms_median") for r in recs] for arm in ("kl", "base")}
    out["peak_bytes"] = {arm: [r[arm].get("peak_bytes") for r in recs] for arm in ("kl", "base")}
    extra = sorted({arm for r in recs for arm in r if arm not in ("kl", "base")})
    out["extra_arms"] = {}
    for arm in extra:
        have = [r for r in recs if arm in r]
        if len(have) == len(recs):
            out["extra_arms"][arm] = {
                "step_matched": {n: paired([r[arm]["eval"][n]["acc"] for r in recs],
                                           [r["base"]["eval_step"][n]["acc"] for r in recs]) for n in lengths},
                "versus_kl": {n: paired([r[arm]["eval"][n]["acc"] for r in recs],
                                        [r["kl"]["eval"][n]["acc"] for r in recs]) for n in lengths},
                "reached": {t: [(r[arm].get("reached") or {}).get(t) for r in recs] for t in THRESHOLDS}}
    if all("attention_kl" in r[arm] for r in recs for arm in ("kl", "base")):
        out["attention_kl"] = {rows: {pair: {arm: [r[arm]["attention_kl"][rows][pair] for r in recs]
                                             for arm in ("kl", "base")}
                                      for pair in recs[0]["kl"]["attention_kl"][rows]}
                               for rows in recs[0]["kl"]["attention_kl"]}
    return out


# ------------------------------------------------------------------------------------------------ formatting
def _pct(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{100 * x:.{digits}f} %"


def _gib(b: float | None) -> str:
    return "–" if b is None else f"{b / 2**30:.2f} GiB"


def _p(p: float | None) -> str:
    if p is None:
        return "–"
    return "p < 0.001" if p < 0.001 else f"p = {p:.3f}"


def _mean_sd(values: list[float]) -> str:
    if len(values) < 2:
        return _pct(values[0]) if values else "–"
    return f"{100 * statistics.mean(values):.1f} ± {100 * statistics.stdev(values):.1f} %"


def _per_seed(values: list[float]) -> str:
    return " / ".join(f"{100 * v:.1f}" for v in values)


def load(path: str = GPU_RESULTS) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


# ------------------------------------------------------------------------------------------------ tables
def teacher_table(results: dict[str, Any]) -> str:
    """The teacher: held-out accuracy per length, overall and per query depth."""
    t = results["teacher"]
    task = results["config"]["task"]
    bins = len(next(iter(t["eval"].values()))["by_depth"])
    head = ["context length N", "accuracy", "queries scored"] + [
        f"depth {100 * i // bins}–{100 * (i + 1) // bins} %" for i in range(bins)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n, v in t["eval"].items():
        lines.append(f"| {n} | **{_pct(v['acc'])}** | {v['n']} | " + " | ".join(_pct(x) for x in v["by_depth"]) + " |")
    lines.append("")
    lines.append(f"Teacher: {t['params']:,} parameters, {t['steps']} steps in {t['train_s']:.0f} s of training; "
                 f"chance is {_pct(1 / task['num_values'])}.")
    return "\n".join(lines)


def students_table(results: dict[str, Any]) -> str:
    """Held-out accuracy of the students per length: with attention KL, without it after the same steps, and without
    it after the same wall-clock time; paired differences and p-values."""
    s = summarise(results)
    head = ["N", "with attention KL", "without, same steps", "without, same time", "with − without (steps)",
            "with − without (time)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n, step in s["step_matched"].items():
        tm = s["time_matched"][n]
        lines.append(f"| {n} | {_mean_sd(step['kl'])} | {_mean_sd(step['base'])} | {_mean_sd(tm['base'])} | "
                     f"{_diff(step)} | {_diff(tm)} |")
    lines.append("")
    lines.append(f"Mean ± standard deviation over {s['n']} seeds; differences are paired by seed (mean, paired t-test "
                 f"p, seeds favouring attention KL). Per seed, with attention KL: "
                 + "; ".join(f"N={n}: {_per_seed(v['kl'])} %" for n, v in s["step_matched"].items()) + ".")
    return "\n".join(lines)


def every_row_table(results: dict[str, Any]) -> str:
    """The extra arm: attention KL over every row (the library's default) instead of the query rows, same steps."""
    arm = summarise(results).get("extra_arms", {}).get("kl_all")
    if arm is None:
        return "*The every-row arm did not run for every finished seed* (it runs last)."
    head = ["N", "attention KL, every row", "without, same steps", "every row − without", "every row − query rows"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n, c in arm["step_matched"].items():
        lines.append(f"| {n} | {_mean_sd(c['kl'])} | {_mean_sd(c['base'])} | {_diff(c)} | "
                     f"{_diff(arm['versus_kl'][n])} |")
    return "\n".join(lines)


def _diff(c: dict[str, Any]) -> str:
    return f"{100 * c['mean_diff']:+.1f} pts ({_p(c['p_t'])}, {c['wins']}/{c['n']})"


def runs_table(results: dict[str, Any]) -> str:
    """The students' training runs: steps, wall-clock, median step, peak memory, steps and time to 50 % / 90 %."""
    s = summarise(results)
    st = results["students"]

    def reached(arm: str, t: str) -> str:
        got = s["reached"][t][arm]
        return " / ".join("–" if g is None else f"{g['step']} ({g['train_s']:.0f} s)" for g in got)

    def med(values: list[float | None], fmt: str) -> str:
        vals = [v for v in values if v is not None]
        return fmt.format(statistics.median(vals)) if vals else "–"

    lines = ["| | with attention KL | without |", "|---|---|---|",
             f"| steps | {st['steps']} | {st['steps']} (step-matched); "
             f"{' / '.join(map(str, s['steps']['base_time_matched']))} (wall-clock-matched) |",
             f"| training time per seed | {' / '.join(f'{x:.0f} s' for x in s['train_s']['kl'])} | "
             f"{' / '.join(f'{x:.0f} s' for x in s['train_s']['base'])} |",
             f"| median step | {med(s['step_ms_median']['kl'], '{:.1f} ms')} | "
             f"{med(s['step_ms_median']['base'], '{:.1f} ms')} |",
             f"| peak CUDA memory | {_gib(max((b for b in s['peak_bytes']['kl'] if b), default=None))} | "
             f"{_gib(max((b for b in s['peak_bytes']['base'] if b), default=None))} |"]
    for t in THRESHOLDS:
        lines.append(f"| first step (time) at {float(t):.0%} training accuracy, per seed | {reached('kl', t)} | "
                     f"{reached('base', t)} |")
    if "attention_kl" in s:
        for pair, v in s["attention_kl"]["queries"].items():
            lines.append(f"| held-out attention KL to the teacher at the query rows, {pair} (nats) | "
                         f"{statistics.mean(v['kl']):.3g} | {statistics.mean(v['base']):.3g} |")
    return "\n".join(lines)


def cost_table(results: dict[str, Any]) -> str:
    """One training step at N = 16384 without and with two attention-KL pairs: median time and peak memory."""
    lines = ["| student (B × N) | attention KL | median step | × without | peak memory | × without |",
             "|---|---|---|---|---|---|"]
    names = {"none": "none", "queries": "2 pairs, query rows", "all": "2 pairs, every row",
             "all-no-early-exit": "2 pairs, every row, teacher runs to its output"}
    for name, c in results["cost"]["configs"].items():
        if "error" in c:
            lines.append(f"| {name} | – | {c['error'][:60]} | | | |")
            continue
        for variant, m in c["variants"].items():
            ratio = f"{m['time_ratio']:.2f}×" if "time_ratio" in m else "1"
            mem = f"{m['memory_ratio']:.2f}×" if m.get("memory_ratio") else ("1" if variant == "none" else "–")
            lines.append(f"| {name} ({c['batch']} × {c['seq_len']}) | {names.get(variant, variant)} | "
                         f"{m['step_ms_median']:.1f} ms | {ratio} | {_gib(m['peak_bytes'])} | {mem} |")
    return "\n".join(lines)


def cpu_table(path: str = CPU_RESULTS) -> str:
    """The CPU checks behind the design (cpu_check.py): length generalisation and the students at short N."""
    _here_on_path()
    from cpu_check import markdown

    return markdown(path)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    results = load(argv[0]) if argv else load()
    for name, fn in (("teacher", teacher_table), ("students", students_table), ("every row", every_row_table),
                     ("runs", runs_table), ("cost", cost_table)):
        print(f"## {name}\n\n{fn(results)}\n")


if __name__ == "__main__":
    main()


# ------------------------------------------------------------------------------------------------ findings
TIME_TARGET, MEMORY_TARGET = 1.5, 1.2  # issue 12's cost targets at N = 16384 (two pairs; teacher early exit)


def _verdict(c: dict[str, Any]) -> str:
    if c["n"] < 2:
        return "one seed: no test"
    if c["significant"]:
        return f"{_p(c['p_t'])} by the paired t-test, {c['wins']} of {c['n']} seeds"
    return f"not significant ({_p(c['p_t'])}, {c['wins']} of {c['n']} seeds): within the noise of {c['n']} seeds"


def findings(results: dict[str, Any]) -> str:
    """What the results say, in sentences generated from them (so the guide cannot claim more than they show)."""
    out = []
    cfg = results["config"]
    n_train = str(cfg["student_train"]["seq_len"])
    t = results.get("teacher", {})
    if t.get("status") == "done":
        ev = t["eval"]
        accs = ", ".join(f"{_pct(v['acc'])} at N = {n}" for n, v in ev.items())
        chance = _pct(1 / cfg["task"]["num_values"])
        if t["solved"]:
            out.append(f"- **The teacher solves the task**: {accs} (chance {chance}).")
        else:
            out.append(f"- **The teacher did not solve the task at every length** ({accs}; chance {chance}): the "
                       "students below copy a teacher that fails where it is below 90 %.")
    s = summarise(results) if done_seeds(results) else None
    if s:
        seeds = cfg["seeds"]
        if s["n"] < len(seeds):
            out.append(f"- **Partial**: {s['n']} of {len(seeds)} seeds finished; the comparisons use those.")
        for key, label in (("step_matched", "after the same number of steps"),
                           ("time_matched", "after the same wall-clock training time")):
            c = s[key][n_train] if n_train in s[key] else next(iter(s[key].values()))
            out.append(f"- At N = {n_train}, {label}: {_pct(c['mean_kl'])} with attention KL against "
                       f"{_pct(c['mean_base'])} without ({100 * c['mean_diff']:+.1f} points; {_verdict(c)}).")
        longest = max(s["step_matched"], key=int)
        c = s["time_matched"][longest]
        out.append(f"- At N = {longest}, {int(longest) / int(n_train):g}× the students' training length, same "
                   f"wall-clock: {_pct(c['mean_kl'])} against {_pct(c['mean_base'])} ({_verdict(c)}).")
        arm = s.get("extra_arms", {}).get("kl_all")
        if arm is not None and n_train in arm["versus_kl"]:
            c = arm["versus_kl"][n_train]
            out.append(f"- Attention KL over every row instead of the query rows, at N = {n_train} after the same "
                       f"steps: {100 * c['mean_diff']:+.1f} points ({_verdict(c)}).")
        out.append(f"- {s['n']} seeds are few: the exact sign-flip test cannot go below p = {0.5 ** (s['n'] - 1):.2f} "
                   "with them, and the t-test on so few differences assumes they are roughly normal. A difference "
                   "called significant here is consistent across the seeds; one called noise may still be real.")
    cost = results.get("cost", {}).get("configs", {}).get("experiment")
    if cost and "variants" in cost:
        for variant, label in (("all", "every row"), ("queries", "the query rows")):
            m = cost["variants"].get(variant)
            if m is None or m.get("memory_ratio") is None:
                continue
            ok_t, ok_m = m["time_ratio"] <= TIME_TARGET, m["memory_ratio"] <= MEMORY_TARGET
            out.append(f"- Cost at N = {cost['seq_len']} (B = {cost['batch']}), two pairs over {label}: the step takes "
                       f"{m['time_ratio']:.2f}× the step without attention KL (target ≤ {TIME_TARGET}×: "
                       f"{'met' if ok_t else 'not met'}) and peaks at {m['memory_ratio']:.2f}× its memory (target ≤ "
                       f"{MEMORY_TARGET}×: {'met' if ok_m else 'not met'}).")
    if results.get("status") != "complete":
        out.append("- The run is **partial** (`status` in the JSON): a second call resumes it.")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------ setup, README
def setup_table(results: dict[str, Any]) -> str:
    """The experiment's setup, from the results' config."""
    _here_on_path()
    from mqar import MQAR, ModelConfig, count_params

    cfg = results["config"]
    task = MQAR(**cfg["task"])
    tt, sc, kl, ev = cfg["teacher_train"], cfg["student_train"], cfg["kl"], cfg["eval"]

    def model(spec: dict[str, Any]) -> str:
        m = ModelConfig(**spec)
        return (f"{m.num_layers} layers, {m.num_heads} heads of {m.d_model // m.num_heads}, d_model {m.d_model}"
                + (f", MLP {m.mlp_ratio}×" if m.mlp_ratio else "") + f": {count_params(m.build(task.vocab_size)):,} "
                "parameters")

    def shapes(items: list[list[int]]) -> str:
        return " and ".join(f"{b} × {n}" for n, b in items)

    stages = ", then ".join(f"{steps} steps of {shapes(items)}" + (" in turn" if len(items) > 1 else "")
                            for steps, items in tt["stages"])
    rows = [
        ("model", model(cfg["teacher"]), model(cfg["student"])),
        ("position", "none in the attention (NoPE); a causal depthwise convolution of kernel "
                     f"{cfg['teacher']['conv_kernel']} before each attention layer", "the same"),
        ("training (batch × N)", f"{stages}; then more of the last stage while below {_pct(tt['target'], 0)} at "
                                 f"N = {tt['check_len']}, within {tt['time_limit_s']} s",
         f"{sc['steps']} steps of {sc['batch']} × {sc['seq_len']}; seeds {', '.join(map(str, cfg['seeds']))}"),
        ("optimizer", f"AdamW, learning rate {tt['lr']:g}, warm-up {tt['warmup']} steps",
         f"AdamW, learning rate {sc['lr']:g}, warm-up {sc['warmup']} steps, bf16 autocast"),
        ("attention KL", "–", ", ".join(f"layer {t} → layer {s}" for t, s in kl["pairs"])
         + f", weight {kl['weight']:g}, over the {'query rows' if kl['rows'] == 'queries' else 'rows'}; a third "
           "arm over every row"),
        ("evaluation", f"N = {', '.join(map(str, ev['lengths']))}: {ev['sequences']} held-out sequences each",
         "the same"),
    ]
    lines = ["| | teacher | students |", "|---|---|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in rows]
    n = sc["seq_len"]
    lines += ["", f"Task: MQAR with {task.num_pairs} key-value pairs per sequence, {task.num_keys} keys, "
                  f"{task.num_values} values and {task.num_noise} filler tokens, one query every "
                  f"{task.query_every} positions ({task.queries(n)} per sequence at N = {n}); chance is "
                  f"{_pct(task.chance)}."]
    return "\n".join(lines)


def readme(results: dict[str, Any]) -> str:
    """README's long-context sentences: what the committed run shows, nothing more."""
    s = summarise(results)
    cfg = results["config"]
    n = str(cfg["student_train"]["seq_len"])
    c = s["time_matched"][n]
    t = results["teacher"]["eval"][n]["acc"]
    text = (f"On one H100 ([long context](docs/guides/long-context.md)), a teacher reaches {_pct(t)} on multi-query "
            f"associative recall at N = {n}; students trained there reach {_pct(c['mean_kl'])} with attention KL and "
            f"{_pct(c['mean_base'])} without after the same wall-clock time (mean of {s['n']} seeds; "
            f"{'consistent across them' if c['significant'] else 'not significant with so few seeds'}).")
    cost = results.get("cost", {}).get("configs", {}).get("experiment", {}).get("variants", {}).get("all")
    if cost and cost.get("memory_ratio"):
        text += (f" A student step with two attention-KL pairs took {cost['time_ratio']:.2f}× the step without and "
                 f"peaked at {cost['memory_ratio']:.2f}× its memory.")
    return text


def blocks() -> dict[str, dict[str, str]]:
    """Every generated block of the long-context guide and README's sentence, from the committed results: page ->
    block name -> markdown."""
    results = load()
    guide = {"findings": findings, "setup": setup_table, "teacher": teacher_table, "students": students_table,
             "every-row": every_row_table, "runs": runs_table, "cost": cost_table}
    page = {f"long-context:{name}": render(results) for name, render in guide.items()}
    page["long-context:cpu"] = cpu_table()
    return {"docs/guides/long-context.md": page, "README.md": {"long-context:readme": readme(results)}}
