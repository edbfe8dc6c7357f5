"""LongCat-Flash (transformers' longcat_flash; MindSpeed-LLM's longcat scripts): layers of two latent
attentions and two dense MLPs with a shortcut-connected mixture of experts (models/longcat.py).
Its attention is DeepSeek-V3's with the query latent, rotated in pairs, both latents scaled by
sqrt(hidden / rank) (--enable-mla-scale-q-lora / -kv-lora); its router scores by softmax over the
real experts and the zero-computation ones (--num-zero-experts: each returns its token times its
weight), chooses by score plus the expert bias, and scales the unnormalised weights."""

from __future__ import annotations

import numpy as np

from mindspeed_core.errors import CheckpointError
from mindspeed_core.models.config import MLAConfig, ModelConfig, MoEConfig
from mindspeed_core.models.families.base import Family, decoder_hf_config, mla_names, rope


class LongcatFlash(Family):
    name = "longcat_flash"
    architecture = "LongcatFlashForCausalLM"
    aliases = ("longcat",)
    specs = ("longcat_spec",)
    spec_fields = {"shortcut_moe": True}  # its spec's layer (no flag of its own)
    builds, experts = "moe", True
    router_name = "router.classifier.weight"
    expert_bias_name = "router.e_score_correction_bias"
    presets = {
        "tiny-longcat-flash": dict(family="longcat_flash", hidden_size=128, num_layers=2, num_attention_heads=4,
                                   ffn_hidden_size=256, qk_layernorm=True, shortcut_moe=True,
                                   mla=dict(kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                                            q_lora_rank=48, scale_q_lora=True, scale_kv_lora=True),
                                   moe=dict(num_experts=8, zero_experts=4, topk=3, ffn_hidden_size=64,
                                            score_function="softmax", norm_topk_prob=False, scaling_factor=6.0,
                                            enable_expert_bias=True, load_balancing_type="none")),
    }

    def config_from_hf(self, hf: dict) -> ModelConfig:
        if hf.get("hidden_act", "silu") != "silu" or hf.get("router_bias") or hf.get("mlp_bias"):
            raise CheckpointError("config.json: longcat_flash is read with silu MLPs and a router without a bias")
        if hf.get("head_dim", hf["qk_rope_head_dim"]) != hf["qk_rope_head_dim"]:  # transformers' RoPE reads head_dim
            raise CheckpointError(f"config.json: head_dim {hf['head_dim']} must be qk_rope_head_dim "
                                  f"{hf['qk_rope_head_dim']} (the rotated features' count)")
        theta, scaling = rope(hf)
        heads = hf["num_attention_heads"]
        mla = MLAConfig(kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
                        qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
                        q_lora_rank=hf["q_lora_rank"], rope_interleave=True, scale_q_lora=True, scale_kv_lora=True)
        moe = MoEConfig(num_experts=hf["n_routed_experts"], zero_experts=hf.get("zero_expert_num") or 0,
                        topk=hf["moe_topk"], ffn_hidden_size=hf["expert_ffn_hidden_size"], score_function="softmax",
                        norm_topk_prob=False, scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                        enable_expert_bias=True, load_balancing_type="none")
        return ModelConfig(
            family=self.name, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_layers"],
            num_attention_heads=heads, ffn_hidden_size=hf["ffn_hidden_size"],
            max_position_embeddings=hf.get("max_position_embeddings", 2048), norm_epsilon=hf.get("rms_norm_eps", 1e-5),
            rotary_base=theta, rope_scaling=scaling, attention_output_bias=bool(hf.get("attention_bias")),
            qk_layernorm=True, mla=mla, moe=moe, shortcut_moe=True,
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False))

    def hf_config(self, cfg: ModelConfig) -> dict:
        mla, moe = cfg.mla, cfg.moe
        if (not cfg.shortcut_moe or mla is None or not (mla.rope_interleave and mla.scale_q_lora and mla.scale_kv_lora)
                or not cfg.qk_layernorm or cfg.add_qkv_bias or cfg.add_bias_linear):
            raise CheckpointError("longcat_flash has shortcut-connected MoE layers of latent attention rotated in pairs "
                                  "with both latents scaled, and no q/k/v or MLP biases: this model lacks one of them")
        if (moe.score_function != "softmax" or moe.norm_topk_prob or not moe.enable_expert_bias
                or moe.shared_expert_size or moe.capacity_factor is not None):
            raise CheckpointError("longcat_flash routes by softmax over its experts with the expert bias, weights "
                                  "scaled but not renormalised, no shared expert or capacity")
        out = decoder_hf_config(self, cfg)
        for key in ("num_hidden_layers", "intermediate_size", "num_key_value_heads", "head_dim"):
            out.pop(key, None)
        out.update(num_layers=cfg.num_layers, ffn_hidden_size=cfg.ffn_hidden_size, q_lora_rank=mla.q_lora_rank,
                   kv_lora_rank=mla.kv_lora_rank, qk_nope_head_dim=mla.qk_nope_head_dim,
                   qk_rope_head_dim=mla.qk_rope_head_dim, head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim,
                   attention_bias=cfg.attention_output_bias, n_routed_experts=moe.num_experts,
                   zero_expert_num=moe.zero_experts, moe_topk=moe.topk,
                   expert_ffn_hidden_size=moe.ffn_hidden_size or cfg.ffn_hidden_size,
                   routed_scaling_factor=moe.scaling_factor)
        return out

    def _sublayer_names(self, cfg: ModelConfig, i: int) -> dict:
        """Hugging Face -> our names of layer i's tensors besides the MoE's."""
        a, b = f"model.layers.{i}.", f"decoder.layers.{i}."
        names = {}
        for j in (0, 1):
            for theirs, ours in mla_names(cfg, i).items():  # self_attn. -> self_attn.<j>.
                names[theirs.replace(f"{a}self_attn.", f"{a}self_attn.{j}.")] = ours.replace(
                    f"{b}self_attention.", f"{b}self_attention_{j}.")
            names[f"{a}self_attn.{j}.o_proj.weight"] = f"{b}self_attention_{j}.linear_proj.weight"
            names[f"{a}input_layernorm.{j}.weight"] = f"{b}input_layernorm_{j}.weight"
            names[f"{a}post_attention_layernorm.{j}.weight"] = f"{b}pre_mlp_layernorm_{j}.weight"
            names[f"{a}mlps.{j}.down_proj.weight"] = f"{b}mlps_{j}.linear_fc2.weight"
        return names

    def layer_from_hf(self, cfg: ModelConfig, i: int, hf: dict, take, out: dict) -> None:
        a = f"model.layers.{i}."
        out.update((ours, take(theirs)) for theirs, ours in self._sublayer_names(cfg, i).items())
        for j in (0, 1):
            out[f"decoder.layers.{i}.mlps_{j}.linear_fc1.weight"] = np.concatenate(
                [take(f"{a}mlps.{j}.gate_proj.weight"), take(f"{a}mlps.{j}.up_proj.weight")])
        out.update(self.experts_from_hf(cfg, i, hf, take))
        for e in range(cfg.moe.num_experts, cfg.moe.slots):  # transformers' unused rows of the zero experts
            for kind in ("gate_proj", "up_proj"):
                hf.pop(f"{a}mlp.experts.{e}.{kind}.weight", None)

    def layer_to_hf(self, cfg: ModelConfig, i: int, ours: dict, out: dict) -> None:
        a = f"model.layers.{i}."
        out.update((theirs, ours[mine]) for theirs, mine in self._sublayer_names(cfg, i).items())
        for j in (0, 1):
            gate, up = np.split(ours[f"decoder.layers.{i}.mlps_{j}.linear_fc1.weight"], 2)
            out[f"{a}mlps.{j}.gate_proj.weight"], out[f"{a}mlps.{j}.up_proj.weight"] = gate, up
        out.update(self.experts_to_hf(cfg, i, ours))
        f, h = cfg.moe.ffn_hidden_size or cfg.ffn_hidden_size, cfg.hidden_size
        for e in range(cfg.moe.num_experts, cfg.moe.slots):  # transformers allocates them; they compute nothing
            for kind in ("gate_proj", "up_proj"):
                out[f"{a}mlp.experts.{e}.{kind}.weight"] = np.zeros((f, h), np.float32)


FAMILY = LongcatFlash()
