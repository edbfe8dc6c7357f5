"""Tensor and sequence parallelism applied to a built model (torchtitan's way: the model
code stays single-device; this module swaps its layers for parallel ones).

``parallelize(model, ps, sequence_parallel)`` slices the full weights of a GPTModel for this
rank, so a parallel run starts from exactly the single-process initialisation:

    self_attention.linear_qkv   column-parallel, rows split by query group (mcore layout)
    self_attention.linear_proj  row-parallel
    mlp.linear_fc1              column-parallel; for SwiGLU the gate and up halves split apart
    mlp.linear_fc2              row-parallel
    word embeddings             vocab-parallel; the output layer and the loss likewise

With --sequence-parallel the activations between those regions are split along the
sequence: column layers all-gather them, row layers reduce-scatter, and the norms (whose
weights then see only part of the sequence) get their gradients summed over the group.
``shard_spec`` records how each sharded parameter was cut, for checkpoints and the
gradient norm.
"""

from __future__ import annotations

import numpy as np

from mindspeed_core import autograd, dist, nn, ops
from mindspeed_core.errors import MindSpeedError
from mindspeed_core.parallel import mappings


def shard_rows(full: np.ndarray, n: int, r: int, swiglu: bool = False) -> np.ndarray:
    if swiglu:  # [gate; up] -> [gate_r; up_r]
        gate, up = np.split(full, 2, axis=0)
        return np.concatenate([np.split(gate, n, axis=0)[r], np.split(up, n, axis=0)[r]])
    return np.split(full, n, axis=0)[r]


def shard(full: np.ndarray, spec: tuple, n: int, r: int) -> np.ndarray:
    dim, swiglu = spec
    return shard_rows(full, n, r, swiglu) if dim == 0 else np.split(full, n, axis=dim)[r]


def unshard(parts: list, spec: tuple) -> np.ndarray:
    dim, swiglu = spec
    if swiglu:
        halves = [np.split(p, 2, axis=0) for p in parts]
        return np.concatenate([h[0] for h in halves] + [h[1] for h in halves])
    return np.concatenate(parts, axis=dim)


class ColumnParallelLinear(nn.Module):
    def __init__(self, full, group, sequence_parallel: bool, swiglu: bool = False):
        super().__init__()
        n, r = dist.world_size(group), dist.rank(group)
        self.group, self.sp = group, sequence_parallel
        self.weight = nn.Parameter(shard_rows(ops.to_numpy(full.weight), n, r, swiglu))
        self.bias = None if full.bias is None else nn.Parameter(shard_rows(ops.to_numpy(full.bias), n, r, swiglu))

    def forward(self, x):
        x = mappings.gather_from_sequence(x, self.group) if self.sp else mappings.copy_to_region(x, self.group)
        return ops.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, full, group, sequence_parallel: bool):
        super().__init__()
        n, r = dist.world_size(group), dist.rank(group)
        self.group, self.sp = group, sequence_parallel
        self.weight = nn.Parameter(np.split(ops.to_numpy(full.weight), n, axis=1)[r])
        self.bias = None if full.bias is None else nn.Parameter(ops.to_numpy(full.bias))

    def forward(self, x):
        y = ops.linear(x, self.weight)
        y = mappings.reduce_scatter_to_sequence(y, self.group) if self.sp else mappings.reduce_from_region(y, self.group)
        return y if self.bias is None else y + self.bias


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
    peak = dist.all_reduce(ops.amax(autograd.detach(logits), dim=-1, keepdim=True), op="max", group=group)
    shifted = logits - peak
    total = mappings.reduce_from_region(ops.sum(ops.exp(shifted), dim=-1), group)
    inside = ops.logical_and(ops.ge(labels, vocab_start), ops.lt(labels, vocab_start + shard))
    local = ops.where(inside, labels - vocab_start, ops.zeros_like(labels))
    picked = ops.squeeze(ops.gather(shifted, 1, ops.unsqueeze(local, 1)), 1)
    target = mappings.reduce_from_region(ops.where(inside, picked, ops.zeros_like(picked)), group)
    return ops.log(total) - target


def parallelize(model, ps, sequence_parallel: bool = False) -> dict:
    """Turn a freshly built (or freshly loaded) full GPTModel into this rank's TP shard.

    Returns the shard spec {parameter name: (split dim, swiglu halves)} of the sharded
    parameters; every other parameter is replicated across the tensor-parallel group."""
    cfg, tp, group = model.cfg, ps.tp, ps.group("tp")
    if tp == 1:
        if sequence_parallel:
            raise MindSpeedError("--sequence-parallel needs --tensor-model-parallel-size > 1")
        return {}
    for what, value in (("query groups", cfg.num_query_groups), ("attention heads", cfg.num_attention_heads),
                        ("ffn hidden size", cfg.ffn_hidden_size), ("padded vocabulary", cfg.vocab_size)):
        if value % tp:
            raise MindSpeedError(f"tensor parallel size {tp} does not divide the {what} ({value})")
    swiglu = cfg.activation == "swiglu"
    spec = {}
    for i, layer in enumerate(model.decoder.layers):
        attn, mlp = layer.self_attention, layer.mlp
        prefix = f"decoder.layers.{i}."
        attn.linear_qkv = ColumnParallelLinear(attn.linear_qkv, group, sequence_parallel)
        attn.linear_proj = RowParallelLinear(attn.linear_proj, group, sequence_parallel)
        attn.num_groups = cfg.num_query_groups // tp
        mlp.linear_fc1 = ColumnParallelLinear(mlp.linear_fc1, group, sequence_parallel, swiglu=swiglu)
        mlp.linear_fc2 = RowParallelLinear(mlp.linear_fc2, group, sequence_parallel)
        spec[prefix + "self_attention.linear_qkv.weight"] = (0, False)
        spec[prefix + "self_attention.linear_proj.weight"] = (1, False)
        spec[prefix + "mlp.linear_fc1.weight"] = (0, swiglu)
        spec[prefix + "mlp.linear_fc2.weight"] = (1, False)
        if cfg.add_qkv_bias:
            spec[prefix + "self_attention.linear_qkv.bias"] = (0, False)
        if cfg.add_bias_linear:
            spec[prefix + "mlp.linear_fc1.bias"] = (0, swiglu)
    emb = VocabParallelEmbedding(model.embedding.word_embeddings, group)
    model.embedding.word_embeddings = emb
    spec["embedding.word_embeddings.weight"] = (0, False)
    if cfg.untie_embeddings_and_output_weights:
        model.output_layer = ColumnParallelLinear(model.output_layer, group, False)
        spec["output_layer.weight"] = (0, False)
    if sequence_parallel:
        model.sequence_multiple = tp  # sequences must split evenly over the group
        model.decoder_input = lambda x: mappings.scatter_to_region(x, group, dim=1)
        model.output_input = lambda x: mappings.gather_from_sequence(x, group, dim=1)
    else:
        model.output_input = lambda x: mappings.copy_to_region(x, group)
    model.token_losses = lambda logits, labels: vocab_parallel_cross_entropy(logits, labels, group, emb.start)
    model.gather_logits = lambda logits: dist.all_gather(logits, group=group, dim=-1)
    return spec


def sequence_parallel_partial(model, spec: dict) -> list[str]:
    """Replicated parameters whose gradients are partial under sequence parallelism: the
    ones inside the decoder (norms, row-parallel biases), which see one slice of the
    sequence. Embeddings run on the whole sequence before it is split."""
    return [n for n, _ in nn.named_parameters(model) if n not in spec and n.startswith("decoder.")]
