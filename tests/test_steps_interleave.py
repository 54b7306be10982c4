"""How an overlapped F&B chunk runs its two step generators (``steps.interleave``) and how the comm thread
posts exchanges (``expert_parallel.post``): the order every rank must share, the weight-gradient fillers
that run only while the turn's exchange is still travelling, and a comm thread that does not wait for one
transfer to land before it posts the next."""

from __future__ import annotations

import threading

import torch

import accel.wgrad
from models.deepseek_v3.expert_parallel import Posted, post
from models.deepseek_v3.steps import collecting, interleave


class _Pending:
    """An exchange that lands after ``polls`` completion checks."""

    def __init__(self, polls: int) -> None:
        self.polls = polls

    def is_completed(self) -> bool:
        self.polls -= 1
        return self.polls < 0


def _side(name: str, log: list, landings: list[int], value=None):
    for i, polls in enumerate(landings):
        log.append(f"{name}{i}")
        yield _Pending(polls)
    log.append(f"{name}{len(landings)}")
    return value


def test_backward_goes_first_and_the_turns_alternate():
    log: list[str] = []
    out = interleave(_side("F", log, [0, 0, 0], value="forward out"), _side("B", log, [0, 0]))
    assert out == "forward out"
    assert log == ["B0", "F0", "B1", "F1", "B2", "F2", "F3"]  # a longer forward finishes alone


def test_fillers_run_only_while_the_turns_exchange_travels_and_the_rest_at_the_end():
    log: list[str] = []
    fillers = [lambda i=i: log.append(f"w{i}") for i in range(5)]
    # F0's exchange lands after 2 checks: two fillers run before F1; B's exchanges have landed already
    interleave(_side("F", log, [2, 0]), _side("B", log, [0]), fillers)
    assert log == ["B0", "F0", "B1", "w0", "w1", "F1", "F2", "w2", "w3", "w4"]
    assert fillers == []


def test_collecting_hands_the_steps_deferred_weight_gradients_to_the_list():
    made: list = []

    def backward():
        assert accel.wgrad.defer(lambda: None)  # a layer defers its weight gradient while a step runs
        yield _Pending(0)
        assert accel.wgrad.defer(lambda: None)
        return "done"

    steps = collecting(backward(), made.append)
    assert not accel.wgrad.active()
    next(steps)
    assert len(made) == 1 and not accel.wgrad.active()  # only while the step itself runs
    try:
        next(steps)
    except StopIteration as stop:
        assert stop.value == "done"
    assert len(made) == 2


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
