"""Capture and restore every random-number generator a training step can touch (exact resume needs all)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

import accel


def capture_rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU and (when present) every device generator of this process."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state()}
    mod = accel.device_module()
    if mod is not None:
        state["device"] = list(mod.get_rng_state_all())
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`; a device state is restored only when the device count matches."""
    random.setstate(_as_tuple(state["python"]))
    np.random.set_state(_as_tuple(state["numpy"]))
    torch.set_rng_state(state["torch"])
    mod = accel.device_module()
    if mod is not None and "device" in state:
        if len(state["device"]) != mod.device_count():
            raise ValueError(f"checkpoint holds RNG states for {len(state['device'])} devices but this process sees "
                             f"{mod.device_count()}; expected the same device count to restore device RNG")
        mod.set_rng_state_all(state["device"])


def _as_tuple(x: Any) -> Any:
    """Python's and numpy's setstate want tuples all the way down (JSON round-trips keep them, lists tolerate)."""
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x
