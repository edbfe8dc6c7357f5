"""How each model spec (models/registry.py: the dense decoder, MoE) is parallelised: the
tensor-parallel plan of its layers, context parallelism around attention, and expert parallelism
for the MoE layers (torchtitan keeps a parallelize function per model the same way)."""

from __future__ import annotations

from mindspeed_core.errors import MindSpeedError
from mindspeed_core.parallel import context, experts, layers
from mindspeed_core.parallel.plan import ParallelPlan


def _dense(chunk, ps, sequence_parallel, cp_algo="megatron_cp_algo", ulysses_degree=None, moe_dispatcher=None,
           experts_whole=False, overrides=None) -> ParallelPlan:
    plan = layers.parallelize(chunk, ps, sequence_parallel, overrides)
    if ps.cp > 1 and cp_algo is not None:  # around tensor parallelism's seams: attention across the CP ranks
        chunk.use_seams(context.ContextParallelSeams(chunk.seams, ps, cp_algo, ulysses_degree))
    return plan


def _moe(chunk, ps, sequence_parallel, cp_algo="megatron_cp_algo", ulysses_degree=None,
         moe_dispatcher="allgather", experts_whole=False) -> ParallelPlan:
    # the matrix refuses MoE with CP before any rank starts (its moe-context-parallel row): the aux
    # loss over a sequence cut into CP chunks is not summed across the CP group yet
    if ps.cp > 1 and cp_algo is not None:
        raise MindSpeedError("a mixture-of-experts model cannot use context parallelism yet")
    overrides = experts.parallelize_moe_layers(chunk, ps, sequence_parallel, moe_dispatcher, experts_whole)
    return _dense(chunk, ps, sequence_parallel, overrides=overrides)


BY_SPEC = {"gpt": _dense, "moe": _moe}  # ModelSpec.name -> its parallelisation


def parallelize(spec, chunk, ps, sequence_parallel: bool, cp_algo: str | None = "megatron_cp_algo",
                ulysses_degree: int | None = None, moe_dispatcher: str = "allgather",
                experts_whole: bool = False) -> ParallelPlan:
    """Apply the spec's parallel layout to one model chunk in place; returns its plan.
    ``cp_algo`` None: whole sequences whatever the context-parallel size (a model that only
    scores them, as GRPO's reward model). ``experts_whole``: the MoE layers' experts stay whole
    on every TP rank (--expert-tensor-parallel-size 1)."""
    return BY_SPEC[spec.name](chunk, ps, sequence_parallel, cp_algo, ulysses_degree, moe_dispatcher, experts_whole)
