"""accel.cli's output-path checks: each refusal names the option and says what was expected."""

import os

import pytest

from accel.cli import check_output_dir, check_output_file


def test_output_file_accepts_new_and_existing_files(tmp_path):
    assert check_output_file(tmp_path / "t.json", "--trace") == tmp_path / "t.json"
    (tmp_path / "old.json").write_text("{}")
    assert check_output_file(tmp_path / "old.json", "--trace").name == "old.json"


@pytest.mark.parametrize("case, expected", [("dir", "is a folder"), ("noparent", "does not exist")])
def test_output_file_refusals_name_the_option(tmp_path, case, expected):
    path = tmp_path if case == "dir" else tmp_path / "missing" / "t.json"
    with pytest.raises(ValueError, match=f"--png .*{expected}"):
        check_output_file(path, "--png")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permission bits")
def test_output_file_refuses_read_only_folder(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(ValueError, match="not writable"):
        check_output_file(ro / "t.json", "--json")


def test_output_dir_rules(tmp_path):
    assert check_output_dir(tmp_path / "a" / "b", "--out") == tmp_path / "a" / "b"  # created later, parents too
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="--out .* is a file"):
        check_output_dir(tmp_path / "f", "--out")
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    assert check_output_dir(full, "--out") == full
    with pytest.raises(ValueError, match="--out .* is not empty"):
        check_output_dir(full, "--out", must_be_empty=True)
    with pytest.raises(ValueError, match="cannot create"):
        check_output_dir(tmp_path / "f" / "sub", "--out")


def test_output_file_probed_by_many_processes_at_once(tmp_path):
    """Every rank of a launch checks the same ``--trace`` path at the same moment: one rank's probe file (created
    and removed at once) must not make another's check fail with 'File exists'."""
    import threading

    target, errors, start = tmp_path / "trace.json", [], threading.Barrier(8)

    def probe() -> None:
        start.wait()
        for _ in range(200):
            try:
                check_output_file(target, "--trace")
            except ValueError as exc:
                errors.append(str(exc))

    threads = [threading.Thread(target=probe) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
