"""ptdp: GPT training with composed tensor, pipeline and data parallelism (PTD-P).

After Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM" (SC21, arXiv 2104.04473).
"""

__version__ = "0.1.0"
