"""``training.run`` tears down the process group it started, and only that one.

Under torchrun each worker has no group until ``init_parallel`` starts one from the environment; left to the
interpreter's exit, its teardown aborted a rank of a finished run under torch 2.11 + gloo ("terminate called
without an active exception"). A caller that started its own group (a test harness, a notebook) keeps it.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.dist_utils import run_distributed

# two data-parallel ranks, one stage, one step: the smallest run that starts a process group
OVERRIDES = ["parallel.pp=1", "parallel.dp=2", "parallel.ep=1", "parallel.schedule=none", "data.global_batch=4",
             "data.seq_len=16", "data.micro_batch=1", "run.steps=1", "run.sample_tokens=0", "run.threads=1",
             "model.fp8=false", "checkpoint.interval=0", "checkpoint.final=false", "logging.progress=false",
             "logging.eval_batches=1", "logging.wandb=disabled", "logging.plot=false"]


def _train_rank(rank: int, world: int, run_dir: str, own_group: bool) -> bool:
    """Train with the harness's group, or without one (as under torchrun); whether a group is left after."""
    from training.config import load_config
    from training.run import RunOptions, run_training

    if not own_group:
        dist.destroy_process_group()
    run_training(load_config("recipes/configs/tiny_cpu.toml", OVERRIDES), RunOptions(run_dir=run_dir, sample=False))
    return dist.is_initialized()


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_training_destroys_the_group_it_started_and_keeps_the_callers(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV3_KERNEL_IMPL", "reference")
    assert run_distributed(_train_rank, 2, str(tmp_path / "started"), False, timeout=240) == [False, False]
    assert run_distributed(_train_rank, 2, str(tmp_path / "given"), True, timeout=240) == [True, True]
