"""The pieces a training run is built from, in the order the trainer builds them: the whole
model with its starting weights, the model cut for this rank's layout (pipeline stages,
tensor / sequence / context / expert parallelism, recompute and swap), and the optimizer over
the parameters it trains (torchtitan builds its train spec's parts the same way)."""

from __future__ import annotations

import numpy as np

from mindspeed_core import device, features, nn, ops
from mindspeed_core.compat import hf
from mindspeed_core.backends.common import check_fits_in_memory
from mindspeed_core.memory.swap import HostSwap
from mindspeed_core.models import lora
from mindspeed_core.models.layers import norm_parameters
from mindspeed_core.parallel import layers as parallel_layers
from mindspeed_core.parallel.parallelize import parallelize
from mindspeed_core.parallel.plan import ParallelPlan
from mindspeed_core.training import distributed, model_source, resume, routing, sharded_checkpoint
from mindspeed_core.training.configuration import memory_needed
from mindspeed_core.training.distributed_optimizer import DistributedAdamW
from mindspeed_core.training.muon import Muon
from mindspeed_core.training.optimizer import AdamW


def whole_model(spec, cfg, ckpt, tp: int, seed: int, say):
    """(the whole model, the iteration it resumes at, the saved optimizer (arrays, steps) or None):
    LoRA adapters started (from ``seed``), then the weights of --load-hf, --load and --lora-load
    (``ckpt``: configuration.Checkpointing)."""
    if device.type() == "cpu":
        check_fits_in_memory(memory_needed(cfg, tp), f"training this {cfg.num_parameters():,}-parameter model")
    hf_source = None
    if ckpt.load_hf:  # checked against its config before the model is built
        hf_source = model_source.read(ckpt.load_hf, "--load-hf", ("hf",), mtp_num_layers=cfg.mtp_num_layers)
    model = spec.build(cfg)
    if cfg.lora is not None:  # the adapters' start; a checkpoint may replace them
        features.note_used("lora")
        lora.init_adapters(model, seed)
    if hf_source is not None:  # the folder's layers are the real ones among --noop-layers
        state = hf.with_noop_layers(hf_source.cfg, hf_source.state, cfg.noop_layers)[1] if cfg.noop_layers else \
            hf_source.state
        resume.load_hf(model, cfg, state)
    iteration, saved_optimizer = 0, None
    for root, adapters_only in ((ckpt.load, False), (ckpt.lora_load, True)):
        if root:
            it, saved_optimizer = resume.resume(model, cfg, root, ckpt.finetune, say, adapters_only,
                                                ckpt.exit_on_missing)
            iteration = it if saved_optimizer is not None else iteration
    return model, iteration, saved_optimizer


def cut_for_layout(model, spec, pipeline_layout, ps, layout, memory, seed: int):
    """(this rank's model chunks, their parallel plan, the host swap or None): the whole model
    cut into this rank's pipeline stages, each parallelised as its family says (``layout``:
    configuration.ParallelLayout), with the recompute and swap policy (``memory``:
    configuration.Memory), and the tensor-parallel random streams seeded from ``seed``."""
    chunks = spec.pipeline_chunks(model, pipeline_layout, ps.local_rank("pp")) if ps.pp > 1 else [model]
    plan = ParallelPlan.join(parallelize(spec, c, ps, layout.sequence_parallel, layout.context_parallel_algo,
                                         layout.ulysses_degree_in_cp, layout.moe_dispatcher, layout.experts_whole,
                                         layout.cp_overlap, layout.moe_overlap)
                             for c in chunks)
    swap = HostSwap() if memory.swap_attention else None
    if memory.recompute.active or swap:
        for chunk in chunks:
            chunk.use_memory(memory.recompute, swap)
    if ps.tp > 1:
        parallel_layers.seed_model_parallel_rng(seed, ps)
    return chunks, plan, swap


def cast_for_mixed_precision(chunks: list, moe_layers: list, dtype: str, norms_float32: bool) -> None:
    """This rank's model chunks cast to ``dtype`` (the optimizer keeps float32 masters), the routers'
    expert biases kept in float32, and with ``norms_float32`` (--init-norm-weight-in-fp32) every
    norm's weight and bias too, with the values they had."""
    norms = [(owner, attr, ops.to_numpy(getattr(owner, attr)).astype(np.float32))
             for chunk in chunks for _, owner, attr in norm_parameters(chunk)] if norms_float32 else []
    routing.cast_keeping_expert_bias(chunks, moe_layers, dtype)
    for owner, attr, values in norms:
        setattr(owner, attr, nn.Parameter(values))
    if norms:
        features.note_used("init-norm-weight-fp32")


def optimizer(named: list, train_plan, plan, ps, optimization, distributed_optimizer: bool, saved=None, cfg=None):
    """AdamW, the distributed optimizer, or Muon, over the trained parameters ``named``, as
    ``optimization`` (configuration.Optimization) says; with ``saved`` (arrays, steps) of a
    checkpoint, this rank's slices of its state. ``cfg``: the model's (Muon's q/k/v split)."""
    o = optimization
    common = (named, o.lr, o.weight_decay, o.betas, o.eps)
    moment_dtype = o.moment_dtypes
    if o.o2_optimizer:
        features.note_used("o2-bf16-optimizer")
    if o.o2_gradient:
        features.note_used("o2-gradient")
    if distributed_optimizer and o.muon is None:
        opt = DistributedAdamW(*common, ps=ps, plan=train_plan, moment_dtype=moment_dtype,
                               reuse_fp32_param=o.reuse_fp32_param, bucket_elements=o.bucket_elements,
                               grad_dtype="bfloat16" if o.o2_gradient else "float32", swap_pieces=o.swap_pieces)
    elif o.muon is not None:
        m = o.muon
        opt = Muon(*common, ps=ps, plan=train_plan, moment_dtype=moment_dtype, bucket_elements=o.bucket_elements,
                   momentum=m.momentum, nesterov=m.nesterov, ns_steps=m.ns_steps, coefficients=m.coefficients,
                   scale_mode=m.scale_mode, extra_scale=m.extra_scale, split_qkv=m.split_qkv, cfg=cfg,
                   tp_mode=m.tp_mode, layerwise=m.layerwise)
    else:
        opt = AdamW(*common, ps=ps, plan=train_plan, moment_dtype=moment_dtype, bucket_elements=o.bucket_elements)
    if isinstance(saved, sharded_checkpoint.Reader):
        _load_slices(opt, saved, named, train_plan, ps)
    elif saved is not None:
        arrays, steps = saved
        mine, specs, experts_here = {n for n, _ in named}, plan.shard_specs, plan.expert_names
        local = {k: ops.tensor(distributed.local_array(k.split(".", 1)[1], v, specs, ps, experts_here))
                 for k, v in arrays.items() if k.split(".", 1)[1] in mine and opt.wants_state(k.split(".", 1)[1])}
        opt.load_state(local, steps)
    return opt


def _load_slices(opt, shards, named: list, train_plan, ps) -> None:
    """The optimizer state of this rank's slices from a sharded checkpoint: a distributed
    optimizer's flat slices, or plain AdamW's tensors (this rank's TP / EP pieces)."""
    entry, shapes, saved = {p.name: p for p in train_plan.params}, {n: tuple(p.shape) for n, p in named}, \
        shards.names("optimizer")

    def read(state: str, name: str, shape: tuple, flat=None):
        if state not in saved:  # a float32 save holds no masters (its weights are): a --bf16 resume takes them
            if saved and state == f"master.{name}" and name in wanting:
                return shards.read("model", sharded_checkpoint.held(name, shape, entry[name], ps, flat))
            return None
        return shards.read("optimizer", sharded_checkpoint.held(state, shape, entry[name], ps, flat))

    # the low-precision parameters, whose masters a float32 save's weights are
    wanting = set(shards.names("model")) & {n for n, p in named if ops.dtype_of(p) != "float32"}
    if hasattr(opt, "load_slices"):
        opt.load_slices(read, shards.steps)
        return
    local = {}
    for state in [*saved, *(f"master.{n}" for n in sorted(wanting) if f"master.{n}" not in saved)]:
        name = state.split(".", 1)[1]
        if name in shapes and saved and opt.wants_state(name):  # (dist_muon: its owner's only)
            local[state] = ops.tensor(read(state, name, shapes[name]))
    opt.load_state(local, shards.steps)
