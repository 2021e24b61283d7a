"""The cost model: what one layout of one model costs on one cluster, as formulas.

FLOPs and parameters (the paper's equations 2 and 3), activation and model-state bytes
per rank (Korthikanti et al.; ZeRO levels; the framework's reserve), the seconds of each
pass and collective on a device (GEMM efficiency curve, memory-bound kernels, links),
context parallelism's share and transfers, and the clusters as data (`hardware`, read and
checked from `hardware/*.toml` or a user's file by `hardware_file`).
Pure arithmetic on configs, no torch: the simulator and the planner call it per layout.
"""
