"""DeepSeek-V4's parts of the memory model (``planner.memory`` calls these for a V4 ``ModelArgs``).

What differs from V3, and where it is counted:

- **activations**: every block is measured on ``meta`` (``planner.memory_measure.v4_block``), the model's own code:
  its ``hc_mult`` (4) input streams (a block's input is 4x V3's hidden state), the 128-token sliding window's
  index lists, the compressed entries of CSA (ratio 4, with the indexer's own compressed keys and top-k) and HCA
  (ratio 128), the mHC units' fp32 mixing, the sparse attention with its sink; the routed experts as V3's grouped
  ``Experts`` over one EP rank's slots. Layers alike (same compress ratio) measure once. With ``recompute =
  ["block"]`` a block keeps only its input streams and rebuilds the rest in backward (torch's checkpoint).
- **the last stage**: the loss head collapses the streams (``hc_head``) before the final norm; each MTP depth is a
  full V4 block with its input projections (``e_proj`` / ``h_proj``) and its own ``hc_head``, then the head.
- **comm**: pipeline P2P buffers carry the 4 streams; the expert all-to-all carries one hidden state per routed
  copy, as V3's.

Parameters, gradients and optimizer states are counted on a ``meta`` V4 model by ``planner.memory`` as V3's.
"""

from __future__ import annotations

from models.deepseek_v4 import ModelArgs as V4Args
from planner import memory_measure as measure
from planner.memory_measure import Measured
from training.stages import num_model_stages, split_layers


def is_v4(args: object) -> bool:
    """Whether ``args`` describe a DeepSeek-V4 model."""
    return isinstance(args, V4Args)


def layer_kind(args: V4Args, layer_id: int) -> str:
    """The kind of block ``layer_id`` for tables: window-only, CSA or HCA (MTP blocks are layer ``n_layers + k``)."""
    name = {0: "window", 4: "CSA", 128: "HCA"}[args.compress_ratios[layer_id]]
    return f"MTP ({name})" if layer_id >= args.n_layers else f"{name} layer"


def stage_activation_bytes(args: V4Args, cfg, p) -> tuple[list[int], list[int], dict[str, int]]:
    """As ``planner.memory.stage_activation_bytes`` for V4: (bytes one micro-batch keeps on each stage, the most
    bytes alive on top of those while one of its pieces runs, the largest bytes one micro-batch keeps in each kind
    of piece), measured at the config's micro-batch shape. The last stage adds the loss head and the MTP depths
    (each measured on the whole length: depth k really runs on ``seq - k``)."""
    par, data = cfg.parallel, cfg.data
    seq, mb = data.seq_len, data.micro_batch
    accelerator = p.attention == "flash"
    slots = (args.n_routed_experts + (cfg.eplb.redundant_experts if cfg.eplb.enabled else 0)) // par.ep
    num = num_model_stages(par.schedule, par.pp, par.vpp)

    def block(i: int) -> Measured:
        return measure.v4_block(args, i, mb, seq, p.act, accelerator, slots)

    stages = []
    for s, (lo, hi) in enumerate(split_layers(args, num)):
        pieces = [(layer_kind(args, i), block(i)) for i in range(lo, hi)]
        if s == num - 1:
            pieces.append(("loss head", measure.v4_head(args, mb, seq, p.act, accelerator)))
            pieces += [(f"MTP depth {k + 1} (block + head)",
                        block(args.n_layers + k).then(measure.v4_head(args, mb, seq, p.act, accelerator)))
                       for k in range(args.n_mtp_layers)]
        stages.append(pieces)
    return measure.stage_totals(stages)


def pieces(args: V4Args, micro_batch: int, seq: int, act: float, accelerator: bool, slots: int
           ) -> dict[str, Measured]:
    """Each kind of V4 piece at one micro-batch (the dry run's "measured" line): one block of each attention kind
    the model has (window-only, CSA, HCA), the MTP block and the loss head."""
    out: dict[str, Measured] = {}
    for i in range(args.n_layers + args.n_mtp_layers):
        kind = layer_kind(args, i)
        if kind not in out:
            out[kind] = measure.v4_block(args, i, micro_batch, seq, act, accelerator, slots)
    out["loss head"] = measure.v4_head(args, micro_batch, seq, act, accelerator)
    return out


def comm_bytes(args: V4Args, cfg, p, dispatch_bytes: float, overlapped: bool) -> int:
    """Expert all-to-all buffers of one micro-batch in flight (dispatch send + receive at ``dispatch_bytes`` per
    value, combine receive in the activation dtype; two micro-batches' at once when the schedule overlaps F and B)
    and pipeline P2P buffers: a send and a receive per direction of the ``hc_mult`` streams."""
    par, data = cfg.parallel, cfg.data
    tokens = data.seq_len * data.micro_batch
    out = 0.0
    if par.ep > 1:
        out += tokens * args.n_activated_experts * args.dim * (2 * dispatch_bytes + p.act) * (2 if overlapped else 1)
    if par.pp > 1:
        directions = par.layout.num_stages // par.pp
        out += 2 * directions * tokens * args.hc_mult * args.dim * p.act
    return int(out)
