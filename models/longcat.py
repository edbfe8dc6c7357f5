"""LongCat-Flash's layer (MindSpeed-LLM's longcat_spec; transformers' LongcatFlashDecoderLayer),
written only against the facade: two attention blocks, each followed by a dense MLP, and one
mixture of experts fed from the first MLP's input whose output joins the residual stream only at
the layer's end (the shortcut that lets its dispatch overlap the second block):

    x = x + attention_0(norm(x))
    h = norm(x);  shortcut = moe(h);  x = x + mlp_0(h)
    x = x + attention_1(norm(x))
    x = x + mlp_1(norm(x)) + shortcut

Parameter names are MindSpeed-LLM's: ``input_layernorm_{0,1}``, ``self_attention_{0,1}``,
``pre_mlp_layernorm_{0,1}``, ``mlps_{0,1}`` and the MoE as ``mlp``. A layer counts once (its
number is MindSpeed-LLM's --num-layers'); its two attentions cache apart.
"""

from __future__ import annotations

from mindspeed_core import features, nn
from mindspeed_core.memory import recompute
from mindspeed_core.models.gpt import MLP, SINGLE_DEVICE, TransformerLayer
from mindspeed_core.models.layers import make_norm


class ShortcutMoELayer(nn.Module):
    recompute_policy = recompute.NONE
    swap = TransformerLayer.swap
    _branch = TransformerLayer._branch

    def __init__(self, cfg, mlp, number: int | None = None):
        super().__init__()
        from mindspeed_core.models.mla import MLASelfAttention  # it builds on models/gpt.py

        self.hidden_dropout, self.branch_scale = cfg.hidden_dropout, None
        for j in (0, 1):
            setattr(self, f"input_layernorm_{j}", make_norm(cfg, cfg.hidden_size))
            attention = MLASelfAttention(cfg, number)
            attention.cache_key = (number, j)
            setattr(self, f"self_attention_{j}", attention)
            setattr(self, f"pre_mlp_layernorm_{j}", make_norm(cfg, cfg.hidden_size))
            setattr(self, f"mlps_{j}", MLP(cfg))
        self.mlp = mlp  # the mixture of experts

    def attentions(self) -> list:
        return [("self_attention_0", self.self_attention_0), ("self_attention_1", self.self_attention_1)]

    def dense_mlps(self) -> list:
        return [("mlps_0", self.mlps_0), ("mlps_1", self.mlps_1)]

    def forward(self, x, cos, sin, seams=SINGLE_DEVICE, tokens=None):
        features.note_used("family-longcat-flash")
        norm = self.recompute_policy.norm_of
        with self.swap():
            x = x + self._branch(self.self_attention_0(norm(self.input_layernorm_0, x), cos, sin, seams, tokens), seams)
        h = norm(self.pre_mlp_layernorm_0, x)
        shortcut = self.mlp(h)
        x = x + self._branch(self.mlps_0(h), seams)
        with self.swap():
            x = x + self._branch(self.self_attention_1(norm(self.input_layernorm_1, x), cos, sin, seams, tokens), seams)
        return x + self._branch(self.mlps_1(norm(self.pre_mlp_layernorm_1, x)), seams) + self._branch(shortcut, seams)
