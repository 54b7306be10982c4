"""fused_ce: chunked linear + cross-entropy against the plain ``F.cross_entropy(F.linear(h, w))``.

Tolerances: in float64 both sides do the same math up to summation order, so loss and gradients
agree to ~1e-15 relative; 1e-12 is far below any real difference. In fp32 (reference ops and the
Triton kernels under the interpreter) against float64: a logit is a dot product of ``dim <= 48``
terms and the log-sum-exp a sum of ``vocab <= 1000`` exponentials, so relative errors stay below
~(48 + 1000) * 2^-24 ~ 6e-5; 2e-5 in calc_diff terms (its square-like measure) and 1e-5 relative on
the loss hold with margin, while a wrong column, row, mask or scale is off by > 1e-3.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from accel import registry
from deep_gemm import calc_diff
from fused_ce import default_chunk, linear_cross_entropy
from verifier import verify


def _case(rows_shape, dim, vocab, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(*rows_shape, dim, generator=g) * 0.5).to(dtype)
    w = (torch.randn(vocab, dim, generator=g) * 0.5).to(dtype)
    t = torch.randint(0, vocab, rows_shape, generator=g)
    t.view(-1)[::4] = -100
    return h, w, t


def _loss_and_grads(fn, h, w, t):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(h, w, t)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _plain(reduction):
    return lambda h, w, t: F.cross_entropy(F.linear(h, w).flatten(0, -2), t.flatten(), reduction=reduction)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [None, 1, 5, 1000])
def test_float64_equals_the_plain_cross_entropy(reduction, chunk):
    h, w, t = _case((3, 11), 24, 301, torch.float64, seed=chunk or 0)
    got = _loss_and_grads(lambda *a: linear_cross_entropy(*a, reduction=reduction, chunk=chunk), h, w, t)
    want = _loss_and_grads(_plain(reduction), h, w, t)
    for a, b in zip(got, want):
        assert a.dtype == torch.float64 and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("frozen", ["hidden", "weight"])
def test_a_frozen_input_gets_no_gradient_and_the_other_the_same(frozen):
    """The backward computes only the gradients asked for (a frozen head: no weight gradient, no fp32 [vocab, dim]
    accumulator); what it does compute is bit-equal to the full backward's."""
    h, w, t = _case((13,), 24, 301, torch.float32, seed=7)
    _, want_h, want_w = _loss_and_grads(lambda *a: linear_cross_entropy(*a, chunk=5), h, w, t)
    h = h.clone().requires_grad_(frozen != "hidden")
    w = w.clone().requires_grad_(frozen != "weight")
    linear_cross_entropy(h, w, t, chunk=5).backward()
    assert (h.grad is None) == (frozen == "hidden") and (w.grad is None) == (frozen == "weight")
    assert torch.equal(w.grad, want_w) if frozen == "hidden" else torch.equal(h.grad, want_h)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_fp32_matches_float64(impl):
    h, w, t = _case((2, 20), 48, 1000, torch.float32, seed=7)
    with registry.force(impl):
        loss, gh, gw = _loss_and_grads(lambda *a: linear_cross_entropy(*a, chunk=6), h, w, t)
    want = _loss_and_grads(_plain("mean"), h.double(), w.double(), t)
    assert abs(loss.double() - want[0]) <= 1e-5 * want[0].abs()
    assert calc_diff(gh, want[1]) < 2e-5 and calc_diff(gw, want[2]) < 2e-5


def test_bf16_follows_the_plain_bf16_path():
    """bf16 hidden/weight: logits from a bf16 GEMM, then fp32, their gradient cast back to bf16 for the
    gradient GEMMs, as autograd does for ``F.linear(h, w).float()``. Loss equal to fp32 rounding of the
    same bf16 logits (rows are computed in chunks, so the GEMM may round differently: 2^-8 relative per
    logit, averaged over 40 rows); gradients within bf16 rounding (calc_diff ~1e-5) of the plain path."""
    h, w, t = _case((40,), 64, 500, torch.bfloat16, seed=3)
    loss, gh, gw = _loss_and_grads(lambda *a: linear_cross_entropy(*a, chunk=7), h, w, t)
    want = _loss_and_grads(_plain("mean"), h, w, t)
    assert gh.dtype == gw.dtype == torch.bfloat16
    assert abs(float(loss) - float(want[0])) <= 4e-3 * abs(float(want[0]))
    assert calc_diff(gh.float(), want[1].float()) < 1e-4 and calc_diff(gw.float(), want[2].float()) < 1e-4


def test_the_logits_are_never_all_kept():
    """What backward holds is hidden, targets and one fp32 log-sum-exp per row: no [rows, vocab] tensor."""
    h, w, t = _case((64,), 16, 512, torch.float32, seed=1)
    h.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.numel()) or x, lambda x: x):
        linear_cross_entropy(h, w, t)
    assert max(saved) < 64 * 512 and sum(saved) == 64 * 16 + 512 * 16 + 64 + 64  # hidden, weight, targets, lse
    assert default_chunk(4096, 7168, 129280) == 228  # V3: 228 x 129280 logits, no more values than hidden


@pytest.mark.parametrize("op", ["fused_ce.cross_entropy_forward", "fused_ce.cross_entropy_backward"])
def test_kernels_pass_the_verification_harness(op):
    """The harness's checks: NaN-poisoned outputs all written, inputs untouched, a Triton launch and no
    reference inside it, outputs within the VerifySpec tolerance of the reference, on fresh seeds."""
    results = verify.verify_op(op, seeds=2, bench=False)
    assert results and all(r.passed for r in results), [r.reason for r in results if not r.passed]


@pytest.mark.parametrize("call,match", [
    (lambda: linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 7), torch.zeros(4, dtype=torch.long)),
     "weight must be"),
    (lambda: linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(3, dtype=torch.long)),
     "targets must be"),
    (lambda: linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4), ), "targets must be"),
    (lambda: linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long),
                                  reduction="none"), "reduction must be"),
    (lambda: linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long),
                                  chunk=0), "chunk must be"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _compile_for_sm90() -> dict[str, int]:
    """Compile both kernels for Hopper offline (no GPU): PTX size per kernel, as the JIT would specialise
    them (fp32 / bf16 logits, int64 targets, the 1024-column block)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fused_ce import kernels

    out = {}
    for fn, logits in ((kernels._forward_kernel, "*fp32"), (kernels._backward_kernel, "*bf16")):
        names = fn.arg_names
        types = {"LOGITS": logits, "TARGETS": "*i64", "LOSS": "*fp32", "LSE": "*fp32", "SCALE": "*fp32",
                 "GRAD": "*fp32", "BLOCK": "constexpr"}
        src = ASTSource(fn=fn, signature={n: types.get(n, "i32") for n in names},
                        constexprs={(names.index("BLOCK"),): kernels.BLOCK})
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        out[fn.__name__] = len(compiled.asm["ptx"])
    return out


@pytest.mark.slow
def test_kernels_compile_for_sm90_offline():
    pytest.importorskip("triton.backends.nvidia")
    # @triton.jit chose interpreter or compiler at import: compile in a process without TRITON_INTERPRET
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tests.test_fused_ce"], cwd=Path(__file__).resolve().parent.parent,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sizes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(sizes) == {"_forward_kernel", "_backward_kernel"} and all(n > 1000 for n in sizes.values())


if __name__ == "__main__":
    print(json.dumps(_compile_for_sm90()))
