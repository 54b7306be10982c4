"""``python -m recipes.long_context`` end to end through the real CLI (``recipes.train`` and ``recipes.export_hf``
subprocesses), shrunk: the short stage and the YaRN extension on 2 context-parallel ranks (the default ``--cp``)
both run, their outputs parse, and the extended model's loss beyond the short training length is below the short
model's there; bad input is one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recipes import long_context

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "recipes.long_context"]


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    return subprocess.run([*CLI, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, names", [
    (["--extend-factor", "1"], "--extend-factor"),
    (["--extend-factor", "0.5"], "--extend-factor"),
    (["--extend-factor", "nan"], "--extend-factor"),
    (["--extend-factor", "four"], "--extend-factor"),
    (["--extend-factor", "1.3"], "--extend-factor"),  # 128 x 1.3 is not a whole number of tokens
    (["--cp", "0"], "--cp"),
    (["--cp", "3"], "parallel.cp=3"),  # 3 ranks cannot share 512 tokens in 2 x 3 equal chunks
    (["--key-digits", "0"], "--key-digits"),
    (["--key-digits", "40"], "--short-len"),  # a 40-digit key does not fit twice in 128 tokens
    (["--short-len", "32"], "--short-len"),  # shorter than a needle plus a question
    (["--short-config", "/nonexistent/short.toml"], "--short-config"),
    (["--extend-config", "/nonexistent/extend.toml"], "--extend-config"),
    (["--set", "optim.nonsense=1"], "optim.nonsense"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, args, names):
    out = tmp_path / "lc"
    try:
        status = long_context.main(["--out", str(out), *args])
    except SystemExit as exc:  # argparse's own errors (types): one line too (accel.cli.ArgumentParser)
        status = exc.code
    err = capsys.readouterr().err.strip()
    assert status == 2, err
    assert len(err.splitlines()) == 1 and "error: " in err and names in err, err
    assert not out.exists()


def test_bad_out_folders(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep").write_text("x")
    for out in (afile, full):
        assert long_context.main(["--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: --out"), err
    assert sorted(p.name for p in full.iterdir()) == ["keep"] and afile.read_text() == "x"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(os.environ.get("DSV3_LONG_CONTEXT") != "1",
                    reason="opt-in (DSV3_LONG_CONTEXT=1): the recipe end to end, two stages and exports, ~1-3.5 min")
def test_shrunk_recipe_trains_both_stages_and_extension_lowers_long_range_loss(tmp_path):
    out = tmp_path / "lc"
    proc = run_cli("--out", str(out), "--short-steps", "150", "--extend-steps", "30",
                   "--eval-docs", "4", timeout=850)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    r = json.loads((out / "long_context.json").read_text())
    # both stages ran through the CLI, at their lengths and RoPE settings, and were exported
    assert r["cp"] == 2 and r["key_digits"] == 1
    assert "cp = 2" in (out / "extend" / "config.toml").read_text().splitlines()  # stage 2 ran on 2 CP ranks
    for stage, steps, seq_len in (("short", 150, 128), ("extend", 30, 512)):
        records = [json.loads(line) for line in (out / stage / "metrics.jsonl").read_text().splitlines()]
        assert max(m["step"] for m in records if "loss" in m) == steps, stage
        assert r["stages"][stage]["steps"] == steps and r["stages"][stage]["seq_len"] == seq_len
        assert (out / f"{stage}_hf" / "config.json").is_file()
    short_cfg = json.loads((out / "short_hf" / "config.json").read_text())
    extend_cfg = json.loads((out / "extend_hf" / "config.json").read_text())
    assert short_cfg.get("rope_scaling") is None
    assert extend_cfg["rope_scaling"]["factor"] == 4.0
    assert extend_cfg["rope_scaling"]["original_max_position_embeddings"] == 128
    assert (out / "long_context.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    names = ("short", "short+yarn", "extended")
    for key in ("passkey_long", "passkey_short", "key_loss_long", "key_loss_short"):
        for name in names:
            assert len(r[key][name]) == len(long_context.DEPTHS)
            assert all(0.0 <= a <= (1.0 if key.startswith("passkey") else 50.0) for a in r[key][name]), (key, name)
    assert all(len(r["position_loss"][n]) == len(r["bucket_edges"]) - 1 for n in names)
    beyond, within = r["loss_beyond_short"], r["loss_within_short"]
    # Measured for this shrunk run (150 + 30 steps, stage 2 at CP 2, 1-digit key, 2026-12-07), seed 1234 / seed 7:
    # loss from position 128 on, short model 3.175 / 2.824, extended 2.494 / 2.324 (gaps 0.68 / 0.50); below 128 the
    # extended model has 2.514 / 2.446 (beyond minus below -0.02 / -0.12), the short model 2.608 / 2.534 (+0.57 /
    # +0.29). Another seed (new data, new init) is a far larger perturbation than another x86 CPU's rounding of the
    # same seed, so 0.1 nats, a fifth of the smallest gap and a third of the short model's rise, leaves room.
    margin = 0.1
    assert beyond["extended"] < beyond["short"] - margin, r
    # and the extended model is no worse past the short length than before it: the new positions are usable
    assert beyond["extended"] < within["extended"] + margin, r
