"""Closed-form bubble and memory figures of the DualPipe README, for comparison with the simulator.

``PP`` is the number of pipeline stages in DualPipe's sense: the rank count for 1F1B, ZB1P and
DualPipe, and twice the rank count for DualPipeV (its 2*PP stages on PP devices). ``B`` is the
full backward, ``W`` the weight-gradient part, ``F&B`` an overlapped forward and backward.

| schedule  | bubble              | parameters | activations |
|-----------|---------------------|------------|-------------|
| 1F1B      | (PP-1)(F+B)         | 1x         | PP          |
| ZB1P      | (PP-1)(F+B-2W)      | 1x         | PP          |
| DualPipe  | (PP/2-1)(F&B+B-3W)  | 2x         | PP+1        |
| DualPipeV | (PP/2-1)(F&B+B-3W)  | 2x         | PP+1        |
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpipe.simulator import Costs

CLOSED_FORM = ("1f1b", "zb1p", "dualpipe", "dualpipev")


@dataclass(frozen=True)
class ClosedForm:
    bubble: float
    parameters: int
    activations: int


def stages_for(name: str, num_ranks: int) -> int:
    """``PP`` in the README's formulas for ``name`` on ``num_ranks`` devices."""
    return 2 * num_ranks if name == "dualpipev" else num_ranks


def closed_form(name: str, num_ranks: int, costs: Costs) -> ClosedForm | None:
    """The README's figures for ``name`` on ``num_ranks`` devices; None for schedules it does not list."""
    if name not in CLOSED_FORM:
        return None
    pp = stages_for(name, num_ranks)
    f, b, w = costs.F, costs.B, costs.W
    if name == "1f1b":
        return ClosedForm((pp - 1) * (f + b), 1, pp)
    if name == "zb1p":
        return ClosedForm((pp - 1) * (f + b - 2 * w), 1, pp)
    return ClosedForm((pp / 2 - 1) * (costs.overlapped + b - 3 * w), 2, pp + 1)
