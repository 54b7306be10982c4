"""Async, atomic, verifiable training checkpoints (see docs/checkpointing.md)."""

from training.checkpoint.format import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    config_hash,
)
from training.checkpoint.manager import CheckpointManager, LoadedCheckpoint, check_shapes, read_checkpoint
from training.checkpoint.rng import capture_rng_state, restore_rng_state
from training.checkpoint.writer import CheckpointWriteError

__all__ = [
    "CheckpointCorruptError", "CheckpointError", "CheckpointManager", "CheckpointMismatchError",
    "CheckpointWriteError", "LoadedCheckpoint", "capture_rng_state", "check_shapes", "config_hash",
    "read_checkpoint", "restore_rng_state",
]
