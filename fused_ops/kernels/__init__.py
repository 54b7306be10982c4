"""fused_ops' Triton kernels (imported at first use through ``accel.registry``, never by the package itself)."""
