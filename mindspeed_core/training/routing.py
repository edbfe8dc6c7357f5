"""The mixture-of-experts routing of a training step, over the whole job: each step's aux and
z losses, tokens per expert and load balance gathered over data-parallel, context-parallel and
pipeline ranks, and aux-loss-free balancing's bias update (--moe-router-enable-expert-bias)."""

from __future__ import annotations

import numpy as np

from mindspeed_core import nn
from mindspeed_core.models import router
from mindspeed_core.training import distributed


def update_expert_bias(moe_layers: list, cfg, tokens_per_expert: list) -> None:
    """Aux-loss-free balancing (--moe-router-enable-expert-bias): once per step, each
    layer's bias moves by the update rate towards the mean load, from the step's tokens
    per expert over every data-parallel and context-parallel rank (the same on every rank)."""
    numbers = cfg.moe_layer_numbers()
    for layer in moe_layers:
        bias = layer.expert_bias()
        if bias is not None:
            layer.set_expert_bias(router.updated_expert_bias(
                bias, np.asarray(tokens_per_expert[numbers.index(layer.number)]), cfg.moe.bias_update_rate))


def cast_keeping_expert_bias(chunks: list, moe_layers: list, dtype: str) -> None:
    """The model chunks cast to ``dtype`` for mixed precision, their routers' expert biases
    kept in float32 with the values they had."""
    biases = [(layer, layer.expert_bias()) for layer in moe_layers]
    for chunk in chunks:
        nn.cast_parameters(chunk, dtype)
    for layer, values in biases:
        layer.keep_expert_bias_float32(values)


def step_stats(moe_layers: list, cfg, ps, grad_accum: int) -> dict:
    """The step's routing over every MoE layer (of every pipeline stage) and data-parallel
    rank: aux and z losses (summed over layers, mean over micro-batches as the loss),
    tokens per expert per layer, dropped assignments, and each layer's load balance
    (busiest expert / mean). A collective over DP, CP and PP."""
    numbers = cfg.moe_layer_numbers()
    row = {n: k for k, n in enumerate(numbers)}
    losses, dropped = np.zeros(2), 0.0
    counts = np.zeros((len(numbers), cfg.moe.slots))  # zero-computation experts' slots too
    for layer in moe_layers:  # this rank's stages' layers
        losses += [layer.stats["aux_loss"] / grad_accum, layer.stats["z_loss"] / grad_accum]
        dropped += layer.stats["dropped"]
        counts[row[layer.number]] = layer.stats["tokens_per_expert"]
    flat = np.concatenate([losses, [dropped], counts.reshape(-1)]).astype(np.float32)
    # DP and CP ranks routed other tokens (a CP rank's losses are its share's: their mean is the
    # whole sequences'), PP ranks hold other layers; with EP across TP each TP rank routed its
    # share too (its losses already weighed 1 / TP); counts are exact in float32 up to 2**24
    flat = distributed.sum_over_dp_and_pp(flat, ps, ("dp", "cp", "pp") + (("tp",) if ps.ep_over_tp else ()))
    flat[:2] /= ps.dp * ps.cp
    counts = np.rint(flat[3:]).astype(np.int64).reshape(counts.shape)
    balance = [float(c.max() / c.mean()) if c.sum() else 0.0 for c in counts]
    return {"aux_loss": float(flat[0]), "z_loss": float(flat[1]), "dropped": int(round(float(flat[2]))),
            "tokens_per_expert": counts.tolist(), "load_balance": balance}
