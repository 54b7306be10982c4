"""accel: the one place that knows the backend (cuda / musa / cpu), and the kernel registry."""

from accel import registry, specs
from accel.backend import (
    BACKENDS,
    BackendError,
    Event,
    backend,
    current_stream,
    default_device,
    detect_backend,
    device_capability,
    device_module,
    device_name,
    dist_backend,
    empty_cache,
    fp8_native,
    local_rank,
    max_memory_allocated,
    reset,
    reset_peak_memory_stats,
    stream_guard,
    synchronize,
    triton_available,
    triton_interpreted,
    triton_unavailable_reason,
)
from accel.registry import Case, KernelFallbackError, Unsupported, VerifySpec
from accel.specs import DeviceSpec, lookup, mfu
from accel.timing import do_bench

__all__ = [
    "BACKENDS", "BackendError", "Case", "DeviceSpec", "Event", "KernelFallbackError", "Unsupported", "VerifySpec",
    "backend", "current_stream", "default_device", "detect_backend", "device_capability", "device_module",
    "device_name", "dist_backend", "do_bench", "empty_cache", "fp8_native", "local_rank", "lookup",
    "max_memory_allocated", "mfu", "registry", "reset", "reset_peak_memory_stats", "specs", "stream_guard",
    "synchronize", "triton_available", "triton_interpreted", "triton_unavailable_reason",
]
