r"""The user's path through TRL: an ``SFTTrainer`` step with padding-free packing, with and without attention KL.

The models of ``benchmarks/user_path.py`` (its ``TEACHER`` and ``STUDENT`` configs, its ``llama()`` builder: a 1.1B
Llama teacher in bf16, frozen, and a 0.25B Llama student with gradient checkpointing), one packed row of ``N`` tokens
per step (``--docs`` documents of ``N / docs`` tokens each, ``position_ids`` restarting at each, no padding), bf16
autocast on the fp32 student, AdamW. Four *cells*, each a few steps after a warm-up, reporting the median step time and
the peak CUDA memory, as the Lightning rows of the user-path benchmark do:

- ``trl/plain``: ``trl.SFTTrainer(padding_free=True)`` alone;
- ``trl/four``: the same trainer with ``AttentionKLMixin`` on user_path's four layer pairs (``head_map="group"``);
- ``loop/plain`` and ``loop/four``: the same models and batch in a plain PyTorch loop, the second with the engine
  (``with distiller.distilling(batch) as kd``): the same measurement without TRL, for a machine where TRL and its
  dependencies (datasets, pyarrow, pandas) are not installed (the ``trl/`` cells then record why they did not run).

For a distilled cell the run also times its irreducible parts alone, with user_path's ``breakdown``: the teacher's pass
up to its deepest paired layer, and each ``attention_kl`` call of a step replayed alone. ::

    python benchmarks/user_path_trl.py                    # N = 16384, 8 documents, sdpa, on the GPU
    python benchmarks/user_path_trl.py --attention flash_attention_2   # where flash-attn is installed
    python benchmarks/user_path_trl.py --cpu-smoke        # the script's logic on tiny models, on the CPU

Writes ``benchmarks/results/<gpu>-user-path-trl.json`` (``--out``) and prints one line per cell and a markdown table.
Needs ``transformers`` and the repository's packages; ``trl`` for the ``trl/`` cells.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import traceback
from types import SimpleNamespace
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import user_path as up  # noqa: E402  (its models, helpers and DEVICE)

CELLS = ("loop/plain", "loop/four", "trl/plain", "trl/four")


def documents(n: int, docs: int, count: int, seed: int = 0) -> list[list[int]]:
    """``count`` documents of ``n // docs`` random token ids (a packed row of ``docs`` of them is ``n`` tokens)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    vocab = up.VOCAB if up.DEVICE == "cuda" else 97
    return torch.randint(1, vocab, (count, n // docs), generator=g).tolist()


def packed_row(rows: list[list[int]]) -> dict:
    """What TRL's padding-free collator makes of ``rows``: one row, restarting ``position_ids``, ``cu_seq_lens_*``."""
    import torch

    ids = torch.tensor([t for r in rows for t in r])[None]
    positions = torch.cat([torch.arange(len(r)) for r in rows])[None]
    cu = torch.tensor([0, *torch.tensor([len(r) for r in rows]).cumsum(0).tolist()], dtype=torch.int32)
    longest = max(len(r) for r in rows)
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": positions, "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def _pairs():
    from lightning_streamkl import explicit_pairs

    return {"pairs": explicit_pairs(up.FOUR_PAIRS, head_map="group")}


def _device_batch(batch: dict) -> dict:
    return {k: v.to(up.DEVICE) if hasattr(v, "to") else v for k, v in batch.items()}


def _autocast():
    import torch

    return torch.autocast(up.DEVICE, dtype=torch.bfloat16)


def run_loop(cell: str, teacher, student, rows: list[list[int]], docs: int, steps: int, warmup: int) -> dict:
    """The plain PyTorch loop: ``student(**batch, use_cache=False).loss`` under bf16 autocast, AdamW; with the engine
    around the forward for ``loop/four``."""
    import torch

    from lightning_streamkl import AttentionDistiller

    distiller = AttentionDistiller(teacher, _pairs(), student=student) if cell.endswith("four") else None
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-5)
    times, record = [], {}
    for step in range(warmup + steps):
        batch = _device_batch({**packed_row(rows[step * docs:(step + 1) * docs]), "use_cache": False})
        up.sync()
        start = time.perf_counter()
        if distiller is None:
            with _autocast():
                loss = student(**batch).loss
        else:
            with distiller.distilling(batch, step=step) as kd, _autocast():
                loss = student(**batch).loss
            loss = loss + kd.loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        up.sync()
        times.append(time.perf_counter() - start)
        print(f"  step {step}: {times[-1] * 1e3:.1f} ms", flush=True)
    if distiller is not None:
        batch = _device_batch({**packed_row(rows[:docs]), "use_cache": False})
        record.update(_breakdown(distiller, student, batch))
    return {**record, "times": times}


def _breakdown(distiller, student, batch: dict) -> dict:
    """user_path's breakdown (the teacher's pass, each KL call replayed alone) on this batch."""
    try:
        return up.breakdown(SimpleNamespace(distiller=distiller), SimpleNamespace(model=student), batch,
                            SimpleNamespace(forward_context=_autocast))
    except Exception as err:  # the steps are a result without it
        traceback.print_exc()
        return {"breakdown_error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}


def run_trl(cell: str, teacher, student, rows: list[list[int]], docs: int, steps: int, warmup: int,
            scratch: str) -> dict:
    """``SFTTrainer(padding_free=True)`` on pre-tokenised documents, ``docs`` per step (one packed row), bf16 mixed
    precision, gradient checkpointing, AdamW; with ``AttentionKLMixin`` for ``trl/four``."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from lightning_streamkl.integrations.trl import AttentionKLMixin

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            up.sync()
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            up.sync()
            self.times.append(time.perf_counter() - self._start)
            print(f"  step {len(self.times) - 1}: {self.times[-1] * 1e3:.1f} ms", flush=True)

    class SFTWithAttentionKL(AttentionKLMixin, SFTTrainer):
        pass

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1},
                                                                                    unk_token="<pad>")),
                                        pad_token="<pad>", eos_token="<eos>")
    timer = Timer()
    args = SFTConfig(output_dir=scratch, max_steps=warmup + steps, per_device_train_batch_size=docs, padding_free=True,
                     max_length=None, bf16=True, gradient_checkpointing=True, learning_rate=1e-5, optim="adamw_torch",
                     logging_steps=warmup + steps, report_to=[], save_strategy="no", disable_tqdm=True,
                     use_cpu=up.DEVICE == "cpu", dataloader_num_workers=0, seed=0)
    kwargs = dict(model=student, args=args, train_dataset=Dataset.from_dict({"input_ids": rows}),
                  processing_class=tokenizer, callbacks=[timer])
    if cell.endswith("four"):
        trainer = SFTWithAttentionKL(**kwargs, attention_teacher=teacher, attention_kl=_pairs())
    else:
        trainer = SFTTrainer(**kwargs)
    trainer.train()
    record: dict[str, Any] = {"times": timer.times, "log": trainer.state.log_history[0]}
    if cell.endswith("four"):
        batch = _device_batch({**packed_row(rows[:docs]), "use_cache": False})
        record.update(_breakdown(trainer.attention_distiller, student, batch))
    del trainer
    return record


def run(n: int, docs: int, steps: int, warmup: int, attention: str, out: str, cells: tuple[str, ...] = CELLS) -> dict:
    """Run ``cells``, rewriting ``out`` after each; returns the results."""
    import tempfile

    import torch
    import transformers

    cuda = up.DEVICE == "cuda"
    data: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                            "transformers": transformers.__version__, "n": n, "docs": docs, "steps": steps,
                            "warmup": warmup, "attention": attention, "teacher": up.TEACHER, "student": up.STUDENT,
                            "four_pairs": {str(k): v for k, v in up.FOUR_PAIRS.items()}, "cells": {}}
    try:
        import trl

        data["trl"] = trl.__version__
    except ImportError:
        data["trl"] = None
    teacher = up.llama(up.TEACHER, n, attention, seed=0, dtype=torch.bfloat16).eval()
    data["teacher_gib"] = up._bytes(teacher) / 2**30
    rows = documents(n, docs, (warmup + steps) * docs)
    for cell in cells:
        print(f"{cell} ...", flush=True)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        try:
            student = up.llama(up.STUDENT, n, attention, seed=1, dtype=torch.float32)
            up.enable_checkpointing(student)
            student.train()
            if cell.startswith("loop/"):
                record = run_loop(cell, teacher, student, rows, docs, steps, warmup)
            else:
                with tempfile.TemporaryDirectory() as scratch:
                    record = run_trl(cell, teacher, student, rows, docs, steps, warmup, scratch)
            record["step_s"] = statistics.median(record["times"][warmup:])
            if cuda:
                resident = up._bytes(teacher) if cell.endswith("four") else 0
                record["peak_gib"] = (torch.cuda.max_memory_allocated() - base + resident) / 2**30
        except ImportError as err:
            record = {"error": f"not installed: {err.name or err}"}
        except Exception as err:  # a cell that fails is a result
            traceback.print_exc()
            record = {"error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
        record["wall_s"] = time.perf_counter() - started
        data["cells"][cell] = record
        student = None
        up._write(out, data)
        print(summary_line(cell, data), flush=True)
    print(table(data))
    return data


def summary_line(cell: str, data: dict) -> str:
    r = data["cells"][cell]
    if "error" in r:
        return f"{cell}: {r['error']}"
    line = f"{cell}: step {r['step_s'] * 1e3:.1f} ms" + (f", peak {r['peak_gib']:.2f} GiB" if "peak_gib" in r else "")
    plain = data["cells"].get(cell.replace("four", "plain"), {})
    if cell.endswith("four") and "step_s" in plain:
        line += f", {r['step_s'] / plain['step_s']:.2f}x plain"
        if "teacher_s" in r:
            line += f", teacher {r['teacher_s'] * 1e3:.1f} ms + KL {sum(r['kl_s']) * 1e3:.1f} ms"
    return line


def table(data: dict) -> str:
    """The cells as a markdown table: plain step, with attention KL, ratio, its irreducible parts, memory ratio."""
    rows = ["| loop | plain step (ms) | with attention KL (ms) | ratio | teacher to the deepest pair (ms) | "
            "KL ops, fwd+bwd (ms) | peak memory, plain / with KL (GiB) |", "|---|---|---|---|---|---|---|"]
    for loop in ("trl", "loop"):
        plain, four = data["cells"].get(f"{loop}/plain", {}), data["cells"].get(f"{loop}/four", {})
        name = "TRL `SFTTrainer(padding_free=True)`" if loop == "trl" else "plain PyTorch loop"
        if "step_s" not in plain or "step_s" not in four:
            rows.append(f"| {name} | {plain.get('error', '')} | {four.get('error', '')} | | | | |")
            continue
        teacher = f"{four['teacher_s'] * 1e3:.1f}" if "teacher_s" in four else "–"
        kl = f"{sum(four['kl_s']) * 1e3:.1f}" if "kl_s" in four else "–"
        memory = f"{plain['peak_gib']:.2f} / {four['peak_gib']:.2f}" if "peak_gib" in four else "–"
        rows.append(f"| {name} | {plain['step_s'] * 1e3:.1f} | {four['step_s'] * 1e3:.1f} | "
                    f"{four['step_s'] / plain['step_s']:.2f}× | {teacher} | {kl} | {memory} |")
    return "\n".join(rows)


def markdown(data: dict, source: str = "benchmarks/results/nvidia-h100-80gb-hbm3-user-path-trl.json") -> str:
    """The guide's block: the run's setup in one line, then :func:`table`."""
    versions = f"torch {data['torch']}, transformers {data['transformers']}, TRL {data['trl'] or 'not installed'}"
    setup = (f"{data['device']}, {versions}; one packed row of N = {data['n']} tokens ({data['docs']} documents), "
             f"`attn_implementation=\"{data['attention']}\"`, median of {data['steps']} steps after {data['warmup']} "
             f"warm-up steps; the teacher's weights take {data['teacher_gib']:.2f} GiB. From `{source}`:")
    return setup + "\n\n" + table(data)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=16384, help="tokens per packed row (one row per step)")
    parser.add_argument("--docs", type=int, default=8, help="documents per packed row")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per cell")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--attention", default="sdpa", help="the models' attention implementation")
    parser.add_argument("--cells", nargs="+", choices=CELLS, default=list(CELLS))
    parser.add_argument("--cpu-smoke", action="store_true", help="the script's logic on tiny models, on the CPU")
    parser.add_argument("--out", help="results file (default: benchmarks/results/<gpu>-user-path-trl.json)")
    args = parser.parse_args(argv)
    import torch

    if args.cpu_smoke:
        up.DEVICE = "cpu"
        return run(64, 4, 1, 1, "sdpa", args.out or "/tmp/user-path-trl-cpu-smoke.json", tuple(args.cells))
    if not torch.cuda.is_available():
        raise SystemExit("the TRL user-path benchmark needs a CUDA GPU (or --cpu-smoke)")
    tag = "".join(c if c.isalnum() else "-" for c in torch.cuda.get_device_name().lower()).strip("-")
    out = args.out or os.path.join(up.RESULTS, f"{tag}-user-path-trl.json")
    return run(args.n, args.docs, args.steps, args.warmup, args.attention, out, tuple(args.cells))


if __name__ == "__main__":
    main()
