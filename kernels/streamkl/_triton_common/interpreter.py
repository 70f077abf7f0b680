"""Whether Triton's CPU interpreter is on: the one reader of ``TRITON_INTERPRET`` in the package (imports no Triton)."""

from __future__ import annotations

import os


def triton_interpreter_enabled() -> bool:
    """True when Triton's CPU interpreter is switched on (``TRITON_INTERPRET`` set to anything but ``""``/``"0"``).

    Triton itself reads the variable when it is imported; this reads it on every call (a dictionary lookup), so that
    a test can change it.

    Example:
        >>> import os
        >>> triton_interpreter_enabled() == (os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))
        True
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
