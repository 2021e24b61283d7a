"""Generation with the KV cache against recomputing the whole sequence: tokens/s, same tokens.

A seeded, randomly initialised GPT (ptdp's own `GPT`, GPT-2 style, fp32) extends a random
prompt by N new tokens through `ptdp.model.generate.generate`, greedily (temperature 0):

- **cache**: the prompt runs once (prefill), then each step feeds only the newest token,
  its attention reading the cached keys and values (the default, `use_cache=True`);
- **no cache**: each step runs the model on the whole sequence so far (`use_cache=False`),
  as generation without a cache must.

Timed is the whole `generate` call (prefill included), as tokens/s of new tokens. Rounds
alternate which mode goes first, so machine noise hits both alike; reported are the medians
and their ratio, measured in the same run. Both modes must return the same tokens in every
round, or the benchmark stops: greedy decoding leaves no randomness, so a token that differs
is the cache's doing. The model's context is the prompt plus the longest N, so the cache
serves every step (past the context both modes recompute a sliding window, see generate.py).

Shapes: b = batch, t = prompt length, n = new tokens.

    python benchmarks/speed/generation.py --new-tokens 64 256 --rounds 5 --threads 1 [--json PATH]
    python benchmarks/speed/generation.py --layers 2 --hidden 64 --heads 4 --new-tokens 8 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ptdp.config.files import apply_updates
from ptdp.config.sections import RunConfig
from ptdp.model.generate import generate
from ptdp.model.gpt import GPT


@dataclass(frozen=True)
class Row:
    """One length: tokens/s of each round per mode, their medians and cache / no cache."""

    new_tokens: int
    cache_tokens_per_s: list[float]
    no_cache_tokens_per_s: list[float]
    same_tokens: bool  # greedy tokens equal in every round

    @property
    def cache_median(self) -> float:
        return statistics.median(self.cache_tokens_per_s)

    @property
    def no_cache_median(self) -> float:
        return statistics.median(self.no_cache_tokens_per_s)

    @property
    def speedup(self) -> float:
        return self.cache_median / self.no_cache_median

    def to_json(self) -> dict:
        medians = {"cache_median": self.cache_median, "no_cache_median": self.no_cache_median}
        return asdict(self) | medians | {"speedup": self.speedup}


def build_model(args: argparse.Namespace) -> GPT:
    """The seeded model, its context just long enough for prompt + the longest generation."""
    model = {
        "num_layers": args.layers,
        "hidden_size": args.hidden,
        "num_heads": args.heads,
        "vocab_size": args.vocab_size,
        "seq_length": args.prompt_len + max(args.new_tokens),
    }
    cfg = apply_updates(RunConfig(), {"model": model}, "benchmark").model
    return GPT(cfg, seed=args.seed).to(args.device).eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(
    model: GPT, prompt: torch.Tensor, n: int, use_cache: bool
) -> tuple[torch.Tensor, float]:
    """(tokens [b, t + n], seconds) of one greedy generation."""
    _sync(prompt.device)
    start = time.perf_counter()
    out = generate(model, prompt, n, temperature=0, use_cache=use_cache)
    _sync(prompt.device)
    return out, time.perf_counter() - start


def check_same(cached: torch.Tensor, plain: torch.Tensor, prompt_len: int) -> None:
    """Raise unless both modes drew the same tokens, naming the first that differs."""
    if torch.equal(cached, plain):
        return
    row, col = (cached != plain).nonzero()[0].tolist()
    raise AssertionError(
        f"greedy tokens differ with and without the KV cache: sequence {row}, new token "
        f"{col - prompt_len} ({cached[row, col].item()} against {plain[row, col].item()})"
    )


def measure(model: GPT, prompt: torch.Tensor, n: int, rounds: int) -> Row:
    """Alternating rounds of both modes for n new tokens (after an untimed warm-up)."""
    for use_cache in (True, False):
        timed_generate(model, prompt, min(n, 8), use_cache)
    new = n * prompt.shape[0]
    speed: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        out: dict[bool, torch.Tensor] = {}
        for use_cache in (True, False) if r % 2 == 0 else (False, True):
            out[use_cache], seconds = timed_generate(model, prompt, n, use_cache)
            speed[use_cache].append(new / seconds)
        check_same(out[True], out[False], prompt.shape[1])
    return Row(n, speed[True], speed[False], same_tokens=True)


def format_table(rows: list[Row]) -> str:
    lines = [
        "| new tokens | cache tokens/s (median) | no cache tokens/s (median) | cache / no cache "
        "| same greedy tokens |",
        "|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.new_tokens} | {r.cache_median:,.1f} | {r.no_cache_median:,.1f} | "
            f"{r.speedup:.2f} | {'yes' if r.same_tokens else 'no'} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1, help="sequences generated together")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, nargs="+", default=[64, 256])
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds per length")
    p.add_argument("--seed", type=int, default=0, help="model weights and prompt")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--json", help="write the machine, the model and the rows to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    if args.threads:
        # On a shared machine one thread is steadier: OpenMP threads that wait for a busy
        # core stall every operator, far more than the lost parallelism costs.
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = build_model(args)
    prompt = torch.randint(
        0,
        args.vocab_size,
        (args.batch, args.prompt_len),
        generator=torch.Generator().manual_seed(args.seed),
    ).to(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    machine = (
        f"{name} | {platform.machine()}, {os.cpu_count()} CPUs | torch {torch.__version__} | "
        f"torch threads {torch.get_num_threads()} | fp32"
    )
    params = sum(p.numel() for p in model.parameters())
    shape = (
        f"{args.layers} layers, h={args.hidden}, {args.heads} heads, vocab {args.vocab_size}, "
        f"{params / 1e6:.2f}M parameters; b={args.batch}, prompt {args.prompt_len} tokens, "
        f"context {model.cfg.seq_length}; {args.rounds} alternating rounds"
    )
    print(f"{machine}\n{shape}", flush=True)
    rows = []
    for n in args.new_tokens:
        rows.append(measure(model, prompt, n, args.rounds))
        print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(format_table(rows))
    if args.json:
        report = {
            "command": " ".join(["python benchmarks/speed/generation.py", *given]),
            "machine": machine,
            "model": shape,
            "rows": [r.to_json() for r in rows],
        }
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
