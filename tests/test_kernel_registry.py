"""accel.registry: which implementation an op runs, strict mode, forcing, Unsupported fall-backs, logging
once, reference call counting and NaN-poisoned outputs."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

import accel
from accel import registry
from accel.registry import KernelFallbackError, Unsupported
from tests import toy_kernels

OP = "test_registry.axpby"


def _reference(x, y, alpha, beta):
    return alpha * x + beta * y


@pytest.fixture
def auto(monkeypatch):
    """Automatic selection, not strict, the interpreter on; a toy op with a real Triton kernel."""
    monkeypatch.setenv("DSV3_KERNEL_IMPL", "auto")
    monkeypatch.delenv("DSV3_STRICT_KERNELS", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    accel.reset()
    op = registry.register(OP, reference=_reference, triton=toy_kernels.TOYS["toy.axpby"][1])
    yield monkeypatch, op
    registry.unregister(OP)
    accel.reset()


def _inputs(n=300):
    return torch.randn(n), torch.randn(n), 1.5, -0.5


def test_triton_runs_under_the_interpreter(auto):
    _, op = auto
    x, y, a, b = _inputs()
    calls = registry.reference_call_count(OP)
    out = op(x, y, a, b)
    assert op.last_impl == "triton" and op.last_reason is None
    assert registry.reference_call_count(OP) == calls  # the reference did not run
    # fp32 elementwise a*x+b*y: same roundings in kernel and reference (an FMA moves the last bit at most).
    torch.testing.assert_close(out, a * x + b * y, rtol=1e-6, atol=1e-6)
    assert registry.implementation(OP, torch.device("cpu")) == "triton"
    assert registry.report(torch.device("cpu"))[OP] == {"impl": "triton", "reason": None}


def test_fallback_without_interpreter_is_logged_once(auto, caplog):
    monkeypatch, op = auto
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, y, a, b = _inputs()
    with caplog.at_level(logging.INFO, logger="accel.kernels"):
        for _ in range(3):
            out = op(x, y, a, b)
    assert op.last_impl == "reference" and "TRITON_INTERPRET" in op.last_reason
    torch.testing.assert_close(out, a * x + b * y, rtol=0, atol=0)  # it is the reference itself
    records = [r.getMessage() for r in caplog.records if OP in r.getMessage()]
    assert len(records) == 1 and "-> reference" in records[0] and "TRITON_INTERPRET" in records[0]
    assert registry.report(torch.device("cpu"))[OP]["impl"] == "reference"


def test_fallback_on_a_gpu_is_a_warning(auto, caplog):
    monkeypatch, op = auto
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(registry, "_current_backend", lambda: "cuda")  # cpu tensors on a GPU machine
    with caplog.at_level(logging.INFO, logger="accel.kernels"):
        op(*_inputs())
    [record] = [r for r in caplog.records if OP in r.getMessage()]
    assert record.levelno == logging.WARNING and "-> reference" in record.getMessage()


def test_strict_mode_without_interpreter_errors(auto):
    monkeypatch, op = auto
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("DSV3_STRICT_KERNELS", "1")
    calls = registry.reference_call_count(OP)
    with pytest.raises(KernelFallbackError) as info:
        op(*_inputs())
    message = str(info.value)
    assert OP in message and "DSV3_STRICT_KERNELS=1" in message and "TRITON_INTERPRET" in message
    assert registry.reference_call_count(OP) == calls  # no silent reference run before the error
    assert registry.report(torch.device("cpu"))[OP]["impl"] == "error"


def test_strict_mode_without_triton_package_errors(auto):
    monkeypatch, op = auto
    monkeypatch.setenv("DSV3_STRICT_KERNELS", "1")
    monkeypatch.setattr(registry, "_TRITON_INSTALLED", False)  # as without the package (looked up once, at import)
    with pytest.raises(KernelFallbackError, match=rf"{OP}.*'triton' package is not installed"):
        op(*_inputs())


def test_requested_triton_errors_name_the_switch(auto):
    monkeypatch, op = auto
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("DSV3_KERNEL_IMPL", "triton")
    with pytest.raises(KernelFallbackError, match="DSV3_KERNEL_IMPL=triton"):
        op(*_inputs())
    monkeypatch.setenv("DSV3_KERNEL_IMPL", "auto")
    with registry.force("triton"), pytest.raises(KernelFallbackError, match=r"registry\.force\('triton'\)"):
        op(*_inputs())


def test_forced_reference_is_a_choice_not_a_fallback(auto):
    monkeypatch, op = auto
    monkeypatch.setenv("DSV3_STRICT_KERNELS", "1")
    calls = registry.reference_call_count(OP)
    with registry.force("reference"):
        op(*_inputs())
    assert op.last_impl == "reference" and op.last_reason is None
    assert registry.reference_call_count(OP) == calls + 1


def test_force_nests_restores_and_is_per_thread(auto):
    _, op = auto
    seen = {}
    with registry.force("reference"):
        with registry.force("triton"):
            assert registry.requested_impl() == "triton"
        assert registry.requested_impl() == "reference"
        thread = threading.Thread(target=lambda: seen.setdefault("other", registry.requested_impl()))
        thread.start()
        thread.join()
    assert registry.requested_impl() == "auto"
    assert seen["other"] == "auto"  # another thread is not forced


def test_bad_selection_names_the_choices(auto):
    monkeypatch, _ = auto
    with pytest.raises(ValueError, match="auto, triton, reference"):
        with registry.force("cuda"):
            pass
    monkeypatch.setenv("DSV3_KERNEL_IMPL", "fast")
    with pytest.raises(ValueError, match="DSV3_KERNEL_IMPL='fast'"):
        registry.requested_impl()


def test_unsupported_inputs_fall_back_or_error(auto):
    monkeypatch, _ = auto

    def picky(x, y, alpha, beta):
        if x.numel() % 2:
            raise Unsupported(f"n={x.numel()} must be even")
        return toy_kernels.TOYS["toy.axpby"][1](x, y, alpha, beta)

    op = registry.register(OP, reference=_reference, triton=picky)
    op(*_inputs(300))
    assert op.last_impl == "triton"
    out = op(*_inputs(301))
    assert out.shape == (301,)
    assert op.last_impl == "reference" and "n=301 must be even" in op.last_reason
    monkeypatch.setenv("DSV3_STRICT_KERNELS", "1")
    with pytest.raises(KernelFallbackError, match=rf"{OP}.*does not support these inputs: n=301 must be even"):
        op(*_inputs(301))


def test_op_without_triton(auto):
    monkeypatch, _ = auto
    op = registry.register(OP, reference=_reference)
    op(*_inputs())
    assert op.last_impl == "reference" and op.last_reason == "no Triton implementation"
    monkeypatch.setenv("DSV3_STRICT_KERNELS", "1")
    with pytest.raises(KernelFallbackError, match="no Triton implementation"):
        op(*_inputs())


def test_reference_calls_are_counted_even_when_called_directly(auto):
    _, op = auto
    before, total = registry.reference_call_count(OP), registry.reference_call_count()
    op.reference(*_inputs())  # register() wrapped the plain function
    assert registry.reference_call_count(OP) == before + 1
    assert registry.reference_call_count() == total + 1
    assert registry.reference_call_counts()[OP] == before + 1

    @registry.reference_for("test_registry.decorated")
    def decorated(x):
        return x

    decorated(1)
    assert registry.reference_call_count("test_registry.decorated") >= 1
    assert decorated.__reference_op__ == "test_registry.decorated"


def test_unknown_op_lists_registered(auto):
    with pytest.raises(KeyError, match=OP):
        registry.get("test_registry.nope")
    with pytest.raises(KeyError):
        registry.unregister("test_registry.nope")
    assert OP in registry.ops()


@pytest.mark.parametrize("dtype, check", [
    (torch.float32, lambda t: torch.isnan(t).all()),
    (torch.bfloat16, lambda t: torch.isnan(t).all()),
    (torch.float8_e4m3fn, lambda t: torch.isnan(t.float()).all()),
    (torch.int32, lambda t: (t == torch.iinfo(torch.int32).max).all()),
    (torch.int64, lambda t: (t == torch.iinfo(torch.int64).max).all()),
    (torch.bool, lambda t: t.all()),
])
def test_empty_is_poisoned_only_inside_the_block(dtype, check):
    with registry.poisoned_outputs():
        t = registry.empty(3, 5, dtype=dtype, device="cpu")
        u = registry.empty((2, 4), dtype=dtype, device="cpu")
    assert t.shape == (3, 5) and u.shape == (2, 4) and t.dtype == dtype
    assert check(t) and check(u)
    with registry.poisoned_outputs():
        pass
    assert registry.empty(4, dtype=dtype, device="cpu").shape == (4,)


def test_import_kernel_packages_reports_errors(tmp_path, monkeypatch):
    (tmp_path / "broken_kernels_pkg").mkdir()
    (tmp_path / "broken_kernels_pkg" / "__init__.py").write_text("import a_dependency_that_is_missing_xyz\n")
    (tmp_path / "raising_kernels_pkg").mkdir()
    (tmp_path / "raising_kernels_pkg" / "__init__.py").write_text("raise RuntimeError('bad kernel config')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    status = registry.import_kernel_packages(["no_such_kernel_pkg_xyz", "broken_kernels_pkg", "raising_kernels_pkg"])
    assert status["no_such_kernel_pkg_xyz"] == "not installed"
    assert "a_dependency_that_is_missing_xyz" in status["broken_kernels_pkg"]  # not swallowed
    assert status["raising_kernels_pkg"] == "RuntimeError: bad kernel config"
    monkeypatch.setattr(registry, "KERNEL_PACKAGES", ("no_such_kernel_pkg_xyz",))
    assert registry.load_all() == registry.ops()  # an absent package is fine
    monkeypatch.setattr(registry, "KERNEL_PACKAGES", ("raising_kernels_pkg",))
    with pytest.raises(ImportError, match="raising_kernels_pkg: RuntimeError: bad kernel config"):
        registry.load_all()
