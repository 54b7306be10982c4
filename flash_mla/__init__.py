"""flash_mla: FlashMLA's Python API (paged MLA decoding, FP8 KV cache) in Triton, plus MLA training attention.

Upstream users switch by changing ``import flash_mla`` only: ``get_mla_metadata`` and
``flash_mla_with_kvcache`` keep FlashMLA's names and shapes; ``mla_attention`` adds the
forward+backward kernel that FlashMLA does not have. DeepSeek-V3.2's sparse attention: ``flash_mla_sparse_fwd``
(FlashMLA's API), ``flash_mla_with_kvcache(..., indices=...)`` and the differentiable ``sparse_mla_attention``.
DeepSeek-V4's (one K = V head, a sink logit per head): the differentiable ``sparse_sink_attention``, and
``sparse_sink_decode`` over FlashMLA's 584-byte V4 FP8 cache (``quantize_kv_v4`` / ``dequantize_kv_v4``).
"""

from flash_mla.attention import mla_attention
from flash_mla.decode import flash_mla_with_kvcache
from flash_mla.fp8_cache import dequantize_kv_fp8, quantize_kv_fp8
from flash_mla.metadata import get_mla_metadata
from flash_mla.sparse import flash_mla_sparse_fwd, sparse_mla_attention
from flash_mla.sparse_sink import sparse_sink_attention
from flash_mla.sparse_sink_decode import sparse_sink_decode
from flash_mla.v4_cache import dequantize_kv_v4, quantize_kv_v4

__all__ = ["dequantize_kv_fp8", "dequantize_kv_v4", "flash_mla_sparse_fwd", "flash_mla_with_kvcache",
           "get_mla_metadata", "mla_attention", "quantize_kv_fp8", "quantize_kv_v4", "sparse_mla_attention",
           "sparse_sink_attention", "sparse_sink_decode"]
