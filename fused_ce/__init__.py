"""fused_ce: the output head's cross-entropy without ``[tokens, vocab]`` logits ever all alive.

``linear_cross_entropy(hidden, weight, targets)`` is ``F.cross_entropy(F.linear(hidden, weight).float(),
targets)`` computed in row chunks; its per-chunk softmax / log-sum-exp / gradient pass is one memory-bound
kernel op (``fused_ce.cross_entropy_forward`` / ``_backward``: Triton, with a PyTorch reference) in
``accel.registry``. A kernel package: it imports only ``accel`` (and torch, triton).
"""

from fused_ce.linear import default_chunk, linear_cross_entropy
from fused_ce.ops import cross_entropy_backward_op, cross_entropy_forward_op

__all__ = ["cross_entropy_backward_op", "cross_entropy_forward_op", "default_chunk", "linear_cross_entropy"]
