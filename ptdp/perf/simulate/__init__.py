"""The simulator: one training step replayed in simulated time.

The schedule's own per-rank action lists (`ptdp.pipeline.dryrun`, what the runtime
executes) replayed with the cost model's durations, the data-parallel reduction and the
optimizer step added (`simulator`); the 2021 Megatron-LM interleaved order for the
paper's runs (`megatron2021`); a proven lower bound on a step without the replay, which
lets the planner skip replays (`bound`); and the timelines drawn as PNG charts and
Chrome traces, simulated or measured (`plot`).
"""
