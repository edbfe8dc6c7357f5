"""Model families and what the trainer needs of each (torchtitan's ModelSpec, in small):
how to build the whole model, how to cut it into pipeline stages, its tensor-parallel plan,
and its Hugging Face adapter. The trainer asks here instead of importing a model class.

Every dense decoder-only family (LLaMA, Mistral, Qwen2/3, GPT-2) is the one GPTModel with
config switches; the mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE) are MoEModel, the
same decoder with MoE MLPs (models/moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mindspeed_core.errors import MindSpeedError
from mindspeed_core.models import gpt, moe
from mindspeed_core.models.config import ModelConfig


@dataclass(frozen=True)
class ModelSpec:
    name: str
    families: tuple  # ModelConfig.family values it covers
    build: Callable  # (cfg) -> the whole model
    pipeline_chunks: Callable  # (whole model, PipelineLayout, pipeline rank) -> [model chunk]
    # (model chunk, ParallelState, sequence_parallel, cp_algo, ulysses_degree, moe_dispatcher)
    #   -> ParallelPlan
    parallelize: Callable
    hf_adapter: str  # module with load_config / load_folder / save_folder


def _parallelize_dense(chunk, ps, sequence_parallel, cp_algo="megatron_cp_algo", ulysses_degree=None,
                       moe_dispatcher=None, overrides=None):
    from mindspeed_core.parallel import context, layers  # parallel layers import the model's seams

    plan = layers.parallelize(chunk, ps, sequence_parallel, overrides)
    if ps.cp > 1:  # around tensor parallelism's seams: attention across the CP ranks
        chunk.use_seams(context.ContextParallelSeams(chunk.seams, ps, cp_algo, ulysses_degree))
    return plan


def _parallelize_moe(chunk, ps, sequence_parallel, cp_algo="megatron_cp_algo", ulysses_degree=None,
                     moe_dispatcher="allgather"):
    # the trainer refuses MoE with CP before any rank starts (check_configuration): the aux
    # loss over a sequence cut into CP chunks is not summed across the CP group yet
    if ps.cp > 1:
        raise MindSpeedError("a mixture-of-experts model cannot use context parallelism yet")
    from mindspeed_core.parallel import experts

    overrides = experts.parallelize_moe_layers(chunk, ps, sequence_parallel, moe_dispatcher)
    return _parallelize_dense(chunk, ps, sequence_parallel, overrides=overrides)


SPECS = (
    ModelSpec("gpt", ("llama", "mistral", "qwen2", "qwen3", "gpt2"), gpt.GPTModel, gpt.pipeline_chunks,
              _parallelize_dense, "mindspeed_core.compat.hf"),
    ModelSpec("moe", ("mixtral", "qwen2_moe", "qwen3_moe"), moe.MoEModel, gpt.pipeline_chunks, _parallelize_moe,
              "mindspeed_core.compat.hf"),
)


def for_config(cfg: ModelConfig) -> ModelSpec:
    if cfg.moe is not None:  # --num-experts on any dense family, or an MoE family
        return next(spec for spec in SPECS if spec.name == "moe")
    for spec in SPECS:
        if cfg.family in spec.families:
            return spec
    raise ValueError(f"no model spec covers the family {cfg.family!r}")
