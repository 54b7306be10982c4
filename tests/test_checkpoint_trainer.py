"""Checkpointing and fault tolerance wired into the real Trainer (tiny DeepSeek-V3 on CPU, one process)."""

import math
from pathlib import Path

import pytest

from training.checkpoint.trainer_hooks import attach

CONFIG = Path(__file__).resolve().parents[1] / "recipes/configs/tiny_cpu.toml"


class _Stop(Exception):
    pass


def _cfg(steps: int, extra=()):
    from training.config import load_config

    return load_config(CONFIG, [
        "parallel.pp=1", "parallel.dp=1", "parallel.ep=1", "parallel.schedule=none", f"run.steps={steps}",
        "run.threads=1", "model.fp8=false", "model.overrides.n_layers=2", "data.seq_len=16", "data.global_batch=4",
        "data.micro_batch=2", "optim.warmup_steps=2", "logging.wandb=disabled", "logging.progress=false",
        "logging.plot=false", "logging.eval_batches=1", "run.sample_tokens=0", "checkpoint.interval=2",
        "checkpoint.final=false", *extra])


def _train(run_dir, cfg, resume=None, stop_at=None):
    """fit() with checkpoint hooks; ``stop_at``: a sync save at that step, then the process 'dies'."""
    from training.parallel import single_process
    from training.trainer import Trainer

    trainer = Trainer(cfg, single_process(cfg.parallel), run_dir)
    hooks = attach(trainer, cfg, run_dir, resume)
    if stop_at is not None:
        def stop(tr, metrics):
            if tr.step == stop_at:
                hooks.save(sync=True)
                raise _Stop
        trainer.step_end_hooks.append(stop)
    try:
        trainer.fit()
    except _Stop:
        pass
    hooks.close()
    return {h["step"]: h["loss"] for h in trainer.history}, trainer


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_resume_is_bit_exact(tmp_path):
    straight, _ = _train(tmp_path / "a", _cfg(6))
    first, _ = _train(tmp_path / "b", _cfg(6), stop_at=3)
    second, trainer = _train(tmp_path / "b", _cfg(6), resume="auto")
    assert sorted(first) == [1, 2] and sorted(second) == [4, 5, 6]  # step 3 died before fit() recorded it
    assert {**first, **second} == {k: v for k, v in straight.items() if k != 3}  # bit-identical losses
    records = (tmp_path / "b" / "metrics.jsonl").read_text()
    assert '"event": "resume"' in records and '"step": 3' in records


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_rolls_back_on_injected_nan(tmp_path, monkeypatch):
    from training.trainer import Trainer

    # sync saves: the rollback target is then the step-4 checkpoint however loaded the machine is (an async save
    # of step 4 still in flight at step 6 rightly makes step 2 the newest stable one)
    cfg = _cfg(8, ["fault.enabled=true", "fault.stable_after=1", "fault.window=4", "checkpoint.async_save=false"])
    real_step = Trainer.train_step
    poisoned = {"done": False}

    def train_step(self):
        if self.step == 5 and not poisoned["done"]:  # the 6th step's loss goes NaN once (a bad batch)
            poisoned["done"] = True
            hook = self.after_backward_hooks[0]
            self.after_backward_hooks[0] = lambda tr, m: hook(tr, {**m, "loss": math.nan})
            try:
                return real_step(self)
            finally:
                self.after_backward_hooks[0] = hook
        return real_step(self)

    monkeypatch.setattr(Trainer, "train_step", train_step)
    losses, trainer = _train(tmp_path, cfg)
    assert poisoned["done"] and trainer.step == 8
    assert all(math.isfinite(v) for v in losses.values())
    records = (tmp_path / "metrics.jsonl").read_text()
    assert '"event": "rollback"' in records and '"rollback_to": 4' in records
