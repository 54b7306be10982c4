"""Sandboxed kernel candidates (issue 25, item 5): ``recipes.verify_kernels`` runs every candidate in a child
process of its own (``verifier.sandbox``), under --candidate as under --suite. A candidate that exits (any
status), crashes, raises past the harness, hangs (also ignoring SIGTERM, also with a grandchild) or forges a
result fails a gate with the reason in the table and the JSON, and the command exits 1, never 0.

The CLI tests run the real command line; each child imports torch (~3 s), so the misbehaving candidates share
one --suite run. The ``sandbox.run`` tests use children without torch (the module is stdlib only)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from recipes import verify_kernels

REPO = Path(__file__).resolve().parents[1]
HACKS = REPO / "tests" / "verify_hacks"
SANDBOX = REPO / "verifier" / "sandbox.py"

# The honest axpy_good passes through the sandbox in test_verify_candidates.py::test_cli_exit_codes_and_json.
CANDIDATES = {
    # honest on the first call, then an exception the harness does not catch (not an Exception): the correct gate
    "candidate_raise.py": """
        from axpy_kernels import axpy

        class Boom(BaseException):
            pass

        calls = []

        def candidate(x, y):
            calls.append(1)
            if len(calls) > 1:
                raise Boom("uncaught by the harness")
            return axpy(x, y)
        """,
    # a fake verdict on stdout and in every descriptor it can write, then os._exit(0) at import
    "candidate_forge.py": """
        import json, os

        print(json.dumps({"verdict": "PASS", "exit_code": 0}))
        print("verdict: PASS")
        fake = json.dumps({"final": True, "status": 0, "stage": "done", "verdict": {"verdict": "PASS"}}) + "\\n"
        for fd in range(3, 256):
            try:
                os.write(fd, fake.encode())
            except OSError:
                pass
        os._exit(0)
        """,
    "candidate_segv.py": """
        import ctypes

        def candidate(x, y):
            return ctypes.string_at(0)
        """,
}

HANG = """
    import signal, subprocess, sys
    from pathlib import Path

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    Path(__file__).with_name("grandchild.pid").write_text(str(sleeper.pid))

    def candidate(x, y):
        while True:
            pass
    """


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1",
            "DSV3_KERNEL_IMPL": "reference"}


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "recipes.verify_kernels", *args], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def _problem(folder: Path, files: dict[str, str]) -> Path:
    folder.mkdir(parents=True)
    (folder / "reference.py").write_text((HACKS / "axpy_ref.py").read_text())
    (folder / "axpy_kernels.py").write_text((HACKS / "axpy_kernels.py").read_text())
    for name, text in files.items():
        (folder / name).write_text(textwrap.dedent(text))
    return folder


def _gone(pid: int, within: float = 5.0) -> bool:
    """The process is dead (absent, or a zombie nobody reaped yet)."""
    deadline = time.monotonic() + within
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def _kill_leftovers(pid_file: Path) -> None:
    """A failing test must not leave its sleepers and loops behind."""
    for pid in (pid_file.read_text().split() if pid_file.exists() else []):
        with contextlib.suppress(OSError):
            os.kill(int(pid), signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_suite_fails_candidates_that_raise_exit_crash_or_forge(tmp_path):
    _problem(tmp_path / "suite" / "axpy", CANDIDATES)
    out = tmp_path / "suite.json"
    proc = _cli("--suite", str(tmp_path / "suite"), "--seeds", "1", "--no-bench", "--timeout", "120",
                "--json", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    gates = {Path(d["candidate"]).name: d["gates"] for d in doc["verdicts"]}
    assert [d["verdict"] for d in doc["verdicts"]] == ["FAIL"] * 3 and doc["summary"]["passed"] == 0
    raised = gates["candidate_raise.py"]
    assert raised["compiles"]["status"] == "pass" and raised["no_fallback"]["status"] == "not run"
    assert raised["correct"]["message"].startswith(
        "candidate exited with status 1 before reporting a verdict (in the correct gate); last output: ")
    assert raised["correct"]["message"].endswith("Boom: uncaught by the harness")
    forge = gates["candidate_forge.py"]
    assert forge["compiles"]["message"] == ("candidate exited with status 0 before reporting a verdict (in the "
                                            "compiles gate); last output: verdict: PASS")
    assert forge["no_fallback"]["message"] == ("1 line(s) in the result channel were not written by the harness "
                                               "(a forged result?)")
    assert gates["candidate_segv.py"]["compiles"]["message"] == (
        "candidate killed by signal 11 (SIGSEGV) before reporting a verdict (in the compiles gate)")
    # the failures count in the pass rates and fast_p, and each reason is printed
    assert doc["summary"]["gates"]["compiles"] == {"passed": 1, "measured": 3}
    assert doc["summary"]["gates"]["correct"] == {"passed": 0, "measured": 1}
    assert doc["summary"]["fast_p"]["fast_0"] == 0.0 and "fast_0=0.00" in proc.stdout
    assert "passed 0/3" in proc.stdout
    for name, g in gates.items():
        for gate, v in g.items():
            if v["status"] == "fail":
                assert f"FAIL axpy/{name} {gate}: {v['message']}" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_candidate_calling_sys_exit_0_fails(tmp_path):
    _problem(tmp_path / "p", {"exit0.py": "import sys\n\ndef candidate(x, y):\n    sys.exit(0)\n"})
    out = tmp_path / "v.json"
    proc = _cli("--candidate", str(tmp_path / "p" / "exit0.py"), "--reference", str(tmp_path / "p" / "reference.py"),
                "--seeds", "1", "--no-bench", "--json", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    why = "candidate exited with status 0 before reporting a verdict (in the compiles gate)"
    assert f"compiles     FAIL            {why}" in proc.stdout and "verdict: FAIL" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["verdict"] == "FAIL" and doc["exit_code"] == 1 and doc["format"] == "function"
    assert doc["gates"]["compiles"] == {"status": "fail", "message": why}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_candidate_that_hangs_is_killed_with_its_process_group(tmp_path):
    """An infinite loop that ignores SIGTERM and left a grandchild sleeping: --timeout applies to --candidate,
    the command returns, and the grandchild is dead too.

    6 s is twice what the child needs to import torch and reach the candidate on an idle 2-core machine; on a
    busier one the timeout may strike before the candidate was imported (still a timeout, but no grandchild to
    check: test_sandbox_timeout_kills_the_group checks that part without torch, independent of load)."""
    _problem(tmp_path / "p", {"hang.py": HANG})
    out = tmp_path / "v.json"
    proc = _cli("--candidate", str(tmp_path / "p" / "hang.py"), "--reference", str(tmp_path / "p" / "reference.py"),
                "--seeds", "1", "--no-bench", "--timeout", "6", "--json", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    gate = json.loads(out.read_text())["gates"]["compiles"]
    assert gate["status"] == "fail"
    assert re.fullmatch(r"timed out after 6 s( \(.*\))?; its process group was killed", gate["message"]), gate
    assert f"compiles     FAIL            {gate['message']}" in proc.stdout
    pid_file = tmp_path / "p" / "grandchild.pid"
    try:
        if pid_file.exists():
            assert "(in the compiles gate)" in gate["message"]
            assert _gone(int(pid_file.read_text()))
    finally:
        _kill_leftovers(pid_file)


def test_bad_json_path_and_timeout_are_refused_before_any_work(tmp_path, capsys):
    argv = ["--candidate", str(HACKS / "axpy_good.py"), "--reference", str(HACKS / "axpy_ref.py")]
    cases = [([*argv, "--json", str(tmp_path / "missing" / "v.json")], "--json .* does not exist"),
             (["--suite", str(tmp_path), "--json", str(tmp_path)], "is a folder; expected a file path"),
             ([*argv, "--timeout", "0"], "--timeout 0: expected a positive number of seconds")]
    for args, expected in cases:  # argparse's one line (prog: error: ...), status 2, before anything runs
        with pytest.raises(SystemExit) as info:
            verify_kernels.main(args)
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.count("\n") == 1 and re.search(expected, err), err


# ----------------------------------------------------------------------------- verifier.sandbox on its own


def _child(body: str) -> list[str]:
    """A Python child with the harness's end of the channel (``r``), without importing torch."""
    prelude = (f"import importlib.util, os, sys\n"
               f"spec = importlib.util.spec_from_file_location('sandbox_under_test', {str(SANDBOX)!r})\n"
               "sb = importlib.util.module_from_spec(spec); sys.modules[spec.name] = sb; spec.loader.exec_module(sb)\n"
               "r = sb.Reporter.from_stdin()\n")
    return [sys.executable, "-c", prelude + textwrap.dedent(body)]


def _sandbox():
    from verifier import sandbox

    return sandbox


def test_sandbox_trusts_only_the_harness():
    sandbox = _sandbox()
    ok = sandbox.run(_child("r.send(stage='compiles')\nprint('noise')\nr.finish(1, verdict={'v': 1})\n"), timeout=60)
    assert ok.returncode == 1 and not ok.forged and ok.log == ["noise"]
    assert ok.messages == [{"stage": "compiles"}, {"final": True, "status": 1, "verdict": {"v": 1}}]
    assert ok.final["verdict"] == {"v": 1}
    # a line written to the channel without the token, then an exit before the harness reports
    forged = sandbox.run(_child("os.write(r.fd, b'{\"final\": true, \"status\": 0}\\n')\nos._exit(0)\n"), timeout=60)
    assert forged.final is None and forged.forged == 1 and forged.how_it_ended() == "exited with status 0"
    # a forked copy of the harness reports (the right token, another pid); the child itself exits 0
    fork = sandbox.run(_child("if os.fork() == 0:\n    r.finish(0, verdict={})\nos.wait()\nos._exit(0)\n"), timeout=60)
    assert fork.final is None and fork.forged == 1 and fork.returncode == 0
    # the token and channel came on stdin, which the candidate then finds empty; the channel is not inherited
    env = sandbox.run(_child("""
        import subprocess
        assert sys.stdin.read() == ''
        code = subprocess.call([sys.executable, '-c', f'import os; os.fstat({r.fd})'], stderr=subprocess.DEVNULL)
        r.finish(0, grandchild_saw_channel=code == 0)
        """), timeout=60)
    assert env.returncode == 0 and env.final["grandchild_saw_channel"] is False
    signalled = sandbox.run(_child("import signal\nos.kill(os.getpid(), signal.SIGKILL)\n"), timeout=60)
    assert signalled.final is None and signalled.how_it_ended() == "killed by signal 9 (SIGKILL)"


def test_sandbox_timeout_kills_the_group(tmp_path):
    sandbox = _sandbox()
    marker = tmp_path / "pids"
    start = time.monotonic()
    try:
        out = sandbox.run(_child(f"""
            import signal, subprocess
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            sleeper = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)'])
            open({str(marker)!r}, 'w').write(str(sleeper.pid))
            r.send(stage='looping')
            while True:
                pass
            """), timeout=2)
        assert 2 <= time.monotonic() - start < 30
        assert out.timed_out and out.returncode is None and out.how_it_ended() == "timed out after 2 s"
        assert out.messages == [{"stage": "looping"}]
        assert _gone(int(marker.read_text()))
    finally:
        _kill_leftovers(marker)


def test_sigterm_to_the_parent_kills_the_child_group_too(tmp_path):
    """The child has its own session: a scheduler's SIGTERM to the verifier must not leave it running."""
    marker = tmp_path / "pids"
    child = _child(f"""
        import subprocess
        sleeper = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)'])
        open({str(marker)!r} + '.tmp', 'w').write(f'{{os.getpid()}} {{sleeper.pid}}')
        os.rename({str(marker)!r} + '.tmp', {str(marker)!r})
        while True:
            pass
        """)
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location('sandbox_under_test', {str(SANDBOX)!r})
        sb = importlib.util.module_from_spec(spec); sys.modules[spec.name] = sb; spec.loader.exec_module(sb)
        sb.run({child!r}, timeout=120)
        """)])
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline and parent.poll() is None:
        time.sleep(0.05)
    try:
        pids = [int(p) for p in marker.read_text().split()]
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=30) == -signal.SIGTERM
        assert all(_gone(pid) for pid in pids)
    finally:
        parent.kill()
        _kill_leftovers(marker)
