"""Model families and what the trainer needs of each (torchtitan's ModelSpec, in small):
how to build the whole model, how to cut it into pipeline stages, and its Hugging Face
adapter. The trainer asks here instead of importing a model class. How each family is
parallelised lives with the parallel layers (parallel/families.py): models import nothing
of parallel/.

Every dense decoder-only family (LLaMA, Mistral, Qwen2/3, Phi-3, Gemma 2, GPT-2) is the one GPTModel with
config switches; the mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE) are MoEModel, the
same decoder with MoE MLPs (models/moe.py); GPT-OSS too, with attention sinks and biased experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mindspeed_core.models import gpt, moe
from mindspeed_core.models.config import ModelConfig


@dataclass(frozen=True)
class ModelSpec:
    name: str
    families: tuple  # ModelConfig.family values it covers
    build: Callable  # (cfg) -> the whole model
    pipeline_chunks: Callable  # (whole model, PipelineLayout, pipeline rank) -> [model chunk]
    hf_adapter: str  # module with load_config / load_folder / save_folder


SPECS = (
    ModelSpec("gpt", ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "gpt2", "deepseek_v2",
                     "deepseek_v3", "glm4_moe", "minicpm3"), gpt.GPTModel,
              gpt.pipeline_chunks, "mindspeed_core.compat.hf"),
    ModelSpec("moe", ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"), moe.MoEModel, gpt.pipeline_chunks,
              "mindspeed_core.compat.hf"),
)


def for_config(cfg: ModelConfig) -> ModelSpec:
    if cfg.moe is not None:  # --num-experts on any dense family, or an MoE family
        return next(spec for spec in SPECS if spec.name == "moe")
    for spec in SPECS:
        if cfg.family in spec.families:
            return spec
    raise ValueError(f"no model spec covers the family {cfg.family!r}")
