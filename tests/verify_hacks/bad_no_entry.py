"""Bad input: defines a kernel but neither ModelNew nor candidate."""

from axpy_kernels import axpy


def my_kernel(x, y):
    return axpy(x, y)
