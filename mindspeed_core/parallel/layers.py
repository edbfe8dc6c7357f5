"""Tensor and sequence parallelism applied to a built model (torchtitan's way: the model
code stays single-device; this module swaps its layers for parallel ones).

``parallelize(model, ps, sequence_parallel)`` slices the full weights of a GPTModel (or of
one pipeline stage) for this rank, so a parallel run starts from exactly the single-process
initialisation:

    self_attention.linear_qkv   column-parallel, rows split by query group (mcore layout); with
                                fewer query groups than ranks, key/value heads are copied
    self_attention.linear_proj  row-parallel
    attention sinks             split by head, as the query rows
    mlp.linear_fc1              column-parallel; for SwiGLU the gate and up halves split apart
    mlp.linear_fc2              row-parallel
    word embeddings             vocab-parallel; the output layer and the loss likewise

With --sequence-parallel the activations between those regions are split along the
sequence: column layers all-gather them, row layers reduce-scatter, and the norms (whose
weights then see only part of the sequence) get their gradients summed over the group.
The embedding output is all-reduced and then sliced (Megatron reduce-scatters it: the same
result with less traffic; left for later). What changes in the model's computation goes
through its declared seams (TensorParallelSeams); parallelize() returns the parallel plan
(parallel/plan.py): how each parameter was cut and what its gradient needs.
"""

from __future__ import annotations

import contextlib

import numpy as np

from mindspeed_core import dist, nn, ops, random
from mindspeed_core.errors import MindSpeedError
from mindspeed_core.models import lora
from mindspeed_core.models.gpt import Seams, vocab_selector
from mindspeed_core.models.config import MLA_DOWN
from mindspeed_core.models.gated_deltanet import GatedDeltaNet
from mindspeed_core.parallel import mappings
from mindspeed_core.parallel.plan import KVCopies, ParallelPlan, ParamPlan
from mindspeed_core.parallel.sharding import shard


class ColumnParallelLinear(nn.Module):
    def __init__(self, full, group, sequence_parallel: bool, spec: tuple = ("split", 0)):
        super().__init__()
        n, r = dist.world_size(group), dist.rank(group)
        self.group, self.sp = group, sequence_parallel
        self.weight = nn.Parameter(shard(ops.to_numpy(full.weight), spec, n, r))
        self.bias = None if full.bias is None else nn.Parameter(shard(ops.to_numpy(full.bias), spec, n, r))
        adapter = lora.factors(full)
        if adapter is not None:  # B's rows follow the weight's; A is replicated
            lora.attach(self, adapter[0], shard(adapter[1], spec, n, r), full.lora_scale, full.lora_dropout)

    def forward(self, x):
        x = mappings.gather_from_sequence(x, self.group) if self.sp else mappings.copy_to_region(x, self.group)
        y = ops.linear(x, self.weight, self.bias)
        if getattr(self, "lora_A", None) is None:
            return y
        # x is the same on every rank here: the shared stream draws the same dropout mask
        return y + lora.adapter_output(self, x)


class RowParallelLinear(nn.Module):
    def __init__(self, full, group, sequence_parallel: bool):
        super().__init__()
        n, r = dist.world_size(group), dist.rank(group)
        self.group, self.sp = group, sequence_parallel
        self.weight = nn.Parameter(np.split(ops.to_numpy(full.weight), n, axis=1)[r])
        self.bias = None if full.bias is None else nn.Parameter(ops.to_numpy(full.bias))
        adapter = lora.factors(full)
        if adapter is not None:  # A's columns follow the weight's; B is replicated
            lora.attach(self, np.split(adapter[0], n, axis=1)[r], adapter[1], full.lora_scale, full.lora_dropout)

    def forward(self, x):
        y = ops.linear(x, self.weight)
        if getattr(self, "lora_A", None) is not None:  # a partial sum, reduced with the base output
            y = y + lora.adapter_output(self, x, _model_parallel_rng())
        y = mappings.reduce_scatter_to_sequence(y, self.group) if self.sp else mappings.reduce_from_region(y, self.group)
        return y if self.bias is None else y + self.bias


class DuplicatedLinear(nn.Module):
    """megatron-core's duplicated linear (multi-latent attention's down-projections): the whole
    weight on every rank, applied to the whole sequence (gathered under SP, else copied into the
    region); each rank's gradient, of its weight and of its input, is a partial sum over the
    heads its output feeds."""

    def __init__(self, full, group, sequence_parallel: bool):
        super().__init__()
        self.group, self.sp = group, sequence_parallel
        self.weight = nn.Parameter(ops.to_numpy(full.weight))
        self.bias = None if full.bias is None else nn.Parameter(ops.to_numpy(full.bias))

    def forward(self, x):
        x = mappings.gather_from_sequence(x, self.group) if self.sp else mappings.copy_to_region(x, self.group)
        return ops.linear(x, self.weight, self.bias)


class DuplicatedAdapter(nn.Module):
    """The fused down-projections' LoRA adapter (models/lora.py FusedAdapter) beside the
    duplicated layers it adds to: both factors whole on every rank, on the whole sequence, their
    gradients partial sums over the heads, as DuplicatedLinear's."""

    def __init__(self, full, group, sequence_parallel: bool):
        super().__init__()
        self.group, self.sp = group, sequence_parallel
        a, b = lora.factors(full)
        lora.attach(self, a, b, full.lora_scale, full.lora_dropout)

    def forward(self, x):
        x = mappings.gather_from_sequence(x, self.group) if self.sp else mappings.copy_to_region(x, self.group)
        return lora.adapter_output(self, x)  # the same x, and stream, on every rank: the same dropout mask


class HeadParallelLinear(nn.Module):
    """A column-parallel linear whose input is already whole on every rank (multi-latent
    attention's up-projections, after a duplicated one): this rank's rows, no communication."""

    def __init__(self, full, group):
        super().__init__()
        n, r = dist.world_size(group), dist.rank(group)
        self.weight = nn.Parameter(np.split(ops.to_numpy(full.weight), n, axis=0)[r])

    def forward(self, x):
        return ops.linear(x, self.weight)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, full, group):
        super().__init__()
        n, r = dist.world_size(group), dist.rank(group)
        vocab = full.weight.shape[0]
        self.group, self.start, self.end = group, r * vocab // n, (r + 1) * vocab // n
        self.weight = nn.Parameter(np.split(ops.to_numpy(full.weight), n, axis=0)[r])

    def forward(self, ids):
        inside = ops.logical_and(ops.ge(ids, self.start), ops.lt(ids, self.end))
        local = ops.where(inside, ids - self.start, ops.zeros_like(ids))
        x = ops.embedding(local, self.weight) * ops.unsqueeze(ops.cast(inside, ops.dtype_of(self.weight)), -1)
        return mappings.reduce_from_region(x, self.group)


def vocab_parallel_cross_entropy(logits, labels, group, vocab_start: int):
    """Per-token cross entropy when each rank holds a slice of the vocabulary: the softmax
    normaliser and the target logit are summed over the group (differentiably)."""
    shard = logits.shape[-1]
    peak = mappings.max_over(ops.amax(logits, dim=-1, keepdim=True), group)
    shifted = logits - peak
    total = mappings.reduce_from_region(ops.sum(ops.exp(shifted), dim=-1), group)
    inside = ops.logical_and(ops.ge(labels, vocab_start), ops.lt(labels, vocab_start + shard))
    local = ops.where(inside, labels - vocab_start, ops.zeros_like(labels))
    picked = ops.squeeze(ops.gather(shifted, 1, ops.unsqueeze(local, 1)), 1)
    target = mappings.reduce_from_region(ops.where(inside, picked, ops.zeros_like(picked)), group)
    return ops.log(total) - target


MODEL_PARALLEL_RNG = "model-parallel"


def seed_model_parallel_rng(seed: int, ps) -> None:
    """Megatron's scheme: the default stream is seeded alike on every rank (replicated
    activations draw the same masks); the tracked "model-parallel" stream is offset by the
    tensor-parallel rank (sharded activations draw different ones)."""
    tracker = random.tracker()
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, seed + 2718 + ps.local_rank("tp"))


def _model_parallel_rng():
    return random.tracker().fork(MODEL_PARALLEL_RNG)


def check_layout(cfg, tp: int, sequence_parallel: bool = False) -> None:
    """Refuse a tensor-parallel size the model cannot be cut by (from the config alone, so
    that the launcher can say so before any rank starts)."""
    if tp == 1:
        if sequence_parallel:
            raise MindSpeedError("--sequence-parallel needs --tensor-model-parallel-size > 1")
        return
    sizes = [("attention heads", cfg.num_attention_heads), ("ffn hidden size", cfg.ffn_hidden_size),
             ("padded vocabulary", cfg.vocab_size)]
    if cfg.linear_attention is not None:  # gated DeltaNet: each rank its key heads and their value heads
        sizes += [("linear attention's key heads", cfg.linear_attention.key_heads),
                  ("linear attention's value heads", cfg.linear_attention.value_heads)]
    if cfg.moe is not None:
        sizes.append(("experts' ffn hidden size", cfg.moe.ffn_hidden_size or cfg.ffn_hidden_size))
        if cfg.moe.shared_expert_size:
            sizes.append(("shared expert's ffn hidden size", cfg.moe.shared_expert_size))
    for what, value in sizes:
        if value % tp:
            raise MindSpeedError(f"tensor parallel size {tp} does not divide the {what} ({value})")
    groups = cfg.num_query_groups
    if groups % tp and tp % groups:
        raise MindSpeedError(f"tensor parallel size {tp} and {groups} query groups: one must divide the other")
    if groups % tp and cfg.qk_layernorm and cfg.qk_norm_across_heads:
        raise MindSpeedError(f"tensor parallel size {tp} copies the {groups} key heads, whose norm runs over all of "
                             f"them at once (MiniMax-M2's q/k norms): use a tensor parallel size that divides {groups}")


class TensorParallelSeams(Seams):
    """The model's seams (models/gpt.py) under tensor (and sequence) parallelism."""

    def __init__(self, cfg, ps, sequence_parallel: bool):
        tp, self.group, self.sp = ps.tp, ps.group("tp"), sequence_parallel
        self.tp = tp
        self.sequence_shards = tp if sequence_parallel else 1
        self.vocab_start = ps.local_rank("tp") * cfg.vocab_size // tp
        self._groups = max(cfg.num_query_groups // tp, 1)  # fewer groups than ranks: one, copied
        self._per_group = cfg.num_attention_heads // tp // self._groups

    def heads(self, cfg):
        return self._groups, self._per_group

    def sum_over_heads(self, x):
        # every rank's heads' share, summed: forward all-reduce, and backward too (each rank's
        # heads feed every rank's normed heads through the sum)
        return mappings.reduce_from_region(mappings.copy_to_region(x, self.group), self.group)

    def replicated_loss_share(self) -> float:
        return 1.0 / self.tp

    def attention_rng(self):
        # ranks holding different heads draw different masks
        return _model_parallel_rng()

    def hidden_rng(self):
        # hidden dropout acts on replicated activations (the same mask on every rank), except
        # under sequence parallelism, where each rank holds other tokens
        return _model_parallel_rng() if self.sp else contextlib.nullcontext()

    def decoder_input(self, x):
        return mappings.scatter_to_region(x, self.group, dim=1) if self.sp else x

    def output_input(self, x):
        return mappings.gather_from_sequence(x, self.group, dim=1) if self.sp else mappings.copy_to_region(x, self.group)

    def gather_logits(self, logits):
        return mappings.gather_from_region(logits, self.group, dim=-1)  # a mapping: a compiled decode step traces it

    def token_losses(self, logits, labels):
        return vocab_parallel_cross_entropy(logits, labels, self.group, self.vocab_start)

    def scalar_head(self, x, weight):
        # every rank computes the head on the same tokens; under SP on its own tokens, then
        # gathered (each rank's gradient is its own slice: the loss is the same everywhere)
        values = ops.linear(x, weight)
        return mappings.gather_from_region(values, self.group, dim=1) if self.sp else values

    def vocab_columns(self, logits, token_ids):
        # each rank's shard holds some of the columns (zeros for the others): their sum
        local = ops.matmul(logits, ops.tensor(vocab_selector(self.vocab_start, logits.shape[-1], token_ids)))
        return mappings.reduce_from_region(local, self.group)


def parallelize(model, ps, sequence_parallel: bool = False, overrides: dict | None = None) -> ParallelPlan:
    """Turn a freshly built (or freshly loaded) GPTModel, whole or one pipeline stage, into
    this rank's tensor-parallel shard, and return its parallel plan (parallel/plan.py).
    ``overrides``: {local parameter name: ParamPlan fields} for layers cut elsewhere (the MoE
    layers: parallel/experts.py)."""
    cfg, tp, group = model.cfg, ps.tp, ps.group("tp")
    check_layout(cfg, tp, sequence_parallel)
    spec, partial, kv = {}, set(), None
    if tp > 1:
        kv = _shard_layers(model, ps, group, sequence_parallel, spec, partial)
        model.use_seams(TensorParallelSeams(cfg, ps, sequence_parallel))
    params = []
    for local, name in zip((n for n, _ in nn.named_parameters(model)), model.parameter_names()):
        fields = dict(shard=spec.get(local),
                      partial=local in partial or (sequence_parallel and local not in spec
                                                   and local.startswith(("decoder.", "mtp."))),
                      kv_copies=kv is not None and spec.get(local, ("",))[0] == "qkv",
                      tied_copy=name.startswith("embedding.") and (local.startswith("output_layer.")
                                                                   or not model.pre_process))
        fields.update((overrides or {}).get(local, {}))
        params.append(ParamPlan(name, **fields))
    return ParallelPlan(params, kv)


def _shard_latent_attention(attn, prefix, group, sequence_parallel, spec, partial) -> None:
    """Multi-latent attention's down-projections duplicated, their latents' norms with them
    (gradients partial over the heads), the up-projections split by head."""
    for attr in MLA_DOWN:
        if hasattr(attn, attr):
            full = getattr(attn, attr)
            setattr(attn, attr, DuplicatedLinear(full, group, sequence_parallel))
            partial.update(prefix + f"{attr}.{kind}" for kind in ("weight", "bias")[:1 + (full.bias is not None)])
    if hasattr(attn, "linear_qkv"):  # LoRA on the fused down-projections
        attn.linear_qkv = DuplicatedAdapter(attn.linear_qkv, group, sequence_parallel)
        partial.update(prefix + f"linear_qkv.lora_{f}.weight" for f in "AB")
    for norm in ("q_layernorm", "kv_layernorm"):
        if hasattr(attn, norm):
            partial.add(prefix + f"{norm}.weight")
    for attr in ("linear_q_up_proj", "linear_kv_up_proj"):
        if hasattr(attn, attr):
            setattr(attn, attr, HeadParallelLinear(getattr(attn, attr), group))
            spec[prefix + f"{attr}.weight"] = ("split", 0)
    indexer = getattr(attn, "dsa_indexer", None)
    if indexer is not None:  # sparse attention's indexer, whole on every rank on the whole sequence: each
        # rank adds 1/TP of its loss (Seams.replicated_loss_share), so its gradients sum over the ranks
        for attr in ("wk", "weights_proj"):  # they read the layer's input (gathered under SP)
            setattr(indexer, attr, DuplicatedLinear(getattr(indexer, attr), group, sequence_parallel))
        partial.update(f"{prefix}dsa_indexer.{name}" for name, _ in nn.named_parameters(indexer))


def _shard_gated_deltanet(attn, prefix, ps, column, row, spec, partial) -> None:
    """A gated DeltaNet layer cut by heads: in_proj's sections and the convolution's channels
    (each rank its q, k, v, z, b, a slices), dt_bias and A_log by value head, out_proj by its input
    columns; out_norm (per head, replicated) with a gradient summed over the ranks' heads."""
    projections, channels = attn.la.sections()
    tp, r = ps.tp, ps.local_rank("tp")
    column(attn, "in_proj", prefix + "in_proj", ("sections", projections), False)
    attn.conv1d.weight = nn.Parameter(shard(ops.to_numpy(attn.conv1d.weight), ("sections", channels), tp, r))
    spec[prefix + "conv1d.weight"] = ("sections", channels)
    for name in ("dt_bias", "A_log"):
        setattr(attn, name, nn.Parameter(shard(ops.to_numpy(getattr(attn, name)), ("split", 0), tp, r)))
        spec[prefix + name] = ("split", 0)
    partial.add(prefix + "out_norm.weight")
    row(attn, "out_proj", prefix + "out_proj")
    attn.tp_shards = tp


def _shard_attention(cfg, attn, prefix, ps, group, sequence_parallel, spec, partial, column, row, qkv_spec) -> None:
    """One token mixer of a layer (``prefix``: its local name's, with the trailing dot) cut by heads."""
    tp = ps.tp
    if isinstance(attn, GatedDeltaNet):
        _shard_gated_deltanet(attn, prefix, ps, column, row, spec, partial)
        return
    if cfg.mla is not None:
        _shard_latent_attention(attn, prefix, group, sequence_parallel, spec, partial)
        if hasattr(attn, "linear_q_proj"):  # queries straight from the hidden state
            column(attn, "linear_q_proj", prefix + "linear_q_proj", ("split", 0), False)
    else:
        column(attn, "linear_qkv", prefix + "linear_qkv", qkv_spec, cfg.add_qkv_bias)
        if cfg.qk_layernorm and cfg.qk_norm_across_heads:  # a weight per feature of all heads: cut with them
            for norm in ("q_layernorm", "k_layernorm"):
                owner = getattr(attn, norm)
                owner.weight = nn.Parameter(shard(ops.to_numpy(owner.weight), ("split", 0), tp, ps.local_rank("tp")))
                spec[f"{prefix}{norm}.weight"] = ("split", 0)
        elif cfg.qk_layernorm:  # replicated, applied to this rank's heads: their gradients sum over TP
            partial.update(f"{prefix}{norm}.{kind}" for norm in ("q_layernorm", "k_layernorm")
                           for kind in ("weight", "bias")[:1 + (cfg.normalization == "layernorm")])
        if cfg.attention_sinks:  # one per head: this rank's heads' (consecutive, also with copied kv heads)
            sinks = attn.core_attention
            sinks.softmax_offset = nn.Parameter(shard(ops.to_numpy(sinks.softmax_offset), ("split", 0), tp,
                                                      ps.local_rank("tp")))
            spec[prefix + "core_attention.softmax_offset"] = ("split", 0)
    row(attn, "linear_proj", prefix + "linear_proj")


def _shard_layers(model, ps, group, sequence_parallel, spec, partial) -> KVCopies | None:
    """Replace the layers by their tensor-parallel versions; fills spec {local name: spec} and
    partial (local names of replicated LoRA factors, whose gradients are partial sums)."""
    cfg, tp = model.cfg, ps.tp
    groups, per = cfg.num_query_groups, cfg.num_attention_heads // cfg.num_query_groups
    kv = None
    if groups % tp == 0:
        qkv_spec = ("split", 0)
    else:  # fewer key/value heads than ranks: each is copied to tp/groups ranks
        qkv_spec = ("qkv", groups, per, cfg.kv_channels)
        rep = tp // groups
        kv = KVCopies(ps.subgroup("tp", rep), (per // rep) * cfg.kv_channels, ps.local_rank("tp") % rep)
    swiglu = ("swiglu",) if cfg.gated else ("split", 0)

    def column(owner, attr, prefix, cut, bias):
        full = getattr(owner, attr)
        setattr(owner, attr, ColumnParallelLinear(full, group, sequence_parallel, cut))
        spec[prefix + ".weight"] = cut
        if bias:
            spec[prefix + ".bias"] = cut
        if lora.factors(full) is not None:
            spec[prefix + ".lora_B.weight"] = cut
            partial.add(prefix + ".lora_A.weight")

    def row(owner, attr, prefix):
        full = getattr(owner, attr)
        setattr(owner, attr, RowParallelLinear(full, group, sequence_parallel))
        spec[prefix + ".weight"] = ("split", 1)
        if lora.factors(full) is not None:
            spec[prefix + ".lora_A.weight"] = ("split", 1)
            partial.add(prefix + ".lora_B.weight")

    for prefix, layer in model.transformer_layers():
        for name, attn in layer.attentions():  # LongCat-Flash's layer holds two
            _shard_attention(cfg, attn, f"{prefix}{name}.", ps, group, sequence_parallel, spec, partial, column, row,
                             qkv_spec)
        for name, mlp in layer.dense_mlps():  # an MoE layer's MLP is cut by parallel/experts.py
            column(mlp, "linear_fc1", f"{prefix}{name}.linear_fc1", swiglu, cfg.add_bias_linear)
            row(mlp, "linear_fc2", f"{prefix}{name}.linear_fc2")
    if hasattr(model, "embedding"):  # the first stage's, or the last's copy for multi-token prediction
        model.embedding.word_embeddings = VocabParallelEmbedding(model.embedding.word_embeddings, group)
        spec["embedding.word_embeddings.weight"] = ("split", 0)
    if model.post_process and hasattr(model, "output_layer"):
        model.output_layer = ColumnParallelLinear(model.output_layer, group, False)
        spec["output_layer.weight"] = ("split", 0)
        if model.output_layer.bias is not None:
            spec["output_layer.bias"] = ("split", 0)
    if model.post_process and hasattr(model, "rm_head") and sequence_parallel:
        partial.add("rm_head.weight")  # each rank's gradient holds its own tokens' share
    return kv
