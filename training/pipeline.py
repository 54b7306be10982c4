"""The pipeline schedule of a training step: ``dualpipe``'s runtime driving this rank's DeepSeek-V3 stages.

``dualpipe.runtime.Pipeline`` executes the schedule IR (1F1B, ZB1P, ZBV, DualPipe, DualPipeV) over
the stage modules, with P2P between the ranks of the ``pp`` group; the last stage's criterion is
``DeepSeekV3Stage.compute_loss`` (head, MTP and the losses), fed the token windows as labels. For
``dualpipe`` the mirrored stage replicas' gradients are summed across the two ranks that hold them.
"""

from __future__ import annotations

import torch

from accel.trace import TraceRecorder
from training.config import TrainConfig
from training.parallel import ParallelState
from training.stages import DeepSeekV3Stage


class PipelineRunner:
    """``step(windows, chunks)`` runs every micro-batch forward and backward through the schedule."""

    def __init__(self, stages: list[DeepSeekV3Stage], cfg: TrainConfig, ps: ParallelState,
                 recorder: TraceRecorder | None = None):
        from dualpipe.dualpipe import DualPipe
        from dualpipe.runtime import Pipeline

        self.stages, self.cfg, self.ps = stages, cfg, ps
        if cfg.parallel.schedule == "dualpipe":
            self.pipe = DualPipe(tuple(stages), process_group=ps.group("pp"), p2p_timeout=cfg.run.timeout_s)
        else:
            self.pipe = Pipeline(stages, schedule=cfg.parallel.schedule, process_group=ps.group("pp"),
                                 p2p_timeout=cfg.run.timeout_s)
        # parallel.overlap=false runs every paired F&B as F then B (the baseline of bench_overlap)
        self.pipe.overlapped_forward_backward = self.pipe.overlapped_forward_backward and cfg.parallel.overlap
        self.pipe.recorder = recorder
        self.last = next((s for s in stages if s.is_last), None)

    def step(self, windows: torch.Tensor, chunks: int) -> float:
        """Sum of the (1/chunks-scaled) micro-batch losses on the rank holding the loss, else 0."""
        criterion = self.last.compute_loss if self.last is not None else None
        if self.cfg.parallel.schedule == "dualpipe":
            return self._dualpipe_step(windows, chunks, criterion)
        inputs = windows[:, :-1].contiguous()
        loss, _ = self.pipe.step(inputs, num_chunks=chunks, criterion=criterion, labels=(windows,))
        return float(loss.sum()) if loss is not None else 0.0

    def _dualpipe_step(self, windows: torch.Tensor, chunks: int, criterion) -> float:
        """DualPipe: rank 0 feeds the first half of the micro-batches down, rank pp-1 the second half
        up the mirrored copies; each end computes the loss of the other's inputs. Both copies of a
        stage then hold the summed gradient (``sync_mirrored_grads``)."""
        half = windows.shape[0] // 2
        first, second = windows[:half], windows[half:]
        pp_rank, pp = self.ps.coords.pp_rank, self.cfg.parallel.pp
        if pp_rank == 0:
            ins, labels = first, second
        elif pp_rank == pp - 1:
            ins, labels = second, first
        else:
            ins, labels = None, None
        args = (ins[:, :-1].contiguous(),) if ins is not None else (None,)
        loss, _ = self.pipe.step(*args, num_chunks=chunks, criterion=criterion,
                                 labels=(labels,) if labels is not None else ())
        self.pipe.sync_mirrored_grads()
        # each end holds half of the micro-batches' losses: x2 so the mean over loss ranks is the step's loss
        return 2.0 * float(loss.sum()) if loss is not None else 0.0


def build_pipeline(stages: list[DeepSeekV3Stage], cfg: TrainConfig, ps: ParallelState,
                   recorder: TraceRecorder | None = None) -> PipelineRunner:
    return PipelineRunner(stages, cfg, ps, recorder)
