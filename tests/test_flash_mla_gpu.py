"""flash_mla on a real GPU (skipped without one): realistic shapes, compiled kernels, against the references.

Run with ``TRITON_INTERPRET=0`` (the suite's conftest defaults it to 1): ``benchmarks/gpu_check.d/flash_mla.sh``.
"""

import pytest
import torch

import accel
import flash_mla
from accel import registry
from flash_mla.attention import mla_attention_reference
from flash_mla.decode import compare_decode, flash_mla_with_kvcache_reference, make_paged_case
from verifier.verify import calc_diff

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.mark.parametrize("s_q,h_q,fp8,varlen", [(1, 128, False, True), (2, 64, False, False), (1, 128, True, True),
                                                (2, 16, True, False)])
def test_decode_matches_reference_on_gpu(s_q, h_q, fp8, varlen):
    device = accel.default_device()
    g = torch.Generator().manual_seed(s_q * 1000 + h_q)
    seqlens = [0, 5, 4096, 3000, 8000, 64, 1, 2049] if varlen else [4096] * 8
    q, cache, table, lens = make_paged_case(8, s_q, h_q, 1, seqlens, fp8, g, device)
    meta, splits = flash_mla.get_mla_metadata(lens, s_q * h_q, 1)
    args = (q, cache, table, lens, 512, meta, splits)
    with registry.force("triton"), registry.poisoned_outputs():
        got = flash_mla.flash_mla_with_kvcache(*args, causal=s_q > 1, is_fp8_kvcache=fp8)
    want = flash_mla_with_kvcache_reference(*args, causal=s_q > 1, is_fp8_kvcache=fp8)
    # FlashMLA's pass marks (out cosine diff < 1e-5, lse relative < 1e-5, same Inf/NaN positions)
    for name, (err, tol) in compare_decode(got, want).items():
        assert err < tol, f"{name}: {err} >= {tol}"


@pytest.mark.parametrize("dqk,dv,varlen", [(192, 128, False), (48, 32, False), (192, 128, True)])
def test_training_attention_matches_reference_on_gpu(dqk, dv, varlen):
    device = accel.default_device()
    lens = [700, 1, 1024, 300] if varlen else None
    lead = (sum(lens),) if varlen else (2, 1024)
    kw = {}
    if varlen:
        kw = {"cu_seqlens": torch.tensor([0, *lens], device=device).cumsum(0).to(torch.int32), "max_seqlen": max(lens)}
    q, k = (torch.randn(*lead, 8, dqk, device=device, dtype=torch.bfloat16) for _ in range(2))
    v, dout = (torch.randn(*lead, 8, dv, device=device, dtype=torch.bfloat16) for _ in range(2))

    def grads(fn):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, causal=True, **kw)
        return (out, *torch.autograd.grad(out, leaves, dout))

    with registry.force("triton"), registry.poisoned_outputs():
        got = grads(flash_mla.mla_attention)
    want = grads(mla_attention_reference)
    # bf16 P and dS feed the tensor cores (the fp32 reference keeps them exact): cos diff ~1e-5 at most
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert calc_diff(a, b) < 1e-4, f"{name}: {calc_diff(a, b)}"
