"""The simulator: one training step replayed in simulated time.

What each stage's passes and transfers cost (`pipeline_costs`); the schedule's own
per-rank action lists (`ptdp.pipeline.dryrun`, what the runtime executes) replayed with
those durations (`replay`), in the 2021 Megatron-LM interleaved order for the paper's runs
(`megatron2021`); the data-parallel gradient reduction (`reduction`) and the step's scalar
all-reduces and optimizer (`optimizer_step`) added; the prediction that ties them together
(`simulator`); a proven lower bound on a step without the replay, which lets the planner
skip replays (`bound`); and the timelines drawn as PNG charts and Chrome traces, simulated
or measured (`plot`).
"""
