"""deep_gemm: DeepGEMM-compatible FP8 GEMMs (Triton for CUDA and MUSA, PyTorch reference anywhere).

Same names and argument order as DeepSeek's DeepGEMM v2 (and its v1 aliases), so code written for
DeepGEMM runs by changing the install. Plus the FP8 training layer (``linear``, ``Fp8Linear``,
``grouped_linear``, ``GroupedLinear``) that DeepGEMM leaves to its users, and DeepSeek-V3.2's indexer
logits (``fp8_mqa_logits``, ``fp8_paged_mqa_logits``) with the top-k selection the sparse attention reads.
"""

from deep_gemm.cast import per_block_cast_to_fp8, per_channel_cast_to_fp8, per_token_cast_to_fp8
from deep_gemm.fp8_fp4 import m_grouped_fp8_fp4_gemm_nt_contiguous
from deep_gemm.gemm import (
    bf16_gemm_nn,
    bf16_gemm_nt,
    bf16_gemm_tn,
    bf16_gemm_tt,
    fp8_gemm_nn,
    fp8_gemm_nt,
    fp8_gemm_tn,
    fp8_gemm_tt,
    gemm_fp8_fp8_bf16_nt,
)
from deep_gemm.grouped import (
    bf16_m_grouped_gemm_nt_masked,
    fp8_m_grouped_gemm_nt_masked,
    k_grouped_bf16_gemm_tn_contiguous,
    k_grouped_fp8_gemm_nt_contiguous,
    k_grouped_fp8_gemm_tn_contiguous,
    m_grouped_bf16_gemm_nt_contiguous,
    m_grouped_bf16_gemm_nt_masked,
    m_grouped_fp8_gemm_nn_contiguous,
    m_grouped_fp8_gemm_nt_contiguous,
    m_grouped_fp8_gemm_nt_masked,
    m_grouped_gemm_fp8_fp8_bf16_nt_contiguous,
    m_grouped_gemm_fp8_fp8_bf16_nt_masked,
)
from deep_gemm.linear import Fp8Linear, GroupedLinear, grouped_linear, linear, reads_only_precast, takes_precast
from deep_gemm.mqa_logits import (
    fp8_mqa_logits,
    fp8_paged_mqa_logits,
    kv_cache_cast_to_fp8,
    select_topk,
)
from deep_gemm.utils import (
    align,
    calc_diff,
    ceil_div,
    get_m_alignment_for_contiguous_layout,
    get_mk_alignment_for_contiguous_layout,
    get_mn_major_tma_aligned_packed_ue8m0_tensor,
    get_mn_major_tma_aligned_tensor,
    get_num_sms,
    set_num_sms,
)

__all__ = [
    "Fp8Linear",
    "GroupedLinear",
    "bf16_gemm_nn",
    "bf16_gemm_nt",
    "bf16_gemm_tn",
    "bf16_gemm_tt",
    "bf16_m_grouped_gemm_nt_masked",
    "align",
    "calc_diff",
    "ceil_div",
    "fp8_gemm_nn",
    "fp8_gemm_nt",
    "fp8_gemm_tn",
    "fp8_gemm_tt",
    "fp8_m_grouped_gemm_nt_masked",
    "fp8_mqa_logits",
    "fp8_paged_mqa_logits",
    "gemm_fp8_fp8_bf16_nt",
    "get_m_alignment_for_contiguous_layout",
    "get_mk_alignment_for_contiguous_layout",
    "get_mn_major_tma_aligned_packed_ue8m0_tensor",
    "get_mn_major_tma_aligned_tensor",
    "get_num_sms",
    "grouped_linear",
    "k_grouped_bf16_gemm_tn_contiguous",
    "m_grouped_fp8_fp4_gemm_nt_contiguous",
    "kv_cache_cast_to_fp8",
    "k_grouped_fp8_gemm_nt_contiguous",
    "k_grouped_fp8_gemm_tn_contiguous",
    "linear",
    "m_grouped_bf16_gemm_nt_contiguous",
    "m_grouped_bf16_gemm_nt_masked",
    "m_grouped_fp8_gemm_nn_contiguous",
    "m_grouped_fp8_gemm_nt_contiguous",
    "m_grouped_fp8_gemm_nt_masked",
    "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous",
    "m_grouped_gemm_fp8_fp8_bf16_nt_masked",
    "per_block_cast_to_fp8",
    "per_channel_cast_to_fp8",
    "per_token_cast_to_fp8",
    "reads_only_precast",
    "select_topk",
    "set_num_sms",
    "takes_precast",
]
