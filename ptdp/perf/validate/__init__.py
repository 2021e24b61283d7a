"""The model against published results: what keeps its predictions honest.

The paper's presets, Table 1 and 2 rows and the `--model NAME|FILE` resolver (`paper`),
each row predicted and checked (`validation`), Megatron-Core's published H100 runs
(`published`), and the fit of a device's GEMM and attention efficiency to them for GPUs
that `ptdp calibrate` has not measured (`ground`).
"""
