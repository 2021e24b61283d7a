"""`ptdp train | preprocess | generate | schedule`: the only place that reads argv."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

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
        description="Sample text from a trained checkpoint.",
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
    _schedule_parser(sub)
    return parser


def _cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from ptdp.config import resolve, to_toml
    from ptdp.parallel.env import LaunchEnv
    from ptdp.train.trainer import prepare, train

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
    train(cfg, resume=args.resume, env=env)
    if env.world_size > 1:
        # All work is done, checkpoints written and the process group destroyed. gloo has
        # been seen to abort a finished process in a C++ destructor at interpreter exit
        # ("terminate called without an active exception"), which the launcher would report
        # as a failure: leave without running the finalisers.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


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
    from ptdp.model.sample import sample_from_checkpoint

    for text in sample_from_checkpoint(
        Path(args.checkpoint),
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        num_samples=args.num_samples,
        seed=args.seed,
        device=args.device,
    ):
        print(text)
        print("-" * 72)
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    try:
        if args.command == "train":
            return _cmd_train(args, rest)
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        if args.command == "preprocess":
            return _cmd_preprocess(args)
        if args.command == "schedule":
            return _cmd_schedule(args)
        return _cmd_generate(args)
    except PtdpError as exc:
        print(f"ptdp {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ptdp {args.command}: interrupted", file=sys.stderr)
        return 130
