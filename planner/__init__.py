"""Parallel-strategy planner: which layout of DeepSeek-V3 training on N GPUs, how fast, does it fit.

``system`` reads the GPU/cluster description, ``costs`` is the per-operation time model, ``search``
enumerates legal layouts, filters them by ``planner.memory`` and times each step with
``dualpipe.simulator``; ``calibrate`` measures a system file on a local GPU. CLI: ``recipes.plan``.
"""

from planner.search import Evaluation, Layout, Request, Space, evaluate, search, to_config
from planner.system import System, known_systems, load_system

__all__ = ["Evaluation", "Layout", "Request", "Space", "System", "evaluate", "known_systems", "load_system",
           "search", "to_config"]
