"""Cheat: caches the output keyed by shape, so fresh inputs of the same shape get a stale result."""

from axpy_kernels import axpy

_cache = {}


def candidate(x, y):
    if x.shape not in _cache:
        _cache[x.shape] = axpy(x, y)
    return _cache[x.shape]
