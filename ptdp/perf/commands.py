"""`ptdp simulate` and `ptdp plan` behind their parsers: the run config they model (one
precision default for both), the search, `--compare`, and what they print."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from ptdp.config.enums import Precision
from ptdp.config.files import given_keys
from ptdp.config.sections import RunConfig
from ptdp.errors import ConfigError
from ptdp.perf.cost.hardware import GIB, System
from ptdp.perf.cost.hardware_file import load_system
from ptdp.perf.cost.host_memory import Start
from ptdp.perf.cost.software import SOFTWARE, Software
from ptdp.perf.validate.paper import ALL_PRESETS, perf_config
from ptdp.rules.domains import POSITIVE, Rule, number_problem


def modelled_config(
    model: str, config: str | None, overrides: list[str], system: System
) -> RunConfig:
    """`perf_config` with one precision default for simulate and plan: where neither the model
    (a preset of a paper or a published model trains in bf16), its TOML file, `--config` nor
    an override sets `train.precision`, 16-bit (bf16) where the device has a bf16 peak, as a
    GPU cluster trains; `ptdp train`'s fp32 default is for the CPU."""
    cfg = perf_config(model, config, overrides)
    files = [f for f in (config, None if model in ALL_PRESETS else model) if f]
    given = set().union(*(given_keys(f, []) for f in files), given_keys(None, overrides))
    if model in ALL_PRESETS or "train.precision" in given:
        return cfg
    if dict(system.device.peak_tflops).get("bf16", 0.0) <= 0:
        return cfg
    return replace(cfg, train=replace(cfg.train, precision=Precision.BF16))


def software_of(args: argparse.Namespace) -> Software:
    """The runtime `--software` names, with `--moe-load-imbalance`."""
    load = getattr(args, "moe_load_imbalance", 1.0)
    at_least_one = Rule(">= 1 (1 = a perfect balance)", lambda v: v >= 1, (0.5,))
    if problem := number_problem("--moe-load-imbalance", load, at_least_one):
        raise ConfigError(problem)
    return replace(SOFTWARE[args.software], moe_load_imbalance=load)


def system_of(args: argparse.Namespace) -> System:
    """The cluster `--device` names, with the node's host memory of `--host-memory-gib`."""
    system = load_system(args.device)
    gib = getattr(args, "host_memory_gib", None)
    if gib is None:
        return system
    if problem := number_problem("--host-memory-gib", gib, POSITIVE):
        raise ConfigError(problem)
    return replace(system, host_memory_bytes=gib * GIB)


def start_of(args: argparse.Namespace) -> Start:
    """The start `--start` names, whose host memory is checked."""
    return Start(getattr(args, "start", "any"))


def run_simulate(args: argparse.Namespace) -> int:
    from ptdp.perf.report import simulation_output
    from ptdp.perf.simulate.simulator import default_world_size, simulate

    system = system_of(args)
    cfg = modelled_config(args.model, args.config, args.overrides, system)
    gpus = default_world_size(cfg) if args.gpus is None else args.gpus
    prediction = simulate(cfg, system, gpus, software=software_of(args))
    out = Path(args.out or Path(cfg.train.run_dir) / "simulation")
    text = simulation_output(prediction, system, out, args.json, cfg, args.software, start_of(args))
    print(text)
    return 0


def run_plan(args: argparse.Namespace) -> int:
    from ptdp.perf.plan.compare import compare
    from ptdp.perf.plan.keys import plan_request
    from ptdp.perf.plan.planner import plan
    from ptdp.perf.report import format_plan, plan_dict, progress_bar

    # `--tp 8` and the other old flags of `plan` as overrides; the explicit keys win.
    old = {k: v for k, v in vars(args).items() if "." in k and v not in (None, "0", "auto")}
    overrides = [text for key, value in old.items() for text in (f"--{key}", str(value))]
    overrides += args.overrides
    system, software = system_of(args), software_of(args)
    base, pins = plan_request(
        modelled_config(args.model, args.config, overrides, system), overrides, args.top
    )
    with progress_bar("simulating layouts") as progress:
        result = plan(
            base,
            gpus=args.gpus,
            system=system,
            software=software,
            progress=progress,
            top=args.top,
            start=start_of(args),
            **pins,
        )
    mine = None
    if args.compare is not None:
        path = args.compare or None  # `--compare` alone: the layout of --config and overrides
        user = base if path is None else modelled_config(args.model, path, overrides, system)
        mine = compare(result, user, path or "--config and overrides", args.gpus, system, software)
    top = args.top
    if args.json:
        print(json.dumps(plan_dict(result, top, mine)))
    else:
        print(format_plan(result, system, top, mine))
    return 0 if result.best else 1
