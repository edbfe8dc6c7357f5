"""LoRA: low-rank adapters on the model's linear layers (MindSpeed-LLM's --lora-* flags).

A targeted layer computes ``x W^T + b + (alpha / r) * dropout(x) A^T B^T``, A [r, in] and
B [out, r]. W and b stay frozen (the trainer gives them no gradient and no optimizer state),
A starts uniform in +-1/sqrt(in) and B at zero, so training starts from the base model's
function. Targets are Megatron's module names: linear_qkv, linear_proj (attention),
linear_fc1, linear_fc2 (the dense MLP, a shared expert's, and the experts'). The adapters'
tensors are named ``<layer>.lora_A.weight`` and ``<layer>.lora_B.weight`` beside the base
``<layer>.weight``.

A mixture of experts' stacked weights (models/moe.py: ``experts.weight1`` [E, in, out] for
fc1, ``weight2`` for fc2) get one adapter per expert, stacked in the same x @ W orientation:
``experts.lora_A.weight1`` [E, in, r] and ``experts.lora_B.weight1`` [E, r, out], folded as
W[e] + (alpha / r) A[e] B[e], as MindSpeed-LLM's grouped LoRA experts hold theirs. They have
no dropout (MindSpeed-LLM's grouped experts have none either).

Under tensor parallelism (parallel/layers.py) B follows a column-parallel base's rows and A a
row-parallel base's columns; the other factor is replicated and its gradient is a partial
sum over the tensor-parallel ranks, so no collective is added to the forward pass.
"""

from __future__ import annotations

import zlib

import numpy as np

from mindspeed_core import features, nn, ops
from mindspeed_core.models.config import LoRAConfig
from mindspeed_core.models.layers import _param
# the adapters' names and their folding into the base weights are numpy work on state dicts
# (models/state.py, framework-free for the converter), named here too where LoRA lives
from mindspeed_core.models.state import ADAPTER_TAGS, EXPERT_TARGETS, is_adapter  # noqa: F401
from mindspeed_core.models.state import merge_lora as merge  # noqa: F401


class Factor(nn.Module):
    """One LoRA factor, a module of its own so that its tensor is named ``lora_A.weight``."""

    def __init__(self, value: np.ndarray):
        super().__init__()
        self.weight = nn.Parameter(np.ascontiguousarray(value, dtype=np.float32))


def adapter_output(module, x, rng=None):
    """(alpha / r) * dropout(x) A^T B^T with the module's ``lora_A``, ``lora_B``, ``lora_scale``
    and ``lora_dropout``; ``rng``: the random stream for the dropout mask (a context)."""
    features.note_used("lora")
    if module.lora_dropout and nn.is_training(module):
        if rng is None:
            x = ops.dropout(x, module.lora_dropout)
        else:
            with rng:
                x = ops.dropout(x, module.lora_dropout)
    return ops.linear(ops.linear(x, module.lora_A.weight), module.lora_B.weight) * module.lora_scale


def attach(module, a: np.ndarray, b: np.ndarray, scale: float, dropout: float) -> None:
    """Give a linear layer its adapter factors (arrays already cut for this rank)."""
    module.lora_A, module.lora_B = Factor(a), Factor(b)
    module.lora_scale, module.lora_dropout = scale, dropout


def factors(full) -> tuple | None:
    """(A, B) as numpy arrays of a layer that carries an adapter, else None."""
    if getattr(full, "lora_A", None) is None:
        return None
    return ops.to_numpy(full.lora_A.weight), ops.to_numpy(full.lora_B.weight)


class ExpertFactors(nn.Module):
    """One LoRA factor of every expert, for each adapted stacked weight: its tensors are named
    ``experts.lora_A.weight1`` (fc1's) and ``experts.lora_A.weight2`` (fc2's); an adapter
    not targeted is None."""

    def __init__(self, weight1: np.ndarray | None, weight2: np.ndarray | None):
        super().__init__()
        self.weight1 = None if weight1 is None else nn.Parameter(np.ascontiguousarray(weight1, np.float32))
        self.weight2 = None if weight2 is None else nn.Parameter(np.ascontiguousarray(weight2, np.float32))


def attach_experts(experts, lora: LoRAConfig, shapes: dict) -> None:
    """Zero adapters (``init_adapters`` fills A) on the experts' stacked weights that ``lora``
    targets; ``shapes`` {"weight1": (E, in, out), "weight2": ...}."""
    a, b = {}, {}
    for which, (n, n_in, n_out) in shapes.items():
        if EXPERT_TARGETS[which] in lora.targets:
            a[which], b[which] = np.zeros((n, n_in, lora.r), np.float32), np.zeros((n, lora.r, n_out), np.float32)
    if a:
        experts.lora_A = ExpertFactors(a.get("weight1"), a.get("weight2"))
        experts.lora_B = ExpertFactors(b.get("weight1"), b.get("weight2"))
        experts.lora_scale = lora.scale


def expert_factors(experts) -> dict:
    """{"lora_A.weight1": parameter, ...} of the experts' adapters (empty without)."""
    out = {}
    for kind in ("lora_A", "lora_B"):
        factor = getattr(experts, kind, None)
        for which in EXPERT_TARGETS:
            if factor is not None and getattr(factor, which) is not None:
                out[f"{kind}.{which}"] = getattr(factor, which)
    return out


def expert_adapter(experts, which: str, x, counts=None, expert: int | None = None):
    """(alpha / r) x A B of stacked weight ``which``'s adapters, or None where it has none:
    rows ``x`` [N, in] sorted by expert (``counts``) through their experts' factors, or all
    through ``expert``'s, or (x [E, T, in]) each expert's slice through its own."""
    a = getattr(getattr(experts, "lora_A", None), which, None)
    if a is None:
        return None
    features.note_used("lora-moe")
    b = getattr(experts.lora_B, which)
    if expert is not None:
        low = ops.matmul(ops.matmul(x, a[expert]), b[expert])
    elif counts is not None:
        low = ops.grouped_matmul(ops.grouped_matmul(x, a, counts), b, counts)
    else:
        low = ops.matmul(ops.matmul(x, a), b)
    return low * experts.lora_scale


class FusedAdapter(nn.Module):
    """An adapter with no base layer of its own: MindSpeed-LLM's latent attention fuses the
    query and key/value down-projections into one linear_qkv, which its LoRA target adapts with
    one A [r, hidden] and one B [q_lora_rank + kv_lora_rank + rope, r]; here the two
    projections are megatron-core's own layers, and this adapter's output, split by rows, is
    added to theirs (models/mla.py). Named ``self_attention.linear_qkv.lora_A.weight``."""

    def __init__(self, n_in: int, n_out: int, lora: LoRAConfig):
        super().__init__()
        attach(self, np.zeros((lora.r, n_in), np.float32), np.zeros((n_out, lora.r), np.float32), lora.scale,
               lora.dropout)

    def forward(self, x):
        return adapter_output(self, x)


class LoRALinear(nn.Module):
    """A base linear layer (models.layers.Linear's weights, the same initialisation draws)
    plus an adapter whose factors start at zero (``init_adapters`` fills A)."""

    def __init__(self, n_in: int, n_out: int, bias: bool, std: float, lora: LoRAConfig):
        super().__init__()
        self.weight = _param((n_out, n_in), std=std)
        self.bias = _param((n_out,), value=0.0) if bias else None
        attach(self, np.zeros((lora.r, n_in), np.float32), np.zeros((n_out, lora.r), np.float32), lora.scale,
               lora.dropout)

    def forward(self, x):
        return ops.linear(x, self.weight, self.bias) + adapter_output(self, x)


def init_adapters(model, seed: int) -> None:
    """A uniform in +-1/sqrt(in) (PEFT's Kaiming-uniform bound), B zero, drawn per tensor from
    its whole-model name and the seed: the same values whatever the layout, the framework or
    the order the layers were built in, and the base weights' draws are left untouched."""
    for (_, param), name in zip(nn.named_parameters(model), model.parameter_names()):
        if not is_adapter(name):
            continue
        shape = tuple(param.shape)
        if ".lora_A." in name:
            rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
            bound = 1.0 / np.sqrt(shape[1])
            value = rng.uniform(-bound, bound, shape).astype(np.float32)
        else:
            value = np.zeros(shape, np.float32)
        nn.assign(param, ops.tensor(value))

