"""DualPipeV: upstream-compatible class over the shared runtime (V-shaped DualPipe)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dualpipe.runtime import DEFAULT_P2P_TIMEOUT, Pipeline
from dualpipe.utils import scatter


class DualPipeV(Pipeline):
    """DualPipeV ("cut-in-half" DualPipe): rank ``r`` holds stages ``r`` and ``2*PP-1-r`` of a
    2*PP-stage model, ``modules = (stage r, stage 2*PP-1-r)``. Inputs, labels and the loss live on
    rank 0. Needs ``num_chunks >= 2 * PP``."""

    def __init__(self, modules: tuple[nn.Module, nn.Module], batch_dim: int = 0,
                 process_group: dist.ProcessGroup | None = None, rank_mapping: Sequence[int] | None = None,
                 p2p_timeout: float = DEFAULT_P2P_TIMEOUT, free_sent_outputs: bool = True) -> None:
        if len(modules) != 2:
            raise ValueError(f"DualPipeV needs two stage modules per rank, got {len(modules)}")
        super().__init__(modules, "dualpipev", batch_dim, process_group, rank_mapping, p2p_timeout,
                         free_sent_outputs)

    def step(self, *inputs: torch.Tensor | None, num_chunks: int = 0, criterion: Callable | None = None,
             labels: Sequence[torch.Tensor | None] = (), return_outputs: bool = False
             ) -> tuple[torch.Tensor | None, Any]:
        """Training step (inference under ``torch.no_grad()``) as upstream: inputs, criterion and
        labels on rank 0, which returns ``(per-micro-batch loss, outputs if return_outputs)``."""
        self._checked_schedule(num_chunks)
        first = self.rank == 0
        if first and torch.is_grad_enabled() and criterion is None:
            raise ValueError("DualPipeV training step needs a criterion on rank 0")
        ins = dict(enumerate(scatter(inputs, num_chunks, self.batch_dim))) if first else {}
        labs = dict(enumerate(scatter(tuple(labels), num_chunks, self.batch_dim))) if first else {}
        losses, outs = self.run(num_chunks, ins, labs, criterion if first else None, return_outputs)
        return self._result(range(num_chunks), first, losses, outs, criterion, return_outputs)
