"""What the trainer needs of each model (torchtitan's ModelSpec, in small): how to build the
whole model and how to cut it into pipeline stages. The trainer asks here instead of importing
a model class. What a family is (its Hugging Face layout, names, presets) is its module's in
models/families/; how a model is parallelised lives with the parallel layers
(parallel/parallelize.py): models import nothing of parallel/.

Every dense decoder-only family (LLaMA, Mistral, Qwen2/3, Phi-3, Gemma, GPT-2, DeepSeek's and
MiniCPM3's latent attention) is the one GPTModel with config switches; the mixtures of experts
(Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-OSS, or --num-experts on any family) are MoEModel, the same
decoder with MoE MLPs (models/moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mindspeed_core.models import families, gpt, moe
from mindspeed_core.models.config import ModelConfig


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable  # (cfg) -> the whole model
    pipeline_chunks: Callable  # (whole model, PipelineLayout, pipeline rank) -> [model chunk]

    @property
    def families(self) -> tuple:
        """The ModelConfig.family values built by this spec when they have no MoE settings."""
        return tuple(name for name, f in families.FAMILIES.items() if f.builds == self.name)


SPECS = (
    ModelSpec("gpt", gpt.GPTModel, gpt.pipeline_chunks),
    ModelSpec("moe", moe.MoEModel, gpt.pipeline_chunks),
)


def for_config(cfg: ModelConfig) -> ModelSpec:
    if cfg.moe is not None:  # --num-experts on any dense family, or an MoE family
        return next(spec for spec in SPECS if spec.name == "moe")
    if cfg.family not in families.FAMILIES:
        raise ValueError(f"no model spec covers the family {cfg.family!r}")
    return next(spec for spec in SPECS if spec.name == families.get(cfg.family).builds)
