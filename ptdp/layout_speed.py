"""The rules of `ptdp.layout.validate` for the launch-overhead switches: train.cuda_graphs
and train.attention_backend, each message naming the key and the fix.

Pure (no torch.distributed), so a setting that cannot apply fails before any process group
exists. CUDA graphs replay a recorded step at fixed addresses: they need compiled regions
whose inputs keep their shapes and whose outputs are consumed before the next replay, which
a pipeline (several microbatches' activations in flight), the cp ring, MoE routing (token
counts per expert change every step) and ZeRO-3 (parameters gathered into fresh storage
each step) do not give.
"""

from __future__ import annotations

from ptdp.config import AttentionBackend, RunConfig

CPU_BACKENDS = (AttentionBackend.AUTO, AttentionBackend.FLASH, AttentionBackend.MATH)
"""What PyTorch's CPU attention runs: its flash kernel or the math reference."""


def speed_rules(cfg: RunConfig, errors: list[str], runtime: bool) -> None:
    """Append what is wrong with train.cuda_graphs and train.attention_backend to `errors`.
    `runtime`: a run on this machine (not a modelled one), where the device matters."""
    t, p = cfg.train, cfg.parallel
    if runtime and t.device == "cpu" and t.attention_backend not in CPU_BACKENDS:
        errors.append(
            f"train.attention_backend = {t.attention_backend.value} is a CUDA kernel, and "
            "train.device = cpu; use --train.attention_backend auto (or math, flash)"
        )
    if not t.cuda_graphs:
        return
    why = []
    if not t.compile:
        why.append("train.compile = false (the graphs capture its compiled regions)")
    if runtime and t.device == "cpu":
        why.append("train.device = cpu (CUDA graphs need a CUDA device)")
    if p.pp > 1:
        why.append(f"parallel.pp = {p.pp} (a pipeline keeps several microbatches in flight)")
    if p.cp > 1:
        why.append(f"parallel.cp = {p.cp} (the ring's transfers are not captured)")
    if cfg.model.num_experts > 0:
        why.append("model.num_experts > 0 (MoE routing changes shapes every step)")
    if p.zero >= 3:
        why.append("parallel.zero = 3 (parameters are gathered into new storage each step)")
    if why:
        errors.append(
            "train.cuda_graphs = true cannot capture this run: "
            + "; ".join(why)
            + "; set --train.cuda_graphs false, or fix each of these"
        )
