"""What every command-line entry point shares: exit statuses and the checks of output paths.

Every recipe (and ``python -m dualpipe.simulate``) reports bad input as one line on stderr naming the
argument or file and what was expected, and exits with ``BAD_INPUT``; output paths are checked before
any work starts, so a run never trains for an hour and then fails to write its trace.

Exit statuses (documented per recipe in ``docs/what_happens_when.md``):

| status | name | meaning |
|---|---|---|
| 0 | ``OK`` | finished; or stopped early (SIGTERM, SIGINT, time budget) with a committed checkpoint of the last step |
| 1 | ``FAILED`` | an error the run could not handle (a rank died, a collective timed out, a gate failed) |
| 2 | ``BAD_INPUT`` | an argument, config value or input file is wrong; nothing was started |
| 3 | ``SAVE_FAILED`` | a checkpoint could not be written (interval, final, on a stop); the last committed is intact |
| 4 | ``FAULT_STOP`` | the NaN / loss-spike guard stopped the run (nothing good to roll back to, or retries exhausted) |
| 5 | ``LOCKED`` | the run folder belongs to another job (its holder is named) |
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
from pathlib import Path
from typing import NoReturn

OK, FAILED, BAD_INPUT, SAVE_FAILED, FAULT_STOP, LOCKED = 0, 1, 2, 3, 4, 5


def check_output_file(path: str | os.PathLike, option: str) -> Path:
    """``path`` as a file this process can create or replace; ValueError naming ``option`` otherwise.

    Refused: an existing folder, a missing or non-folder parent, a parent this user cannot write to, a path that
    cannot be created there (tried: the file is created and removed at once)."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise ValueError(f"{option} {str(path)!r} is a folder; expected a file path")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"{option} {str(path)!r}: folder {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {str(path)!r}: folder {str(parent)!r} is not writable")
    if p.exists():
        try:  # opened for writing (nothing truncated); gone meanwhile (another process's probe): probed below
            os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
            return p
        except FileNotFoundError:
            pass
        except OSError:
            raise ValueError(f"{option} {str(path)!r} exists and is not writable") from None
    try:  # permission bits do not tell (root, /proc, a read-only mount): create the file and remove it again
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process made it meanwhile (the ranks of one launch probe the same path)
        return p
    except OSError as exc:
        raise ValueError(f"{option} {str(path)!r}: cannot create it ({exc.strerror})") from None
    os.close(fd)
    with contextlib.suppress(FileNotFoundError):  # (removed meanwhile by another process's probe)
        os.unlink(p)
    return p


def check_output_dir(path: str | os.PathLike, option: str, *, must_be_empty: bool = False) -> Path:
    """``path`` as a folder this process can create or write into; ValueError naming ``option`` otherwise.

    ``must_be_empty``: an existing folder with anything in it is refused (callers offer ``--overwrite``)."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise ValueError(f"{option} {str(path)!r} is a file; expected a folder")
    if p.is_dir():
        if not os.access(p, os.W_OK | os.X_OK):
            raise ValueError(f"{option} {str(path)!r} is not writable")
        if must_be_empty and any(p.iterdir()):
            raise ValueError(f"{option} {str(path)!r} is not empty")
        return p
    ancestor = p.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {str(path)!r}: cannot create it under {str(ancestor)!r}")
    return p


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` that keeps the module docstring's line breaks and ends each option's help with its default.

    An option whose help already names its default (``(default: the config's)``) and one without a default
    (``has_default``) are left as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not has_default(action):
            return text
        shown = ",".join(map(str, action.default)) if isinstance(action.default, (list, tuple)) else "%(default)s"
        return f"{text} (default: {shown})" if text else f"(default: {shown})"


def has_default(action: argparse.Action) -> bool:
    """Whether an option has a default worth showing (not None, a flag's False, an empty list or suppressed)."""
    return bool(action.option_strings) and action.default is not False and action.default not in (
        None, [], argparse.SUPPRESS)


def _number(text: str, kind: type, lo: float, lo_open: bool) -> int | float:
    """``text`` as a finite ``kind`` (int or float) above ``lo``; ArgumentTypeError saying what was expected."""
    expected = f"expected {'an integer' if kind is int else 'a finite number'} {'>' if lo_open else '>='} {lo:g}"
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{expected}, got {text!r}") from None
    if not math.isfinite(value) or (value <= lo if lo_open else value < lo):
        raise argparse.ArgumentTypeError(f"{expected}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (counts, sizes, sequence lengths)."""
    return _number(text, int, 1, False)


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _number(text, int, 0, False)


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (bandwidths, megabytes, timeouts)."""
    return _number(text, float, 0, True)


def nonnegative_float(text: str) -> float:
    """argparse type: a finite number >= 0 (costs, latencies, delays)."""
    return _number(text, float, 0, False)


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with ``HelpFormatter`` and usage errors as one line, argparse's own
    ``<prog>: error: <message>`` without the usage block before it, exit status ``BAD_INPUT``."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")
