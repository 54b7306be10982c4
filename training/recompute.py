"""Whole-block recompute ("block"), applied from outside: a layer's compute keeps only its inputs for backward.

``checkpointed(fn, layer, *args)`` is ``torch.utils.checkpoint`` (non-reentrant, so it composes with every
backward a pipeline runs: a piece's own ``torch.autograd.backward``, or ``torch.autograd.grad``) around
``fn(*args)``. The model is not told: its forward is the math, and the memory policy
(``training.memory_policy.MemoryPolicy.recomputed``) hands this wrapper to whoever runs a layer (the layer loop,
the MTP depths, the overlapped plan's pieces).

A replay is a second forward of the same layer, inside backward. The model's running statistics (the balancer's
expert load counts and balance-loss sums, the MoE's received rows, the V3.2 indexer's loss and recall sums) count
every forward, so a replay would count a micro-batch twice: around its replay ``fn`` runs between a snapshot and
a restore of those statistics (``_Statistics``), so the replay changes nothing but what backward needs. deep_gemm's
layers keep the parameter itself on their autograd context (not a saved-tensor copy), so weight gradients land on
the real parameters when the saved tensors are the replay's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from models.deepseek_v3.balancing import ExpertBalancer
from models.deepseek_v3.indexer import IndexerStats
from models.deepseek_v3.moe import MoE

# the modules whose running statistics a forward adds to (their tensor and dict attributes)
STATISTICS = (ExpertBalancer, MoE, IndexerStats)


class _Statistics:
    """The running statistics of ``layer``'s statistics modules as they are now; ``restore()`` puts them back.

    A statistic is a public attribute of one of ``STATISTICS`` that holds a tensor (added to in place or replaced)
    or a dict of them (entries replaced); parameters, buffers and submodules are not statistics."""

    def __init__(self, layer: nn.Module):
        self.kept: list[tuple[nn.Module, str, Any, Any]] = []  # (module, name, the object, its value now)
        for m in layer.modules():
            if not isinstance(m, STATISTICS):
                continue
            for name, value in vars(m).items():
                if name.startswith("_") or isinstance(value, nn.Parameter):
                    continue
                if isinstance(value, torch.Tensor):
                    self.kept.append((m, name, value, value.clone()))
                elif isinstance(value, dict):
                    self.kept.append((m, name, value, dict(value)))
                elif value is None:  # a statistic not counted yet (``MoE.received_rows``)
                    self.kept.append((m, name, None, None))

    def restore(self) -> None:
        with torch.no_grad():
            for m, name, obj, value in self.kept:
                now = getattr(m, name)
                if now is obj and isinstance(obj, torch.Tensor) and now.shape == value.shape:
                    now.copy_(value)  # the same tensor object: whoever holds it sees the restored values
                elif now is obj and isinstance(obj, dict):
                    now.clear()
                    now.update(value)
                elif obj is not None or isinstance(now, torch.Tensor):
                    setattr(m, name, value)


def checkpointed(fn: Callable, layer: nn.Module, *args):
    """``fn(*args)``, keeping only ``args`` for backward (``fn`` replayed there) when gradients flow; the replay
    leaves ``layer``'s running statistics as they were."""
    differentiable = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    if not (torch.is_grad_enabled() and differentiable):
        return fn(*args)
    calls = 0

    def run(*inputs):
        nonlocal calls
        calls += 1
        full = list(args)  # the rest (RoPE tables, routing records) as they are: the checkpoint sees the inputs only
        for i, x in zip(differentiable, inputs):
            full[i] = x
        if calls == 1:
            return fn(*full)
        kept = _Statistics(layer)
        try:
            return fn(*full)
        finally:  # also when the checkpoint stops the replay early (it raises to stop)
            kept.restore()

    return checkpoint(run, *(args[i] for i in differentiable), use_reentrant=False)


__all__ = ["STATISTICS", "checkpointed"]
