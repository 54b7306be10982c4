"""Every kernel op's ``torch.ops.dsv3`` front passes ``torch.library.opcheck`` (schema, fake tensor, autograd
registration, AOT dispatch), generic over ``accel.registry``: the cases are each op's own verification cases
(``VerifySpec.make_case``, all its interpreter shapes, two seeds) on the CPU, where the op's body runs the
PyTorch reference; once more per op with the Triton kernel in its interpreter for the checks that run the op
eagerly (the fake and AOT checks trace the body, which the interpreter cannot run on fake tensors)."""

from __future__ import annotations

import pytest
import torch

from accel import registry

registry.load_all()

# Ops not yet fronted by a custom op (issue 35, item 1): whoever converts one removes it here.
EXPECTED_MISSING_PACKAGES = ("fused_ops",)
CONVERTED_PACKAGES = ("deep_gemm", "flash_mla", "fused_ce")
_OPS = [name for name in registry.ops() if registry.get(name).custom_op is not None]


def _cases(name: str, seeds=(0, 1)):
    spec = registry.get(name).verify
    for shape in spec.shapes:
        for seed in seeds:
            yield spec.make_case(shape, seed, torch.device("cpu"))


def _with_grad(kernel: registry.KernelOp, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Floating-point (non-FP8) tensors require grad when the op has an autograd: opcheck then checks it."""
    def leaf(v):
        if kernel.differentiable and isinstance(v, torch.Tensor) and v.is_floating_point() and v.element_size() > 1:
            return v.detach().clone().requires_grad_(True)
        return v

    return tuple(leaf(a) for a in args), {k: leaf(v) for k, v in kwargs.items()}


def test_every_op_of_the_converted_packages_has_a_torch_op():
    names = [n for n in registry.ops() if n.split(".")[0] in CONVERTED_PACKAGES + EXPECTED_MISSING_PACKAGES]
    missing = [n for n in names if registry.get(n).custom_op is None]
    unexpected = [n for n in missing if n.split(".")[0] not in EXPECTED_MISSING_PACKAGES]
    assert not unexpected, f"kernel ops without a torch.ops.dsv3 op: {unexpected}"
    for name in names:
        op = registry.get(name).custom_op
        if op is not None:  # named by the registry name's last part, reachable as torch.ops.dsv3.<name>
            short = name.rsplit(".", 1)[-1]
            assert getattr(torch.ops.dsv3, short).default is op._opoverload, name
    stale = [p for p in EXPECTED_MISSING_PACKAGES
             if any(n.split(".")[0] == p for n in names) and not any(n.split(".")[0] == p for n in missing)]
    assert not stale, f"{stale}: every op converted; move the package to CONVERTED_PACKAGES"


def _leaves(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    flat = [*args, *kwargs.values()]
    return [t for v in flat for t in (v if isinstance(v, (list, tuple)) else (v,)) if isinstance(t, torch.Tensor)]


def _has_fp8(args: tuple, kwargs: dict) -> bool:
    return any(t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for t in _leaves(args, kwargs))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).clone() if t.numel() else t.detach().clone()


def _check_schema_fp8(op, args: tuple, kwargs: dict) -> None:
    """What opcheck's test_schema checks, for ops with FP8 inputs: its mutation test compares each input before
    and after with ``torch.allclose``, which has no float8 kernel on the CPU. Here: every argument the schema does
    not declare written is unchanged byte for byte, and no output shares storage with an input."""
    schema = getattr(op, "_opoverload", op)._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    names = [a.name for a in schema.arguments]
    bound = {**dict(zip(names, args)), **kwargs}
    before = {n: [_bytes(t) for t in _leaves((v,), {})] for n, v in bound.items() if n not in written}
    out = op(*args, **kwargs)
    for n, saved in before.items():
        for old, new in zip(saved, _leaves((bound[n],), {})):
            assert torch.equal(old, _bytes(new)), f"{op}: argument {n} changed but the schema does not declare it"
    inputs = {t.untyped_storage().data_ptr() for t in _leaves(args, kwargs) if t.numel()}
    for t in _leaves(out if isinstance(out, tuple) else (out,), {}):
        assert not t.numel() or t.untyped_storage().data_ptr() not in inputs, f"{op}: an output aliases an input"


@pytest.mark.parametrize("name", _OPS)
def test_opcheck_reference(name):
    kernel = registry.get(name)
    with registry.force("reference"):
        for i, case in enumerate(_cases(name)):
            args, kwargs = _with_grad(kernel, case.args, case.kwargs)
            # AOT dispatch (a dynamic-shape trace, the slow check) on the first case; the others vary the shapes
            # the schema, autograd and fake checks see
            tests = ("test_autograd_registration", "test_faketensor") + (("test_aot_dispatch_dynamic",) if i == 0
                                                                           else ())
            if _has_fp8(args, kwargs):
                _check_schema_fp8(kernel.custom_op, args, kwargs)
            else:
                tests = ("test_schema", *tests)
            torch.library.opcheck(kernel.custom_op, args, kwargs, test_utils=tests)


@pytest.mark.parametrize("name", _OPS)
def test_opcheck_triton_interpreted(name):
    kernel = registry.get(name)
    if registry.triton_unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip(registry.triton_unavailable_reason(torch.device("cpu")))
    case = next(_cases(name, seeds=(2,)))
    args, kwargs = _with_grad(kernel, case.args, case.kwargs)
    eager = ("test_autograd_registration", "test_faketensor")
    with registry.force("triton"):
        if _has_fp8(args, kwargs):
            _check_schema_fp8(kernel.custom_op, args, kwargs)
        torch.library.opcheck(kernel.custom_op, args, kwargs,
                              test_utils=eager if _has_fp8(args, kwargs) else ("test_schema", *eager))
    assert kernel.last_impl == "triton"


@pytest.mark.parametrize("reduction,chunk", [("mean", 3), ("sum", 16)])
def test_opcheck_linear_cross_entropy(reduction, chunk):
    """The chunked head + loss (a composite op over the two kernel ops) and its backward op."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(7, 16, generator=g, requires_grad=True)
    weight = torch.randn(40, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 40, (7,), generator=g)
    targets[::3] = -100
    torch.library.opcheck(torch.ops.dsv3.linear_cross_entropy.default,
                          (hidden, weight, targets, -100, reduction, chunk))
    lse = torch.logsumexp(hidden.detach() @ weight.detach().T, dim=-1)
    torch.library.opcheck(torch.ops.dsv3.linear_cross_entropy_backward.default,
                          (torch.tensor(0.5), hidden.detach(), weight.detach(), targets, lse, -100, reduction, chunk))


@pytest.mark.parametrize("fp8,fp8_cache", [(None, False), ("blockwise", True), ("mxfp8", False)])
def test_opcheck_fp8_training_layers(fp8, fp8_cache):
    """deep_gemm's training layers as ops (``dsv3::linear``, ``dsv3::grouped_linear``; K and N not multiples of
    128): schema, fakes, registered autograd and AOT dispatch. Their weight gradient goes to ``accel.grads``
    outside autograd, so opcheck sees the input gradients only."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, 200, generator=g, requires_grad=True)
    weight = torch.randn(136, 200, generator=g, requires_grad=True)
    bias = torch.randn(136, generator=g, requires_grad=True)
    m_indices = torch.tensor([0] * 100 + [-1] * 28 + [2] * 128 + [1] * 5 + [-1] * 123, dtype=torch.int32)
    xg = torch.randn(384, 200, generator=g, requires_grad=True)
    wg = torch.randn(3, 136, 200, generator=g, requires_grad=True)
    for op, args in ((torch.ops.dsv3.linear.default, (x, weight, bias, fp8, fp8_cache, None, None)),
                     (torch.ops.dsv3.grouped_linear.default, (xg, wg, m_indices, fp8, fp8_cache, None, None))):
        if fp8:  # FP8 tensors inside (its casts, the kept e4m3): test_schema's allclose has no float8 kernel
            _check_schema_fp8(op, args, {})
            torch.library.opcheck(op, args, test_utils=("test_autograd_registration", "test_faketensor",
                                                        "test_aot_dispatch_dynamic"))
        else:
            torch.library.opcheck(op, args)
