"""One training step on one rank: its model chunks and trainer (trainer.py), the pipeline
step through a schedule (pipelined.py), AdamW on fp32 masters (optim.py) and the fp16 loss
scale (loss_scale.py)."""
