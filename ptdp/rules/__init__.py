"""What a run may say: every rule a configuration must obey, checked before any process
group exists, each refusal naming the values involved and the fix.

layout.py    validate(cfg, world_size) -> Layout, the single entry: runs the rules below
             and returns the derived numbers (never written back into the config); the
             mesh's axis order (ORDER), which ptdp.parallel.mesh builds
domains.py   the domain of every number: each float key finite and in its range, TOML's
             integers, text in Unicode (and the hardware files' numbers, for ptdp.perf)
model.py     sizes, heads against the width, rotary positions and their scaling
parallel.py  the sizes against the world, what tp, sp and cp need, schedule against chunks
pipeline.py  the pipeline split (parallel.pipeline_layers)
zero.py      ZeRO levels, what each shards and cannot combine with
train.py     batches against dp, intervals, fault policies, optimizer numbers, data keys
moe.py       the mixture-of-experts keys, alone and against the layout
fp8.py       what train.precision = fp8 needs (dimensions a multiple of 16, torchao)
speed.py     CUDA graphs and attention backends, and torch versions

Every module reads ptdp.config; none of ptdp.config reads this package but its reference
page, which shows the domains.
"""
