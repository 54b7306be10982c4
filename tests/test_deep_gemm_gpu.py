"""deep_gemm's compiled Triton kernels on a real GPU at DeepSeek-V3 shapes (skipped without a GPU).

Same rules as on the CPU: calc_diff against the fp32 product of the unquantized inputs below
``tests.tolerances.fp8_calc_diff_bound`` (two e4m3 casts per GEMM, three for the Linear's wgrad; every
compared tensor here has >= 64 x 2112 outputs: ~1.4e-3 and ~2.1e-3; DeepGEMM's own 1e-3 is the Gaussian-input
case of the same formula) and < 1e-5 against the reference on the same FP8 inputs; outputs NaN-poisoned first,
skipped rows must stay NaN.
"""

import pytest
import torch

import accel
import deep_gemm
from accel import registry
from deep_gemm import calc_diff
from deep_gemm.grouped import contiguous_layout
from tests.tolerances import fp8_calc_diff_bound

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

QUANT_TOL, SAME_INPUT_TOL = fp8_calc_diff_bound(casts=2, reduction=7168, samples=64 * 2112), 1e-5
WGRAD_TOL = fp8_calc_diff_bound(casts=3, reduction=2048, samples=2048 * 1536)


@pytest.fixture
def dev():
    return accel.default_device()


def _nan(*shape, dtype=torch.bfloat16, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


@pytest.mark.parametrize("m,n,k", [(64, 2112, 7168), (4096, 7168, 2048), (129, 24576, 1536), (4096, 4096, 7168)])
def test_dense_nt_deepseek_shapes(dev, m, n, k):
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    with registry.force("triton"):
        a_q, b_q = deep_gemm.per_token_cast_to_fp8(a), deep_gemm.per_block_cast_to_fp8(b)
        d = deep_gemm.fp8_gemm_nt(a_q, b_q, _nan(m, n, device=dev))
    assert not torch.isnan(d).any()
    assert calc_diff(d, a.float() @ b.float().T) < QUANT_TOL
    with registry.force("reference"):
        ref = deep_gemm.fp8_gemm_nt(a_q, b_q, _nan(m, n, device=dev))
    assert calc_diff(d, ref) < SAME_INPUT_TOL


@pytest.mark.parametrize("kind", ["nn", "tn"])
def test_dgrad_and_wgrad_layouts(dev, kind):
    m, n, k = 4096, 2048, 7168
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    with registry.force("triton"):
        if kind == "nn":
            ops = (deep_gemm.per_token_cast_to_fp8(a), deep_gemm.per_block_cast_to_fp8(b.T.contiguous()))
            d = deep_gemm.fp8_gemm_nn(*ops, _nan(m, n, device=dev))
        else:
            ops = (deep_gemm.per_channel_cast_to_fp8(a.T.contiguous()),
                   deep_gemm.per_channel_cast_to_fp8(b.T.contiguous()))
            d = deep_gemm.fp8_gemm_tn(*ops, _nan(m, n, dtype=torch.float32, device=dev))
    assert calc_diff(d, a.float() @ b.float().T) < QUANT_TOL


def test_grouped_contiguous_masked_and_k_grouped(dev):
    groups, n, k = 4, 4096, 7168
    m_indices = contiguous_layout([1000, 0, 1500, 700], dev)
    a = torch.randn(m_indices.numel(), k, device=dev, dtype=torch.bfloat16) * (m_indices >= 0).unsqueeze(1)
    b = torch.randn(groups, n, k, device=dev, dtype=torch.bfloat16)
    with registry.force("triton"):
        a_q, b_q = deep_gemm.per_token_cast_to_fp8(a), deep_gemm.per_block_cast_to_fp8(b)
        d = deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a_q, b_q, _nan(m_indices.numel(), n, device=dev), m_indices)
    assert torch.isnan(d[m_indices < 0]).all()
    for g in (0, 2, 3):
        rows = m_indices == g
        assert calc_diff(d[rows], a[rows].float() @ b[g].float().T) < QUANT_TOL

    masked_m = torch.tensor([128, 0, 77, 256], dtype=torch.int32, device=dev)
    a3 = torch.randn(groups, 256, k, device=dev, dtype=torch.bfloat16)
    with registry.force("triton"):
        d3 = deep_gemm.m_grouped_fp8_gemm_nt_masked(deep_gemm.per_token_cast_to_fp8(a3), b_q,
                                                    _nan(groups, 256, n, device=dev), masked_m, 128)
    for g, rows in enumerate(masked_m.tolist()):
        assert torch.isnan(d3[g, rows:]).all()
        if rows:
            assert calc_diff(d3[g, :rows], a3[g, :rows].float() @ b[g].float().T) < QUANT_TOL

    ks, mm, nn = [2048, 0, 4096], 2048, 7168
    x = torch.randn(sum(ks), mm, device=dev, dtype=torch.bfloat16)
    y = torch.randn(sum(ks), nn, device=dev, dtype=torch.bfloat16)
    c = torch.randn(len(ks), mm, nn, device=dev)
    with registry.force("triton"):
        dk = deep_gemm.k_grouped_fp8_gemm_tn_contiguous(
            deep_gemm.per_channel_cast_to_fp8(x), deep_gemm.per_channel_cast_to_fp8(y),
            _nan(len(ks), mm, nn, dtype=torch.float32, device=dev), ks,
            torch.tensor(ks, dtype=torch.int32, device=dev), c)
    torch.testing.assert_close(dk[1], c[1], rtol=0, atol=0)
    assert calc_diff(dk[0], c[0] + x[:2048].float().T @ y[:2048].float()) < QUANT_TOL
    assert calc_diff(dk[2], c[2] + x[2048:].float().T @ y[2048:].float()) < QUANT_TOL


def test_fp8_linear_training_step_on_gpu(dev, monkeypatch):
    # registry.force is thread-local and autograd runs GPU backward on its own thread: use the env.
    monkeypatch.setenv("DSV3_KERNEL_IMPL", "triton")
    torch.manual_seed(0)
    layer = deep_gemm.Fp8Linear(2048, 1536, device=dev)
    ref = torch.nn.Linear(2048, 1536, device=dev)
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(4, 512, 2048, device=dev, dtype=torch.bfloat16)
    grad = torch.randn(4, 512, 1536, device=dev)
    x1, x2 = x.clone().requires_grad_(), x.float().requires_grad_()
    layer(x1).float().backward(grad)
    assert registry.get("deep_gemm.fp8_gemm_tn").last_impl == "triton"
    ref(x2).backward(grad)
    assert calc_diff(x1.grad, x2.grad) < QUANT_TOL
    assert calc_diff(layer.weight.grad, ref.weight.grad) < WGRAD_TOL
    assert calc_diff(layer.bias.grad, ref.bias.grad) < 1e-4  # sums of bf16-rounded output grads


@pytest.mark.parametrize("kind", ["nt", "nn", "tn"])
def test_mxfp8_layouts(dev, kind):
    """MXFP8 (1x32 UE8M0 scales on both operands, tl.dot_scaled in the main loop) at a DeepSeek-V3 shape; the
    packed UE8M0 form of the same scales gives the same bits (nt)."""
    m, n, k = 4096, 2048, 7168
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=dev, dtype=torch.bfloat16)

    def mx(x, along_rows=False):
        cast = deep_gemm.per_channel_cast_to_fp8 if along_rows else deep_gemm.per_token_cast_to_fp8
        return cast(x.contiguous(), use_ue8m0=True, gran_k=32)

    with registry.force("triton"):
        if kind == "nt":
            ops = (mx(a), mx(b))
            d = deep_gemm.fp8_gemm_nt(*ops, _nan(m, n, device=dev))
            packed = tuple((t, deep_gemm.get_mn_major_tma_aligned_packed_ue8m0_tensor(s)) for t, s in ops)
            assert torch.equal(d, deep_gemm.fp8_gemm_nt(*packed, _nan(m, n, device=dev), recipe=(1, 1, 32)))
        elif kind == "nn":
            ops = (mx(a), mx(b.T, along_rows=True))
            d = deep_gemm.fp8_gemm_nn(*ops, _nan(m, n, device=dev))
        else:
            ops = (mx(a.T, along_rows=True), mx(b.T, along_rows=True))
            d = deep_gemm.fp8_gemm_tn(*ops, _nan(m, n, dtype=torch.float32, device=dev))
    assert calc_diff(d, a.float() @ b.float().T) < QUANT_TOL
    with registry.force("reference"):
        ref = getattr(deep_gemm, f"fp8_gemm_{kind}")(*ops, _nan(m, n, dtype=d.dtype, device=dev))
    assert calc_diff(d, ref) < SAME_INPUT_TOL
