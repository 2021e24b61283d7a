"""Framework overhead: `ptdp train` (tp=pp=dp=1) against a plain PyTorch loop.

Both train the same GPT (same class, config, seed), on the same tokens, with the same
batch (micro-batches x gradient accumulation), AdamW, gradient clipping, and one
checkpoint save at the end. Rounds alternate ours / plain so that machine noise hits
both alike; the report is the median tokens/s of each and the ratio of medians.

    python benchmarks/speed/overhead.py                 # demo model, synthetic tokens
    python benchmarks/speed/overhead.py --steps 20 --rounds 5
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ptdp.config.files import apply_updates, load_toml
from ptdp.config.sections import RunConfig
from ptdp.data.indexed import IndexedWriter
from ptdp.model.gpt import GPT
from ptdp.parallel.env import LaunchEnv
from ptdp.train.data_setup import resolve_vocab
from ptdp.train.run import train
from ptdp.train.step.optim import lr_at

ROOT = Path(__file__).resolve().parents[2]


def synthetic_data(directory: Path, vocab: int, tokens: int) -> str:
    """Random tokens in the indexed format (speed does not depend on the text)."""
    prefix = directory / "synthetic"
    rng = np.random.default_rng(0)
    with IndexedWriter(prefix, np.uint16) as writer:
        for _ in range(16):
            writer.add_document(rng.integers(0, vocab, tokens // 16))
    return str(prefix)


def run_ptdp(cfg: RunConfig, run_dir: Path) -> float:
    """The whole `ptdp train` path: validation, data, model, loop, logging, final save."""
    cfg = apply_updates(cfg, {"train": {"run_dir": str(run_dir)}}, "benchmark")
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        train(cfg, env=LaunchEnv(0, 1, 0))
    return time.perf_counter() - start


def run_plain(cfg: RunConfig, run_dir: Path) -> float:
    """What a user would write by hand: nanoGPT-style batches from a memmap."""
    m, t, o = cfg.model, cfg.train, cfg.optim
    tokens = np.memmap(cfg.data.path + ".bin", dtype=np.uint16, mode="r")
    model = GPT(m, seed=t.seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": other, "weight_decay": 0}],
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
    )
    accum = t.global_batch_size // t.micro_batch_size
    s = m.seq_length
    start = time.perf_counter()
    sample = 0
    for step in range(t.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, o, t.steps)
        for _ in range(accum):
            rows = [
                tokens[(sample + i) * s : (sample + i) * s + s + 1]
                for i in range(t.micro_batch_size)
            ]
            sample += t.micro_batch_size
            batch = torch.from_numpy(np.stack(rows).astype(np.int64))
            loss = model(batch[:, :-1], batch[:, 1:]) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % t.log_interval == 0:
            loss.item()
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, run_dir / "plain.pt")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "demo.toml"))
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = load_toml(args.config)
        data = synthetic_data(tmp, vocab=4096, tokens=2_000_000)
        cfg = apply_updates(
            base,
            {
                "model": {"vocab_size": 4096, "dropout": 0.0},
                "data": {"path": data},
                "train": {
                    "steps": args.steps,
                    "eval_interval": 0,
                    "save_interval": 0,
                    "progress": False,
                    "device": "cpu",
                    "log_interval": 5,
                },
            },
            "benchmark",
        )
        cfg = resolve_vocab(cfg)
        tokens = args.steps * cfg.train.global_batch_size * cfg.model.seq_length
        ours, plain = [], []
        for r in range(args.rounds):
            ours.append(tokens / run_ptdp(cfg, tmp / f"ours{r}"))
            plain.append(tokens / run_plain(cfg, tmp / f"plain{r}"))
            print(f"round {r}: ptdp {ours[-1]:,.0f} tok/s | plain {plain[-1]:,.0f} tok/s")
    mo, mp = statistics.median(ours), statistics.median(plain)
    m, t = cfg.model, cfg.train
    threads = torch.get_num_threads()
    print(f"\nmachine: {platform.machine()}, {threads} threads, torch {torch.__version__}")
    print(
        f"model: {m.num_layers} layers, h={m.hidden_size}, s={m.seq_length}, "
        f"batch {t.global_batch_size} (micro {t.micro_batch_size}), "
        f"{args.steps} steps x {args.rounds} rounds"
    )
    print(
        f"median tokens/s: ptdp {mo:,.0f} | plain loop {mp:,.0f} | ptdp/plain = {mo / mp:.3f} "
        f"(overhead {100 * (1 - mo / mp):+.1f}%)"
    )
    assert math.isfinite(mo) and math.isfinite(mp)


if __name__ == "__main__":
    main()
