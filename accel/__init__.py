"""accel: the one place that knows the backend (cuda / musa / cpu), and the kernel registry."""

from accel.torch_support import require_supported_torch

require_supported_torch()  # before anything else: an untested torch is refused in one line (accel/torch_support.py)

from accel import registry, specs  # noqa: E402
from accel.backend import (  # noqa: E402
    BACKENDS,
    HOPPER,
    BackendError,
    Event,
    TargetDevice,
    backend,
    current_stream,
    default_device,
    detect_backend,
    device_capability,
    device_module,
    device_multiprocessors,
    device_name,
    dist_backend,
    empty_cache,
    fp8_native,
    local_rank,
    max_memory_allocated,
    planning_for,
    reset,
    reset_peak_memory_stats,
    stream_guard,
    synchronize,
    triton_available,
    triton_interpreted,
    triton_unavailable_reason,
)
from accel.registry import Case, KernelFallbackError, Unsupported, VerifySpec  # noqa: E402
from accel.specs import DeviceSpec, lookup, mfu  # noqa: E402
from accel.timing import do_bench  # noqa: E402

__all__ = [
    "BACKENDS", "BackendError", "Case", "DeviceSpec", "Event", "HOPPER", "KernelFallbackError", "TargetDevice",
    "Unsupported", "VerifySpec", "backend", "current_stream", "default_device", "detect_backend", "device_capability",
    "device_module", "device_multiprocessors", "device_name", "dist_backend", "do_bench", "empty_cache", "fp8_native",
    "local_rank", "lookup", "max_memory_allocated", "mfu", "planning_for", "registry", "reset",
    "reset_peak_memory_stats", "specs", "stream_guard", "synchronize", "triton_available", "triton_interpreted",
    "triton_unavailable_reason",
]
