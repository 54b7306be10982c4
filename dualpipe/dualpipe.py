"""DualPipe: upstream-compatible class over the shared runtime (bidirectional pipeline)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from accel.flight import recorded
from accel.grads import accumulate_grad, grad
from dualpipe.runtime import DEFAULT_P2P_TIMEOUT, Pipeline
from dualpipe.utils import scatter


class DualPipe(Pipeline):
    """DualPipe: rank ``r`` of ``PP`` (even) holds ``modules = (part r, part PP-1-r)`` of a PP-part
    model. Half of the micro-batches enter at rank 0 and flow down, half enter at rank PP-1 and
    flow up through the mirrored copies. Needs ``num_chunks`` even and ``>= 2 * PP``.

    As upstream, rank 0 and rank PP-1 both pass their inputs; labels on rank 0 belong to the
    inputs of rank PP-1 and vice versa, and each returns the loss of the other's inputs. The two
    copies of each part must start equal; call ``sync_mirrored_grads()`` after ``step`` so both
    hold the summed gradient (a parameter shared by the two parts of a rank is summed once).
    """

    def __init__(self, modules: tuple[nn.Module, nn.Module], batch_dim: int = 0,
                 process_group: dist.ProcessGroup | None = None, rank_mapping: Sequence[int] | None = None,
                 p2p_timeout: float = DEFAULT_P2P_TIMEOUT, free_sent_outputs: bool = True) -> None:
        if len(modules) != 2:
            raise ValueError(f"DualPipe needs two stage modules per rank, got {len(modules)}")
        super().__init__(modules, "dualpipe", batch_dim, process_group, rank_mapping, p2p_timeout,
                         free_sent_outputs)
        if self.num_ranks % 2:
            raise ValueError(f"DualPipe needs an even number of ranks, got {self.num_ranks}")

    def step(self, *inputs: torch.Tensor | None, num_chunks: int = 0, criterion: Callable | None = None,
             labels: Sequence[torch.Tensor | None] = (), return_outputs: bool = False
             ) -> tuple[torch.Tensor | None, Any]:
        """Training step (inference under ``torch.no_grad()``); see the class docstring for
        which rank passes what. Returns ``(loss, outputs)`` on ranks 0 and PP-1, else ``(None, None)``."""
        self._checked_schedule(num_chunks)
        p, half = self.num_ranks, num_chunks // 2
        end = self.rank in (0, p - 1)
        if end and torch.is_grad_enabled() and criterion is None:
            raise ValueError("DualPipe training step needs a criterion on ranks 0 and PP-1")
        # rank 0 feeds micro-batches 0..N/2-1 (down) and ends the up-chain N/2..N-1; rank PP-1 the reverse
        own = range(half) if self.rank == 0 else range(half, 2 * half)
        other = range(half, 2 * half) if self.rank == 0 else range(half)
        ins, labs = {}, {}
        if end:
            ins = dict(zip(own, scatter(inputs, half, self.batch_dim)))
            labs = dict(zip(other, scatter(tuple(labels), half, self.batch_dim)))
        losses, outs = self.run(num_chunks, ins, labs, criterion if end else None, return_outputs)
        return self._result(other, end, losses, outs, criterion, return_outputs)

    def sync_mirrored_grads(self) -> None:
        """Sum the gradients of the two copies of each part (``module[0]`` here is ``module[1]``
        on rank PP-1-r), so both copies take the same optimizer step."""
        partner = self.p2p.peers[self.num_ranks - 1 - self.rank]
        mine = [_flat_grads(self.module[0]), _flat_grads(self.module[1])]
        theirs = [torch.empty_like(mine[0]), torch.empty_like(mine[1])]
        # we send our copy of part PP-1-r (module[1]) and receive the partner's copy of part r (its module[1])
        ops = [dist.P2POp(dist.isend, mine[1], partner, self.group),
               dist.P2POp(dist.isend, mine[0], partner, self.group),
               dist.P2POp(dist.irecv, theirs[0], partner, self.group),
               dist.P2POp(dist.irecv, theirs[1], partner, self.group)]
        nbytes = sum(t.numel() * t.element_size() for t in mine)
        flight = self.flight  # our half as a send entry, so the partner's receive finds it sent
        sent = flight.begin("send", "mirrored grads", peer=partner, nbytes=nbytes, blocking=False,
                            posted=True) if flight is not None else None
        with recorded(flight, "recv", "mirrored grads", peer=partner, nbytes=nbytes):
            for w in dist.batch_isend_irecv(ops):
                w.wait(self.p2p.timeout)
        if sent is not None:
            flight.end(sent)
        # A parameter both parts hold (a shared embedding: the first part's input, the last part's MTP) is one
        # tensor here and one on the partner, whose gradient already sums both uses: add it once.
        done: set[int] = set()
        for module, extra in zip(self.module, theirs):
            offset = 0
            for p in module.parameters():
                n = p.numel()
                if id(p) not in done:
                    add = extra[offset: offset + n].view_as(p)
                    accumulate_grad(p, add)
                    done.add(id(p))
                offset += n


def _flat_grads(module: nn.Module) -> torch.Tensor:
    flat = []
    for p in module.parameters():
        g = grad(p)
        flat.append((g if g is not None else torch.zeros_like(p)).reshape(-1))
    return torch.cat(flat)
