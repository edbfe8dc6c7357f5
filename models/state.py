"""Whole-model state dicts ({parameter name: numpy array}, models/gpt.py's names) changed
with numpy alone, so that conversion and export (compat/, mindspeed convert) bind no
framework: LoRA adapters folded into their weights, layers renumbered."""

from __future__ import annotations

import dataclasses

import numpy as np

ADAPTER_TAGS = (".lora_A.", ".lora_B.")


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


def adapter_shapes(cfg) -> dict:
    """{name: shape} of every LoRA factor the config's model holds (models/gpt.py's linear
    layers named in ``cfg.lora.targets``: no-op layers hold none, MoE layers none on their MLP)."""
    if cfg.lora is None:
        return {}
    width = 2 * cfg.ffn_hidden_size if cfg.gated else cfg.ffn_hidden_size
    sizes = {"self_attention.linear_qkv": (cfg.hidden_size, cfg.qkv_width),
             "self_attention.linear_proj": (cfg.num_attention_heads * cfg.kv_channels, cfg.hidden_size),
             "mlp.linear_fc1": (cfg.hidden_size, width), "mlp.linear_fc2": (cfg.ffn_hidden_size, cfg.hidden_size)}
    out = {}
    for i in range(cfg.num_layers):
        if i in cfg.noop_layers:
            continue
        for module, (n_in, n_out) in sizes.items():
            if module.split(".")[1] not in cfg.lora.targets or (module.startswith("mlp.") and cfg.is_moe_layer(i)):
                continue
            out[f"decoder.layers.{i}.{module}.lora_A.weight"] = (cfg.lora.r, n_in)
            out[f"decoder.layers.{i}.{module}.lora_B.weight"] = (n_out, cfg.lora.r)
    return out


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
        base = name.replace(".lora_A.weight", ".weight")
        a = np.asarray(state[name], np.float64)
        b = np.asarray(state[name.replace(".lora_A.", ".lora_B.")], np.float64)
        w = np.asarray(out[base])
        out[base] = (w.astype(np.float64) + cfg.lora.scale * (b @ a)).astype(w.dtype)
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
