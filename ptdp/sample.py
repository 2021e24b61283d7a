"""Load a checkpoint with its tokenizer and sample text from it (`ptdp generate`).

Checkpoints are layout-free, so any of them loads into any generation layout: one
process holds the whole model; under torchrun, `pp` pipeline stages (`--pp`, default 1)
each hold a near-even share of the layers (stage 0 the embedding, the last one the output
layer), split tensor-parallel over tp = processes / pp ranks (any tp dividing the heads,
key/value groups and MLP width). Each process reads only its part of the checkpoint, and
every process returns the same texts, those of one process for the same seed.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

from ptdp.checkpoint import find_checkpoint, load_config
from ptdp.checkpoint.partial import load_model_weights, read_scalar
from ptdp.checkpoint.store import damaged_advice, verify_file
from ptdp.config.sections import ParallelConfig, RunConfig
from ptdp.data.tokenizers import Tokenizer, load_tokenizer
from ptdp.errors import CheckpointError, ConfigError
from ptdp.model.generate import generate
from ptdp.model.gpt import GPT
from ptdp.model.pipeline_generate import StagePeers, generate_pipelined
from ptdp.parallel.comm import Group, world_group
from ptdp.parallel.env import LaunchEnv, init_process_group, pick_device
from ptdp.parallel.mesh import MeshShape, ParallelMesh
from ptdp.pipeline.partition import layer_ranges, near_even_split
from ptdp.rules.domains import FRACTION, NON_NEGATIVE
from ptdp.rules.layout import validate


def split_processes(world_size: int, pp: int) -> int:
    """The tensor-parallel size tp = world_size / pp; refuses a pp that does not divide."""
    if pp < 1:
        raise ConfigError(f"--pp {pp}: the number of pipeline stages must be 1 or more")
    if world_size % pp:
        raise ConfigError(
            f"--pp {pp} pipeline stages do not divide {world_size} process(es); launch a "
            f"multiple of pp processes (e.g. torchrun --nproc-per-node {max(pp, 1)} -m ptdp "
            f"generate ... --pp {max(pp, 1)}), tp being processes / pp"
        )
    return world_size // pp


def check_sampling(
    prompt: str, max_new_tokens: int, temperature: float, top_k: int, top_p: float, samples: int
) -> None:
    """Refuse sampling options that cannot work, naming the option and the valid range."""
    for flag, value in (("--max-new-tokens", max_new_tokens), ("--num-samples", samples)):
        if value < 1:
            raise ConfigError(f"{flag} {value} must be 1 or more")
    if not NON_NEGATIVE.holds(temperature):  # finite too: inf would sample uniformly
        raise ConfigError(f"--temperature {temperature} must be a finite number >= 0 (0 = greedy)")
    if top_k < 0:
        raise ConfigError(f"--top-k {top_k} must be >= 0 (0 = all tokens)")
    if not FRACTION.holds(top_p):
        raise ConfigError(f"--top-p {top_p} must be in (0, 1] (1 = off)")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:  # argv bytes that are not UTF-8 arrive as surrogates
        raw = prompt[exc.start : exc.end].encode("utf-8", "surrogateescape")
        bad = ", ".join(f"0x{b:02x}" for b in raw)
        raise ConfigError(
            f"--prompt is not valid UTF-8 text (byte {bad} at character {exc.start}); pass "
            "UTF-8 text, e.g. run the shell with a UTF-8 locale (LANG=C.UTF-8) or convert the "
            "prompt's file with `iconv -t UTF-8`"
        ) from None


def fit_prompt(ids: list[int], context: int) -> tuple[list[int], str]:
    """The prompt's last `context` tokens, and a note naming what was cut ("" if nothing).

    The model reads at most its context (model.seq_length) to pick a token, so the tokens
    before the last `context` would never be read; generation goes on from the rest, its
    window sliding over the new tokens (`ptdp.model.generate`)."""
    if len(ids) <= context:
        return ids, ""
    dropped = len(ids) - context
    return ids[-context:], (
        f"the prompt has {len(ids)} tokens, more than the model's context of {context} "
        f"(model.seq_length); it is cut to its last {context} ({dropped} dropped), where the "
        "printed text starts"
    )


def stage_layers(cfg: RunConfig, step_dir: Path, tp: int, pp: int) -> list[range]:
    """Each stage's layers (`near_even_split`: up to two more stages than layers, the last
    and then the first holding none), after checking that the checkpoint's model splits into
    pp stages over tp ranks; pure, so it runs before any process group."""
    n = cfg.model.num_layers
    split = near_even_split(n, pp)
    if split is None:
        raise ConfigError(
            f"{step_dir}'s model has {n} layers, too few for --pp {pp} stages (at least one "
            f"layer on each but the first and the last); use --pp {n + 2} or fewer"
        )
    if tp * pp == 1:  # the whole model, as trained
        return [range(n)]
    parallel = ParallelConfig(tp=tp, pp=pp, dp=1, pipeline_layers=split if pp > 1 else ())
    try:  # only the layout's rules can fail: the run trained with this model
        validate(dataclasses.replace(cfg, parallel=parallel), tp * pp)
    except ConfigError as exc:
        raise ConfigError(
            f"cannot split {step_dir}'s model over tp={tp} x pp={pp} processes (--pp {pp}, "
            f"tp = processes / pp; parallel.* below are these): {exc}"
        ) from None
    return layer_ranges(n, pp, 1, split)


def launch_generation(path: Path, device: str, pp: int = 1) -> tuple[ParallelMesh | None, str]:
    """Under torchrun or srun, the generation mesh (tp = processes / pp, stages slowest) and
    this rank's device, the layout checked against the checkpoint before the process group
    starts; (None, device) for one process."""
    env = LaunchEnv.from_environ()
    tp = split_processes(env.world_size, pp)
    if env.world_size == 1:
        return None, str(pick_device(device, 0))
    step_dir = find_checkpoint(path)
    stage_layers(load_config(step_dir), step_dir, tp, pp)
    picked = pick_device(device, env.local_rank)
    init_process_group(env, picked)
    return ParallelMesh.build(MeshShape(tp=tp, pp=pp), env.rank), str(picked)


def load_model(step_dir: Path, device: str = "cpu", mesh: ParallelMesh | None = None) -> GPT:
    """The checkpoint's model whole, or (with `mesh`) this rank's pipeline stage of it,
    split over its tensor-parallel group; every rank of `mesh` calls this together."""
    cfg = load_config(step_dir)
    tp, pp = (1, 1) if mesh is None else (mesh.size("tp"), mesh.size("pp"))
    ranges = stage_layers(cfg, step_dir, tp, pp)
    stage = 0 if mesh is None else mesh.coord("pp")
    group = mesh.axis("tp") if mesh is not None and tp > 1 else None
    model = GPT(
        cfg.model,
        seed=cfg.train.seed,
        tp=group,
        etp=group,  # experts split like the MLPs: generation holds 1/tp of them per rank
        layers=ranges[stage],
        has_embedding=stage == 0,
        has_head=stage == pp - 1,
    )
    world = world_group() if mesh is not None else Group.single()
    load_model_weights([model], step_dir, group or Group.single(), world)
    return model.to(device)


def stage_peers(mesh: ParallelMesh) -> StagePeers:
    """This rank's pipeline: its stage group and every stage's rank at its tp coordinate."""
    tp = mesh.coord("tp")
    ranks = tuple(mesh.shape.rank_of(tp=tp, dp=0, pp=i) for i in range(mesh.size("pp")))
    return StagePeers(mesh.axis("pp"), ranks)


def checkpoint_tokenizer(step_dir: Path, entry: str) -> Tokenizer:
    """The checkpoint's tokenizer, checked as training checks the data's: its file against
    checksums.json, its vocabulary against the model's (an id the model has no row for
    cannot be encoded)."""
    if entry != "bytes":
        problem = verify_file(step_dir, entry)
        if problem:
            raise CheckpointError(f"{problem}; {damaged_advice(step_dir)}")
    tokenizer = load_tokenizer("bytes" if entry == "bytes" else str(step_dir / entry))
    vocab = load_config(step_dir).model.vocab_size
    if tokenizer.vocab_size > vocab:
        raise CheckpointError(
            f"the tokenizer of {step_dir} ({tokenizer.name}) has {tokenizer.vocab_size} tokens "
            f"but the model's model.vocab_size is {vocab}, so ids {vocab}.."
            f"{tokenizer.vocab_size - 1} have no embedding: the tokenizer is not the one it "
            "was trained with; copy the checkpoint's own tokenizer.json back"
        )
    return tokenizer


def sample_from_checkpoint(
    path: Path,
    prompt: str,
    *,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 50,
    top_p: float = 0.95,
    num_samples: int = 1,
    seed: int = 0,
    device: str = "cpu",
    use_cache: bool = True,
    mesh: ParallelMesh | None = None,
) -> list[str]:
    """Texts continuing `prompt` (cut to the model's context, with a note on stderr: see
    `fit_prompt`); with `mesh` (every rank calls this together), sampled by the pipeline of
    its stages over tensor groups, the same texts on every rank."""
    check_sampling(prompt, max_new_tokens, temperature, top_k, top_p, num_samples)
    step_dir = find_checkpoint(path)
    entry = read_scalar(step_dir, "tokenizer", "")
    if not entry:
        raise CheckpointError(
            f"{step_dir} records no tokenizer (its data was preprocessed elsewhere); "
            "train with --data.tokenizer PATH/tokenizer.json to make it self-contained"
        )
    tokenizer = checkpoint_tokenizer(step_dir, entry)
    model = load_model(step_dir, device, mesh)
    ids, note = fit_prompt(
        tokenizer.encode(prompt) if prompt else [tokenizer.eod_id], model.cfg.seq_length
    )
    if note and (mesh is None or mesh.rank == 0):
        print(f"note: {note}", file=sys.stderr)
    tokens = torch.tensor([ids] * num_samples, device=device)
    options = dict(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generator=torch.Generator().manual_seed(seed),
        stop_token=None,
        use_cache=use_cache,
    )
    if mesh is not None and mesh.size("pp") > 1:
        out = generate_pipelined(model, stage_peers(mesh), tokens, max_new_tokens, **options)
    else:
        out = generate(model, tokens, max_new_tokens, **options)
    return [tokenizer.decode(row.tolist()) for row in out]
