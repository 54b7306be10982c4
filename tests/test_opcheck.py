"""Every kernel op's ``torch.ops.dsv3`` front passes ``torch.library.opcheck`` (schema, fake tensor, autograd
registration, AOT dispatch), generic over ``accel.registry``: the cases are each op's own verification cases
(``VerifySpec.make_case``, all its interpreter shapes, one seed each; the AOT-dispatch trace, the costly check, on
the first) on the CPU, where the op's body runs the PyTorch reference; once more per op with the Triton kernel in
its interpreter for the checks that run the op eagerly (the fake and AOT checks trace the body, which the
interpreter cannot run on fake tensors)."""

from __future__ import annotations

import pytest
import torch

from accel import registry

registry.load_all()

# Ops not yet fronted by a custom op (issue 35, item 1): whoever converts one removes it here.
EXPECTED_MISSING_PACKAGES = ()
CONVERTED_PACKAGES = ("deep_gemm", "flash_mla", "fused_ce", "fused_ops")
_OPS = [name for name in registry.ops() if registry.get(name).custom_op is not None]


def _cases(name: str, seeds=(0,)):
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
            assert getattr(torch.ops.dsv3, short).default.name() == f"dsv3::{short}", name
    stale = [p for p in EXPECTED_MISSING_PACKAGES
             if any(n.split(".")[0] == p for n in names) and not any(n.split(".")[0] == p for n in missing)]
    assert not stale, f"{stale}: every op converted; move the package to CONVERTED_PACKAGES"


AOT = "test_aot_dispatch_dynamic"
ALL_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", AOT)


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among the arguments, those in a list argument (an FP8 ``[values, scales]`` pair) included."""
    flat = [*args, *kwargs.values()]
    return [t for v in flat for t in (v if isinstance(v, (list, tuple)) else (v,)) if isinstance(t, torch.Tensor)]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).clone() if t.element_size() == 1 else t.detach().clone()


def _schema_check_fp8(op, args: tuple, kwargs: dict) -> None:
    """opcheck's schema check for a call with FP8 inputs, which torch's SchemaCheckMode cannot compare (no FP8
    equality kernel): the op writes none of its inputs the schema does not declare written (their bytes; NaN
    where NaN was) and returns no alias of one."""
    schema = getattr(op, "_opoverload", op)._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    bound = {**dict(zip([a.name for a in schema.arguments], args)), **kwargs}
    kept = {n: _tensors((v,), {}) for n, v in bound.items() if n not in written}
    before = {n: [_bytes(t) for t in ts] for n, ts in kept.items()}
    out = op(*args, **kwargs)
    for n, ts in kept.items():
        for t, b in zip(ts, before[n], strict=True):
            now = _bytes(t)
            assert torch.equal(now, b) or (now.is_floating_point() and torch.equal(now.isnan(), b.isnan())), (op, n)
    ptrs = {t.untyped_storage().data_ptr() for t in _tensors(args, kwargs) if t.numel()}
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None]
    assert not any(o.numel() and o.untyped_storage().data_ptr() in ptrs for o in outs), f"{op} aliases an input"


def _fp8(tensors) -> bool:
    return any(t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for t in tensors)


def _opcheck(kernel: registry.KernelOp, args: tuple, kwargs: dict, checks=ALL_CHECKS) -> None:
    if _fp8(_tensors(args, kwargs)):
        _schema_check_fp8(kernel.custom_op, args, kwargs)
        checks = tuple(c for c in checks if c != "test_schema")
    torch.library.opcheck(kernel.custom_op, args, kwargs, test_utils=tuple(c for c in checks if c != AOT))
    if AOT in checks:
        out = kernel.custom_op(*args, **kwargs)
        if _fp8(t for t in (out if isinstance(out, tuple) else (out,)) if t is not None):
            # opcheck's AOT check sums every output for its backward, and FP8 has no sum kernel: forward only here
            # (the op's autograd is the non-FP8 sibling's, checked with gradients there: rmsnorm_fp8 -> rmsnorm)
            args, kwargs = _detached(args), {k: v for k, v in zip(kwargs, _detached(tuple(kwargs.values())))}
        torch.library.opcheck(kernel.custom_op, args, kwargs, test_utils=(AOT,))


def _detached(values: tuple) -> tuple:
    return tuple(v.detach() if isinstance(v, torch.Tensor) else v for v in values)


@pytest.mark.parametrize("name", _OPS)
def test_opcheck_reference(name):
    kernel = registry.get(name)
    with registry.force("reference"):
        for i, case in enumerate(_cases(name)):  # the AOT trace (the costly check) on the first shape
            _opcheck(kernel, *_with_grad(kernel, case.args, case.kwargs), ALL_CHECKS if i == 0 else ALL_CHECKS[:3])


@pytest.mark.slow
@pytest.mark.parametrize("name", _OPS)
def test_opcheck_triton_interpreted(name):
    kernel = registry.get(name)
    if registry.triton_unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip(registry.triton_unavailable_reason(torch.device("cpu")))
    gap = kernel.verify.interpreter_gap() if kernel.verify and kernel.verify.interpreter_gap else None
    if gap:
        pytest.skip(gap)
    case = next(_cases(name, seeds=(2,)))
    args, kwargs = _with_grad(kernel, case.args, case.kwargs)
    with registry.force("triton"):
        _opcheck(kernel, args, kwargs, ALL_CHECKS[:3])
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
    for need in ((True, True), (False, True), (True, False)):  # a frozen input's gradient is not computed
        torch.library.opcheck(torch.ops.dsv3.linear_cross_entropy_backward.default,
                              (torch.tensor(0.5), hidden.detach(), weight.detach(), targets, lse, -100, reduction,
                               chunk, *need))


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
            _schema_check_fp8(op, args, {})
            torch.library.opcheck(op, args, test_utils=ALL_CHECKS[1:])
        else:
            torch.library.opcheck(op, args)
