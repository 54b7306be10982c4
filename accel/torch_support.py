"""The torch versions the toolkit is tested on; ``import accel`` (so every package of the toolkit) refuses others.

Tested: 2.13 (``make test``) and 2.11, the GPU environment's (``make test-torch211``). ``pyproject.toml``
declares the same range. Numbers must not depend on the version, but the overlapped forward-and-backward
once gave different gradients under 2.11 with no error (issue 26), so an untested torch is refused, not
warned about.

The refusal is an ``ImportError`` whose message is one line naming both versions. A program that does not
catch it (every recipe, ``python -m dualpipe.simulate``, a user's script) prints that line alone, as
``error: ...`` like the recipes' other refusals, instead of a traceback, and exits 1.
"""

from __future__ import annotations

import re
import sys

import torch

OLDEST, NEWEST = (2, 11), (2, 13)
REQUIREMENT = "torch>=2.11,<2.14"  # the same as pyproject.toml's


class UnsupportedTorchError(ImportError):
    """The installed torch is outside the tested range."""


def _minor(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a torch version string (``2.11.0``, ``2.13.0+cpu``, ``2.12.0a0+git1234``)."""
    m = re.match(r"(\d+)\.(\d+)", str(version))
    return (int(m.group(1)), int(m.group(2))) if m else None


def check(version: str | None = None) -> None:
    """Raise ``UnsupportedTorchError`` unless ``version`` (default: the installed torch's) is in the tested range."""
    version = str(torch.__version__ if version is None else version)
    minor = _minor(version)
    if minor is None or not OLDEST <= minor <= NEWEST:
        raise UnsupportedTorchError(
            f"dsv3-toolkit supports torch {OLDEST[0]}.{OLDEST[1]} to {NEWEST[0]}.{NEWEST[1]} ({REQUIREMENT}, "
            f"the tested range); installed: torch {version}")


def _one_line_hook(previous):
    def hook(kind, value, tb):
        if isinstance(value, UnsupportedTorchError):
            print(f"error: {value}", file=sys.stderr)
        else:
            previous(kind, value, tb)
    return hook


def require_supported_torch() -> None:
    """``check()``; on refusal, first make an uncaught refusal print one line instead of a traceback."""
    try:
        check()
    except UnsupportedTorchError:
        sys.excepthook = _one_line_hook(sys.excepthook)
        raise
