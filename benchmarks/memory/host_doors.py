"""Host peak memory per rank of the doors in and out of ptdp (issue 52): `ptdp train
--checkpoint.init_from` a Hugging Face model, `ptdp convert --from hf` and `--to hf`, and
`ptdp train --resume`.

For a random `transformers` Llama and Mixtral (fp32 safetensors written by
`save_pretrained`, untied embeddings), each `ptdp train` rank's high-water mark of resident
memory (VmHWM in /proc/self/status) is read as the training loop starts, after the build
and the load, before any step; a run without init_from (the same config, random weights)
is the baseline. Per rank:

  extra     HWM(init_from) - HWM(baseline): what the load costs on top of building the rank
  shard     the rank's own fp32 parameters (its tp/ep slices of its pipeline stage's layers)
  largest   the model's largest single tensor (the input or output embedding)
  load s    time spent in the load itself on that rank

The target of the rewritten loaders: extra <= ~1.5 (shard + largest). `convert --from/--to
hf` are measured as one process each, its HWM at exit less that of a Python that imported
torch and ptdp; divided by the model's bytes. `--resume` at world 2 (tp2 for the Llama, ep2
for the Mixtral): extra over the first run's start, against the rank's own state (fp32
parameter = master, and AdamW's two moments: 12 bytes per parameter it holds).

Each rank runs this file as its driver (`driver` first argument): it wraps ptdp's own
functions to take the marks and writes them as JSON at exit (ptdp leaves a multi-rank run
by os._exit, so atexit alone would miss it); ptdp itself is not changed. Ranks are launched
by torchrun on gloo with one thread each.

    python benchmarks/memory/host_doors.py [--parts init_from,convert,resume]
        [--size small|medium] [--out FILE]

--size small (~6M parameters) checks the machinery in a few minutes; medium (~100M,
the default) is what BENCHMARKS.md reports. The rows go to --out, by default
runs/benchmarks/host_doors.json (ignored by git).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MB = 1e6
PARTS = ("init_from", "convert", "resume")


# ----------------------------------------------------------------------------- pure helpers


@dataclass(frozen=True)
class Shape:
    """A Llama (experts = 0) or Mixtral, as the Hugging Face config says it."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    experts: int = 0
    top_k: int = 2


SMALL = dict(hidden=256, layers=4, heads=4, kv_heads=2, vocab=8192)
MEDIUM = dict(hidden=768, heads=12, kv_heads=4, vocab=32000)
SIZES = {
    "small": {"llama": Shape(**SMALL, ffn=512), "mixtral": Shape(**SMALL, ffn=256, experts=4)},
    "medium": {
        "llama": Shape(**MEDIUM, layers=8, ffn=2048),
        "mixtral": Shape(**MEDIUM, layers=6, ffn=512, experts=8),
    },
}
"""small: ~6.5M and ~8M parameters (a check of the machinery); medium: ~99M and ~115M."""
SEQ = 128


@dataclass(frozen=True)
class Layout:
    """A run's split of the model: tp, pp, ep over `world` ranks (dp = the rest)."""

    name: str
    world: int
    tp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    def overrides(self) -> list[str]:
        return [f"--parallel.{k}={getattr(self, k)}" for k in ("tp", "pp", "ep")]


DENSE_LAYOUTS = (
    Layout("1", 1),
    Layout("tp2", 2, tp=2),
    Layout("pp2", 2, pp=2),
    Layout("tp2·pp2", 4, tp=2, pp=2),
)
MOE_LAYOUTS = (*DENSE_LAYOUTS[:3], Layout("ep2", 2, ep=2), DENSE_LAYOUTS[3])
MOE_LAYOUTS += (Layout("ep2·tp2", 4, tp=2, ep=2),)
RESUME_LAYOUT = {"llama": Layout("tp2", 2, tp=2), "mixtral": Layout("ep2", 2, ep=2)}


def padded_vocab(vocab: int, tp: int, multiple: int = 128) -> int:
    """ptdp's embedding rows: the vocabulary padded to a multiple of `multiple` * tp."""
    step = multiple * tp
    return -(-vocab // step) * step


def shard_params(shape: Shape, layout: Layout, rank: int) -> int:
    """Parameters rank `rank` holds: its tp slices of its stage's layers (ranks run tp
    fastest, then dp, then pp), its ep share of each layer's experts (each whole: etp = 1),
    the replicated norms and routers whole; the embedding on the first stage, the final norm
    and output layer on the last, their (padded) rows split over tp."""
    h, tp, pp = shape.hidden, layout.tp, layout.pp
    if shape.layers % pp or shape.experts % layout.ep:
        raise ValueError(f"{layout.name} does not divide {shape}")
    stage = rank // (tp * layout.dp)
    head = h // shape.heads
    attention = (2 * h * h + 2 * h * shape.kv_heads * head) // tp
    if shape.experts:
        mlp = h * shape.experts + shape.experts // layout.ep * 3 * h * shape.ffn
    else:
        mlp = 3 * h * shape.ffn // tp
    count = shape.layers // pp * (2 * h + attention + mlp)
    rows = padded_vocab(shape.vocab, tp) // tp
    if stage == 0:
        count += rows * h
    if stage == pp - 1:
        count += h + rows * h
    return count


def parse_hwm(status: str) -> int:
    """Bytes of the VmHWM line of a /proc/<pid>/status text ("VmHWM:   1234 kB")."""
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            value, unit = line.split()[1:3]
            if unit != "kB":
                raise ValueError(f"unexpected unit in {line!r}")
            return int(value) * 1024
    raise ValueError("no VmHWM line")


def ratio(num: float, den: float) -> float | None:
    return round(num / den, 2) if den else None


def init_rows(base: dict[int, dict], init: dict[int, dict], info: dict, shape: Shape,
              layout: Layout) -> list[dict]:  # fmt: skip
    """One row per rank of an init_from run against its baseline's rank."""
    rows = []
    for rank in sorted(init):
        shard = 4 * shard_params(shape, layout, rank)
        extra = init[rank]["hwm_loaded"] - base[rank]["hwm_loaded"]
        rows.append({
            "model": info["family"], "layout": layout.name, "world": layout.world, "rank": rank,
            "shard": shard, "measured_shard": init[rank].get("param_bytes"),
            "largest": info["largest"], "model_bytes": info["bytes"],
            "hwm_base": base[rank]["hwm_loaded"], "hwm_init": init[rank]["hwm_loaded"],
            "extra": extra, "extra_per_shard_largest": ratio(extra, shard + info["largest"]),
            "extra_per_model": ratio(extra, info["bytes"]),
            "load_s": round(init[rank].get("load_s", 0.0), 2),
            "to_loop_s": round(init[rank]["t_loop"] - base[rank]["t_loop"], 2),
        })  # fmt: skip
    return rows


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A markdown table: `columns` are (heading, key, format); bytes keys in MB."""
    lines = ["| " + " | ".join(c[0] for c in columns) + " |"]
    lines.append("|" + "|".join("---" for _ in columns) + "|")
    for row in rows:
        cells = []
        for _, key, fmt in columns:
            value = row.get(key)
            if value is None:
                cells.append("–")
            elif fmt == "MB":
                cells.append(f"{value / MB:,.0f}")
            else:
                cells.append(format(value, fmt))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


INIT_COLUMNS = [
    ("model", "model", ""), ("layout", "layout", ""), ("rank", "rank", "d"),
    ("shard MB", "shard", "MB"), ("HWM random MB", "hwm_base", "MB"),
    ("HWM init_from MB", "hwm_init", "MB"), ("extra MB", "extra", "MB"),
    ("extra / (shard + largest)", "extra_per_shard_largest", ".2f"),
    ("extra / model", "extra_per_model", ".2f"), ("load s", "load_s", ".1f"),
]  # fmt: skip
CONVERT_COLUMNS = [
    ("command", "command", ""), ("model", "model", ""), ("model MB", "model_bytes", "MB"),
    ("largest MB", "largest", "MB"), ("HWM MB", "hwm", "MB"), ("extra MB", "extra", "MB"),
    ("extra / model", "extra_per_model", ".2f"), ("wall s", "wall_s", ".1f"),
]  # fmt: skip
RESUME_COLUMNS = [
    ("model", "model", ""), ("layout", "layout", ""), ("rank", "rank", "d"),
    ("own state MB", "state", "MB"), ("HWM fresh MB", "hwm_base", "MB"),
    ("HWM resume MB", "hwm_resume", "MB"), ("extra MB", "extra", "MB"),
    ("extra / state", "extra_per_state", ".2f"), ("restore s", "load_s", ".1f"),
]  # fmt: skip


# ----------------------------------------------------------------------------- the driver


def _hwm() -> int:
    return parse_hwm(Path("/proc/self/status").read_text())


def driver(record: str, args: list[str]) -> int:
    """One process of a measured command: ptdp's `main(args)` with marks taken, written to
    `record` (a directory: rank<RANK>.json) at exit. `args` = ["imports"]: only import."""
    t0 = time.time()
    marks: dict = {"rank": int(os.environ.get("RANK", "0"))}
    path = Path(record) / f"rank{marks['rank']}.json"

    def write() -> None:
        marks.update(hwm_exit=_hwm(), t_exit=time.time() - t0)
        path.write_text(json.dumps(marks))

    import atexit

    atexit.register(write)
    real_exit = os._exit

    def leave(code: int) -> None:  # ptdp's exit_now after a multi-rank run skips atexit
        write()
        real_exit(code)

    os._exit = leave
    import torch

    torch.set_num_threads(1)
    import ptdp.convert  # noqa: F401 - the imports every door pays
    import ptdp.train.run as run
    from ptdp.cli import main
    from ptdp.train.step.trainer import Trainer

    if args == ["imports"]:
        return 0

    def timed(fn):
        def wrapper(*a, **kw):
            start = time.time()
            try:
                return fn(*a, **kw)
            finally:
                marks["load_s"] = marks.get("load_s", 0.0) + time.time() - start

        return wrapper

    loop = run.run_loop

    def run_loop(trainer, **kw):
        marks["hwm_loaded"], marks["t_loop"] = _hwm(), time.time() - t0
        params = [p for c in trainer.chunks for p in c.parameters()]
        marks["param_bytes"] = sum(p.numel() * p.element_size() for p in params)
        marks["state_bytes"] = trainer.optimizer.planned_state_bytes()
        return loop(trainer, **kw)

    run.run_loop, run.load_initial_weights = run_loop, timed(run.load_initial_weights)
    Trainer.restore = timed(Trainer.restore)
    return main(args)


# ----------------------------------------------------------------------------- launching


def launch(work: Path, name: str, args: list[str], world: int = 0) -> dict[int, dict]:
    """`ptdp args` under the driver: on `world` torchrun ranks, or as one plain process
    (world 0); returns each rank's marks and, under "wall", the launch's wall time."""
    record = work / "marks" / name
    record.mkdir(parents=True)
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable]
    if world:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    cmd += [str(Path(__file__).resolve()), "driver", str(record), *args]
    start = time.time()
    with (work / f"{name}.log").open("w") as log:
        code = subprocess.run(cmd, env=env, cwd=ROOT, stdout=log, stderr=log).returncode
    if code:
        raise RuntimeError(f"{' '.join(cmd)} exited with {code}; see {work / name}.log")
    marks = {int(p.stem[4:]): json.loads(p.read_text()) for p in record.glob("rank*.json")}
    for m in marks.values():
        m["wall"] = time.time() - start
    return marks


def save_hf(directory: str, family: str, shape: dict) -> None:
    """A random `transformers` model of `shape` saved in `directory` (fp32 safetensors)."""
    import torch
    import transformers

    s = Shape(**shape)
    common = dict(
        hidden_size=s.hidden, num_hidden_layers=s.layers, num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads, intermediate_size=s.ffn, vocab_size=s.vocab,
        max_position_embeddings=2 * SEQ, rms_norm_eps=1e-5, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    if family == "mixtral":
        config = transformers.MixtralConfig(
            **common, num_local_experts=s.experts, num_experts_per_tok=s.top_k
        )
        model = transformers.MixtralForCausalLM(config)
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    model.save_pretrained(directory)


def hf_info(directory: Path, family: str) -> dict:
    """The saved model's bytes and largest tensor, read from the safetensors headers."""
    sizes = []
    for file in sorted(directory.glob("*.safetensors")):
        with file.open("rb") as f:  # an 8-byte length, then the JSON header
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        header.pop("__metadata__", None)
        sizes += [v["data_offsets"][1] - v["data_offsets"][0] for v in header.values()]
    return {"family": family, "bytes": sum(sizes), "largest": max(sizes), "tensors": len(sizes)}


def train_args(config: Path, run_dir: Path, layout: Layout, data: str) -> list[str]:
    return [
        "train", "--config", str(config), f"--train.run_dir={run_dir}", f"--data.path={data}",
        "--train.device=cpu", "--train.progress=false", "--train.steps=1",
        "--train.micro_batch_size=1", "--train.global_batch_size=4", "--train.log_interval=1",
        "--train.eval_interval=0", f"--model.seq_length={SEQ}", *layout.overrides(),
    ]  # fmt: skip


@dataclass
class Model:
    family: str
    shape: Shape
    hf: Path
    imported: Path
    info: dict


def prepare(work: Path, family: str, shape: Shape) -> Model:
    hf, imported = work / f"{family}-hf", work / f"{family}-ptdp"
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.memory.host_doors "
    code += f"import save_hf; save_hf({str(hf)!r}, {family!r}, {asdict(shape)!r})"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    return Model(family, shape, hf, imported, hf_info(hf, family))


def part_convert(work: Path, model: Model, imports: int) -> list[dict]:
    """convert --from hf (which also makes the config every train run uses), --to hf."""
    rows = []
    steps = [
        ("convert --from hf", ["--from", "hf", str(model.hf), str(model.imported)]),
        ("convert --to hf", ["--to", "hf", str(model.imported), str(work / f"{model.family}-out")]),
    ]
    for command, args in steps:
        m = launch(work, f"{model.family}-{command.split()[1][2:]}", ["convert", *args])[0]
        extra = m["hwm_exit"] - imports
        rows.append({
            "command": command, "model": model.family, "model_bytes": model.info["bytes"],
            "largest": model.info["largest"], "hwm": m["hwm_exit"], "imports": imports,
            "extra": extra, "extra_per_model": ratio(extra, model.info["bytes"]),
            "wall_s": round(m["t_exit"], 1),
        })  # fmt: skip
    return rows


def part_init_from(work: Path, model: Model, data: str) -> list[dict]:
    rows = []
    layouts = MOE_LAYOUTS if model.shape.experts else DENSE_LAYOUTS
    config = model.imported / "config.toml"
    for layout in layouts:
        tag = f"{model.family}-{layout.name.replace('·', '')}"
        args = train_args(config, work / f"{tag}-random", layout, data)
        base = launch(work, f"{tag}-random", args, layout.world)
        args = train_args(config, work / f"{tag}-init", layout, data)
        init = launch(
            work, f"{tag}-init", [*args, f"--checkpoint.init_from={model.hf}"], layout.world
        )
        rows += init_rows(base, init, model.info, model.shape, layout)
        print(table(rows[-layout.world :], INIT_COLUMNS).split("\n", 2)[2], flush=True)
    return rows


def part_resume(work: Path, model: Model, data: str) -> list[dict]:
    layout = RESUME_LAYOUT[model.family]
    run_dir = work / f"{model.family}-resume"
    args = train_args(model.imported / "config.toml", run_dir, layout, data)
    fresh = launch(work, f"{model.family}-fresh", args, layout.world)
    args = [a if a != "--train.steps=1" else "--train.steps=2" for a in args]
    again = launch(work, f"{model.family}-resume", [*args, "--resume"], layout.world)
    rows = []
    for rank in sorted(again):
        state = 12 * shard_params(model.shape, layout, rank)
        extra = again[rank]["hwm_loaded"] - fresh[rank]["hwm_loaded"]
        rows.append({
            "model": model.family, "layout": layout.name, "rank": rank, "state": state,
            "measured_state": again[rank]["param_bytes"] + again[rank]["state_bytes"],
            "hwm_base": fresh[rank]["hwm_loaded"], "hwm_resume": again[rank]["hwm_loaded"],
            "extra": extra, "extra_per_state": ratio(extra, state),
            "load_s": round(again[rank].get("load_s", 0.0), 2),
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default=",".join(PARTS), help=f"of {', '.join(PARTS)}")
    p.add_argument("--size", default="medium", choices=list(SIZES))
    p.add_argument("--models", default="llama,mixtral")
    p.add_argument("--out", default=str(ROOT / "runs/benchmarks/host_doors.json"))
    a = p.parse_args(argv)
    parts = [x for x in a.parts.split(",") if x]
    if unknown := set(parts) - set(PARTS):
        p.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    from benchmarks.speed.mfu import synthetic_tokens

    result: dict = {"size": a.size, "seq_length": SEQ, "dtype": "float32", "parts": parts}
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="host_doors-") as tmp:
        work = Path(tmp)
        imports = launch(work, "imports", ["imports"])[0]["hwm_exit"]
        result["imports_hwm"] = imports
        for family in [m for m in a.models.split(",") if m]:
            shape = SIZES[a.size][family]
            data = synthetic_tokens(work, shape.vocab, 64 * (SEQ + 1))
            model = prepare(work, family, shape)
            result.setdefault("models", {})[family] = {**model.info, "shape": asdict(shape)}
            rows = part_convert(work, model, imports)  # every part trains from its config
            if "convert" in parts:
                result.setdefault("convert", []).extend(rows)
            for part, fn in (("init_from", part_init_from), ("resume", part_resume)):
                if part in parts:
                    result.setdefault(part, []).extend(fn(work, model, data))
    result["wall_s"] = round(time.time() - start)
    for part, columns in (("init_from", INIT_COLUMNS), ("convert", CONVERT_COLUMNS),
                          ("resume", RESUME_COLUMNS)):  # fmt: skip
        if part in result:
            print(f"\n{part}\n\n{table(result[part], columns)}")
    print(f"\nimports alone: HWM {imports / MB:,.0f} MB; {result['wall_s']} s in all")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {a.out}")
    return result


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "driver":
        sys.path.insert(0, str(ROOT))
        raise SystemExit(driver(sys.argv[2], sys.argv[3:]))
    if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
        sys.path.insert(0, str(ROOT))
    main()
