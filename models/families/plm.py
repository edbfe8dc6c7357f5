"""PLM (PLM-Team's PLM-1.8B, model_type plm; MindSpeed-LLM's plm_spec with --squared-relu). Its
modelling code is outside the transformers release (a transformers pull request and the Hub's
folders hold it); read from there, it is DeepSeek-V2-Lite's dense decoder with another MLP:

- latent attention without a query latent: ``q_proj``, then ``kv_a_proj_with_mqa`` (the key/value
  latent and one rotated key shared by the heads), ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``;
  RoPE on consecutive pairs of the rotated features (``rope_interleave``, on by default), the
  softmax scale 1/sqrt(qk_nope_head_dim + qk_rope_head_dim);
- an MLP of ``up_proj`` and ``down_proj`` without a gate, relu(x)^2 between them (``relu2``);
- tied embeddings by default, no experts.
"""

from __future__ import annotations

import dataclasses

from mindspeed_core import features
from mindspeed_core.errors import CheckpointError
from mindspeed_core.models.config import ModelConfig
from mindspeed_core.models.families.deepseek import DeepSeekV2


class PLM(DeepSeekV2):
    name = "plm"
    architecture = "PLMForCausalLM"
    aliases = ("plm",)
    experts = False
    trailing_layers = False
    # MindSpeed-LLM's plm_spec: DeepSeek's latent-attention layer, the key/value latent always normed
    # (its spec builds the norm without --qk-layernorm, which the PLM scripts do not pass)
    specs = ("plm_spec",)
    spec_fields = {"qk_layernorm": True}
    expresses = ("activation",)  # its squared-ReLU MLP
    presets = {
        # PLM-1.8B's layer, scaled: latent attention without a query latent, a squared-ReLU MLP, tied
        "tiny-plm": dict(family="plm", hidden_size=128, num_layers=3, num_attention_heads=4, ffn_hidden_size=256,
                         activation="squared_relu", qk_layernorm=True, rotary_base=100000.0,
                         mla=dict(kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)),
    }

    def config_from_hf(self, hf: dict) -> ModelConfig:
        if hf.get("hidden_act", "relu2") != "relu2":
            raise CheckpointError(f"config.json: hidden_act {hf['hidden_act']!r}: PLM's MLP is relu2 (squared ReLU)")
        if hf.get("q_lora_rank") or hf.get("n_routed_experts"):
            raise CheckpointError("config.json: PLM's attention has no query latent and its MLPs no experts; this "
                                  "folder sets q_lora_rank or n_routed_experts")
        cfg = super().config_from_hf({**hf, "n_routed_experts": None, "hidden_act": "silu", "tie_word_embeddings":
                                      hf.get("tie_word_embeddings", True)})
        mla = dataclasses.replace(cfg.mla, rope_interleave=bool(hf.get("rope_interleave", True)))
        return dataclasses.replace(cfg, family=self.name, activation="squared_relu", mla=mla)

    def hf_config(self, cfg: ModelConfig) -> dict:
        if cfg.activation != "squared_relu" or cfg.moe is not None or cfg.mla is None or cfg.mla.q_lora_rank:
            raise CheckpointError("plm has latent attention without a query latent and squared-ReLU MLPs without "
                                  "experts: this model has another attention or MLP")
        out = super().hf_config(cfg)
        out.pop("first_k_dense_replace", None)
        out.update(hidden_act="relu2", rope_interleave=cfg.mla.rope_interleave)
        return out

    def layer_from_hf(self, cfg: ModelConfig, i: int, hf: dict, take, out: dict) -> None:
        features.note_used("family-plm")
        self.attention_from_hf(cfg, i, hf, take, out)
        out[f"decoder.layers.{i}.mlp.linear_fc1.weight"] = take(f"model.layers.{i}.mlp.up_proj.weight")
        for hf_n, ours in self.layer_names(cfg, i).items():
            if hf_n in hf:
                out[ours] = take(hf_n)

    def layer_to_hf(self, cfg: ModelConfig, i: int, ours: dict, out: dict) -> None:
        features.note_used("family-plm")
        self.attention_to_hf(cfg, i, ours, out)
        out[f"model.layers.{i}.mlp.up_proj.weight"] = ours[f"decoder.layers.{i}.mlp.linear_fc1.weight"]
        for hf_n, mine in self.layer_names(cfg, i).items():
            if mine in ours:
                out[hf_n] = ours[mine]


FAMILY = PLM()
