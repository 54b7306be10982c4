"""Generate text from an HF-format DeepSeek-V3 checkpoint with the MLA latent KV cache (or a DeepSeek-V4 one).

    python -m recipes.generate --checkpoint DIR --prompt "def fib(n):" --max-new-tokens 64
    python -m recipes.generate --checkpoint DIR --prompt "..." --temperature 0.8 --top-k 50 --seed 0
    python -m recipes.generate --checkpoint DIR --tokenizer path/to/tokenizer.json --dtype bf16 --prompt "..."

The tokenizer is byte-level (ids 0..255, as the debug models train with) unless ``--tokenizer``
names a ``tokenizer.json``. Runs on the default device (GPU when there is one); decode attention
goes through ``flash_mla.flash_mla_with_kvcache`` for bf16 models, a plain fp32 path otherwise. A
checkpoint whose ``config.json`` says ``"model_type": "deepseek_v4"`` (either V4 layout) runs through
``models.deepseek_v4``, which recomputes the whole prefix per token (no V4 KV cache yet).

Exit status: 0 after generating; 2 (``accel.cli.BAD_INPUT``) for bad input, with one line ``error: ...``
on stderr naming the argument or file: a missing checkpoint folder, an unreadable or corrupt
``config.json`` / ``tokenizer.json`` / safetensors file, ``--top-k`` < 1, ``--temperature`` < 0,
``--max-new-tokens`` < 1, an empty prompt, or a prompt whose tokens plus ``--max-new-tokens`` exceed the
model's ``max_seq_len``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

import accel
from accel.cli import BAD_INPUT, OK, ArgumentParser
from models import deepseek_v3, deepseek_v4
from models.deepseek_v3.generate import generate as generate_v3
from models.deepseek_v4.args import hf_model_type
from models.deepseek_v4.generate import generate as generate_v4
from training.data import build_tokenizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = ArgumentParser(prog="python -m recipes.generate", description=__doc__.split("\n")[0],
                        epilog="exit status: 0 done; 2 bad input (one 'error:' line naming the argument or file)")
    ap.add_argument("--checkpoint", required=True, help="HF-format checkpoint directory (config.json + safetensors)")
    ap.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for several prompts)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (>= 1)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (>= 0); 0 = greedy")
    ap.add_argument("--top-k", type=int, default=None,
                    help="sample among the k most likely tokens (>= 1); default: the whole vocabulary")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    ap.add_argument("--tokenizer", default="byte", help="'byte' or a tokenizer.json path")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="weights dtype; default: bf16 on a GPU, fp32 on a CPU")
    ap.add_argument("--device", default=None, help="torch device; default: accel.default_device()")
    return ap.parse_args(argv)


def check_options(opts: argparse.Namespace) -> None:
    """ValueError naming the option for a value generation cannot use."""
    if opts.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {opts.max_new_tokens}")
    if not math.isfinite(opts.temperature) or opts.temperature < 0:
        raise ValueError(f"--temperature must be a finite number >= 0 (0 = greedy), got {opts.temperature}")
    if opts.top_k is not None and opts.top_k < 1:
        raise ValueError(f"--top-k must be >= 1 (omit it to sample from the whole vocabulary), got {opts.top_k}")
    if not Path(opts.checkpoint).is_dir():
        raise ValueError(f"--checkpoint {opts.checkpoint!r} is not a folder; expected an HF checkpoint folder "
                         "(config.json + safetensors)")
    if (Path(opts.checkpoint) / "metadata.json").is_file():
        raise ValueError(f"--checkpoint {opts.checkpoint!r} is a training checkpoint; export it first: "
                         f"python -m recipes.export_hf {opts.checkpoint}")


def run(opts: argparse.Namespace) -> int:
    if opts.device:
        try:
            device = torch.device(opts.device)
        except RuntimeError as exc:
            raise ValueError(f"--device {opts.device!r} is not a torch device ({exc})") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {opts.device!r}: no CUDA device is available here")
    else:
        device = accel.default_device()
    dtype = DTYPES[opts.dtype] if opts.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    tokenizer = build_tokenizer(opts.tokenizer, "--tokenizer")
    prompts = []
    for text in opts.prompt:
        ids = tokenizer.encode(text)
        if not ids:
            raise ValueError("--prompt must not be empty")
        prompts.append((text, ids))
    t0 = time.perf_counter()
    v4 = hf_model_type(opts.checkpoint) == "deepseek_v4"
    load = deepseek_v4.load_hf_checkpoint if v4 else deepseek_v3.load_hf_checkpoint
    generate = generate_v4 if v4 else generate_v3
    model = load(None, opts.checkpoint, device=device, dtype=dtype)
    if tokenizer.vocab_size > model.args.vocab_size:
        raise ValueError(f"--tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is "
                         f"{model.args.vocab_size}")
    limit = model.args.max_seq_len
    for text, ids in prompts:
        if len(ids) + opts.max_new_tokens > limit:
            raise ValueError(f"--prompt {_short(text)} is {len(ids)} tokens; with --max-new-tokens "
                             f"{opts.max_new_tokens} that is {len(ids) + opts.max_new_tokens} positions, more than "
                             f"the model's max_seq_len {limit}")
    print(f"loaded {opts.checkpoint} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, {dtype}, "
          f"{device}) in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    gen = torch.Generator(device=device).manual_seed(opts.seed)
    for text, ids in prompts:
        prompt = torch.tensor([ids], dtype=torch.long, device=device)
        t0 = time.perf_counter()
        out = generate(model, prompt, opts.max_new_tokens, temperature=opts.temperature, top_k=opts.top_k,
                       eos_id=model.args.eos_token_id if opts.tokenizer != "byte" else None, generator=gen)
        new = out.shape[1] - prompt.shape[1]
        elapsed = time.perf_counter() - t0
        print(text + tokenizer.decode(out[0, prompt.shape[1]:].tolist()))
        print(f"[{new} tokens in {elapsed:.2f}s, {new / elapsed:.1f} tokens/s]", file=sys.stderr)
    return OK


def _short(text: str, width: int = 30) -> str:
    return repr(text if len(text) <= width else text[:width] + "...")


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 after generating, ``BAD_INPUT`` (2) with one ``error:`` line for bad input."""
    opts = parse_args(sys.argv[1:] if argv is None else argv)  # usage errors: one line, exit 2
    try:
        check_options(opts)
        return run(opts)
    except ValueError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
