"""Bytes kept for backward per token: ours with each memory option vs transformers' DeepSeek-V3, same run.

    python -m recipes.bench_memory                       # preset bench_cpu, 2 x 512 tokens, fp32
    python -m recipes.bench_memory --preset debug --batch 2 --seq 128 --json out.json

What is counted: every tensor autograd saves during one training forward (model + loss), through
``torch.autograd.graph.saved_tensors_hooks``, as distinct storages whose size is read *after* the
forward, i.e. what stays allocated until backward (a tensor the memory policy remakes in backward is not kept:
what it is remade from is counted instead).
Parameters and buffers are not counted (they are not activations). That is what a GPU run holds for
backward: our CPU attention reference keeps what the flash kernel keeps (q, k, v), and the FP8
paths save the same e4m3 + scale tensors on either device. transformers runs its default
implementation (sdpa attention, grouped experts) on the same config and the same weights.

Per layer = the whole model's bytes / n_layers (embedding, final norm and loss included, so the
per-layer figure slightly overstates a layer); the "vs transformers" column is the same ratio either way.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable

import torch
from torch import nn

from accel.cli import BAD_INPUT, OK, ArgumentParser, check_output_file, positive_int
from recipes.benchutil import print_report
from training.memory_policy import MemoryPolicy

# name -> ModelArgs overrides. "v3 + fp8 cache" is the V3 recipe: RMSNorm + MLA up-projection recompute,
# FP8 GEMMs whose inputs are kept as e4m3 + 1x128 scales, SwiGLU input in FP8 with its output recomputed.
OPTIONS: dict[str, dict] = {
    "none": {},
    "norm": {"recompute": ("norm",)},
    "mla_up": {"recompute": ("mla_up",)},
    "v3": {"recompute": ("v3",)},
    "v3 + swiglu": {"recompute": ("v3", "swiglu")},
    "fp8 (no cache)": {"fp8": True, "fp8_cache_activations": False},
    "fp8 + fp8 cache": {"fp8": True},
    "v3 + fp8 cache": {"recompute": ("v3",), "fp8": True},
    "block": {"recompute": ("block",)},
}


def saved_bytes(forward: Callable[[], torch.Tensor], module: nn.Module,
                policy: MemoryPolicy | None = None) -> tuple[int, torch.Tensor]:
    """(bytes of the distinct storages autograd saved while ``forward()`` ran, measured after it returned;
    ``module``'s parameters and buffers excluded; the loss it returned). ``policy``: the forward runs under that
    memory policy, which reports what it keeps."""
    # storages told apart by identity: ``untyped_storage()`` is one Python object for a storage's whole life,
    # shared by its views (held here, so no other storage takes its id)
    skip = {id(s): s for s in (t.untyped_storage() for t in (*module.parameters(), *module.buffers()))}
    storages: dict[int, torch.UntypedStorage] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if id(storage) not in skip:
            storages.setdefault(id(storage), storage)
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if policy is None else policy.applied(pack)
    with hooks:
        loss = forward()
    return sum(s.nbytes() for s in storages.values()), loss


def ours(args, state: dict, tokens: torch.Tensor, dtype: torch.dtype) -> tuple[int, float]:
    """Saved bytes and loss of our model with ``args`` on ``tokens [b, s + 1]``, the training loss path."""
    from models.deepseek_v3 import Transformer, lm_losses_from_hidden

    model = Transformer(args).to(dtype)
    model.load_state_dict(state)
    model.train()
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    policy = MemoryPolicy(model, args)  # as the trainer applies it, whole-block recompute included

    def forward() -> torch.Tensor:
        h = model.run_layers(model.embed_tokens(inputs), wrap=policy.recomputed)
        return lm_losses_from_hidden(args, model.norm, model.head, model.mtp, model.embed, h, inputs,
                                     labels, wrap=policy.recomputed)["loss"]

    nbytes, loss = saved_bytes(forward, model, policy)
    loss.backward()  # the recomputed paths must also run backward
    return nbytes, float(loss.detach())


def transformers_model(checkpoint: str, dtype: torch.dtype, tokens: torch.Tensor) -> tuple[int, float, str]:
    """Saved bytes, loss and attention implementation of transformers' model from ``checkpoint``."""
    from transformers import DeepseekV3ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model = DeepseekV3ForCausalLM.from_pretrained(checkpoint, dtype=dtype)
    model.train()
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def forward() -> torch.Tensor:
        logits = model(inputs).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    nbytes, loss = saved_bytes(forward, model)
    loss.backward()
    return nbytes, float(loss.detach()), model.config._attn_implementation


def measure(preset: str, batch: int, seq: int, dtype: torch.dtype, options: dict[str, dict] = OPTIONS,
            with_transformers: bool = True) -> tuple[list[dict], dict]:
    """One row per option (and transformers'), bytes per token and per token per layer."""
    from models.deepseek_v3 import ModelArgs, Transformer, save_hf_checkpoint

    base = ModelArgs.preset(preset, n_mtp_layers=0)  # transformers' model has no MTP: count the same work
    torch.manual_seed(0)
    reference = Transformer(base).to(dtype)
    state = reference.state_dict()
    tokens = torch.randint(0, min(base.vocab_size, 256), (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    n = batch * seq
    rows = []
    for name, overrides in options.items():
        nbytes, loss = ours(base.replace(**overrides), state, tokens, dtype)
        rows.append({"impl": "ours", "option": name, "KiB_per_token": nbytes / n / 1024,
                     "KiB_per_token_layer": nbytes / n / 1024 / base.n_layers, "loss": loss})
    info = {"args": base, "tokens": n}
    if with_transformers:
        with tempfile.TemporaryDirectory() as tmp:
            save_hf_checkpoint(reference, tmp, dtype=dtype)
            nbytes, loss, attn = transformers_model(tmp, dtype, tokens)
        rows.append({"impl": "transformers", "option": f"default ({attn})", "KiB_per_token": nbytes / n / 1024,
                     "KiB_per_token_layer": nbytes / n / 1024 / base.n_layers, "loss": loss})
        for r in rows:
            r["vs_transformers"] = r["KiB_per_token"] / rows[-1]["KiB_per_token"]
    return rows, info


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m recipes.bench_memory", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="bench_cpu", help="ModelArgs preset to measure")
    ap.add_argument("--batch", type=positive_int, default=2, help="sequences per forward")
    ap.add_argument("--seq", type=positive_int, default=512, help="tokens per sequence")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="parameter and activation dtype")
    ap.add_argument("--json", default=None, help="also write the report as JSON here")
    opts = ap.parse_args(sys.argv[1:] if argv is None else argv)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[opts.dtype]
    try:
        from models.deepseek_v3 import ModelArgs

        if opts.json:
            check_output_file(opts.json, "--json")
        args = ModelArgs.preset(opts.preset)
        if opts.seq > args.max_seq_len:
            raise ValueError(f"--seq {opts.seq} exceeds preset {opts.preset}'s max_seq_len={args.max_seq_len}")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
    rows, info = measure(opts.preset, opts.batch, opts.seq, dtype)
    args = info["args"]
    notes = [f"preset {opts.preset} ({args.n_layers} layers, dim {args.dim}, {args.n_routed_experts} experts "
             f"top-{args.n_activated_experts}, vocab {args.vocab_size}, no MTP), batch {opts.batch} x seq {opts.seq}, "
             f"{opts.dtype}; bytes saved for backward by one forward incl. the loss, parameters excluded",
             "per layer = whole model / n_layers; losses differ only by summation order (same weights, same batch)"]
    print_report("Activation memory kept for backward: ours vs transformers", rows,
                 ["impl", "option", "KiB_per_token", "KiB_per_token_layer", "vs_transformers", "loss"],
                 json_path=opts.json, notes=notes)
    return OK


if __name__ == "__main__":
    sys.exit(main())
