"""The one-rank process group the GPU area checks run in (NCCL/MCCL refuse two ranks on one device).

Imported by the Python checks of this folder's area scripts (run from the repo root). Lives beside
them, not in the toolkit: only these single-device checks need a rendezvous without torchrun.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

import accel


def init_one_rank_group() -> torch.device:
    """Start a world of one on this host's accelerator (a free local port); return the device."""
    device = accel.default_device()
    if device.type == "cpu":
        raise RuntimeError("no accelerator visible: the GPU checks need CUDA or MUSA")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group(accel.dist_backend())
    return device
