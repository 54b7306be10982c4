"""Point-to-point transfer of tensor lists between pipeline ranks, with shapes sent per message.

Each message is a fixed-size int64 header (which message it is, then dtype and shape of every
tensor, or "None") followed by one transfer per tensor. The receiver learns shapes and dtypes
from the header, so stages may change shapes from step to step and no global
``set_p2p_tensor_shapes`` is needed. The header also names the message, so ranks that disagree
about the schedule fail loudly instead of mixing up tensors. Every wait has a timeout that
names this rank, the peer and the action. With a ``flight`` recorder (``accel.flight``) every send and
receive is an entry of it, and a receive that fails dumps the recorder before the error leaves it.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from accel.flight import Entry, FlightRecorder
from dualpipe.ir import Message

HEADER_LEN = 64
_MAGIC = 0x5D1A
_KIND_CODE = {"act": 1, "grad": 2}
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool,
          torch.uint8, torch.int8, torch.int16, torch.float8_e4m3fn, torch.float8_e5m2)


class P2PTimeoutError(TimeoutError):
    """A peer did not deliver a message in time (dead, stalled, or running another schedule)."""


class P2PMismatchError(ValueError):
    """A peer sent something other than what this rank's schedule expects."""


class P2P:
    """Sends and receives ``Message`` payloads between pipeline ranks of ``group``.

    ``peers[p]`` is the global rank of pipeline rank ``p``. Sends are asynchronous; their
    handles are kept until ``wait_sends`` (the tensors must stay untouched until then).
    """

    def __init__(self, group: dist.ProcessGroup | None, peers: Sequence[int], rank: int, device: torch.device,
                 timeout: float = 300.0):
        self.group, self.peers, self.rank, self.device = group, list(peers), rank, device
        self.timeout = datetime.timedelta(seconds=timeout)
        self._sends: list[tuple[list[dist.Work], list[torch.Tensor], list[torch.Tensor], Entry | None]] = []
        self.blocked_s = 0.0  # time spent blocked in receives (benchmarks separate it from overhead)
        self.flight: FlightRecorder | None = None  # when set, each send and receive is an entry of it

    # -- header ------------------------------------------------------------------------------
    def _header(self, msg: Message, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        fields = [_MAGIC, _KIND_CODE[msg.kind], msg.stage, msg.mb, len(tensors)]
        for t in tensors:
            if t is None:
                fields += [-1, 0]
                continue
            if t.dtype not in DTYPES:
                raise ValueError(f"rank {self.rank}: cannot send dtype {t.dtype} for {msg}; supported: {DTYPES}")
            fields += [DTYPES.index(t.dtype), t.dim(), *t.shape]
        if len(fields) > HEADER_LEN:
            raise ValueError(f"rank {self.rank}: {msg} carries too many tensors/dims for the {HEADER_LEN}-slot header")
        header = torch.full((HEADER_LEN,), -2, dtype=torch.int64, device=self.device)
        header[: len(fields)] = torch.tensor(fields, dtype=torch.int64)
        return header

    def _parse(self, msg: Message, header: torch.Tensor) -> list[tuple[torch.dtype, tuple[int, ...]] | None]:
        h = header.tolist()
        expect = [_MAGIC, _KIND_CODE[msg.kind], msg.stage, msg.mb]
        if h[:4] != expect:
            raise P2PMismatchError(f"rank {self.rank}: expected {msg} from rank {msg.src} but received a message for "
                                   f"kind={h[1]} stage={h[2]} mb={h[3]} (do all ranks run the same schedule?)")
        specs: list[tuple[torch.dtype, tuple[int, ...]] | None] = []
        i = 5
        for _ in range(h[4]):
            code, ndim = h[i], h[i + 1]
            specs.append(None if code < 0 else (DTYPES[code], tuple(h[i + 2: i + 2 + ndim])))
            i += 2 + ndim
        return specs

    # -- transfer ----------------------------------------------------------------------------
    def send(self, msg: Message, tensors: Sequence[torch.Tensor | None], free_after: bool = False) -> None:
        """Post ``tensors`` to ``msg.dst``. With ``free_after``, their storage is released once sent
        (upstream's memory saving for stage outputs that are only kept as autograd roots)."""
        dst = self.peers[msg.dst]
        header = self._header(msg, tensors)
        payload = [t.detach().contiguous() for t in tensors if t is not None]
        entry = None
        if self.flight is not None:
            entry = self.flight.begin("send", message_name(msg), stage=msg.stage, mb=msg.mb, peer=dst, blocking=False,
                                      posted=True, nbytes=sum(t.numel() * t.element_size() for t in payload))
        works = [dist.isend(t, dst, group=self.group) for t in (header, *payload)]
        to_free = [t for t in tensors if t is not None] if free_after else []
        self._sends.append((works, [header, *payload], to_free, entry))

    def recv(self, msg: Message, action: str) -> list[torch.Tensor | None]:
        if self.flight is None:
            return self._recv(msg, action, None)
        with self.flight.record("recv", message_name(msg), stage=msg.stage, mb=msg.mb, peer=self.peers[msg.src],
                                context=action) as entry:
            return self._recv(msg, action, entry)

    def _recv(self, msg: Message, action: str, entry: Entry | None) -> list[torch.Tensor | None]:
        src = self.peers[msg.src]
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        self._wait(dist.irecv(header, src, group=self.group), msg, action)
        out = [None if spec is None else torch.empty(spec[1], dtype=spec[0], device=self.device)
               for spec in self._parse(msg, header)]
        works = [dist.irecv(t, src, group=self.group) for t in out if t is not None]  # all in flight at once
        if entry is not None:
            entry.nbytes = sum(t.numel() * t.element_size() for t in out if t is not None)
        for work in works:
            self._wait(work, msg, action)
        return out

    def _wait(self, work: dist.Work, msg: Message, action: str) -> None:
        t0 = time.perf_counter()
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            step = f" at step {self.flight.step}" if self.flight is not None and self.flight.step is not None else ""
            raise P2PTimeoutError(
                f"{self._name(self.rank)}: no {msg.kind} message for stage {msg.stage} micro-batch {msg.mb} from "
                f"{self._name(msg.src)} within {self.timeout.total_seconds():.0f}s (needed by action {action}{step}); "
                f"the peer is dead, stalled or on another schedule: {exc}") from exc
        finally:
            self.blocked_s += time.perf_counter() - t0

    def _name(self, pp_rank: int) -> str:
        """A pipeline rank as errors name it: its global rank, and its pipeline rank where that differs."""
        glob = self.peers[pp_rank]
        return f"rank {glob}" if glob == pp_rank else f"rank {glob} (pipeline rank {pp_rank})"

    def reap_sends(self) -> None:
        """Forget sends that have completed (cheap), releasing what was marked ``free_after``."""
        pending = []
        for works, keep, to_free, entry in self._sends:
            if all(w.is_completed() for w in works):
                _release(to_free)
                if entry is not None:
                    self.flight.end(entry)
            else:
                pending.append((works, keep, to_free, entry))
        self._sends = pending

    def wait_sends(self) -> None:
        for works, _, to_free, entry in self._sends:
            if entry is not None:
                self.flight.waiting(entry)
            for w in works:
                try:
                    w.wait(self.timeout)
                except RuntimeError as exc:
                    error = P2PTimeoutError(f"rank {self.rank}: a send did not complete within "
                                            f"{self.timeout.total_seconds():.0f}s: {exc}")
                    if entry is not None:
                        self.flight.fail(entry, error)
                    raise error from exc
            _release(to_free)
            if entry is not None:
                self.flight.end(entry)
        self._sends = []


def message_name(msg: Message) -> str:
    """How the flight recorder names a message, the same on its sender and its receiver."""
    return f"{msg.kind} stage {msg.stage} mb {msg.mb}"


def _release(tensors: Sequence[torch.Tensor]) -> None:
    for t in tensors:
        t.data = torch.empty(0, dtype=t.dtype, device=t.device)
