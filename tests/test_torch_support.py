"""An untested torch is refused at ``import accel`` in one line naming it and the range (issue 26).

The installed torch is in the range (or nothing here could run), so the refusals fake ``torch.__version__``:
in this process for ``check``, and through a ``sitecustomize`` in a subprocess for the real CLI.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from accel import torch_support

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("version", ["2.11.0", "2.11.0+cu130", "2.12.1", "2.13.0", "2.13.0+cpu", "2.13.1a0+git12ab"])
def test_tested_versions_are_accepted(version):
    torch_support.check(version)


@pytest.mark.parametrize("version", ["2.10.0", "2.10.1+cu128", "2.4.1", "2.14.0", "2.14.0.dev20261201", "3.0.0",
                                     "1.13.1", "garbage"])
def test_untested_versions_are_refused_in_one_line(version):
    with pytest.raises(ImportError) as err:
        torch_support.check(version)
    message = str(err.value)
    assert "\n" not in message
    assert f"installed: torch {version}" in message
    assert "torch>=2.11,<2.14" in message and "2.11 to 2.13" in message


def test_default_is_the_installed_torch(monkeypatch):
    torch_support.check()  # the suite itself runs on a tested torch
    monkeypatch.setattr(torch, "__version__", "2.10.0")
    with pytest.raises(torch_support.UnsupportedTorchError, match="installed: torch 2.10.0"):
        torch_support.check()


def test_pyproject_declares_the_same_range():
    text = (ROOT / "pyproject.toml").read_text()
    declared = re.findall(r'"(torch[<>=!~][^";]*)', text)
    assert declared == [torch_support.REQUIREMENT]


@pytest.mark.timeout(120)
def test_recipe_cli_prints_one_line_and_no_traceback(tmp_path):
    """``python -m recipes.train --help`` under a torch that says it is 2.10.0: one ``error:`` line, exit 1."""
    (tmp_path / "sitecustomize.py").write_text("import torch\ntorch.__version__ = '2.10.0'\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-m", "recipes.train", "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: dsv3-toolkit supports torch"), proc.stderr
    assert "installed: torch 2.10.0" in lines[0] and "torch>=2.11,<2.14" in lines[0]
