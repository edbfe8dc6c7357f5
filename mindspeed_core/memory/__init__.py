"""Trading compute or host memory for device memory: activation recompute (recompute.py),
swapping attention activations to the host (swap.py), keeping the fp32 master as the bf16
parameters plus a residual (reuse_fp32_param.py), and measuring what that saves (measure.py).
"""
