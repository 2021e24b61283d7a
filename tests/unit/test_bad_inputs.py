"""Bad inputs: each is refused with ptdp's own error type and a message that names the
problem and the fix, before any process group exists; a full disk during a save keeps
the previous checkpoint as `latest`."""

from __future__ import annotations

import errno
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import ptdp.checkpoint as ckpt
from ptdp.cli import main
from ptdp.config.files import resolve
from ptdp.convert.hf import export_hf, import_hf
from ptdp.data.tokenizers import train_bpe
from ptdp.errors import CheckpointError, ConfigError, DataError, PtdpError
from ptdp.parallel.env import LaunchEnv
from ptdp.perf.cost.hardware_file import BUILTIN_DIR, load_system
from ptdp.perf.cost.software import MEGATRON_2021
from ptdp.perf.plan.planner import plan
from ptdp.perf.simulate.simulator import simulate
from ptdp.sample import launch_generation, sample_from_checkpoint
from ptdp.train.run import train
from tests.helpers import make_corpus, tiny_config

TORCHRUN_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID")
"""Cleared before each launch case (SLURM_PROCID too: these cases are not srun tasks)."""


@dataclass
class Ctx:
    """What a case needs: a scratch directory, the shared tiny dataset, a saved run."""

    tmp: Path
    data: str
    saved: Path
    monkeypatch: pytest.MonkeyPatch

    @property
    def run(self) -> Path:
        return self.tmp / "run"

    def train(self, world: int = 1, resume: bool = False, **sections: dict) -> None:
        cfg = tiny_config(self.data, self.run, **sections)
        train(cfg, resume=resume, env=LaunchEnv(rank=0, world_size=world, local_rank=0))

    def copy_data(self, keep_sidecar: bool = True) -> str:
        """A private copy of the tiny dataset to damage; returns its prefix."""
        prefix = self.tmp / "data" / "tiny"
        prefix.parent.mkdir(parents=True)
        for ext in ("bin", "idx", "json") if keep_sidecar else ("bin", "idx"):
            shutil.copyfile(f"{self.data}.{ext}", f"{prefix}.{ext}")
        self.data = str(prefix)
        return self.data

    def copy_run(self) -> Path:
        """A private copy of the saved one-step run; returns its step directory."""
        shutil.copytree(self.saved, self.run)
        return ckpt.find_checkpoint(self.run)


# ------------------------------------------------------------------ how to produce each


def _toml_unknown_key(c: Ctx) -> None:
    (c.tmp / "c.toml").write_text("[train]\nstep = 3\n")
    resolve(str(c.tmp / "c.toml"), [])


def _truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _truncated_idx(c: Ctx) -> None:
    c.copy_data()
    _truncate(Path(f"{c.data}.idx"), -8)
    c.train()


def _truncated_bin(c: Ctx) -> None:
    c.copy_data()
    _truncate(Path(f"{c.data}.bin"), 1000)
    c.train()


def _bad_magic(c: Ctx) -> None:
    c.copy_data()
    idx = Path(f"{c.data}.idx")
    idx.write_bytes(b"NOTANIDX!" + idx.read_bytes()[9:])
    c.train()


def _missing(ext: str) -> Callable[[Ctx], None]:
    def produce(c: Ctx) -> None:
        c.copy_data()
        Path(f"{c.data}.{ext}").unlink()
        c.train()

    return produce


def _data_path_with_extension(c: Ctx) -> None:
    c.data = c.data + ".bin"
    c.train()


def _ids_beyond_vocab(c: Ctx) -> None:
    c.copy_data(keep_sidecar=False)  # made elsewhere: no record of its vocabulary
    c.train(model={"vocab_size": 100})


def _tokenizer_mismatch(c: Ctx) -> None:
    make_corpus(c.tmp / "text", docs=2)
    tok = train_bpe(sorted((c.tmp / "text").glob("*.txt")), 300, c.tmp / "tokenizer.json")
    assert tok.vocab_size == 300
    c.train(data={"tokenizer": str(c.tmp / "tokenizer.json")})


def _corrupt_sidecar(c: Ctx) -> None:
    c.copy_data()
    Path(f"{c.data}.json").write_text("{not json")
    c.train()


def _latest_to_missing_dir(c: Ctx) -> None:
    shutil.rmtree(c.copy_run())
    c.train(resume=True, train={"steps": 2})


def _corrupt_metadata(c: Ctx) -> None:
    _truncate(c.copy_run() / ckpt.METADATA, 50)
    c.train(resume=True, train={"steps": 2})


def _shard(c: Ctx) -> Path:
    return next(c.copy_run().glob("*.distcp"))


def _missing_shard(c: Ctx) -> None:
    _shard(c).unlink()
    c.train(resume=True, train={"steps": 2})


def _truncated_shard(c: Ctx) -> None:
    _truncate(_shard(c), 100)
    c.train(resume=True, train={"steps": 2})


def _checksum_mismatch(c: Ctx) -> None:
    shard = _shard(c)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # same length, one bit flipped
    shard.write_bytes(bytes(data))
    c.train(resume=True, train={"steps": 2})


def _checkpoint_config_missing(c: Ctx) -> None:
    (c.copy_run() / "config.toml").unlink()
    c.train(resume=True, train={"steps": 2})


def _model_mismatch(c: Ctx) -> None:
    c.copy_run()
    c.train(resume=True, train={"steps": 2}, model={"hidden_size": 64})


def _run_dir_taken(c: Ctx) -> None:
    c.copy_run()
    c.train()


def _environ(c: Ctx, **values: str) -> None:
    for name in TORCHRUN_VARS:
        c.monkeypatch.delenv(name, raising=False)
    for name, value in values.items():
        c.monkeypatch.setenv(name, value)


def _no_torchrun(c: Ctx) -> None:
    """`ptdp train` with a 4-process layout, started as a plain process."""
    _environ(c)
    train(tiny_config(c.data, c.run, parallel={"tp": 4}))


def _world_size_alone(c: Ctx) -> None:
    _environ(c, WORLD_SIZE="4")
    train(tiny_config(c.data, c.run, parallel={"tp": 4}))


def _world_size_not_int(c: Ctx) -> None:
    _environ(c, WORLD_SIZE="four")
    train(tiny_config(c.data, c.run))


def _toml(c: Ctx, text: str | bytes) -> None:
    path = c.tmp / "c.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    resolve(str(path), [])


def _latest(c: Ctx, text: str | None) -> None:
    """The saved run with `latest` deleted (None) or replaced by `text`."""
    latest = c.copy_run().parent / ckpt.LATEST
    latest.unlink() if text is None else latest.write_text(text)


def _fresh_start_without_latest(c: Ctx) -> None:
    _latest(c, None)
    c.train()


def _checksums(c: Ctx, text: str | None) -> None:
    sums = c.copy_run() / "checksums.json"
    sums.unlink() if text is None else sums.write_text(text)
    c.train(resume=True, train={"steps": 2})


def _latest_lost_and_shard_missing(c: Ctx) -> None:
    step_dir = c.copy_run()
    (step_dir.parent / ckpt.LATEST).write_text("\n")
    next(step_dir.glob("*.distcp")).unlink()
    c.train(resume=True)


def _hf_config_not_json(c: Ctx) -> None:
    (_hf_dir(c) / "config.json").write_text("{oops")
    import_hf(c.tmp / "hf", c.tmp / "imported")


def _run_dir_under_a_file(c: Ctx) -> None:
    (c.tmp / "file").write_text("")
    c.train(train={"run_dir": str(c.tmp / "file" / "run")})


def _tokenizer_not_utf8(c: Ctx) -> None:
    (c.tmp / "t.json").write_bytes(b"\xff")
    c.train(data={"tokenizer": str(c.tmp / "t.json")})


def _ids_beyond_sidecar(c: Ctx) -> None:
    """The sidecar says vocabulary 257, but one token of the .bin is 300 (a damaged file)."""
    source = Path(c.data).parent / "tokenizer.json"
    c.copy_data()
    shutil.copyfile(source, Path(c.data).parent / "tokenizer.json")
    tokens = np.memmap(f"{c.data}.bin", dtype=np.uint16, mode="r+")
    tokens[len(tokens) // 2] = 300
    tokens.flush()
    del tokens
    c.train()


def _hf_dir(c: Ctx) -> Path:
    """The saved run exported as a Hugging Face model directory."""
    return export_hf(c.saved, c.tmp / "hf").path


def _truncated_safetensors(c: Ctx, keep: int) -> Path:
    hf = _hf_dir(c)
    _truncate(hf / "model.safetensors", keep)
    return hf


def _hardware(c: Ctx, old: str, new: str, prepend: str = "") -> None:
    text = (BUILTIN_DIR / "a100-80gb.toml").read_text()
    assert old in text
    (c.tmp / "hw.toml").write_text(prepend + text.replace(old, new))
    load_system(c.tmp / "hw.toml")


def _sample(c: Ctx, prompt: str = "", **options: float) -> None:
    sample_from_checkpoint(c.saved, prompt, **{"max_new_tokens": 2, **options})


def _rank_out_of_range(c: Ctx) -> None:
    _environ(c, WORLD_SIZE="4", RANK="4", LOCAL_RANK="0", MASTER_ADDR="x", MASTER_PORT="1")
    train(tiny_config(c.data, c.run, parallel={"tp": 4}))


# Each row: id, how to produce it, the exact error type, fragments of the message
# (the problem, then the fix: a key, a file, a command).
CASES: list[tuple[str, Callable[[Ctx], None], type[PtdpError], tuple[str, ...]]] = [
    # ---- configs
    (
        "unknown-key",
        lambda c: resolve(None, ["--model.num_layer", "2"]),
        ConfigError,
        ("unknown key 'model.num_layer'", "did you mean 'num_layers'"),
    ),
    (
        "unknown-key-in-toml",
        _toml_unknown_key,
        ConfigError,
        ("unknown key 'train.step'", "c.toml", "did you mean 'steps'"),
    ),
    (
        "missing-config-file",
        lambda c: resolve(str(c.tmp / "nope.toml"), []),
        ConfigError,
        ("nope.toml does not exist", "see configs/"),
    ),
    (
        "wrong-type",
        lambda c: resolve(None, ["--model.num_layers", "two"]),
        ConfigError,
        ("model.num_layers = 'two' is not an integer", "use a whole number"),
    ),
    (
        "bad-enum",
        lambda c: resolve(None, ["--parallel.schedule", "interleave"]),
        ConfigError,
        ("parallel.schedule = 'interleave' is not valid", "did you mean 'interleaved'"),
    ),
    (
        "bad-enum-listed",
        lambda c: resolve(None, ["--train.on_nan", "rewind"]),
        ConfigError,
        ("train.on_nan = 'rewind' is not valid", "skip, stop, rollback, retry"),
    ),
    (
        "cuda-graphs-on-cpu",
        lambda c: c.train(train={"cuda_graphs": True, "device": "cpu"}),
        ConfigError,
        ("train.cuda_graphs = true cannot capture", "train.compile = false", "train.device = cpu"),
    ),
    (
        "cuda-graphs-with-a-pipeline",
        lambda c: c.train(2, parallel={"pp": 2}, train={"compile": True, "cuda_graphs": True}),
        ConfigError,
        ("parallel.pp = 2 (a pipeline", "set --train.cuda_graphs false"),
    ),
    (
        "cuda-attention-kernel-on-cpu",
        lambda c: c.train(train={"attention_backend": "cudnn", "device": "cpu"}),
        ConfigError,
        ("train.attention_backend = cudnn is a CUDA kernel", "--train.attention_backend auto"),
    ),
    (
        "moe-key-on-a-dense-model",
        lambda c: c.train(model={"moe_top_k": 4}),
        ConfigError,
        ("model.moe_top_k = 4 set but model.num_experts = 0", "set --model.num_experts"),
    ),
    (
        "moe-top-k-over-experts",
        lambda c: c.train(model={"num_experts": 2, "moe_top_k": 3}),
        ConfigError,
        ("model.moe_top_k = 3 exceeds model.num_experts = 2", "use a top_k <= 2"),
    ),
    (
        "moe-capacity-with-context-parallelism",
        lambda c: c.train(
            world=2, parallel={"cp": 2}, model={"num_experts": 4, "moe_capacity_factor": 1.25}
        ),
        ConfigError,
        ("model.moe_capacity_factor = 1.25 with parallel.cp = 2", "--model.moe_capacity_factor 0"),
    ),
    (
        "ep-not-dividing-the-experts",
        lambda c: c.train(world=3, parallel={"ep": 3}, model={"num_experts": 4}),
        ConfigError,
        # 2 divides the 4 experts but not dp = 3: the fix is 1
        ("model.num_experts = 4 is not divisible by parallel.ep = 3", "--parallel.ep 1 (a"),
    ),
    (
        "ep-not-dividing-the-stage",
        lambda c: c.train(world=2, parallel={"ep": 4}, model={"num_experts": 8}),
        ConfigError,
        (
            "ep * parallel.etp = 4 * 1 = 4 does not divide tp * cp * dp = 1 * 1 * 2",
            "use --parallel.ep 2,",
        ),
    ),
    (
        "etp-not-dividing-the-expert-width",
        lambda c: c.train(
            world=2,
            parallel={"tp": 2, "etp": 2},
            model={"num_experts": 4, "moe_ffn_hidden_size": 36 + 1},
        ),
        ConfigError,
        ("(model.moe_ffn_hidden_size) is not divisible by parallel.etp = 2", "--parallel.etp 1"),
    ),
    (
        "fp8-without-torchao",
        lambda c: (
            c.monkeypatch.setattr("ptdp.rules.fp8.has_torchao", lambda: False),
            c.train(train={"precision": "fp8"}),
        ),
        ConfigError,
        ("fp8 needs torchao's float8 training, which is not installed", "pip install -e '.[fp8]'"),
    ),
    (
        "fp8-expert-width-not-a-multiple-of-16",
        lambda c: c.train(
            model={"num_experts": 2, "moe_ffn_hidden_size": 40}, train={"precision": "fp8"}
        ),
        ConfigError,
        (
            "fp8 needs the routed experts' inner features per rank (model.moe_ffn_hidden_size, "
            "40, / parallel.etp = 1) to be a multiple of 16",
            "use --model.moe_ffn_hidden_size 48",
        ),
    ),
    (
        "fp8-width-not-a-multiple-of-16",
        lambda c: c.train(model={"hidden_size": 24, "num_heads": 4}, train={"precision": "fp8"}),
        ConfigError,
        ("fp8 needs model.hidden_size (= 24) to be a multiple of 16", "change the model's widths"),
    ),
    (
        "fp8-tokens-not-a-multiple-of-16",
        lambda c: c.train(model={"seq_length": 10}, train={"precision": "fp8"}),
        ConfigError,
        ("micro_batch_size * model.seq_length / parallel.cp = 40)", "raise micro_batch_size"),
    ),
    (
        "fp8-all-gather-without-fp8",
        lambda c: c.train(world=2, parallel={"zero": 3, "zero3_fp8_all_gather": True}),
        ConfigError,
        ("zero3_fp8_all_gather = true gathers float8 weights, but", "--train.precision fp8"),
    ),
    (
        "fp8-all-gather-without-zero3",
        lambda c: c.train(
            world=2, parallel={"zero": 2, "zero3_fp8_all_gather": True}, train={"precision": "fp8"}
        ),
        ConfigError,
        ("but parallel.zero = 2 gathers none", "--parallel.zero 3"),
    ),
    (
        "fp8-all-gather-rowwise",
        lambda c: c.train(
            world=2,
            parallel={"zero": 3, "zero3_fp8_all_gather": True},
            train={"precision": "fp8", "fp8_recipe": "rowwise"},
        ),
        ConfigError,
        ("needs train.fp8_recipe = tensorwise", "--train.fp8_recipe tensorwise"),
    ),
    (
        "ep-on-a-dense-model",
        lambda c: c.train(world=2, parallel={"ep": 2}),
        ConfigError,
        ("parallel.ep = 2 splits experts, but model.num_experts = 0", "--parallel.ep 1"),
    ),
    (
        "ep-below-one",
        lambda c: c.train(parallel={"ep": 0}, model={"num_experts": 4}),
        ConfigError,
        ("parallel.ep = 0 must be >= 1",),
    ),
    (
        "tp-not-dividing-heads",
        lambda c: c.train(world=3, parallel={"tp": 3}),
        ConfigError,
        ("model.num_heads = 4 is not divisible by parallel.tp = 3", "choose tp dividing"),
    ),
    (
        "layers-not-divisible-by-pp-vpp",
        lambda c: c.train(world=4, parallel={"pp": 2, "vpp": 2, "schedule": "interleaved"}),
        ConfigError,
        ("model.num_layers = 2 is not divisible by pp*vpp = 2*2", "a multiple of 4"),
    ),
    (
        "rope-scaling-without-rope",
        lambda c: c.train(model={"rope_scaling": "llama3"}),
        ConfigError,
        ("model.rope_scaling = llama3 scales rotary positions", "model.position_embedding = rope"),
    ),
    (
        "rope-scaling-bands-inverted",
        lambda c: c.train(
            model={
                "position_embedding": "rope",
                "rope_scaling": "llama3",
                "rope_high_freq_factor": 1,
            }
        ),
        ConfigError,
        (
            "model.rope_high_freq_factor = 1.0 must exceed model.rope_low_freq_factor = 1.0",
            "4 and 1",
        ),
    ),
    (
        "yarn-betas-inverted",
        lambda c: c.train(
            model={"position_embedding": "rope", "rope_scaling": "yarn", "rope_beta_fast": 0.5}
        ),
        ConfigError,
        ("model.rope_beta_fast = 0.5 must be at least model.rope_beta_slow = 1.0", "32 and 1"),
    ),
    (
        "mla-keys-under-mha",
        lambda c: c.train(model={"position_embedding": "rope", "kv_lora_rank": 16}),
        ConfigError,
        ("model.kv_lora_rank = 16 set but model.attention = mha", "--model.attention mla"),
    ),
    (
        "mla-without-widths",
        lambda c: c.train(model={"position_embedding": "rope", "attention": "mla"}),
        ConfigError,
        ("model.attention = mla needs model.kv_lora_rank > 0", "qk_rope_head_dim 64"),
    ),
    (
        "mla-with-groups",
        lambda c: c.train(
            model={
                "position_embedding": "rope",
                "attention": "mla",
                "kv_lora_rank": 16,
                "qk_rope_head_dim": 4,
                "v_head_dim": 8,
                "num_query_groups": 2,
            }
        ),
        ConfigError,
        ("model.num_query_groups = 2 has no meaning under model.attention = mla", "drop it"),
    ),  # fmt: skip
    (
        "mla-learned-positions",
        lambda c: c.train(
            model={"attention": "mla", "kv_lora_rank": 16, "qk_rope_head_dim": 4, "v_head_dim": 8}
        ),
        ConfigError,
        ("model.attention = mla carries its positions in the rotary key", "rope"),
    ),
    (
        "yarn-keys-without-yarn",
        lambda c: c.train(model={"position_embedding": "rope", "rope_mscale": 1.0}),
        ConfigError,
        ("model.rope_mscale = 1.0 set but model.rope_scaling = none", "--model.rope_scaling yarn"),
    ),
    (
        "negative-sliding-window",
        lambda c: c.train(model={"sliding_window": -4}),
        ConfigError,
        ("model.sliding_window = -4 must be >= 0",),
    ),
    (
        "global-batch-not-divisible",
        lambda c: c.train(train={"global_batch_size": 10}),
        ConfigError,
        ("train.global_batch_size = 10 is not divisible by micro_batch_size*dp", "e.g. 8"),
    ),
    (
        "world-size-not-tp-pp-dp",
        lambda c: c.train(world=3, parallel={"dp": 2}),
        ConfigError,
        ("tp*cp*pp*dp = 1*1*1*2 = 2 does not match the world", "torchrun --nproc-per-node 2"),
    ),
    (
        "world-size-not-multiple-of-tp-pp",
        lambda c: c.train(world=3, parallel={"tp": 2}),
        ConfigError,
        ("world size 3 is not divisible by tp*cp*pp = 2*1*1 = 2", "launch a multiple of 2"),
    ),
    (
        "rollback-without-save-interval",
        lambda c: c.train(train={"on_nan": "rollback"}),
        ConfigError,
        ("train.on_nan = rollback with train.save_interval = 0", "--train.save_interval"),
    ),
    (
        "retry-without-in-process-recovery",
        lambda c: c.train(train={"on_nan": "retry"}),
        ConfigError,
        ("train.on_nan = retry replays the step from memory", "--train.recovery in_process"),
    ),
    (
        "in-process-recovery-with-async-save",
        lambda c: c.train(train={"recovery": "in_process", "async_save": True}),
        ConfigError,
        ("train.recovery = in_process with train.async_save", "--train.async_save false"),
    ),
    (
        "recovery-unknown",
        lambda c: resolve(None, ["--train.recovery", "inprocess"]),
        ConfigError,
        ("train.recovery = 'inprocess' is not valid", "did you mean 'in_process'"),
    ),
    (
        "vpp-without-interleaved",
        lambda c: c.train(world=2, parallel={"pp": 2, "vpp": 2}),
        ConfigError,
        ("parallel.vpp = 2 needs a schedule with model chunks", "--parallel.schedule interleaved"),
    ),
    # ---- data and tokenizer files
    (
        "empty-data-path",
        lambda c: train(tiny_config("", c.run)),
        ConfigError,
        ("data.path is empty", "ptdp preprocess", "--data.path"),
    ),
    (
        "missing-data-path",
        lambda c: train(tiny_config(str(c.tmp / "nothing"), c.run)),
        DataError,
        ("nothing.bin nor", "nothing.idx exists", "--data.path PREFIX"),
    ),
    (
        "data-path-with-extension",
        _data_path_with_extension,
        DataError,
        ("prefix without extension", "--data.path"),
    ),
    (
        "missing-idx",
        _missing("idx"),
        DataError,
        ("tiny.idx: dataset file not found", "ptdp preprocess"),
    ),
    (
        "missing-bin",
        _missing("bin"),
        DataError,
        ("tiny.bin: dataset file not found", "ptdp preprocess"),
    ),
    (
        "truncated-idx",
        _truncated_idx,
        DataError,
        ("tiny.idx: truncated", "header implies", "re-create it with `ptdp preprocess`"),
    ),
    (
        "truncated-bin",
        _truncated_bin,
        DataError,
        ("tiny.bin: 1000 bytes", "truncated or mismatched .bin", "ptdp preprocess"),
    ),
    (
        "corrupt-magic",
        _bad_magic,
        DataError,
        ("tiny.idx: not a Megatron indexed dataset index (bad magic bytes)", "ptdp preprocess"),
    ),
    (
        "corrupt-sidecar",
        _corrupt_sidecar,
        DataError,
        ("tiny.json: unreadable dataset sidecar", "re-run `ptdp preprocess`"),
    ),
    (
        "vocab-smaller-than-data",
        lambda c: c.train(model={"vocab_size": 100}),
        ConfigError,
        ("model.vocab_size = 100 is smaller than the data's vocabulary of 257", "set"),
    ),
    (
        "token-ids-beyond-vocab",
        _ids_beyond_vocab,
        ConfigError,
        ("holds token id 256, but model.vocab_size = 100", "--model.vocab_size 257"),
    ),
    (
        "tokenizer-mismatch",
        _tokenizer_mismatch,
        ConfigError,
        ("(vocabulary 300) is not the tokenizer", "made with (bytes", "--data.tokenizer"),
    ),
    (
        "unknown-tokenizer",
        lambda c: c.train(data={"tokenizer": str(c.tmp / "missing.json")}),
        DataError,
        ("missing.json: unknown tokenizer", "the path of a tokenizer.json"),
    ),
    # ---- checkpoints
    (
        "run-dir-taken",
        _run_dir_taken,
        CheckpointError,
        ("already holds checkpoints", "pass --resume", "--train.run_dir"),
    ),
    (
        "latest-names-missing-checkpoint",
        _latest_to_missing_dir,
        CheckpointError,
        ("points to", "which does not exist", "into", "latest", "--train.run_dir"),
    ),
    (
        "corrupt-checkpoint-metadata",
        _corrupt_metadata,
        CheckpointError,
        ("cannot read checkpoint file", ".metadata", "resume from an earlier checkpoint"),
    ),
    (
        "missing-checkpoint-shard",
        _missing_shard,
        CheckpointError,
        (".distcp is missing", "resume from an earlier checkpoint"),
    ),
    (
        "truncated-checkpoint-shard",
        _truncated_shard,
        CheckpointError,
        (".distcp is truncated (100 of", "resume from an earlier checkpoint"),
    ),
    (
        "checkpoint-checksum-mismatch",
        _checksum_mismatch,
        CheckpointError,
        ("is corrupted (checksum mismatch with checksums.json)", "use an earlier checkpoint"),
    ),
    (
        "checkpoint-config-missing",
        _checkpoint_config_missing,
        CheckpointError,
        ("config.toml is missing", "resume from an earlier checkpoint"),
    ),
    (
        "checkpoint-model-mismatch",
        _model_mismatch,
        CheckpointError,
        ("different model (hidden_size: 32 -> 64)", "same model settings", "--train.run_dir"),
    ),
    # ---- launches
    (
        "layout-needs-torchrun",
        _no_torchrun,
        ConfigError,
        (
            "this layout needs 4 processes (tp*cp*pp*dp = 4*1*1*1)",
            "not under torchrun",
            "torchrun --nproc-per-node 4 -m ptdp train",
        ),
    ),
    (
        "world-size-without-torchrun-vars",
        _world_size_alone,
        ConfigError,
        (
            "WORLD_SIZE=4 is set but RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT are not",
            "torchrun --nproc-per-node 4",
            "unset WORLD_SIZE",
        ),
    ),
    (
        "world-size-not-an-integer",
        _world_size_not_int,
        ConfigError,
        ("WORLD_SIZE='four' is not an integer", "torchrun"),
    ),
    (
        "rank-out-of-range",
        _rank_out_of_range,
        ConfigError,
        ("RANK=4 with WORLD_SIZE=4", "0 <= RANK < WORLD_SIZE", "torchrun"),
    ),
    # ---- damage (issue 21): never loaded unverified, never a raw traceback
    (
        "fresh-start-where-latest-is-lost",
        _fresh_start_without_latest,
        CheckpointError,
        ("already holds checkpoints", "pass --resume"),
    ),
    (
        "checksums-missing",
        lambda c: _checksums(c, None),
        CheckpointError,
        ("checksums.json is missing, so the shards cannot be checked", "an earlier checkpoint"),
    ),
    (
        "checksums-not-listing-a-shard",
        lambda c: _checksums(c, "{}"),
        CheckpointError,
        ("__0_0.distcp is not listed in", "checksums.json, so it cannot be verified"),
    ),
    (
        "checksums-wrong-shape",
        lambda c: _checksums(c, "[1, 2]"),
        CheckpointError,
        ("checksums.json does not map each file to its bytes and crc32",),
    ),
    (
        "latest-lost-and-no-complete-checkpoint",
        _latest_lost_and_shard_missing,
        CheckpointError,
        ("latest is missing, empty or damaged and no step directory", "__0_0.distcp is missing"),
    ),
    (
        "token-ids-beyond-vocab-despite-sidecar",
        _ids_beyond_sidecar,
        DataError,
        (
            "tiny.bin holds token id 300, but model.vocab_size = 257",
            "tiny.json records a vocabulary of 257",
            "re-create it with `ptdp preprocess`",
        ),
    ),  # fmt: skip
    (
        "hf-weights-truncated-in-import",
        lambda c: import_hf(_truncated_safetensors(c, 50_000), c.tmp / "imported"),
        CheckpointError,
        ("model.safetensors is truncated (50000 of", "download or export the model again"),
    ),
    (
        "hf-weights-truncated-in-init-from",
        lambda c: c.train(checkpoint={"init_from": str(_truncated_safetensors(c, 5))}),
        CheckpointError,
        ("model.safetensors is truncated (5 of 8 bytes", "download or export the model again"),
    ),
    (
        "hf-config-not-json",
        _hf_config_not_json,
        CheckpointError,
        ("cannot read the Hugging Face model config", "config.json (JSONDecodeError"),
    ),
    (
        "toml-value-wrong-shape",
        lambda c: _toml(c, "[model]\nnum_layers = [1, 2]\n"),
        ConfigError,
        ("model.num_layers = [1, 2] is not an integer", "use a whole number", "c.toml"),
    ),
    (
        "toml-table-for-a-value",
        lambda c: _toml(c, "[train.lr]\nx = 1\n"),
        ConfigError,
        ("unknown key 'train.lr'",),
    ),
    (
        "config-not-toml",
        lambda c: _toml(c, "this is = = not toml\n"),
        ConfigError,
        ("c.toml is not valid TOML", "see configs/"),
    ),
    (
        "config-not-utf8",
        lambda c: _toml(c, b"\xff\xfe[model]\n"),
        ConfigError,
        ("c.toml is not valid TOML (UTF-8 text", "can't decode byte 0xff"),
    ),
    (
        "run-dir-unwritable",
        _run_dir_under_a_file,
        ConfigError,
        ("--train.run_dir = ", "file is a file, not a directory", "choose a directory you can"),
    ),
    (
        "tokenizer-not-utf8",
        _tokenizer_not_utf8,
        DataError,
        ("t.json: not a valid Hugging Face tokenizer.json (not UTF-8 text",),
    ),
    (
        "generate-device-unknown",
        lambda c: _environ(c) or launch_generation(c.saved, "tpu"),
        ConfigError,
        ("device 'tpu' is not one torch knows", "auto, cpu or cuda"),
    ),
    (
        "hardware-zero-gpus-per-node",
        lambda c: _hardware(c, "gpus = 8", "gpus = 0"),
        ConfigError,
        ("hw.toml: [node] gpus = 0 must be a whole number >= 1", "a100-80gb.toml for the format"),
    ),
    (
        "hardware-efficiency-above-one",
        lambda c: _hardware(c, "gemm_efficiency = 0.75", "gemm_efficiency = 1.5"),
        ConfigError,
        ("[device.achieved] gemm_efficiency = 1.5 must be a fraction in (0, 1]",),
    ),
    (
        "hardware-zero-bandwidth",
        lambda c: _hardware(c, "bandwidth_gb_s = 25 ", "bandwidth_gb_s = 0 "),
        ConfigError,
        ("[network] bandwidth_gb_s = 0 must be > 0",),
    ),
    (
        "hardware-reserves-all-memory",
        # a100-80gb has no reserved_gib since the per-layout formula (ptdp.perf.cost.reserve):
        # add one
        lambda c: _hardware(
            c, "kernel_overhead_us = 5\n", "kernel_overhead_us = 5\nreserved_gib = 80\n"
        ),
        ConfigError,
        ("reserved_gib = 80 leaves nothing of [device] memory_gib = 80",),
    ),
    (
        "hardware-value-not-a-number",
        lambda c: _hardware(c, "memory_gib = 80 ", 'memory_gib = "lots" '),
        ConfigError,
        ("[device] memory_gib = 'lots' is not a number",),
    ),
    (
        "hardware-section-not-a-table",
        lambda c: _hardware(c, "[network]", "[unused]", prepend="network = 3\n"),
        ConfigError,
        ("[network] must be a table of key = value lines",),
    ),
    (
        "prompt-not-utf8",
        lambda c: _sample(c, "ab" + b"\xff".decode("utf-8", "surrogateescape") + "cd"),
        ConfigError,
        ("--prompt is not valid UTF-8 text (byte 0xff at character 2)", "LANG=C.UTF-8"),
    ),
    (
        "max-new-tokens-zero",
        lambda c: _sample(c, max_new_tokens=0),
        ConfigError,
        ("--max-new-tokens 0 must be 1 or more",),
    ),
    (
        "top-p-zero",
        lambda c: _sample(c, top_p=0.0),
        ConfigError,
        ("--top-p 0.0 must be in (0, 1]",),
    ),
    (
        "simulate-zero-gpus",
        lambda c: simulate(resolve(None, ["--model.vocab_size", "64"]), load_system("h100-sxm"), 0),
        ConfigError,
        ("world size 0 must be >= 1", "--gpus N"),
    ),
    (
        "simulate-cuda-graphs-on-megatron-2021",
        lambda c: simulate(
            resolve(
                None, "--model.vocab_size 64 --train.compile true --train.cuda_graphs true".split()
            ),
            load_system("a100-80gb"),
            1,
            software=MEGATRON_2021,
        ),
        ConfigError,
        ("train.cuda_graphs = true is ptdp's capture", "set --train.cuda_graphs false"),
    ),
    (
        "plan-negative-gpus",
        lambda c: plan(
            resolve(None, ["--model.vocab_size", "64"]), gpus=-1, system=load_system("h100-sxm")
        ),
        ConfigError,
        ("--gpus -1: the number of GPUs to plan for must be 1 or more",),
    ),
    (
        "convert-negative-seq-length",
        lambda c: import_hf(_hf_dir(c), c.tmp / "imported", seq_length=-5),
        ConfigError,
        ("--seq-length -5 must be >= 1, or 0 for the model's 32 positions",),
    ),
]


@pytest.fixture(scope="module")
def saved_run(tiny_data: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished one-step run with its checkpoint, copied by the cases that damage it."""
    run = tmp_path_factory.mktemp("saved") / "run"
    train(tiny_config(tiny_data, run, train={"steps": 1}))
    return run


@pytest.mark.parametrize(
    ("produce", "error", "fragments"),
    [pytest.param(*row[1:], id=row[0]) for row in CASES],
)
def test_bad_input(
    produce: Callable[[Ctx], None],
    error: type[PtdpError],
    fragments: tuple[str, ...],
    tiny_data: str,
    saved_run: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(PtdpError) as info:
        produce(Ctx(tmp_path, tiny_data, saved_run, monkeypatch))
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in: {info.value}"
    assert not dist.is_initialized()  # refused before any process group


def test_table_is_large_enough() -> None:
    assert len(CASES) >= 65 and len({row[0] for row in CASES}) == len(CASES)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "torchrun --nproc-per-node 4 -m ptdp train"),
        ({"WORLD_SIZE": "4"}, "WORLD_SIZE=4 is set but RANK"),
    ],
    ids=["plain-process", "world-size-only"],
)
def test_cli_refuses_before_process_group(
    env: dict[str, str],
    message: str,
    tiny_data: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = ["train", "--data.path", tiny_data, "--parallel.tp", "4"]
    args += ["--train.run_dir", str(tmp_path / "run"), "--train.device", "cpu"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("ptdp train: error: ") and message in err
    assert "Traceback" not in err
    assert not dist.is_initialized()
    assert not (tmp_path / "run").exists()  # nothing written


def test_full_disk_keeps_previous_checkpoint(
    tiny_data: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC partway through the second checkpoint: a clear error, the first checkpoint
    stays `latest` and loads, and no half-written step directory is left behind."""
    run = tmp_path / "run"
    root = ckpt.checkpoint_root(run)
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        # The first checkpoint is published once `latest` exists; then the disk fills up
        # after half of the second one's first tensor has gone out.
        if (root / ckpt.LATEST).exists() and hasattr(f, "write"):
            f.write(b"\0" * 64)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    cfg = tiny_config(tiny_data, run, train={"steps": 4, "save_interval": 2})
    with pytest.raises(CheckpointError) as info:
        train(cfg)
    text = str(info.value)
    assert "disk is full" in text and str(root / "step_00000004.tmp") in text
    assert f"free space on the disk holding {root}" in text
    assert "latest still names step_00000002" in text
    assert (root / ckpt.LATEST).read_text().strip() == "step_00000002"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002"]
    assert not dist.is_initialized()
    monkeypatch.setattr(torch, "save", real_save)
    step_dir = ckpt.find_checkpoint(run)
    assert step_dir == root / "step_00000002"
    assert ckpt.load_checkpoint(step_dir)["step"] == 2
    # The run continues from it once there is space again.
    result = train(cfg, resume=True)
    assert (result.start_step, result.final_step) == (2, 4)
    assert (root / ckpt.LATEST).read_text().strip() == "step_00000004"
