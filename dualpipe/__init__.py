"""dualpipe: DualPipe, DualPipeV, ZeroBubble, 1F1B and interleaved 1F1B pipeline parallelism on one schedule IR.

Public surface as deepseek-ai/DualPipe (``DualPipe``, ``DualPipeV``, ``WeightGradStore``),
plus ``Pipeline`` (runner for any schedule), the IR, validator, simulator and calculator.
"""

from dualpipe.dualpipe import DualPipe
from dualpipe.dualpipev import DualPipeV
from dualpipe.ir import Action, Overlap, Schedule, from_csv, load_csv
from dualpipe.runtime import Pipeline
from dualpipe.schedules import SCHEDULES, build
from dualpipe.utils import calc_diff
from dualpipe.weight_grad import LinearWithDeferredWGrad, WeightGradStore

__all__ = ["SCHEDULES", "Action", "DualPipe", "DualPipeV", "LinearWithDeferredWGrad", "Overlap", "Pipeline",
           "Schedule", "WeightGradStore", "build", "calc_diff", "from_csv", "load_csv"]
