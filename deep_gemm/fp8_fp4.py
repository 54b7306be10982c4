"""``m_grouped_fp8_fp4_gemm_nt_contiguous``: the MoE experts' GEMM of DeepSeek-V4 inference and FP4 training, FP8
activations (MXFP8: E4M3 with a UE8M0 scale per 1x32; or DeepSeek-V3's blockwise cast, an fp32 scale per 1x128,
as the model's routed experts take them under ``fp8_recipe = "blockwise"``) times MXFP4 weights
(``deep_gemm.mxfp4``'s released layout: two E2M1 per byte, an E8M0 scale per 32 along K), in the contiguous
grouped layout of
``m_grouped_fp8_gemm_nt_contiguous`` (rows of group g marked g in ``m_indices``, -1 padding rows untouched).

Kernel: ``deep_gemm.kernels.fp8_fp4`` (``tl.dot_scaled``: tcgen05 block-scaled MMA on sm_100a, a dequantising
upcast on sm_90a); the reference dequantises both operands and multiplies in fp32. Scales are one byte per 32
(``float8_e8m0fnu`` or ``uint8``), not DeepGEMM's packed int32 words.
"""

from __future__ import annotations

import torch

from accel import registry
from accel.registry import Case, VerifySpec
from deep_gemm.cast import per_token_cast_to_fp8
from deep_gemm.grouped import _group_sizes, _no_fake, check_m_indices, contiguous_layout
from deep_gemm.mxfp4 import pack_mxfp4, unpack_mxfp4
from deep_gemm.utils import FP8, MX_BLOCK, dot_scaled_interpreter_gap

K_ALIGN = 128  # the kernel's K step (four 32-blocks)
_SCALE = (torch.uint8, torch.float8_e8m0fnu)


def cast_mxfp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 rows: e4m3 ``x / 2^e`` and uint8 ``e + 127`` per 1x32 block, ``e = floor(log2(amax)) - 8`` (E4M3's
    largest exponent, the OCP MX rule), all-zero blocks at -127."""
    m, k = x.shape
    blocks = x.float().view(m, k // MX_BLOCK, MX_BLOCK)
    amax = blocks.abs().amax(-1)
    e = (torch.frexp(amax)[1] - 1 - 8).clamp(-127, 127)
    e = torch.where(amax == 0, -127, e)
    q = torch.ldexp(blocks, -e.unsqueeze(-1).float()).clamp(-448, 448).to(FP8).view(m, k)
    return q, (e + 127).to(torch.uint8)


def _dequant_rows(a: torch.Tensor, sa: torch.Tensor) -> torch.Tensor:
    """The rows' values in fp32: e4m3 times 2^(byte - 127) per 1x32, or times the fp32 scale per 1x128."""
    m, k = a.shape
    if sa.dtype == torch.float32:
        return (a.float().view(m, k // K_ALIGN, K_ALIGN) * sa.unsqueeze(-1)).view(m, k)
    e = sa.view(torch.uint8).float() - 127
    return torch.ldexp(a.float().view(m, k // MX_BLOCK, MX_BLOCK), e.unsqueeze(-1)).view(m, k)


def _check(a, b, d, m_indices) -> None:
    if not (isinstance(a, (tuple, list)) and len(a) == 2 and isinstance(b, (tuple, list)) and len(b) == 2):
        raise ValueError("m_grouped_fp8_fp4_gemm_nt_contiguous: a and b must be (values, scales) pairs")
    (x, sa), (w, sb) = a, b
    if x.dtype != FP8 or x.dim() != 2 or x.shape[1] % K_ALIGN:
        raise ValueError(f"a: expected float8_e4m3fn [M, K] with K a multiple of {K_ALIGN}, got {x.dtype} "
                         f"{tuple(x.shape)}")
    m, k = x.shape
    mx_scales = sa.dtype in _SCALE and tuple(sa.shape) == (m, k // MX_BLOCK)
    if not (mx_scales or (sa.dtype == torch.float32 and tuple(sa.shape) == (m, k // K_ALIGN))):
        raise ValueError(f"a's scales: expected uint8/float8_e8m0fnu [{m}, {k // MX_BLOCK}] (MXFP8, 1x32) or float32 "
                         f"[{m}, {k // K_ALIGN}] (1x128), got {sa.dtype} {tuple(sa.shape)}")
    if w.dtype not in (torch.int8, torch.uint8) or w.dim() != 3 or w.shape[2] * 2 != k:
        raise ValueError(f"b: expected MXFP4 int8 [G, N, {k // 2}] (two e2m1 per byte), got {w.dtype} {tuple(w.shape)}")
    g, n = w.shape[:2]
    if sb.dtype not in _SCALE or tuple(sb.shape) != (g, n, k // MX_BLOCK):
        raise ValueError(f"b's scales: expected uint8/float8_e8m0fnu [{g}, {n}, {k // MX_BLOCK}], got {sb.dtype} "
                         f"{tuple(sb.shape)}")
    if not isinstance(d, torch.Tensor) or tuple(d.shape) != (m, n) or d.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"d: expected bfloat16/float32 [{m}, {n}], got {getattr(d, 'dtype', type(d).__name__)} "
                         f"{tuple(getattr(d, 'shape', ()))}")
    check_m_indices(m_indices, m, g)


@registry.reference_for("deep_gemm.m_grouped_fp8_fp4_gemm_nt_contiguous")
def m_grouped_fp8_fp4_gemm_nt_contiguous_reference(a, b, d, m_indices):
    """fp32 product of the dequantised operands, group by group; -1 rows untouched."""
    x = _dequant_rows(*a)
    w, sb = b
    for g in range(w.shape[0]):
        rows = torch.nonzero(m_indices == g).squeeze(1)
        if rows.numel():
            d[rows] = (x[rows] @ unpack_mxfp4(w[g], sb[g], dtype=torch.float32).T).to(d.dtype)
    return d


def _make_case(shape: dict, seed: int, device: torch.device) -> Case:
    gen = torch.Generator().manual_seed(seed)
    groups, n, k = shape["groups"], shape["n"], shape["k"]
    m_indices = contiguous_layout(_group_sizes(gen, groups, shape["m_per_group"]), device)
    x = torch.randn(m_indices.numel(), k, generator=gen) * (m_indices.cpu() >= 0).unsqueeze(1)
    w = torch.randn(groups, n, k, generator=gen)
    a = tuple(t.to(device) for t in (per_token_cast_to_fp8(x) if shape.get("a_fp32") else cast_mxfp8_rows(x)))
    b = tuple(t.to(device) for t in pack_mxfp4(w))
    d = torch.full((m_indices.numel(), n), float("nan"), dtype=torch.bfloat16, device=device)
    return Case(args=(a, b, d, m_indices), outputs=(2,))


_op = registry.register(
    "deep_gemm.m_grouped_fp8_fp4_gemm_nt_contiguous", reference=m_grouped_fp8_fp4_gemm_nt_contiguous_reference,
    triton="deep_gemm.kernels.fp8_fp4:m_grouped_fp8_fp4_contiguous",
    # 1e-5: the same exact products (e4m3 x e2m1 x powers of two are fp32 numbers); fp32 summation order only
    verify=VerifySpec(make_case=_make_case, shapes=[dict(groups=2, m_per_group=100, n=48, k=128),
                                                    dict(groups=3, m_per_group=60, n=40, k=256),
                                                    dict(groups=2, m_per_group=70, n=40, k=256, a_fp32=True)],
                      bench_shapes=[dict(groups=8, m_per_group=4096, n=4096, k=7168)], tolerance=1e-5,
                      flops=lambda s: 2.0 * s["groups"] * s["m_per_group"] * s["n"] * s["k"],
                      bytes_moved=lambda s: float(s["groups"] * (s["m_per_group"] * s["k"] + s["n"] * s["k"] / 2
                                                                 + 2 * s["m_per_group"] * s["n"])), fp8=True,
                      interpreter_gap=dot_scaled_interpreter_gap))


# opaque: the reference reads the group layout on the host (as the other m-grouped GEMMs, deep_gemm.grouped)
@registry.torch_op(_op, mutates_args=("d",), fake=_no_fake, opaque=True)
def _fp8_fp4_op(a: list[torch.Tensor], b: list[torch.Tensor], d: torch.Tensor, m_indices: torch.Tensor) -> None:
    _op(tuple(a), tuple(b), d, m_indices)


def m_grouped_fp8_fp4_gemm_nt_contiguous(a, b, d: torch.Tensor, m_indices: torch.Tensor) -> torch.Tensor:
    """``d[r] = a[r] @ b[m_indices[r]]^T`` for FP8 rows ``a = (e4m3 [M, K], UE8M0 [M, K/32])`` (MXFP8) or ``(e4m3
    [M, K], fp32 [M, K/128])`` (DeepSeek-V3's blockwise activation cast, ``per_token_cast_to_fp8``) and MXFP4 weights
    ``b = (int8 [G, N, K/2], E8M0 [G, N, K/32])`` (``pack_mxfp4``); rows with ``m_indices = -1`` untouched."""
    _check(a, b, d, m_indices)
    _fp8_fp4_op(list(a), list(b), d, m_indices.to(torch.int32).contiguous())
    return d
