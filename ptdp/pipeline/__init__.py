"""Pipeline parallelism: schedules as data, their verifier, and the runtime that runs them.

Read in this order to follow one schedule from its builder to a step:

actions.py      Action (kind, stage, mb) and Plan, a rank -> action list mapping
placement.py    which rank holds each virtual stage; partition.py: each stage's layers
classic.py      the builders of GPipe, 1F1B and interleaved 1F1B (one fused backward)
zero_bubble.py  the builders of ZB-H1, ZB-H2 and ZB-V (backward split into B and W)
paired.py       the builders whose steady state pairs a forward with a backward: DualPipeV,
                and 1F1B paired for parallel.moe_overlap
schedules.py    the registry: each schedule's builder, chunks, bubble and in-flight bound
lowering.py     add_comms: a compute-only plan given its sends and receives
verify.py       the rules and a unit-time dry run (dryrun.py, dryrun_engine.py) of all ranks
plan.py         PipelinePlan: a schedule built, lowered and verified once for every reader
runtime.py      PipelineRuntime: one rank's actions on real model chunks (p2p.py moves the
                boundary tensors); timeline.py records it, report.py prints `ptdp schedule`

All but runtime.py and p2p.py are pure Python (no torch), so the simulator in
ptdp.perf replays the very plans the runtime executes.
"""
