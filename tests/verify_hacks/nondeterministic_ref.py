"""Bad input: a reference that adds unseeded noise, so two runs with the same seed differ."""

import os

import torch

ROWS, COLS = 24, 40


def reference(x, y):
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little")))
    return 2 * x + y + noise


def make_inputs(seed, device):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(ROWS, COLS, generator=g).to(device), torch.randn(ROWS, COLS, generator=g).to(device))
