"""Multi-token prediction (DeepSeek-V3; megatron-core's --mtp-num-layers).

After the last layer, module k (1..D) predicts the token k + 1 places ahead of each position:

    h_k = transformer_layer_k(eh_proj_k([enorm_k(embedding(t_{i+k})); hnorm_k(h_{k-1})]))
    logits_k = output_layer(final_layernorms_k(h_k))

h_0 is the decoder's output before its final norm; the embedding and the output layer are the
model's own (shared). The token t_{i+k} is the label k - 1 places on, so the modules need the
labels only, not the input ids: on a last pipeline stage they are there already.

Depth k's loss is the mean cross entropy over the positions whose label k places on exists
(and counts in the loss mask k places on); the model's gradient gets mtp_loss_scaling_factor / D
times their sum, while the loss the trainer reports stays the language-model loss (the depths'
losses are reported apart). Parameter names are MindSpeed-LLM's: ``mtp.layers.<k>.{enorm,
hnorm, eh_proj, transformer_layer.*}`` and ``mtp.final_layernorms.<k>``.
"""

from __future__ import annotations

import numpy as np

from mindspeed_core import nn, ops
from mindspeed_core.models.layers import Linear, make_norm


class MTPLayer(nn.Module):
    def __init__(self, cfg, number: int, mlp):
        super().__init__()
        from mindspeed_core.models.gpt import TransformerLayer  # gpt builds this module

        self.enorm = make_norm(cfg, cfg.hidden_size)
        self.hnorm = make_norm(cfg, cfg.hidden_size)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, False, cfg.init_method_std)
        self.transformer_layer = TransformerLayer(cfg, mlp)
        self.transformer_layer.self_attention.layer_number = number

    def forward(self, hidden, embedded, cos, sin, seams, tokens):
        x = self.eh_proj(ops.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        return self.transformer_layer(x, cos, sin, seams, tokens)


class MultiTokenPrediction(nn.Module):
    """The D modules of a last pipeline stage; layer k is numbered num_layers + k - 1 (its MLP
    is ``make_mlp`` of that number: MoE where the last layer's is)."""

    def __init__(self, cfg, make_mlp):
        super().__init__()
        numbers = [cfg.num_layers + k for k in range(cfg.mtp_num_layers)]
        self.layers = nn.ModuleList([MTPLayer(cfg, n, make_mlp(n)) for n in numbers])
        self.final_layernorms = nn.ModuleList([make_norm(cfg, cfg.hidden_size) for _ in numbers])
        self.scale = cfg.mtp_loss_scaling_factor / cfg.mtp_num_layers
        self.reset_stats()

    def reset_stats(self) -> None:
        """Each depth's losses since the last call (scalar tensors, detached: for the log)."""
        self.losses = [[] for _ in self.layers]

    def take_losses(self) -> np.ndarray:
        """Each depth's summed micro-batch losses since the last call, as float64."""
        out = np.array([sum(float(ops.to_numpy(v)) for v in depth) for depth in self.losses], np.float64)
        self.reset_stats()
        return out


def shift_left(x, steps: int = 1):
    """[b, S] ids moved ``steps`` places to the left, zeros coming in at the end."""
    b, s = x.shape
    if steps >= s:
        return ops.zeros((b, s), ops.dtype_of(x))
    return ops.cat([x[:, steps:], ops.zeros((b, steps), ops.dtype_of(x))], dim=1)


def depth_mask(loss_mask, shape, k: int) -> np.ndarray:
    """[b, S] float32: depth k's loss mask, the main one k places on (zero where that passes the end)."""
    whole = np.ones(shape, np.float32) if loss_mask is None else np.broadcast_to(
        np.asarray(loss_mask, np.float32), shape)
    out = np.zeros(shape, np.float32)
    if k < shape[1]:
        out[:, :shape[1] - k] = whole[:, k:]
    return out
