"""Closed-form bubble and memory figures of the DualPipe README, for comparison with the simulator.

``PP`` is the number of pipeline stages in DualPipe's sense: the rank count for 1F1B, ZB1P and
DualPipe, and twice the rank count for DualPipeV (its 2*PP stages on PP devices). ``B`` is the
full backward, ``W`` the weight-gradient part, ``F&B`` an overlapped forward and backward; ``F`` and
``B`` are a whole rank's share of the model (under interleaved 1F1B each of its ``v`` chunks takes
``F/v``). Activations count micro-batches of a rank's whole share (interleaved 1F1B: its peak of
``2(PP-1) + (v-1)PP + 1`` chunk activations, each ``1/v`` of a share, on rank 0).

| schedule         | bubble              | parameters | activations           |
|------------------|---------------------|------------|-----------------------|
| 1F1B             | (PP-1)(F+B)         | 1x         | PP                    |
| interleaved 1F1B | (PP-1)(F+B)/v       | 1x         | PP + (PP-1)/v (N>=PP) |
| ZB1P      | (PP-1)(F+B-2W)      | 1x         | PP          |
| DualPipe  | (PP/2-1)(F&B+B-3W)  | 2x         | PP+1        |
| DualPipeV | (PP/2-1)(F&B+B-3W)  | 2x         | PP+1        |
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpipe.simulator import Costs

CLOSED_FORM = ("1f1b", "interleaved1f1b", "zb1p", "dualpipe", "dualpipev")


@dataclass(frozen=True)
class ClosedForm:
    bubble: float
    parameters: int
    activations: float


def stages_for(name: str, num_ranks: int) -> int:
    """``PP`` in the README's formulas for ``name`` on ``num_ranks`` devices."""
    return 2 * num_ranks if name == "dualpipev" else num_ranks


def closed_form(name: str, num_ranks: int, costs: Costs, vpp: int = 1) -> ClosedForm | None:
    """The README's figures for ``name`` on ``num_ranks`` devices (Megatron's for interleaved 1F1B with ``vpp``
    chunks per rank; ``costs`` are then one chunk's); None for schedules it does not list."""
    if name not in CLOSED_FORM:
        return None
    pp = stages_for(name, num_ranks)
    f, b, w = costs.F, costs.B, costs.W
    if name == "1f1b":
        return ClosedForm((pp - 1) * (f + b), 1, pp)
    if name == "interleaved1f1b":  # a chunk costs F, B: a rank's share vpp F, vpp B
        return ClosedForm((pp - 1) * (f + b), 1, pp + (pp - 1) / vpp)
    if name == "zb1p":
        return ClosedForm((pp - 1) * (f + b - 2 * w), 1, pp)
    return ClosedForm((pp / 2 - 1) * (costs.overlapped + b - 3 * w), 2, pp + 1)
