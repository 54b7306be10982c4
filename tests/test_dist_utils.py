import os

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed


def _allreduce(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _fails(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom")


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_run_distributed_returns_each_rank_result():
    assert run_distributed(_allreduce, 2) == [3.0, 3.0]


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_run_distributed_names_failing_rank():
    with pytest.raises(RuntimeError, match="rank 1: ValueError: boom"):
        run_distributed(_fails, 2, timeout=60)


def _environment(rank: int, world_size: int, names: tuple[str, ...]) -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in names}


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_ranks_see_the_callers_environment_at_the_call(monkeypatch):
    """Ranks fork from a server started at an earlier call: they still take the environment the caller has now,
    variables added and removed since included, as spawned ranks would."""
    run_distributed(_allreduce, 2)  # the server is running from here on
    monkeypatch.setenv("DSV3_TEST_PROBE", "set after the server started")
    monkeypatch.delenv("WANDB_SILENT", raising=False)
    names = ("DSV3_TEST_PROBE", "WANDB_SILENT", "RANK")
    seen = run_distributed(_environment, 2, names)
    assert seen == [{"DSV3_TEST_PROBE": "set after the server started", "WANDB_SILENT": None, "RANK": str(r)}
                    for r in range(2)]
