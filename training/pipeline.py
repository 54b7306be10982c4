"""The pipeline schedule of a training step: ``dualpipe``'s runtime driving this rank's DeepSeek-V3 stages.

``dualpipe.runtime.Pipeline`` executes the schedule IR (1F1B, interleaved 1F1B, ZB1P, ZBV, DualPipe, DualPipeV) over
the stage modules, with P2P between the ranks of the ``pp`` group; the last stage's criterion is the
step's ``training.loss.StageLoss`` (head, MTP and the losses), fed the token windows as labels. For
``dualpipe`` the mirrored stage replicas' gradients are summed across the two ranks that hold them.
"""

from __future__ import annotations

import torch

from accel.flight import FlightRecorder
from accel.trace import TraceRecorder
from dualpipe.dualpipe import DualPipe
from dualpipe.runtime import Pipeline
from models.deepseek_v3.context_parallel import ContextParallel
from training.config import TrainConfig
from training.loss import StageLoss
from training.parallel import ParallelState
from training.stages import DeepSeekV3Stage


class PipelineRunner:
    """``step(windows, chunks, criterion)`` runs every micro-batch forward and backward through the schedule."""

    def __init__(self, stages: list[DeepSeekV3Stage], cfg: TrainConfig, ps: ParallelState,
                 recorder: TraceRecorder | None = None, flight: FlightRecorder | None = None,
                 cp: ContextParallel | None = None):
        """``recorder``: the runtime records each action on its compute track (``recipes.train --trace``);
        ``flight``: and each action and P2P message in the rank's flight recorder; ``cp``: context parallelism
        (the stages get this rank's chunks of each sequence, the criterion the whole windows)."""
        self.cp = cp
        self.schedule, self.pp, self.pp_rank = cfg.parallel.schedule, cfg.parallel.pp, ps.coords.pp_rank
        if self.schedule == "dualpipe":
            self.pipe = DualPipe(tuple(stages), process_group=ps.group("pp"), p2p_timeout=cfg.run.timeout_s)
        else:
            self.pipe = Pipeline(stages, schedule=self.schedule, process_group=ps.group("pp"),
                                 p2p_timeout=cfg.run.timeout_s, vpp=cfg.parallel.vpp)
        # parallel.overlap=false runs every paired F&B as F then B (the baseline of bench_overlap)
        self.pipe.overlapped_forward_backward = self.pipe.overlapped_forward_backward and cfg.parallel.overlap
        self.pipe.recorder = recorder
        self.pipe.flight = flight

    def step(self, windows: torch.Tensor, chunks: int, criterion: StageLoss | None) -> None:
        """Forward and backward of ``windows`` in ``chunks`` micro-batches; ``criterion`` (on ranks holding
        the last stage) collects the losses."""
        if self.schedule == "dualpipe":
            self._dualpipe_step(windows, chunks, criterion)
            return
        self.pipe.step(self._inputs(windows), num_chunks=chunks, criterion=criterion, labels=(windows,))

    def _inputs(self, windows: torch.Tensor) -> torch.Tensor:
        """The first stage's input: the windows' tokens, or this CP rank's chunks of them."""
        tokens = windows[:, :-1]
        return (tokens if self.cp is None else self.cp.split(tokens)).contiguous()

    def _dualpipe_step(self, windows: torch.Tensor, chunks: int, criterion: StageLoss | None) -> None:
        """DualPipe: rank 0 feeds the first half of the micro-batches down, rank pp-1 the second half
        up the mirrored copies; each end computes the loss of the other's inputs. Both copies of a
        stage then hold the summed gradient (``sync_mirrored_grads``)."""
        half = windows.shape[0] // 2
        first, second = windows[:half], windows[half:]
        if self.pp_rank == 0:
            ins, labels = first, second
        elif self.pp_rank == self.pp - 1:
            ins, labels = second, first
        else:
            ins, labels = None, None
        args = (self._inputs(ins),) if ins is not None else (None,)
        self.pipe.step(*args, num_chunks=chunks, criterion=criterion, labels=(labels,) if labels is not None else ())
        self.pipe.sync_mirrored_grads()
