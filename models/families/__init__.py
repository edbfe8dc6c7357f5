"""The model families, one module each (``FAMILY``: the family, or a tuple of related ones),
discovered here: a new family is a new module. Each holds everything that is that family's: its
Hugging Face config.json reading and writing, its tensors' names and layouts (fused projections
split and joined, experts, on-disk quirks), its MindSpeed-LLM names (--model-type-hf aliases,
--spec modules) and its presets (--model-name). What every family shares stays in compat/hf.py
(folders, shards, dtypes, the head, multi-token prediction layers) and models/families/base.py
(the LLaMA-like decoder several families extend).
"""

from __future__ import annotations

import importlib
import pkgutil

from mindspeed_core.models.config import ModelConfig
from mindspeed_core.models.families.base import Family


def _discover() -> dict:
    found = {}
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        if module == "base":
            continue
        declared = importlib.import_module(f"{__name__}.{module}").FAMILY
        for family in declared if isinstance(declared, tuple) else (declared,):
            if family.name in found:
                raise RuntimeError(f"models/families/{module}.py declares the family {family.name!r} again")
            found[family.name] = family
    return found


FAMILIES: dict = _discover()  # ModelConfig.family -> Family
# config.json's model_type -> Family
BY_MODEL_TYPE = {t: f for f in FAMILIES.values() for t in (f.model_types or (f.name,))}
# MindSpeed-LLM's --model-type-hf names -> our family
ALIASES = {alias: f.name for f in FAMILIES.values() for alias in f.aliases}
# a dense family's --model-type-hf name that MindSpeed-LLM's scripts also give an MoE family's models
ALSO_NAMED = {alias: f.name for f in FAMILIES.values() for alias in f.also_named}


def named(alias: str, moe: bool) -> str | None:
    """The family --model-type-hf ``alias`` names for a model with MoE layers or without (None:
    no family has that name). MindSpeed-LLM's Phi-3.5-MoE pretraining line names phi3.5, its
    converter's name for Phi-3.5-mini: for a model with experts that is Phi-3.5-MoE."""
    return ALSO_NAMED[alias] if moe and alias in ALSO_NAMED else ALIASES.get(alias)


# MindSpeed-LLM's layer spec modules (--spec) -> the family each builds
SPECS = {spec: f.name for f in FAMILIES.values() for spec in f.specs}
# --model-name presets
PRESETS = {name: fields for f in FAMILIES.values() for name, fields in f.presets.items()}


def get(name: str) -> Family:
    """The family of ModelConfig.family ``name``."""
    return FAMILIES[name]


def moe_of(dense: str) -> str | None:
    """The mixture-of-experts family whose attention is the dense family ``dense``'s."""
    return next((f.name for f in FAMILIES.values() if f.dense == dense), None)


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model name {name!r}; presets: {', '.join(sorted(PRESETS))}")
    return ModelConfig(**{**PRESETS[name], **overrides})


__all__ = ["ALIASES", "ALSO_NAMED", "BY_MODEL_TYPE", "FAMILIES", "PRESETS", "SPECS", "Family", "get", "moe_of", "named", "preset"]
