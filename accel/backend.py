"""Which backend (cuda / musa / cpu) this process runs on, and what that backend can do.

This is the only module in the toolkit that knows how CUDA and MUSA differ. MUSA is PyTorch's
PrivateUse1 backend registered by ``torch_musa`` (device type ``musa``, module ``torch.musa``,
collectives ``mccl``); ``torch.cuda.is_available()`` is False there, so nothing here ever decides
by looking at the string ``"cuda"`` alone.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from types import ModuleType

import torch

BACKENDS = ("cuda", "musa", "cpu")
DIST_BACKENDS = {"cuda": "nccl", "musa": "mccl", "cpu": "gloo"}
BACKEND_ENV = "DSV3_BACKEND"


class BackendError(RuntimeError):
    """The requested backend is unknown or cannot be used in this process."""


def _musa_module() -> ModuleType | None:
    """``torch.musa`` once ``torch_musa`` is imported, or None when the package is absent."""
    if getattr(torch, "musa", None) is None:
        if importlib.util.find_spec("torch_musa") is None:
            return None
        importlib.import_module("torch_musa")  # registers torch.musa and the PrivateUse1 backend
    return getattr(torch, "musa", None)


def _accelerator_type() -> str | None:
    """The device type ``torch.accelerator`` reports (torch >= 2.6), if any."""
    acc = getattr(torch, "accelerator", None)
    if acc is None or not acc.is_available():
        return None
    return acc.current_accelerator().type


def detect_backend() -> str:
    """Decide the backend: ``DSV3_BACKEND`` if set, else the accelerator torch sees, else cpu."""
    forced = os.environ.get(BACKEND_ENV, "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise BackendError(f"{BACKEND_ENV}={forced!r} is not a backend; choose one of {', '.join(BACKENDS)}")
        if forced == "musa":
            mod = _musa_module()
            if mod is None:
                raise BackendError(
                    f"{BACKEND_ENV}=musa needs the 'torch_musa' package (Moore Threads' PyTorch backend), "
                    "which is not installed"
                )
            if not mod.is_available():
                raise BackendError(f"{BACKEND_ENV}=musa but torch.musa.is_available() is False (no MUSA device)")
        if forced == "cuda" and not torch.cuda.is_available():
            raise BackendError(f"{BACKEND_ENV}=cuda but torch.cuda.is_available() is False")
        return forced
    acc = _accelerator_type()
    if acc in ("cuda", "musa"):
        return acc
    if torch.cuda.is_available():
        return "cuda"
    mod = _musa_module()
    if mod is not None and mod.is_available():
        return "musa"
    return "cpu"


@functools.cache
def backend() -> str:
    """The backend of this process, decided once (``reset()`` forgets it, for tests)."""
    return detect_backend()


def reset() -> None:
    """Forget every cached decision, so the next call detects again (tests use this)."""
    backend.cache_clear()
    triton_available.cache_clear()


def device_module() -> ModuleType | None:
    """``torch.cuda`` or ``torch.musa`` (their APIs mirror each other); None on cpu."""
    name = backend()
    if name == "cuda":
        return torch.cuda
    if name == "musa":
        return _musa_module()
    return None


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def default_device() -> torch.device:
    """This process's device: ``cuda:LOCAL_RANK`` / ``musa:LOCAL_RANK`` / ``cpu``."""
    name = backend()
    if name == "cpu":
        return torch.device("cpu")
    count = device_module().device_count()
    return torch.device(name, local_rank() % max(count, 1))


def dist_backend() -> str:
    """The torch.distributed backend for this process: nccl, mccl or gloo."""
    return DIST_BACKENDS[backend()]


def synchronize(device: torch.device | None = None) -> None:
    """Wait for all queued work on the device (no-op on cpu)."""
    mod = device_module()
    if mod is not None:
        mod.synchronize(device)


def device_name() -> str:
    mod = device_module()
    if mod is None:
        return "cpu"
    return mod.get_device_name(default_device())


@dataclass(frozen=True)
class TargetDevice:
    """The device whose kernels' host logic runs on ``meta`` tensors: its compute capability and multiprocessors."""

    capability: tuple[int, int]
    multiprocessors: int


HOPPER = TargetDevice((9, 0), 132)  # H100/H200/H800 SXM
_target = threading.local()


@contextmanager
def planning_for(device: TargetDevice) -> Iterator[None]:
    """Within the block (this thread), ``device_capability``, ``fp8_native`` and ``device_multiprocessors``
    describe ``device``: the memory measurement runs the kernels' wrappers on ``meta`` tensors as on that GPU."""
    previous = getattr(_target, "device", None)
    _target.device = device
    try:
        yield
    finally:
        _target.device = previous


def device_multiprocessors() -> int | None:
    """The device's streaming multiprocessors (``planning_for``'s inside it), or None on the cpu."""
    target = getattr(_target, "device", None)
    if target is not None:
        return target.multiprocessors
    module = device_module()
    if module is None or backend() == "cpu":
        return None
    return int(module.get_device_properties(default_device()).multi_processor_count)


def device_capability() -> tuple[int, int] | None:
    target = getattr(_target, "device", None)
    if target is not None:
        return target.capability
    mod = device_module()
    if mod is None:
        return None
    return tuple(mod.get_device_capability(default_device()))


def fp8_native() -> bool:
    """Whether the device multiplies e4m3 in hardware (CUDA sm89+, MUSA compute capability 3.1+)."""
    cap = device_capability()
    if cap is None:
        return False
    return cap >= ((8, 9) if backend() == "cuda" else (3, 1))


def triton_interpreted() -> bool:
    """Whether Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def triton_available() -> bool:
    """Whether a Triton kernel can run here: importable, and a GPU backend or the CPU interpreter."""
    if importlib.util.find_spec("triton") is None:
        return False
    return backend() != "cpu" or triton_interpreted()


def triton_unavailable_reason() -> str | None:
    """Why Triton cannot run, in words, or None when it can."""
    if importlib.util.find_spec("triton") is None:
        return "the 'triton' package is not installed"
    if backend() == "cpu" and not triton_interpreted():
        return "backend is cpu and TRITON_INTERPRET=1 is not set"
    return None


class Event:
    """A timing event on the device stream (device events on GPU, perf_counter on cpu)."""

    def __init__(self) -> None:
        mod = device_module()
        self._event = mod.Event(enable_timing=True) if mod is not None else None
        self._t = 0.0

    def record(self) -> None:
        if self._event is not None:
            self._event.record()
        else:
            self._t = time.perf_counter()

    def elapsed_time(self, end: Event) -> float:
        """Milliseconds from this event to ``end`` (both must have been recorded)."""
        if self._event is not None:
            end._event.synchronize()
            return self._event.elapsed_time(end._event)
        return (end._t - self._t) * 1e3


def current_stream() -> object | None:
    """The calling thread's current device stream (None on cpu), to hand to another thread."""
    mod = device_module()
    return None if mod is None else mod.current_stream()


def stream_guard(stream: object | None) -> AbstractContextManager:
    """Make ``stream`` (from ``current_stream``, possibly another thread's) current in this thread.

    Work queued by a helper thread on its caller's stream is ordered with the caller's own kernels
    (current streams and devices are per thread; a new thread would otherwise use the default stream).
    """
    return nullcontext() if stream is None else device_module().stream(stream)


def empty_cache() -> None:
    mod = device_module()
    if mod is not None:
        mod.empty_cache()


def max_memory_allocated() -> int:
    mod = device_module()
    return 0 if mod is None else int(mod.max_memory_allocated())


def reset_peak_memory_stats() -> None:
    mod = device_module()
    if mod is not None:
        mod.reset_peak_memory_stats()
