"""Whole-model state dicts ({parameter name: numpy array}, models/gpt.py's names) changed
with numpy alone, so that conversion and export (compat/, mindspeed convert) bind no
framework: LoRA adapters folded into their weights, layers renumbered."""

from __future__ import annotations

import dataclasses

import numpy as np

ADAPTER_TAGS = (".lora_A.", ".lora_B.")


def is_adapter(name: str) -> bool:
    """Whether a parameter name is a LoRA factor (trained) rather than a base weight."""
    return any(tag in name for tag in ADAPTER_TAGS)


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
