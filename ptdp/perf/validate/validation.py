"""The model against the paper: each Table 1 row and the README's GPT-3 example.

For a Table 1 row the paper gives the model, n, t, p and B but not the micro-batch b or
the chunks per rank v; the planner chooses them (b from equation (1), v by simulation)
with the paper's software (`MEGATRON_2021`) and settings (full recomputation, no
sequence parallelism, interleaving allowed). The prediction is compared with the
published TFLOP/s per GPU, which count equation (3)'s FLOPs.

`measure_cpu_memory` runs a small model in one process through a schedule's own order of
forwards and backwards and measures what `estimate_memory` predicts: model state and the
peak of the activations saved for backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from ptdp.config.enums import Recompute
from ptdp.config.sections import RunConfig
from ptdp.perf.cost.hardware import System
from ptdp.perf.cost.hardware_file import load_system
from ptdp.perf.cost.software import DEEPSPEED_2021, MEGATRON_2021
from ptdp.perf.plan.planner import Option, plan
from ptdp.perf.simulate.simulator import Prediction, simulate
from ptdp.perf.validate.paper import (
    README_GPT3,
    TABLE_1,
    TABLE_2,
    Table1Row,
    Table2Row,
    paper_run,
    table2_run,
)


@dataclass(frozen=True)
class Check:
    """Published against predicted, for one row."""

    row: Table1Row
    option: Option

    @property
    def predicted(self) -> float:
        return self.option.prediction.tflops_per_device

    @property
    def error(self) -> float:
        """Relative error of the prediction."""
        return self.predicted / self.row.tflops - 1


def check_row(
    row: Table1Row, system: System | None = None, micro_batch: int | None = None
) -> Check:
    """Plan b (unless `micro_batch` fixes it) and v for the row's (t, p) and predict its
    TFLOP/s per GPU. The paper does not give b; at b = 1 each microbatch's fixed costs
    (launches, the gradients' accumulation pass) weigh most."""
    result = plan(
        paper_run(row, micro_batch=1, vpp=1),
        gpus=row.gpus,
        system=system or load_system("a100-80gb"),
        software=MEGATRON_2021,
        tp=row.tp,
        pp=row.pp,
        micro_batch=micro_batch,
        recompute=Recompute.FULL,
        sequence_parallel=False,
        zero=0,
    )
    if result.best is None:
        raise ValueError(f"{row.name}: no layout fits: {result.rejected}")
    return Check(row, result.best)


def check_script_row(row: Table1Row, system: System | None = None) -> Prediction:
    """The row as the authors' script ran it (`AUTHORS_SCRIPT`): its b, v and DDP, no search."""
    cfg = paper_run(row, micro_batch=row.script_micro_batch, vpp=row.script_vpp)
    return simulate(cfg, system or load_system("a100-80gb"), row.gpus, software=MEGATRON_2021)


def check_table_2_row(row: Table2Row, system: System | None = None) -> Prediction:
    """The paper's section 5.2 row: ZeRO-3 simulated as DeepSpeed ran it (`DEEPSPEED_2021`),
    PTD-P with the paper's software, b = 1 and the interleaving v the planner picks."""
    system = system or load_system("a100-80gb")
    cfg = table2_run(row)
    if row.scheme == "zero-3":
        return simulate(cfg, system, row.gpus, software=DEEPSPEED_2021)
    result = plan(
        cfg,
        gpus=row.gpus,
        system=system,
        software=MEGATRON_2021,
        tp=cfg.parallel.tp,
        pp=cfg.parallel.pp,
        micro_batch=row.micro_batch,
        recompute=Recompute.FULL,
        sequence_parallel=False,
        zero=0,
    )
    if result.best is None:
        raise ValueError(f"{row}: no layout fits: {result.rejected}")
    return result.best.prediction


def check_table_2(system: System | None = None) -> list[tuple[Table2Row, Prediction]]:
    return [(row, check_table_2_row(row, system)) for row in TABLE_2]


def check_table_1(system: System | None = None) -> list[Check]:
    return [check_row(row, system) for row in TABLE_1]


def readme_gpt3(system: System | None = None) -> Prediction:
    """The README's run as its script sets it: b = 1, no interleaving, full recompute.

    Megatron-LM's examples/pretrain_gpt3_175B.sh: t = 8, p = 16, micro-batch 1, global
    batch 1536, fp16, --checkpoint-activations, no virtual pipeline.
    """
    cfg = paper_run(README_GPT3, micro_batch=1, vpp=1)
    return simulate(
        cfg, system or load_system("a100-80gb"), README_GPT3.gpus, software=MEGATRON_2021
    )


def measure_cpu_memory(cfg: RunConfig, schedule: str, m: int, seed: int = 0) -> tuple[int, int]:
    """(model state bytes, peak saved-activation bytes) of one CPU step of `cfg` (pp = 1).

    Forwards and backwards run in the order of `schedule`'s plan for one rank and m
    microbatches; saved tensors are counted with `record_saved_tensors` (storages once,
    weights excluded); the state is weights, gradients and AdamW's moments after a step.
    """
    import torch

    from ptdp.model.gpt import GPT
    from ptdp.perf.cost.activations import record_saved_tensors
    from ptdp.pipeline.actions import Kind
    from ptdp.pipeline.schedules import build

    torch.manual_seed(seed)
    model = GPT(cfg.model, recompute=cfg.parallel.recompute)
    b, s, v = cfg.train.micro_batch_size, cfg.model.seq_length, cfg.model.vocab_size
    held: dict[int, tuple[torch.Tensor, int]] = {}
    live = peak = 0
    for a in build(schedule, 1, m)[0]:
        if a.kind is Kind.F:
            tokens, labels = torch.randint(0, v, (b, s)), torch.randint(0, v, (b, s))
            loss, records = record_saved_tensors(model, tokens, labels)
            nbytes = sum(r.nbytes for r in records)
            held[a.mb] = (loss, nbytes)
            live += nbytes
            peak = max(peak, live)
        else:
            loss, nbytes = held.pop(a.mb)
            loss.backward()
            live -= nbytes
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.step()
    params = list(model.parameters())
    state = sum(p.numel() * p.element_size() for p in params)
    state += sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    moments = [t for st in optimizer.state.values() for t in st.values() if t.dim() > 0]
    state += sum(t.numel() * t.element_size() for t in moments)
    return state, peak
