"""Every fenced Python block of README.md and docs/ runs (issue 34: snippets used names they never define, such as
`L`, `max_steps`, `trainer_kwargs`, `data`).

The blocks of a page run in order in one namespace, as a reader pasting them would run them, with `examples/` on
`sys.path` and Lightning's `Trainer` capped to two quiet CPU steps (a snippet's `max_steps=1000` would otherwise be
the test's run time). Each block is one of:

- runnable as shown;
- runnable given what its first line says it assumes: ``# assumes: teacher (an nn.Module), data (...)``. The names
  listed there (before any ``;``, parentheses left out) are provided, as small stand-ins from :data:`NAMES`, and
  nothing else is;
- a doctest (``>>>`` lines), run with doctest;
- marked ``<!-- example: FILE -->``: an excerpt of an example file (tests/test_docs.py checks its lines are the
  file's), and a test runs that file;
- marked ``<!-- tested: FILE::TEST -->``: run by that test;
- marked ``<!-- skip: REASON -->``: not run, with its reason stated (it needs GPUs, it downloads a hub model, it is
  a signature).
"""

from __future__ import annotations

import doctest
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^(?: *<!-- (\w+): (.*?) -->\s*\n)?( *)```python\n(.*?)^\3```", flags=re.S | re.M)
MARKERS = ("example", "tested", "skip")


def blocks(page: Path) -> list[tuple[int, str | None, str, str]]:
    """``(line, marker, marker text, code)`` of each fenced Python block of ``page`` (indentation removed)."""
    text = page.read_text()
    found = []
    for m in BLOCK.finditer(text):
        indent = len(m.group(3))
        code = "\n".join(line[indent:] for line in m.group(4).splitlines()) + "\n"
        found.append((text[:m.start()].count("\n") + 1, m.group(1), m.group(2) or "", code))
    return found


def assumed(code: str) -> list[str]:
    """The names a block's first line says it assumes (``# assumes: a (what it is), b and c; free text``).

    >>> assumed("# assumes: teacher (an nn.Module), student_module and data (a LightningDataModule); see x\\nx = 1")
    ['teacher', 'student_module', 'data']
    >>> assumed("import torch\\n")
    []
    """
    first = code.lstrip("\n").splitlines()[0] if code.strip() else ""
    if not first.startswith("# assumes:"):
        return []
    listed = re.sub(r"\([^)]*\)", "", first[len("# assumes:"):].split(";")[0])
    return [name.strip() for name in re.split(r",| and ", listed) if name.strip()]


# ---------------------------------------------------------------------------------------------- the stand-ins
def _tiny():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import lightning_tiny
    finally:
        sys.path.remove(str(EXAMPLES))
    return lightning_tiny


def _batch() -> dict[str, Any]:
    return next(iter(_tiny().TokenDataModule().train_dataloader()))


class _MyAttention:
    """Stands in for the custom-attention guide's ``MyAttention``: a self-attention that keeps its last q and k."""

    @staticmethod
    def make():
        import torch
        from torch import nn

        class MyAttention(nn.Module):
            def __init__(self, dim: int = 16, heads: int = 2) -> None:
                super().__init__()
                self.heads, self.qkv = heads, nn.Linear(dim, 3 * dim)

            def forward(self, x):
                b, n, d = x.shape
                q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
                self.last_q, self.last_k = q, k
                return x + nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2) \
                    .reshape(b, n, d)

        torch.manual_seed(0)
        return MyAttention


def _custom_model():
    from torch import nn

    attention = _namespace_cache.setdefault("MyAttention", _MyAttention.make())
    return nn.Sequential(attention(), attention())


_namespace_cache: dict[str, Any] = {}

#: What an ``# assumes:`` line may name, and the stand-in the test provides for it.
NAMES: dict[str, Callable[[], Any]] = {
    "teacher": lambda: _tiny().tiny_teacher(),
    "student": lambda: _tiny().CausalLMModule().model,
    "student_module": lambda: _tiny().CausalLMModule(),
    "data": lambda: _tiny().TokenDataModule(),
    "loader": lambda: _tiny().TokenDataModule().train_dataloader(),
    "model": lambda: _tiny().tiny_teacher(),
    "batch": _batch,
    "base_model": lambda: _tiny().CausalLMModule().model,
    "apply_rope": lambda: (lambda x: x),
    "x": lambda: __import__("torch").randn(2, 6, 16),
    "task_loss": lambda: (lambda out: out.pow(2).mean()),
}
#: Stand-ins that differ on one page (the custom-attention guide's models are built of its own attention module).
PAGE_NAMES: dict[str, dict[str, Callable[[], Any]]] = {
    "docs/guides/custom-attention.md": {
        "MyAttention": lambda: _namespace_cache.setdefault("MyAttention", _MyAttention.make()),
        "teacher": _custom_model,
        "student": _custom_model,
    },
}


# ---------------------------------------------------------------------------------------------- the runner
@pytest.fixture
def capped_trainer(monkeypatch):
    """Lightning's Trainer, capped to two quiet CPU steps (and one validation batch)."""
    import lightning
    import lightning.pytorch

    class Trainer(lightning.Trainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.update(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1,
                          num_sanity_val_steps=0, max_steps=min(int(kwargs.get("max_steps") or 2), 2),
                          max_epochs=min(int(kwargs.get("max_epochs") or 1), 1), limit_train_batches=2)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(lightning, "Trainer", Trainer)
    monkeypatch.setattr(lightning.pytorch, "Trainer", Trainer)


def _run_examples() -> str:
    return "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))


def _check_marked(page: Path, line: int, marker: str, text: str, code: str) -> None:
    where = f"{page.relative_to(ROOT)}:{line}"
    if marker == "skip":
        assert len(text.split()) >= 3, f"{where}: a skipped block must say why (<!-- skip: REASON -->)"
    elif marker == "example":
        file = ROOT / text
        assert file.is_file(), f"{where}: {text} does not exist"
        tests = _run_examples()
        assert file.stem in tests, f"{where}: no test runs {text}, which this block is an excerpt of"
    elif marker == "tested":
        file, _, name = text.partition("::")
        assert re.search(rf"^def {re.escape(name)}\(", (ROOT / file).read_text(), flags=re.M), \
            f"{where}: {text} does not exist"
    else:  # pragma: no cover
        pytest.fail(f"{where}: unknown marker <!-- {marker}: ... --> (known: {MARKERS})")


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)], ids=lambda p: str(p.relative_to(ROOT)))
@pytest.mark.usefixtures("capped_trainer")
def test_every_snippet_runs(page, monkeypatch, tmp_path):
    pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.chdir(tmp_path)  # whatever a snippet writes stays out of the tree
    monkeypatch.setattr("sys.argv", ["snippet"])
    _namespace_cache.clear()
    names = {**NAMES, **PAGE_NAMES.get(str(page.relative_to(ROOT)), {})}
    namespace: dict[str, Any] = {"__name__": "__snippet__"}
    for line, marker, text, code in blocks(page):
        where = f"{page.relative_to(ROOT)}:{line}"
        if marker is not None:
            _check_marked(page, line, marker, text, code)
            continue
        if code.lstrip().startswith(">>>"):
            test = doctest.DocTestParser().get_doctest(code, dict(namespace), where, str(page), line)
            runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
            runner.run(test)
            assert runner.failures == 0, f"{where}: the doctest fails"
            continue
        for name in assumed(code):
            assert name in names, f"{where} assumes {name!r}, which this test does not provide (add it to NAMES)"
            namespace[name] = names[name]()
        try:
            exec(compile(code, where, "exec"), namespace)
        except Exception as err:
            raise AssertionError(f"{where} does not run as shown: {type(err).__name__}: {err}\n{code}") from err


def test_the_assumes_line_is_read_as_documented():
    assert assumed("# assumes: a, b and c (three things)\n") == ["a", "b", "c"]
    assert blocks(ROOT / "README.md"), "README.md has no Python block"
