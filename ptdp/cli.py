"""`ptdp train|preprocess|generate|schedule|simulate|plan|calibrate|convert|inspect|
config-reference`: the only place that reads argv.

Parsing and printing only. Each subparser names the function that runs it
(`set_defaults(run=...)`); commands import what they use when they run, so `ptdp --help`
stays fast. Commands that take a config (train, simulate, plan) read it the same way:
`--config FILE` (TOML) and `--section.key value` overrides, resolved by `ptdp.config.files.resolve`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ptdp import __version__
from ptdp.errors import PtdpError, report_error

Subparsers = argparse._SubParsersAction

TORCHRUN = """

Under torchrun (or srun alone), every process runs this same command and becomes one rank:
  torchrun --nproc-per-node 2 -m ptdp train --config configs/demo.toml
"""

PERF_EPILOG = (
    "Configuration: --model (a preset or a TOML file) < --config FILE < --section.key value "
    "overrides, with the keys of `ptdp train --help`."
)

CONVERT_DESCRIPTION = (
    "--to hf CKPT OUT: write a checkpoint (run or step directory) as a transformers model "
    "directory (config.json, the weights in safetensors files of at most --max-shard-size "
    "with their index, tokenizer.json), reading one layer at a time. --from hf DIR OUT: make "
    "OUT a run directory whose step-0 checkpoint holds the model, with no optimizer state; "
    "train from it in any layout with `ptdp train --config OUT/config.toml --resume "
    "--data.path PREFIX`."
)

CHECKPOINT_HELP = "a run directory (uses its latest checkpoint) or a step directory"


def _opt(
    p: argparse._ActionsContainer, flags: str, default: float | str, help: str, **kw: object
) -> None:
    """An option (`flags`: its spellings) of its default's type, the default shown in the help."""
    kw.setdefault("type", type(default))
    p.add_argument(*flags.split(), default=default, help=f"{help} (default: {default})", **kw)


def _train_parser(sub: Subparsers) -> None:
    from ptdp.config.files import help_text

    p = sub.add_parser(
        "train",
        help="train a model (one process, or one rank under torchrun or srun)",
        description="Train a GPT model on preprocessed data.",
        epilog=help_text() + TORCHRUN,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # so that --section.key overrides never match an option prefix
    )
    p.set_defaults(run=_cmd_train, overrides_ok=True)
    _model_option(p)
    p.add_argument("--config", metavar="FILE", help="TOML config file (see configs/)")
    resume = "continue from the latest checkpoint in train.run_dir (start fresh if none)"
    p.add_argument("--resume", action="store_true", help=resume)
    dry = "validate the config and data, print the resolved config and layout, and exit"
    p.add_argument("--dry-run", action="store_true", help=dry)
    world = "with --dry-run: check the layout for N processes (default: this launch's)"
    p.add_argument("--world-size", type=int, default=0, metavar="N", help=world)


def _preprocess_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "preprocess",
        help="tokenize text, JSON lines, Parquet, Arrow or saved datasets into an indexed dataset",
        description=(
            "Tokenize plain-text files (one document per file), JSON lines, Parquet or Arrow "
            "files or datasets.save_to_disk folders (one document per line or row) into PREFIX"
            ".bin/.idx (Megatron-LM's format), tokenizer.json and PREFIX.json naming it."
        ),
    )
    p.set_defaults(run=_cmd_preprocess)
    inputs = "files or directories (*.txt, *.jsonl, *.json, *.parquet, *.arrow, saved datasets)"
    p.add_argument("--input", nargs="+", required=True, metavar="FILE_OR_DIR", help=inputs)
    prefix = "output path without extension, e.g. data/shakespeare/shakespeare"
    p.add_argument("--output-prefix", required=True, metavar="PREFIX", help=prefix)
    tokenizer = "raw bytes, a BPE trained on the input, a tokenizer.json or an HF model directory"
    _opt(p, "--tokenizer", "bpe", tokenizer, metavar="bytes|bpe|PATH")
    _opt(p, "--text-key", "text", "field or column holding the text (JSON, tables)", metavar="K")
    _opt(p, "--vocab-size", 4096, "vocabulary of the trained BPE", metavar="N")
    _opt(p, "--workers", 1, "tokenizer processes", metavar="N")


def _generate_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "generate",
        help="sample text from a checkpoint",
        description="Sample text from a trained checkpoint, with a KV cache. Launched "
        "with torchrun --nproc-per-node N, the N processes form --pp pipeline stages (a "
        "near-even share of the layers each; up to layers + 2 stages, the last and then the "
        "first holding none), each split tensor-parallel over N / pp ranks "
        "(dividing the heads, key/value groups and MLP width); rank 0 prints the texts one "
        "process would.",
    )
    p.set_defaults(run=_cmd_generate)
    p.add_argument("--checkpoint", required=True, metavar="PATH", help=CHECKPOINT_HELP)
    prompt = (
        "text to continue (default: empty); one longer than the model's context "
        "(model.seq_length) is cut to its last tokens, with a note"
    )
    p.add_argument("--prompt", default="", help=prompt)
    _opt(p, "--max-new-tokens", 200, "tokens to generate", metavar="N")
    _opt(p, "--temperature", 0.8, "softmax temperature; 0 = greedy")
    _opt(p, "--top-k", 50, "sample from the k likeliest (0 = all)")
    _opt(p, "--top-p", 0.95, "nucleus sampling mass (1 = off)")
    _opt(p, "--num-samples", 1, "independent samples of the same prompt", metavar="N")
    _opt(p, "--seed", 0, "sampling seed: same seed, same text")
    _opt(p, "--device", "cpu", "cpu or cuda")
    _opt(p, "--pp", 1, "pipeline stages under torchrun (tp = processes / pp)", metavar="N")
    no_cache = "recompute the whole context for every new token (slower; for comparison)"
    p.add_argument("--no-kv-cache", action="store_true", help=no_cache)


def _inspect_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "inspect",
        help="show what a checkpoint holds",
        description="Print a checkpoint's step, model config and layout, tensors (names, "
        "shapes, dtypes, sizes), optimizer state and tokenizer.",
    )
    p.set_defaults(run=_cmd_inspect)
    p.add_argument("checkpoint", metavar="CKPT", help=CHECKPOINT_HELP)


def _schedule_parser(sub: Subparsers) -> None:
    from ptdp.pipeline.schedules import SCHEDULES

    width = max(len(s.formula) for s in SCHEDULES.values())
    p = sub.add_parser(
        "schedule",
        help="print a pipeline schedule's per-rank actions and check it",
        description=(  # wrapped here: the raw formatter keeps the epilog's table
            "Build a pipeline schedule, add its sends and receives, verify it (dependencies,\n"
            "matching sends/receives, no deadlock, in-flight activations) and print the\n"
            "step x rank table with its unit-cost bubble. No cluster needed."
        ),
        epilog="schedules (bubble under unit costs):\n"
        + "\n".join(f"  {n:<12} {s.formula:<{width}} {s.doc}" for n, s in SCHEDULES.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(run=_cmd_schedule)
    _opt(p, "--schedule --parallel.schedule", "1f1b", "schedule name", choices=list(SCHEDULES))
    _opt(p, "--pp --parallel.pp", 4, "pipeline ranks")
    vpp = "model chunks per rank; >= 2 for interleaved (default: 2 for zb-v and dualpipev, else 1)"
    p.add_argument("--vpp", "--parallel.vpp", type=int, default=None, help=vpp)
    _opt(p, "--microbatches", 8, "microbatches per pipeline per step", metavar="M")
    no_comms = "show compute actions only (no SEND/RECV rows)"
    p.add_argument("--no-comms", action="store_true", help=no_comms)
    p.add_argument("--moe-overlap", action="store_true", help="parallel.moe_overlap's pairs")
    layers = "each stage's layers (the first and last may be 0): a replay costing them"
    _opt(p, "--layers --parallel.pipeline_layers", "", layers, metavar="A,B,..")
    _opt(p, "--end-costs", "1,1", "with --layers: embedding, loss cost in layers", metavar="E,H")


def _model_option(p: argparse.ArgumentParser) -> None:
    from ptdp.perf.validate.paper import MODEL_HELP

    p.add_argument("--model", default="", metavar="NAME|FILE", help=MODEL_HELP)


def _perf_parser(sub: Subparsers, name: str, **kw: str) -> argparse.ArgumentParser:
    """`simulate` and `plan`: a model and its config, a cluster, a runtime."""
    from ptdp.perf.cost.hardware_file import list_systems
    from ptdp.perf.cost.software import SOFTWARE

    p = sub.add_parser(name, allow_abbrev=False, **kw)
    _model_option(p)
    p.add_argument("--config", metavar="FILE", help="TOML config file, applied over --model")
    systems = f"cluster: {', '.join(list_systems())} or a hardware TOML"
    _opt(p, "--device", "a100-80gb", systems, metavar="NAME|FILE")
    software = "kernels and overlap of this runtime, or the paper's Megatron-LM/DeepSpeed runs"
    _opt(p, "--software", "ptdp", software, choices=list(SOFTWARE))
    load = "mixture of experts: the busiest expert's load over the mean, scaling expert GEMMs"
    _opt(p, "--moe-load-imbalance", 1.0, load, metavar="X")
    start = "the start whose host memory is checked (any: the larger of hf and resume)"
    _opt(p, "--start", "any", start, choices=["any", "hf", "resume", "scratch"])
    host = "the node's host memory in GiB, shared by its GPUs (default: the hardware file's)"
    p.add_argument("--host-memory-gib", type=float, metavar="GIB", help=host)
    p.add_argument("--json", action="store_true", help=f"print the {name} result as JSON")
    return p


def _simulate_parser(sub: Subparsers) -> None:
    p = _perf_parser(
        sub,
        "simulate",
        help="predict step time, TFLOP/s, bubble and memory of a config on a cluster",
        description=(
            "Replay the config's pipeline schedule (its exact per-rank action lists) with a "
            "compute and communication model of a cluster: prints the predicted iteration "
            "time, TFLOP/s per GPU, bubble and memory per GPU, and writes the timeline as a "
            "PNG and a Chrome trace (open it in https://ui.perfetto.dev). No GPU needed."
        ),
        epilog=PERF_EPILOG,
    )
    p.set_defaults(run=_cmd_perf, overrides_ok=True)
    gpus = "world size (default: tp * cp * pp * dp, with dp = 1 if it is 0)"
    p.add_argument("--gpus", type=int, default=None, metavar="N", help=gpus)
    out = "where timeline.png and trace.json go (default: train.run_dir/simulation)"
    p.add_argument("--out", default="", metavar="DIR", help=out)


def _plan_parser(sub: Subparsers) -> None:
    from ptdp.perf.plan.keys import OLD_PLAN_FLAGS, PLAN_DESCRIPTION, PLAN_EPILOG

    p = _perf_parser(
        sub,
        "plan",
        help="search the parallel layouts that fit and rank them by predicted throughput",
        description=PLAN_DESCRIPTION,
        epilog=PERF_EPILOG + PLAN_EPILOG,
    )
    p.set_defaults(run=_cmd_perf, overrides_ok=True)
    p.add_argument("--gpus", type=int, required=True, metavar="N", help="number of GPUs")
    _opt(p, "--top", 5, "layouts to list")
    mine = "rank this layout too (a TOML file; alone: --config's and the overrides') with the gain"
    p.add_argument("--compare", nargs="?", const="", metavar="CONFIG", help=mine)
    old = p.add_argument_group("old spellings, each of a config key (0 or auto: searched)")
    for flag, key in OLD_PLAN_FLAGS.items():
        old.add_argument(flag, dest=key, metavar="V", help=f"--{key} V")
    on, key = {"action": "store_const", "const": "true"}, "optim.distributed"
    old.add_argument("--distributed-optimizer", dest=key, help=f"--{key} true", **on)


def _calibrate_parser(sub: Subparsers) -> None:
    from ptdp.perf.calibrate.calibration_file import DESCRIPTION

    help = "time this machine's kernels and links; write a cluster TOML for --device"
    p = sub.add_parser("calibrate", help=help, description=DESCRIPTION)
    p.set_defaults(run=_cmd_calibrate)
    _opt(p, "--out", "", "cluster TOML to write (runs/calibration/<device>.toml)", metavar="FILE")
    p.add_argument("--quick", action="store_true", help="a coarse pass of a few seconds")
    base = "built-in cluster (or file) whose links one process keeps; auto: this GPU's own"
    _opt(p, "--base", "auto", base, metavar="NAME|FILE|none")
    precision = "of GEMMs and attention (auto: bf16 on CUDA, fp32 on CPU)"
    _opt(p, "--precision", "auto", precision, choices=["auto", "fp32", "bf16", "fp16"])


def _convert_parser(sub: Subparsers) -> None:
    help = "convert a checkpoint to or from a Hugging Face transformers model"
    p = sub.add_parser("convert", help=help, description=CONVERT_DESCRIPTION)
    p.set_defaults(run=_cmd_convert)
    way = p.add_mutually_exclusive_group(required=True)
    way.add_argument("--to", choices=["hf"], help="export a ptdp checkpoint")
    way.add_argument("--from", dest="source", choices=["hf"], help="import into a ptdp run")
    p.add_argument("src", metavar="SRC", help="checkpoint (--to) or model directory (--from)")
    p.add_argument("out", metavar="OUT", help="model directory (--to) or run directory (--from)")
    seq = "--from: training context length (default: the model's maximum positions)"
    p.add_argument("--seq-length", type=int, default=0, metavar="N", help=seq)
    p.add_argument("--overwrite", action="store_true", help="--to: into an OUT holding files")
    shard = "--to: the most bytes of one weights file, e.g. 500MB (default 5GB, as transformers)"
    p.add_argument("--max-shard-size", type=_size, default="5GB", metavar="SIZE", help=shard)


def _size(text: str) -> int:
    from ptdp.convert.safetensors_out import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _config_reference_parser(sub: Subparsers) -> None:
    from ptdp.config.reference import DESCRIPTION

    help = "print the reference of every config key (Markdown, docs/configuration.md)"
    p = sub.add_parser("config-reference", help=help, description=DESCRIPTION)
    p.set_defaults(run=_cmd_config_reference)
    output = "write the page to PATH instead of printing it (e.g. docs/configuration.md)"
    p.add_argument("--output", metavar="PATH", help=output)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ptdp",
        description="Train GPT language models with tensor, pipeline and data parallelism.",
    )
    parser.add_argument("--version", action="version", version=f"ptdp {__version__}")
    parser.set_defaults(overrides_ok=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = (_train_parser, _preprocess_parser, _generate_parser, _inspect_parser)
    perf = (_schedule_parser, _simulate_parser, _plan_parser, _calibrate_parser)
    for add in (*commands, *perf, _convert_parser, _config_reference_parser):
        add(sub)
    return parser


def _cmd_train(args: argparse.Namespace) -> int:
    from ptdp.config.files import given_keys
    from ptdp.parallel.env import LaunchEnv, exit_now, leave_failed_rank
    from ptdp.perf.validate.paper import perf_config
    from ptdp.train.run import dry_run, train

    cfg = perf_config(args.model, args.config, args.overrides)
    env = LaunchEnv.from_environ()
    given = given_keys(args.config, args.overrides)  # checked by checkpoint.init_from
    if args.dry_run:
        if args.world_size:
            env = LaunchEnv(rank=0, world_size=args.world_size, local_rank=0)
        print(dry_run(cfg, env, given=given))
        return 0
    try:
        result = train(cfg, resume=args.resume, env=env, given=given, config_file=args.config)
    except BaseException as exc:
        if env.world_size == 1:
            raise
        leave_failed_rank("train", env.rank, exc)
    # Stopped by SIGINT/SIGTERM after saving: the shell's code for that signal (130, 143).
    code = 128 + result.interrupted if result.interrupted else 0
    if env.world_size > 1:  # all done: leave without gloo's finalisers
        exit_now(code)
    return code


def _cmd_preprocess(args: argparse.Namespace) -> int:
    from ptdp.data.preprocess import preprocess

    result = preprocess(
        args.input,
        args.output_prefix,
        args.tokenizer,
        vocab_size=args.vocab_size,
        workers=args.workers,
        text_key=args.text_key,
    )
    print(result)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from ptdp.parallel.env import exit_now
    from ptdp.sample import launch_generation, sample_from_checkpoint

    mesh, device = launch_generation(Path(args.checkpoint), args.device, args.pp)
    sampling = ("max_new_tokens", "temperature", "top_k", "top_p", "num_samples", "seed")
    texts = sample_from_checkpoint(
        Path(args.checkpoint),
        args.prompt,
        **{key: getattr(args, key) for key in sampling},
        device=str(device),
        use_cache=not args.no_kv_cache,
        mesh=mesh,
    )
    for text in texts if mesh is None or mesh.rank == 0 else []:
        print(text)
        print("-" * 72)
    if mesh is not None:  # as after `ptdp train`: skip gloo's finalisers at exit
        exit_now(0)
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from ptdp.checkpoint import describe_checkpoint

    print(describe_checkpoint(args.checkpoint))
    return 0


def _cmd_schedule(args: argparse.Namespace) -> int:
    from ptdp.pipeline.report import schedule_report

    a = args
    try:
        kw = dict(comms=not a.no_comms, layers=a.layers, ends=a.end_costs, paired=a.moe_overlap)
        print(schedule_report(a.schedule, a.pp, a.microbatches, a.vpp, **kw))
    except ValueError as exc:  # a ScheduleError too
        print(f"ptdp schedule: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _cmd_perf(args: argparse.Namespace) -> int:  # simulate and plan
    from ptdp.perf import commands

    return (commands.run_simulate if args.command == "simulate" else commands.run_plan)(args)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from ptdp.perf.calibrate.measure import run_calibrate

    return run_calibrate(args.out, quick=args.quick, base=args.base, precision=args.precision)


def _cmd_convert(args: argparse.Namespace) -> int:
    from ptdp.convert import export_hf, import_hf

    if args.to:
        sizes = {"overwrite": args.overwrite, "shard_bytes": args.max_shard_size}
        result = export_hf(args.src, args.out, **sizes)
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


def _cmd_config_reference(args: argparse.Namespace) -> int:
    from ptdp.config.reference import write

    write(args.output)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and not args.overrides_ok:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.overrides = rest
    try:
        return args.run(args)
    except PtdpError as exc:
        report_error(f"ptdp {args.command}: error: {exc}")
        return 2
    except KeyboardInterrupt as exc:  # ptdp train's Interrupted says what was lost
        print(f"ptdp {args.command}: interrupted{f': {exc}' if str(exc) else ''}", file=sys.stderr)
        return 130
