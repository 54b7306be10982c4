"""The pipeline schedule of a training step: ``dualpipe``'s runtime driving this rank's DeepSeek-V3 stages.

``dualpipe.runtime.Pipeline`` executes the schedule IR (1F1B, ZB1P, ZBV, DualPipe, DualPipeV) over
the stage modules, with P2P between the ranks of the ``pp`` group; the last stage's criterion is
``DeepSeekV3Stage.compute_loss`` (head, MTP and the losses), fed the token windows as labels. For
``dualpipe`` the mirrored stage replicas' gradients are summed across the two ranks that hold them.
"""

from __future__ import annotations

import torch

from training.config import TrainConfig
from training.parallel import ParallelState
from training.stages import DeepSeekV3Stage


class PipelineRunner:
    """``step(windows, chunks)`` runs every micro-batch forward and backward through the schedule."""

    def __init__(self, stages: list[DeepSeekV3Stage], cfg: TrainConfig, ps: ParallelState):
        from dualpipe.runtime import Pipeline

        self.stages, self.cfg, self.ps = stages, cfg, ps
        self.pipe = Pipeline(stages, schedule=cfg.parallel.schedule, process_group=ps.group("pp"),
                             p2p_timeout=cfg.run.timeout_s)
        self.last = next((s for s in stages if s.is_last), None)

    def step(self, windows: torch.Tensor, chunks: int) -> float:
        """Sum of the (1/chunks-scaled) micro-batch losses on the rank holding the loss, else 0."""
        inputs = windows[:, :-1].contiguous()
        criterion = self.last.compute_loss if self.last is not None else None
        loss, _ = self.pipe.step(inputs, num_chunks=chunks, criterion=criterion, labels=(windows,))
        if self.cfg.parallel.schedule == "dualpipe":
            _sum_replica_grads(self.stages, self.ps)
        return float(loss.sum()) if loss is not None else 0.0


def _sum_replica_grads(stages: list[DeepSeekV3Stage], ps: ParallelState) -> None:
    """DualPipe holds stage s on pp ranks s and pp-1-s: sum each stage's gradients over its two holders."""
    from dualpipe.runtime import sum_mirrored_grads  # the dualpipe package's helper

    sum_mirrored_grads(stages, ps.group("pp"))


def build_pipeline(stages: list[DeepSeekV3Stage], cfg: TrainConfig, ps: ParallelState) -> PipelineRunner:
    return PipelineRunner(stages, cfg, ps)
