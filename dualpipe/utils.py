"""Micro-batch splitting and joining, backward without shape re-checks, the gradient check metric."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.graph import get_gradient_edge

from accel.numerics import calc_diff  # noqa: F401 - re-exported for schedule tests and users


def scatter(inputs: Sequence[torch.Tensor | None] | torch.Tensor, chunks: int, dim: int) -> list[tuple]:
    """Split each tensor of ``inputs`` into ``chunks`` micro-batches along ``dim``; one tuple per micro-batch."""
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    for i, x in enumerate(inputs):
        if x is not None and not isinstance(x, torch.Tensor):
            raise ValueError(f"inputs[{i}] must be a tensor or None, got {type(x).__name__}")
        if x is not None and x.shape[dim] < chunks:
            raise ValueError(f"inputs[{i}] has {x.shape[dim]} rows along batch_dim={dim}, "
                             f"fewer than num_chunks={chunks} micro-batches")
    split = [[None] * chunks if x is None else list(x.tensor_split(chunks, dim=dim)) for x in inputs]
    return [tuple(s[c] for s in split) for c in range(chunks)] if split else [() for _ in range(chunks)]


def gather(micro_outputs: Sequence[Sequence[torch.Tensor]], dim: int) -> tuple[torch.Tensor | None, ...]:
    """Concatenate per-micro-batch output lists back into whole-batch tensors."""
    columns = list(zip(*micro_outputs))
    return tuple(None if col[0] is None else torch.cat(col, dim=dim) for col in columns)


def run_backward(tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    """Backward from ``tensors`` with ``grads``, accumulating into ``.grad``. The outputs of a stage may have
    had their data freed after being sent (an empty tensor in its place), so the backward starts from their
    gradient edges (public API), which autograd checks against the shapes recorded in the graph, not the
    tensors' current ones."""
    torch.autograd.backward([get_gradient_edge(t) for t in tensors], list(grads))


