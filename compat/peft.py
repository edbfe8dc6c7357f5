"""PEFT adapter folders: a LoRA run's adapters as Hugging Face's peft library saves them for
the transformers model of the same family (what MindSpeed-LLM's ``--save-lora-to-hf`` writes).

    <dir>/adapter_config.json          peft_type LORA, r, lora_alpha, target_modules, ...
    <dir>/adapter_model.safetensors    base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight, ...

Our adapters sit on Megatron's fused layers; transformers' model has one projection per part.
A fused layer's factor pair (A [r, in], B [out, r]) becomes one pair per part: A as it is (the
parts read the same input), B's rows of that part (query, key and value rows out of the per-group
layout; gate and up halves), so each part's update B_part A is exactly its rows of B A.
Framework-free: numpy and safetensors.
"""

from __future__ import annotations

import json
import os

import numpy as np

from mindspeed_core import tensor_files
from mindspeed_core.compat import hf
from mindspeed_core.errors import MindSpeedError
from mindspeed_core.models import families
from mindspeed_core.models.config import ModelConfig
from mindspeed_core.models.families.base import split_qkv

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
# Megatron's module -> (transformers' block, its projections in B's row order)
_PARTS = {"linear_qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")), "linear_proj": ("self_attn", ("o_proj",)),
          "linear_fc1": ("mlp", ("gate_proj", "up_proj")), "linear_fc2": ("mlp", ("down_proj",))}
_BLOCKS = {"linear_qkv": "self_attention", "linear_proj": "self_attention", "linear_fc1": "mlp", "linear_fc2": "mlp"}


def _split_rows(cfg: ModelConfig, module: str, b: np.ndarray) -> tuple:
    if module == "linear_qkv":
        return split_qkv(cfg, b)
    if module == "linear_fc1":
        return tuple(np.split(b, 2))  # gate rows, then up rows
    return (b,)


def to_peft_state(cfg: ModelConfig, state: dict) -> dict:
    """{peft's tensor name: array} of the adapters in ``state`` (our names; layers numbered as
    the Hugging Face model numbers them, no-op layers dropped)."""
    cfg, state = hf.without_noop_layers(cfg, state)
    out = {}
    for i in range(cfg.num_layers):
        for module in cfg.lora.targets:
            ours = f"decoder.layers.{i}.{_BLOCKS[module]}.{module}"
            if ours + ".lora_A.weight" not in state:  # a mixture-of-experts layer's MLP
                continue
            a = np.asarray(state[ours + ".lora_A.weight"], np.float32)
            block, parts = _PARTS[module]
            for part, b in zip(parts, _split_rows(cfg, module, np.asarray(state[ours + ".lora_B.weight"], np.float32))):
                name = f"base_model.model.model.layers.{i}.{block}.{part}"
                out[name + ".lora_A.weight"] = np.ascontiguousarray(a)
                out[name + ".lora_B.weight"] = np.ascontiguousarray(b)
    return out


def adapter_config(cfg: ModelConfig) -> dict:
    alpha = cfg.lora.alpha
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora.r,
            "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha, "lora_dropout": cfg.lora.dropout,
            "target_modules": sorted(p for m in cfg.lora.targets for p in _PARTS[m][1]), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True, "inference_mode": True,
            "modules_to_save": None, "base_model_name_or_path": None}


def check_exportable(cfg: ModelConfig) -> None:
    if cfg.lora is None:
        raise MindSpeedError("the checkpoint holds no LoRA adapters to export")
    if not families.get(cfg.family).peft_export:
        built = ", ".join(f.name for f in families.FAMILIES.values() if f.peft_export)
        raise MindSpeedError(f"PEFT export is built for the {built} families; this is a {cfg.family} model")
    if cfg.moe is not None and {"linear_fc1", "linear_fc2"} & set(cfg.lora.targets):
        raise MindSpeedError("PEFT export of adapters on a mixture of experts' MLPs is not built: merge them into "
                             "the model instead (--lora-load RUN with --load-dir BASE)")


def save_adapter(folder: str, cfg: ModelConfig, state: dict) -> list:
    """Write ``folder``'s adapter_config.json and adapter_model.safetensors (beside whatever
    the folder holds, e.g. the base model); returns the files written."""
    check_exportable(cfg)
    tensors = to_peft_state(cfg, state)
    os.makedirs(folder, exist_ok=True)
    paths = [os.path.join(folder, WEIGHTS), os.path.join(folder, CONFIG)]
    tensor_files.save(paths[0], {k: tensor_files.HostTensor(v) for k, v in tensors.items()},
                      raw_metadata={"format": "pt"})
    tmp = paths[1] + f".tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(adapter_config(cfg), fh, indent=2)
    os.replace(tmp, paths[1])  # the config last: a folder with it holds the whole adapter
    return paths
