"""Analytical collective traffic of one training step on one rank, in bytes of payload
handed to the collectives (float32), for the layouts this package implements.

It is the count the algorithms require (Megatron's tensor-parallel regions, one gradient
reduction per step), so ``dist.comm_stats()`` on native collectives must equal it exactly;
where collectives are emulated, the ratio of wire bytes to this figure is the emulation's
overhead. Per micro-batch of T tokens, hidden size h, L layers, tensor-parallel size t:

    TP:      forward  embedding all-reduce T h, 2 all-reduces T h per layer (attention and MLP
                      outputs), vocab-parallel loss 2 all-reduces of T (sum, target) and
                      one of t T (the max: each rank's in its slot, summed; mappings.max_over)
             backward 2 all-reduces T h per layer (attention and MLP inputs), 1 for the output
    TP + SP: each layer all-reduce becomes an all-gather of T h / t (input) plus a
             reduce-scatter of T h; the decoder input is sliced (backward: all-gather T h / t)
             and the output gathered (backward: reduce-scatter T h)
    per step: DP all-reduce of the rank's gradients (or, with the distributed optimizer, a
             reduce-scatter of them, an all-gather of the updated slice, and the norm's two
             partial sums), the loss averaged over DP, the gradient norm's sharded part
             summed over TP, and under SP the decoder's replicated gradients summed over TP;
             with MoE layers, their routing statistics summed over DP for the log (aux and z
             loss, dropped count, tokens per expert of each MoE layer).
"""

from __future__ import annotations


def step_bytes(cfg, *, micro_batch: int, seq_length: int, grad_accum: int, tp: int, dp: int, sp: bool,
               distributed_optimizer: bool, local_params: int, sp_partial_params: int, moe_layers: int = 0,
               per_token_loss: bool = False) -> dict:
    """{collective: bytes} expected on one rank per training step (fp32 training)."""
    f = 4
    T, h, L = micro_batch * seq_length, cfg.hidden_size, cfg.num_layers
    out: dict = {}

    def add(op, n):
        out[op] = out.get(op, 0) + n

    if tp > 1:
        per_micro = {}
        if sp:
            # per layer: 2 gathers forward (qkv, fc1 inputs) + 2 backward (proj, fc2), and the
            # mirror-image reduce-scatters; plus the output gather and the decoder-input slice
            per_micro["all_reduce"] = T * h * f + (2 + tp) * T * f  # embedding (full sequence) and the loss
            per_micro["all_gather"] = (4 * L + 2) * (T // tp) * h * f
            per_micro["reduce_scatter"] = (4 * L + 1) * T * h * f
        else:
            per_micro["all_reduce"] = (4 * L + 2) * T * h * f + (2 + tp) * T * f
        for op, n in per_micro.items():
            add(op, grad_accum * n)
        add("all_reduce", f)  # the gradient norm's sharded part, over TP
        if sp and sp_partial_params:
            add("all_reduce", sp_partial_params * f)
    if dp > 1:
        add("all_reduce", f)  # the loss, averaged for the log
        if per_token_loss:
            add("all_reduce", f)  # the step's count of loss tokens (--calculate-per-token-loss)
        if moe_layers:
            add("all_reduce", (3 + moe_layers * cfg.moe.num_experts) * f)
        if distributed_optimizer:
            padded = -(-local_params // dp) * dp
            add("reduce_scatter", padded * f)
            add("all_gather", padded // dp * f)
            add("all_reduce", 2 * f)  # the norm's two partial sums over DP
        else:
            add("all_reduce", local_params * f)
    return out
