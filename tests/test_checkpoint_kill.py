"""kill -9 the example training loop at many moments (eleven, several inside background writes), resume each
time, and finish: every resume finds a committed, verified checkpoint, partial saves are never loaded, and the
final loss curve is bit-identical to an uninterrupted run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from training.checkpoint import CheckpointManager
from training.checkpoint import format as fmt
from training.checkpoint.example_loop import main as example_main

STEPS, INTERVAL = 30, 3
ARGS = ["--steps", str(STEPS), "--interval", str(INTERVAL), "--keep-last", "2", "--write-delay", "0.1"]

# (line prefix that triggers the kill, which occurrence in that segment): moments across a save's life
KILL_POINTS = [
    ("EVENT file_written 0", 1),  # during the very first save: nothing committed yet, a fresh start follows
    ("STEP", 4),                  # between saves, mid-training
    ("EVENT mid_write", 2),       # inside a shard file, half written
    ("EVENT file_written", 2),    # one shard done, the next not started
    ("EVENT rank_done", 2),       # all shards + done marker, no metadata.json yet
    ("EVENT staged", 2),          # metadata.json written, folder not yet renamed into place
    ("EVENT renamed", 2),         # renamed, `latest` not yet replaced
    ("EVENT committed", 2),       # `latest` replaced, retention not yet run
    ("METRIC", 1),                # right after a resume, before the first step
    ("EVENT mid_write", 5),       # inside a shard again, with retention due to delete an old folder
    ("STEP", 1),                  # the first step after a resume
]


def _launch(root: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "training.checkpoint.example_loop", "--root", str(root), *ARGS]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=Path(__file__).resolve().parents[1])


def _record_step(line: str, seen: dict[int, str]) -> None:
    _, step, loss = line.split()
    # a step replayed after a resume must reproduce the very same bits
    assert seen.setdefault(int(step), loss) == loss, f"step {step} replayed with a different loss"


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_kill9_at_many_points_then_resume_exactly(tmp_path):
    reference = {str(k): v.hex() for k, v in example_main(["--root", str(tmp_path / "ref"), "--steps", str(STEPS),
                                                      "--interval", str(INTERVAL), "--resume", "none"]).items()}
    root = tmp_path / "ckpt"
    seen: dict[int, str] = {}
    staging_seen = uncommitted_seen = 0
    expected_resume = None
    for prefix, occurrence in KILL_POINTS:
        proc = _launch(root)
        count, log = 0, []
        for line in proc.stdout:
            log.append(line)
            if line.startswith("STEP"):
                _record_step(line, seen)
            if line.startswith("METRIC") and '"resume"' in line:
                assert f'"step": {expected_resume}' in line, f"resumed elsewhere than the newest valid: {line}"
            if line.startswith(prefix):
                count += 1
                if count == occurrence:
                    proc.kill()
                    break
        proc.wait(30)
        assert count == occurrence, f"kill point {prefix!r} #{occurrence} never reached:\n{''.join(log[-20:])}"
        staging_seen += any(p.name.startswith(fmt.STAGING_PREFIX) for p in root.iterdir())
        latest = fmt.read_pointer(root, fmt.LATEST_FILE)
        uncommitted_seen += any(s > (latest or -1) for s in fmt.committed_steps(root))
        found = CheckpointManager(root).find_latest_valid()  # what the next start will resume from
        if latest is None:
            assert found is None
        else:
            assert found == root / fmt.step_dirname(latest), "resume must pick the committed `latest`"
            assert CheckpointManager(root).verify(found) is None
        expected_resume = None if found is None else latest
    assert staging_seen >= 4 and uncommitted_seen >= 1  # the kills really landed inside saves
    final = subprocess.run([sys.executable, "-m", "training.checkpoint.example_loop", "--root", str(root), *ARGS],
                           capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert final.returncode == 0, final.stdout[-2000:] + final.stderr[-2000:]
    for line in final.stdout.splitlines():
        if line.startswith("STEP"):
            _record_step(line, seen)
    assert f"DONE {STEPS}" in final.stdout
    assert {str(k): v for k, v in sorted(seen.items())} == reference
