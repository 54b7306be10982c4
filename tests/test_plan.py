"""The overlapped F&B plan (``models.deepseek_v3.plan``): a Run's gradients equal a plain backward's, the
turns of an overlapped chunk are fixed (backward first), a Run lets go of what no later piece reads; and the
comm thread (``expert_parallel.post``) posts the next exchange while one travels."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from models.deepseek_v3.expert_parallel import Posted, post
from models.deepseek_v3.plan import Compute, Exchange, Run, overlapped


class _Done:
    """A handle that has landed already."""

    def __init__(self, value) -> None:
        self.value = value

    def wait(self):
        return self.value


@dataclass
class _Mirror:
    """An exchange with one rank: what lands is what was sent, times ``scale`` (so a wrong reverse shows)."""

    log: list
    name: str
    scale: float = 2.0

    def reverse(self, grad):
        self.log.append(f"reverse {self.name}")
        return _Done(grad * self.scale)


@dataclass
class _Landed:
    rows: torch.Tensor
    exchanged: _Mirror


def _exchange(name: str, log: list, sends: str, lands: str) -> Exchange:
    def posted(x):
        log.append(f"post {name}")
        return _Done(_Landed(x.detach() * 2.0, _Mirror(log, name)))

    return Exchange(name, posted, (sends,), lands)


def _layer(log: list, w: torch.Tensor) -> list:
    """attention -> dispatch -> experts -> combine -> output, on ``h``, as an expert-parallel layer's pieces."""
    def attention(h):
        log.append("attention")
        return {"h": h, "send": torch.tanh(h @ w)}

    def experts(rows):
        log.append("experts")
        return {"y": rows.sin() * w.sum()}

    def output(h, back):
        log.append("output")
        return {"h": h + back * h}

    return [Compute("attention", attention, ("h",), ("h", "send")), _exchange("dispatch", log, "send", "rows"),
            Compute("experts", experts, ("rows",), ("y",)), _exchange("combine", log, "y", "back"),
            Compute("output", output, ("h", "back"), ("h",))]


def _plain(x: torch.Tensor, w: torch.Tensor, layers: int) -> torch.Tensor:
    """The same layers as one autograd graph (each exchange: times 2)."""
    h = x
    for _ in range(layers):
        back = (torch.tanh(h @ w) * 2.0).sin() * w.sum() * 2.0
        h = h + back * h
    return h


def test_a_run_backward_gives_the_gradients_of_one_graph():
    """float64: per-piece backward, values read by two pieces (``h``: attention and output) and the reverse
    exchanges give the same gradients as autograd over the whole composition, up to summation order."""
    g = torch.Generator().manual_seed(0)
    for rows, dim, layers in ((3, 4, 1), (5, 7, 3)):
        x = torch.randn(rows, dim, generator=g, dtype=torch.float64, requires_grad=True)
        w = (torch.randn(dim, dim, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
        grad = torch.randn(rows, dim, generator=g, dtype=torch.float64)
        ref = torch.autograd.grad(_plain(x, w, layers), [x, w], grad)
        run = Run([p for _ in range(layers) for p in _layer([], w)], h=x)
        out = run.forward()["h"]
        torch.testing.assert_close(out, _plain(x, w, layers).detach(), rtol=1e-12, atol=0)
        run.backward(h=grad)
        torch.testing.assert_close(x.grad, ref[0], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(w.grad, ref[1], rtol=1e-12, atol=1e-14)
        assert set(run.values) == {"h"}  # everything else was let go once its last reader had run


def test_an_overlapped_chunk_runs_backward_first_in_fixed_turns():
    """One layer's F of micro-batch a against the B of micro-batch b, in one log (B's compute runs as autograd
    and does not log; its reverse exchanges do): B's output backward and reverse combine first, then F's
    attention and dispatch, B's experts backward and reverse dispatch, F's experts and combine, B's attention
    backward, F's output. B's gradients equal a plain backward's."""
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(4, 4, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
    xa, xb = (torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    grad = torch.randn(3, 4, generator=g, dtype=torch.float64)
    ref = torch.autograd.grad(_plain(xb, w, 1), [xb, w], grad)
    log: list = []
    run_b = Run(_layer(log, w), h=xb)
    run_b.forward()
    log.clear()
    run_a = Run(_layer(log, w), h=xa)
    overlapped(run_a, run_b, h=grad)
    assert log == ["reverse combine", "attention", "post dispatch", "reverse dispatch", "experts", "post combine",
                   "output"], log
    torch.testing.assert_close(xb.grad, ref[0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(w.grad, ref[1], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(run_a.values["h"], _plain(xa, w, 1).detach(), rtol=1e-12, atol=0)


class _Work:
    def __init__(self) -> None:
        self.done = threading.Event()

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self) -> bool:
        assert self.done.wait(30), "the transfer never landed"
        return True


def test_the_comm_thread_posts_the_next_exchange_while_the_first_travels():
    first_work, posted_second = _Work(), threading.Event()
    finished_on = []

    def finish_first():
        finished_on.append(threading.get_ident())
        return torch.ones(2)

    first = post(None, "first", lambda: Posted([first_work, torch.zeros(1)], finish_first))

    def stage_second():
        posted_second.set()
        return Posted([], lambda: "second")

    second = post(None, "second", stage_second)
    assert posted_second.wait(30), "the comm thread waited for the first transfer before posting the second"
    assert not first.is_completed()
    first_work.done.set()
    assert first.is_completed()
    assert torch.equal(first.wait(), torch.ones(2)) and first.wait() is first.wait()  # finished once
    assert finished_on == [threading.get_ident()]  # on the waiter's thread, not the comm thread
    assert second.wait() == "second"
