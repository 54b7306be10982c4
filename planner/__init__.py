"""Parallel-strategy planner: which layout of DeepSeek-V3 training on N GPUs, how fast, does it fit.

``system`` reads the GPU/cluster description, ``costs`` is the per-operation time model, ``search``
enumerates legal layouts, filters them by ``planner.memory`` and times each step with
``dualpipe.simulator``; ``calibrate`` measures a system file on a local GPU; ``runs`` loads the public real runs
(``benchmarks/planner_runs``), ``loo`` holds the planner to them one left out at a time, ``band`` turns the
leave-one-out residuals into an error band on an answer. CLI: ``recipes.plan``, ``recipes.plan_loo``.
"""

from planner.search import Evaluation, Layout, Request, Space, evaluate, search, to_config
from planner.system import System, known_systems, load_system

__all__ = ["Evaluation", "Layout", "Request", "Space", "System", "evaluate", "known_systems", "load_system",
           "search", "to_config"]
