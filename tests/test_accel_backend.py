"""accel.backend: backend selection (cuda / musa / cpu), the DSV3_BACKEND override and its errors, the
distributed-backend mapping, Triton availability, events and do_bench.

No MUSA card is here, so MUSA is faked the way torch_musa presents itself: a ``torch.musa`` module
(in-process), or a ``torch_musa`` package that renames PyTorch's PrivateUse1 backend to ``musa`` and
registers ``torch.musa`` (in a subprocess, since the rename cannot be undone).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

import accel
from accel import backend as backend_fn
from accel.backend import BackendError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def clean_backend(monkeypatch):
    """No DSV3_BACKEND, no cached decision before or after the test."""
    monkeypatch.delenv("DSV3_BACKEND", raising=False)
    accel.reset()
    yield monkeypatch
    accel.reset()


def _fake_musa_module(available: bool = True) -> types.ModuleType:
    mod = types.ModuleType("torch.musa")
    mod.is_available = lambda: available
    mod.device_count = lambda: 2
    mod.synchronize = lambda device=None: None
    return mod


def test_cpu_when_no_accelerator(clean_backend):
    clean_backend.delattr(torch, "musa", raising=False)
    clean_backend.setitem(sys.modules, "torch_musa", None)  # not installed
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert backend_fn() == "cpu"
    assert accel.dist_backend() == "gloo"
    assert accel.default_device() == torch.device("cpu")
    assert accel.device_module() is None
    assert accel.device_name() == "cpu"
    assert accel.device_capability() is None
    assert accel.fp8_native() is False


@pytest.mark.musa
def test_fake_torch_musa_selects_musa_and_mccl(clean_backend):
    clean_backend.setattr(torch, "musa", _fake_musa_module(), raising=False)
    clean_backend.setattr(torch.cuda, "is_available", lambda: False)
    assert backend_fn() == "musa"
    assert accel.dist_backend() == "mccl"
    assert accel.device_module() is torch.musa


@pytest.mark.musa
def test_musa_reported_by_torch_accelerator(clean_backend):
    """torch >= 2.6 names the PrivateUse1 device through torch.accelerator; that is trusted first."""
    fake_acc = types.SimpleNamespace(is_available=lambda: True,
                                     current_accelerator=lambda: types.SimpleNamespace(type="musa"))
    clean_backend.setattr(torch, "accelerator", fake_acc, raising=False)
    clean_backend.setattr(torch, "musa", _fake_musa_module(), raising=False)
    assert backend_fn() == "musa"
    assert accel.dist_backend() == "mccl"


@pytest.mark.musa
def test_unavailable_musa_is_not_selected(clean_backend):
    clean_backend.setattr(torch, "musa", _fake_musa_module(available=False), raising=False)
    clean_backend.setattr(torch.cuda, "is_available", lambda: False)
    assert backend_fn() == "cpu"


@pytest.mark.musa
def test_forced_musa_without_torch_musa_names_the_package(clean_backend):
    clean_backend.delattr(torch, "musa", raising=False)
    clean_backend.setitem(sys.modules, "torch_musa", None)
    clean_backend.setenv("DSV3_BACKEND", "musa")
    with pytest.raises(BackendError, match="torch_musa"):
        backend_fn()


@pytest.mark.musa
def test_forced_musa_without_a_device(clean_backend):
    clean_backend.setattr(torch, "musa", _fake_musa_module(available=False), raising=False)
    clean_backend.setenv("DSV3_BACKEND", "musa")
    with pytest.raises(BackendError, match="is_available"):
        backend_fn()


@pytest.mark.parametrize("name", ["rocm", "nvidia", "musa0"])
def test_unknown_backend_lists_the_choices(clean_backend, name):
    clean_backend.setenv("DSV3_BACKEND", name)
    with pytest.raises(BackendError) as info:
        backend_fn()
    assert name in str(info.value)
    for choice in ("cuda", "musa", "cpu"):
        assert choice in str(info.value)


def test_forced_cuda_without_cuda(clean_backend):
    clean_backend.setattr(torch.cuda, "is_available", lambda: False)
    clean_backend.setenv("DSV3_BACKEND", "cuda")
    with pytest.raises(BackendError, match="cuda"):
        backend_fn()


def test_forced_cpu_wins_over_an_accelerator(clean_backend):
    clean_backend.setattr(torch, "musa", _fake_musa_module(), raising=False)
    clean_backend.setattr(torch.cuda, "is_available", lambda: True)
    clean_backend.setenv("DSV3_BACKEND", " CPU ")  # case and spaces forgiven
    assert backend_fn() == "cpu"
    assert accel.dist_backend() == "gloo"


def test_decision_is_cached_until_reset(clean_backend):
    assert backend_fn() == "cpu"
    clean_backend.setenv("DSV3_BACKEND", "bogus")
    assert backend_fn() == "cpu"  # cached: env changes need accel.reset()
    accel.reset()
    with pytest.raises(BackendError):
        backend_fn()


def test_triton_availability_on_cpu(clean_backend):
    clean_backend.setenv("TRITON_INTERPRET", "1")
    accel.reset()
    assert accel.triton_available() and accel.triton_unavailable_reason() is None
    clean_backend.setenv("TRITON_INTERPRET", "0")
    accel.reset()
    assert not accel.triton_available()
    assert "TRITON_INTERPRET" in accel.triton_unavailable_reason()
    clean_backend.setitem(sys.modules, "triton", None)  # not importable
    clean_backend.setenv("TRITON_INTERPRET", "1")
    accel.reset()
    assert not accel.triton_available()
    assert "'triton'" in accel.triton_unavailable_reason()


def test_local_rank_picks_the_device_index(clean_backend):
    clean_backend.setenv("LOCAL_RANK", "3")
    assert accel.local_rank() == 3
    assert accel.default_device() == torch.device("cpu")  # cpu has no index


def test_cpu_event_and_do_bench(clean_backend):
    start, end = accel.Event(), accel.Event()
    start.record()
    sum(range(10000))
    end.record()
    assert start.elapsed_time(end) > 0
    calls = []
    ms = accel.do_bench(lambda: calls.append(1), warmup=2, rep=5)
    assert len(calls) == 7 and ms >= 0  # warm-up runs plus timed runs, median in ms
    with pytest.raises(ValueError, match="rep >= 1"):
        accel.do_bench(lambda: None, rep=0)
    accel.synchronize()  # no-op on cpu, must not raise
    accel.empty_cache()
    accel.reset_peak_memory_stats()
    assert accel.max_memory_allocated() == 0


_FAKE_TORCH_MUSA = '''
"""Stand-in for Moore Threads' torch_musa: renames PrivateUse1 to 'musa' and registers torch.musa."""
import types
import torch

class _Event:
    def __init__(self, enable_timing=False):
        self.t = 0.0
    def record(self):
        import time
        self.t = time.perf_counter()
    def synchronize(self):
        pass
    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3

musa = types.ModuleType("torch_musa.musa")
musa.is_available = lambda: True
musa.device_count = lambda: 8
musa.get_device_name = lambda device=None: "MTT S5000"
musa.get_device_capability = lambda device=None: (3, 1)
musa.synchronized = []
musa.synchronize = lambda device=None: musa.synchronized.append(str(device))
musa.Event = _Event
torch.utils.rename_privateuse1_backend("musa")
torch._register_device_module("musa", musa)
'''

_PROBE = '''
import json, os, torch
import accel

def probe():
    out = {"backend": accel.backend(), "dist": accel.dist_backend(), "device": str(accel.default_device()),
           "name": accel.device_name(), "fp8": accel.fp8_native(), "spec": accel.lookup(accel.device_name()).name}
    accel.synchronize()
    e0, e1 = accel.Event(), accel.Event()
    e0.record(); e1.record()
    out["event_ms"] = e0.elapsed_time(e1)
    return out

detected = probe()
os.environ["DSV3_BACKEND"] = "musa"
accel.reset()
forced = probe()
print(json.dumps({"detected": detected, "forced": forced, "synchronized": torch.musa.synchronized}))
'''


@pytest.mark.musa
@pytest.mark.timeout(120)
def test_fake_torch_musa_package_end_to_end(tmp_path):
    """A process with a torch_musa package installed gets musa:LOCAL_RANK, mccl, the S5000 spec, FP8,
    both detected and forced with DSV3_BACKEND=musa."""
    (tmp_path / "torch_musa").mkdir()
    (tmp_path / "torch_musa" / "__init__.py").write_text(textwrap.dedent(_FAKE_TORCH_MUSA))
    env = {k: v for k, v in os.environ.items() if k != "DSV3_BACKEND"}
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]), LOCAL_RANK="5")
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for got in (report["detected"], report["forced"]):
        assert got["backend"] == "musa" and got["dist"] == "mccl"
        assert got["device"] == "musa:5"
        assert got["name"] == "MTT S5000" and got["spec"] == "MTT S5000"
        assert got["fp8"] is True  # compute capability 3.1
        assert got["event_ms"] >= 0
    assert report["synchronized"] == ["None", "None"]  # accel.synchronize reached torch.musa each time
