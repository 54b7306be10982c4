"""accel.specs: device names as drivers report them map to the right peak figures; unknown names give None."""

from __future__ import annotations

import pytest

from accel import specs


@pytest.mark.parametrize("device_name, expected", [
    ("NVIDIA H100 80GB HBM3", "H100"),       # torch.cuda.get_device_name on an SXM5 H100
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H800", "H800"),
    ("NVIDIA H800 80GB HBM3", "H800"),
    ("NVIDIA H200", "H200"),
    ("NVIDIA H200 NVL", "H200 NVL"),
    ("nvidia h200", "H200"),                 # case-insensitive
    ("NVIDIA A100-SXM4-80GB", "A100"),
    ("MTT S4000", "MTT S4000"),
    ("MTT S5000", "MTT S5000"),
    ("Moore Threads MTT S5000", "MTT S5000"),
])
def test_known_devices(device_name, expected):
    assert specs.lookup(device_name).name == expected


@pytest.mark.parametrize("device_name", [
    "cpu", "", "NVIDIA GeForce RTX 4090", "NVIDIA H20",   # H20 is not an H200
    "NVIDIA RTX A1000 6GB Laptop GPU",                    # contains "A100" but is not one
    "MTT S80",
])
def test_unknown_devices(device_name):
    assert specs.lookup(device_name) is None


def test_figures_are_consistent():
    h100, h800, h200 = specs.lookup("H100"), specs.lookup("H800"), specs.lookup("H200")
    # Same Hopper compute; H200 has more bandwidth; FP8 dense is twice bf16 dense on Hopper.
    assert h100.bf16_tflops == h800.bf16_tflops == h200.bf16_tflops
    assert h200.memory_gbps > h100.memory_gbps
    for spec in (h100, h800, h200):
        assert spec.fp8_tflops == pytest.approx(2 * spec.bf16_tflops, rel=0.01)
    assert specs.lookup("A100").fp8_tflops == 0.0  # no FP8 tensor cores
    assert set(specs.known_devices()) >= {"H100", "H800", "H200", "A100", "MTT S4000", "MTT S5000"}


def test_mfu():
    assert specs.mfu(494.5e12, "NVIDIA H100 80GB HBM3") == pytest.approx(0.5)
    assert specs.mfu(989.5e12, "NVIDIA H800", fp8=True) == pytest.approx(0.5, rel=1e-3)
    assert specs.mfu(156e12, "NVIDIA A100-SXM4-80GB", fp8=True) == pytest.approx(0.5)  # no fp8: bf16 peak
    assert specs.mfu(1e12, "cpu") is None
