"""The round-to-nearest-even helpers, shared with the other kernel packages from ``accel.rounding``."""

from accel.rounding import round_to_bf16, round_to_e4m3_grid

__all__ = ["round_to_bf16", "round_to_e4m3_grid"]
