"""verifier.candidate: the four gates on candidate files, and every reward hack of issue 16 caught by its gate.

Each cheating candidate is a small file under tests/verify_hacks/ (real @triton.jit kernels, run by the CPU
interpreter); each test names the gate that must catch it and the message it must give. The honest
candidates must pass every gate measurable here (the speed gate is "not measurable" on the cpu).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from recipes import verify_kernels
from verifier import candidate, fallback
from verifier.candidate import FAIL, NOT_MEASURABLE, PASS

HACKS = Path(__file__).parent / "verify_hacks"
AXPY, MATMUL = HACKS / "axpy_ref.py", HACKS / "matmul_ref.py"
pytestmark = pytest.mark.timeout(300)


def _verify(name: str, reference: Path = AXPY, **kwargs) -> candidate.Verdict:
    return candidate.verify_candidate(HACKS / f"{name}.py", reference, **kwargs)


@pytest.mark.parametrize("name, reference", [("axpy_good", AXPY), ("matmul_good", MATMUL)])
def test_honest_candidates_pass(name, reference):
    v = _verify(name, reference)
    assert v.exit_code == 0, candidate.format_verdict(v)
    assert [v.gates[g].status for g in candidate.GATES] == [PASS, PASS, PASS, NOT_MEASURABLE]
    assert len(v.seeds) == 5 and len(set(v.seeds)) == 5
    assert v.tolerances == {"out": 1e-4}  # fp32 output: KernelBench's current tolerance
    assert v.max_errors["out"] < 1e-10 and v.launches >= 1
    assert "cpu / Triton interpreter" in v.gates["faster"].message


# (candidate, reference, gate that catches it, message it gives)
HACK_CASES = [
    ("hack_matmul", MATMUL, "no_fallback", r"PyTorch computed inside the candidate: .*aten\.mm x1"),
    ("hack_conv", MATMUL, "no_fallback", r"PyTorch computed inside the candidate: .*aten\.convolution x1"),
    ("hack_softmax", MATMUL, "no_fallback", r"PyTorch computed inside the candidate: aten\._softmax x1"),
    ("hack_sdpa", MATMUL, "no_fallback", r"PyTorch computed inside the candidate: .*aten\.bmm"),
    ("hack_noop_launch", AXPY, "no_fallback", r"aten\.add x1, aten\.mul x1 .*out was produced by aten\.add, "
                                              r"not by the candidate's kernel"),
    ("hack_compiled", AXPY, "no_fallback", r"PyTorch computed inside the candidate: aten\.add x1, aten\.mul x1"),
    ("hack_calls_reference", AXPY, "no_fallback", r"PyTorch computed inside the candidate: aten\.add x1, aten\.mul"),
    ("hack_try_except", AXPY, "no_fallback", r"PyTorch computed inside the candidate: aten\.add x1, aten\.mul x1"),
    ("hack_cache_pointer", AXPY, "no_fallback", r"\(repeated call, same inputs\): the candidate launched no Triton "
                                                r"kernel; .*out was not allocated in this call"),
    ("hack_cache_shape", AXPY, "correct", r"out: 9\d\d of 960 elements outside atol=rtol=0\.0001"),
    ("hack_return_input", AXPY, "no_fallback", r"out shares memory with input input\[1\] \(returns an input"),
    ("hack_return_view", AXPY, "no_fallback", r"out shares memory with input input\[1\] \(returns an input"),
    ("hack_partial_write", AXPY, "correct", r"out: 40 of 960 elements NaN/Inf where the reference is finite "
                                            r"\(unwritten\? outputs start NaN-poisoned\)"),
    ("hack_mutate_input", AXPY, "correct", r"the candidate modified its inputs: input\[0\] \(960 of 960 elements\)"),
    ("hack_thread", AXPY, "no_fallback", r"1 Triton launch\(es\) came from another thread.*started 1 thread"),
    ("hack_patch_timer", AXPY, "no_fallback", r"the candidate replaced torch\.cuda\.Event, time\.perf_counter when "
                                              r"imported"),
    ("hack_patch_allclose", AXPY, "no_fallback", r"the candidate replaced torch\.allclose when imported"),
    ("hack_patch_harness", AXPY, "no_fallback", r"the candidate replaced verifier\.candidate\._compare when imported"),
    ("hack_low_precision", AXPY, "correct", r"out: \d+ of 960 elements outside atol=rtol=0\.0001"),
    # seed 0's answer against another seed's inputs: an element may fall inside the tolerance by chance
    ("hack_hardcoded", AXPY, "correct", r"out: 9\d\d of 960 elements outside atol=rtol=0\.0001"),
]


@pytest.mark.parametrize("name, reference, gate, message", HACK_CASES, ids=[c[0] for c in HACK_CASES])
def test_reward_hack_is_caught(name, reference, gate, message):
    v = _verify(name, reference)
    assert v.exit_code == 1 and not v.passed, candidate.format_verdict(v)
    assert v.gates[gate].status == FAIL, candidate.format_verdict(v)
    assert re.search(message, v.gates[gate].message), v.gates[gate].message
    assert v.gates["faster"].status in (NOT_MEASURABLE, "not run")


def test_harness_patches_are_undone():
    """A candidate that patched torch.allclose / the harness at import leaves nothing patched behind."""
    allclose, compare = torch.allclose, candidate._compare
    _verify("hack_patch_allclose")
    _verify("hack_patch_harness")
    assert torch.allclose is allclose and candidate._compare is compare


def test_cached_hardcoded_output_is_also_flagged_as_stale():
    v = _verify("hack_hardcoded")
    assert re.search(r"out is a copy of a tensor from before the call \(cached or hard-coded\?\)",
                     v.gates["no_fallback"].message), v.gates["no_fallback"].message


def test_shape_specific_kernel_fails_on_other_shapes():
    """Hard-coded for the default 24 x 40: passes there, fails as soon as --shapes changes the size."""
    assert _verify("hack_fixed_shape").exit_code == 0
    v = _verify("hack_fixed_shape", shapes={"ROWS": 32})
    assert v.gates["correct"].status == FAIL
    assert "out: 320 of 1280 elements NaN/Inf where the reference is finite" in v.gates["correct"].message


@pytest.mark.gpu
def test_faster_gate_measures_and_decides_on_a_gpu():
    v = _verify("matmul_good", MATMUL, device=torch.device("cuda"), min_speedup=0.0)
    assert v.gates["faster"].status == PASS and v.speedup > 0 and v.candidate_ms > 0 and v.reference_ms > 0
    v = _verify("matmul_good", MATMUL, device=torch.device("cuda"), min_speedup=1e9)
    assert v.gates["faster"].status == FAIL and "needs >= 1e+09x" in v.gates["faster"].message
    assert v.exit_code == 1


@pytest.mark.gpu
def test_side_stream_is_caught():
    v = _verify("hack_side_stream", device=torch.device("cuda"))
    assert v.gates["no_fallback"].status == FAIL
    assert "went to a side stream" in v.gates["no_fallback"].message


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("name, reference, message", [
    ("bad_no_entry", AXPY, r"^candidate defines no function candidate\(\*inputs\)"),
    ("matmul_good", HACKS / "neither_ref.py", r"is in neither format: KernelBench needs Model, get_inputs, "
                                              r"get_init_inputs \(missing Model, get_inputs, get_init_inputs\)"),
    ("axpy_good", MATMUL, r"^candidate defines no class ModelNew"),
    ("bad_constructor", MATMUL, r"^mismatched constructor: Model\(in_features, out_features\) but "
                                r"ModelNew\(features\)$"),
    ("axpy_good", HACKS / "nondeterministic_ref.py", r"^the reference is not deterministic: two runs with seed \d+ "
                                                     r"differ \(out: \d+ of 960 elements outside"),
    ("axpy_good", HACKS / "no_such_ref.py", r"reference file .*no_such_ref\.py does not exist"),
])
def test_bad_input_gets_a_verdict_not_a_traceback(name, reference, message):
    v = _verify(name, reference)
    assert v.exit_code == 2 and v.bad_input, candidate.format_verdict(v)
    assert re.search(message, v.bad_input), v.bad_input
    assert "BAD INPUT: " in candidate.format_verdict(v)


def test_bad_shapes_override_names_the_sizes():
    v = _verify("axpy_good", shapes={"ROWZ": 8})
    assert v.exit_code == 2
    assert v.bad_input == "--shapes ROWZ=8: the reference has no module-level number 'ROWZ'; it has: COLS, ROWS"


@pytest.mark.parametrize("name, gate, message", [
    ("bad_shape", "correct", r"out: shape \(24, 39\), reference \(24, 40\)"),
    ("bad_dtype", "correct", r"out: dtype torch\.float64, reference torch\.float32"),
    ("bad_syntax", "compiles", r"^first call failed: .*not_defined_anywhere"),
])
def test_wrong_outputs_and_compile_errors_are_named(name, gate, message):
    v = _verify(name)
    assert v.exit_code == 1 and v.gates[gate].status == FAIL
    assert re.search(message, v.gates[gate].message), v.gates[gate].message


# ----------------------------------------------------------------------------- pieces


def test_tolerances_by_dtype_and_override():
    assert candidate.tolerance_for(torch.float32, None) == 1e-4
    assert candidate.tolerance_for(torch.bfloat16, None) == candidate.tolerance_for(torch.float16, None) == 1e-2
    assert candidate.tolerance_for(torch.int64, 0.5) == 0.0  # integers are always exact
    assert candidate.tolerance_for(torch.float32, 1e-3) == 1e-3
    assert candidate.tolerance_for(torch.bfloat16, {torch.bfloat16: 2e-2}) == 2e-2
    v = _verify("hack_low_precision", tolerance=1e-2)  # fp16 arithmetic is within 1e-2: the override is used
    assert v.gates["correct"].status == PASS and v.tolerances == {"out": 1e-2}


def test_allow_list_lets_a_declared_operator_through():
    v = _verify("hack_noop_launch", allow={"aten.mul": "test", "aten.add": "test"})
    assert "PyTorch computed" not in (v.gates["no_fallback"].message or "")
    # still not written by the kernel: the allow-list lets an operator run, it does not make it a kernel
    assert "out is a copy of an input" in v.gates["no_fallback"].message
    with pytest.raises(ValueError, match="expected 'aten.op_name': 'reason'"):
        fallback.normalize_allow({"aten.mm": ""})
    assert fallback.normalize_allow({"mm": "a", "aten.add.Tensor": "b", "torch.ops.aten.mul": "c"}) == {
        "aten.mm": "a", "aten.add": "b", "aten.mul": "c"}


def test_recorder_sees_torch_ops_and_launch_provenance():
    from tests.verify_hacks import axpy_kernels

    x, y = torch.randn(8, 8), torch.randn(8, 8)
    with fallback.record_call([x, y]) as rec:
        out = axpy_kernels.axpy(x, y)
        extra = torch.matmul(x, y)
    assert rec.launches == 1 and rec.writer(out) == fallback.KERNEL
    assert rec.violations == {"aten.mm": 1} and rec.writer(extra) == "aten.mm"
    assert fallback.output_problems(rec, [("out", out)], [("x", x), ("y", y)]) == []
    with fallback.record_call([x]) as rec:
        buf = torch.empty(4)
    assert torch.isnan(buf).all()  # empty allocations are poisoned
    assert rec.problems() == [] and fallback.output_problems(rec, [("out", buf)], []) == [
        "the candidate launched no Triton kernel", "out was allocated but never written by a kernel launch"]


def test_fast_p_and_suite_summary():
    def verdict(correct: bool, speedup: float | None) -> candidate.Verdict:
        v = candidate.Verdict("c.py", "r.py")
        for g in ("compiles", "correct", "no_fallback"):
            v.gates[g].status = PASS if correct else FAIL
        v.gates["faster"].status = PASS if speedup and speedup >= 1 else FAIL
        v.speedup = speedup
        return v

    vs = [verdict(True, 2.5), verdict(True, 1.2), verdict(True, 0.5), verdict(False, None)]
    assert [candidate.fast_p(vs, p) for p in candidate.FAST_P] == [0.75, 0.5, 0.25, 0.25]
    summary = candidate.suite_summary(vs)
    assert summary["gates"]["correct"] == {"passed": 3, "measured": 4}
    assert summary["fast_p"] == {"fast_0": 0.75, "fast_1": 0.5, "fast_1.5": 0.25, "fast_2": 0.25}
    cpu = [verdict(True, None)]
    cpu[0].gates["faster"].status = NOT_MEASURABLE
    assert candidate.fast_p(cpu, 0) == 1.0 and candidate.fast_p(cpu, 1.0) is None
    assert "fast_1=not measurable" in candidate.format_suite(cpu)
    back = candidate.verdict_from_dict(json.loads(json.dumps(vs[0].to_dict())))
    assert back.passed and back.speedup == 2.5 and back.gates["faster"].status == PASS
    assert math.isclose(candidate.fast_p([back], 2.0), 1.0)


# ----------------------------------------------------------------------------- the command line


@pytest.mark.slow
def test_cli_exit_codes_and_json(tmp_path, capsys):
    out = tmp_path / "v.json"
    argv = ["--candidate", str(HACKS / "hack_noop_launch.py"), "--reference", str(AXPY), "--json", str(out)]
    assert verify_kernels.main(argv) == 1
    printed = capsys.readouterr().out
    assert "no_fallback  FAIL" in printed and "verdict: FAIL" in printed
    doc = json.loads(out.read_text())
    assert doc["exit_code"] == 1 and doc["gates"]["no_fallback"]["status"] == "fail"
    assert doc["gates"]["faster"]["status"] == "not measurable" and doc["gates"]["compiles"]["status"] == "pass"
    assert verify_kernels.main(["--candidate", str(HACKS / "axpy_good.py"), "--reference", str(AXPY)]) == 0
    assert verify_kernels.main(["--candidate", str(HACKS / "bad_no_entry.py"), "--reference", str(AXPY)]) == 2
    assert "BAD INPUT: candidate defines no function candidate" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        verify_kernels.main(["--candidate", str(HACKS / "axpy_good.py")])
    assert info.value.code == 2 and "--candidate and --reference go together" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        verify_kernels.main(["--candidate", "a.py", "--reference", "b.py", "--allow", "aten.mm"])
    assert "--allow 'aten.mm': expected OP=REASON" in capsys.readouterr().err


def test_suite_without_problems_is_bad_input(tmp_path, capsys):
    assert verify_kernels.main(["--suite", str(tmp_path)]) == 2
    assert "no <problem>/reference.py with candidate*.py beside it" in capsys.readouterr().err
