"""Where a step's time goes, beside the performance model's terms for it.

Issue 22, item 2's diagnosis. For each one-process configuration of
`benchmarks/perf_model/prediction.py` and its data-parallel ones without sharded gradients (or those
`--only` names), ptdp's `Trainer` takes warm-up steps and then timed ones, with the
transformer layers' forward and backward timed by module hooks (which add a little time of
their own), the wait for the gradient reduction (`GradBuffers.finish`), the forward-backward
and the optimizer step apart; beside each phase, the model's figure from the calibration
file: the layers' F and B + W (`Prediction.layer` x layers x this rank's microbatches), the
reduction (`Prediction.dp_seconds`: over gloo none of it hides under the backward), the
optimizer step with the step's scalar all-reduces (`Prediction.optimizer_seconds`) and the
rest (embedding, head, loss, the data; measured, it holds the loss's all-reduce). Also the
optimizer step repeated at once after the timed one: the same work on warm caches, to show
how much a step's own order costs it. Two-rank figures are the two ranks' mean.

    python benchmarks/perf_model/step_phases.py --calibration runs/benchmarks/calibration.toml
    python benchmarks/perf_model/step_phases.py --calibration FILE --only 1p-base dp2-zero0
    python benchmarks/perf_model/step_phases.py --tiny --calibration a100-80gb  # seconds: the test

Prints a markdown table; writes no file.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common.corpus import repo_corpus
from benchmarks.common.spawn import spawn
from benchmarks.perf_model.prediction import CASES, Case, case_config, predict
from ptdp.model.gpt import TransformerLayer
from ptdp.parallel.env import LaunchEnv
from ptdp.perf.cost.hardware_file import load_system
from ptdp.train.run import prepare
from ptdp.train.step.trainer import Trainer

PHASES = ("step", "layers_f", "layers_b", "reduce", "rest", "optimizer", "optimizer_again")


def phased(case: Case) -> bool:
    """Cases whose phases follow each other: one process, or data parallelism whose
    gradients are reduced after the backward (ZeRO-0 and 1; ZeRO-2 and 3 reduce inside it)."""
    return case.world == 1 or set(case.parallel) == {"zero"} and case.parallel["zero"] <= 1


def _hook_layers(trainer: Trainer, spent: dict[str, float]) -> None:
    """Add each transformer layer's forward and backward wall time to `spent`."""
    started: dict[tuple[str, int], float] = {}

    def begin(kind: str, i: int):  # noqa: ANN202 - a hook
        return lambda *_: started.__setitem__((kind, i), time.perf_counter())

    def end(kind: str, i: int):  # noqa: ANN202 - a hook
        def hook(*_: object) -> None:
            spent[kind] += time.perf_counter() - started[(kind, i)]

        return hook

    layers = [m for m in trainer.model.modules() if isinstance(m, TransformerLayer)]
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(begin("layers_f", i))
        layer.register_forward_hook(end("layers_f", i))
        layer.register_full_backward_pre_hook(begin("layers_b", i))
        layer.register_full_backward_hook(end("layers_b", i))


def _time_reduction(trainer: Trainer, spent: dict[str, float]) -> None:
    """Add the wait for the gradient reduction (`GradBuffers.finish`) to `spent`."""
    finish = trainer.grads.finish

    def timed() -> None:
        start = time.perf_counter()
        finish()
        spent["reduce"] += time.perf_counter() - start

    trainer.grads.finish = timed


def measure(rank: int, world: int, cfg, warmup: int, steps: int) -> dict[str, float]:  # noqa: ANN001 - a RunConfig
    """Median milliseconds of each phase over `steps` steps after `warmup` (a `spawn`
    worker with two ranks: the ranks' mean)."""
    env = LaunchEnv(rank, world, rank)
    cfg, layout, data = prepare(cfg, env)
    trainer = Trainer(cfg, layout, env, data)
    spent = {"layers_f": 0.0, "layers_b": 0.0, "reduce": 0.0}
    _hook_layers(trainer, spent)
    _time_reduction(trainer, spent)
    rows = []
    for i in range(warmup + steps):
        spent["layers_f"] = spent["layers_b"] = spent["reduce"] = 0.0
        start = time.perf_counter()
        loss = trainer.forward_backward()
        backward_done = time.perf_counter()
        trainer.optimizer_step(loss)
        done = time.perf_counter()
        trainer.optimizer.clip(cfg.optim.grad_clip, trainer.optimizer.grad_norm())
        trainer.optimizer.step()  # the same update again, on warm caches (not counted)
        again = time.perf_counter() - done
        trainer.step += 1
        if i >= warmup:
            f, b, reduce = spent["layers_f"], spent["layers_b"], spent["reduce"]
            rest = backward_done - start - f - b - reduce
            row = (done - start, f, b, reduce, rest, done - backward_done)
            rows.append(dict(zip(PHASES, (*row, again))))
    if trainer.watchdog:
        trainer.watchdog.close()
    mine = {k: 1e3 * statistics.median(r[k] for r in rows) for k in PHASES}
    if world == 1:
        return mine
    ranks: list = [None] * world
    dist.all_gather_object(ranks, mine)
    return {k: statistics.fmean(r[k] for r in ranks) for k in PHASES}


def modelled(cfg, world: int, system) -> dict[str, float]:  # noqa: ANN001 - a RunConfig, a System
    """The model's milliseconds for the same phases (no repeat: the model has one step)."""
    p = predict(cfg, world, system)
    microbatches = p.layout.num_microbatches
    passes = cfg.model.num_layers * microbatches
    f, b = passes * p.layer.f, passes * (p.layer.b + p.layer.w)
    step, reduce, optimizer = p.iteration_seconds, p.dp_seconds, p.optimizer_seconds
    rest = step - f - b - reduce - optimizer
    return {k: 1e3 * v for k, v in zip(PHASES, (step, f, b, reduce, rest, optimizer, optimizer))}


def table(rows: list[tuple[str, dict[str, float], dict[str, float]]]) -> list[str]:
    lines = [
        "| config | step ms (model) | layers F | layers B | reduction wait | rest of F + B "
        "| optimizer | optimizer again at once |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, got, want in rows:
        cells = [f"{got[k]:.1f} ({want[k]:.1f})" for k in PHASES[:-1]]
        lines.append(f"| {name} | {' | '.join(cells)} | {got['optimizer_again']:.1f} |")
    return lines


def main(argv: list[str] | None = None) -> list[tuple[str, dict, dict]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calibration", required=True, metavar="FILE",
                        help="`ptdp calibrate`'s file (or a built-in name)")  # fmt: skip
    names = [c.name for c in CASES if phased(c)]
    parser.add_argument("--only", nargs="+", default=names, metavar="NAME",
                        help=f"of {', '.join(names)}")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=9, help="timed steps (their median)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (the test)")
    args = parser.parse_args(argv)
    if unknown := sorted(set(args.only) - set(names)):
        parser.error(f"--only: {', '.join(unknown)} not among the cases whose phases follow "
                     f"each other ({', '.join(names)})")  # fmt: skip
    torch.set_num_threads(1)  # as each rank of the prediction benchmark
    system = load_system(args.calibration)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = repo_corpus(Path(tmp) / "data")
        for case in [c for c in CASES if c.name in args.only]:
            cfg = case_config(case, data, f"{tmp}/runs", args.tiny)
            if case.world == 1:
                got = measure(0, 1, cfg, args.warmup, args.steps)
            else:
                got = spawn(measure, case.world, cfg, args.warmup, args.steps)
            rows.append((case.name, got, modelled(cfg, case.world, system)))
            print(table(rows[-1:])[-1], flush=True)
    print("\n".join(table(rows)))
    return rows


if __name__ == "__main__":
    main()
