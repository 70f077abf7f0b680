r"""The user's path, end to end: a real-scale Hugging Face teacher and student through a Lightning ``Trainer``.

A Llama teacher of 1.1B parameters (22 layers, 32 query and 8 key-value heads of 64, as TinyLlama-1.1B but with 8 KV
heads; bf16, frozen) and a Llama student of 0.25B (16 layers, 16 / 4 heads of 64), both built from their configs, one
sequence of ``N`` tokens per step, gradient checkpointing on the student, AdamW. Each *cell* fits the student for a
few steps and reports the median step time and the peak CUDA memory of the fit:

- ``plain``: the student alone;
- ``four``: with :class:`~lightning_streamkl.StreamKLDistillation` on four layer pairs (``head_map="group"``);
- ``uniform``: with ``uniform_pairs`` over every student layer;
- ``naive``: the KD a user writes without the op, eager attention with ``output_attentions=True`` and the KL of the
  maps, as far as it fits in memory.

A distilled cell's teacher is resident on the GPU (``teacher_device="student"``) unless the cell says otherwise: with
``teacher_device="offload"`` it stays in pinned host memory and is streamed to the GPU one layer at a time.

over ``Trainer(precision=...)`` ``bf16-mixed``, ``bf16-true``, ``16-mixed`` and ``32-true`` (with
``torch.set_float32_matmul_precision("high")``), attention implementations ``sdpa`` and ``flex_attention``, and the
student with and without ``torch.compile``. For a distilled cell the run also times its irreducible parts alone: the
teacher's pass up to its deepest paired layer (the engine's own ``run_teacher``), and each pair's ``attention_kl``
forward+backward replayed on the tensors the loss handed the op in a step (their shapes, dtypes and options). The
rest of the extra time is the pipeline around the op. Ratios compare cells measured in the same run.

Peak memory is the fit's: the most allocated during it, less what was allocated before the student was built, plus
the teacher's weights for a distilled cell with a resident teacher (the teacher is put on the GPU, or in host memory
for an offloaded one, before the cell's memory is read; it stays there between cells). An offloaded teacher's device
copies are made during the fit, so the fit's peak holds them.

Parts (each resumes: cells already in ``--out`` are skipped, so a run stopped by a time limit is continued by the
same command)::

    python benchmarks/user_path.py --part n16384            # the full matrix at N = 16384, without compile
    python benchmarks/user_path.py --part n16384-compile    # the same cells with a compiled student
    python benchmarks/user_path.py --part ends              # N = 4096 and 32768: bf16-mixed and bf16-true, sdpa, four
    python benchmarks/user_path.py --part naive             # the KD without the op at N = 4096 and 8192
    python benchmarks/user_path.py --part offload           # N = 16384 and 32768: bf16-mixed, sdpa, four, the teacher
                                                            # resident and offloaded
    python benchmarks/user_path.py --part fp16              # N = 16384: 16-mixed, sdpa, four and uniform, the
                                                            # teacher resident, and offloaded for uniform
    python benchmarks/user_path.py --part compiled-teacher  # N = 4096: bf16-mixed, sdpa, four, the teacher eager
                                                            # and compiled, the student eager and compiled
    python benchmarks/user_path.py --part windowed          # N = 8192: bf16-mixed, sdpa, four, the models as built
                                                            # and as Mistral models with a 2048-token sliding window
    python benchmarks/user_path.py --part padded            # N = 4096: bf16-mixed, sdpa, four, batches of 4
                                                            # sequences, of full length and right-padded
    python benchmarks/user_path.py --part packed            # N = 16384: bf16-mixed, sdpa, four, one sequence and
                                                            # the same tokens as 8 packed documents
    python benchmarks/user_path.py --part accuracy          # each precision setting against the float64 oracle
    python benchmarks/user_path.py --smoke                  # every cell kind at N = 512, 2 steps, into /tmp
    python benchmarks/user_path.py --render                 # the committed results into docs/guides/precision.md
    python benchmarks/user_path.py --peak N16384/bf16-true/sdpa/eager/uniform   # what is live at a cell's peak
                                                            # (a cell key; offloaded: .../four/teacher-offload)

Needs a CUDA GPU, ``transformers`` and the repository's packages (``PYTHONPATH=kernels:.``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
ROOT = os.path.dirname(HERE)
PRECISION_DOC = os.path.join(ROOT, "docs", "guides", "precision.md")
REAL_TEACHERS_DOC = os.path.join(ROOT, "docs", "guides", "real-teachers.md")
HF_MODELS_DOC = os.path.join(ROOT, "docs", "guides", "hf-models.md")
README = os.path.join(ROOT, "README.md")
#: The committed run the docs render.
RESULT = os.path.join(RESULTS, "nvidia-h100-80gb-hbm3-user-path.json")
#: The run of parts ``offload``, ``fp16``, ``n16384-compile`` and ``compiled-teacher`` the docs render (their own
#: card: one H200).
H200_RESULT = os.path.join(RESULTS, "nvidia-h200-user-path.json")

PRECISIONS = ("bf16-mixed", "bf16-true", "16-mixed", "32-true")
#: The device the cells run on ("cuda"; "cpu" for ``--cpu-smoke``, which checks the script itself on tiny models).
DEVICE = "cuda"
ATTENTIONS = ("sdpa", "flex_attention")
#: student layer -> teacher layer of the four pairs (the student's 16 layers against the teacher's 22, spread evenly)
FOUR_PAIRS = {3: 5, 7: 10, 11: 15, 15: 21}
#: Part ``windowed``: the sliding window of both models (Mistral 7B's is 4096 tokens at up to 32768).
WINDOW = 2048
#: Part ``padded``: each sequence's share of ``N`` in a batch right-padded to its longest sequence, as a data collator
#: pads it (the real-batches benchmark's right-padded batch).
PADDED_FRACTIONS = (1.0, 0.8, 0.55, 0.3)
#: Part ``packed``: documents packed into one row (the real-batches benchmark's lengths for the row's ``N``).
PACKED_DOCUMENTS = 8
TEACHER = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=8)
STUDENT = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
               num_key_value_heads=4)
VOCAB = 32000
#: ``--cpu-smoke``: the same depths and head counts, tiny widths
TINY = {"hidden_size": 64, "intermediate_size": 64}
#: The targets of the user-path issue, checked by the rendered table.
PIPELINE_TARGET = 1.15  # extra time <= 1.15 x (teacher's pass + the KL ops)
MEMORY_TARGET = 1.15  # peak memory <= 1.15 x the plain step's
HEADLINE_TARGET = 2.6  # bf16-mixed, N = 32768, four pairs: step <= 2.6 x the plain step


#: The parts of cells (``--part``; part ``accuracy`` measures no cell).
PARTS = ("n16384", "n16384-compile", "ends", "naive", "offload", "fp16", "compiled-teacher", "windowed", "padded",
         "packed")
#: The placement of a distilled cell's teacher unless the cell names another (the callback's default).
RESIDENT = "student"


@dataclass(frozen=True)
class Cell:
    """One fit: sequence length, precision, attention implementation, compiled or not, what is distilled, and where
    the teacher is (the callback's ``teacher_device``)."""

    n: int
    precision: str
    attention: str
    compiled: bool
    pairs: str  # "plain" | "four" | "uniform" | "naive"
    teacher_device: str = RESIDENT  # "student" (resident) | "offload"
    teacher_compiled: bool = False  # the callback's teacher wrapped in torch.compile
    window: int = 0  # > 0: both models are Mistral models of the same shapes with this sliding window
    batch: int = 1  # sequences per step
    padded: bool = False  # the batch right-padded: its sequences' lengths are PADDED_FRACTIONS of n
    documents: int = 0  # > 0: each row this many packed documents (position_ids restarting, no attention mask)

    @property
    def key(self) -> str:
        """``N<n>/<precision>/<attention>/<eager|compiled>/<pairs>``, then ``/teacher-<device>`` when the teacher is
        not resident, ``/teacher-compiled`` when it is compiled, ``/window-<w>`` for windowed models,
        ``/batch-<b>`` for more than one sequence a step, ``/padded`` for a right-padded batch and ``/packed-<d>``
        for rows of packed documents (the keys of the runs before these fields are unchanged)."""
        key = f"N{self.n}/{self.precision}/{self.attention}/{'compiled' if self.compiled else 'eager'}/{self.pairs}"
        key = key if self.teacher_device == RESIDENT else f"{key}/teacher-{self.teacher_device}"
        key = f"{key}/teacher-compiled" if self.teacher_compiled else key
        key = f"{key}/window-{self.window}" if self.window else key
        key = f"{key}/batch-{self.batch}" if self.batch != 1 else key
        key = f"{key}/padded" if self.padded else key
        return f"{key}/packed-{self.documents}" if self.documents else key

    @classmethod
    def from_key(cls, key: str) -> Cell:
        """The cell of a :attr:`key`."""
        n, precision, attention, mode, pairs, *rest = key.split("/")
        windows = [int(t.removeprefix("window-")) for t in rest if t.startswith("window-")]
        batches = [int(t.removeprefix("batch-")) for t in rest if t.startswith("batch-")]
        documents = [int(t.removeprefix("packed-")) for t in rest if t.startswith("packed-")]
        teacher = [t for t in rest if t.startswith("teacher-")]
        compiled_teacher = "teacher-compiled" in teacher
        devices = [t.removeprefix("teacher-") for t in teacher if t != "teacher-compiled"]
        return cls(int(n.removeprefix("N")), precision, attention, mode == "compiled", pairs,
                   devices[0] if devices else RESIDENT, compiled_teacher, windows[0] if windows else 0,
                   batches[0] if batches else 1, "padded" in rest, documents[0] if documents else 0)

    @property
    def baseline(self) -> Cell:
        return Cell(self.n, self.precision, self.attention, self.compiled, "plain", window=self.window,
                    batch=self.batch, padded=self.padded, documents=self.documents)


def part_cells(part: str) -> list[Cell]:
    """The cells of a part (see the module docstring), plain cells first within each setting."""
    cells: list[Cell] = []
    if part not in PARTS + ("smoke", "cpu-smoke"):
        raise SystemExit(f"unknown part {part!r}")
    if part in ("n16384", "n16384-compile"):
        compiled = part.endswith("compile")
        for precision in PRECISIONS:
            for attention in ATTENTIONS:
                cells += [Cell(16384, precision, attention, compiled, p) for p in ("plain", "four", "uniform")]
    if part == "n16384-compile":  # the setups people compile first: the rest as far as time allows
        cells.sort(key=lambda c: (c.precision not in ("bf16-mixed", "bf16-true"), c.attention != "sdpa"))
    if part == "ends":
        cells += [c for n in (4096, 32768) for precision in ("bf16-mixed", "bf16-true")
                  for c in _sdpa_four(n, precision)]
    if part == "offload":  # the teacher's weights off the GPU: resident and offloaded side by side
        cells += [c for n in (16384, 32768) for c in _sdpa_four(n, "bf16-mixed", ("student", "offload"))]
        cells += [Cell(16384, "bf16-mixed", "sdpa", False, "uniform", t) for t in ("student", "offload")]
    if part == "fp16":  # 16-mixed, whose op keeps fp32 gradients: resident, and offloaded with the most pairs
        cells += _sdpa_four(16384, "16-mixed")
        cells += [Cell(16384, "16-mixed", "sdpa", False, "uniform", t) for t in ("student", "offload")]
    if part == "compiled-teacher":  # N = 4096, where a step is bound by the host: the teacher eager and compiled
        for student in (False, True):
            cells += [Cell(4096, "bf16-mixed", "sdpa", student, p) for p in ("plain", "four")]
            cells.append(Cell(4096, "bf16-mixed", "sdpa", student, "four", teacher_compiled=True))
    if part == "windowed":  # sliding-window models (Mistral's, Qwen2's), and the same shapes without a window
        for window in (0, WINDOW):
            cells += [Cell(8192, "bf16-mixed", "sdpa", False, p, window=window) for p in ("plain", "four")]
    if part == "padded":  # a batch of sequences of full length, and the same batch right-padded
        for padded in (False, True):
            cells += [Cell(4096, "bf16-mixed", "sdpa", False, p, batch=len(PADDED_FRACTIONS), padded=padded)
                      for p in ("plain", "four")]
    if part == "packed":  # one document, and the same tokens as packed documents (both run here, in one run)
        for documents in (1, PACKED_DOCUMENTS):
            cells += [Cell(16384, "bf16-mixed", "sdpa", False, p, documents=documents) for p in ("plain", "four")]
    if part == "naive":
        for n in (4096, 8192):
            cells += [Cell(n, "bf16-mixed", "sdpa", False, p) for p in ("plain", "naive")]
    if part == "cpu-smoke":  # what runs on a CPU: the script's logic on tiny models
        cells += [Cell(64, precision, "sdpa", False, p) for precision in ("bf16-mixed", "32-true")
                  for p in ("plain", "four")]
        cells += [Cell(64, "bf16-true", "sdpa", False, "uniform"), Cell(64, "bf16-mixed", "sdpa", False, "naive")]
        cells.append(Cell(64, "bf16-mixed", "sdpa", False, "four", "offload"))
        cells += [Cell(64, "bf16-mixed", "sdpa", False, p, window=16) for p in ("plain", "four")]
        cells += [Cell(64, "bf16-mixed", "sdpa", False, p, batch=len(PADDED_FRACTIONS), padded=True)
                  for p in ("plain", "four")]
        cells += [Cell(64, "bf16-mixed", "sdpa", False, p, documents=3) for p in ("plain", "four")]
    if part == "smoke":  # every kind of cell once
        cells += [Cell(512, precision, "sdpa", False, p) for precision in PRECISIONS for p in ("plain", "four")]
        cells += [Cell(512, "bf16-mixed", "flex_attention", False, p) for p in ("plain", "four")]
        cells += [Cell(512, "bf16-mixed", "sdpa", False, "uniform"), Cell(512, "bf16-mixed", "sdpa", False, "naive")]
        cells += [Cell(512, "bf16-mixed", "sdpa", True, p) for p in ("plain", "four")]
        cells.append(Cell(512, "bf16-mixed", "sdpa", False, "four", "offload"))
        cells.append(Cell(512, "bf16-mixed", "sdpa", False, "four", teacher_compiled=True))
        cells += [Cell(512, "bf16-mixed", "sdpa", False, p, window=128) for p in ("plain", "four")]
        cells += [Cell(512, "bf16-mixed", "sdpa", False, p, batch=len(PADDED_FRACTIONS), padded=True)
                  for p in ("plain", "four")]
        cells += [Cell(512, "bf16-mixed", "sdpa", False, p, documents=PACKED_DOCUMENTS) for p in ("plain", "four")]
    return cells


def _sdpa_four(n: int, precision: str, teachers: tuple[str, ...] = (RESIDENT,)) -> list[Cell]:
    """The plain cell and the four-pair cells (one per teacher placement) of an eager sdpa student."""
    return [Cell(n, precision, "sdpa", False, "plain")] + [Cell(n, precision, "sdpa", False, "four", t)
                                                          for t in teachers]


# ---------------------------------------------------------------------------------------------- models and the fit
def llama(shape: dict, n: int, attention: str, seed: int, dtype, window: int = 0):
    """A Llama model of ``shape`` built from its config; with ``window``, a Mistral model of the same shapes whose
    every layer attends through a ``window``-token sliding window."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    if DEVICE == "cpu":
        shape = {**shape, **TINY, "num_attention_heads": shape["num_attention_heads"] // 4,
                 "num_key_value_heads": shape["num_key_value_heads"] // 4}
    config, model = (MistralConfig, MistralForCausalLM) if window else (LlamaConfig, LlamaForCausalLM)
    cfg = config(**shape, vocab_size=VOCAB if DEVICE == "cuda" else 97, max_position_embeddings=max(n, 2048),
                 attn_implementation=attention, tie_word_embeddings=False, **({"sliding_window": window} if window
                                                                             else {}))
    with torch.device(DEVICE):
        return model(cfg).to(dtype)


def enable_checkpointing(model) -> None:
    """Gradient checkpointing as a user turns it on (transformers' default kwargs)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


def batch_of(n: int, seed: int = 0, batch: int = 1, padded: bool = False, documents: int = 0) -> dict:
    """``batch`` sequences of ``n`` random tokens; ``padded``: right-padded, the sequences ``PADDED_FRACTIONS`` of
    ``n`` long (their padding masked out of the attention and of the labels, as a data collator pads them);
    ``documents``: each row that many packed documents, as ``DataCollatorWithFlattening`` packs them
    (``position_ids`` restarting, no attention mask, and ``use_cache=False``, without which transformers' sdpa
    attends across them)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB if DEVICE == "cuda" else 97, (batch, n), generator=g)
    if documents:
        if HERE not in sys.path:  # (called once per batch)
            sys.path.insert(0, HERE)
        from real_batches import doc_lengths

        positions = torch.cat([torch.arange(length) for length in doc_lengths(n, documents)])
        return {"input_ids": ids, "position_ids": positions.expand(batch, n).clone(), "labels": ids.clone(),
                "use_cache": False}
    mask = torch.ones_like(ids)
    if padded:
        if batch != len(PADDED_FRACTIONS):
            raise ValueError(f"a padded batch has {len(PADDED_FRACTIONS)} sequences, not {batch}")
        for row, fraction in enumerate(PADDED_FRACTIONS):
            mask[row, round(fraction * n):] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100)}


def _module_classes():
    import lightning as L
    import torch

    class StudentLM(L.LightningModule):
        """The user's module: the Hugging Face causal LM's own loss."""

        def __init__(self, model) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-5)

    class NaiveKD(StudentLM):
        """The KD without the op: both models return their attention maps and the KL is taken on them (each teacher
        head against the student head of its group)."""

        def __init__(self, model, teacher) -> None:
            super().__init__(model)
            object.__setattr__(self, "_teacher", teacher)  # frozen, outside the module (not trained, not saved)

        def training_step(self, batch, batch_idx):
            with torch.no_grad():
                maps_t = self._teacher(input_ids=batch["input_ids"], output_attentions=True, use_cache=False).attentions
            out = self.model(**batch, output_attentions=True)
            kl = 0.0
            for s, t in FOUR_PAIRS.items():
                p_t = maps_t[t].float()
                group = p_t.shape[1] // out.attentions[s].shape[1]
                log_s = out.attentions[s].float().clamp_min(1e-30).log().repeat_interleave(group, dim=1)
                kl = kl + (p_t * (p_t.clamp_min(1e-30).log() - log_s)).sum(-1).mean() / len(FOUR_PAIRS)
            return out.loss + kl

    class StepTimer(L.Callback):
        """Wall-clock time of every training batch, the GPU drained at both ends, and the host's part of it: the
        time until the host has queued the whole step (a step whose host time reaches its wall time is bound by the
        host)."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.host: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            sync()
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.host.append(time.perf_counter() - self._start)
            sync()
            self.times.append(time.perf_counter() - self._start)
            print(f"  step {batch_idx}: {self.times[-1] * 1e3:.1f} ms", flush=True)

    return StudentLM, NaiveKD, StepTimer


def sync() -> None:
    """Wait for the GPU (a no-op on the CPU)."""
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


@contextlib.contextmanager
def matmul_precision(setting: str) -> Iterator[None]:
    """``torch.set_float32_matmul_precision(setting)`` inside the block."""
    import torch

    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(setting)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def median_time(fn, repeats: int = 5) -> float:
    """The median wall-clock seconds of ``fn()`` (the GPU drained at both ends), after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def op_calls(distiller, model, batch, context) -> list[tuple[tuple, dict]]:
    """The ``attention_kl`` calls the loss makes in one step (tensors and options), from a step run by hand."""
    from lightning_streamkl import terms

    calls: list[tuple[tuple, dict]] = []
    op = terms.attention_kl

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return op(*args, **kwargs)

    terms.attention_kl = spy
    try:
        with context:
            distiller.begin_step(batch)
            with distiller.student_recording():
                model(**batch)
            distiller.end_step(batch)
    finally:
        terms.attention_kl = op
    return calls


def replay_seconds(call: tuple[tuple, dict]) -> float:
    """One ``attention_kl`` call's forward+backward alone, on copies of its tensors (the student's requiring grad)."""
    import torch

    from streamkl import attention_kl

    args, kwargs = call
    q_t, k_t = (x.detach() for x in args[:2])
    q_s, k_s = (x.detach().clone().requires_grad_() for x in args[2:4])

    def step():
        out = attention_kl(q_t, k_t, q_s, k_s, **kwargs)
        kl = out.kl if kwargs.get("return_count") else out  # the loss's calls also return their row count
        kl.backward(torch.ones_like(kl))
        q_s.grad = k_s.grad = None

    with torch.autocast(DEVICE, enabled=False):
        return median_time(step, repeats=10)


def breakdown(distill, module, batch: dict, plugin) -> dict[str, Any]:
    """The irreducible parts of a distilled step, measured with the model where the fit left it (call it before the
    fit ends: Lightning moves the module back to the CPU then): the teacher's pass up to its deepest paired layer,
    and each ``attention_kl`` call of a step replayed alone."""
    distiller = distill.distiller

    def teacher_pass():
        with plugin.forward_context():
            distiller.run_teacher(batch)
        distiller.clear()

    out: dict[str, Any] = {"teacher_s": median_time(teacher_pass)}
    calls = op_calls(distiller, module.model, batch, plugin.forward_context())
    out["kl_s"] = [replay_seconds(c) for c in calls]
    out["kl_calls"] = [{"shapes": [list(x.shape) for x in c[0][:4]], "dtypes": [str(x.dtype) for x in c[0][:4]],
                        "reduction": c[1].get("reduction"),
                        "window": list(c[1]["window"]) if c[1].get("window") else None,
                        "general_mask": c[1].get("attn_mask") is not None,
                        "key_padding": c[1].get("key_padding_mask") is not None,
                        "packed": c[1].get("cu_seqlens_q") is not None} for c in calls]
    out["pairing"] = distiller.describe()
    return out


def run_cell(cell: Cell, teacher, steps: int, warmup: int) -> dict[str, Any]:
    """Fit the student of ``cell`` for ``warmup + steps`` steps; the record of the cell."""
    import lightning as L
    import torch

    from lightning_streamkl import StreamKLDistillation, explicit_pairs, uniform_pairs

    StudentLM, NaiveKD, StepTimer = _module_classes()
    teacher.config._attn_implementation = "eager" if cell.pairs == "naive" else cell.attention
    record: dict[str, Any] = {"key": cell.key, **cell.__dict__}
    offloaded = cell.pairs != "plain" and cell.teacher_device == "offload"
    teacher.to("cpu" if offloaded else DEVICE)  # where the cell's callback keeps it, before memory is read
    gc.collect()
    cuda = DEVICE == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    with matmul_precision("high" if cell.precision == "32-true" else "highest"):
        hf = llama(STUDENT, cell.n, "eager" if cell.pairs == "naive" else cell.attention, seed=1,
                   dtype=torch.float32, window=cell.window)
        record["student_params"] = sum(p.numel() for p in hf.parameters())
        enable_checkpointing(hf)
        hf.train()
        student = torch.compile(hf) if cell.compiled else hf
        module = NaiveKD(student, teacher) if cell.pairs == "naive" else StudentLM(student)
        timer = StepTimer()
        callbacks: list[Any] = [timer]
        data = [batch_of(cell.n, seed, cell.batch, cell.padded, cell.documents) for seed in range(warmup + steps)]
        if cell.pairs in ("four", "uniform"):
            pairs = explicit_pairs(FOUR_PAIRS, head_map="group") if cell.pairs == "four" else \
                uniform_pairs(teacher, hf, head_map="group")
            distill = StreamKLDistillation(torch.compile(teacher) if cell.teacher_compiled else teacher, pairs=pairs,
                                           teacher_device=cell.teacher_device)

            class Breakdown(L.Callback):
                def on_train_end(self, trainer, pl_module):
                    if cuda:  # the steps' peak, before the breakdown's own calls
                        record["step_peak_bytes"] = torch.cuda.max_memory_allocated()
                        if TRACES is not None:  # --peak: the allocation history of the steps
                            TRACES.append(torch.cuda.memory._snapshot())
                    batch = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in data[0].items()}
                    try:
                        record.update(breakdown(distill, pl_module, batch, trainer.precision_plugin))
                    except Exception as err:  # the steps are a result without it
                        traceback.print_exc()
                        record["breakdown_error"] = f"{type(err).__name__}: {str(err).splitlines()[0]}"

            callbacks += [distill, Breakdown()]
        trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, precision=cell.precision,
                            max_steps=warmup + steps, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))
    record.update(step_s=statistics.median(timer.times[warmup:]), steps_s=timer.times,
                  host_s=statistics.median(timer.host[warmup:]))
    if cuda:
        resident = _bytes(teacher) if cell.pairs in ("four", "uniform", "naive") and not offloaded else 0
        peak = record.pop("step_peak_bytes", None) or torch.cuda.max_memory_allocated()
        record["peak_gib"] = (peak - base + resident) / 2**30
    else:
        record["peak_gib"] = 1.0  # not measured on the CPU
    return record


#: With ``--peak``, the CUDA allocation history of each cell's steps (see :func:`peak_allocations`).
TRACES: list | None = None
#: The frames an allocation is named by in ``--peak``'s table (the first few from these files).
NAMED_FRAMES = ("modeling_llama", "streamkl", "user_path", "checkpoint", "adam", "lightning/pytorch")


def peak_allocations(snapshot: dict, rows: int = 12) -> tuple[float, list[tuple[float, str]]]:
    """``(GiB, [(MiB, where)])``: what the traced allocations hold at their peak, summed by where they were made (the
    first three frames from :data:`NAMED_FRAMES` files; allocations made before the trace began are not in it)."""
    events = snapshot["device_traces"][0]
    live: dict[int, dict] = {}
    current = peak = peak_at = 0
    for i, event in enumerate(events):
        if event["action"] == "alloc":
            live[event["addr"]] = event
            current += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in live:
            current -= live.pop(event["addr"])["size"]
        if current > peak:
            peak, peak_at = current, i
    live = {}
    for event in events[:peak_at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    where: dict[str, int] = {}
    for event in live.values():
        frames = [f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" for f in event["frames"]
                  if any(name in f["filename"] for name in NAMED_FRAMES)][:3]
        key = " < ".join(frames) or "(torch internals)"
        where[key] = where.get(key, 0) + event["size"]
    top = sorted(where.items(), key=lambda kv: -kv[1])[:rows]
    return peak / 2**30, [(size / 2**20, key) for key, size in top]


def peak_trace(key: str) -> None:
    """Fit the cell ``key`` (e.g. ``N16384/bf16-true/sdpa/eager/uniform``) for two steps with the CUDA allocation
    history on, and print what is live at the steps' peak."""
    import torch

    global TRACES
    cell = Cell.from_key(key)
    teacher = llama(TEACHER, cell.n, cell.attention, seed=0, dtype=torch.bfloat16, window=cell.window).eval()
    TRACES = []
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    record = run_cell(cell, teacher, steps=1, warmup=1)
    torch.cuda.memory._record_memory_history(enabled=None)
    snapshot = TRACES[-1] if TRACES else torch.cuda.memory._snapshot()
    gib, top = peak_allocations(snapshot)
    print(f"{key}: peak {record['peak_gib']:.2f} GiB with the teacher's weights; traced allocations at their peak "
          f"{gib:.2f} GiB, of which:")
    for mib, where in top:
        print(f"  {mib:9.1f} MiB  {where}")


def run_part(part: str, out: str, steps: int, warmup: int, budget_s: float | None = None) -> dict:
    """Run the cells of ``part`` that ``out`` does not hold yet (or that failed, unless out of memory), rewriting
    ``out`` after each; with ``budget_s``, start no cell once that many seconds have passed."""
    import lightning
    import torch
    import transformers
    import triton

    data: dict[str, Any] = {}
    if os.path.exists(out):
        with open(out) as f:
            data = json.load(f)
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    if data.get("device", device) != device:
        raise SystemExit(f"{out} holds a run on {data['device']}, not {device}; pass another --out")
    data.update(device=device, torch=torch.__version__, triton=triton.__version__,
                transformers=transformers.__version__, lightning=lightning.__version__,
                teacher=TEACHER, student=STUDENT, vocab=VOCAB, four_pairs={str(k): v for k, v in FOUR_PAIRS.items()},
                steps=steps, warmup=warmup)
    cells = data.setdefault("cells", {})
    todo = [c for c in part_cells(part)
            if c.key not in cells or cells[c.key].get("error", "out of memory").split(":")[0] != "out of memory"]
    teachers: dict[int, Any] = {}
    began = time.perf_counter()
    for cell in todo:
        if budget_s is not None and time.perf_counter() - began > budget_s:
            print(f"budget of {budget_s:.0f} s spent: {len(todo) - todo.index(cell)} cells left for the next run")
            break
        if cell.compiled or cell.teacher_compiled:
            torch._dynamo.reset()
        model = (cell.n, cell.window)
        if model not in teachers:
            teachers.clear()
            gc.collect()
            teachers[model] = llama(TEACHER, cell.n, cell.attention, seed=0, dtype=torch.bfloat16,
                                    window=cell.window).eval()
            data["teacher_gib"] = _bytes(teachers[model]) / 2**30
            data["teacher_params"] = sum(p.numel() for p in teachers[model].parameters())
        print(f"{cell.key} ...", flush=True)
        start = time.perf_counter()
        try:
            record = run_cell(cell, teachers[model], steps, warmup)
        except torch.OutOfMemoryError:
            total = torch.cuda.get_device_properties(0).total_memory / 2**30
            record = {"key": cell.key, **cell.__dict__, "error": f"out of memory ({total:.0f} GiB card)"}
        except Exception as err:  # a cell that fails is a result (e.g. compile not supported)
            traceback.print_exc()
            record = {"key": cell.key, **cell.__dict__, "error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
        record["wall_s"] = time.perf_counter() - start
        if os.environ.get("STREAMKL_COMMIT"):  # the code a cell ran (a run may resume on a later commit)
            record["commit"] = os.environ["STREAMKL_COMMIT"]
        cells[cell.key] = record
        if "student_params" in record:
            data["student_params"] = record.pop("student_params")
        _write(out, data)
        print(summary_line(record, cells), flush=True)
    return data


def _write(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(f"{path}.tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(f"{path}.tmp", path)


# ---------------------------------------------------------------------------------------------- accuracy
#: The settings whose accuracy is measured: (name, autocast dtype or None, float32 matmul precision)
ACCURACY_SETTINGS = (("bf16 (autocast)", "bfloat16", "highest"), ("fp16 (autocast)", "float16", "highest"),
                     ("fp32 (TF32)", None, "high"), ("fp32 (IEEE)", None, "highest"))


def accuracy(seed: int = 0) -> list[dict[str, Any]]:
    """The relative L2 error of the per-row KL and of the student's query and key gradients of each setting against
    the float64 oracle on the same float32 inputs (B=1, H=16, N=4096, D=64, causal), for random attention and for a
    student close to its teacher."""
    import torch

    from streamkl import attention_kl, naive_attention_kl

    def rel(a, b):
        return float(torch.linalg.vector_norm(a.double() - b) / torch.linalg.vector_norm(b))

    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (1, 16, 4096, 64)
    rows = []
    for case in ("random", "close"):
        q_t, k_t = (torch.randn(shape, generator=g, device="cuda") * 1.5 for _ in range(2))
        if case == "random":
            q_s, k_s = (torch.randn(shape, generator=g, device="cuda") * 1.5 for _ in range(2))
        else:  # the student is its teacher made slightly sharper, plus noise
            q_s, k_s = q_t * 1.05 + 0.01 * torch.randn(shape, generator=g, device="cuda"), k_t.clone()
        exact = [x.double().requires_grad_(i >= 2) for i, x in enumerate((q_t, k_t, q_s, k_s))]
        oracle = naive_attention_kl(*exact, causal=True, reduction="none", compute_dtype=torch.float64)
        upstream = torch.randn(oracle.shape, generator=g, device="cuda", dtype=torch.float64)
        d_q, d_k = torch.autograd.grad((oracle * upstream).sum(), exact[2:])
        for name, autocast, setting in ACCURACY_SETTINGS:
            q, k = q_s.detach().clone().requires_grad_(), k_s.detach().clone().requires_grad_()
            with matmul_precision(setting), \
                    torch.autocast("cuda", dtype=getattr(torch, autocast or "float32"), enabled=autocast is not None):
                kl = attention_kl(q_t, k_t, q, k, causal=True, reduction="none")
            got_q, got_k = torch.autograd.grad((kl * upstream.float()).sum(), (q, k))
            rows.append({"case": case, "setting": name, "kl": rel(kl, oracle), "dq": rel(got_q, d_q),
                         "dk": rel(got_k, d_k)})
            print(rows[-1], flush=True)
    return rows


def accuracy_table(data: dict) -> str:
    rows = ["| products | KL, random attention | dQ_s, dK_s, random | KL, student close to teacher | "
            "dQ_s, dK_s, close |",
            "|---|---|---|---|---|"]
    by = {(r["case"], r["setting"]): r for r in data.get("accuracy", [])}
    for name, _, _ in ACCURACY_SETTINGS:
        r, c = by.get(("random", name)), by.get(("close", name))
        if r and c:
            rows.append(f"| {name} | {r['kl']:.1e} | {r['dq']:.1e}, {r['dk']:.1e} | {c['kl']:.1e} | "
                        f"{c['dq']:.1e}, {c['dk']:.1e} |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------- tables
def derived(record: dict, cells: dict) -> dict[str, float] | None:
    """Ratios of a distilled cell against its plain cell of the same run: step and memory, and the pipeline's
    extra time over its irreducible parts (``None`` when either cell failed or is missing)."""
    plain = cells.get(Cell.from_key(record["key"]).baseline.key)
    if plain is None or "error" in plain or "error" in record:
        return None
    out = {"ratio": record["step_s"] / plain["step_s"], "memory": record["peak_gib"] / plain["peak_gib"]}
    if "teacher_s" in record:
        irreducible = record["teacher_s"] + sum(record["kl_s"])
        out.update(extra_s=record["step_s"] - plain["step_s"], irreducible_s=irreducible,
                   pipeline=(record["step_s"] - plain["step_s"]) / irreducible)
    return out


def summary_line(record: dict, cells: dict) -> str:
    if "error" in record:
        return f"{record['key']}: {record['error']}"
    line = f"{record['key']}: step {record['step_s'] * 1e3:.1f} ms, peak {record['peak_gib']:.2f} GiB"
    d = derived(record, cells)
    if d:
        line += f", {d['ratio']:.2f}x plain, memory {d['memory']:.2f}x"
        if "pipeline" in d:
            line += (f", teacher {record['teacher_s'] * 1e3:.1f} ms + KL {sum(record['kl_s']) * 1e3:.1f} ms, "
                     f"extra/irreducible {d['pipeline']:.2f}")
    return line


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f}" if seconds >= 0.1 else f"{seconds * 1e3:.1f}"


def matrix_table(data: dict, n: int, compiled: bool = False) -> str:
    """The cells of one ``N`` with an eager (or ``compiled``) student as a markdown table: plain step, step with the
    callback, ratio, memory ratio and the breakdown of the extra time."""
    cells = data["cells"]
    ordered = sorted(cells.values(), key=lambda r: (PRECISIONS.index(r["precision"]), ATTENTIONS.index(r["attention"]),
                                                    r["compiled"], r["pairs"] != "four"))
    rows = ["| precision | attention | student | pairs | plain step (ms) | with attention KL (ms) | ratio | "
            "teacher to the deepest pair (ms) | KL ops, fwd+bwd (ms) | rest (ms) | extra / (teacher + KL) | "
            "peak memory ratio | without the teacher's weights |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for record in ordered:
        if record["n"] != n or record["pairs"] in ("plain", "naive") or record["compiled"] != compiled \
                or not _resident(record) or record.get("window"):
            continue
        plain = cells.get(Cell(n, record["precision"], record["attention"], record["compiled"], "plain").key, {})
        head = (f"| {record['precision']} | {record['attention']} | {'compiled' if record['compiled'] else 'eager'} | "
                f"{record['pairs']} | ")
        if "error" in record or "error" in plain:
            why = record.get("error") or plain.get("error")
            rows.append(head + f"{_ms(plain['step_s']) if 'step_s' in plain else '–'} | {why} | | | | | | | |")
            continue
        d = derived(record, cells)
        kl = sum(record["kl_s"])
        rest = d["extra_s"] - record["teacher_s"] - kl
        own = (record["peak_gib"] - data["teacher_gib"]) / plain["peak_gib"]
        rows.append(head + f"{_ms(plain['step_s'])} | {_ms(record['step_s'])} | {d['ratio']:.2f}× | "
                    f"{_ms(record['teacher_s'])} | {_ms(kl)} | {_ms(rest)} | {d['pipeline']:.2f} | "
                    f"{d['memory']:.2f}× | {own:.2f}× |")
    return "\n".join(rows)


def naive_table(data: dict) -> str:
    cells = data["cells"]
    rows = ["| N | plain step (ms) | KD on attention maps (ms) | ratio | peak memory (GiB), plain / KD on maps |",
            "|---|---|---|---|---|"]
    for record in cells.values():
        if record["pairs"] != "naive":
            continue
        plain = cells.get(Cell.from_key(record["key"]).baseline.key, {})
        if "error" in record:
            rows.append(f"| {record['n']} | {_ms(plain['step_s']) if 'step_s' in plain else '–'} | {record['error']} | "
                        f"| {plain.get('peak_gib', 0):.1f} / – |")
            continue
        rows.append(f"| {record['n']} | {_ms(plain['step_s'])} | {_ms(record['step_s'])} | "
                    f"{record['step_s'] / plain['step_s']:.1f}× | {plain['peak_gib']:.1f} / {record['peak_gib']:.1f} |")
    return "\n".join(rows)


def headline(data: dict) -> str:
    """One sentence for the README: the documented setup at the longest measured N."""
    cells = data["cells"]
    four = [r for r in cells.values() if r["pairs"] == "four" and r["precision"] == "bf16-mixed"
            and r["attention"] == "sdpa" and not r["compiled"] and "error" not in r and _resident(r)]
    if not four:
        return "(no run)"
    record = max(four, key=lambda r: r["n"])
    d = derived(record, cells)
    student_params = data["student_params"]
    return (f"On one {data['device']}, a {student_params / 1e9:.2f}B Llama student distilled from a "
            f"{data['teacher_params'] / 1e9:.2f}B Llama teacher (bf16) on four layer "
            f"pairs at N = {record['n']} under `Trainer(precision=\"bf16-mixed\")` took {d['ratio']:.2f}× the plain "
            f"student's step ({_ms(record['step_s'])} ms against {_ms(record['step_s'] / d['ratio'])} ms) and "
            f"{d['memory']:.2f}× its peak memory; the teacher's own forward is most of the difference "
            f"([the user-path benchmark](docs/guides/precision.md#what-it-costs)).")


def setup_line(data: dict) -> str:
    """The models, card and software of a results file, in one paragraph."""
    t, s = data["teacher"], data["student"]
    return (f"Teacher: {data['teacher_params'] / 1e9:.2f}B parameters, {t['num_hidden_layers']} layers, "
            f"{t['num_attention_heads']} query and {t['num_key_value_heads']} key-value heads of "
            f"{t['hidden_size'] // t['num_attention_heads']}, bf16 ({data['teacher_gib']:.2f} GiB). Student: "
            f"{data['student_params'] / 1e9:.2f}B parameters, {s['num_hidden_layers']} layers, "
            f"{s['num_attention_heads']} and {s['num_key_value_heads']} heads of "
            f"{s['hidden_size'] // s['num_attention_heads']}, fp32 weights (bf16 under `bf16-true`). Measured on one "
            f"{data['device']} (torch {data['torch']}, Triton {data['triton']}, transformers {data['transformers']}, "
            f"Lightning {data['lightning']}); median of {data['steps']} steps after {data['warmup']}.")


def offload_table(data: dict, part: str) -> str:
    """The distilled cells of ``part`` (``offload``, ``fp16``) with the teacher resident and streamed from host memory,
    each against the plain cell of its ``N``: step, the teacher's pass, peak memory (the resident teacher's weights
    counted)."""
    cells = data["cells"]
    rows = ["| N | pairs | teacher | plain step (ms) | with attention KL (ms) | ratio | teacher to the deepest pair "
            "(ms) | KL ops, fwd+bwd (ms) | plain peak (GiB) | peak with attention KL (GiB) | peak memory ratio |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    distilled = {c.key for c in part_cells(part) if c.pairs != "plain"}
    for record in sorted(cells.values(), key=lambda r: (r["n"], r["pairs"] != "four", not _resident(r))):
        if record["key"] not in distilled or "error" in record:
            continue
        plain = cells[Cell.from_key(record["key"]).baseline.key]
        d = derived(record, cells)
        where = "resident" if _resident(record) else "`teacher_device=\"offload\"`"
        rows.append(f"| {record['n']} | {record['pairs']} | {where} | {_ms(plain['step_s'])} | "
                    f"{_ms(record['step_s'])} | {d['ratio']:.2f}× | {_ms(record['teacher_s'])} | "
                    f"{_ms(sum(record['kl_s']))} | {plain['peak_gib']:.2f} | {record['peak_gib']:.2f} | "
                    f"{d['memory']:.2f}× |")
    return "\n".join(rows)


def _distilled(cells: dict, part: str) -> Iterator[tuple[Cell, dict, dict]]:
    """``(cell, record, plain record)`` of each distilled cell of ``part`` that ran, in the part's order."""
    for cell in part_cells(part):
        record = cells.get(cell.key)
        if cell.pairs != "plain" and record is not None and "error" not in record:
            yield cell, record, cells[cell.baseline.key]


def compiled_teacher_table(data: dict) -> str:
    """The cells of part ``compiled-teacher``: for an eager and a compiled student, the plain step and the four-pair
    step with the teacher eager and compiled, each with the host's time to queue the step (the median over the
    timed steps; the host-bound steps are those whose host time reaches their wall time)."""
    cells = data["cells"]
    rows = ["| student | teacher | plain step (ms) | with attention KL (ms) | ratio | host: plain step (ms) | host: "
            "with attention KL (ms) | teacher to the deepest pair (ms) | KL ops, fwd+bwd (ms) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for cell, record, plain in _distilled(cells, "compiled-teacher"):
        rows.append(f"| {'compiled' if cell.compiled else 'eager'} | "
                    f"{'`torch.compile(teacher)`' if cell.teacher_compiled else 'eager'} | {_ms(plain['step_s'])} | "
                    f"{_ms(record['step_s'])} | {derived(record, cells)['ratio']:.2f}× | {_ms(plain['host_s'])} | "
                    f"{_ms(record['host_s'])} | {_ms(record['teacher_s'])} | {_ms(sum(record['kl_s']))} |")
    return "\n".join(rows)


def windowed_table(data: dict) -> str:
    """The cells of part ``windowed``: the plain and the four-pair step of the models as built (full causal
    attention) and of the same shapes as Mistral models with a sliding window, whose layers' 4-D masks the capture
    reads as the window (the op then visits only the band)."""
    cells = data["cells"]
    rows = ["| attention | plain step (ms) | with attention KL (ms) | ratio | teacher to the deepest pair (ms) | "
            "KL ops, fwd+bwd (ms) | plain peak (GiB) | peak with attention KL (GiB) |",
            "|---|---|---|---|---|---|---|---|"]
    for cell, record, plain in _distilled(cells, "windowed"):
        kind = f"sliding window of {cell.window} (Mistral)" if cell.window else "full causal (Llama)"
        rows.append(f"| {kind} | {_ms(plain['step_s'])} | {_ms(record['step_s'])} | "
                    f"{derived(record, cells)['ratio']:.2f}× | {_ms(record['teacher_s'])} | "
                    f"{_ms(sum(record['kl_s']))} | {plain['peak_gib']:.2f} | {record['peak_gib']:.2f} |")
    return "\n".join(rows)


def batches_table(data: dict, part: str) -> str:
    """The cells of part ``padded`` or ``packed``: the plain and the four-pair step of each batch (sequences of full
    length; the same right-padded, which the capture reads as key padding and query masks; the same tokens as packed
    documents, which it reads as the op's packed layout)."""
    cells = data["cells"]
    rows = ["| batch | plain step (ms) | with attention KL (ms) | ratio | teacher to the deepest pair (ms) | "
            "KL ops, fwd+bwd (ms) | plain peak (GiB) | peak with attention KL (GiB) |",
            "|---|---|---|---|---|---|---|---|"]
    shares = "/".join(f"{f:.0%}".removesuffix("%") for f in PADDED_FRACTIONS)
    for cell, record, plain in _distilled(cells, part):
        kind = f"{cell.batch} × {cell.n}, " + (f"right-padded to {shares}% of N" if cell.padded else
                                              "one document" if cell.documents == 1 else
                                              f"{cell.documents} packed documents" if cell.documents else
                                              "no padding" if cell.batch > 1 else "one sequence")
        rows.append(f"| {kind} | {_ms(plain['step_s'])} | {_ms(record['step_s'])} | "
                    f"{derived(record, cells)['ratio']:.2f}× | {_ms(record['teacher_s'])} | "
                    f"{_ms(sum(record['kl_s']))} | {plain['peak_gib']:.2f} | {record['peak_gib']:.2f} |")
    return "\n".join(rows)


def _resident(record: dict) -> bool:
    """True for a cell whose teacher is resident (every cell of the runs before ``teacher_device`` was recorded)."""
    return record.get("teacher_device", RESIDENT) == RESIDENT


def _eager_ns(data: dict) -> set[int]:
    return {r["n"] for r in data["cells"].values()
            if r["pairs"] in ("four", "uniform") and not r["compiled"] and _resident(r)}


def blocks(data: dict) -> dict[str, dict[str, str]]:
    """``{file: {block name: markdown}}`` rendered from a results file: one table per ``N`` of the eager students, the
    KD without the op and the accuracy (the compiled students' table is another run's: :func:`committed_blocks`)."""
    tables = {f"user-path:n{n}": matrix_table(data, n) for n in sorted(_eager_ns(data))}
    tables["user-path:setup"] = setup_line(data)
    tables["user-path:naive"] = naive_table(data)
    tables["user-path:accuracy"] = accuracy_table(data)
    return {PRECISION_DOC: tables, README: {"user-path:readme": headline(data)}}


def committed_blocks() -> dict[str, dict[str, str]]:
    """:func:`blocks` of the committed results (:data:`RESULT`), with the compiled students' table (block
    ``user-path:compiled``) and the tables of parts ``offload`` and ``fp16`` (blocks ``user-path:offload``,
    ``user-path:fp16``), of part ``compiled-teacher`` (block ``user-path:compiled-teacher``) and of part
    ``windowed`` (block ``user-path:windowed`` of the real-teachers guide) and of parts ``padded`` and ``packed``
    (blocks ``user-path:padded``, ``user-path:packed`` of the Hugging Face models guide), each once the run holds
    it, of :data:`H200_RESULT`."""
    with open(RESULT) as f:
        rendered = blocks(json.load(f))
    with open(H200_RESULT) as f:
        h200 = json.load(f)
    card = f"{h200['device']}; median of {h200['steps']} steps after {h200['warmup']}."
    rendered[PRECISION_DOC]["user-path:compiled"] = f"{card}\n\n" + matrix_table(h200, 16384, compiled=True)
    for part, precision in (("offload", "bf16-mixed"), ("fp16", "16-mixed")):
        rendered[PRECISION_DOC][f"user-path:{part}"] = (f"{h200['device']}, {precision}, sdpa, eager student; median "
                                                        f"of {h200['steps']} steps.\n\n" + offload_table(h200, part))
    rendered[PRECISION_DOC]["user-path:compiled-teacher"] = (
        f"{h200['device']}, N = 4096, bf16-mixed, sdpa; median of {h200['steps']} steps.\n\n"
        + compiled_teacher_table(h200))
    if any(cell.key in h200["cells"] for cell in part_cells("windowed")):
        rendered[REAL_TEACHERS_DOC] = {"user-path:windowed": (
            f"{h200['device']}, N = 8192, bf16-mixed, sdpa, eager student, four pairs; median of {h200['steps']} "
            "steps.\n\n" + windowed_table(h200))}
    for part, n in (("padded", 4096), ("packed", 16384)):
        if any(cell.key in h200["cells"] for cell in part_cells(part) if cell.batch > 1 or cell.documents):
            rendered.setdefault(HF_MODELS_DOC, {})[f"user-path:{part}"] = (
                f"{h200['device']}, N = {n}, bf16-mixed, sdpa, eager student, four pairs; median of "
                f"{h200['steps']} steps.\n\n" + batches_table(h200, part))
    return rendered


def render() -> None:
    sys.path.insert(0, HERE)
    from report import write_blocks

    for doc, named in committed_blocks().items():
        write_blocks(doc, named)
        print(f"wrote {', '.join(named)} into {os.path.relpath(doc, ROOT)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=PARTS + ("accuracy",))
    parser.add_argument("--smoke", action="store_true", help="every cell kind at N = 512, 2 steps, into /tmp")
    parser.add_argument("--cpu-smoke", action="store_true", help="the script's logic on tiny models, on the CPU")
    parser.add_argument("--out", help="results file (default: benchmarks/results/<gpu>-user-path.json)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per cell")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--budget-s", type=float, help="start no cell after this many seconds (resume later)")
    parser.add_argument("--render", action="store_true", help="write the committed results' tables into the docs")
    parser.add_argument("--peak", metavar="CELL", help="what is live at the peak of one cell's steps, e.g. "
                        "N16384/bf16-true/sdpa/eager/uniform")
    args = parser.parse_args(argv)
    if args.render:
        render()
        return
    import torch

    if args.cpu_smoke:
        global DEVICE
        DEVICE = "cpu"
        run_part("cpu-smoke", args.out or "/tmp/user-path-cpu-smoke.json", steps=1, warmup=1)
        return
    if not torch.cuda.is_available():
        raise SystemExit("the user-path benchmark needs a CUDA GPU")
    tag = "".join(c if c.isalnum() else "-" for c in torch.cuda.get_device_name().lower()).strip("-")
    if args.peak:
        peak_trace(args.peak)
        return
    if args.smoke:
        run_part("smoke", args.out or "/tmp/user-path-smoke.json", steps=1, warmup=1, budget_s=args.budget_s)
        return
    if not args.part:
        parser.error("give --part, --smoke or --render")
    if args.part == "accuracy":
        out = args.out or os.path.join(RESULTS, f"{tag}-user-path.json")
        data = {"device": torch.cuda.get_device_name(), "cells": {}}
        if os.path.exists(out):
            with open(out) as f:
                data = json.load(f)
        data["accuracy"] = accuracy()
        _write(out, data)
        return
    run_part(args.part, args.out or os.path.join(RESULTS, f"{tag}-user-path.json"), args.steps, args.warmup,
             args.budget_s)


if __name__ == "__main__":
    main()
