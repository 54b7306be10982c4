"""``--dry-run`` and a launch run the same checks (``training.trainer.check_static``): every input a
launch refuses, the dry run refuses with the same message, before any process starts."""

from __future__ import annotations

import pytest

from recipes.train import main as train_main

DEMO = "recipes/configs/tiny_cpu.toml"

# Inputs a launch refuses after loading the config (model, pipeline split, combination, ramp, data),
# each with the message both paths must print. Before the checks were one function, --dry-run
# accepted all but the first of these.
REFUSED = [
    (["--set", "model.overrides.n_layers=1"], "too few for 4"),
    (["--set", "parallel.schedule=1f1b", "--set", "data.global_batch=8"],
     "n_mtp_layers=1 with parallel.schedule='1f1b'"),
    (["--set", "data.seq_len=100000"], "exceeds the model's max_seq_len"),
    (["--set", "balance.strategy=aux_fre"], "aux_fre"),
    (["--set", "model.overrides.recompute=['norm','mla']"], "recompute"),
    (["--set", "data.source=/nonexistent/corpus.txt"], None),  # the dry run reports it absent (below)
    (["--set", "data.batch_ramp_start=8", "--set", "data.batch_ramp_steps=4", "--set", "run.steps=10"],
     "data.batch_ramp_start"),
    (["--nproc", "3"], "world size 3 != parallel.pp x parallel.dp"),
]


def _no_launch(*a, **k):
    raise AssertionError("a process group was started despite bad input")


@pytest.mark.parametrize("argv, message", REFUSED)
def test_dry_run_refuses_what_a_launch_refuses(argv, message, capsys, monkeypatch):
    monkeypatch.setattr("recipes.train.relaunch", _no_launch)
    assert train_main(["--config", DEMO, *argv]) == 2
    launch_err = capsys.readouterr().err
    dry = train_main(["--config", DEMO, "--dry-run", *argv])
    out = capsys.readouterr()
    if message is None:  # absent data: fatal at launch, reported by the dry run planning elsewhere
        assert "data.source" in launch_err
        assert dry == 0 and "data.source='/nonexistent/corpus.txt'" in out.out and "not on this machine" in out.out
        return
    assert message in launch_err
    assert dry == 2 and out.err == launch_err  # the same check, the same words


def test_dry_run_checks_a_present_corpus_as_a_launch_does(tmp_path, capsys):
    small = tmp_path / "small.txt"
    small.write_text("too short " * 100)
    assert train_main(["--config", DEMO, "--dry-run", "--set", f"data.source={small}"]) == 2
    assert "fewer than one global batch" in capsys.readouterr().err


def test_every_bundled_config_passes_the_dry_run(capsys):
    """The CPU configs pass the dry run (data present: the corpus is checked too)."""
    for cfg in ("tiny_cpu", "eplb_cpu"):
        assert train_main(["--config", f"recipes/configs/{cfg}.toml", "--dry-run"]) == 0, capsys.readouterr().err
        assert "training windows" in capsys.readouterr().out
