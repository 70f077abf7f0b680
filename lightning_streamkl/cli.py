r"""
LightningCLI with StreamKL's own error messages
^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^

:class:`DistillationCLI` is ``LightningCLI`` for configs that hold a :class:`~lightning_streamkl.StreamKLDistillation`
(``trainer.callbacks``, any ``class_path`` section): a bad StreamKL value or key is reported as the library's own
message, the one Python gives, alone (``error: <message>``, exit status 2), instead of in jsonargparse's usage text,
union errors, chained traceback and ``Namespace`` dump:

- values are checked when the config is parsed (with :func:`~lightning_streamkl.validate_config`), so
  ``--print_config`` checks them too;
- an unknown key of the callback (``wieght:``) names the closest valid one;
- an error a StreamKL class raises while the classes are instantiated is reported the same way.

Everything else (the trainer's, the model's and the data's arguments) is jsonargparse's as usual. Needs the ``cli``
extra (jsonargparse); importing :mod:`lightning_streamkl` does not import this module.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import re
import sys
import traceback
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import yaml

try:
    from jsonargparse import ArgumentError, Namespace
    from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
except ImportError as err:  # pragma: no cover - jsonargparse missing
    raise ImportError("lightning_streamkl.cli needs jsonargparse: pip install 'lightning-streamkl[cli]'.") from err

from .callback import StreamKLDistillation
from .config import validate_config

__all__ = ["DistillationCLI", "StreamKLArgumentParser", "asks_to_print_config", "check_sections", "library_error",
           "streamkl_sections", "without_print_config"]

#: The folders of this package and of the op: an error raised from code in them is the library's own.
_OWN = tuple(str(Path(f).resolve().parent) + os.sep for f in (__file__, inspect.getfile(validate_config)))
_PRINT_CONFIG = "--print_config"
#: jsonargparse's message for a key a class does not take (in a ``class_path`` section).
_NOT_ACCEPTED = re.compile(r"Problem with given class_path '(lightning_streamkl[\w.]*)':\s*\n\s*"
                           r"(?:Option|Key) '([^']+)' is not accepted")
_TYPE_PROBLEM = re.compile(r'^Parser key "(\w+)": .*? Got value: (.*)$')
_CLASS_PROBLEM = re.compile(r"Problem with given class_path '(lightning_streamkl[\w.]*)':\s*\n((?:\s{6,}.*\n?)+)")


def _is_own(err: BaseException) -> bool:
    tb = traceback.extract_tb(err.__traceback__)
    return isinstance(err, (ValueError, TypeError)) and bool(tb) and \
        str(Path(tb[-1].filename).resolve()).startswith(_OWN)


def library_error(err: BaseException | None) -> BaseException | None:
    """The error the library itself raised in ``err``'s chain of causes and contexts (a ``ValueError`` or
    ``TypeError`` from :mod:`lightning_streamkl` or :mod:`streamkl` code), or ``None``.

    Example:
        >>> try:
        ...     try:
        ...         validate_config({"pairs": [[0, 0]], "temperature": -2})
        ...     except ValueError as inner:
        ...         raise TypeError("Does not validate against any of the Union subtypes") from inner
        ... except TypeError as outer:
        ...     print(library_error(outer))
        Expected `temperature` to be a finite number > 0, but got -2.0.
    """
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if _is_own(err):
            return err
        err = err.__cause__ or err.__context__
    return None


def _plain(value: Any) -> Any:
    if isinstance(value, Namespace):
        return value.as_dict()
    return value


def _class_of(class_path: Any) -> type | None:
    if not isinstance(class_path, str) or "." not in class_path:
        return None
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(__import__(module, fromlist=[name]), name)
    except (ImportError, AttributeError):
        return None


def streamkl_sections(config: Any, where: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """``(key, init_args)`` of every ``class_path`` section of ``config`` (a parsed ``Namespace``, or plain
    mappings and lists) whose class is :class:`~lightning_streamkl.StreamKLDistillation` or a subclass.

    Example:
        >>> cfg = {"trainer": {"callbacks": [{"class_path": "lightning_streamkl.StreamKLDistillation",
        ...                                   "init_args": {"pairs": [[0, 0]], "weight": 2.0}}]}}
        >>> [(key, args["weight"]) for key, args in streamkl_sections(cfg)]
        [('trainer.callbacks[0]', 2.0)]
    """
    config = _plain(config)
    if isinstance(config, Mapping):
        cls = _class_of(config.get("class_path"))
        if isinstance(cls, type) and issubclass(cls, StreamKLDistillation):
            yield where, dict(_plain(config.get("init_args")) or {})
            return
        for key, value in config.items():
            yield from streamkl_sections(value, f"{where}.{key}" if where else str(key))
    elif isinstance(config, (list, tuple)):
        for i, value in enumerate(config):
            yield from streamkl_sections(value, f"{where}[{i}]")


def _arguments(value: Any) -> Any:
    """Parsed arguments as the config takes them: a dataclass value that jsonargparse holds as
    ``{class_path, init_args}`` (a :class:`~lightning_streamkl.LayerPair`) becomes the mapping of its fields."""
    value = _plain(value)
    if isinstance(value, Mapping):
        if "class_path" in value and dataclasses.is_dataclass(_class_of(value["class_path"])):
            return _arguments(value.get("init_args") or {})
        return {k: _arguments(v) for k, v in value.items() if k != "__subclasses_disabled__"}
    if isinstance(value, (list, tuple)):
        return [_arguments(v) for v in value]
    return value


def check_sections(config: Any, plain_sections: Iterable[str] = ()) -> None:
    """Validate every StreamKL section of a parsed config with :func:`~lightning_streamkl.validate_config`: the
    ``class_path`` ones (:func:`streamkl_sections`) and the plain ones at the dotted keys ``plain_sections``.

    Raises:
        ValueError, TypeError: the first section's error, the message Python gives for the same value.

    Example:
        >>> check_sections({"distillation": {"pairs": [[0, 0]], "head_map": "grouped"}}, ["distillation"])
        Traceback (most recent call last):
        ...
        ValueError: Expected `head_map` to be one of ('error', 'group'), but got 'grouped'.
    """
    sections = list(streamkl_sections(config))
    plain = _plain(config)
    for key in plain_sections:
        node: Any = plain
        for part in key.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        if isinstance(node, Mapping):
            sections.append((key, dict(node)))
    for _, args in sections:
        validate_config({k: _arguments(v) for k, v in args.items() if k not in ("teacher", "teacher_forward")})


def _unknown_key(class_path: str, key: str) -> str | None:
    cls = _class_of(class_path)
    if cls is None:
        return None
    known = [p for p in inspect.signature(cls).parameters if p not in ("self", "args", "kwargs")]
    near = difflib.get_close_matches(key, known, n=1)
    hint = f" Did you mean `{near[0]}`?" if near else ""
    return f"Unknown key `{key}` in the {cls.__name__} arguments.{hint} Valid keys: {known}."


def _library_message(message: str, ex: BaseException | None) -> str | None:
    """What to print instead of jsonargparse's ``message``: the library's own error in ``ex``'s chain, an unknown key
    of a StreamKL class with the closest valid one, or the part of the message about a StreamKL class; ``None``
    when the error is not about StreamKL."""
    own = library_error(ex)
    if own is not None:
        return str(own)
    found = _NOT_ACCEPTED.search(message)
    if found:
        text = _unknown_key(*found.groups())
        if text is not None:
            return text
    found = _CLASS_PROBLEM.search(message)
    if found:
        detail = " ".join(line.strip() for line in found.group(2).splitlines() if line.strip())
        value = _TYPE_PROBLEM.search(detail)
        if value and _class_of(found.group(1)) is StreamKLDistillation:  # the config's own message for that value
            try:
                validate_config({"pairs": [[0, 0]], value.group(1): yaml.safe_load(value.group(2))})
            except (ValueError, TypeError) as err:
                return str(err)
            except yaml.YAMLError:
                pass
        return f"{found.group(1)}: {detail}"
    return None


class _NotOurs(Exception):
    """Raised by :meth:`StreamKLArgumentParser.error` during the check before ``--print_config``: not a StreamKL
    error, so the printing goes ahead as jsonargparse would do it."""


class StreamKLArgumentParser(LightningArgumentParser):
    """The parser of :class:`DistillationCLI`: it validates the StreamKL sections of a parsed config, and reports an
    error about them as the library's message alone (``error: <message>``, exit status 2; with
    ``exit_on_error=False`` or jsonargparse's debug mode, an ``ArgumentError`` with that message).

    Attributes:
        plain_sections: keys of sections that hold a StreamKL config without a ``class_path`` (e.g. the
            ``distillation`` section of ``streamkl-distill``); validated like the ``class_path`` ones.

    Example:
        >>> parser = StreamKLArgumentParser(exit_on_error=False)
        >>> _ = parser.add_argument("--distillation", type=dict)
        >>> parser.plain_sections = ["distillation"]
        >>> parser.parse_args(["--distillation", "{pairs: [[0, 0]], temperature: -2}"])
        Traceback (most recent call last):
        ...
        argparse.ArgumentError: Expected `temperature` to be a finite number > 0, but got -2.0.
    """

    plain_sections: list[str]
    _checking_only = False

    def validate(self, namespace: Namespace, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        try:
            check_sections(namespace, getattr(self, "plain_sections", []))
        except (ValueError, TypeError) as err:
            self.error(str(err), err)
        super().validate(namespace, *args, **kwargs)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:  # type: ignore[override]
        own = _library_message(message, ex)
        if own is None:
            if self._checking_only:
                raise _NotOurs(message)
            super().error(message, ex)
        self._logger.error(own)
        if not self.exit_on_error or os.environ.get("JSONARGPARSE_DEBUG"):
            raise ArgumentError(None, own) from ex
        sys.stderr.write(f"error: {own}\n")
        self.exit(2)


class DistillationCLI(LightningCLI):
    """``LightningCLI`` whose StreamKL config errors are the library's own messages (see the module): use it in
    place of ``LightningCLI``, with the same arguments.

    ``--print_config`` first checks the StreamKL sections (an error is reported as for a run) and then prints as
    usual; other incomplete parts of the config (a missing model, say) do not stop it.

    Example:
        >>> import contextlib, io, sys
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> argv, sys.argv = sys.argv, ["train.py"]
        >>> args = ["fit", "--trainer.callbacks+=lightning_streamkl.StreamKLDistillation",
        ...         "--trainer.callbacks.teacher=gpt2", "--trainer.callbacks.pairs=[[0, 0]]",
        ...         "--trainer.callbacks.temperature=-2", "--print_config"]
        >>> with contextlib.redirect_stderr(io.StringIO()) as err, contextlib.suppress(SystemExit):
        ...     DistillationCLI(BoringModel, args=args)
        >>> sys.argv = argv
        >>> err.getvalue()
        'error: Expected `temperature` to be a finite number > 0, but got -2.0.\\n'
    """

    def __init__(self, *args: Any, parser_class: type[LightningArgumentParser] = StreamKLArgumentParser,
                 **kwargs: Any) -> None:
        if not issubclass(parser_class, StreamKLArgumentParser):
            raise TypeError(f"Expected `parser_class` to be a subclass of StreamKLArgumentParser, but got "
                            f"{parser_class.__name__}.")
        super().__init__(*args, parser_class=parser_class, **kwargs)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse as ``LightningCLI`` does; with ``--print_config``, check the StreamKL sections first."""
        argv = sys.argv[1:] if args is None else args
        if isinstance(argv, (list, tuple)) and asks_to_print_config(argv):
            self._check_before_printing(parser, [str(a) for a in argv])
        super().parse_arguments(parser, args)

    @staticmethod
    def _check_before_printing(parser: LightningArgumentParser, argv: list[str]) -> None:
        stripped = without_print_config(argv)
        parsers = [p for p in _parsers(parser) if isinstance(p, StreamKLArgumentParser)]
        for p in parsers:
            p._checking_only = True
        try:
            parser.parse_args(stripped)
        except _NotOurs:
            pass
        finally:
            for p in parsers:
                p._checking_only = False

    def instantiate_classes(self) -> None:
        """Instantiate as ``LightningCLI`` does; an error a StreamKL class raises is reported as its own message."""
        try:
            super().instantiate_classes()
        except Exception as err:
            own = library_error(err)
            if own is None:
                raise
            self.parser.error(str(own), own)


def without_print_config(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--print_config`` (and its value, ``--print_config=skip_null`` or a separate
    ``skip_null``/``skip_default``/``comments``): the same command as a run parses it.

    Example:
        >>> without_print_config(["fit", "--print_config", "skip_null", "--config", "a.yaml"])
        ['fit', '--config', 'a.yaml']
    """
    stripped, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg.split("=")[0] == _PRINT_CONFIG:
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            skip = arg == _PRINT_CONFIG and bool(nxt) and \
                set(nxt.split(",")) <= {"skip_null", "skip_default", "comments"}
            continue
        stripped.append(arg)
    return stripped


def asks_to_print_config(argv: Sequence[str]) -> bool:
    """True when ``argv`` has ``--print_config`` (with or without a value).

    Example:
        >>> asks_to_print_config(["fit", "--print_config=skip_null"]), asks_to_print_config(["fit"])
        (True, False)
    """
    return any(str(a).split("=")[0] == _PRINT_CONFIG for a in argv)


def _parsers(parser: LightningArgumentParser) -> list[Any]:
    """The parser and its subcommand parsers."""
    found = [parser]
    subcommands = getattr(parser, "_subcommands_action", None)
    for sub in getattr(subcommands, "_name_parser_map", {}).values():
        found.extend(_parsers(sub))
    return found
