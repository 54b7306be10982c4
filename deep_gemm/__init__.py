"""deep_gemm"""
