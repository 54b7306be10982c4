"""Plain-function problem for the hack tests: out = 2 x + y, fp32."""

import torch

ROWS, COLS = 24, 40


def reference(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 2 * x + y


def make_inputs(seed: int, device: torch.device):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(ROWS, COLS, generator=g).to(device), torch.randn(ROWS, COLS, generator=g).to(device))
