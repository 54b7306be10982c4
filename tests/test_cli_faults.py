"""Issue 40 through the real command lines: the last bad inputs, faults mid-run, and the verifier's worker.

Every refusal runs ``python -m MODULE ...`` in a subprocess, in a working folder of its own that holds its input
files and must hold nothing new afterwards; the one line on stderr (``error: ...`` naming the argument, key or
file and what was expected) and the exit status are asserted. The commands start together, a few at a time
(each pays a torch import; on two cores that is most of the wall time).

Faults are real operating-system failures at the write call, without root and without a test seam in the
code under test: a full disk is a file-size limit (``RLIMIT_FSIZE``: a write past it fails with ``EFBIG``, set on
the running trainer with ``prlimit`` once a checkpoint is committed, or on the export from its start); a
read-only checkpoints folder is ``chmod 0555`` (or ``chattr +i`` for root, whom permission bits do not stop).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from training.checkpoint import CheckpointManager
from training.checkpoint import format as fmt

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "recipes" / "configs" / "tiny_cpu.toml")
HACKS = ROOT / "tests" / "verify_hacks"
ERROR_LINE = re.compile(r"^(\S[^:]*: )?error: ")
SINGLE = ["parallel.pp=1", "parallel.dp=1", "parallel.ep=1", "parallel.schedule=none"]
PARALLEL = 6  # commands at once: enough to overlap their imports, few enough not to swap a 2-core machine


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1",
            "DSV3_KERNEL_IMPL": "reference"}


def _train(*sets: str) -> list[str]:
    return ["recipes.train", "--config", TINY, "--nproc", "1", "--run-dir", "{t}/run",
            *[x for s in [*SINGLE, *sets] for x in ("--set", s)]]


def _system_file(folder: Path, name: str, change) -> None:
    doc = json.loads((ROOT / "planner" / "systems" / "H800.json").read_text())
    change(doc)
    (folder / name).write_text(json.dumps(doc))


def _dump(folder: Path, change) -> None:
    from accel.flight import FlightRecorder

    recorder = FlightRecorder(0, world_size=1, stall="")
    recorder.begin("recv", "act stage 0 mb 0", peer=0)
    doc = recorder.snapshot("test")
    change(doc)
    (folder / "run" / "flight").mkdir(parents=True)
    (folder / "run" / "flight" / "rank_0.json").write_text(json.dumps(doc))


def _garbage_checkpoint(folder: Path) -> None:
    (folder / "ck" / "step_000000003").mkdir(parents=True)
    (folder / "ck" / "step_000000003" / "metadata.json").write_text("{ garbage")


def _other_config_checkpoint(folder: Path) -> None:
    """A committed checkpoint, written as the trainer writes one, of another model config."""
    CheckpointManager(folder / "ck", async_save=False).save(3, {"model": {"w": torch.randn(4)}},
                                                            {"config": {"model": {"preset": "other"}}})


def _bad_utf8_jsonl(folder: Path) -> None:
    (folder / "in.jsonl").write_bytes(b'{"text": "good line"}\n{"text": "bad \xff\xfe bytes"}\n{"text": "more"}\n')


# (name, argv, the error line must contain, setup of the working folder); "{t}" is the working folder
REFUSALS = [
    # tracebacks before
    ("log_every=0", _train("logging.log_every=0"), "error: logging.log_every must be >= 1", None),
    ("imbalance=inf", ["recipes.plan", "--gpus", "8", "--expert-imbalance", "inf"],
     "argument --expert-imbalance: expected a finite number > 0, got 'inf'", None),
    ("gpus_per_node=0", ["recipes.plan", "--gpus", "8", "--system", "{t}/s.json"],
     "error: system file '{t}/s.json': gpus_per_node must be an integer >= 1, got 0",
     lambda t: _system_file(t, "s.json", lambda d: d.update(gpus_per_node=0))),
    ("comm_sm_fraction=1", ["recipes.plan", "--gpus", "8", "--system", "{t}/s.json"],
     "error: system file '{t}/s.json': comm_sm_fraction must be in [0, 1), got 1.0",
     lambda t: _system_file(t, "s.json", lambda d: d.update(comm_sm_fraction=1.0))),
    ("dump entries {}", ["recipes.diagnose", "{t}/run"],
     "error: {t}/run/flight/rank_0.json: not a flight-recorder dump ('entries' is {}, expected list)",
     lambda t: _dump(t, lambda d: d.update(entries={}))),
    ("dump entries strings", ["recipes.diagnose", "{t}/run"],
     "not a flight-recorder dump (entries[0] is 'a', expected an object)",
     lambda t: _dump(t, lambda d: d.update(entries=["a", "b"]))),
    ("dump created string", ["recipes.diagnose", "{t}/run"],
     "not a flight-recorder dump ('created' is 'yesterday', expected int or float)",
     lambda t: _dump(t, lambda d: d.update(created="yesterday"))),
    ("dsa sparse missing", ["recipes.dsa", "--sparse-config", "{t}/missing.toml", "--out", "{t}/dsa"],
     "error: --sparse-config: no such file '{t}/missing.toml'", None),
    ("dsa sparse not toml", ["recipes.dsa", "--sparse-config", "{t}/bad.toml", "--out", "{t}/dsa"],
     "error: --sparse-config '{t}/bad.toml': not valid TOML",
     lambda t: (t / "bad.toml").write_text("[run\nsteps =")),
    ("simulate /proc", ["dualpipe.simulate", "--trace", "/proc/x.json"],
     "error: --trace '/proc/x.json': cannot create it (No such file or directory)", None),
    # silent acceptances before
    ("steps beyond int64", _train("run.steps=99999999999999999999"),
     "error: config key 'run.steps': expected a 64-bit integer, got 99999999999999999999", None),
    ("steps 10^9", _train("run.steps=1000000000"), "error: run.steps must be in [1, 999999999]", None),
    ("sample_tokens=-1", _train("run.sample_tokens=-1"), "error: run.sample_tokens must be >= 0", None),
    ("threads=-1", _train("run.threads=-1"), "error: run.threads must be >= 0", None),
    ("eval_batches=-1", _train("logging.eval_batches=-1"),
     "logging.eval_batches >= 0 (0 = no validation loss), got 0 and -1", None),
    ("gpus_per_node<0", ["recipes.plan", "--gpus", "8", "--system", "{t}/s.json"],
     "gpus_per_node must be an integer >= 1, got -8",
     lambda t: _system_file(t, "s.json", lambda d: d.update(gpus_per_node=-8))),
    ("comm_sm_fraction<0", ["recipes.plan", "--gpus", "8", "--system", "{t}/s.json"],
     "comm_sm_fraction must be in [0, 1), got -0.1",
     lambda t: _system_file(t, "s.json", lambda d: d.update(comm_sm_fraction=-0.1))),
    ("intra latency<0", ["recipes.plan", "--gpus", "8", "--system", "{t}/s.json"],
     "links.intra_node.latency_us must be a number >= 0, got -3",
     lambda t: _system_file(t, "s.json", lambda d: d["links"]["intra_node"].update(latency_us=-3))),
    ("fp8_tflops<0", ["recipes.plan", "--gpus", "8", "--system", "{t}/s.json"],
     "gpu.fp8_tflops must be a number >= 0, got -1",
     lambda t: _system_file(t, "s.json", lambda d: d["gpu"].update(fp8_tflops=-1))),
    ("shapes tokens=0", ["recipes.verify_kernels", "--candidate", str(HACKS / "axpy_good.py"), "--reference",
                         str(HACKS / "axpy_ref.py"), "--shapes", "ROWS=0"],
     "error: --shapes 'ROWS=0': expected a size, a finite number > 0", None),
    # the hang before
    ("gpus 2^40", ["recipes.plan", "--gpus", str(2**40)],
     f"error: --gpus {2**40}: the planner searches clusters of up to 1,048,576 GPUs", None),
    # refused, but wrote before
    ("resume garbage metadata", [*_train(), "--resume", "{t}/ck/step_000000003"],
     "error: --resume '{t}/ck/step_000000003': {t}/ck/step_000000003/metadata.json is not valid JSON",
     _garbage_checkpoint),
    ("resume another config", [*_train(), "--resume", "{t}/ck/step_000000003"],
     "error: --resume '{t}/ck/step_000000003': checkpoint {t}/ck/step_000000003 was written for another config",
     _other_config_checkpoint),
    ("keep_every=-3", _train("checkpoint.keep_every=-3"), "checkpoint.keep_every >= 0 (0 = none), got 25, 2 and -3",
     None),
    ("prepare --strict", ["recipes.prepare_data", "--input", "{t}/in.jsonl", "--tokenizer", "byte", "--out",
                          "{t}/out", "--workers", "1", "--no-progress", "--strict"],
     "error: {t}/in.jsonl:2: not UTF-8 (byte 0xff at column 15) (--strict: a bad line is fatal", _bad_utf8_jsonl),
]


def _tree(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*"))}


def _run_case(folder: Path, argv: list[str]) -> subprocess.CompletedProcess:
    fill = [a.replace("{t}", str(folder)) for a in argv]
    return subprocess.run([sys.executable, "-m", *fill], cwd=folder, env=_env(), text=True, capture_output=True,
                          timeout=240)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_reported_bad_input_is_one_line_status_2_and_writes_nothing(tmp_path):
    folders = []
    for i, (*_, setup) in enumerate(REFUSALS):
        folder = tmp_path / f"case{i:02d}"
        folder.mkdir()
        if setup is not None:
            setup(folder)
        folders.append((folder, _tree(folder)))
    with concurrent.futures.ThreadPoolExecutor(PARALLEL) as pool:
        procs = list(pool.map(lambda c: _run_case(c[0][0], c[1][1]), zip(folders, REFUSALS)))
    for (folder, before), (name, _, expected, _), proc in zip(folders, REFUSALS, procs):
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2, (name, proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
        assert "Traceback" not in proc.stdout + proc.stderr, (name, proc.stderr)
        assert len(lines) == 1 and ERROR_LINE.match(lines[0]), (name, proc.stderr)
        assert expected.replace("{t}", str(folder)) in lines[0], (name, expected, lines[0])
        assert _tree(folder) == before, f"{name}: a refused command wrote {set(_tree(folder)) - set(before)}"


@pytest.mark.slow
def test_invalid_utf8_jsonl_lines_are_counted_skipped_and_reported(tmp_path):
    """Without --strict a line that is not UTF-8 is a bad line like any other: skipped, counted in the manifest,
    named in the summary's warning; the dataset holds the good lines only."""
    _bad_utf8_jsonl(tmp_path)
    proc = _run_case(tmp_path, ["recipes.prepare_data", "--input", "{t}/in.jsonl", "--tokenizer", "byte", "--out",
                                "{t}/out", "--workers", "1", "--no-progress"])
    assert proc.returncode == 0, proc.stderr
    assert (f"warning: 1 bad JSONL lines skipped (listed in manifest.json), e.g. {tmp_path}/in.jsonl:2: not UTF-8 "
            "(byte 0xff at column 15)") in proc.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["bad_lines"]["count"] == 1 and manifest["total_documents"] == 2
    # the byte tokenizer: a token per byte plus the end-of-document token, for "good line" and "more"
    assert manifest["total_tokens"] == len("good line") + 1 + len("more") + 1


def test_a_model_width_no_head_divides_is_legal_and_documented():
    """``model.overrides.dim=100``: MLA sizes its heads by ``n_heads x qk_head_dim``, not by ``dim``; RoPE turns
    ``qk_rope_head_dim`` (which must be even, and is refused otherwise); the FP8 GEMMs zero-pad K and N to 128.
    So the width is legal, as docs/training.md says, and the rule that does exist is enforced."""
    from training.config import load_config
    from training.trainer import check_layout

    args = check_layout(load_config(TINY, [*SINGLE, "model.overrides.dim=100"]), 1)
    assert args.dim == 100
    with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
        check_layout(load_config(TINY, [*SINGLE, "model.overrides.qk_rope_head_dim=7"]), 1)
    assert "`model.overrides.dim`" in (ROOT / "docs" / "training.md").read_text()


# ---- faults mid-run: the data kept, one line, the documented status ---------------------------------------------
FAULT_RUN = [*SINGLE, "run.sample_tokens=0", "data.seq_len=32", "data.global_batch=4", "data.micro_batch=2",
             "logging.progress=false", "logging.eval_batches=1", "logging.wandb=disabled", "logging.plot=false",
             "run.threads=1", "run.steps=40", "checkpoint.interval=2", "checkpoint.keep_last=3",
             "checkpoint.final=false", "optim.warmup_steps=2"]
FSIZE_LIMIT = 256 << 10  # below a shard of the run's checkpoint (MiBs), above its metrics and metadata files


def _start_training(run: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "recipes.train", "--config", TINY, "--nproc", "1", "--run-dir", str(run)]
    cmd += [x for s in FAULT_RUN for x in ("--set", s)]
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _after_first_commit(run: Path, proc: subprocess.Popen) -> int:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        step = fmt.read_pointer(run / "checkpoints", fmt.LATEST_FILE)
        if step is not None:
            return step
        time.sleep(0.02)
    out, err = proc.communicate()
    raise AssertionError(f"no checkpoint was committed: {out[-2000:]} {err[-2000:]}")


def _assert_stopped_with_the_last_commit_intact(run: Path, proc: subprocess.Popen, reason: str) -> None:
    out, err = proc.communicate(timeout=300)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 3, out[-2000:] + err[-3000:]  # accel.cli.SAVE_FAILED
    assert "Traceback" not in out + err and len(lines) == 1, err[-3000:]
    latest = fmt.read_pointer(run / "checkpoints", fmt.LATEST_FILE)
    root = run / "checkpoints"
    m = re.fullmatch(rf"error: rank 0: (background )?checkpoint of step (\d+) failed: .*{reason}.*; the last "
                     rf"committed checkpoint, {fmt.step_dirname(latest)} in {re.escape(str(root))}, is intact: free "
                     r"space or make the folder writable, then --resume auto", lines[0])
    assert m and int(m.group(2)) > latest, lines[0]
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")], "a staging folder was left"
    assert CheckpointManager(root, sweep=False).find_latest_valid() == root / fmt.step_dirname(latest)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_disk_full_at_an_interval_save_stops_with_one_line_and_status_3(tmp_path):
    """Once step 2 is committed the trainer may write no file past 256 KiB: the next interval save fails in its
    background write (EFBIG, as ENOSPC would), the run stops with one line, exit 3, and ``latest`` is the last
    committed step, whole, with no staging folder left."""
    run = tmp_path / "run"
    proc = _start_training(run)
    try:
        _after_first_commit(run, proc)
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (FSIZE_LIMIT, FSIZE_LIMIT))
        _assert_stopped_with_the_last_commit_intact(run, proc, "File too large")
    finally:
        proc.kill()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_read_only_checkpoints_folder_after_a_commit_stops_with_one_line_and_status_3(tmp_path):
    run = tmp_path / "run"
    proc = _start_training(run)
    root = run / "checkpoints"
    locked = False
    try:
        _after_first_commit(run, proc)
        if os.geteuid() == 0:  # root writes through permission bits; the immutable flag stops root too
            if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(root)]).returncode:
                proc.kill()
                pytest.skip("root without chattr +i: no way to make a folder read-only for this process")
        else:
            root.chmod(0o555)
        locked = True
        _assert_stopped_with_the_last_commit_intact(run, proc, "(Permission denied|Operation not permitted)")
    finally:
        proc.kill()
        if locked:
            if os.geteuid() == 0:
                subprocess.run(["chattr", "-i", str(root)])
            root.chmod(0o755)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_export_overwrite_into_a_full_disk_keeps_the_earlier_export(tmp_path):
    """``export_hf --overwrite`` whose shard write fails (EFBIG past the file-size limit: safetensors reports it as
    its own SafetensorError): one line naming the export and saying the earlier one is intact, exit 1, the earlier
    export byte for byte as it was, and nothing left beside it."""
    from models.deepseek_v3 import Transformer
    from recipes.export_hf import export
    from tests.test_checkpoint_export_hf import _config, _save_like_the_trainer
    from training.trainer import model_args

    cfg = _config(ep=1)
    _save_like_the_trainer(tmp_path / "ck", cfg, Transformer(model_args(cfg)))
    out = tmp_path / "exports" / "hf"
    export(tmp_path / "ck", out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, FSIZE_LIMIT))

    proc = subprocess.run([sys.executable, "-m", "recipes.export_hf", str(tmp_path / "ck"), "--out", str(out),
                           "--overwrite"], cwd=tmp_path, env=_env(), text=True, capture_output=True, timeout=240,
                          preexec_fn=limit)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1, proc.stdout + proc.stderr  # accel.cli.FAILED, as its --help says
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: the export to {out} failed (SafetensorError: ")
    assert "File too large" in lines[0] and lines[0].endswith(f"; the earlier export in {out} is intact")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in out.parent.iterdir()] == ["hf"]


# ---- the verifier: the candidate's output apart from the verdict; its worker dies with it ------------------------
def _problem(folder: Path, candidate: str) -> tuple[Path, Path]:
    folder.mkdir(parents=True)
    shutil.copy(HACKS / "axpy_ref.py", folder / "reference.py")
    shutil.copy(HACKS / "axpy_kernels.py", folder / "axpy_kernels.py")
    (folder / "candidate.py").write_text(candidate)
    return folder / "candidate.py", folder / "reference.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_candidates_print_never_lands_above_the_verdict(tmp_path):
    """A candidate that prints a passing verdict and exits 0 fails (exit 1); what it printed is on stderr, after
    the verdict, under a heading and quoted, never on the verifier's stdout before its verdict."""
    cand, ref = _problem(tmp_path / "p", 'import sys\nprint(\'{"verdict": "pass"}\')\nsys.exit(0)\n')
    proc = subprocess.run([sys.executable, "-m", "recipes.verify_kernels", "--candidate", str(cand), "--reference",
                           str(ref), "--seeds", "1", "--no-bench"], cwd=tmp_path, env=_env(), text=True,
                          capture_output=True, timeout=240)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"== {cand} vs {ref}") and proc.stdout.rstrip().endswith("verdict: FAIL")
    assert not any(line.startswith('{"verdict"') for line in proc.stdout.splitlines()), proc.stdout
    assert proc.stderr.splitlines() == ["candidate process output (its last 1 lines, not the verifier's):",
                                        '  | {"verdict": "pass"}']


def _workers(marker: str) -> list[int]:
    """Live (not zombie) processes whose command line holds ``--worker`` and ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if b"--worker" in argv and any(marker.encode() in a for a in argv) and state != "Z":
            found.append(int(pid))
    return found


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="finds the workers through /proc")
@pytest.mark.timeout(300)
def test_sigkill_of_the_verifier_kills_its_worker_in_candidate_and_suite_mode(tmp_path):
    """A candidate that loops forever; the verifier killed with SIGKILL (as ``subprocess.run(timeout=)`` and CI
    limits do), in --candidate and in --suite mode: each worker is gone within a few seconds."""
    loop = ("import os\nopen(os.path.join(os.path.dirname(__file__), 'started'), 'w').close()\n\n"
            "def candidate(x, y):\n    while True:\n        pass\n")
    cand, ref = _problem(tmp_path / "one" / "axpy", loop)
    _problem(tmp_path / "suite" / "axpy", loop)
    verifiers = [subprocess.Popen([sys.executable, "-m", "recipes.verify_kernels", *args, "--seeds", "1",
                                   "--no-bench"], cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
                 for args in (["--candidate", str(cand), "--reference", str(ref)],
                              ["--suite", str(tmp_path / "suite")])]
    try:
        deadline = time.monotonic() + 240
        started = [tmp_path / "one" / "axpy" / "started", tmp_path / "suite" / "axpy" / "started"]
        while not all(p.exists() for p in started) and time.monotonic() < deadline:
            assert all(v.poll() is None for v in verifiers)
            time.sleep(0.05)
        workers = _workers(str(tmp_path))
        assert len(workers) == 2, workers  # one per verifier, both in the candidate's loop
        for v in verifiers:
            v.send_signal(signal.SIGKILL)
            v.wait()
        deadline = time.monotonic() + 5
        while _workers(str(tmp_path)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _workers(str(tmp_path)) == [], "a worker outlived its killed verifier"
    finally:
        for v in verifiers:
            v.kill()
        for pid in _workers(str(tmp_path)):
            os.kill(pid, signal.SIGKILL)
