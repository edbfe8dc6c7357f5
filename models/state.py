"""Whole-model state dicts ({parameter name: numpy array}, models/gpt.py's names) changed
with numpy alone, so that conversion and export (compat/, mindspeed convert) bind no
framework: LoRA adapters folded into their weights, layers renumbered."""

from __future__ import annotations

import dataclasses

import numpy as np

from mindspeed_core import features

ADAPTER_TAGS = (".lora_A.", ".lora_B.")
# the experts' stacked weights (models/moe.py) and the LoRA target each answers to
EXPERT_TARGETS = {"weight1": "linear_fc1", "weight2": "linear_fc2"}


EXPERT_BIAS = ".mlp.router.expert_bias"


def is_expert_bias(name: str) -> bool:
    """Whether a parameter is a router's expert bias (aux-loss-free balancing: state the
    step's loads move, not the optimizer)."""
    return name.endswith(EXPERT_BIAS)


def expert_bias_name(layer: int) -> str:
    return f"decoder.layers.{layer}{EXPERT_BIAS}"


def is_adapter(name: str) -> bool:
    """Whether a parameter name is a LoRA factor (trained) rather than a base weight."""
    return any(tag in name for tag in ADAPTER_TAGS)


def moved_under_lora(name: str) -> bool:
    """Whether a LoRA run moves tensor ``name``: its adapters, and the routers' expert biases
    (aux-loss-free balancing updates them from the loads during LoRA too, as megatron-core's):
    what an adapters-only checkpoint holds and --lora-load takes."""
    return is_adapter(name) or is_expert_bias(name)


def adapter_shapes(cfg) -> dict:
    """{name: shape} of every LoRA factor the config's model holds (models/gpt.py's linear
    layers named in ``cfg.lora.targets``, no-op layers none; an MoE layer's on its shared
    expert's linear layers and its experts' stacked weights, models/lora.py)."""
    if cfg.lora is None:
        return {}
    r = cfg.lora.r

    def glu(size):
        return 2 * size if cfg.gated else size

    # latent attention (models/mla.py): linear_qkv is the adapter of its fused down-projections
    # (MindSpeed-LLM's), and its linear_proj takes the heads' values
    mla = cfg.mla
    attention = ({"self_attention.linear_qkv": (cfg.hidden_size, cfg.qkv_width),
                  "self_attention.linear_proj": (cfg.num_attention_heads * cfg.kv_channels, cfg.hidden_size)}
                 if mla is None else
                 {"self_attention.linear_qkv": (cfg.hidden_size, (mla.q_lora_rank or 0) + mla.kv_lora_rank
                                                + mla.qk_rope_head_dim),
                  "self_attention.linear_proj": (cfg.num_attention_heads * mla.v_head_dim, cfg.hidden_size)})
    linears = {**attention,
               "mlp.linear_fc1": (cfg.hidden_size, glu(cfg.ffn_hidden_size)),
               "mlp.linear_fc2": (cfg.ffn_hidden_size, cfg.hidden_size)}
    stacked = {}
    if cfg.moe is not None:
        f, e, shared = cfg.moe.ffn_hidden_size or cfg.ffn_hidden_size, cfg.moe.num_experts, cfg.moe.shared_expert_size
        stacked = {"weight1": (e, cfg.hidden_size, glu(f)), "weight2": (e, f, cfg.hidden_size)}
        moe_linears = {k: v for k, v in linears.items() if k.startswith("self_attention.")}
        if shared:
            moe_linears.update({"mlp.shared_experts.linear_fc1": (cfg.hidden_size, glu(shared)),
                                "mlp.shared_experts.linear_fc2": (shared, cfg.hidden_size)})
    out = {}
    for i in range(cfg.num_layers):
        if i in cfg.noop_layers:
            continue
        moe = cfg.is_moe_layer(i)
        for module, (n_in, n_out) in (moe_linears if moe else linears).items():
            if module.startswith("self_attention.") and cfg.is_linear_layer(i):
                continue  # gated DeltaNet's projections take no adapters
            if module.rsplit(".", 1)[1] in cfg.lora.targets:
                out[f"decoder.layers.{i}.{module}.lora_A.weight"] = (r, n_in)
                out[f"decoder.layers.{i}.{module}.lora_B.weight"] = (n_out, r)
        for which, (n, n_in, n_out) in (stacked.items() if moe else ()):
            if EXPERT_TARGETS[which] in cfg.lora.targets:
                out[f"decoder.layers.{i}.mlp.experts.lora_A.{which}"] = (n, n_in, r)
                out[f"decoder.layers.{i}.mlp.experts.lora_B.{which}"] = (n, r, n_out)
    return out


def adapter_target(name: str) -> str:
    """The LoRA target (Megatron's module name) a factor's name answers to."""
    leaf = name.rsplit(".", 1)[1]
    return EXPERT_TARGETS.get(leaf) or name.partition(".lora_")[0].rsplit(".", 1)[1]


def adapter_rank(a_name: str, shape: tuple) -> int:
    """The LoRA rank of the A factor ``a_name`` of ``shape`` ([r, in]; an expert's [E, in, r])."""
    return int(shape[-1] if len(shape) == 3 else shape[0])


def check_adapters(cfg, state: dict, where: str) -> None:
    """The LoRA factors in ``state`` must be exactly those ``cfg`` describes, in their shapes
    (a ValueError naming the first that is not, for ``where``'s messages)."""
    want = adapter_shapes(cfg)
    held = {k: tuple(np.shape(v)) for k, v in state.items() if is_adapter(k)}
    for name in sorted(set(want) | set(held)):
        if name not in held:
            raise ValueError(f"{where} has no {name} (LoRA rank {cfg.lora.r}, targets {' '.join(cfg.lora.targets)})")
        if name not in want:
            raise ValueError(f"{where} holds {name}, which LoRA targets {' '.join(cfg.lora.targets)} do not include")
        if held[name] != want[name]:
            raise ValueError(f"{where}: {name} is {held[name]}, not {want[name]} (LoRA rank {cfg.lora.r})")


def merge_lora(cfg, state: dict) -> tuple:
    """(config, state) of a whole model with each adapter folded into its base weight
    (W + (alpha / r) B A, in float64, then the weight's dtype) and the factors dropped: what a
    Hugging Face export or generation loads. A config without LoRA passes through."""
    if cfg.lora is None:
        return cfg, state
    out = {k: v for k, v in state.items() if not is_adapter(k)}
    for name in state:
        if ".lora_A." not in name:
            continue
        base = name.replace(".lora_A.", ".")  # x.lora_A.weight -> x.weight; experts.lora_A.weight1 -> experts.weight1
        a = np.asarray(state[name], np.float64)
        b = np.asarray(state[name.replace(".lora_A.", ".lora_B.")], np.float64)
        if a.ndim == 3:
            features.note_used("lora-moe")
        delta = a @ b if a.ndim == 3 else b @ a  # the experts' [E, in, r] @ [E, r, out]; a linear's [out, r] @ [r, in]
        # latent attention's fused adapter: its rows go to the query's and the key/value's down-projections
        parts = ([(base, delta)] if base in out else
                 [(base.replace("linear_qkv.", f"{p}."), d) for p, d in zip(
                     ("linear_q_down_proj", "linear_kv_down_proj"), np.split(delta, [cfg.mla.q_lora_rank]))])
        for target, d in parts:
            w = np.asarray(out[target])
            out[target] = (w.astype(np.float64) + cfg.lora.scale * d).astype(w.dtype)
    return dataclasses.replace(cfg, lora=None), out


def renumber_layers(state: dict, number_of) -> dict:
    """The state with layer ``n``'s tensors under layer ``number_of(n)`` (no-op layers added
    or dropped); the other tensors as they are."""
    out = {}
    for name, value in state.items():
        if name.startswith("decoder.layers."):
            layer, rest = name[len("decoder.layers."):].split(".", 1)
            name = f"decoder.layers.{number_of(int(layer))}.{rest}"
        out[name] = value
    return out
