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
