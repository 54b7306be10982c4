"""Context parallelism in the trainer: the CP helper made once per run and handed to the modules that use it.

``context_parallel`` makes this rank's ``models.deepseek_v3.context_parallel.ContextParallel`` from its ``cp``
process group (None without CP); ``wire_context_parallel`` gives it to every stage (positions of its rows, the
loss's shares, MTP's roll) and every MLA layer of them (the latent all-gather and the global causal mask), as
``training.experts.wire_moe_layers`` gives the MoE layers their expert-parallel exchange. The trainer then feeds
each stage this rank's chunks of the sequences (``ContextParallel.split``) and the criterion the whole windows.
See ``docs/context_parallel.md``.
"""

from __future__ import annotations

from collections.abc import Sequence

from accel.flight import FlightRecorder
from accel.trace import TraceRecorder
from models.deepseek_v3.balancing import ExpertBalancer
from models.deepseek_v3.context_parallel import ContextParallel
from models.deepseek_v3.mla import MLA, InnerAttention
from training.config import TrainConfig
from training.parallel import ParallelState
from training.stages import DeepSeekV3Stage


def context_parallel(cfg: TrainConfig, ps: ParallelState, recorder: TraceRecorder | None = None,
                     flight: FlightRecorder | None = None) -> ContextParallel | None:
    """This rank's CP helper over its ``cp`` group for sequences of ``data.seq_len`` tokens; None at cp = 1.
    ``recorder`` / ``flight``: its exchanges are recorded on the trace's comm track and in the flight recorder."""
    if cfg.parallel.cp == 1:
        return None
    return ContextParallel(ps.group("cp"), cfg.parallel.cp, ps.coords.cp_rank, cfg.data.seq_len, recorder, flight)


def wire_context_parallel(stages: Sequence[DeepSeekV3Stage], cp: ContextParallel | None) -> None:
    """Hand ``cp`` to every stage and every MLA layer and expert balancer in them (MTP's included); nothing without
    CP. The balancers are wired by ``training.experts.wire_moe_layers``, which must run first."""
    if cp is None:
        return
    for st in stages:
        st.cp = cp
        for m in st.modules():
            if isinstance(m, (MLA, InnerAttention, ExpertBalancer)):
                m.cp = cp


def check_context_parallel(cp: int, seq_len: int, n_mtp_layers: int, capacity_factor: float | None) -> None:
    """ValueError (one line, naming the setting) for what the CP runtime does not run."""
    if cp == 1:
        return
    chunk = seq_len // (2 * cp)
    if n_mtp_layers >= chunk:
        raise ValueError(f"model n_mtp_layers={n_mtp_layers} with parallel.cp={cp}: each of the 2 x cp chunks of "
                         f"data.seq_len={seq_len} holds {chunk} tokens, fewer than MTP's depth + 1; lower parallel.cp "
                         "or raise data.seq_len")
    if capacity_factor is not None:
        raise ValueError(f"balance.capacity_factor={capacity_factor:g} with parallel.cp={cp}: expert capacity is "
                         "counted over each rank's tokens, not the context-parallel group's whole sequences; leave "
                         "balance.capacity_factor unset (dropless) or set parallel.cp=1")
