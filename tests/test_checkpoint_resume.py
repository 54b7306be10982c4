"""Resume: exact on CPU, optimizer states re-partitioned for another data-parallel size, torchrun restarts."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist_utils import free_port, run_distributed
from training.checkpoint import CheckpointManager
from training.checkpoint.example_loop import main as example_main
from training.checkpoint.resume import (
    gather_named_optimizer_state,
    load_named_optimizer_state,
    named_optimizer_state,
)
from training.optim import AdamW

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_resume_is_bit_exact(tmp_path):
    common = ["--interval", "4", "--hidden", "24"]
    straight = example_main(["--root", str(tmp_path / "a"), "--steps", "16", "--resume", "none", *common])
    first = example_main(["--root", str(tmp_path / "b"), "--steps", "8", "--resume", "none", *common])
    second = example_main(["--root", str(tmp_path / "b"), "--steps", "16", "--resume", "auto", *common])
    assert sorted(second) == list(range(9, 17))  # it resumed at step 8 instead of starting over
    assert {**first, **second} == straight  # float equality: bit-identical losses


def _adamw(groups, masters: bool):
    """torch's AdamW, or (``masters``) ours with FP32 master weights and BF16 moments for BF16 parameters."""
    if masters:
        return AdamW(groups, moments_dtype=torch.bfloat16, master_dtype=torch.float32)
    return torch.optim.AdamW(groups)


def _adamw_with_state(shapes, seed, masters: bool = False):
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if masters else torch.float32
    params = [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in shapes]
    opt = _adamw([{"params": params[:2], "lr": 0.1}, {"params": params[2:], "weight_decay": 0.0}], masters)
    for _ in range(3):
        sum((p * torch.randn_like(p)).sum() for p in params).backward()
        opt.step()
    names = {id(p): f"layer{i}.weight" for i, p in enumerate(params)}
    return params, opt, names


@pytest.mark.timeout(60)
@pytest.mark.parametrize("saved_world,new_world", [(2, 1), (2, 3), (1, 2), (3, 2)])
@pytest.mark.parametrize("masters", [False, True], ids=["torch", "bf16+fp32 masters"])
def test_optimizer_states_repartition_exactly(tmp_path, saved_world, new_world, masters):
    """Also with FP32 master weights of BF16 parameters (their masters and BF16 moments keep their dtypes)."""
    shapes = [(5, 3), (7,), (2, 2, 2), (4,), (6, 1)]
    params, full_opt, names = _adamw_with_state(shapes, seed=saved_world * 10 + new_world, masters=masters)
    full = named_optimizer_state(full_opt, names)

    def owned(world, rank):  # ZeRO-1 style: whole parameters dealt round-robin
        return [p for i, p in enumerate(params) if i % world == rank]

    def shard_opt(world, rank):
        mine = owned(world, rank)
        groups = [{"params": [p for p in params[:2] if any(p is m for m in mine)], "lr": 0.1},
                  {"params": [p for p in params[2:] if any(p is m for m in mine)], "weight_decay": 0.0}]
        return _adamw(groups, masters)

    # save: each "rank" writes the states of the parameters it owns; rank 0 commits (written last here).
    # All managers exist before any save, as in a real job (rank 0 sweeps leftover staging folders at start).
    managers = [CheckpointManager(tmp_path, rank=r, world_size=saved_world, async_save=False)
                for r in range(saved_world)]
    for rank in reversed(range(saved_world)):
        opt = shard_opt(saved_world, rank)
        sub = {"state": {n: s for n, s in full["state"].items()
                         if any(names[id(p)] == n for p in owned(saved_world, rank))},
               "param_groups": full["param_groups"]}
        load_named_optimizer_state(opt, names, sub)
        mgr = managers[rank]
        mgr.save(3, {"optimizer": named_optimizer_state(opt, names)})
        mgr.close()
    folder = tmp_path / "step_000000003"
    for rank in range(new_world):
        opt = shard_opt(new_world, rank)
        wanted = [names[id(p)] for g in opt.param_groups for p in g["params"]]
        load_named_optimizer_state(opt, names, gather_named_optimizer_state(folder, "optimizer", wanted))
        got = named_optimizer_state(opt, names)
        assert set(got["state"]) == set(wanted)
        for n in wanted:
            for k, v in full["state"][n].items():
                assert got["state"][n][k].dtype == v.dtype and torch.equal(got["state"][n][k], v), (n, k)
            assert not masters or got["state"][n]["master"].dtype == torch.float32
        assert [g["lr"] for g in got["param_groups"]] == [0.1, 0.001]


def _dp_run(rank, world, root):
    """DP=2 to step 6, a copy of the checkpoints for the DP=1 run, then DP=2 on to step 9 (one spawn)."""
    import torch.distributed as dist

    common = ["--interval", "3", "--dropout", "0", "--dtype", "float64"]
    example_main(["--root", root + "/dp2", "--steps", "6", "--resume", "none", *common])
    dist.barrier()
    if rank == 0:
        shutil.copytree(root + "/dp2", root + "/dp1")
    dist.barrier()
    return example_main(["--root", root + "/dp2", "--steps", "9", "--resume", "auto", *common])


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_resume_with_another_data_parallel_size(tmp_path):
    """Train DP=2 (ZeRO-1 optimizer shards) to step 6, then continue to 9 with DP=2 and with DP=1."""
    cont2 = run_distributed(_dp_run, 2, str(tmp_path), timeout=200)[0]
    cont1 = example_main(["--root", str(tmp_path / "dp1"), "--steps", "9", "--interval", "3", "--dropout", "0",
                          "--dtype", "float64"])
    assert sorted(cont1) == sorted(cont2) == [7, 8, 9]
    # DP=2 averages two half-batch gradients where DP=1 takes one full-batch mean: equal up to float64 rounding
    # (~1e-16; measured 5e-16 here), which AdamW can amplify by a few orders over three steps;
    # 1e-12 relative still fails on any mis-loaded state (a stale LR alone moved the loss by 4e-5)
    for step in cont1:
        assert cont1[step] == pytest.approx(cont2[step], rel=1e-12)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_max_restarts_resumes_from_latest_checkpoint(tmp_path):
    """Rank 1 dies after step 8 on the first attempt; torchrun restarts the job, which resumes by itself."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m",
           "training.checkpoint.example_loop", "--root", str(tmp_path), "--steps", "10", "--interval", "3",
           "--crash-after-step", "8"]
    # Workers get their own store per attempt: with torchrun's shared agent store, a restarted gloo group
    # can read the dead attempt's peer addresses and fail connectFullMesh ("Connection refused").
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=REPO, env=env)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "CRASH 8" in text and '"event": "restart"' in text and '"restart_count": 1' in text
    # resumed from the newest committed checkpoint: 6, or 3 when rank 0 was stopped before committing 6
    assert '"event": "restart", "step": 6' in text or '"event": "restart", "step": 3' in text
    losses = [line.split()[1:] for line in out.stdout.splitlines() if line.startswith("STEP")]
    by_step: dict[str, set[str]] = {}
    for step, loss in losses:
        by_step.setdefault(step, set()).add(loss)
    assert all(len(v) == 1 for v in by_step.values()), "replayed steps 7-8 must reproduce the same bits"
    assert "DONE 10" in out.stdout
