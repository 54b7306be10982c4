"""Context parallelism (CP): the ranks of a CP group share each sequence, and MLA exchanges its latent.

Each sequence of ``s`` tokens is cut into ``2 x cp`` chunks of ``L = s / (2 cp)`` tokens; CP rank ``r`` holds
chunks ``r`` and ``2cp-1-r`` (TransformerEngine's load balance: every rank then has the same causal work).
A rank's rows are its two chunks, in that order, at their *global* positions (RoPE, masks, MTP shifts).

MLA's keys and values all come from one 576-wide latent per token (``kv_lora_rank`` + ``qk_rope_head_dim``,
RoPE already applied at the token's global position), so each layer all-gathers that latent over the CP
group (``gather``: differentiable, its backward reduce-scatters the gradient), up-projects the whole
sequence's keys and values locally, and attends its local queries with the global causal mask
(``attention``). ``ContextParallel`` holds the group and the run's sequence length: it is made once per run
and handed to the modules that exchange (``MLA.cp``, ``DeepSeekV3Stage.cp``); nothing changes per step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from accel.flight import FlightRecorder, record_collective
from accel.trace import TraceRecorder

# torch >= 2.13 names them *_single (the *_tensor names are deprecated there); torch 2.11 has only the old names
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def chunk_positions(seq_len: int, cp: int, cp_rank: int) -> list[int]:
    """Global positions of CP rank ``cp_rank``'s rows: chunk ``cp_rank`` then chunk ``2cp-1-cp_rank``."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} must be divisible by 2 x cp = {2 * cp}")
    chunk = seq_len // (2 * cp)
    return [c * chunk + i for c in (cp_rank, 2 * cp - 1 - cp_rank) for i in range(chunk)]


class _AllGather(torch.autograd.Function):
    """``[n, ...]`` on every rank of ``cp``'s group -> ``[cp * n, ...]`` (rank order); backward: reduce-scatter (sum)
    of the gradient, each rank keeping its own rows (gloo, which has no reduce-scatter: all-reduce then slice)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
        ctx.cp = cp
        x = x.contiguous()
        out = x.new_empty((cp.size * x.shape[0], *x.shape[1:]))
        with cp.recorded("cp all-gather", "all_gather", out.numel() * out.element_size()):
            _all_gather(out, x, group=cp.group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cp = ctx.cp
        grad = grad.contiguous()
        n = grad.shape[0] // cp.size
        with cp.recorded("backward cp reduce-scatter", "reduce_scatter", grad.numel() * grad.element_size()):
            if dist.get_backend(cp.group) == "gloo":
                dist.all_reduce(grad, group=cp.group)
                return grad[cp.rank * n:(cp.rank + 1) * n].clone(), None
            out = grad.new_empty((n, *grad.shape[1:]))
            _reduce_scatter(out, grad, group=cp.group)
        return out, None


class Posted:
    """An all-gather in flight (``ContextParallel.post_gather``): the buffer it lands in and what to close when it
    has (the wait, its trace span and flight-recorder entry)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.work: dist.Work | None = None
        self.open = contextlib.ExitStack()


class _PostGather(torch.autograd.Function):
    """Posts ``_AllGather``'s forward without waiting (``_Land`` waits); backward: its reduce-scatter."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cp: ContextParallel, posted: Posted) -> torch.Tensor:
        ctx.cp = cp
        x = x.contiguous()
        out = x.new_empty((cp.size * x.shape[0], *x.shape[1:]))
        posted.open.enter_context(cp.recorded("cp all-gather", "all_gather", out.numel() * out.element_size()))
        posted.work = _all_gather(out, x, group=cp.group, async_op=True)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllGather.backward(ctx, grad)[0], None, None


class _Land(torch.autograd.Function):
    """Waits for a posted all-gather; the gradient passes through."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, posted: Posted) -> torch.Tensor:
        with posted.open:
            posted.work.wait()
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class ContextParallel:
    """This rank's place in its CP group: ``positions`` of its rows, ``split`` of a whole sequence into them,
    ``gather`` of a per-token tensor over the group in global order, and causal ``attention`` of local queries
    over gathered keys. ``seq_len``: the run's sequence length (every micro-batch has it)."""

    def __init__(self, group: dist.ProcessGroup | None, size: int, rank: int, seq_len: int,
                 recorder: TraceRecorder | None = None, flight: FlightRecorder | None = None):
        """``recorder``: each exchange is a span of the ``--trace`` timeline's comm track; ``flight``: and an
        entry of the rank's flight recorder (a hang names the step, action and exchange)."""
        if size < 2:
            raise ValueError(f"ContextParallel needs a group of at least 2 ranks, got {size}")
        self.group, self.size, self.rank, self.seq_len = group, size, rank, seq_len
        self.recorder, self.flight = recorder, flight
        self.chunk = seq_len // (2 * size)
        self._positions = torch.tensor(chunk_positions(seq_len, size, rank), dtype=torch.long)
        # row of the gathered [cp * 2L] tensor holding global position p: rank r's rows are chunks r, 2cp-1-r
        order = [q for r in range(size) for q in chunk_positions(seq_len, size, r)]
        self._gathered_row = torch.empty(seq_len, dtype=torch.long)
        self._gathered_row[torch.tensor(order)] = torch.arange(seq_len)

    @contextlib.contextmanager
    def recorded(self, name: str, kind: str, nbytes: int) -> Iterator[None]:
        """A blocking exchange over the CP group, recorded on the trace's comm track and in the flight recorder."""
        with contextlib.ExitStack() as stack:
            if self.recorder is not None:
                stack.enter_context(self.recorder.span("comm", name))
            stack.enter_context(record_collective(self.flight, name, "cp", self.group, nbytes, kind=kind))
            yield

    @property
    def local_len(self) -> int:
        return 2 * self.chunk

    def positions(self, device: torch.device | str, rows: int | None = None) -> torch.Tensor:
        """Global positions of this rank's first ``rows`` rows (all ``2L`` by default). MTP depth k drops the
        last k positions of the sequence, the tail of the rank holding the last chunk: a prefix of its rows."""
        pos = self._positions if rows is None else self._positions[:rows]
        return pos.to(device)

    def split(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's rows of a whole-sequence tensor (``seq_len`` long on ``dim``)."""
        if t.shape[dim] != self.seq_len:
            raise ValueError(f"context parallelism: a sequence of {t.shape[dim]} tokens, expected the run's "
                             f"data.seq_len={self.seq_len}")
        return t.index_select(dim, self.positions(t.device))

    @torch.no_grad()
    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the CP group (a new tensor; no gradient): counts over the whole sequences."""
        out = t.detach().clone()
        with self.recorded("cp count sum", "all_reduce", out.numel() * out.element_size()):
            dist.all_reduce(out, group=self.group)
        return out

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """``t [b, rows, ...]`` (this rank's first ``rows <= 2L`` rows) -> ``[b, seq_len, ...]`` in global order,
        differentiable (backward: reduce-scatter). Rows a rank does not have (MTP's dropped tail) come back as
        zeros at positions no kept query can see."""
        rows = t.shape[1]
        if rows > self.local_len:
            raise ValueError(f"context parallelism: {rows} rows on a rank that holds {self.local_len}")
        if rows < self.local_len:
            t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, self.local_len - rows))
        gathered = _AllGather.apply(t.transpose(0, 1), self)
        return gathered.index_select(0, self._gathered_row.to(t.device)).transpose(0, 1)

    def post_gather(self, t: torch.Tensor) -> tuple[torch.Tensor, Posted]:
        """``gather`` in two halves, so work runs while the exchange is in flight: this posts it and returns
        (the buffer, not yet valid, and its ``Posted``); ``landed`` waits and gives ``gather``'s result."""
        rows = t.shape[1]
        if rows > self.local_len:
            raise ValueError(f"context parallelism: {rows} rows on a rank that holds {self.local_len}")
        if rows < self.local_len:
            t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, self.local_len - rows))
        posted = Posted(rows)
        return _PostGather.apply(t.transpose(0, 1), self, posted), posted

    def landed(self, buffer: torch.Tensor, posted: Posted) -> torch.Tensor:
        """The posted gather's ``[b, seq_len, ...]`` in global order, once it has landed."""
        gathered = _Land.apply(buffer, posted)
        return gathered.index_select(0, self._gathered_row.to(buffer.device)).transpose(0, 1)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Causal attention of this rank's queries ``q [b, rows, h, dqk]`` (its rows' global positions) over the
        whole sequence's ``k [b, s, h, dqk]``, ``v [b, s, h, dv]`` -> ``[b, rows, h, dv]``. One call per local
        chunk, each over the key prefix it can see (chunk c: ``(c + 1) L`` keys), so every rank scores the same
        ``(2cp + 1) L^2`` query-key pairs."""
        pos = self.positions(q.device, q.shape[1])
        outs = []
        for chunk, lo, hi in ((self.rank, 0, min(self.chunk, q.shape[1])),
                              (2 * self.size - 1 - self.rank, self.chunk, q.shape[1])):
            if hi <= lo:
                continue
            qpos = pos[lo:hi]
            keys = chunk * self.chunk + hi - lo  # up to the chunk's last kept query (known here: no device sync)
            mask = torch.arange(keys, device=q.device)[None, :] <= qpos[:, None]
            out = F.scaled_dot_product_attention(q[:, lo:hi].transpose(1, 2), k[:, :keys].transpose(1, 2),
                                                 v[:, :keys].transpose(1, 2), attn_mask=mask, scale=scale)
            outs.append(out.transpose(1, 2))
        return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
