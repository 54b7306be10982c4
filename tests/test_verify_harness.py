"""verifier.verify against deliberately broken toy kernels: each fault must be caught, the correct kernel must pass.

The toy ops (tests/toy_kernels.py) are real @triton.jit kernels run by the CPU interpreter. Edge cases of
the checker itself (dtypes, shapes, integer outputs, NaN patterns, aliasing, custom compares) use plain
PyTorch "kernels" registered as the Triton implementation, which is all the harness needs to see.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from accel import registry
from accel.registry import Case, VerifySpec
from tests import toy_kernels
from verifier import fallback, verify


@pytest.fixture(scope="module")
def toys():
    names = toy_kernels.register_toys()
    yield names
    toy_kernels.unregister_toys()


@pytest.fixture
def scratch_ops():
    """Register throw-away ops under test_verify.*; all removed afterwards. Their plain-PyTorch "Triton
    implementations" launch one trivial Triton kernel first (unless launch=False), as the harness demands."""
    made = []

    def make(name, reference, impl, make_case, launch=True, **spec_kwargs):
        full = f"test_verify.{name}"
        spec_kwargs.setdefault("shapes", [{"n": 8}])
        spec_kwargs.setdefault("allow", fallback.ALLOW_ANY)  # plain PyTorch stands in for the kernel here
        if impl is not None and launch:
            impl = _with_marker_launch(impl)
        registry.register(full, reference=reference, triton=impl,
                          verify=VerifySpec(make_case=make_case, **spec_kwargs) if make_case else None)
        made.append(full)
        return full

    yield make
    for name in made:
        registry.unregister(name)


@pytest.mark.timeout(120)
def test_correct_kernel_passes_with_timings(toys):
    results = verify.verify_op("toy.axpby", seeds=5)
    assert len(results) == 5 * len(toy_kernels.SHAPES)
    assert all(r.passed and r.reason is None for r in results), verify.failures(results)
    assert len({r.seed for r in results}) == 5  # five distinct fresh seeds, reused across shapes
    for r in results:
        assert set(r.errors) == {"out"} and r.errors["out"][0] <= toy_kernels.TOLERANCE
    timed = [r for r in results if r.kernel_ms is not None]
    assert len(timed) == len(toy_kernels.SHAPES)  # one timing per shape, on its first seed
    for r in timed:
        assert r.reference_ms > 0 and r.speedup == pytest.approx(r.reference_ms / r.kernel_ms)
        seconds = r.kernel_ms * 1e-3
        assert r.tflops == pytest.approx(3.0 * r.shape["n"] / seconds / 1e12)
        assert r.gbps == pytest.approx(12.0 * r.shape["n"] / seconds / 1e9)


@pytest.mark.timeout(120)
def test_correct_in_place_kernel_passes(toys):
    results = verify.verify_op("toy.axpby_out", seeds=5, bench=False)
    assert all(r.passed for r in results), verify.failures(results)
    assert set(results[0].errors) == {"out"}  # named after the reference's parameter
    assert all(r.kernel_ms is None for r in results)  # bench=False


@pytest.mark.timeout(120)
@pytest.mark.parametrize("op, expected", [
    ("toy.wrong_result", r"^out: error [0-9.e+-]+ > tolerance 1e-06$"),
    ("toy.unwritten_output", r"^out: 1 of \d+ elements NaN/Inf where the reference is finite \(unwritten\?\)$"),
    ("toy.unwritten_out_arg", r"^out: 1 of \d+ elements NaN/Inf where the reference is finite \(unwritten\?\)$"),
    ("toy.calls_reference", r"^kernel called a reference: toy\.axpby x1"),  # n=37: no launch at all, too
    ("toy.mutates_input", r"^kernel modified its inputs: x \((\d+) of \1 elements\)$"),
    ("toy.unsupported", r"^kernel raised KernelFallbackError: .*does not support these inputs: toy kernel"),
], ids=lambda v: v.removeprefix("toy.") if v.startswith("toy.") else "")
def test_each_broken_kernel_is_caught(toys, op, expected):
    results = verify.verify_op(op, seeds=5)
    assert len(results) == 5 * len(toy_kernels.SHAPES)
    for r in results:
        assert not r.passed
        assert r.reason is not None
        assert re.search(expected, r.reason), r.reason
        assert r.kernel_ms is None  # a failing shape is not timed


def test_replayed_seeds_are_reproducible(toys):
    first = verify.verify_op("toy.wrong_result", shapes=[{"n": 50}], seeds=[11, 12], bench=False)
    again = verify.verify_op("toy.wrong_result", shapes=[{"n": 50}], seeds=[11, 12], bench=False)
    assert [r.seed for r in first] == [11, 12]
    assert [r.max_error for r in first] == [r.max_error for r in again]
    assert first[0].max_error != first[1].max_error  # different seeds, different inputs


def test_fresh_seeds():
    a, b = verify.fresh_seeds(5), verify.fresh_seeds(5)
    assert len(set(a)) == 5 and a != b  # equal only with probability ~2^-155
    with pytest.raises(ValueError, match="seeds"):
        verify.fresh_seeds(0)


# ----------------------------------------------------------------------------- checker edge cases


def _with_marker_launch(impl):
    def launching(*args, **kwargs):
        toy_kernels.launch_marker()
        return impl(*args, **kwargs)

    return launching


def test_pytorch_posing_as_triton_is_caught(scratch_ops):
    name = scratch_ops("no_launch", lambda x: x * 2, lambda x: x + x, _case_x, launch=False)
    [result] = verify.verify_op(name, seeds=1)
    assert not result.passed and result.launches == 0
    assert result.reason == "the Triton implementation launched no Triton kernel"


def test_launches_are_counted(toys):
    [result] = verify.verify_op("toy.axpby", shapes=[{"n": 1000}], seeds=1, bench=False)
    assert result.passed and result.launches == 1  # one kernel[grid](...) call, however many programs
    with verify.count_triton_launches() as launches:
        toy_kernels.launch_marker()
        toy_kernels.launch_marker()
    assert launches == [2]


def _case_x(shape, seed, device):
    return Case(args=(torch.randn(shape["n"], device=device),))


def test_dtype_and_shape_mismatch(scratch_ops):
    wrong_dtype = scratch_ops("dtype", lambda x: x * 2, lambda x: (x * 2).double(), _case_x)
    wrong_shape = scratch_ops("shape", lambda x: x * 2, lambda x: (x * 2)[:-1], _case_x)
    extra = scratch_ops("extra", lambda x: x * 2, lambda x: (x * 2, x), _case_x)
    assert "out: dtype torch.float64, reference torch.float32" in verify.verify_op(wrong_dtype, seeds=1)[0].reason
    assert "out: shape (7,), reference (8,)" in verify.verify_op(wrong_shape, seeds=1)[0].reason
    assert "kernel produced ['out[0]', 'out[1]'], reference ['out']" in verify.verify_op(extra, seeds=1)[0].reason


def test_integer_outputs_must_match_exactly(scratch_ops):
    def case(shape, seed, device):
        return Case(args=(torch.randn(shape["n"], 6, device=device),))

    def off_by_one(x):
        idx = x.argmax(dim=1)
        idx[0] = (idx[0] + 1) % x.shape[1]
        return idx

    good = scratch_ops("argmax", lambda x: x.argmax(dim=1), lambda x: x.argmax(dim=1), case, tolerance=0.5)
    bad = scratch_ops("argmax_bad", lambda x: x.argmax(dim=1), off_by_one, case, tolerance=0.5)
    assert verify.verify_op(good, seeds=2)[0].passed
    result = verify.verify_op(bad, seeds=1, shapes=[{"n": 8}])[0]
    # One of eight indices differs; the float tolerance (0.5) does not apply to integers.
    assert not result.passed and result.errors["out"] == (1 / 8, 0.0)


def test_nan_positions_must_agree(scratch_ops):
    def case(shape, seed, device):
        x = torch.randn(shape["n"], device=device)
        x[::3] = float("nan")
        return Case(args=(x,))

    same = scratch_ops("nan_same", lambda x: x * 2, lambda x: x + x, case)
    hides_nan = scratch_ops("nan_hidden", lambda x: x * 2, lambda x: torch.nan_to_num(x) * 2, case)
    # NaN where the reference has NaN is right; the NaN inputs also pass the (bitwise) unchanged-input check.
    assert verify.verify_op(same, seeds=2)[0].passed
    result = verify.verify_op(hides_nan, seeds=1)[0]
    assert not result.passed and result.max_error == math.inf
    assert "NaN/Inf where the kernel has finite values" in result.reason


def test_kernel_calling_its_own_reference_is_caught(scratch_ops):
    name = "test_verify.own_reference"
    scratch_ops("own_reference", lambda x: x * 2, lambda x: registry.get(name).reference(x), _case_x)
    result = verify.verify_op(name, seeds=1)[0]
    assert not result.passed and f"kernel called a reference: {name} x1" in result.reason


def test_custom_compare_sees_named_outputs(scratch_ops):
    seen = {}

    def reference(x, out):
        out.copy_(x + 1)
        return x * 2, x * 3

    def impl(x, out):
        out.copy_(x + 1)
        return x * 2, x * 3

    def compare(got, want):
        seen["names"] = sorted(got)
        return {name: (verify.tensor_error(got[name], want[name]), 0.0) for name in want}

    def case(shape, seed, device):
        return Case(args=(torch.randn(shape["n"]), torch.randn(shape["n"])), outputs=(1,))

    name = scratch_ops("named", reference, impl, case, compare=compare)
    assert verify.verify_op(name, seeds=1)[0].passed
    assert seen["names"] == ["out", "out[0]", "out[1]"]  # in-place 'out' parameter, returned tuple


def test_setup_problems_are_reported(scratch_ops):
    def raising_case(shape, seed, device):
        raise RuntimeError("cannot build inputs")

    def bad_outputs(shape, seed, device):
        return Case(args=(torch.randn(4),), outputs=(3,))

    cases = {
        scratch_ops("no_spec", lambda x: x, lambda x: x, None): "no VerifySpec registered",
        scratch_ops("no_triton", lambda x: x, None, _case_x): "no Triton implementation",
        scratch_ops("no_shapes", lambda x: x, lambda x: x, _case_x, shapes=[]): "VerifySpec has no shapes",
        scratch_ops("case_raises", lambda x: x, lambda x: x, raising_case): "make_case failed: RuntimeError",
        scratch_ops("case_outputs", lambda x: x, lambda x: x, bad_outputs): "Case.outputs names args[3]",
        scratch_ops("not_a_case", lambda x: x, lambda x: x, lambda s, seed, d: (torch.randn(2),)):
            "expected accel.registry.Case",
        scratch_ops("ref_raises", lambda x: 1 / 0, lambda x: x, _case_x): "reference raised ZeroDivisionError",
        scratch_ops("kernel_raises", lambda x: x, lambda x: x[99], _case_x): "kernel raised IndexError",
    }
    for name, expected in cases.items():
        [result] = verify.verify_op(name, seeds=1)
        assert not result.passed and expected in result.reason, (name, result.reason)


def test_clone_case_keeps_layout_and_aliasing():
    base = torch.randn(6, 8)
    view_t = base.t()                  # non-contiguous
    window = base[1:3, 2:6]            # storage offset, shared storage with view_t
    case = Case(args=(view_t, (window, 3)), kwargs={"k": base}, outputs=())
    copy = verify.clone_case(case)
    c_t, (c_window, three), c_base = copy.args[0], copy.args[1], copy.kwargs["k"]
    assert three == 3
    assert c_t.stride() == view_t.stride() and c_window.storage_offset() == window.storage_offset()
    assert torch.equal(c_t, view_t) and torch.equal(c_window, window)
    assert c_base.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()  # a real copy
    c_base[1, 2] = 100.0  # aliasing survives: one storage behind all three copies
    assert c_window[0, 0] == 100.0 and c_t[2, 1] == 100.0 and base[1, 2] != 100.0


def test_calc_diff_and_tensor_error():
    x = torch.randn(100, dtype=torch.float64)
    assert verify.calc_diff(x, x) == pytest.approx(0.0, abs=1e-15)
    assert verify.calc_diff(2 * x, x) == pytest.approx(0.2)   # 1 - 2*2/(4+1)
    assert verify.calc_diff(-x, x) == pytest.approx(2.0)
    assert verify.calc_diff(torch.zeros(3), torch.zeros(3)) == 0.0
    inf_at_0 = x.clone()
    inf_at_0[0] = math.inf
    assert verify.tensor_error(inf_at_0, inf_at_0) == pytest.approx(0.0, abs=1e-15)
    assert verify.tensor_error(-inf_at_0, -x) == math.inf  # -inf where the reference is finite
    assert verify.tensor_error(x[:5], x) == math.inf
    assert verify.tensor_error(torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 0, 4])) == 0.25
    fp8 = torch.randn(16).to(torch.float8_e4m3fn)
    assert verify.tensor_error(fp8, fp8) == pytest.approx(0.0, abs=1e-15)


def test_report_and_strict_json(toys, tmp_path):
    results = verify.verify_op("toy.axpby", shapes=[{"n": 40}], seeds=2)
    results += verify.verify_op("toy.unwritten_output", shapes=[{"n": 40}], seeds=[5, 6])
    rows = verify.summarize(results)
    assert [(r["op"], r["seeds"], r["result"]) for r in rows] == [("toy.axpby", "2/2", "PASS"),
                                                                  ("toy.unwritten_output", "0/2", "FAIL")]
    assert rows[0]["kernel_ms"] > 0 and rows[1]["kernel_ms"] is None
    text = verify.format_report(results)
    assert "FAIL toy.unwritten_output [n=40] seeds=5,6: out: 1 of 40 elements" in text
    assert "timings here" in text  # the cpu note
    path = tmp_path / "v.json"
    verify.write_json(path, results)

    def no_constants(token):
        raise AssertionError(f"non-standard JSON constant {token}")

    doc = json.loads(path.read_text(), parse_constant=no_constants)  # no NaN/Infinity literals
    assert doc["passed"] is False and len(doc["results"]) == 4 and doc["context"]["backend"] == "cpu"
    assert doc["results"][2]["max_error"] == "inf"


def test_fp8_input_mutation_is_caught(scratch_ops):
    def case(shape, seed, device):
        return Case(args=(torch.randn(shape["n"], device=device).to(torch.float8_e4m3fn),))

    def flips_a_bit(x):
        x.view(torch.uint8)[3] ^= 1  # one mantissa bit of one element
        return x.float()

    name = scratch_ops("fp8_mutation", lambda x: x.float(), flips_a_bit, case, tolerance=1.0)
    result = verify.verify_op(name, seeds=1)[0]
    assert not result.passed and "kernel modified its inputs: x (1 of 8 elements)" in result.reason


def test_peak_percent_uses_the_nearer_roofline():
    h100 = "NVIDIA H100 80GB HBM3"  # 989 bf16 / 1979 fp8 TFLOP/s, 3350 GB/s
    assert verify.peak_percent(494.5, None, device=h100) == pytest.approx(50.0)
    assert verify.peak_percent(494.75, None, fp8=True, device=h100) == pytest.approx(25.0)
    assert verify.peak_percent(98.9, 2680.0, device=h100) == pytest.approx(80.0)  # memory-bound: 80% of HBM
    assert verify.peak_percent(1.0, 1.0, device="cpu") is None
    assert verify.peak_percent(None, None, device=h100) is None


def test_a_wrong_tile_cannot_hide_in_a_large_output(scratch_ops):
    def case(shape, seed, device):
        return Case(args=(torch.randn(shape["n"], shape["n"], device=device),))

    def one_bad_tile(x):
        out = x * 2
        out[64:72, 128:136] = 0.0  # one 8x8 tile left at zero: 64 of 65536 elements
        return out

    name = scratch_ops("bad_tile", lambda x: x * 2, one_bad_tile, case, shapes=[{"n": 256}], tolerance=1e-3)
    [result] = verify.verify_op(name, seeds=[3])
    torch.manual_seed(3)
    x = torch.randn(256, 256)
    assert verify.calc_diff(one_bad_tile(x), x * 2) < 1e-3  # a global calc_diff alone would let it pass
    assert not result.passed and result.max_error > 1e-2  # the tile's block (1/64 of the tensor) exposes it


def test_blockwise_diff_matches_calc_diff_for_uniform_errors():
    want = torch.randn(300, 200, dtype=torch.float64)
    got = want * (1 + 1e-4 * torch.randn_like(want))
    assert verify.blockwise_diff(got, want) == pytest.approx(verify.calc_diff(got, want), rel=0.5)
    near_zero = want.clone()
    near_zero[:40] = 0.0
    tiny_noise = near_zero.clone()
    tiny_noise[:40] = 1e-12  # absolute noise where the reference is exactly zero: not a failure
    assert verify.blockwise_diff(tiny_noise, near_zero) < 1e-18


def test_bad_arguments_name_themselves(toys):
    with pytest.raises(ValueError, match="shapes: expected a list of dicts"):
        verify.verify_op("toy.axpby", shapes={"n": 4})
    with pytest.raises(ValueError, match="seeds"):
        verify.verify_op("toy.axpby", seeds=[])
    with pytest.raises(ValueError, match="seeds"):
        verify.verify_op("toy.axpby", seeds=0)
    with pytest.raises(KeyError, match="no kernel op named 'toy.nope'"):
        verify.verify_op("toy.nope")
    assert verify.select_ops("toy.axpby*") == ["toy.axpby", "toy.axpby_out"]  # one glob as a plain string
    assert verify.select_ops(["toy.wrong_*", "toy.unsupported"]) == ["toy.unsupported", "toy.wrong_result"]
