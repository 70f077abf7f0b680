"""The indexer guide's example runs as written (a doctest of docs/guides/indexer.md). Its H100 table is generated
from the committed results and checked in tests/test_indexer_docs.py."""

from __future__ import annotations

import doctest
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "indexer.md"


def test_guide_example_runs():
    result = doctest.testfile(str(GUIDE), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 5 and result.failed == 0

