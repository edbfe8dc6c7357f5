"""Trading compute or host memory for device memory: activation recompute (recompute.py),
swapping attention activations to the host (swap.py), and measuring what that saves
(measure.py).
"""
