"""DeepSeek-V2 (and V2-Lite) and DeepSeek-V3: multi-head latent attention (models/mla.py), dense
layers first, then DeepSeek's MoE (V2: softmax greedy top-k; V3: sigmoid scores steered by an
expert bias, top-k among the best groups) beside shared experts; V3's folders may carry
multi-token prediction layers. GLM-4.5 shares the MoE (glm4_moe.py), MiniCPM3 the attention."""

from __future__ import annotations

from mindspeed_core import features
from mindspeed_core.errors import CheckpointError
from mindspeed_core.models.config import MLAConfig, ModelConfig, MoEConfig
from mindspeed_core.models.families.base import Family, decoder_hf_config, rope


class DeepSeekV2(Family):
    name = "deepseek_v2"
    architecture = "DeepseekV2ForCausalLM"
    aliases = ("deepseek2-lite",)
    experts = True
    trailing_layers = True
    shared_experts_prefix = "shared_experts."
    v3 = False

    def config_from_hf(self, hf: dict) -> ModelConfig:
        kind = self.name
        mla = mla_from_hf(hf, kind, interleave=not self.v3 or hf.get("rope_interleave", True))
        theta, scaling = rope(hf)
        layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
        dense = hf.get("first_k_dense_replace", 3 if self.v3 else 0)
        moe_layers = tuple(range(min(dense, layers), layers)) if hf.get("n_routed_experts") else ()
        moe = moe_from_hf(hf, kind) if moe_layers else None
        return ModelConfig(
            family=kind, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=layers,
            num_attention_heads=heads, ffn_hidden_size=hf["intermediate_size"],
            max_position_embeddings=hf.get("max_position_embeddings", 2048), norm_epsilon=hf.get("rms_norm_eps", 1e-6),
            rotary_base=theta, rope_scaling=scaling, attention_output_bias=bool(hf.get("attention_bias")),
            qk_layernorm=True, mla=mla, untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
            moe=moe, moe_layers=moe_layers or None)

    sparse_attention = False  # sparse attention's indexer (deepseek_v32.py)

    def hf_config(self, cfg: ModelConfig) -> dict:
        if cfg.dsa is not None and not self.sparse_attention:
            raise CheckpointError(f"{self.name} has no sparse attention indexer: export this model as deepseek_v32 "
                                  f"or glm_moe_dsa")
        out = decoder_hf_config(self, cfg)
        mla = cfg.mla
        if mla is None or not cfg.qk_layernorm or cfg.add_qkv_bias or cfg.add_bias_linear:
            raise CheckpointError(f"{cfg.family} has multi-latent attention with its latents' norms, and no q/k/v or "
                                  f"MLP biases: this model lacks one of them or has more")
        if not self.v3 and not mla.rope_interleave:
            raise CheckpointError("deepseek_v2 stores its rotated features interleaved; this model does not")
        for key in ("num_key_value_heads", "head_dim"):
            del out[key]
        out.update(q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank, qk_nope_head_dim=mla.qk_nope_head_dim,
                   qk_rope_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim,
                   attention_bias=cfg.attention_output_bias, first_k_dense_replace=cfg.num_layers)
        if self.v3:
            out.update(rope_interleave=mla.rope_interleave, num_nextn_predict_layers=cfg.mtp_num_layers)
        moe_to_hf(cfg, out, v3=self.v3)
        if self.v3 and cfg.moe is not None:
            out["scoring_func"] = "sigmoid"
        return out


class DeepSeekV3(DeepSeekV2):
    name = "deepseek_v3"
    architecture = "DeepseekV3ForCausalLM"
    aliases = ("deepseek3",)
    specs = ("deepseek_spec",)  # MindSpeed-LLM's plm_spec builds PLM's (plm.py)
    # DeepSeek's spec builds V2's layers too, and with --enable-dsa-indexer V3.2's and GLM-5's
    spec_also = ("deepseek_v2", "deepseek_v32", "glm_moe_dsa")
    mtp_layers = True
    v3 = True
    presets = {
        # DeepSeek-V3's routing on the LLaMA decoder: sigmoid scores, 4 groups of which each token
        # may use 2, weights renormalised and scaled, aux-loss-free bias, a tiny sequence aux loss,
        # one shared expert, the first layer dense (its latent attention is not here)
        "tiny-deepseek-v3": dict(family="llama", hidden_size=128, num_layers=4, num_attention_heads=4,
                                 num_query_groups=4, ffn_hidden_size=352, moe_layers=(1, 2, 3),
                                 moe=dict(num_experts=8, topk=2, ffn_hidden_size=64, score_function="sigmoid",
                                          num_groups=4, group_topk=2, scaling_factor=2.5, enable_expert_bias=True,
                                          load_balancing_type="seq_aux_loss", aux_loss_coeff=1e-4,
                                          shared_expert_size=64)),
    }

    def note_expert_bias(self) -> None:
        features.note_used("hf-deepseek-v3-moe")


def mla_from_hf(hf: dict, kind: str, interleave: bool) -> MLAConfig:
    """A latent attention's sizes (DeepSeek's keys, which MiniCPM3 shares); ``interleave``: its
    rotated features are pairs (DeepSeek-V2), not halves."""
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act {hf.get('hidden_act')!r} is not supported for {kind} (silu only)")
    if hf.get("mlp_bias"):
        raise CheckpointError(f"config.json: mlp_bias is not supported for {kind}")
    return MLAConfig(kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
                     qk_rope_head_dim=hf["qk_rope_head_dim"],
                     v_head_dim=hf.get("v_head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
                     q_lora_rank=hf.get("q_lora_rank"), rope_interleave=interleave)


def moe_from_hf(hf: dict, kind: str) -> MoEConfig:
    """DeepSeek-V2's softmax top-k (greedy), or DeepSeek-V3's (and GLM-4.5's) sigmoid scores
    steered by each router's e_score_correction_bias (our expert bias: aux-loss-free
    balancing) with top-k among the best groups (a group scored by its two best experts)."""
    groups, topk_group = hf.get("n_group"), hf.get("topk_group")
    v3 = kind != "deepseek_v2"
    if not v3:
        method = hf.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy") or (method == "group_limited_greedy" and groups != 1):
            raise CheckpointError(f"config.json: topk_method {method!r} with {groups} groups is not supported for "
                                  f"deepseek_v2 (greedy top-k only: its groups score by their best expert)")
        groups = topk_group = None
    else:
        if hf.get("topk_method", "noaux_tc") != "noaux_tc" or hf.get("scoring_func", "sigmoid") != "sigmoid":
            raise CheckpointError(f"config.json: topk_method {hf.get('topk_method')!r} with scoring_func "
                                  f"{hf.get('scoring_func')!r} is not supported for {kind} (noaux_tc, sigmoid)")
        if groups and hf["n_routed_experts"] % groups:
            raise CheckpointError(f"config.json: {hf['n_routed_experts']} routed experts do not split into "
                                  f"n_group {groups} groups")
        groups, topk_group = (groups, topk_group) if groups and groups > 1 else (None, None)
    shared = hf.get("n_shared_experts") or 0
    return MoEConfig(num_experts=hf["n_routed_experts"], topk=hf["num_experts_per_tok"],
                     ffn_hidden_size=hf["moe_intermediate_size"], score_function="sigmoid" if v3 else "softmax",
                     norm_topk_prob=bool(hf.get("norm_topk_prob", v3)), num_groups=groups, group_topk=topk_group,
                     scaling_factor=float(hf.get("routed_scaling_factor", 1.0)), enable_expert_bias=v3,
                     shared_expert_size=hf["moe_intermediate_size"] * shared if shared else None)


def moe_to_hf(cfg: ModelConfig, out: dict, v3: bool) -> None:
    """DeepSeek's and GLM-4.5's MoE keys: dense layers first, then routed and shared experts."""
    moe = cfg.moe
    if moe is None:
        return
    dense = min(cfg.moe_layers or (0,))
    if cfg.moe_layers not in (None, tuple(range(dense, cfg.num_layers))):
        raise CheckpointError(f"{cfg.family} has dense layers first, then an MoE MLP in every layer")
    router = ((moe.score_function, bool(moe.enable_expert_bias)) == (("sigmoid", True) if v3 else ("softmax", False))
              and (v3 or not moe.num_groups))
    if (not router or moe.shared_expert_gate or moe.capacity_factor is not None
            or (moe.shared_expert_size or 0) % (moe.ffn_hidden_size or 1)):
        raise CheckpointError(f"{cfg.family} routes by " + ("sigmoid scores with an expert bias (aux-loss-free)"
                              if v3 else "softmax top-k") + ", with shared experts a whole number of experts wide: "
                              "this model's router has no equivalent there")
    expert = moe.ffn_hidden_size or cfg.ffn_hidden_size
    out.update(first_k_dense_replace=dense, n_routed_experts=moe.num_experts, num_experts_per_tok=moe.topk,
               moe_intermediate_size=expert, n_shared_experts=(moe.shared_expert_size or 0) // expert,
               norm_topk_prob=moe.norm_topk_prob, routed_scaling_factor=moe.scaling_factor,
               topk_method="noaux_tc" if v3 else "greedy", n_group=moe.num_groups or 1, topk_group=moe.group_topk or 1)


FAMILY = (DeepSeekV2(), DeepSeekV3())
