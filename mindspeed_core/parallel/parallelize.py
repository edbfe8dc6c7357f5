"""How each model spec (models/registry.py: the dense decoder, MoE) is parallelised: the
tensor-parallel plan of its layers, context parallelism around attention, and expert parallelism
for the MoE layers (torchtitan keeps a parallelize function per model the same way)."""

from __future__ import annotations

from mindspeed_core.parallel import context, experts, layers
from mindspeed_core.parallel.plan import ParallelPlan


def _dense(chunk, ps, sequence_parallel, cp_algo="megatron_cp_algo", ulysses_degree=None, moe_dispatcher=None,
           experts_whole=False, cp_overlap=False, moe_overlap=False, overrides=None) -> ParallelPlan:
    plan = layers.parallelize(chunk, ps, sequence_parallel, overrides)
    if ps.cp > 1 and cp_algo is not None:  # around tensor parallelism's seams: attention across the CP ranks
        chunk.use_seams(context.ContextParallelSeams(chunk.seams, ps, cp_algo, ulysses_degree, cp_overlap))
    return plan


def _moe(chunk, ps, sequence_parallel, cp_algo="megatron_cp_algo", ulysses_degree=None,
         moe_dispatcher="allgather", experts_whole=False, cp_overlap=False, moe_overlap=False) -> ParallelPlan:
    overrides = experts.parallelize_moe_layers(chunk, ps, sequence_parallel, moe_dispatcher, experts_whole,
                                               context_shares=ps.cp > 1 and cp_algo is not None, overlap=moe_overlap)
    return _dense(chunk, ps, sequence_parallel, cp_algo, ulysses_degree, cp_overlap=cp_overlap, overrides=overrides)


BY_SPEC = {"gpt": _dense, "moe": _moe}  # ModelSpec.name -> its parallelisation


def parallelize(spec, chunk, ps, sequence_parallel: bool, cp_algo: str | None = "megatron_cp_algo",
                ulysses_degree: int | None = None, moe_dispatcher: str = "allgather",
                experts_whole: bool = False, cp_overlap: bool = False, moe_overlap: bool = False) -> ParallelPlan:
    """Apply the spec's parallel layout to one model chunk in place; returns its plan.
    ``cp_algo`` None: whole sequences whatever the context-parallel size (a model that only
    scores them, as GRPO's reward model). ``experts_whole``: the MoE layers' experts stay whole
    on every TP rank (--expert-tensor-parallel-size 1). ``cp_overlap``: the ring's exchanges travel
    while its blocks compute (--use-cp-send-recv-overlap); ``moe_overlap``: the alltoall dispatch in
    chunks that travel while the experts compute (--moe-alltoall-overlap-comm)."""
    return BY_SPEC[spec.name](chunk, ps, sequence_parallel, cp_algo, ulysses_degree, moe_dispatcher, experts_whole,
                              cp_overlap, moe_overlap)
