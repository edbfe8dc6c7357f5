"""Hunyuan-V3 (transformers' hy_v3; MindSpeed-LLM's hunyuan3 scripts, --model-type-hf HYV3):
Qwen3's attention (q/k norms per head, one attention_bias switch), dense MLP layers where
mlp_layer_types says "dense" (the first, in the releases), elsewhere experts chosen by sigmoid
scores steered by the block's expert bias, renormalised and scaled by router_scaling_factor,
beside a shared expert (num_shared_experts x moe_intermediate_size wide, ungated).

enable_moe_fp32_combine adds the routed and shared outputs in float32: ours are added in the
activations' dtype after the routed sum (float32) is cast; in float32 training and inference,
as here, the two are the same."""

from __future__ import annotations

from mindspeed_core import features
from mindspeed_core.errors import CheckpointError
from mindspeed_core.models.config import ModelConfig, MoEConfig
from mindspeed_core.models.families.base import LlamaLike, transformers_aux_loss
from mindspeed_core.models.families.mixtral import moe_sizes_of


class HYV3(LlamaLike):
    name = "hy_v3"
    architecture = "HYV3ForCausalLM"
    aliases = ("HYV3", "hy_v3")
    builds, experts = "moe", True
    one_attention_bias = True
    qk_norm = True
    peft_export = False
    router_name = "router.gate.weight"
    expert_bias_name = "expert_bias"
    shared_experts_prefix = "shared_mlp."
    presets = {
        "tiny-hy-v3": dict(family="hy_v3", hidden_size=128, num_layers=4, num_attention_heads=4, num_query_groups=2,
                           kv_channels=32, ffn_hidden_size=352, qk_layernorm=True, norm_epsilon=1e-5,
                           moe_layers=(1, 2, 3),
                           moe=dict(num_experts=8, topk=2, ffn_hidden_size=96, score_function="sigmoid",
                                    enable_expert_bias=True, scaling_factor=2.826, load_balancing_type="none",
                                    aux_loss_coeff=0.0, shared_expert_size=96)),
    }

    def note_expert_bias(self) -> None:  # where its routers' expert bias is read or written
        features.note_used("family-hy-v3")

    def mlp_bias_from_hf(self, hf: dict) -> bool:
        if hf.get("mlp_bias"):
            raise CheckpointError("config.json: hy_v3 with mlp_bias is not supported (its experts and shared expert "
                                  "would carry biases)")
        return False

    def moe_from_hf(self, hf: dict) -> tuple:
        topk, experts = moe_sizes_of(hf)
        layers = hf["num_hidden_layers"]
        types = hf.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
        if len(types) != layers or set(types) - {"dense", "sparse"}:
            raise CheckpointError(f"config.json: mlp_layer_types {types!r} is not one of 'dense' / 'sparse' per layer")
        moe_layers = tuple(i for i, t in enumerate(types) if t == "sparse")
        if not moe_layers:
            raise CheckpointError("config.json: hy_v3 without sparse layers (mlp_layer_types) is a dense model: "
                                  "export it as qwen3")
        width, shared = hf["moe_intermediate_size"], hf.get("num_shared_experts", 1) or 0
        return MoEConfig(num_experts=experts, topk=topk, ffn_hidden_size=width, score_function="sigmoid",
                         norm_topk_prob=True, enable_expert_bias=True,
                         scaling_factor=float(hf.get("router_scaling_factor", 1.0)),
                         aux_loss_coeff=transformers_aux_loss(hf, topk),
                         load_balancing_type="aux_loss" if hf.get("output_router_logits") else "none",
                         shared_expert_size=width * shared or None), (None if len(moe_layers) == layers else moe_layers)

    def hf_config(self, cfg: ModelConfig) -> dict:
        out = super().hf_config(cfg)
        moe = cfg.moe
        if cfg.add_bias_linear or not cfg.qk_layernorm or cfg.qk_norm_across_heads:
            raise CheckpointError("hy_v3 has q/k norms per head and no MLP biases: this model has no equivalent there")
        expert = (moe.ffn_hidden_size or cfg.ffn_hidden_size) if moe else 0
        if (moe is None or moe.score_function != "sigmoid" or not moe.enable_expert_bias or not moe.norm_topk_prob
                or moe.num_groups or moe.shared_expert_gate or moe.capacity_factor is not None
                or (moe.shared_expert_size or 0) % expert):
            raise CheckpointError("hy_v3 routes by sigmoid scores with the expert bias, renormalised and scaled, "
                                  "without groups, beside an ungated shared expert a whole number of experts wide: "
                                  "this model's router has no equivalent there")
        out.update(num_experts=moe.num_experts, num_experts_per_tok=moe.topk, moe_intermediate_size=expert,
                   num_shared_experts=(moe.shared_expert_size or 0) // expert,
                   router_scaling_factor=moe.scaling_factor, enable_moe_fp32_combine=True, mlp_bias=False,
                   mlp_layer_types=["sparse" if cfg.is_moe_layer(i) else "dense" for i in range(cfg.num_layers)],
                   output_router_logits=moe.aux_loss_coeff > 0, router_aux_loss_coef=moe.aux_loss_coeff / moe.topk)
        return out


FAMILY = HYV3()
