"""Performance model: a cost model, a simulator that replays the schedules, a planner.

cost/        what a layout costs: FLOPs and parameters (the paper's equations 2 and 3),
             activation, model-state and reserve bytes, seconds of each pass and
             collective, context parallelism and ZeRO, clusters as data (hardware/*.toml)
simulate/    one step replayed in simulated time from the schedules' own action lists, with
             each stage's costs, the gradient reduction and the optimizer step added:
             time, bubble, TFLOP/s, memory; the 2021 Megatron-LM order, a lower bound
             without the replay, timelines drawn as PNG charts and Chrome traces
plan/        `ptdp plan`: the layouts that fit, searched, ranked, explained, compared
calibrate/   `ptdp calibrate`: this machine's kernels and links timed, the cost model's
             constants fitted, written as a cluster file for cost/hardware_file.py
validate/    the model against published results: the paper's presets and tables,
             Megatron-Core's H100 runs, the fit of uncalibrated GPUs to them
commands.py  `ptdp simulate` and `ptdp plan` behind their parsers
report.py    what they print: text and JSON of predictions and plans, timeline files

Dependencies go one way: cost <- simulate <- plan <- validate, and the commands over all;
calibrate measures with torch, and the cost model reads its pure-Python fits.
"""
