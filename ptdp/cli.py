"""`ptdp train|preprocess|generate|schedule|simulate|plan|convert|inspect`: the only place
that reads argv."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path
from typing import NoReturn

from ptdp import __version__
from ptdp.errors import PtdpError

TRAIN_EPILOG = """\
Configuration: defaults < --config FILE (TOML) < --section.key value overrides.
Every option below can be set in the TOML file as `key = value` under `[section]`,
or on the command line as --section.key value or --section.key=value.

{options}

Under torchrun, every process runs this same command and becomes one rank:
  torchrun --nproc-per-node 2 -m ptdp train --config configs/demo.toml
"""


def _train_parser(sub: argparse._SubParsersAction) -> None:
    from ptdp.config import help_text

    p = sub.add_parser(
        "train",
        help="train a model (one process, or one rank under torchrun)",
        description="Train a GPT model on preprocessed data.",
        epilog=TRAIN_EPILOG.format(options=help_text()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # so that --section.key overrides never match an option prefix
    )
    p.add_argument("--config", metavar="FILE", help="TOML config file (see configs/)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in train.run_dir (start fresh if none)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the config and data, print the resolved config and layout, and exit",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=0,
        metavar="N",
        help="with --dry-run: check the layout for N processes (default: this launch's)",
    )


def _preprocess_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "preprocess",
        help="tokenize text/JSON-lines into an indexed binary dataset",
        description=(
            "Tokenize plain-text files (one document per file) or JSON-lines files (a 'text' "
            "field per line) into PREFIX.bin / PREFIX.idx in Megatron-LM's indexed format, "
            "plus PREFIX.json recording the tokenizer."
        ),
    )
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="FILE_OR_DIR",
        help="files or directories (searched for *.txt, *.jsonl, *.json)",
    )
    p.add_argument(
        "--output-prefix",
        required=True,
        metavar="PREFIX",
        help="output path without extension, e.g. data/shakespeare/shakespeare",
    )
    p.add_argument(
        "--tokenizer",
        default="bpe",
        metavar="bytes|bpe|PATH",
        help="raw bytes, a byte-level BPE trained on the input, or a tokenizer.json (default: bpe)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=4096,
        metavar="N",
        help="vocabulary of the trained BPE (default: 4096)",
    )
    p.add_argument(
        "--workers", type=int, default=1, metavar="N", help="tokenizer processes (default: 1)"
    )


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="sample text from a checkpoint",
        description="Sample text from a trained checkpoint, with a KV cache. Launched "
        "with torchrun --nproc-per-node N, the N processes split each layer "
        "tensor-parallel (any N dividing the heads, key/value groups and MLP width) and "
        "rank 0 prints.",
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        metavar="PATH",
        help="a run directory (uses its latest checkpoint) or a step directory",
    )
    p.add_argument("--prompt", default="", help="text to continue (default: empty)")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=200,
        metavar="N",
        help="tokens to generate (default: 200)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="softmax temperature; 0 = greedy (default: 0.8)",
    )
    p.add_argument("--top-k", type=int, default=50, help="sample from the k likeliest (0 = all)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (1 = off)")
    p.add_argument(
        "--num-samples",
        type=int,
        default=1,
        metavar="N",
        help="independent samples of the same prompt (default: 1)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="sampling seed: same seed, same text (default: 0)"
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument(
        "--no-kv-cache",
        action="store_true",
        help="recompute the whole context for every new token (slower; for comparison)",
    )


def _inspect_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="show what a checkpoint holds",
        description="Print a checkpoint's step, model config and layout, tensors (names, "
        "shapes, dtypes, sizes), optimizer state and tokenizer.",
    )
    p.add_argument(
        "checkpoint",
        metavar="CKPT",
        help="a run directory (uses its latest checkpoint) or a step directory",
    )


def _schedule_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "schedule",
        help="print a pipeline schedule's per-rank actions and check it",
        description=(
            "Build a pipeline schedule, add its sends and receives, verify it (dependencies, "
            "matching sends/receives, no deadlock, in-flight activations) and print the "
            "step x rank table with its unit-cost bubble. No cluster needed."
        ),
    )
    p.add_argument(
        "--schedule",
        default="1f1b",
        choices=["gpipe", "1f1b", "interleaved", "zb-h1"],
        help="schedule name, as in parallel.schedule (default: 1f1b)",
    )
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks (default: 4)")
    p.add_argument(
        "--vpp",
        type=int,
        default=1,
        help="model chunks per rank; >= 2 for interleaved (default: 1)",
    )
    p.add_argument(
        "--microbatches",
        type=int,
        default=8,
        metavar="M",
        help="microbatches per pipeline per step (default: 8)",
    )
    p.add_argument(
        "--no-comms", action="store_true", help="show compute actions only (no SEND/RECV rows)"
    )


SOFTWARE_CHOICES = ("ptdp", "megatron-2021")


def _simulate_parser(sub: argparse._SubParsersAction) -> None:
    from ptdp.perf.hardware import list_systems

    p = sub.add_parser(
        "simulate",
        help="predict step time, TFLOP/s, bubble and memory of a config on a cluster",
        description=(
            "Replay the config's pipeline schedule (its exact per-rank action lists) with a "
            "compute and communication model of a cluster: prints the predicted iteration "
            "time, TFLOP/s per GPU, bubble and memory per GPU, and writes the timeline as a "
            "PNG and a Chrome trace (open it in https://ui.perfetto.dev). No GPU needed."
        ),
        epilog="Config overrides (--section.key value) work as in `ptdp train`.",
        allow_abbrev=False,
    )
    p.add_argument("--config", metavar="FILE", help="TOML config file (see configs/)")
    p.add_argument(
        "--model",
        default="",
        metavar="NAME",
        help="start from a paper model preset (gpt3-175b, gpt-1t, ...; see `ptdp plan --help`)",
    )
    p.add_argument(
        "--device",
        default="a100-80gb",
        metavar="NAME|FILE",
        help=f"cluster: {', '.join(list_systems())} or a hardware TOML (default: a100-80gb)",
    )
    p.add_argument(
        "--gpus",
        type=int,
        default=0,
        metavar="N",
        help="world size (default: tp * pp * dp, with dp = 1 if it is 0)",
    )
    p.add_argument(
        "--out",
        default="",
        metavar="DIR",
        help="where timeline.png and trace.json go (default: train.run_dir/simulation)",
    )
    p.add_argument(
        "--software",
        default="ptdp",
        choices=SOFTWARE_CHOICES,
        help="kernels and overlap of this runtime, or of Megatron-LM as the paper ran it",
    )
    p.add_argument("--json", action="store_true", help="print the prediction as JSON")


def _plan_parser(sub: argparse._SubParsersAction) -> None:
    from ptdp.perf.hardware import list_systems
    from ptdp.perf.paper import PRESETS

    p = sub.add_parser(
        "plan",
        help="search the parallel layouts that fit and rank them by predicted throughput",
        description=(
            "Search tensor, pipeline and data-parallel sizes, micro-batch, schedule and "
            "recomputation for a model on N GPUs, keep the layouts that fit in memory, "
            "simulate each and rank them; explains the choice with the paper's guidelines "
            "(tensor parallel inside a node, pipeline across nodes, micro-batch from its "
            "equation (1))."
        ),
    )
    p.add_argument(
        "--model",
        required=True,
        metavar="NAME|FILE",
        help=f"a preset ({', '.join(PRESETS)}) or a TOML config whose [model] is used",
    )
    p.add_argument("--gpus", type=int, required=True, metavar="N", help="number of GPUs")
    p.add_argument(
        "--device",
        default="a100-80gb",
        metavar="NAME|FILE",
        help=f"cluster: {', '.join(list_systems())} or a hardware TOML (default: a100-80gb)",
    )
    p.add_argument(
        "--global-batch", type=int, required=True, metavar="B", help="sequences per step"
    )
    p.add_argument(
        "--vocab-size", type=int, default=0, metavar="V", help="set model.vocab_size (if 0)"
    )
    p.add_argument("--precision", default="", choices=["", "bf16", "fp16", "fp32"])
    p.add_argument("--tp", type=int, default=0, help="fix the tensor-parallel size")
    p.add_argument("--pp", type=int, default=0, help="fix the pipeline-parallel size")
    p.add_argument("--vpp", type=int, default=0, help="fix the model chunks per rank")
    p.add_argument("--micro-batch", type=int, default=0, metavar="b", help="fix b")
    p.add_argument("--recompute", default="auto", choices=["auto", "none", "selective", "full"])
    p.add_argument(
        "--sequence-parallel",
        default="auto",
        choices=["auto", "on", "off"],
        help="auto: on whenever tp > 1",
    )
    p.add_argument(
        "--distributed-optimizer", action="store_true", help="shard optimizer state over dp"
    )
    p.add_argument("--software", default="ptdp", choices=SOFTWARE_CHOICES)
    p.add_argument("--top", type=int, default=5, help="layouts to list (default: 5)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def _convert_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="convert a checkpoint to or from a Hugging Face transformers model",
        description=(
            "--to hf CKPT OUT: write a checkpoint (run or step directory) as a transformers "
            "GPT-2 or Llama model directory (config.json, model.safetensors, tokenizer.json). "
            "--from hf DIR OUT: make OUT a run directory whose step-0 checkpoint holds the "
            "model, with no optimizer state; train from it in any layout with "
            "`ptdp train --config OUT/config.toml --resume --data.path PREFIX`."
        ),
    )
    way = p.add_mutually_exclusive_group(required=True)
    way.add_argument("--to", choices=["hf"], help="export a ptdp checkpoint")
    way.add_argument("--from", dest="source", choices=["hf"], help="import into a ptdp run")
    p.add_argument("src", metavar="SRC", help="checkpoint (--to) or model directory (--from)")
    p.add_argument("out", metavar="OUT", help="model directory (--to) or run directory (--from)")
    p.add_argument(
        "--seq-length",
        type=int,
        default=0,
        metavar="N",
        help="--from: training context length (default: the model's maximum positions)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ptdp",
        description="Train GPT language models with tensor, pipeline and data parallelism.",
    )
    parser.add_argument("--version", action="version", version=f"ptdp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _train_parser(sub)
    _preprocess_parser(sub)
    _generate_parser(sub)
    _inspect_parser(sub)
    _schedule_parser(sub)
    _simulate_parser(sub)
    _plan_parser(sub)
    _convert_parser(sub)
    return parser


def _cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from ptdp.config import resolve, to_toml
    from ptdp.parallel.env import LaunchEnv
    from ptdp.train.run import prepare, train

    cfg = resolve(args.config, overrides)
    env = LaunchEnv.from_environ()
    if args.dry_run:
        if args.world_size:
            env = LaunchEnv(rank=0, world_size=args.world_size, local_rank=0)
        cfg, layout, data = prepare(cfg, env)
        print(to_toml(cfg))
        print(f"# layout: {layout.describe()}")
        print(f"# data: {len(data.train):,} training samples, tokenizer {data.tokenizer_spec}")
        return 0
    try:
        result = train(cfg, resume=args.resume, env=env)
    except BaseException as exc:
        if env.world_size == 1:
            raise
        _leave_failed_rank(env.rank, exc)
    # Stopped by SIGINT/SIGTERM after saving: the shell's code for that signal (130, 143).
    code = 128 + result.interrupted if result.interrupted else 0
    if env.world_size > 1:
        # All work is done, checkpoints written and the process group destroyed. gloo has
        # been seen to abort a finished process in a C++ destructor at interpreter exit
        # ("terminate called without an active exception"), which the launcher would report
        # as a failure: leave without running the finalisers.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _leave_failed_rank(rank: int, exc: BaseException) -> NoReturn:
    """A rank of a multi-process run failed (or stopped because another did): report it
    and exit now. Interpreter finalisers could block on a dead peer's connection."""
    if isinstance(exc, PtdpError):
        print(f"ptdp train: error: rank {rank}: {exc}", file=sys.stderr)
    elif not isinstance(exc, KeyboardInterrupt):
        traceback.print_exception(exc)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130 if isinstance(exc, KeyboardInterrupt) else 2 if isinstance(exc, PtdpError) else 1)


def _cmd_preprocess(args: argparse.Namespace) -> int:
    from ptdp.data.preprocess import preprocess

    result = preprocess(
        args.input,
        args.output_prefix,
        args.tokenizer,
        vocab_size=args.vocab_size,
        workers=args.workers,
    )
    print(
        f"wrote {result.prefix}.bin/.idx: {result.num_docs:,} documents, "
        f"{result.num_tokens:,} tokens, vocabulary {result.vocab_size}"
    )
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from ptdp.parallel.comm import Group
    from ptdp.parallel.env import LaunchEnv, init_process_group, pick_device
    from ptdp.sample import sample_from_checkpoint

    env, tp, device = LaunchEnv.from_environ(), None, args.device
    if env.world_size > 1:  # under torchrun: one tensor-parallel group of all processes
        device = pick_device(args.device, env.local_rank)
        init_process_group(env, device)
        tp = Group(None, env.world_size, env.rank)
    texts = sample_from_checkpoint(
        Path(args.checkpoint),
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        num_samples=args.num_samples,
        seed=args.seed,
        device=str(device),
        use_cache=not args.no_kv_cache,
        tp=tp,
    )
    for text in texts if env.rank == 0 else []:
        print(text)
        print("-" * 72)
    if env.world_size > 1:  # as after `ptdp train`: skip gloo's finalisers at exit
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from ptdp.checkpoint import describe_checkpoint

    print(describe_checkpoint(args.checkpoint))
    return 0


def _cmd_schedule(args: argparse.Namespace) -> int:
    from ptdp.pipeline.schedules import add_comms, build, in_flight_bound
    from ptdp.pipeline.verify import ScheduleError, format_table, verify

    pp, m, vpp = args.pp, args.microbatches, args.vpp
    try:
        plan = build(args.schedule, pp, m, vpp)
        lowered = add_comms(plan, pp, vpp)
        bound = in_flight_bound(args.schedule, pp, m, vpp)
        report = verify(lowered, pp, vpp, m, max_in_flight=bound)
    except (ValueError, ScheduleError) as exc:
        print(f"ptdp schedule: error: {exc}", file=sys.stderr)
        return 2
    print(format_table(plan if args.no_comms else lowered))
    theory = (pp - 1) / (vpp * m) if args.schedule != "zb-h1" else (pp - 1) / (3 * m)
    print(
        f"\n{args.schedule}: pp={pp} vpp={vpp} microbatches={m} | unit-cost makespan "
        f"{report.makespan} (ideal {report.ideal}) | bubble {report.bubble_fraction:.4f} "
        f"(theory {theory:.4f}) | peak in-flight activations per rank "
        f"{list(report.peak_in_flight)}"
    )
    return 0


def _software(name: str):
    from ptdp.perf.costs import MEGATRON_2021, PTDP

    return MEGATRON_2021 if name == "megatron-2021" else PTDP


def _cmd_simulate(args: argparse.Namespace, overrides: list[str]) -> int:
    import json
    from dataclasses import replace

    from ptdp.config import RunConfig, apply_updates, load_toml, parse_overrides, resolve
    from ptdp.errors import ConfigError
    from ptdp.perf.hardware import load_system
    from ptdp.perf.paper import PRESETS, preset
    from ptdp.perf.report import format_prediction, prediction_dict, write_timeline
    from ptdp.perf.simulator import simulate

    if args.model:  # preset < TOML file < command line, as `resolve` does from the defaults
        if args.model not in PRESETS:
            raise ConfigError(f"unknown model {args.model!r}; presets: {', '.join(PRESETS)}")
        cfg = replace(RunConfig(), model=preset(args.model))
        cfg = load_toml(args.config, cfg) if args.config else cfg
        cfg = apply_updates(cfg, parse_overrides(overrides), "the command line")
    else:
        cfg = resolve(args.config, overrides)
    if cfg.model.vocab_size <= 0:
        raise ConfigError(
            "model.vocab_size = 0 (taken from the data when training); the simulator needs "
            "it: pass --model.vocab_size N"
        )
    system = load_system(args.device)
    par = cfg.parallel
    gpus = args.gpus or par.tp * par.pp * max(par.dp, 1)
    prediction = simulate(cfg, system, gpus, software=_software(args.software))
    out = Path(args.out or Path(cfg.train.run_dir) / "simulation")
    title = f"{system.name}: {prediction.layout.describe()} ({par.schedule.value})"
    png, trace = write_timeline(prediction, out, title)
    png_text = str(png) if png else "not drawn (pip install matplotlib)"
    if args.json:
        print(
            json.dumps(
                {**prediction_dict(prediction), "png": png and str(png), "trace": str(trace)}
            )
        )
    else:
        print(format_prediction(prediction, system))
        print(f"timeline: {png_text} | trace: {trace} (open in https://ui.perfetto.dev)")
    return 0


def _plan_base(args: argparse.Namespace):
    from dataclasses import replace

    from ptdp.config import RunConfig, apply_updates, load_toml
    from ptdp.perf.paper import PRESETS, preset

    if args.model in PRESETS:  # the paper's models in mixed precision
        base = replace(RunConfig(), model=preset(args.model))
        base = apply_updates(base, {"train": {"precision": "bf16"}}, "the paper presets")
    else:
        base = load_toml(args.model)
    updates: dict = {"train": {"global_batch_size": args.global_batch}}
    if args.vocab_size:
        updates["model"] = {"vocab_size": args.vocab_size}
    if args.precision:
        updates["train"]["precision"] = args.precision
    if args.distributed_optimizer:
        updates["optim"] = {"distributed": True}
    return apply_updates(base, updates, "the command line")


def _cmd_plan(args: argparse.Namespace) -> int:
    import json

    from tqdm import tqdm

    from ptdp.config import Recompute
    from ptdp.errors import ConfigError
    from ptdp.perf.hardware import load_system
    from ptdp.perf.planner import plan
    from ptdp.perf.report import format_plan, plan_dict

    base = _plan_base(args)
    if base.model.vocab_size <= 0:
        raise ConfigError(f"{args.model}: model.vocab_size is 0; pass --vocab-size V")
    system = load_system(args.device)
    bar = tqdm(total=0, desc="simulating layouts", unit="layout", file=sys.stderr, disable=None)

    def progress(done: int, total: int, what: str) -> None:
        bar.total = total
        bar.set_postfix_str(what)
        bar.update(done - bar.n)

    sp = {"auto": None, "on": True, "off": False}[args.sequence_parallel]
    result = plan(
        base,
        gpus=args.gpus,
        system=system,
        software=_software(args.software),
        tp=args.tp or None,
        pp=args.pp or None,
        vpp=args.vpp or None,
        micro_batch=args.micro_batch or None,
        recompute=None if args.recompute == "auto" else Recompute(args.recompute),
        sequence_parallel=sp,
        progress=progress,
    )
    bar.close()
    if args.json:
        print(json.dumps(plan_dict(result, args.top)))
    else:
        print(format_plan(result, system, args.top))
    return 0 if result.best else 1


def _cmd_convert(args: argparse.Namespace) -> int:
    from ptdp.convert import export_hf, import_hf

    if args.to:
        result = export_hf(args.src, args.out)
        print(f"wrote {result.family} model to {result.path} (transformers format)")
    else:
        result = import_hf(args.src, args.out, seq_length=args.seq_length)
        print(
            f"wrote {result.family} checkpoint {result.path}; train from it with\n"
            f"  ptdp train --config {args.out}/config.toml --resume --data.path PREFIX"
        )
    for note in result.notes:
        print(f"note: {note}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    try:
        if args.command == "train":
            return _cmd_train(args, rest)
        if args.command == "simulate":
            return _cmd_simulate(args, rest)
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        if args.command == "preprocess":
            return _cmd_preprocess(args)
        if args.command == "schedule":
            return _cmd_schedule(args)
        if args.command == "plan":
            return _cmd_plan(args)
        if args.command == "inspect":
            return _cmd_inspect(args)
        if args.command == "convert":
            return _cmd_convert(args)
        return _cmd_generate(args)
    except PtdpError as exc:
        print(f"ptdp {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ptdp {args.command}: interrupted", file=sys.stderr)
        return 130
