"""Generate text from an HF-format DeepSeek-V3 checkpoint with the MLA latent KV cache.

    python -m recipes.generate --checkpoint DIR --prompt "def fib(n):" --max-new-tokens 64
    python -m recipes.generate --checkpoint DIR --prompt "..." --temperature 0.8 --top-k 50 --seed 0
    python -m recipes.generate --checkpoint DIR --tokenizer path/to/tokenizer.json --dtype bf16 --prompt "..."

The tokenizer is byte-level (ids 0..255, as the debug models train with) unless ``--tokenizer``
names a ``tokenizer.json``. Runs on the default device (GPU when there is one); decode attention
goes through ``flash_mla.flash_mla_with_kvcache`` for bf16 models, a plain fp32 path otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import accel
from accel.cli import HelpFormatter
from models.deepseek_v3 import load_hf_checkpoint
from models.deepseek_v3.generate import generate
from training.data import build_tokenizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m recipes.generate", description=__doc__.split("\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="HF-format checkpoint directory (config.json + safetensors)")
    ap.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for several prompts)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=None, help="sample from the k likeliest tokens (default: all)")
    ap.add_argument("--seed", type=int, default=0, help="random seed of the sampling")
    ap.add_argument("--tokenizer", default="byte", help="'byte' or a tokenizer.json path")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="weights dtype (default: bf16 on a GPU, fp32 on a CPU)")
    ap.add_argument("--device", default=None, help="default: accel.default_device()")
    args = ap.parse_args(argv)
    if args.max_new_tokens < 1:
        ap.error("--max-new-tokens must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    device = torch.device(opts.device) if opts.device else accel.default_device()
    dtype = DTYPES[opts.dtype] if opts.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    tokenizer = build_tokenizer(opts.tokenizer)
    t0 = time.perf_counter()
    model = load_hf_checkpoint(None, opts.checkpoint, device=device, dtype=dtype)
    if tokenizer.vocab_size > model.args.vocab_size:
        raise ValueError(f"--tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is "
                         f"{model.args.vocab_size}")
    print(f"loaded {opts.checkpoint} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, {dtype}, "
          f"{device}) in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    gen = torch.Generator(device=device).manual_seed(opts.seed)
    for text in opts.prompt:
        ids = tokenizer.encode(text)
        if not ids:
            raise ValueError("--prompt must not be empty")
        prompt = torch.tensor([ids], dtype=torch.long, device=device)
        t0 = time.perf_counter()
        out = generate(model, prompt, opts.max_new_tokens, temperature=opts.temperature, top_k=opts.top_k,
                       eos_id=model.args.eos_token_id if opts.tokenizer != "byte" else None, generator=gen)
        new = out.shape[1] - prompt.shape[1]
        elapsed = time.perf_counter() - t0
        print(text + tokenizer.decode(out[0, prompt.shape[1]:].tolist()))
        print(f"[{new} tokens in {elapsed:.2f}s, {new / elapsed:.1f} tokens/s]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
