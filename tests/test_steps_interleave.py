"""How an overlapped F&B chunk runs its two step generators (``steps.interleave``) and how the comm thread
posts exchanges (``expert_parallel.post``): the order every rank must share (backward first), and a comm
thread that does not wait for one transfer to land before it posts the next."""

from __future__ import annotations

import threading

import torch

from models.deepseek_v3.expert_parallel import Posted, post
from models.deepseek_v3.steps import interleave


def _side(name: str, log: list, steps: int, value=None):
    for i in range(steps):
        log.append(f"{name}{i}")
        yield
    log.append(f"{name}{steps}")
    return value


def test_backward_goes_first_and_the_turns_alternate():
    log: list[str] = []
    out = interleave(_side("F", log, 3, value="forward out"), _side("B", log, 2))
    assert out == "forward out"
    assert log == ["B0", "F0", "B1", "F1", "B2", "F2", "F3"]  # a longer forward finishes alone


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
