"""Triton kernels behind flash_mla's public ops (imported lazily: the package works without Triton)."""
