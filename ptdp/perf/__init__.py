"""Performance model: FLOPs, memory, hardware, a simulator that replays the schedules, a planner.

flops.py        the paper's FLOPs (equation 3) and parameters (equation 2), MFU / HFU, dense peaks
memory.py       bytes per device: model state, Korthikanti activations x in-flight microbatches
activations.py  Korthikanti et al.'s per-layer activation bytes and what PyTorch really saves
hardware.py     clusters as data (hardware/*.toml): device, NVLink, network
costs.py        seconds of F, B, W per layer (GEMM efficiency curve, HBM traffic, collectives)
context.py      context parallelism: s/cp tokens per rank, K/V bytes of the ring and all-gather
context_costs.py  seconds of a cp rank's layer, its K/V transfers exposed or hidden
zero.py         ZeRO levels' traffic per step, ZeRO-2/3's per-microbatch collectives
replay.py       the schedules' own action lists replayed in simulated time (ptdp.pipeline.dryrun)
simulator.py    one training step of a config on a cluster: time, bubble, TFLOP/s, memory
planner.py      layouts that fit, ranked by simulated throughput, explained: search.py tries the
                sizes, levels, micro-batches and schedules, ranking.py replays and ranks them,
                explain.py says why; plan_keys.py is the command line's pins
timeline.py     TimelineRecorder for the runtime, Chrome traces and PNG charts
paper.py        the paper's model presets and published figures; validation.py checks them
calibrate.py    `ptdp calibrate`: microbench.py times this machine (timing.py: how each call
                is timed; waits.py: a collective's cost in place), fit.py fits the
                constants, calibration_file.py writes them as a cluster file for hardware.py
"""
