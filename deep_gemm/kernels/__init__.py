"""Triton kernels behind deep_gemm's public ops (imported lazily: Triton may be absent)."""
