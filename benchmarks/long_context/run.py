r"""Long-context attention distillation, measured (issue 12, item 6, and its cost targets).

A teacher learns multi-query associative recall (MQAR, ``mqar.py``) and is evaluated at 4k to 32k tokens; then, for
each of 3 seeds, two smaller students train at N = 16384 from the same initial weights on the same batches, one with
attention KL to the teacher (two layer pairs) and one without. The comparison is

- **step-matched**: both students after the same number of steps ``S``;
- **wall-clock-matched**: the student without attention KL keeps training until its training time equals the time the
  distilled student took for its ``S`` steps (teacher forward and KL included), and is evaluated there too;

at every evaluation length, paired by seed (``paired.py``: paired t-test and exact sign-flip test; with 3 seeds the
sign-flip test cannot go below p = 0.25). A separate cost benchmark times one training step with and without the two
attention-KL pairs at N = 16384 (median step time, peak CUDA memory of the whole step), for the experiment's student
and for larger ones. Everything goes to one JSON file, rewritten after every unit of work, so a run cut short keeps
what it finished and a second call resumes it::

    python benchmarks/long_context/run.py --out runs/long_context
    python benchmarks/long_context/run.py --out runs/long_context --resume-from DIR   # continue a stopped run
    python benchmarks/long_context/run.py --smoke --out /tmp/lc-smoke                   # toy sizes, on a CPU

Phases: ``teacher`` (train and evaluate the teacher, save ``teacher.pt``, then the cost benchmark), ``students``
(the seeds; needs ``teacher.pt`` in ``--out`` or ``--resume-from``), ``all`` (both). With ``--budget-s`` the budget
is checked before every unit from measured step times; a unit that would not fit is left for the next call.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import platform
import shutil
import statistics
import sys
import time
import traceback
from dataclasses import asdict
from datetime import datetime, timezone
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
for extra in (os.path.join(ROOT, "kernels"), ROOT, HERE):
    if os.path.isdir(extra) and extra not in sys.path:
        sys.path.insert(0 if extra == HERE else len(sys.path), extra)

import torch  # noqa: E402
from experiment import GPU, SMOKE  # noqa: E402
from mqar import (  # noqa: E402
    MQAR,
    ModelConfig,
    OutOfTime,
    Schedule,
    autocast,
    count_params,
    distiller_for,
    evaluate,
    kl_terms,
    train,
)
from tables import summarise  # noqa: E402

SCHEMA = "streamkl-long-context/1"

# ------------------------------------------------------------------------------------------------------- helpers
class Run:
    """The output directory: ``results.json`` (rewritten atomically after every unit), ``teacher.pt``, ``log.txt``."""

    def __init__(self, out: str) -> None:
        self.out = out
        os.makedirs(out, exist_ok=True)
        self.path = os.path.join(out, "results.json")
        self.results: dict[str, Any] = {}
        if os.path.exists(self.path):
            with open(self.path) as f:
                self.results = json.load(f)

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.results, f, indent=1, default=_json_default)
        os.replace(tmp, self.path)

    def log(self, text: str) -> None:
        line = f"[{datetime.now(timezone.utc).strftime('%H:%M:%S')}] {text}"
        print(line, flush=True)
        with open(os.path.join(self.out, "log.txt"), "a") as f:
            f.write(line + "\n")


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return str(value)


class Budget:
    """The phase's wall-clock budget, counted from the script's start."""

    def __init__(self, seconds: float, start: float) -> None:
        self.seconds, self.start = seconds, start

    @property
    def left(self) -> float:
        return self.seconds - (time.time() - self.start)

    @property
    def deadline(self) -> float:
        return self.start + self.seconds + 30  # a unit that overruns its estimate by this much is abandoned


def environment(device: torch.device) -> dict[str, Any]:
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else
           f"cpu ({platform.processor() or platform.machine()})",
           "torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads()}
    for name in ("triton", "lightning"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            env[name] = None
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
        env["memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    return env


def _median(values: list[float], skip: int = 5) -> float | None:
    values = values[skip:] if len(values) > skip else values
    return statistics.median(values) if values else None


def _eval_batch(cfg: dict[str, Any], n: int) -> int:
    return max(1, min(cfg["eval"]["sequences"], cfg["eval"]["tokens_per_batch"] // n))


def _evaluate(model: torch.nn.Module, task: MQAR, cfg: dict[str, Any], device: torch.device,
              lengths: list[int] | None = None) -> dict[str, Any]:
    ev = cfg["eval"]
    out = {}
    for n in lengths or ev["lengths"]:
        out.update(evaluate(model, task, [n], sequences=ev["sequences"], batch_size=_eval_batch(cfg, n),
                            device=device, depth_bins=ev["depth_bins"]))
    return out


@torch.no_grad()
def heldout_attention_kl(teacher: torch.nn.Module, student: torch.nn.Module, task: MQAR, cfg: dict[str, Any],
                         device: torch.device) -> dict[str, dict[str, float]]:
    """Mean attention KL(teacher ‖ student) per pair on held-out sequences, over every row and over the query rows."""
    spec = cfg["attn_kl_eval"]
    was = student.training
    student.eval()
    out: dict[str, dict[str, float]] = {}
    for rows in ("all", "queries"):
        distiller = distiller_for(teacher, student, cfg["kl"]["pairs"])
        g = torch.Generator(device).manual_seed(777)
        sums = counts = None
        for _ in range(spec["sequences"]):
            batch = task.batch(1, spec["seq_len"], generator=g, device=device)
            with autocast(device):
                distiller.begin_step(batch)
                with distiller.student_recording():
                    student(batch["input_ids"])
                terms = kl_terms(distiller, batch, rows)
            sums = terms.kl_sums if sums is None else sums + terms.kl_sums
            counts = terms.rows if counts is None else counts + terms.rows
        names = distiller.loss.pair_names
        out[rows] = {name: float(s / max(float(c), 1.0)) for name, s, c in zip(names, sums, counts)}
    student.train(was)
    return out


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _summary(r: dict[str, Any]) -> dict[str, Any]:
    """A training run's record without its weights."""
    return {"steps": r["steps"], "train_s": r["train_s"], "step_ms_median": _median(r["step_ms"]),
            "peak_bytes": r["peak_bytes"], "reached": r["reached"], "history": r["history"]}


# ------------------------------------------------------------------------------------------------------- phases
def phase_teacher(run: Run, cfg: dict[str, Any], task: MQAR, device: torch.device, budget: Budget) -> torch.nn.Module:
    """Train and evaluate the teacher (or load it when ``teacher.pt`` exists); returns it."""
    res = run.results
    path = os.path.join(run.out, "teacher.pt")
    teacher = ModelConfig(**cfg["teacher"]).build(task.vocab_size)
    if os.path.exists(path) and res.get("teacher", {}).get("status") == "done":
        state = torch.load(path, map_location="cpu", weights_only=True)
        teacher.load_state_dict(state["model"])
        run.log(f"teacher: loaded {path} ({res['teacher']['eval'][str(cfg['teacher_train']['check_len'])]['acc']:.1%} "
                f"at N={cfg['teacher_train']['check_len']})")
        return teacher.to(device)
    tt = cfg["teacher_train"]
    torch.manual_seed(tt["data_seed"])
    teacher = ModelConfig(**cfg["teacher"]).build(task.vocab_size)
    stages = [(int(s), [tuple(x) for x in shapes]) for s, shapes in tt["stages"]]
    run.log(f"teacher: {count_params(teacher):,} parameters, schedule {stages}, target {tt['target']:.0%} at "
            f"N={tt['check_len']}, at most {tt['time_limit_s']} s")
    parts, check = [], None
    limit = min(tt["time_limit_s"], max(budget.left - 60, 1))
    r = train(teacher, task, Schedule(stages), seed=0, data_seed=tt["data_seed"], device=device, lr=tt["lr"],
              warmup=tt["warmup"], time_limit_s=limit, abort_at=budget.deadline, log_every=50,
              on_log=lambda row: run.log(_row_text("teacher", row)) if row["step"] % 500 == 0 else None)
    parts.append(_summary(r))
    used = r["train_s"]
    while True:  # more of the last stage while below the target and within the teacher's time
        check = evaluate(teacher, task, [tt["check_len"]], sequences=tt["check_sequences"],
                         batch_size=_eval_batch(cfg, tt["check_len"]), device=device)[str(tt["check_len"])]["acc"]
        run.log(f"teacher: {sum(p['steps'] for p in parts)} steps, {used:.0f} s: {check:.1%} at N={tt['check_len']}")
        if check >= tt["target"] or used + 5 > limit or len(parts) > tt["max_extensions"]:
            break
        r = train(teacher, task, Schedule([(tt["extend_steps"], stages[-1][1])]), seed=0, device=device,
                  data_seed=tt["data_seed"] + len(parts), lr=tt["lr"], warmup=1, time_limit_s=limit - used,
                  abort_at=budget.deadline, log_every=50)
        parts.append(_summary(r))
        used += r["train_s"]
    torch.save({"model": teacher.state_dict(), "config": cfg["teacher"], "task": cfg["task"]}, path)
    run.log("teacher: evaluating at " + ", ".join(map(str, cfg["eval"]["lengths"])))
    ev = _evaluate(teacher, task, cfg, device)
    res["teacher"] = {
        "status": "done", "params": count_params(teacher), "config": cfg["teacher"],
        "steps": sum(p["steps"] for p in parts), "train_s": used, "parts": parts, "check_accuracy": check,
        "eval": ev, "solved": all(v["acc"] >= 0.9 for v in ev.values()), "checkpoint": "teacher.pt",
        "sha256": _sha256(path), "bytes": os.path.getsize(path),
    }
    run.save()
    run.log("teacher: " + ", ".join(f"N={n}: {v['acc']:.1%}" for n, v in ev.items()))
    return teacher


def _row_text(name: str, row: dict[str, Any]) -> str:
    kl = " ".join(f"{k}={v:.3f}" for k, v in row.items() if k.startswith("kl/"))
    return (f"{name}: step {row['step']} (N={row['seq_len']}, B={row['batch']}) loss {row['loss']:.3f} acc "
            f"{row['acc']:.1%} {kl} [{row['train_s']:.1f} s]")


def phase_cost(run: Run, cfg: dict[str, Any], task: MQAR, teacher: torch.nn.Module, device: torch.device,
               budget: Budget) -> None:
    """One training step with and without the attention-KL pairs: median time and peak memory of the whole step."""
    res = run.results.setdefault("cost", {"configs": {}})
    spec = cfg["cost"]
    for c in spec["configs"]:
        if c["name"] in res["configs"]:
            continue
        if budget.left < 60:
            run.log(f"cost: {c['name']!r} left for the next call (budget)")
            return
        try:
            res["configs"][c["name"]] = _cost_one(run, cfg, c, task, teacher, device, spec["steps"], spec["warmup"])
        except torch.cuda.OutOfMemoryError as err:
            res["configs"][c["name"]] = {"error": f"out of memory: {err}"[:300]}
        except Exception as err:  # the cost benchmark must not cost the experiment: record it and go on
            res["configs"][c["name"]] = {"error": f"{type(err).__name__}: {err}"[:300],
                                         "traceback": traceback.format_exc()[-2000:]}
            run.log(f"cost {c['name']!r} failed: {type(err).__name__}: {err}")
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        run.save()


def _cost_one(run: Run, cfg: dict[str, Any], c: dict[str, Any], task: MQAR, trained: torch.nn.Module,
              device: torch.device, steps: int, warmup: int) -> dict[str, Any]:
    pairs = c.get("pairs", cfg["kl"]["pairs"])
    s_cfg = ModelConfig(**c.get("student", cfg["student"]))
    torch.manual_seed(0)
    student = s_cfg.build(task.vocab_size).to(device)
    teacher = trained if "teacher" not in c else ModelConfig(**c["teacher"]).build(task.vocab_size)
    teacher = teacher.cpu()  # off the device while the plain step is measured
    out: dict[str, Any] = {"seq_len": c["seq_len"], "batch": c["batch"], "pairs": pairs,
                           "student": asdict(s_cfg), "student_params": count_params(student),
                           "teacher": c.get("teacher", cfg["teacher"]), "teacher_params": count_params(teacher),
                           "variants": {}}
    shape = (c["seq_len"], c["batch"])

    def measure(variant: str) -> dict[str, Any]:
        model = copy.deepcopy(student)
        distiller, rows = None, "queries" if variant.startswith("queries") else "all"
        if variant != "none":
            teacher.to(device)
            distiller = distiller_for(teacher, model, pairs, early_exit=not variant.endswith("no-early-exit"))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        train(model, task, Schedule([(warmup, [shape])]), seed=99, device=device, distiller=distiller,
              kl_rows=rows, log_every=10**9)
        r = train(model, task, Schedule([(steps, [shape])]), seed=98, device=device, distiller=distiller,
                  kl_rows=rows, log_every=10**9)
        return {"step_ms_median": statistics.median(r["step_ms"]), "step_ms": r["step_ms"],
                "peak_bytes": r["peak_bytes"]}

    out["variants"]["none"] = base = measure("none")
    for variant in c["variants"]:
        m = measure(variant)
        m["time_ratio"] = m["step_ms_median"] / base["step_ms_median"]
        m["memory_ratio"] = (m["peak_bytes"] / base["peak_bytes"]) if base["peak_bytes"] else None
        out["variants"][variant] = m
    teacher.cpu()
    if trained is not teacher:
        del teacher
    trained.to(device)
    texts = [f"{v}: {m['step_ms_median']:.1f} ms" + (f" ({m['time_ratio']:.2f}x, memory {m['memory_ratio']:.2f}x)"
                                                    if "time_ratio" in m and m["memory_ratio"] else "")
             for v, m in out["variants"].items()]
    run.log(f"cost {c['name']!r} (B={c['batch']}, N={c['seq_len']}): " + "; ".join(texts))
    return out


def _decide_student_steps(run: Run, cfg: dict[str, Any], task: MQAR, teacher: torch.nn.Module,
                          device: torch.device, budget: Budget) -> int:
    """The students' step budget ``S``: the config's, or fewer when a warm-up timing shows the three seeds would not
    fit in this call and the next one (the reduction is recorded). Decided once; resumed calls keep it."""
    st = run.results.setdefault("students", {"seeds": {}})
    if "steps" in st:
        return st["steps"]
    sc = cfg["student_train"]
    shape = (sc["seq_len"], sc["batch"])
    torch.manual_seed(0)
    model = ModelConfig(**cfg["student"]).build(task.vocab_size).to(device)
    times = {}
    for arm in ("kl", "base"):
        m = copy.deepcopy(model)
        distiller = distiller_for(teacher, m, cfg["kl"]["pairs"]) if arm == "kl" else None
        r = train(m, task, Schedule([(8, [shape])]), seed=97, device=device, distiller=distiller,
                  kl_rows=cfg["kl"]["rows"], log_every=10**9)
        times[arm] = statistics.median(r["step_ms"][3:]) / 1e3
    wanted = sc["steps"]
    per_seed = 2 * wanted * times["kl"] + _eval_estimate(cfg, times)
    seeds = len(cfg["seeds"])
    # the first call's budget left now, plus a second call of the same budget
    available = budget.left + budget.seconds - 60
    steps = wanted
    if seeds * per_seed > available:
        steps = max(10, int((available / seeds - _eval_estimate(cfg, times)) / (2 * times["kl"])))
    st.update({"steps": steps, "steps_wanted": wanted, "warmup_step_s": times,
               "expected_per_seed_s": 2 * steps * times["kl"] + _eval_estimate(cfg, times)})
    note = "" if steps == wanted else f" (reduced from {wanted} to fit two calls)"
    run.log(f"students: S = {steps} steps{note}; warm-up step {1e3 * times['kl']:.1f} ms with attention KL, "
            f"{1e3 * times['base']:.1f} ms without; expected {st['expected_per_seed_s']:.0f} s per seed")
    run.save()
    return steps


def _eval_estimate(cfg: dict[str, Any], times: dict[str, float]) -> float:
    """Seconds to evaluate three students' snapshots: a forward pass is about a third of a training step."""
    sc = cfg["student_train"]
    tokens = sum(cfg["eval"]["sequences"] * n * (n / sc["seq_len"]) for n in cfg["eval"]["lengths"])
    step_tokens = sc["seq_len"] * sc["batch"]
    return 3 * (tokens / step_tokens) * times["base"] / 3 + 10


def phase_students(run: Run, cfg: dict[str, Any], task: MQAR, teacher: torch.nn.Module, device: torch.device,
                   budget: Budget) -> None:
    sc = cfg["student_train"]
    steps = _decide_student_steps(run, cfg, task, teacher, device, budget)
    st = run.results["students"]
    shape = (sc["seq_len"], sc["batch"])
    for seed in cfg["seeds"]:
        rec = st["seeds"].setdefault(str(seed), {})
        if "kl" in rec and "base" in rec:
            continue
        need = st["expected_per_seed_s"] * (0.55 if "kl" in rec else 1.0)
        if budget.left < need:
            run.log(f"students: seed {seed} left for the next call ({budget.left:.0f} s left, {need:.0f} s needed)")
            return
        torch.manual_seed(seed)
        initial = ModelConfig(**cfg["student"]).build(task.vocab_size)
        try:
            if "kl" not in rec:
                model = copy.deepcopy(initial)
                distiller = distiller_for(teacher, model.to(device), cfg["kl"]["pairs"])
                run.log(f"students: seed {seed}, with attention KL ({cfg['kl']['rows']} rows), {steps} steps")
                r = train(model, task, Schedule([(steps, [shape])]), seed=seed, device=device, lr=sc["lr"],
                          warmup=sc["warmup"], distiller=distiller, kl_weight=cfg["kl"]["weight"],
                          kl_rows=cfg["kl"]["rows"], abort_at=budget.deadline, log_every=10,
                          on_log=lambda row: run.log(_row_text("  kl", row)) if row["step"] % 250 == 0 else None)
                rec["kl"] = {**_summary(r), "eval": _evaluate(model, task, cfg, device),
                             "attention_kl": heldout_attention_kl(teacher, model, task, cfg, device)}
                run.save()
                run.log(f"students: seed {seed} with: {r['train_s']:.1f} s; " + _acc_text(rec["kl"]["eval"]))
            t_kl = rec["kl"]["train_s"]
            model = copy.deepcopy(initial)
            run.log(f"students: seed {seed}, without attention KL, {steps} steps and on to {t_kl:.1f} s of training")
            r = train(model, task, Schedule([(steps * sc["max_time_factor"], [shape])]), seed=seed, device=device,
                      lr=sc["lr"], warmup=sc["warmup"], time_limit_s=t_kl, min_steps=steps, snapshots=[steps],
                      snapshot_at_s=t_kl, abort_at=budget.deadline, log_every=10,
                      on_log=lambda row: run.log(_row_text("  base", row)) if row["step"] % 250 == 0 else None)
            snaps = r.pop("snapshots")
            at_step = model if r["steps"] == steps else _with_state(model, snaps[f"step{steps}"])
            at_time = _with_state(model, snaps["time"]) if "time" in snaps else model
            rec["base"] = {**_summary(r), "time_matched_step": snaps.get("time_step", r["steps"]),
                           "eval_step": _evaluate(at_step, task, cfg, device),
                           "eval_time": _evaluate(at_time, task, cfg, device),
                           "attention_kl": heldout_attention_kl(teacher, at_step, task, cfg, device)}
            run.results["comparison"] = summarise(run.results)
            run.save()
            run.log(f"students: seed {seed} without, at step {steps}: " + _acc_text(rec["base"]["eval_step"])
                    + f"; at {t_kl:.1f} s (step {rec['base']['time_matched_step']}): "
                    + _acc_text(rec["base"]["eval_time"]))
        except OutOfTime as err:
            run.log(f"students: seed {seed} abandoned ({err}); the next call redoes it")
            return
    for arm, rows in cfg["kl"].get("extra_arms", {}).items():
        for seed in cfg["seeds"]:
            rec = st["seeds"][str(seed)]
            if arm in rec:
                continue
            need = 0.5 * st["expected_per_seed_s"]
            if budget.left < need:
                run.log(f"students: {arm} of seed {seed} left for the next call ({budget.left:.0f} s left)")
                return
            torch.manual_seed(seed)
            model = ModelConfig(**cfg["student"]).build(task.vocab_size)
            distiller = distiller_for(teacher, model.to(device), cfg["kl"]["pairs"])
            run.log(f"students: seed {seed}, {arm} (attention KL over {rows} rows), {steps} steps")
            try:
                r = train(model, task, Schedule([(steps, [shape])]), seed=seed, device=device, lr=sc["lr"],
                          warmup=sc["warmup"], distiller=distiller, kl_weight=cfg["kl"]["weight"], kl_rows=rows,
                          abort_at=budget.deadline, log_every=10)
            except OutOfTime as err:
                run.log(f"students: {arm} of seed {seed} abandoned ({err})")
                return
            rec[arm] = {**_summary(r), "rows": rows, "eval": _evaluate(model, task, cfg, device),
                        "attention_kl": heldout_attention_kl(teacher, model, task, cfg, device)}
            run.results["comparison"] = summarise(run.results)
            run.save()
            run.log(f"students: seed {seed} {arm}: " + _acc_text(rec[arm]["eval"]))


def _with_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    m = copy.deepcopy(model)
    m.load_state_dict(state)
    return m


def _acc_text(ev: dict[str, Any]) -> str:
    return ", ".join(f"N={n}: {v['acc']:.1%}" for n, v in ev.items())


# ------------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase", choices=("teacher", "students", "all"), default="all")
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "long_context"))
    parser.add_argument("--resume-from", help="a previous call's output directory (results.json, teacher.pt)")
    parser.add_argument("--budget-s", type=float, default=float("inf"), help="wall-clock budget of this call")
    parser.add_argument("--smoke", action="store_true", help="toy sizes, every step (CPU)")
    parser.add_argument("--device", default=None)
    args = parser.parse_args(argv)
    cfg = copy.deepcopy(SMOKE if args.smoke else GPU)
    start = time.time()
    budget = Budget(args.budget_s, start)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu"))
    if device.type == "cpu":
        torch.set_num_threads(1)
    if args.resume_from and os.path.abspath(args.resume_from) != os.path.abspath(args.out):
        os.makedirs(args.out, exist_ok=True)
        for name in ("results.json", "teacher.pt", "log.txt"):
            src, dst = os.path.join(args.resume_from, name), os.path.join(args.out, name)
            if os.path.exists(src) and not os.path.exists(dst):
                shutil.copy(src, dst)
    run = Run(args.out)
    res = run.results
    if res and res.get("config") != cfg:
        run.log("the results in --out were made with another config; starting over")
        res.clear()
    res.update({"schema": SCHEMA, "smoke": args.smoke, "config": cfg})
    res.setdefault("calls", []).append({"phase": args.phase, "started": datetime.now(timezone.utc).isoformat(),
                                        "budget_s": args.budget_s, "environment": environment(device)})
    res["environment"] = res["calls"][0]["environment"]
    run.save()
    task = MQAR(**cfg["task"])
    status = "complete"
    try:
        if args.phase in ("teacher", "all"):
            teacher = phase_teacher(run, cfg, task, device, budget)
            phase_cost(run, cfg, task, teacher, device, budget)
        if args.phase in ("students", "all"):
            if not os.path.exists(os.path.join(run.out, "teacher.pt")):
                run.log("students: no teacher.pt in --out (or --resume-from); run --phase teacher first")
                return 2
            teacher = phase_teacher(run, cfg, task, device, budget)
            phase_cost(run, cfg, task, teacher, device, budget)
            phase_students(run, cfg, task, teacher, device, budget)
    except Exception:
        run.results["calls"][-1]["error"] = traceback.format_exc()[-3000:]
        run.save()
        raise
    finally:
        done = [s for s, r in res.get("students", {}).get("seeds", {}).items() if "kl" in r and "base" in r]
        status = "complete" if len(done) == len(cfg["seeds"]) and len(res.get("cost", {}).get("configs", {})) == len(
            cfg["cost"]["configs"]) and res.get("teacher", {}).get("status") == "done" else "partial"
        res["status"] = status
        res["calls"][-1]["wall_s"] = time.time() - start
        if "students" in res:
            res["comparison"] = summarise(res)
        run.save()
        run.log(f"{status}: {len(done)}/{len(cfg['seeds'])} seeds; {time.time() - start:.0f} s; {run.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
