"""flash_mla: FlashMLA's Python API (paged MLA decoding, FP8 KV cache) in Triton, plus MLA training attention.

Upstream users switch by changing ``import flash_mla`` only: ``get_mla_metadata`` and
``flash_mla_with_kvcache`` keep FlashMLA's names and shapes; ``mla_attention`` adds the
forward+backward kernel that FlashMLA does not have.
"""

from flash_mla.attention import mla_attention

__all__ = ["mla_attention"]
