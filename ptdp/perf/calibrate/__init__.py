"""Calibration behind `ptdp calibrate`: this machine measured, the cost model's constants fitted.

Microbenchmarks of GEMMs, attention, memory-bound kernels and collectives (`microbench`),
how each call is timed (`timing`), what a collective costs in place between compute
(`waits`) and what a split backward costs (`wgrad_cost`); the fits of curves and links to
those figures (`fit`, pure Python); what a sweep times by device type and the loops that
time it (`sweep`), the run that turns its figures into a calibration (`measure`) and the
cluster file it writes for the cost model to read (`calibration_file`). Only the measuring
modules import torch, so the cost model can use `fit` without it.
"""
