"""What a family is (``Family``) and what several families share: the LLaMA-like decoder's
config.json reading and writing, and the Hugging Face <-> our names of its layers (q/k/v fused
per query group, gate and up fused, latent attention, experts written one by one).

A family module subclasses ``Family`` (or one of the dense families it extends) and sets or
overrides what differs; compat/hf.py reads and writes folders through it (Hugging Face's
model_type picks the family) and keeps only what every family shares.
"""

from __future__ import annotations

import numpy as np

from mindspeed_core.errors import CheckpointError
from mindspeed_core.models import rope as rotary
from mindspeed_core.models.config import ModelConfig

# ModelConfig fields beyond the LLaMA decoder that only Gemma's layout can express (a sliding
# window also those with `window`), and those only MiniCPM3's can
GEMMA_FIELDS = ("norm_offset", "post_norm", "scale_embeddings", "query_pre_attn_scalar", "attn_logit_softcapping",
                "final_logit_softcapping", "sliding_window", "local_rotary_base")
MINICPM_FIELDS = ("scale_emb", "scale_depth", "dim_model_base")


class Family:
    """One model family. Class attributes say what it is; the methods read and write its
    config.json and its tensors (hf: a Hugging Face state dict, ours: ours, both numpy)."""

    name = ""  # ModelConfig.family
    model_types: tuple = ()  # config.json model_type values read as this family (default: its name)
    architecture = ""  # transformers' class
    aliases: tuple = ()  # MindSpeed-LLM's --model-type-hf names
    # names of another family that MindSpeed-LLM's scripts also give this one's MoE models (see families.named)
    also_named: tuple = ()
    specs: tuple = ()  # MindSpeed-LLM's layer spec modules (--spec) that build it
    spec_fields: dict = {}  # ModelConfig fields its --spec implies (no flag of their own)
    builds = "gpt"  # models/registry.py's spec: gpt (dense decoder) or moe
    dense = None  # a mixture of experts: the dense family whose attention it has
    experts = False  # its Hugging Face layout holds MoE layers
    mtp_layers = False  # multi-token prediction layers after the last one read and written (--mtp-num-layers)
    trailing_layers = False  # its folders may carry such layers, which a read without them leaves
    presets: dict = {}  # preset name (--model-name) -> ModelConfig fields
    spec_also: tuple = ()  # other families whose folders the layers its specs build also read
    quantizations: tuple = ()  # quantization_config methods whose weights it reads (dequantised)
    refused_model_types: dict = {}  # a related model_type it does not read -> why, and what it reads instead
    peft_export = False  # LoRA adapters export as PEFT's (q_proj, k_proj, v_proj, gate_proj, up_proj, ...)

    # ---- the LLaMA-like decoder's settings (the dense families and their MoE) ----
    window = None  # "every": a sliding window in every layer or none; "typed": in layer_types' sliding layers
    one_attention_bias = False  # attention_bias: biases on q, k, v and o together
    partial_rotary = False  # partial_rotary_factor below 1 read and written
    # field groups beyond the decoder it writes: "gemma", "minicpm", "hybrid" (gated attention and
    # linear-attention layers), or single fields of GEMMA_FIELDS
    expresses: tuple = ()
    shared_experts_prefix = "shared_expert."  # Hugging Face's name of the shared expert's module
    expert_bias_name = "gate.e_score_correction_bias"  # the router's expert bias, in its MoE block
    router_name = "gate.weight"  # the router's weight, in its MoE block

    def config_from_hf(self, hf: dict) -> ModelConfig:
        raise NotImplementedError

    def tensors_in(self, cfg: ModelConfig, hf: dict) -> dict:
        """A folder's tensors renamed to the layout this family's reader takes: a wrapper's (a
        multimodal folder's) text model renamed and what it does not use set aside (Qwen3.5),
        another model's names translated (Ling-V2's are GLM-4.5's); default: as they are."""
        return hf

    def tensors_out(self, cfg: ModelConfig, out: dict) -> dict:
        """The writer's tensors renamed as the family's folders name them (tensors_in's inverse)."""
        return out

    def hf_config(self, cfg: ModelConfig) -> dict:
        """config.json for ``cfg``; a model that this family cannot hold is a CheckpointError."""
        out = decoder_hf_config(self, cfg)
        if cfg.mla is not None:
            raise CheckpointError(f"{cfg.family} has no multi-latent attention: export it as deepseek_v2 or "
                                  f"deepseek_v3")
        return out

    # ---- tensors: the whole model (embedding, layers, final norm; the head and MTP are hf.py's) ----
    def body_from_hf(self, cfg: ModelConfig, hf: dict, take, out: dict) -> None:
        out["embedding.word_embeddings.weight"] = take("model.embed_tokens.weight")
        for i in range(cfg.num_layers):
            self.layer_from_hf(cfg, i, hf, take, out)
        out["decoder.final_layernorm.weight"] = take("model.norm.weight")

    def body_to_hf(self, cfg: ModelConfig, ours: dict, out: dict) -> None:
        out["model.embed_tokens.weight"] = ours["embedding.word_embeddings.weight"]
        for i in range(cfg.num_layers):
            self.layer_to_hf(cfg, i, ours, out)
        out["model.norm.weight"] = ours["decoder.final_layernorm.weight"]

    def layer_from_hf(self, cfg: ModelConfig, i: int, hf: dict, take, out: dict) -> None:
        """Hugging Face layer ``i`` into ``out`` as decoder.layers.<i>."""
        a = f"model.layers.{i}."
        self.attention_from_hf(cfg, i, hf, take, out)
        if cfg.is_moe_layer(i):
            out.update(self.experts_from_hf(cfg, i, hf, take))
        else:
            gate, up = take(a + "mlp.gate_proj.weight"), take(a + "mlp.up_proj.weight")
            out[f"decoder.layers.{i}.mlp.linear_fc1.weight"] = np.concatenate([gate, up])
            if cfg.add_bias_linear:
                out[f"decoder.layers.{i}.mlp.linear_fc1.bias"] = np.concatenate([take(a + "mlp.gate_proj.bias"),
                                                                                 take(a + "mlp.up_proj.bias")])
        for hf_n, ours in self.layer_names(cfg, i).items():
            if hf_n in hf:
                out[ours] = take(hf_n)

    def attention_from_hf(self, cfg: ModelConfig, i: int, hf: dict, take, out: dict) -> None:
        """Layer ``i``'s q/k/v projections (fused per query group), or its latent attention, and
        its sinks (the other attention tensors are layer_names')."""
        a, b = f"model.layers.{i}.", f"decoder.layers.{i}.self_attention.linear_qkv."
        if cfg.mla is not None:
            out.update((ours, take(theirs)) for theirs, ours in mla_names(cfg, i).items())
        else:
            out[b + "weight"] = fuse_qkv(cfg, *(take(a + f"self_attn.{x}_proj.weight") for x in "qkv"))
        if cfg.add_qkv_bias:
            out[b + "bias"] = fuse_qkv(cfg, *(take(a + f"self_attn.{x}_proj.bias") for x in "qkv"))
        if cfg.attention_sinks:
            out[f"decoder.layers.{i}.self_attention.core_attention.softmax_offset"] = take(a + "self_attn.sinks")

    def layer_to_hf(self, cfg: ModelConfig, i: int, ours: dict, out: dict) -> None:
        """Our decoder.layers.<i> into ``out`` as Hugging Face layer ``i``."""
        a = f"model.layers.{i}."
        self.attention_to_hf(cfg, i, ours, out)
        if cfg.is_moe_layer(i):
            out.update(self.experts_to_hf(cfg, i, ours))
        else:
            gate, up = np.split(ours[f"decoder.layers.{i}.mlp.linear_fc1.weight"], 2)
            out[a + "mlp.gate_proj.weight"], out[a + "mlp.up_proj.weight"] = gate, up
            if cfg.add_bias_linear:
                gate_b, up_b = np.split(ours[f"decoder.layers.{i}.mlp.linear_fc1.bias"], 2)
                out[a + "mlp.gate_proj.bias"], out[a + "mlp.up_proj.bias"] = gate_b, up_b
        for hf_n, mine in self.layer_names(cfg, i).items():
            if mine in ours:
                out[hf_n] = ours[mine]

    def attention_to_hf(self, cfg: ModelConfig, i: int, ours: dict, out: dict) -> None:
        a, b = f"model.layers.{i}.", f"decoder.layers.{i}.self_attention.linear_qkv."
        if cfg.mla is not None:
            out.update((theirs, ours[mine]) for theirs, mine in mla_names(cfg, i).items())
        else:
            for x, t in zip("qkv", split_qkv(cfg, ours[b + "weight"])):
                out[a + f"self_attn.{x}_proj.weight"] = t
        if cfg.add_qkv_bias:
            for x, t in zip("qkv", split_qkv(cfg, ours[b + "bias"])):
                out[a + f"self_attn.{x}_proj.bias"] = t
        if cfg.attention_sinks:
            out[a + "self_attn.sinks"] = ours[f"decoder.layers.{i}.self_attention.core_attention.softmax_offset"]

    def layer_names(self, cfg: ModelConfig, i: int) -> dict:
        """Hugging Face -> our names of layer i's tensors besides q/k/v and the MLP's fc1."""
        a, b = f"model.layers.{i}.", f"decoder.layers.{i}."
        names = {a + "input_layernorm.weight": b + "input_layernorm.weight",
                 a + "post_attention_layernorm.weight": b + "pre_mlp_layernorm.weight",
                 a + "self_attn.o_proj.weight": b + "self_attention.linear_proj.weight",
                 a + "self_attn.o_proj.bias": b + "self_attention.linear_proj.bias",
                 a + "self_attn.q_norm.weight": b + "self_attention.q_layernorm.weight",
                 a + "self_attn.k_norm.weight": b + "self_attention.k_layernorm.weight",
                 a + "mlp.down_proj.weight": b + "mlp.linear_fc2.weight",
                 a + "mlp.down_proj.bias": b + "mlp.linear_fc2.bias"}
        if cfg.mla is not None:  # its q_layernorm is the query latent's (mla_names)
            names = {k: v for k, v in names.items() if not k.endswith(("q_norm.weight", "k_norm.weight"))}
        return names

    # ---- experts written one by one (the layout every release of transformers reads) ----
    def moe_names(self, cfg: ModelConfig, i: int) -> tuple[str, tuple]:
        """(MoE block prefix, (gate, up, down) names of an expert's projections); the router is
        the block's ``router_name``."""
        return f"model.layers.{i}.mlp.", ("gate_proj", "up_proj", "down_proj")

    def note_expert_bias(self) -> None:
        """Called where a router's expert bias is read or written."""

    def experts_from_hf(self, cfg: ModelConfig, i: int, hf: dict, take) -> dict:
        """Layer i's router, experts (stacked: [E, h, 2f] gate then up columns, [E, f, h]) and
        shared expert."""
        a, (g, u, d) = self.moe_names(cfg, i)
        b = f"decoder.layers.{i}.mlp."
        out = {b + "router.weight": take(a + self.router_name)}
        if cfg.moe.enable_expert_bias:  # DeepSeek-V3's and GLM-4.5's steering of the choice
            self.note_expert_bias()
            out[b + "router.expert_bias"] = take(a + self.expert_bias_name).astype(np.float32)
        w1, w2 = [], []
        for e in range(cfg.moe.num_experts):
            gate, up = take(f"{a}experts.{e}.{g}.weight"), take(f"{a}experts.{e}.{u}.weight")
            w1.append(np.concatenate([gate, up]).T)
            w2.append(take(f"{a}experts.{e}.{d}.weight").T)
        out[b + "experts.weight1"], out[b + "experts.weight2"] = np.stack(w1), np.stack(w2)
        if cfg.moe.shared_expert_size:
            s = a + self.shared_experts_prefix
            out[b + "shared_experts.linear_fc1.weight"] = np.concatenate([take(s + "gate_proj.weight"),
                                                                          take(s + "up_proj.weight")])
            out[b + "shared_experts.linear_fc2.weight"] = take(s + "down_proj.weight")
            if cfg.moe.shared_expert_gate:
                out[b + "shared_experts.gate_weight"] = take(a + "shared_expert_gate.weight")
        return out

    def experts_to_hf(self, cfg: ModelConfig, i: int, ours: dict) -> dict:
        a, (g, u, d) = self.moe_names(cfg, i)
        b = f"decoder.layers.{i}.mlp."
        out = {a + self.router_name: ours[b + "router.weight"]}
        if cfg.moe.enable_expert_bias:
            self.note_expert_bias()
            out[a + self.expert_bias_name] = ours[b + "router.expert_bias"]
        for e in range(cfg.moe.num_experts):
            gate, up = np.split(ours[b + "experts.weight1"][e].T, 2)
            out[f"{a}experts.{e}.{g}.weight"] = np.ascontiguousarray(gate)
            out[f"{a}experts.{e}.{u}.weight"] = np.ascontiguousarray(up)
            out[f"{a}experts.{e}.{d}.weight"] = np.ascontiguousarray(ours[b + "experts.weight2"][e].T)
        if cfg.moe.shared_expert_size:
            s = a + self.shared_experts_prefix
            out[s + "gate_proj.weight"], out[s + "up_proj.weight"] = np.split(
                ours[b + "shared_experts.linear_fc1.weight"], 2)
            out[s + "down_proj.weight"] = ours[b + "shared_experts.linear_fc2.weight"]
            if cfg.moe.shared_expert_gate:
                out[a + "shared_expert_gate.weight"] = ours[b + "shared_experts.gate_weight"]
        return out


class LlamaLike(Family):
    """The LLaMA decoder and the families that are it with switches (Mistral, Qwen2, Qwen3,
    Phi-3) and their mixtures of experts: one config.json reader for them all."""

    peft_export = True

    def config_from_hf(self, hf: dict) -> ModelConfig:
        kind = hf["model_type"]
        if hf.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"hidden_act {hf.get('hidden_act')!r} is not supported for {kind} (silu only)")
        refuse_partial_rotary(hf, self.dense or kind, self.partial_rotary)
        theta, scaling = rope(hf)
        heads = hf["num_attention_heads"]
        moe, moe_layers = self.moe_from_hf(hf)
        return ModelConfig(
            family=self.name, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"], num_attention_heads=heads,
            num_query_groups=hf.get("num_key_value_heads") or heads,
            kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads, ffn_hidden_size=hf["intermediate_size"],
            max_position_embeddings=hf.get("max_position_embeddings", 2048), norm_epsilon=hf.get("rms_norm_eps", 1e-6),
            rotary_base=theta, rope_scaling=scaling, add_qkv_bias=self.qkv_bias_from_hf(hf),
            add_bias_linear=self.mlp_bias_from_hf(hf), attention_output_bias=self.output_bias_from_hf(hf),
            qk_layernorm=self.qk_norm, untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
            rotary_percent=float(partial_rotary_factor(hf)), moe=moe, moe_layers=moe_layers,
            **dict(zip(("sliding_window", "sliding_window_layers"), self.window_from_hf(hf))))

    qk_norm = False  # Qwen3's q/k norms

    def qkv_bias_from_hf(self, hf: dict) -> bool:
        return self.output_bias_from_hf(hf)

    def output_bias_from_hf(self, hf: dict) -> bool:
        # Llama's and Qwen3's attention_bias: q, k, v and o projections; Mistral's attention has
        # none (transformers ignores attention_bias there, and so do we)
        return bool(hf.get("attention_bias")) and self.one_attention_bias

    def mlp_bias_from_hf(self, hf: dict) -> bool:
        return False

    def moe_from_hf(self, hf: dict) -> tuple:
        return None, None

    def window_from_hf(self, hf: dict) -> tuple[int | None, tuple | None]:
        """(sliding_window, sliding_window_layers) as transformers reads them: Mistral's and
        Phi-3's window in every layer; Qwen's, with use_sliding_window, in its layer_types'
        sliding layers (by default those from max_window_layers on); Llama has none."""
        window = hf.get("sliding_window")
        if not window or self.window is None:
            return None, None
        if self.window == "every":
            return window, None
        if not hf.get("use_sliding_window"):
            return None, None
        layers = hf["num_hidden_layers"]
        types = hf.get("layer_types") or ["sliding_attention" if i >= hf.get("max_window_layers", 28)
                                          else "full_attention" for i in range(layers)]
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        return (window, sliding) if sliding else (None, None)


def decoder_hf_config(family: Family, cfg: ModelConfig) -> dict:
    """The LLaMA-like decoder's config.json, with the switches ``family`` has; the family adds
    its own keys after (Family.hf_config)."""
    if cfg.attention_sinks or cfg.glu_linear_offset or cfg.activation_func_clamp_value is not None:
        raise CheckpointError(f"{cfg.family} has no attention sinks or clamped experts in transformers (gpt_oss "
                              f"has): this model cannot be written as a {cfg.family} folder")
    if (cfg.attention_output_gate or cfg.linear_attention is not None) and "hybrid" not in family.expresses:
        raise CheckpointError(f"{cfg.family} has no gated attention or linear-attention layers in transformers "
                              f"(qwen3_next has): this model cannot be written as a {cfg.family} folder")
    windowed = family.window is not None
    foreign = [f for f in GEMMA_FIELDS if getattr(cfg, f) and not (windowed and f == "sliding_window")
               and f not in family.expresses]
    foreign += ["activation"] if cfg.activation != "swiglu" and "activation" not in family.expresses else []
    if cfg.rotary_percent != 1.0 and not family.partial_rotary:
        foreign.append("partial_rotary_factor")
    minicpm = [f for f in MINICPM_FIELDS if getattr(cfg, f) is not None]
    if ("gemma" not in family.expresses and foreign) or ("minicpm" not in family.expresses and minicpm):
        raise CheckpointError(f"{cfg.family} has no {(foreign or minicpm)[0]} setting in transformers: this model "
                              f"cannot be written as a {cfg.family} folder")
    rope_parameters = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rope_scaling:
        rope_parameters.update(cfg.rope_scaling)
    if cfg.rotary_percent != 1.0:
        rope_parameters["partial_rotary_factor"] = cfg.rotary_percent
    out = {"model_type": cfg.family, "architectures": [family.architecture], "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
           "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
           "num_key_value_heads": cfg.num_query_groups, "head_dim": cfg.kv_channels,
           "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_epsilon,
           "hidden_act": "silu", "rope_theta": cfg.rotary_base, "rope_parameters": rope_parameters,
           "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights}
    if family.one_attention_bias:
        if cfg.add_qkv_bias != cfg.attention_output_bias:
            raise CheckpointError(f"{cfg.family} has one attention_bias for q, k, v and o: this model has "
                                  f"q/k/v biases {cfg.add_qkv_bias} but an output bias {cfg.attention_output_bias}")
        out["attention_bias"] = cfg.add_qkv_bias
    every = list(range(cfg.num_layers))
    if family.window == "every":
        if cfg.sliding_window_layers not in (None, tuple(every)):
            raise CheckpointError(f"{cfg.family} slides its window in every layer or none: this model slides it in "
                                  f"layers {list(cfg.sliding_window_layers)}")
        out["sliding_window"] = cfg.sliding_window
    if family.window == "typed":
        sliding = every if cfg.sliding_window_layers is None else cfg.sliding_window_layers
        out.update(sliding_window=cfg.sliding_window, use_sliding_window=cfg.sliding_window is not None,
                   max_window_layers=min(sliding, default=cfg.num_layers), layer_types=[
                       "sliding_attention" if cfg.sliding_window and i in sliding else "full_attention" for i in every])
    return out


# ---- config.json readers several families share ---------------------------------------------

def rope(hf: dict) -> tuple[float, dict | None]:
    """(rope_theta, the scaling) as transformers reads them, from rope_parameters or the older
    rope_theta / rope_scaling."""
    params = dict(hf.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling:
        if not isinstance(scaling, dict):
            raise CheckpointError(f"config.json: {key} must be an object, got {scaling!r}")
        scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        if scaling.get("rope_type") in ("llama3", "yarn", "longrope"):
            # transformers' reading: a top-level original_max_position_embeddings first, else
            # the one in rope_scaling, else the model's own length
            if hf.get("original_max_position_embeddings") is not None:
                scaling["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
            elif hf.get("max_position_embeddings") is not None:
                scaling.setdefault("original_max_position_embeddings", hf["max_position_embeddings"])
        wrong = rotary.problem(scaling)
        if wrong:
            raise CheckpointError(f"config.json: {key}.{wrong}")
    return theta, scaling or None


def partial_rotary_factor(hf: dict, default: float = 1.0) -> float:
    return (hf.get("rope_parameters") or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", default))


def refuse_partial_rotary(hf: dict, kind: str, supported: bool) -> None:
    """RoPE on part of each head, where the family's model rotates every feature."""
    if partial_rotary_factor(hf) != 1.0 and not supported:
        raise CheckpointError(f"config.json: partial_rotary_factor {partial_rotary_factor(hf)!r} (RoPE on part of "
                              f"each head) is not supported for {kind}")


def transformers_aux_loss(hf: dict, topk: int) -> float:
    """transformers' aux loss is E * sum_e f_e P_e with f_e counting all k choices: k times
    Megatron's, whose coefficient ours is; it is only added with output_router_logits."""
    return hf.get("router_aux_loss_coef", 0.0) * topk if hf.get("output_router_logits") else 0.0


# ---- tensors several families share ---------------------------------------------------------

def fuse_qkv(cfg: ModelConfig, q, k, v):
    """Per query group: its query heads, its key head, its value head (mcore layout)."""
    g, d = cfg.num_query_groups, cfg.kv_channels
    per = cfg.num_attention_heads // g
    tail = q.shape[1:]
    parts = [q.reshape((g, per, d) + tail), k.reshape((g, 1, d) + tail), v.reshape((g, 1, d) + tail)]
    return np.concatenate(parts, axis=1).reshape((-1,) + tail)


def split_qkv(cfg: ModelConfig, qkv):
    g, d = cfg.num_query_groups, cfg.kv_channels
    per = cfg.num_attention_heads // g
    tail = qkv.shape[1:]
    grouped = qkv.reshape((g, per + 2, d) + tail)
    q = grouped[:, :per].reshape((-1,) + tail)
    return q, grouped[:, per].reshape((-1,) + tail), grouped[:, per + 1].reshape((-1,) + tail)


def mla_names(cfg: ModelConfig, i: int) -> dict:
    """Hugging Face -> our names of layer i's multi-latent attention tensors (o_proj aside)."""
    a, b, mla = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}.self_attention.", cfg.mla
    pairs = [("q_proj", "linear_q_proj", False)] if mla.q_lora_rank is None else [
        ("q_a_proj", "linear_q_down_proj", cfg.attention_output_bias), ("q_b_proj", "linear_q_up_proj", False)]
    pairs += [("kv_a_proj_with_mqa", "linear_kv_down_proj", cfg.attention_output_bias),
              ("kv_b_proj", "linear_kv_up_proj", False)]
    if cfg.qk_layernorm:
        pairs += [("kv_a_layernorm", "kv_layernorm", False)]
        pairs += [("q_a_layernorm", "q_layernorm", False)] if mla.q_lora_rank is not None else []
    names = {}
    for theirs, ours, bias in pairs:
        for kind in ("weight", "bias") if bias else ("weight",):
            names[f"{a}{theirs}.{kind}"] = f"{b}{ours}.{kind}"
    return names
