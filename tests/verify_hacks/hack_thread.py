"""Cheat: launches the kernel from a worker thread and returns before it finishes (the timed region ends early)."""

import threading

import torch
from axpy_kernels import axpy_kernel, launch


def candidate(x, y):
    out = torch.empty_like(x)
    worker = threading.Thread(target=launch, args=(axpy_kernel, x, y, out))
    worker.start()
    worker.join()  # joined here so the test is deterministic; the harness flags the thread either way
    return out
