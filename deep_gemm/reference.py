"""PyTorch references for every deep_gemm op: quantize or dequantize, then exact fp32 arithmetic.

They define what the Triton kernels must compute and are what runs on a CPU (tests, FP8-training
studies). The GEMM references dequantize both operands (fp8 value x its block's scale, in fp32)
and run one fp32 matmul: the same numbers as a kernel that promotes each 128-wide K block into an
fp32 accumulator, up to fp32 rounding order (calc_diff ~1e-12 on the test shapes).
Grouped references loop over groups with vectorised gathers, never over rows or K blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from accel import registry
from deep_gemm.utils import BLOCK, FP8, FP8_MAX, MX_BLOCK, ceil_div, ceil_to_ue8m0, unpack_ue8m0

AMAX_FLOOR = 1e-4  # DeepGEMM's floor: an all-zero tile gets scale 1e-4/448 instead of 0 (no 0/0)


# ---------------------------------------------------------------- casts


def cast_tiles(x: torch.Tensor, tile_rows: int, tile_cols: int, use_ue8m0: bool = False):
    """Quantize the last two dims of ``x`` to e4m3 with one fp32 scale per ``tile_rows x tile_cols`` tile.

    Returns ``(x_fp8, sf)`` with ``x_fp8`` shaped like ``x`` and ``sf`` shaped
    ``[..., ceil(rows/tile_rows), ceil(cols/tile_cols)]``; scale = amax/448 with amax floored at 1e-4.
    Partial tiles at the edges are padded with zeros for the amax only.
    """
    *batch, rows, cols = x.shape
    r_tiles, c_tiles = ceil_div(rows, tile_rows), ceil_div(cols, tile_cols)
    xf = x.float().reshape(-1, rows, cols)
    pad_r, pad_c = r_tiles * tile_rows - rows, c_tiles * tile_cols - cols
    if pad_r or pad_c:
        xf = torch.nn.functional.pad(xf, (0, pad_c, 0, pad_r))
    tiles = xf.view(-1, r_tiles, tile_rows, c_tiles, tile_cols)
    amax = tiles.abs().amax(dim=(2, 4), keepdim=True).clamp_min(AMAX_FLOOR)
    sf = amax / FP8_MAX
    if use_ue8m0:
        sf = ceil_to_ue8m0(sf)
    q = (tiles * (1.0 / sf)).to(FP8).view(-1, r_tiles * tile_rows, c_tiles * tile_cols)[:, :rows, :cols]
    return q.reshape(*batch, rows, cols).contiguous(), sf.reshape(*batch, r_tiles, c_tiles)


@registry.reference_for("deep_gemm.per_token_cast_to_fp8")
def per_token_cast_reference(x: torch.Tensor, use_ue8m0: bool = False, gran_k: int = BLOCK):
    return cast_tiles(x, 1, gran_k, use_ue8m0)


@registry.reference_for("deep_gemm.per_channel_cast_to_fp8")
def per_channel_cast_reference(x: torch.Tensor, use_ue8m0: bool = False, gran_k: int = BLOCK):
    return cast_tiles(x, gran_k, 1, use_ue8m0)


@registry.reference_for("deep_gemm.per_block_cast_to_fp8")
def per_block_cast_reference(x: torch.Tensor, use_ue8m0: bool = False):
    return cast_tiles(x, BLOCK, BLOCK, use_ue8m0)


def _tile(size: int, scales: int) -> int:
    """Elements per scale along a dim of ``size`` with ``scales`` scales: 1, 32 (MXFP8) or 128."""
    if scales == size:
        return 1
    return BLOCK if scales == ceil_div(size, BLOCK) else MX_BLOCK


def dequantize(x: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """fp32 values of ``x`` (fp8, [..., rows, cols]) under scales ``sf`` ([..., rows/gr, cols/gc]).

    The tile size is read off the shapes: a scale tensor with one row per row of ``x`` is per-row,
    one per 128 (or 32) rows is blocked, likewise along the columns. int32 scales are MXFP8's packed
    UE8M0 exponents along the last dim (four 1x32 scales per int32).
    """
    rows, cols = x.shape[-2:]
    if sf.dtype == torch.int32:
        sf = unpack_ue8m0(sf, ceil_div(cols, MX_BLOCK))
    s_rows, s_cols = sf.shape[-2:]
    tr, tc = _tile(rows, s_rows), _tile(cols, s_cols)
    xf = x.float()
    pad_r, pad_c = s_rows * tr - rows, s_cols * tc - cols
    if pad_r or pad_c:
        xf = torch.nn.functional.pad(xf, (0, pad_c, 0, pad_r))
    batch = xf.shape[:-2]
    tiles = xf.reshape(*batch, s_rows, tr, s_cols, tc) * sf.reshape(*batch, s_rows, 1, s_cols, 1)
    return tiles.reshape(*batch, s_rows * tr, s_cols * tc)[..., :rows, :cols]


# ---------------------------------------------------------------- GEMMs (D = A @ B^T [+ C])


def _write(d: torch.Tensor, value: torch.Tensor, c: torch.Tensor | None) -> torch.Tensor:
    if c is not None:
        value = value + c.float()
    d.copy_(value.to(d.dtype))
    return d


def gemm_nt_reference(a, b, d, c=None):
    """Logical ``A [M, K]`` and ``B [N, K]`` (fp8 pairs or plain tensors, any strides)."""
    a_val = dequantize(*a) if isinstance(a, tuple) else a.float()
    b_val = dequantize(*b) if isinstance(b, tuple) else b.float()
    return _write(d, a_val @ b_val.transpose(-1, -2), c)


@registry.reference_for("deep_gemm.fp8_gemm_nt")
def fp8_gemm_nt_reference(a, b, d, c=None):
    return gemm_nt_reference(tuple(a), tuple(b), d, c)


@registry.reference_for("deep_gemm.fp8_gemm_nn")
def fp8_gemm_nn_reference(a, b, d, c=None):
    return gemm_nt_reference(tuple(a), (b[0].T, b[1].T), d, c)


@registry.reference_for("deep_gemm.fp8_gemm_tn")
def fp8_gemm_tn_reference(a, b, d, c=None):
    return gemm_nt_reference((a[0].T, a[1].T), (b[0].T, b[1].T), d, c)


@registry.reference_for("deep_gemm.fp8_gemm_tt")
def fp8_gemm_tt_reference(a, b, d, c=None):
    return gemm_nt_reference((a[0].T, a[1].T), tuple(b), d, c)


@registry.reference_for("deep_gemm.bf16_gemm_nt")
def bf16_gemm_nt_reference(a, b, d, c=None):
    return gemm_nt_reference(a, b, d, c)


@registry.reference_for("deep_gemm.bf16_gemm_nn")
def bf16_gemm_nn_reference(a, b, d, c=None):
    return gemm_nt_reference(a, b.T, d, c)


@registry.reference_for("deep_gemm.bf16_gemm_tn")
def bf16_gemm_tn_reference(a, b, d, c=None):
    return gemm_nt_reference(a.T, b.T, d, c)


@registry.reference_for("deep_gemm.bf16_gemm_tt")
def bf16_gemm_tt_reference(a, b, d, c=None):
    return gemm_nt_reference(a.T, b, d, c)


# ---------------------------------------------------------------- grouped GEMMs


def m_grouped_nt_contiguous_reference(a, b, d, m_indices):
    """Rows with ``m_indices == g`` times group g's B; rows marked -1 are not written."""
    for g in range(b[0].shape[0] if isinstance(b, tuple) else b.shape[0]):
        rows = torch.nonzero(m_indices == g).squeeze(1)
        if rows.numel() == 0:
            continue
        a_rows = (a[0][rows], a[1][rows]) if isinstance(a, tuple) else a[rows]
        b_g = (b[0][g], b[1][g]) if isinstance(b, tuple) else b[g]
        d[rows] = gemm_nt_reference(a_rows, b_g, torch.empty(rows.numel(), d.shape[1], dtype=d.dtype,
                                                             device=d.device))
    return d


@registry.reference_for("deep_gemm.m_grouped_fp8_gemm_nt_contiguous")
def m_grouped_fp8_gemm_nt_contiguous_reference(a, b, d, m_indices):
    return m_grouped_nt_contiguous_reference(tuple(a), tuple(b), d, m_indices)


@registry.reference_for("deep_gemm.m_grouped_fp8_gemm_nn_contiguous")
def m_grouped_fp8_gemm_nn_contiguous_reference(a, b, d, m_indices):
    return m_grouped_nt_contiguous_reference(tuple(a), (b[0].transpose(1, 2), b[1].transpose(1, 2)), d, m_indices)


@registry.reference_for("deep_gemm.m_grouped_bf16_gemm_nt_contiguous")
def m_grouped_bf16_gemm_nt_contiguous_reference(a, b, d, m_indices):
    return m_grouped_nt_contiguous_reference(a, b, d, m_indices)


def m_grouped_nt_masked_reference(a, b, d, masked_m):
    """Group g: the first ``masked_m[g]`` rows of ``a[g]`` times ``b[g]``; later rows untouched."""
    for g, m in enumerate(masked_m.tolist()):
        if m <= 0:
            continue
        a_g = (a[0][g, :m], a[1][g, :m]) if isinstance(a, tuple) else a[g, :m]
        b_g = (b[0][g], b[1][g]) if isinstance(b, tuple) else b[g]
        gemm_nt_reference(a_g, b_g, d[g, :m])
    return d


@registry.reference_for("deep_gemm.m_grouped_fp8_gemm_nt_masked")
def m_grouped_fp8_gemm_nt_masked_reference(a, b, d, masked_m, expected_m=None):
    return m_grouped_nt_masked_reference(tuple(a), tuple(b), d, masked_m)


@registry.reference_for("deep_gemm.m_grouped_bf16_gemm_nt_masked")
def m_grouped_bf16_gemm_nt_masked_reference(a, b, d, masked_m, expected_m=None):
    return m_grouped_nt_masked_reference(a, b, d, masked_m)


def k_grouped_tn_reference(a, b, d, ks: Sequence[int], c=None):
    """Group g: ``d[g] = c[g] + A_g^T B_g`` over its rows ``[sum(ks[:g]), sum(ks[:g+1]))`` of A and B."""
    start = 0
    for g, k in enumerate(ks):
        end = start + k
        if isinstance(a, tuple):
            kb0, kb1 = start // BLOCK, end // BLOCK
            a_g = (a[0][start:end].T, a[1][kb0:kb1].T)
            b_g = (b[0][start:end].T, b[1][kb0:kb1].T)
        else:
            a_g, b_g = a[start:end].T, b[start:end].T
        if k == 0:
            _write(d[g], torch.zeros(d.shape[1:], device=d.device), None if c is None else c[g])
        else:
            gemm_nt_reference(a_g, b_g, d[g], None if c is None else c[g])
        start = end
    return d


@registry.reference_for("deep_gemm.k_grouped_fp8_gemm_tn_contiguous")
def k_grouped_fp8_gemm_tn_contiguous_reference(a, b, d, ks, ks_tensor=None, c=None):
    return k_grouped_tn_reference(tuple(a), tuple(b), d, ks, c)


@registry.reference_for("deep_gemm.k_grouped_bf16_gemm_tn_contiguous")
def k_grouped_bf16_gemm_tn_contiguous_reference(a, b, d, ks, ks_tensor=None, c=None):
    return k_grouped_tn_reference(a, b, d, ks, c)


@registry.reference_for("deep_gemm.k_grouped_fp8_gemm_nt_contiguous")
def k_grouped_fp8_gemm_nt_contiguous_reference(a, b, d, ks, ks_tensor=None, c=None):
    """Group g's A is the K-major ``[m, ks[g]]`` block at offset ``sum(ks[:g]) * m`` of the flat ``a[0]``."""
    m, n = d.shape[1:]
    start = 0
    for g, k in enumerate(ks):
        kb = slice(start // BLOCK, (start + k) // BLOCK)
        a_g = (a[0].reshape(-1)[start * m:(start + k) * m].view(m, k), a[1][:, kb])
        b_g = (b[0].reshape(-1)[start * n:(start + k) * n].view(n, k), b[1][:, kb])
        if k == 0:
            _write(d[g], torch.zeros(m, n, device=d.device), None if c is None else c[g])
        else:
            gemm_nt_reference(a_g, b_g, d[g], None if c is None else c[g])
        start += k
    return d
