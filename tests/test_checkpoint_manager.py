"""CheckpointManager: round trips, async == sync bytes, retention, verification fallback, bad input."""

import errno
import filecmp
import json
import stat
import threading
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

from training.checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointManager,
    CheckpointMismatchError,
    CheckpointWriteError,
    check_shapes,
)
from training.checkpoint import format as fmt


def _trained_state(hidden: int = 6, dtype=torch.float32, steps: int = 2):
    model = torch.nn.Sequential(torch.nn.Linear(5, hidden), torch.nn.Linear(hidden, 3)).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(torch.randn(4, 5, dtype=dtype)).pow(2).mean().backward()
        opt.step()
    bias = torch.randn(8)  # stands in for MoE expert biases (a buffer, not a parameter)
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "expert_bias": {"layers.3": bias},
            "scheduler": {"last_epoch": steps, "base_lrs": [1e-2]}, "data": {"epoch": 0, "offset": 17}}


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype,hidden", [(torch.float32, 6), (torch.bfloat16, 11), (torch.float64, 3)])
def test_save_load_roundtrip(tmp_path, dtype, hidden):
    state = _trained_state(hidden, dtype)
    mgr = CheckpointManager(tmp_path)
    mgr.save(7, state, {"config": {"dim": hidden}, "tokens_seen": 7 * 4096, "layout": {"dp": 1, "pp": 1}})
    mgr.wait()
    loaded = mgr.load("auto", expect_config={"dim": hidden})
    assert loaded.step == 7 and _equal(loaded.state, state)
    meta = loaded.metadata
    assert meta["tokens_seen"] == 7 * 4096 and meta["layout"] == {"dp": 1, "pp": 1}
    assert meta["config_hash"] == fmt.config_hash({"dim": hidden}) and meta["software"]["torch"] == torch.__version__
    folder = tmp_path / "step_000000007"
    for name, entry in meta["files"].items():  # sizes and checksums describe the files on disk
        assert (folder / name).stat().st_size == entry["bytes"]
        assert fmt.sha256_file(folder / name) == entry["sha256"]
    assert sorted(p.name for p in folder.iterdir()) == sorted([*meta["files"], "metadata.json"])
    assert set(meta["files"]) == {"model-rank00000.safetensors", "optimizer-rank00000.safetensors",
                                  "expert_bias-rank00000.safetensors"}
    mode = stat.S_IMODE((folder / "metadata.json").stat().st_mode)  # readable by whoever may read the JSON
    assert {stat.S_IMODE((folder / name).stat().st_mode) for name in meta["files"]} == {mode}
    mgr.close()


@pytest.mark.timeout(60)
def test_async_and_sync_saves_are_byte_identical(tmp_path):
    state = _trained_state(9)
    for mode in ("async", "sync"):
        mgr = CheckpointManager(tmp_path / mode, async_save=mode == "async")
        torch.manual_seed(5)  # same RNG state captured in both
        mgr.save(3, state, {"config": {"x": 1}})
        mgr.close()
    a, b = tmp_path / "async" / "step_000000003", tmp_path / "sync" / "step_000000003"
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert match == names and not mismatch and not errors


class _SlowWriter:
    """safetensors' own writer, gated by an event so a test controls when the background write ends."""

    def __init__(self):
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self, tensors, path):
        self.started.set()
        assert self.release.wait(30), "test never released the writer"
        safetensors.torch.save_file(tensors, str(path))


@pytest.mark.timeout(60)
def test_async_snapshot_isolates_training_and_one_save_in_flight(tmp_path):
    slow = _SlowWriter()
    w = torch.randn(64, 32)
    mgr = CheckpointManager(tmp_path, save_tensors=slow)
    stall = mgr.save(1, {"model": {"w": w}})
    assert slow.started.wait(10) and mgr._writer.in_flight()
    assert stall < 5.0
    saved = w.clone()
    w.add_(1.0)  # training goes on while the write is in flight
    second_done = threading.Event()
    t = threading.Thread(target=lambda: (mgr.save(2, {"model": {"w": w}}), second_done.set()))
    t.start()
    time.sleep(0.3)
    assert not second_done.is_set(), "a second save must wait for the one in flight"
    assert mgr.latest_step() is None and not (tmp_path / "step_000000001").exists()  # nothing committed mid-write
    slow.release.set()
    t.join(20)
    mgr.wait()
    assert torch.equal(mgr.load(tmp_path / "step_000000001").state["model"]["w"], saved)
    assert torch.equal(mgr.load("auto").state["model"]["w"], w)
    mgr.close()


@pytest.mark.timeout(60)
def test_retention_keeps_last_every_nth_and_protected(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2, keep_every=4, async_save=False)
    state = {"model": {"w": torch.randn(3)}}
    for step in range(1, 10):
        mgr.save(step, state)
        if step == 3:
            mgr.mark_stable(3)
        if step == 5:
            mgr.pin(5)
    assert mgr.committed_steps() == [3, 4, 5, 8, 9]  # stable 3, every-4th 4 and 8, pinned 5, last two 8 and 9
    mgr.unpin(5)
    mgr.save(10, state)
    assert mgr.committed_steps() == [3, 4, 8, 9, 10] and mgr.latest_step() == 10
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging or trash left behind
    mgr.close()


def _three_checkpoints(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=5, async_save=False)
    states = {}
    for step in (10, 20, 30):
        states[step] = {"model": {"w": torch.randn(50, 7)}, "optimizer": {"m": torch.randn(20)}}
        mgr.save(step, states[step])
    return mgr, states


def _truncate(path: Path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_byte(path: Path):
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # inside the tensor data: the size stays right, only the checksum can tell
    path.write_bytes(bytes(data))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("damage,file", [(_truncate, "model-rank00000.safetensors"),
                                         (_flip_byte, "optimizer-rank00000.safetensors"),
                                         (Path.unlink, "model-rank00000.safetensors"),
                                         (_truncate, "metadata.json")])
def test_corrupt_latest_falls_back_with_warning_naming_the_file(tmp_path, damage, file):
    mgr, states = _three_checkpoints(tmp_path)
    bad = tmp_path / "step_000000030" / file
    damage(bad)
    events = []
    mgr.metrics = events.append
    with pytest.warns(RuntimeWarning, match=str(bad).replace(".", r"\.")):
        loaded = mgr.load("auto")
    assert loaded.step == 20 and _equal(loaded.state, states[20])
    assert events and events[0]["event"] == "checkpoint_fallback" and events[0]["bad_file"] == str(bad)
    with pytest.raises(CheckpointCorruptError, match="step_000000030") as info:  # an explicit path is not replaced
        mgr.load(tmp_path / "step_000000030")
    assert info.value.bad_file == bad
    mgr.close()


@pytest.mark.timeout(60)
def test_partial_and_uncommitted_checkpoints_are_never_loaded(tmp_path):
    mgr, states = _three_checkpoints(tmp_path)
    # a save killed mid-write: a staging folder with a half file and no metadata
    staging = tmp_path / ".staging-step_000000040"
    staging.mkdir()
    (staging / "model-rank00000.safetensors").write_bytes(b"\x00" * 100)
    # a folder renamed into place but never pointed at by `latest` (killed before the pointer update)
    newer = tmp_path / "step_000000050"
    (tmp_path / "step_000000030").rename(newer)
    (tmp_path / "step_000000020").rename(tmp_path / "step_000000030")  # latest (30) now holds step 20's files
    meta = json.loads((tmp_path / "step_000000030" / "metadata.json").read_text())
    assert meta["step"] == 20
    assert mgr.find_latest_valid() == tmp_path / "step_000000030"
    fresh = CheckpointManager(tmp_path, sweep=True)  # a restart (owning the folder) sweeps the leftover staging
    assert not staging.exists()
    (tmp_path / "latest").unlink()  # no pointer at all: every committed folder is a candidate
    assert fresh.find_latest_valid() == newer
    fresh.close()
    mgr.close()


@pytest.mark.timeout(60)
def test_full_disk_in_background_surfaces_at_next_step_and_keeps_previous(tmp_path):
    fail = {"on": False}

    def writer(tensors, path):
        if fail["on"]:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        safetensors.torch.save_file(tensors, str(path))

    mgr = CheckpointManager(tmp_path, save_tensors=writer)
    good = {"model": {"w": torch.randn(10)}}
    mgr.save(1, good)
    mgr.wait()
    fail["on"] = True
    mgr.save(2, {"model": {"w": torch.randn(10)}})  # returns at once: the failure happens in the background
    deadline = time.monotonic() + 20
    with pytest.raises(CheckpointWriteError, match=r"step 2 failed: OSError.*No space left"):
        while time.monotonic() < deadline:  # the training loop polls once per step
            mgr.poll()
            time.sleep(0.01)
    mgr.poll()  # reported once; the loop can go on
    assert mgr.latest_step() == 1 and mgr.committed_steps() == [1]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert _equal(mgr.load("auto").state, good)
    fail["on"] = False
    mgr.save(3, good)  # a later save works again
    mgr.wait()
    assert mgr.committed_steps() == [1, 3]
    mgr.close()


@pytest.mark.timeout(60)
def test_other_config_and_shapes_are_refused(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(5, {"model": {"w": torch.randn(4, 3)}}, {"config": {"model": {"dim": 4, "layers": 2}, "lr": 1e-3}})
    mgr.wait()
    with pytest.raises(CheckpointMismatchError, match=r"another config.*model\.dim"):
        mgr.load("auto", expect_config={"model": {"dim": 8, "layers": 2}, "lr": 1e-3})
    loaded = mgr.load("auto")
    with pytest.raises(CheckpointMismatchError, match=r"w: checkpoint \(4, 3\).*expected \(8, 3\)"):
        check_shapes({"w": torch.empty(8, 3)}, loaded.state["model"])
    with pytest.raises(CheckpointMismatchError, match="b: missing"):
        check_shapes({"w": torch.empty(4, 3), "b": torch.empty(3)}, loaded.state["model"])
    mgr.close()


@pytest.mark.timeout(60)
def test_bad_input_gives_clear_errors(tmp_path):
    mgr = CheckpointManager(tmp_path / "ok")
    with pytest.raises(CheckpointError, match="does not exist"):
        mgr.load(tmp_path / "nowhere")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointError, match="cannot be created"):
        CheckpointManager(tmp_path / "afile" / "sub")
    assert mgr.load("auto") is None  # an empty root: nothing to resume, not an error
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="verify"):
        CheckpointManager(tmp_path, verify="md5")
    with pytest.raises(ValueError, match="non-empty dict"):
        mgr.save(1, {})
    with pytest.raises(ValueError, match="section"):
        mgr.save(1, {"a/b": {"w": torch.zeros(1)}})
    with pytest.raises(ValueError, match="section 'model'.* 'f'.*function"):
        mgr.save(1, {"model": {"f": print}}, sync=True)
    with pytest.raises(CheckpointError, match="not committed"):
        mgr.mark_stable(99)
    mgr.close()


@pytest.mark.timeout(60)
def test_resaving_a_step_after_rollback_replaces_it(tmp_path):
    mgr, states = _three_checkpoints(tmp_path)
    mgr.rollback_to(10)
    assert mgr.latest_step() == 10 and mgr.committed_steps() == [10]
    new = {"model": {"w": torch.randn(50, 7)}}
    mgr.save(20, new, sync=True)
    assert mgr.latest_step() == 20 and _equal(mgr.load("auto").state, new)
    mgr.close()
