"""Cheat: precomputes the answer for the inputs of seed 0 and returns it (a seed-specific hard-coded output)."""

import torch
from axpy_kernels import axpy, noop
from axpy_ref import make_inputs

_KNOWN = axpy(*make_inputs(0, torch.device("cpu")))


def candidate(x, y):
    noop(x)
    return _KNOWN.clone()
