"""Every CLI refuses bad input in one line naming the argument or file, exits 2, and writes nothing (issue 25).

Most cases call the entry point's ``main(argv)`` in this process (a subprocess costs a torch import
each); the cases the issue reported run through the real CLI in a subprocess. Each case runs in an
empty working folder with its input files beside it, and that folder must hold nothing new afterwards.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from accel.cli import has_default

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "recipes" / "configs" / "tiny_cpu.toml")
TINY = str(ROOT / "recipes" / "configs" / "tiny_cpu.toml")
# argparse's own refusals end with "<prog>: error: ..."; the recipes' with "error: ..."
ERROR_LINE = re.compile(r"^(\S[^:]*: )?error: ")


def _inputs(folder: Path) -> None:
    """The bad (and a few good) input files every case may name, created in ``folder``."""
    (folder / "garbage.txt").write_bytes(b"\x00\xff\xfe\x81 binary \x00\x9c" * 8)
    (folder / "empty.txt").write_bytes(b"")
    (folder / "ok.txt").write_text("hello world\n")
    (folder / "ok.jsonl").write_text('{"text": "hello"}\n')
    (folder / "bad.toml").write_text("[run]\nsteps = 3\nname = \n")
    (folder / "unknown.toml").write_text("[run]\nbogus = 1\n")
    (folder / "wrongtype.toml").write_text('[run]\nsteps = "many"\n')
    (folder / "binary.toml").write_bytes(b"\xff\xfe[run]\n")
    (folder / "a_folder").mkdir()
    (folder / "simumax" / "simumax" / "core").mkdir(parents=True)
    (folder / "simumax" / "simumax" / "core" / "perf_llm.py").write_text("")


# (module, argv, what the error line must say); "{t}" is the case's working folder
CASES = [
    # recipes.plan: every number validated, output paths checked before the search
    ("recipes.plan", ["--gpus", "8", "--seq-len", "0"], "argument --seq-len: expected an integer >= 1, got '0'"),
    ("recipes.plan", ["--gpus", "8", "--seq-len", "1"], "--seq-len must be >= 2"),
    ("recipes.plan", ["--gpus", "8", "--seq-len", "99999999999"], "exceeds the model's max_seq_len"),
    ("recipes.plan", ["--gpus", "0"], "argument --gpus: expected an integer >= 1"),
    ("recipes.plan", ["--gpus", "8", "--global-batch", "-4"], "argument --global-batch"),
    ("recipes.plan", ["--gpus", "8", "--tokens", "nan"], "argument --tokens: expected a finite number > 0"),
    ("recipes.plan", ["--gpus", "8", "--intra-bw", "0"], "argument --intra-bw"),
    ("recipes.plan", ["--gpus", "8", "--top", "0"], "argument --top"),
    ("recipes.plan", ["--gpus", "8", "--expert-imbalance", "nan"], "--expert-imbalance"),
    ("recipes.plan", ["--gpus", "8", "--json", "{t}"], "--json '{t}' is a folder"),
    ("recipes.plan", ["--gpus", "8", "--trace", "{t}"], "--trace '{t}' is a folder"),
    ("recipes.plan", ["--gpus", "8", "--write-config", "{t}/no/x.toml"], "--write-config"),
    ("recipes.plan", ["--gpus", "8", "--model", "{t}/garbage.txt"], "--model '{t}/garbage.txt': expected a preset"),
    ("recipes.plan", ["--gpus", "8", "--system", "{t}/garbage.txt"], "--system '{t}/garbage.txt': not valid JSON"),
    ("recipes.plan", ["--gpus", "8", "--gpu", "H9000"], "--gpu: unknown GPU 'H9000'"),
    ("recipes.plan", ["--gpus", "8", "--model", "{t}/missing.toml"], "--model: no such file '{t}/missing.toml'"),
    ("recipes.plan", ["--gpus", "8", "--fix", "pp=1,dp=8,ep=8,schedule=none,micro_batch=1,microbatches=2,"
                      "recompute=block,fp8=true,moments=bfloat16,eplb=0,zero1=true"], "no layout fits H800"),
    ("recipes.plan", ["calibrate", "--out", "{t}"], "--out '{t}' is a folder"),
    # recipes.prepare_data: undecodable, empty, 0-token inputs; bad numbers; unusable --out / --tokenizer
    ("recipes.prepare_data", ["--input", "{t}/garbage.txt", "--tokenizer", "byte", "--out", "{t}/o", "--workers", "1"],
     "--input '{t}/garbage.txt': not UTF-8 text"),
    ("recipes.prepare_data", ["--input", "{t}/empty.txt", "--tokenizer", "byte", "--out", "{t}/o", "--workers", "1"],
     "--input '{t}/empty.txt': the file is empty"),
    ("recipes.prepare_data", ["--input", "{t}/ok.jsonl", "--tokenizer", "byte", "--out", "{t}/o", "--workers", "1",
                              "--text-field", "body", "--no-progress"], "0 tokens produced"),
    ("recipes.prepare_data", ["--input", "{t}/ok.txt", "--tokenizer", "{t}/garbage.txt", "--out", "{t}/o",
                              "--workers", "1"], "--tokenizer '{t}/garbage.txt': not a readable"),
    ("recipes.prepare_data", ["--input", "{t}/ok.txt", "--tokenizer", "{t}/a_folder", "--out", "{t}/o"],
     "--tokenizer: no tokenizer file at '{t}/a_folder/tokenizer.json'"),
    ("recipes.prepare_data", ["--input", "{t}/ok.txt", "--tokenizer", "byte", "--out", "{t}/ok.txt"],
     "--out '{t}/ok.txt' is a file"),
    ("recipes.prepare_data", ["--input", "{t}/ok.txt", "--tokenizer", "byte", "--out", "{t}/o", "--workers", "0"],
     "argument --workers"),
    ("recipes.prepare_data", ["--input", "{t}/ok.txt", "--tokenizer", "byte", "--out", "{t}/o", "--shard-mb", "nan"],
     "argument --shard-mb"),
    ("recipes.prepare_data", ["--input", "{t}/ok.txt", "--tokenizer", "byte", "--out", "{t}/o", "--max-tokens", "-1"],
     "argument --max-tokens"),
    # dualpipe.simulate / dualpipe.bench
    ("dualpipe.simulate", ["--trace", "{t}"], "--trace '{t}' is a folder"),
    ("dualpipe.simulate", ["--csv", "{t}/no/s.csv"], "--csv"),
    ("dualpipe.simulate", ["--ranks", "0"], "argument --ranks"),
    ("dualpipe.simulate", ["--microbatches", "-1"], "argument --microbatches"),
    ("dualpipe.simulate", ["--F", "nan"], "argument --F: expected a finite number >= 0"),
    ("dualpipe.simulate", ["--FB", "inf"], "argument --FB"),
    ("dualpipe.simulate", ["--W", "5"], "cost W (5.0) cannot exceed the full backward B"),
    ("dualpipe.bench", ["--ranks", "3"], "even number of ranks"),
    ("dualpipe.bench", ["--schedules", "bogus"], "--schedules 'bogus'"),
    ("dualpipe.bench", ["--repeats", "0"], "argument --repeats"),
    ("dualpipe.bench", ["--json", "{t}"], "--json '{t}' is a folder"),
    # recipes.train: config file, --set, --nproc, --device
    ("recipes.train", ["--config", "{t}/missing.toml"], "--config: no such file '{t}/missing.toml'"),
    ("recipes.train", ["--config", TINY, "--set", "model.init_from={t}", "--dry-run"],
     "model.init_from='{t}': no config.json there"),
    ("recipes.train", ["--config", TINY, "--set", "model.fp8_recipe=bogus", "--dry-run"],
     "model.fp8_recipe must be one of blockwise, mxfp8, got 'bogus'"),
    ("recipes.train", ["--config", "{t}/a_folder", "--dry-run"], "--config '{t}/a_folder' is a folder"),
    ("recipes.train", ["--config", "{t}/bad.toml", "--dry-run"],
     "--config '{t}/bad.toml': not valid TOML: Invalid value (at line 3"),
    ("recipes.train", ["--config", "{t}/binary.toml", "--dry-run"], "--config '{t}/binary.toml': not UTF-8 text"),
    ("recipes.train", ["--config", "{t}/unknown.toml", "--dry-run"],
     "--config '{t}/unknown.toml': unknown config key 'run.bogus'"),
    ("recipes.train", ["--config", "{t}/wrongtype.toml", "--dry-run"], "'run.steps': expected an integer"),
    ("recipes.train", ["--config", TINY, "--set", "optim.bogus=1", "--dry-run"], "unknown config key 'optim.bogus'"),
    ("recipes.train", ["--config", TINY, "--set", "noequals", "--dry-run"], "--set expects key=value"),
    ("recipes.train", ["--config", TINY, "--nproc", "0"], "argument --nproc: expected an integer >= 1"),
    ("recipes.train", ["--config", TINY, "--nproc", "-2", "--dry-run"], "argument --nproc"),
    ("recipes.train", ["--config", TINY, "--nproc", "3", "--dry-run"], "world size 3"),
    ("recipes.train", ["--config", TINY, "--dry-run", "--device", "H9000"], "--device 'H9000': unknown device"),
    ("recipes.train", ["--config", TINY, "--device", "H800"], "--device is the device --dry-run checks"),
    # experiments and benchmarks that train: every config, the data and the outputs checked before any run
    ("recipes.expert_balance", ["--steps", "0"], "argument --steps"),
    ("recipes.expert_balance", ["--alpha", "nan"], "argument --alpha"),
    ("recipes.expert_balance", ["--eplb-interval", "0"], "argument --eplb-interval"),
    ("recipes.expert_balance", ["--text", "{t}/missing.txt"], "--text '{t}/missing.txt': no such file"),
    ("recipes.expert_balance", ["--out", "{t}/ok.txt"], "--out '{t}/ok.txt' is a file"),
    ("recipes.expert_balance", ["--strategies", "bogus"], "unknown part(s) ['bogus']"),
    ("recipes.expert_balance", ["--config", TINY], "world size 1"),
    ("recipes.fp8_vs_bf16", ["--steps", "0"], "argument --steps"),
    ("recipes.fp8_vs_bf16", ["--config", "{t}/missing.toml"], "--config: no such file"),
    ("recipes.fp8_vs_bf16", ["--out", "{t}/ok.txt"], "--out '{t}/ok.txt' is a file"),
    ("recipes.fp8_vs_bf16", ["--set", "bogus=1"], "unknown config key 'bogus'"),
    ("recipes.bench_overlap", ["--nproc", "3"], "world size 3"),
    ("recipes.bench_overlap", ["--json", "{t}"], "--json '{t}' is a folder"),
    ("recipes.bench_a2a_delay", ["--trace", "{t}"], "--trace '{t}' is a folder"),
    ("recipes.bench_a2a_delay", ["--comm-ratio", "nan"], "argument --comm-ratio"),
    ("recipes.bench_a2a_delay", ["--config", "{t}/bad.toml"], "not valid TOML"),
    ("recipes.memory_report", ["--config", TINY, "--json", "{t}"], "--json '{t}' is a folder"),
    ("recipes.memory_report", ["--config", TINY, "--steps", "1"], "--steps must be >= 2"),
    ("recipes.memory_report", ["--config", TINY, "--nproc", "0"], "argument --nproc"),
    ("recipes.bench_checkpoint", ["--size-mb", "nan"], "argument --size-mb"),
    ("recipes.bench_checkpoint", ["--root", "{t}/missing"], "--root '{t}/missing': no such folder"),
    ("recipes.bench_checkpoint", ["--device", "tpu"], "--device 'tpu'"),
    ("recipes.bench_ep_overlap", ["--topk", "9"], "--topk 9: expected at most --experts 8"),
    ("recipes.bench_ep_overlap", ["--dim", "0"], "argument --dim"),
    ("recipes.bench_ep_overlap", ["--experts", "3"], "--experts 3 is not divisible by --nproc 2"),
    ("recipes.bench_ep_overlap", ["--fp8", "--dim", "100"], "--dim 100: --fp8 quantises 1x128 tiles"),
    ("recipes.bench_memory", ["--preset", "nosuch"], "unknown name 'nosuch'"),
    ("recipes.bench_memory", ["--seq", "0"], "argument --seq"),
    ("recipes.bench_model", ["--json", "{t}"], "--json '{t}' is a folder"),
    ("recipes.bench_model", ["--warmup", "-1"], "argument --warmup"),
    ("recipes.bench_kernels", ["bogus"], "argument kernel: invalid choice"),
    ("recipes.bench_kernels", ["deep_gemm", "--json", "{t}"], "argument --json: '{t}' is a folder"),
    ("recipes.bench_kernels", ["flash_mla", "--json", "{t}/no/x.json"], "argument --json"),
    ("recipes.compare_simumax", ["--simumax", "{t}/a_folder"], "is not a SimuMax checkout"),
    ("recipes.compare_simumax", ["--simumax", "{t}/simumax", "--python", "{t}/no/python"], "--python"),
    ("recipes.compare_simumax", ["--simumax", "{t}/simumax", "--json", "{t}"], "--json '{t}' is a folder"),
    ("recipes.kernels_compiled", ["--jobs", "0"], "argument --jobs"),
    ("recipes.kernels_compiled", ["--write", "{t}"], "--write '{t}' is a folder"),
    ("recipes.warm_kernels", ["--areas", "bogus"], "--areas 'bogus'"),
    ("recipes.warm_kernels", ["--timeout", "nan"], "argument --timeout"),
    ("recipes.verify_kernels", ["--json", "{t}"], "--json '{t}' is a folder"),
    ("recipes.verify_kernels", ["--tolerance", "-1", "--ops", "x"], "argument --tolerance"),
    ("recipes.verify_kernels", ["--import", "no_such_module_x", "--list"], "--import no_such_module_x: no such module"),
    ("recipes.verify_kernels", ["--suite", "{t}/ok.txt"], "--suite {t}/ok.txt: not a directory"),
]


def _run_main(module: str, argv: list[str], capsys) -> tuple[int, str, str]:
    main = importlib.import_module(module).main
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse's refusals
        status = exc.code
    out, err = capsys.readouterr()
    return status, out, err


def _check_refusal(status, out: str, err: str, expected: str, before: set[str], folder: Path, what: str = "") -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, (what, status, out[-2000:], err[-2000:])
    assert "Traceback" not in out + err, (what, err)
    assert lines and ERROR_LINE.match(lines[-1]), (what, err)
    assert expected in lines[-1], (what, expected, lines[-1])
    assert sorted(p.name for p in folder.iterdir()) == sorted(before), f"{what}: a refused command wrote files"


@pytest.mark.parametrize("module, argv, expected", CASES,
                         ids=[f"{m.split('.')[-1]}:{' '.join(a)[:60]}" for m, a, _ in CASES])
def test_bad_input_is_one_line_and_status_2(module, argv, expected, tmp_path, monkeypatch, capsys):
    _inputs(tmp_path)
    before = {p.name for p in tmp_path.iterdir()}
    monkeypatch.chdir(tmp_path)  # a stray relative write (runs/, a report) would land here and fail the test
    for key in ("TRITON_INTERPRET", "DSV3_KERNEL_IMPL"):  # restored after the case: kernels_compiled clears one
        if key in os.environ:
            monkeypatch.setenv(key, os.environ[key])
    fill = lambda s: s.replace("{t}", str(tmp_path))  # noqa: E731
    status, out, err = _run_main(module, [fill(a) for a in argv], capsys)
    _check_refusal(status, out, err, fill(expected), before, tmp_path)


# the cases the issue reported, through the real command line
SUBPROCESS_CASES = [
    (["recipes.plan", "--gpus", "8", "--seq-len", "0"], "argument --seq-len: expected an integer >= 1, got '0'"),
    (["recipes.prepare_data", "--input", "{t}/garbage.txt", "--tokenizer", "byte", "--out", "{t}/out", "--workers",
      "1"], "error: --input '{t}/garbage.txt': not UTF-8 text"),
    (["dualpipe.simulate", "--png", "{t}"], "error: --png '{t}' is a folder; expected a file path"),
    (["recipes.train", "--config", "{t}/missing.toml"], "error: --config: no such file '{t}/missing.toml'"),
    # it imports every kernel module compiled for a GPU: in this process they would leave the interpreter
    (["recipes.kernels_compiled", "--match", "no_such_kernel"], "error: --match 'no_such_kernel': no kernel name"),
]


@pytest.mark.slow
def test_reported_cases_through_the_cli(tmp_path):
    """The commands start together (each pays a torch import; on two cores this halves the wall time)."""
    _inputs(tmp_path)
    before = {p.name for p in tmp_path.iterdir()}
    fill = lambda s: s.replace("{t}", str(tmp_path))  # noqa: E731
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1",
           "DSV3_KERNEL_IMPL": "reference"}
    procs = [subprocess.Popen([sys.executable, "-m", *[fill(a) for a in argv]], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for argv, _ in SUBPROCESS_CASES]
    for proc, (argv, expected) in zip(procs, SUBPROCESS_CASES, strict=True):
        out, err = proc.communicate(timeout=180)
        _check_refusal(proc.returncode, out, err, fill(expected), before, tmp_path, what=argv[0])


def test_png_is_written_exactly_where_it_says(tmp_path, capsys):
    """A --png without the .png suffix is written at that path (matplotlib would otherwise append one)."""
    from dualpipe import simulate

    assert simulate.main(["--ranks", "2", "--microbatches", "4", "--png", str(tmp_path / "timeline")]) == 0
    assert (tmp_path / "timeline").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote png: {tmp_path / 'timeline'}" in capsys.readouterr().out


HELP = [(m, []) for m in (
    "recipes.plan", "recipes.prepare_data", "recipes.train", "recipes.export_hf", "recipes.generate",
    "recipes.verify_kernels", "recipes.expert_balance", "recipes.fp8_vs_bf16", "recipes.memory_report",
    "recipes.bench_overlap", "recipes.bench_a2a_delay", "recipes.bench_checkpoint", "recipes.bench_ep_overlap",
    "recipes.bench_memory", "recipes.bench_model", "recipes.bench_kernels", "recipes.compare_simumax",
    "recipes.kernels_compiled", "recipes.warm_kernels", "dualpipe.simulate", "dualpipe.bench")] + [
    ("recipes.plan", ["calibrate"]), ("recipes.bench_kernels", ["deep_gemm"]), ("recipes.bench_kernels", ["flash_mla"]),
    ("recipes.bench_kernels", ["fused"])]


@pytest.mark.parametrize("module, prefix", HELP, ids=[" ".join([m, *p]) for m, p in HELP])
def test_help_shows_every_option_with_its_meaning_and_default(module, prefix, monkeypatch, capsys):
    parsers: list[argparse.ArgumentParser] = []
    parse = argparse.ArgumentParser.parse_args

    def spy(self, *args, **kwargs):
        parsers.append(self)
        return parse(self, *args, **kwargs)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", spy)
    with pytest.raises(SystemExit) as info:
        importlib.import_module(module).main([*prefix, "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    parser = parsers[-1]
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        assert action.help, f"{module} {action.option_strings or action.dest}: no help string"
        shown = " ".join(formatter._expand_help(action).split())
        assert "".join(shown.split()) in "".join(text.split()), (action.option_strings, shown)
        if has_default(action):
            assert "default" in shown, f"{module} {action.option_strings}: --help does not show the default"
