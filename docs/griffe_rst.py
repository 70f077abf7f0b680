"""A griffe extension for the API reference: the project's docstrings are Google style with some reStructuredText
(Sphinx roles, ``.. math::``, ``.. tip::``, ``Example::``). This turns those into what mkdocstrings renders:

- ``:class:`~pkg.Name``` (and func/meth/mod/attr/data/obj/exc) -> an optional cross-reference to ``pkg.Name``;
- ``:math:`x``` -> ``\\(x\\)``, and ``.. math::`` blocks -> ``$$ ... $$`` (KaTeX through arithmatex);
- ``.. tip::`` / ``.. note::`` / ``.. warning::`` / ``.. attention::`` -> Material admonitions;
- ``Example:`` / ``Example::`` section titles -> ``Examples:`` (so doctests render as code, not prose);
- RST title underlines (``^^^^``) -> a bold title;
- ``a, b,`` / ``c: description`` argument entries wrapped over two lines -> one line.

Used by mkdocs.yml (``extensions: [docs/griffe_rst.py:RstToMarkdown]``); not part of the package.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(class|func|meth|mod|attr|data|obj|exc):`(~?)([^`<]+?)(?:\s*<([^>]+)>)?`")
_MATH_ROLE = re.compile(r":math:`([^`]+)`")
_ADMONITION = re.compile(r"^(\s*)\.\. (tip|note|warning|attention|seealso)::\s*(.*)$")
_MATH_BLOCK = re.compile(r"^(\s*)\.\. math::\s*$")
_EXAMPLE_TITLE = re.compile(r"^(\s*)Example::?\s*$")
_UNDERLINE = re.compile(r"^([\^=~\-])\1{2,}\s*$")
_WRAPPED_NAMES = re.compile(r"^(\s+)([\w*]+(?:, [\w*]+)*,)\n\1(?=[\w*]+(?:, [\w*]+)*[,:])", re.M)


def _role(match: re.Match[str]) -> str:
    kind, short, target, explicit = match.groups()
    path = (explicit or target).strip().lstrip("~").rstrip("()")
    title = target.strip().lstrip("~") if not explicit else target.strip()
    if short:
        title = title.split(".")[-1]
    if kind in ("func", "meth"):
        title = title.rstrip("()") + "()"
    return f'<autoref identifier="{path}" optional><code>{title}</code></autoref>'


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def convert(text: str) -> str:
    """The docstring with its reStructuredText turned into Markdown (see the module docstring)."""
    while _WRAPPED_NAMES.search(text):
        text = _WRAPPED_NAMES.sub(lambda m: m.group(1) + m.group(2) + " ", text)
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if i + 1 < len(lines) and line.strip() and _UNDERLINE.match(lines[i + 1]) \
                and len(lines[i + 1].strip()) >= len(line.strip()):
            out.append(f"**{line.strip()}**")
            i += 2
            continue
        m = _EXAMPLE_TITLE.match(line)
        if m:
            out.append(f"{m.group(1)}Examples:")
            i += 1
            while i < len(lines) and not lines[i].strip():  # Google sections start on the next line
                i += 1
            continue
        m = _MATH_BLOCK.match(line)
        if m:
            base = _indent(line)
            body, i = _block(lines, i + 1, base)
            pad = " " * base
            out += [f"{pad}$$", *(pad + b.strip() for b in body if b.strip()), f"{pad}$$"]
            continue
        m = _ADMONITION.match(line)
        if m:
            pad, kind, first = m.groups()
            body, i = _block(lines, i + 1, len(pad))
            kind = {"attention": "warning", "seealso": "note"}.get(kind, kind)
            out.append(f"{pad}!!! {kind}")
            for b in ([first] if first else []) + [b.strip() for b in body]:
                out.append(f"{pad}    {b}" if b else "")
            continue
        out.append(line)
        i += 1
    text = "\n".join(out)
    text = _MATH_ROLE.sub(lambda m: "\\(" + m.group(1) + "\\)", text)
    return _ROLE.sub(_role, text)


def _block(lines: list[str], start: int, base: int) -> tuple[list[str], int]:
    """The lines indented deeper than ``base`` from ``start`` (blank lines inside kept), and where they end."""
    body, i = [], start
    while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > base):
        body.append(lines[i])
        i += 1
    while body and not body[-1].strip():
        body.pop()
        i -= 1
    while body and not body[0].strip():
        body.pop(0)
    return body, i


class RstToMarkdown(griffe.Extension):
    """Convert every docstring once, when griffe loads the object."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = convert(obj.docstring.value)
