"""Peak throughput of known devices, for MFU and roofline figures.

Dense (no 2:4 sparsity) tensor-core peaks, and the device memory the driver reports (the 80 GB
H100/H800 parts show 81559 MiB = 79.6 GiB, the 141 GB H200 143771 MiB = 140.4 GiB, the A100 80GB
81920 MiB; the 40 GB A100 is not told apart). Figures are the vendors' published numbers; where a
vendor publishes only a sparse figure it is halved. MUSA figures come from Moore Threads'
product pages and launch material and are less certain than NVIDIA's datasheets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    bf16_tflops: float
    fp8_tflops: float  # 0.0 where the device has no FP8 tensor cores
    memory_gbps: float
    memory_gib: float = 0.0  # device memory the driver reports (nvidia-smi's total), GiB; 0.0 = unknown


# Order matters: the first key found in the device name wins (form-factor variants before the SXM part).
# A key matches as a whole model number: "A100" does not match "RTX A1000".
_SPECS: tuple[tuple[str, DeviceSpec], ...] = (
    # NVIDIA GB300 NVL72 datasheet: 360 bf16 / 720 fp8 PFLOP/s sparse per 72 GPUs (halved: 2.5 / 5 dense per GPU),
    # 8 TB/s and 288 GB HBM3e per GPU (288e9 bytes = 268.2 GiB; the driver's figure is not published).
    ("GB300", DeviceSpec("GB300", 2500.0, 5000.0, 8000.0, 268.2)),
    # NVIDIA GB200 NVL72 datasheet: 360 bf16 / 720 fp8 PFLOP/s sparse per 72 GPUs (halved: 2.5 / 5 dense per GPU),
    # 8 TB/s and 186 GB HBM3e per GPU (186e9 bytes = 173.2 GiB).
    ("GB200", DeviceSpec("GB200", 2500.0, 5000.0, 8000.0, 173.2)),
    # NVIDIA HGX B300 datasheet: 36 bf16 / 72 fp8 PFLOP/s sparse per 8 GPUs (halved: 2.25 / 4.5 dense per GPU),
    # 8 TB/s and 288 GB HBM3e per GPU (288e9 bytes = 268.2 GiB).
    ("B300", DeviceSpec("B300", 2250.0, 4500.0, 8000.0, 268.2)),
    # NVIDIA HGX B200 datasheet: 4.5 bf16 / 9 fp8 PFLOP/s sparse per GPU (halved), 8 TB/s HBM3e, 180 GB.
    ("B200", DeviceSpec("B200", 2250.0, 4500.0, 8000.0, 179.0)),
    # NVIDIA H200 NVL datasheet: 1671 bf16 / 3341 fp8 sparse TFLOP/s (halved), 4.8 TB/s HBM3e.
    ("H200 NVL", DeviceSpec("H200 NVL", 835.0, 1670.0, 4800.0, 140.4)),
    # NVIDIA H200 datasheet (SXM): 989 bf16 / 1979 fp8 dense TFLOP/s, 4.8 TB/s HBM3e.
    ("H200", DeviceSpec("H200", 989.0, 1979.0, 4800.0, 140.4)),
    # NVIDIA H100 NVL datasheet: 1671 bf16 / 3341 fp8 sparse TFLOP/s (halved), 3.9 TB/s HBM3.
    ("H100 NVL", DeviceSpec("H100 NVL", 835.0, 1670.0, 3900.0, 93.6)),
    # NVIDIA H100 PCIe datasheet: 1513 bf16 / 3026 fp8 sparse TFLOP/s (halved), 2.0 TB/s HBM2e.
    ("H100 PCIE", DeviceSpec("H100 PCIe", 756.0, 1513.0, 2000.0, 79.6)),
    # NVIDIA H800 (SXM): H100 compute with reduced NVLink; 3.35 TB/s HBM3 (DeepSeek-V3 report's cluster).
    ("H800", DeviceSpec("H800", 989.0, 1979.0, 3350.0, 79.6)),
    # NVIDIA H100 datasheet (SXM5): 989 bf16 / 1979 fp8 dense TFLOP/s, 3.35 TB/s HBM3.
    ("H100", DeviceSpec("H100", 989.0, 1979.0, 3350.0, 79.6)),
    # NVIDIA A100 datasheet (SXM 80GB): 312 bf16 dense TFLOP/s, no FP8, 2.039 TB/s HBM2e.
    ("A100", DeviceSpec("A100", 312.0, 0.0, 2039.0, 80.0)),
    # Moore Threads MTT S5000 launch material: ~1 PFLOP/s FP8, ~500 bf16, 1.6 TB/s (press figures).
    ("S5000", DeviceSpec("MTT S5000", 500.0, 1000.0, 1600.0)),
    # Moore Threads MTT S4000 product page: 100 TFLOP/s bf16/fp16, no FP8, 768 GB/s GDDR6.
    ("S4000", DeviceSpec("MTT S4000", 100.0, 0.0, 768.0, 48.0)),
)


def _key_pattern(key: str) -> re.Pattern[str]:
    # Not preceded by a letter or digit, not followed by a digit: "NVIDIA H100 80GB HBM3" and
    # "A100-SXM4-80GB" match, "RTX A1000" and "GH1000" do not. Spaces match '-' or '_' too.
    body = r"[\s_-]+".join(re.escape(part) for part in key.split())
    return re.compile(rf"(?<![A-Z0-9]){body}(?![0-9])")


_PATTERNS = tuple((_key_pattern(key), spec) for key, spec in _SPECS)


def lookup(device_name: str) -> DeviceSpec | None:
    """The spec whose model number occurs in ``device_name`` (case-insensitive), or None if unknown."""
    upper = device_name.upper()
    for pattern, spec in _PATTERNS:
        if pattern.search(upper):
            return spec
    return None


def known_devices() -> list[str]:
    return [spec.name for _, spec in _SPECS]


def mfu(flops_per_second: float, device_name: str, fp8: bool = False) -> float | None:
    """Model FLOPs utilisation against the device's dense peak; None for an unknown device."""
    spec = lookup(device_name)
    if spec is None:
        return None
    peak = spec.fp8_tflops if fp8 and spec.fp8_tflops else spec.bf16_tflops
    return flops_per_second / (peak * 1e12)
