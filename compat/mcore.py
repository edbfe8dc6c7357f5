"""Megatron-core's legacy checkpoint layout, written and read: what Megatron-LM's and
MindSpeed-LLM's ``--save``/``--load`` and ``convert_ckpt.py`` use.

    <dir>/latest_checkpointed_iteration.txt       the newest iteration (or "release")
    <dir>/iter_0000100/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt
        {"args": Namespace, "checkpoint_version": 3.0, "iteration": 100, "model": state dict}
        ("model0", "model1", ... instead of "model" with virtual pipeline stages)

TT is the tensor-parallel rank, PPP the pipeline rank (only when PP > 1), EEE the
expert-parallel rank (only when EP > 1). The names are megatron-core GPTModel's with its local
layer spec, which are ours (models/gpt.py): ``embedding.word_embeddings.weight``,
``decoder.layers.N.self_attention.linear_qkv.weight`` (query heads, key, value per query group),
``decoder.layers.N.mlp.linear_fc1.weight`` (gate rows, then up rows), ``output_layer.weight``,
with each stage's layers numbered from 0 (a no-op layer keeps its place, holding nothing), a
tied output layer copied on the last stage when there are several, and ``_extra_state``
(None) beside each linear layer's weight, as megatron-core's state dict has it. Experts are
SequentialMLP's ``mlp.experts.local_experts.E.linear_fc{1,2}.weight`` (GroupedMLP's
``mlp.experts.weight1/weight2`` are read too), E numbered within the expert-parallel rank.

A LoRA run's linear layers carry peft's names, as MindSpeed-LLM saves them:
``linear_qkv.base_layer.weight`` for the base, ``linear_qkv.lora_A.default.weight`` and
``lora_B.default.weight`` for the factors (a save with the adapters only is read too), and
``args`` holds ``lora_r``, ``lora_alpha`` and ``lora_target_modules``.

A tensor-parallel rank's piece of each weight is parallel/layers.py's cut (``TP_SPECS``):
column-parallel rows, row-parallel columns, gate and up halves cut alike, the vocabulary
padded with zero rows to a multiple of TP as Megatron pads it; a LoRA factor B is cut as its
column-parallel layer's rows, A as its row-parallel layer's columns, the other one whole. ``args`` holds Megatron's names
for the model and the layout, and ours in ``mindspeed_model_config`` (JSON), which is read back
exactly; a checkpoint without it (made by Megatron itself) is read from Megatron's names.
Files are read with compat/torch_pickle (no code from the file runs, no torch needed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re

import numpy as np

from mindspeed_core.compat import torch_dist, torch_pickle
from mindspeed_core.errors import CheckpointError
from mindspeed_core.models.config import (MLA_DOWN, MLA_UP, LoRAConfig, MLAConfig, ModelConfig, MoEConfig,
                                          interleaved_window_layers)
from mindspeed_core.models.state import EXPERT_TARGETS, is_adapter, moved_under_lora
from mindspeed_core.parallel import pipeline
from mindspeed_core.parallel.sharding import shard, unshard
from mindspeed_core.tensor_files import HostTensor

TRACKER = "latest_checkpointed_iteration.txt"
FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
# linear layers whose weights megatron-core pairs with an _extra_state entry
_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2",
            "mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2", *(
                f"self_attention.{n}" for n in MLA_UP + MLA_DOWN))


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a checkpoint's pieces live: TP, PP, EP and the pipeline's stages."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    layers_per_virtual_stage: int | None = None
    num_layer_list: str | None = None
    # the experts' TP size: None, the model's TP (experts cut as the dense MLP); 1 under TP, every
    # file holds its experts whole (megatron-core's ETP 1, MindSpeed-LLM's --expert-tensor-parallel-size 1)
    etp: int | None = None

    def __post_init__(self):
        if self.etp not in (None, 1, self.tp):
            raise CheckpointError(f"expert tensor parallel size {self.etp}: Megatron's files are read and written with "
                                  f"the experts whole (1) or cut as the model's TP ({self.tp})")
        object.__setattr__(self, "etp", 1 if self.etp == 1 and self.tp > 1 else None)

    @property
    def experts_whole(self) -> bool:
        return self.etp == 1

    def stages(self, cfg: ModelConfig) -> pipeline.PipelineLayout:
        return pipeline.model_layout(cfg, self.pp, self.layers_per_virtual_stage, self.num_layer_list)

    def rank_dir(self, t: int, p: int, e: int) -> str:
        return f"mp_rank_{t:02d}" + (f"_{p:03d}" if self.pp > 1 else "") + (f"_{e:03d}" if self.ep > 1 else "")

    def rank_keys(self) -> list[tuple[int, int, int]]:
        """The (tp, pp, ep) ranks with a file. With the experts whole, the ranks of megatron-core's
        ETP 1 layout (EP groups across TP): EP rank e sits with TP rank e mod TP, so a file for each
        TP rank t with EP rank t mod EP when EP divides TP, for each EP rank e with TP rank e mod TP
        when TP divides EP (MindSpeed-LLM's converter writes these; the other pairs would repeat them)."""
        if not self.experts_whole:
            return [(t, p, e) for t in range(self.tp) for p in range(self.pp) for e in range(self.ep)]
        pairs = ([(t, t % self.ep) for t in range(self.tp)] if self.tp % self.ep == 0
                 else [(e % self.tp, e) for e in range(self.ep)])
        return [(t, p, e) for t, e in pairs for p in range(self.pp)]

    def dense_ep(self, t: int) -> int:
        """The EP rank of a file holding TP rank ``t``'s slices of the dense tensors."""
        return (t % self.ep if self.tp % self.ep == 0 else t) if self.experts_whole else 0

    def expert_tps(self, e: int) -> list[int]:
        """The TP ranks whose files together hold EP rank ``e``'s experts (one when they are whole)."""
        return [e % self.tp] if self.experts_whole else list(range(self.tp))


def tp_spec(cfg: ModelConfig, name: str):
    """How a whole-model tensor (our name) is cut over TP ranks (parallel/layers.py's specs);
    None: every rank holds all of it."""
    # LongCat-Flash's two attentions and dense MLPs a layer are cut as any layer's
    name = re.sub(r"\.mlps_\d\.", ".mlp.", re.sub(r"\.self_attention_\d\.", ".self_attention.", name))
    if is_adapter(name):  # B follows a column-parallel base's rows, A a row-parallel base's columns
        if cfg.mla is not None and ".self_attention.linear_qkv." in name:
            return None  # latent attention's fused down-projections' adapter: whole, as they are
        base = tp_spec(cfg, re.sub(r"\.lora_[AB]\.weight$", ".weight", name))
        if base is None or (base == ("split", 1)) == (".lora_B." in name):
            return None
        return base
    swiglu = ("swiglu",) if cfg.gated else ("split", 0)  # any gated unit: [gate; up] cut apart
    if name in ("embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias"):
        return ("split", 0)
    if name.endswith(("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                      *(f"self_attention.{n}.weight" for n in MLA_UP), ".eh_proj.weight",
                      "self_attention.core_attention.softmax_offset")):  # the sinks: one per head
        return ("split", 0)  # multi-token prediction's eh_proj: a column-parallel layer in Megatron's files
    if cfg.qk_norm_across_heads and name.endswith(("self_attention.q_layernorm.weight",
                                                   "self_attention.k_layernorm.weight")):
        return ("split", 0)  # a weight per feature of every head (MiniMax-M2): cut with the heads
    if name.endswith(("mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "shared_experts.linear_fc1.weight")):
        return swiglu
    if name.endswith(("self_attention.linear_proj.weight", "mlp.linear_fc2.weight",
                      "shared_experts.linear_fc2.weight", "self_attention.out_proj.weight")):
        return ("split", 1)
    if cfg.linear_attention is not None:  # gated DeltaNet (parallel/layers.py cuts it the same way)
        projections, channels = cfg.linear_attention.sections()
        if name.endswith("self_attention.in_proj.weight"):
            return ("sections", projections)
        if name.endswith("self_attention.conv1d.weight"):
            return ("sections", channels)
        if name.endswith(("self_attention.dt_bias", "self_attention.A_log")):
            return ("split", 0)
    return None


def check(cfg: ModelConfig, layout: Layout) -> None:
    """What Megatron's layout cannot hold, refused before anything is written."""
    if cfg.num_query_groups % layout.tp:
        raise CheckpointError(f"--target-tensor-parallel-size {layout.tp} does not divide the model's "
                              f"{cfg.num_query_groups} key/value heads (num_query_groups), as Megatron requires")
    if cfg.moe is not None and cfg.moe.num_experts % layout.ep:
        raise CheckpointError(f"--target-expert-parallel-size {layout.ep} does not divide the model's "
                              f"{cfg.moe.num_experts} experts")
    if cfg.linear_attention is not None:
        for heads, what in ((cfg.linear_attention.key_heads, "key"), (cfg.linear_attention.value_heads, "value")):
            if heads % layout.tp:
                raise CheckpointError(f"--target-tensor-parallel-size {layout.tp} does not divide the model's {heads} "
                                      f"linear-attention {what} heads")
    if cfg.moe is None and layout.ep > 1:
        raise CheckpointError("--target-expert-parallel-size applies to mixture-of-experts models; this one has none")
    if layout.experts_whole and layout.tp % layout.ep and layout.ep % layout.tp:
        raise CheckpointError(f"--expert-tensor-parallel-size 1: megatron-core's files hold the TP and EP ranks in "
                              f"pairs, so one of --target-tensor-parallel-size {layout.tp} and "
                              f"--target-expert-parallel-size {layout.ep} must divide the other")
    for size, what in ((cfg.ffn_hidden_size, "ffn_hidden_size"), (cfg.hidden_size, "hidden_size"),
                       (cfg.num_attention_heads, "num_attention_heads")):
        if size % layout.tp:
            raise CheckpointError(f"--target-tensor-parallel-size {layout.tp} does not divide the model's {what} "
                                  f"{size}")
    layout.stages(cfg)  # a MindSpeedError naming the pipeline flag that does not fit


def _padded_vocab(cfg: ModelConfig, tp: int) -> int:
    return -(-cfg.vocab_size // tp) * tp


def _pad_rows(array: np.ndarray, rows: int) -> np.ndarray:
    if array.shape[0] == rows:
        return array
    return np.concatenate([array, np.zeros((rows - array.shape[0],) + array.shape[1:], array.dtype)])


# ---- whole model -> rank files --------------------------------------------------------------

def _stage_names(cfg: ModelConfig, stages: pipeline.PipelineLayout, stage: int) -> dict:
    """{mcore name in the stage: our whole-model name} of one virtual stage's tensors,
    experts excluded (they are cut over EP)."""
    last = stages.virtual_stages - 1
    out = {}
    if stage == 0:
        out["embedding.word_embeddings.weight"] = "embedding.word_embeddings.weight"
        if cfg.position_embedding_type == "learned":
            out["embedding.position_embeddings.weight"] = "embedding.position_embeddings.weight"
    if stage == last:
        # with multi-token prediction, MindSpeed-LLM's model holds the final norm itself
        norm = "final_layernorm." if cfg.mtp_num_layers else "decoder.final_layernorm."
        out[norm + "weight"] = "decoder.final_layernorm.weight"
        if cfg.normalization == "layernorm":
            out[norm + "bias"] = "decoder.final_layernorm.bias"
        if cfg.mtp_num_layers and stage != 0:  # the modules' copy of the embeddings (MindSpeed-LLM's)
            out["embedding.word_embeddings.weight"] = "embedding.word_embeddings.weight"
        for k in range(cfg.mtp_num_layers):
            out.update((f"mtp.layers.{k}.{n}.weight",) * 2 for n in ("enorm", "hnorm", "eh_proj"))
            out[f"mtp.final_layernorms.{k}.weight"] = f"mtp.final_layernorms.{k}.weight"
        if cfg.reward_head:
            out["rm_head.weight"] = "rm_head.weight"
        elif cfg.untie_embeddings_and_output_weights:
            out["output_layer.weight"] = "output_layer.weight"
            if cfg.output_layer_bias:
                out["output_layer.bias"] = "output_layer.bias"
        elif stages.virtual_stages > 1:  # Megatron's copy of the tied embeddings on the last stage
            out["output_layer.weight"] = "embedding.word_embeddings.weight"
    return out


def _peft_name(adapted: set, rest: str) -> str:
    """A layer's tensor (``rest``: its name inside the layer) under the name peft gives it in a
    LoRA run's Megatron checkpoint (MindSpeed-LLM's): the own tensors of a linear layer in
    ``adapted`` (those with factors) under ``base_layer.``, the factors as
    ``lora_A.default.weight``; other tensors keep theirs."""
    module, _, leaf = rest.rpartition(".")
    if module.endswith((".lora_A", ".lora_B")):
        return f"{module}.default.{leaf}"
    if module in adapted:
        return f"{module}.base_layer.{leaf}"
    return rest


def _ours(key: str) -> str:
    """The inverse of ``_peft_name``."""
    return key.replace(".base_layer.", ".").replace(".default.", ".")


def _layer_names(names: list[str], prefix: str) -> list[str]:
    return [n[len(prefix):] for n in names if n.startswith(prefix)]


def _stage_layers(cfg: ModelConfig, stages: pipeline.PipelineLayout, stage: int) -> list[tuple[str, str, int]]:
    """[(our whole-model prefix, its prefix in the stage's files, layer number)] of a virtual
    stage's transformer layers: the decoder's (no-op layers hold none), then on the last
    stage multi-token prediction's (numbered on from num_layers)."""
    out = [(f"decoder.layers.{number}.", f"decoder.layers.{local}.", number)
           for local, number in enumerate(stages.stages[stage]) if number not in stages.noop]
    if stage == stages.virtual_stages - 1:
        out += [(f"mtp.layers.{k}.transformer_layer.",) * 2 + (cfg.num_layers + k,) for k in range(cfg.mtp_num_layers)]
    return out


def split(cfg: ModelConfig, whole: dict, layout: Layout, dtype: str = "float32") -> dict:
    """{(tp rank, pp rank, ep rank): [state dict of each model chunk]} in mcore's names, each
    tensor a HostTensor of ``dtype``."""
    check(cfg, layout)
    stages = layout.stages(cfg)
    names = list(whole)
    vocab = _padded_vocab(cfg, layout.tp)
    out = {}
    for t, p, e in layout.rank_keys():
        chunks = []
        for c in range(stages.chunks):
            stage = stages.stage(p, c)
            state = {}

            def put(key, full, spec):
                if spec is not None and layout.tp > 1:
                    full = shard(full, spec, layout.tp, t)
                state[key] = HostTensor.of(full, dtype)

            for key, ours in _stage_names(cfg, stages, stage).items():
                full = np.asarray(whole[ours])
                if key in ("embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias"):
                    full = _pad_rows(full, vocab)
                put(key, full, tp_spec(cfg, key))
                if key == "output_layer.weight":
                    state["output_layer._extra_state"] = None
            for mine, theirs, _ in _stage_layers(cfg, stages, stage):
                adapted = {n.rsplit(".lora_A.", 1)[0] for n in _layer_names(names, mine) if ".lora_A." in n}
                for rest in _layer_names(names, mine):
                    ours = mine + rest
                    if rest.startswith("mlp.experts."):
                        _put_experts(cfg, state, theirs + "mlp.experts.", rest, whole[ours], layout, t, e,
                                     dtype, {w for w in ("weight1", "weight2")
                                             if f"{mine}mlp.experts.lora_A.{w}" in whole})
                        continue
                    put(theirs + _peft_name(adapted, rest), np.asarray(whole[ours]), tp_spec(cfg, ours))
                    for linear in _LINEARS:
                        if rest == linear + ".weight":
                            state[theirs + _peft_name(adapted, linear + "._extra_state")] = None
            chunks.append(state)
        out[t, p, e] = chunks
    return out


def _put_experts(cfg, state, prefix, rest, full, layout, t, e, dtype, adapted=frozenset()) -> None:
    """Our stacked experts (weight1 [E, hidden, 2 ffn], weight2 [E, ffn, hidden]) as this EP
    rank's SequentialMLP local experts, cut over TP as their dense twins are (whole with ETP 1); their LoRA
    factors (lora_A.weight1 [E, in, r], ...) as each expert's peft factors, the adapted
    bases (``adapted``: "weight1", "weight2") under ``base_layer``."""
    full = np.asarray(full)
    mine = np.split(full, layout.ep, axis=0)[e]
    fc1 = ("swiglu",) if cfg.gated else ("split", 0)
    # (module, tensor, how TP cuts it); fc2's bias is whole on every TP rank, as Megatron's row
    # layer's; a factor B follows fc1's rows, A fc2's columns, the other one whole
    key, kind, spec = {"mlp.experts.weight1": ("linear_fc1", "weight", fc1),
                       "mlp.experts.weight2": ("linear_fc2", "weight", ("split", 1)),
                       "mlp.experts.bias1": ("linear_fc1", "bias", fc1),
                       "mlp.experts.bias2": ("linear_fc2", "bias", None),
                       "mlp.experts.lora_A.weight1": ("linear_fc1.lora_A.default", "weight", None),
                       "mlp.experts.lora_B.weight1": ("linear_fc1.lora_B.default", "weight", fc1),
                       "mlp.experts.lora_A.weight2": ("linear_fc2.lora_A.default", "weight", ("split", 1)),
                       "mlp.experts.lora_B.weight2": ("linear_fc2.lora_B.default", "weight", None)}.get(
                           rest, (None, None, None))
    if key is None:
        raise CheckpointError(f"unexpected expert tensor {rest}")
    if key in ("linear_fc1", "linear_fc2") and ("weight" + key[-1]) in adapted:
        key += ".base_layer"
    for j, expert in enumerate(mine):
        weight = expert.T if kind == "weight" else expert
        if layout.tp > 1 and spec is not None and not layout.experts_whole:
            weight = shard(np.ascontiguousarray(weight), spec, layout.tp, t)
        state[f"{prefix}local_experts.{j}.{key}.{kind}"] = HostTensor.of(weight, dtype)
        if kind == "weight" and ".lora_" not in key:
            state[f"{prefix}local_experts.{j}.{key}._extra_state"] = None


def megatron_args(cfg: ModelConfig, layout: Layout, dtype: str, iteration: int) -> argparse.Namespace:
    """The ``args`` Megatron keeps in each file: its names for the model and the layout, and
    our config (``mindspeed_model_config``) to read back exactly."""
    a = argparse.Namespace(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, group_query_attention=cfg.num_query_groups
        != cfg.num_attention_heads, num_query_groups=cfg.num_query_groups, kv_channels=cfg.kv_channels,
        max_position_embeddings=cfg.max_position_embeddings, padded_vocab_size=_padded_vocab(cfg, layout.tp),
        normalization="RMSNorm" if cfg.normalization == "rmsnorm" else "LayerNorm", norm_epsilon=cfg.norm_epsilon,
        swiglu=cfg.activation == "swiglu", gelu_tanh=cfg.activation == "geglu_tanh", geglu=cfg.activation == "geglu",
        quick_geglu=cfg.activation == "quick_geglu", glu_linear_offset=cfg.glu_linear_offset,
        activation_func_clamp_value=cfg.activation_func_clamp_value,
        softmax_type="learnable" if cfg.attention_sinks else "vanilla",
        position_embedding_type="rope" if cfg.position_embedding_type == "rope" else "learned_absolute",
        rotary_base=cfg.rotary_base, rotary_percent=cfg.rotary_percent, add_qkv_bias=cfg.add_qkv_bias,
        add_bias_linear=cfg.add_bias_linear,
        qk_layernorm=cfg.qk_layernorm, untie_embeddings_and_output_weights=cfg.untie_embeddings_and_output_weights,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp or layout.tp,
        num_layers_per_virtual_pipeline_stage=layout.layers_per_virtual_stage,
        num_layer_list=layout.num_layer_list, noop_layers=",".join(map(str, cfg.noop_layers)) or None,
        params_dtype=torch_pickle.TorchDType(dtype), bf16=dtype == "bfloat16", fp16=dtype == "float16",
        iteration=iteration, mindspeed_model_config=json.dumps(cfg.to_dict(), sort_keys=True))
    for field, name in _LAYER_ARGS:
        setattr(a, name, getattr(cfg, field))
    if cfg.sliding_window is not None:  # MindSpeed-LLM's two window settings (another pattern: our config only)
        a.sliding_window = cfg.sliding_window if cfg.sliding_window_layers is None else None
        a.interleave_sliding_window = (cfg.sliding_window if cfg.sliding_window_layers
                                       == interleaved_window_layers(cfg.num_layers) else None)
    if cfg.mla is not None:  # Megatron's: --qk-head-dim is the part without position
        a.multi_latent_attention, a.q_lora_rank, a.kv_lora_rank = True, cfg.mla.q_lora_rank, cfg.mla.kv_lora_rank
        a.qk_head_dim, a.qk_pos_emb_head_dim = cfg.mla.qk_nope_head_dim, cfg.mla.qk_rope_head_dim
        a.v_head_dim = cfg.mla.v_head_dim
    if cfg.mtp_num_layers:
        a.mtp_num_layers, a.mtp_loss_scaling_factor = cfg.mtp_num_layers, cfg.mtp_loss_scaling_factor
    if cfg.linear_attention is not None:  # MindSpeed-LLM's gated DeltaNet arguments (its qwen3_next spec)
        la = cfg.linear_attention
        a.linear_num_key_heads, a.linear_num_value_heads = la.key_heads, la.value_heads
        a.linear_key_head_dim, a.linear_value_head_dim, a.mamba_d_conv = la.key_dim, la.value_dim, la.conv_kernel
        a.mamba_chunk_size, a.partial_rotary_factor = la.chunk_size, cfg.rotary_percent
        # megatron-core's pattern: 1 = linear attention, 0 = full attention, per layer
        a.linear_attention_freq = [int(cfg.is_linear_layer(i)) for i in range(cfg.num_layers)]
    if cfg.lora is not None:  # MindSpeed-LLM's names for the run's LoRA flags
        a.lora_r, a.lora_alpha, a.lora_target_modules = cfg.lora.r, cfg.lora.alpha, list(cfg.lora.targets)
        a.lora_dropout = cfg.lora.dropout
    if cfg.moe is not None:
        a.num_experts, a.moe_router_topk = cfg.moe.num_experts, cfg.moe.topk
        a.moe_ffn_hidden_size = cfg.moe.ffn_hidden_size or cfg.ffn_hidden_size
        a.moe_shared_expert_intermediate_size = cfg.moe.shared_expert_size
        a.moe_layer_freq = [int(cfg.is_moe_layer(i)) for i in range(cfg.num_layers)]  # Megatron's list form
        for field, name in _MOE_ARGS:
            setattr(a, name, getattr(cfg.moe, field))
        a.moe_router_pre_softmax = not cfg.moe.norm_topk_prob
    return a


# Gemma's and MiniCPM's ModelConfig fields under MindSpeed-LLM's argument names
_LAYER_ARGS = (("norm_offset", "add_rmsnorm_offset"), ("post_norm", "post_norm"),
               ("scale_embeddings", "input_embeds_norm"), ("query_pre_attn_scalar", "query_pre_attn_scalar"),
               ("attn_logit_softcapping", "attn_logit_softcapping"),
               ("final_logit_softcapping", "output_logit_softcapping"), ("scale_emb", "scale_emb"),
               ("scale_depth", "scale_depth"), ("dim_model_base", "dim_model_base"),
               ("output_layer_bias", "add_output_layer_bias"))


# MoEConfig's fields under Megatron's argument names (MindSpeed-LLM's for the shared expert's gate)
_MOE_ARGS = (("score_function", "moe_router_score_function"), ("num_groups", "moe_router_num_groups"),
             ("group_topk", "moe_router_group_topk"), ("scaling_factor", "moe_router_topk_scaling_factor"),
             ("load_balancing_type", "moe_router_load_balancing_type"), ("aux_loss_coeff", "moe_aux_loss_coeff"),
             ("z_loss_coeff", "moe_z_loss_coeff"), ("enable_expert_bias", "moe_router_enable_expert_bias"),
             ("bias_update_rate", "moe_router_bias_update_rate"), ("capacity_factor", "moe_expert_capacity_factor"),
             ("pad_to_capacity", "moe_pad_expert_input_to_capacity"), ("drop_policy", "moe_token_drop_policy"),
             ("shared_expert_gate", "shared_expert_gate"))


def _moe_layers(args, num_layers: int) -> tuple | None:
    """The MoE layers Megatron's args give: --moe-layer-freq (every k-th layer, or a 0/1 list
    per layer) and MindSpeed-LLM's --first-k-dense-replace; None: every layer."""
    freq, first = _arg(args, "moe_layer_freq", 1), _arg(args, "first_k_dense_replace", 0)
    if isinstance(freq, (list, tuple)):
        if len(freq) != num_layers or any(f not in (0, 1) for f in freq):
            raise ValueError(f"moe_layer_freq {list(freq)} is not a 0/1 list of the {num_layers} layers")
        layers = tuple(i for i, f in enumerate(freq) if f and i >= first)
    else:
        layers = tuple(i for i in range(num_layers) if i % int(freq) == 0 and i >= first)
    return None if len(layers) == num_layers else layers


def save(root: str, iteration: int, cfg: ModelConfig, whole: dict, layout: Layout, dtype: str = "float32") -> str:
    """Write the whole model ``whole`` (our names) as Megatron's checkpoint ``root`` at
    ``iteration``, cut for ``layout``; returns the iteration folder."""
    pieces = split(cfg, whole, layout, dtype)
    args = megatron_args(cfg, layout, dtype, iteration)
    folder = os.path.join(root, f"iter_{iteration:07d}")
    for (t, p, e), chunks in pieces.items():
        rank = os.path.join(folder, layout.rank_dir(t, p, e))
        os.makedirs(rank, exist_ok=True)
        state = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}
        if len(chunks) == 1:
            state["model"] = chunks[0]
        else:
            state.update({f"model{c}": chunk for c, chunk in enumerate(chunks)})
        torch_pickle.save(os.path.join(rank, FILE), state)
    tmp = os.path.join(root, f"{TRACKER}.tmp-{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write(str(iteration))
    os.replace(tmp, os.path.join(root, TRACKER))
    return folder


# ---- rank files -> whole model --------------------------------------------------------------

def is_megatron_checkpoint(root: str) -> bool:
    """Whether ``root`` holds Megatron's layout (iteration folders of mp_rank_* folders)."""
    try:
        folder = _iteration_folder(root)
    except CheckpointError:
        return False
    return folder is not None and os.path.isdir(folder) and (
        any(_RANK_DIR.match(n) for n in os.listdir(folder)) or torch_dist.is_torch_dist(folder))


def _iteration_folder(root: str) -> str | None:
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as fh:
            text = fh.read(64).decode("ascii", "replace").strip()
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    if text == "release":
        return os.path.join(root, "release")
    if not text.isdigit():
        raise CheckpointError(f"{path} holds {text[:40]!r}, not an iteration number or 'release'")
    return os.path.join(root, f"iter_{int(text):07d}")


def _float32(t) -> np.ndarray:
    if not isinstance(t, HostTensor):
        raise CheckpointError(f"expected a tensor, found {type(t).__name__}")
    return t.float32()


@dataclasses.dataclass
class Checkpoint:
    """A Megatron checkpoint read whole: ``state`` {our name: float32 array}; ``exact``:
    its config is ours as we wrote it (else derived from Megatron's args, family llama)."""

    iteration: int
    cfg: ModelConfig
    state: dict
    layout: Layout
    dtype: str
    exact: bool


def load(root: str) -> Checkpoint:
    """Megatron's checkpoint ``root``, any TP/PP/EP/VPP, as one whole model."""
    folder = _iteration_folder(root)
    if folder is None or not os.path.isdir(folder):
        raise CheckpointError(f"{root} holds no Megatron checkpoint ({TRACKER} naming an existing iteration folder)")
    if torch_dist.is_torch_dist(folder):
        return _load_torch_dist(folder)
    ranks = {}
    for name in os.listdir(folder):
        m = _RANK_DIR.match(name)
        if m:
            ranks[tuple(int(x) if x is not None else 0 for x in m.groups())] = os.path.join(folder, name, FILE)
    if not ranks:
        raise CheckpointError(f"{folder} holds no mp_rank_* folders")
    first = torch_pickle.load(ranks[min(ranks)])
    if not isinstance(first, dict) or "args" not in first:
        raise CheckpointError(f"{ranks[min(ranks)]} is not a Megatron checkpoint (no args)")
    args = first["args"]
    cfg = config_from_args(args)
    layout = _saved_layout(args)
    if layout.pp == 1 and layout.ep > 1:  # mp_rank_TT_EEE: without PP, Megatron's one 3-digit number is the EP rank
        ranks = {(t, 0, p): path for (t, p, _), path in ranks.items()}
    want = set(layout.rank_keys())
    if set(ranks) != want:
        missing = sorted(want - set(ranks))
        raise CheckpointError(f"{folder}: the rank folders do not match TP={layout.tp} PP={layout.pp} EP={layout.ep} "
                              + ("(experts whole, ETP=1) " if layout.experts_whole else "") + "of its args" + (f" ({layout.rank_dir(*missing[0])} is missing)" if missing else ""))
    states = {key: (first if key == min(ranks) else torch_pickle.load(path)) for key, path in ranks.items()}
    iteration = first.get("iteration", 0) or 0
    for key, state in states.items():  # every rank file of one save: the same model, the same iteration
        where = ranks[key]
        if not isinstance(state, dict) or "args" not in state:
            raise CheckpointError(f"{where} is not a Megatron checkpoint (a {type(state).__name__} without args)")
        if (state.get("iteration", 0) or 0) != iteration:
            raise CheckpointError(f"{where} is from iteration {state.get('iteration')!r} but "
                                  f"{ranks[min(ranks)]} from {iteration!r}: the rank files come from different saves")
        if key != min(ranks):
            try:
                same = config_from_args(state["args"]) == cfg
            except (CheckpointError, AttributeError, TypeError, ValueError):
                same = False
            if not same:
                raise CheckpointError(f"{where}'s args describe another model than {ranks[min(ranks)]}'s: the rank "
                                      f"files come from different checkpoints")
    if type(iteration) is not int or iteration < 0:
        raise CheckpointError(f"{ranks[min(ranks)]} holds no valid iteration ({iteration!r})")
    try:
        whole = merge(cfg, {k: _chunks(v, ranks[k]) for k, v in states.items()}, layout)
    except (AttributeError, KeyError, TypeError, ValueError, IndexError) as exc:  # a tensor of another model's shape
        raise CheckpointError(f"{folder}: the rank files do not fit together as one model of its args ({exc})") from None
    dtype = getattr(_arg(args, "params_dtype", None), "name", None) or "float32"
    return Checkpoint(iteration, cfg, whole, layout, dtype, isinstance(getattr(args, "mindspeed_model_config", None), str))


def _saved_layout(args) -> Layout:
    return Layout(tp=_arg(args, "tensor_model_parallel_size", 1), pp=_arg(args, "pipeline_model_parallel_size", 1),
                  ep=_arg(args, "expert_model_parallel_size", 1),
                  layers_per_virtual_stage=_arg(args, "num_layers_per_virtual_pipeline_stage", None),
                  num_layer_list=_arg(args, "num_layer_list", None),
                  etp=_arg(args, "expert_tensor_parallel_size", None))


def _load_torch_dist(folder: str) -> Checkpoint:
    """A checkpoint of Megatron's torch_dist format (compat/torch_dist.py): the model whole."""
    common, state = torch_dist.load(folder)
    args, iteration = common.get("args"), common.get("iteration", 0) or 0
    if args is None:
        raise CheckpointError(f"{folder}/{torch_dist.COMMON} holds no args: not a Megatron checkpoint")
    if type(iteration) is not int or iteration < 0:
        raise CheckpointError(f"{folder}/{torch_dist.COMMON} holds no valid iteration ({iteration!r})")
    cfg = config_from_args(args)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias"):
        if name in state:  # the padded vocabulary's rows beyond the model's
            state[name] = state[name][:cfg.vocab_size]
    dtype = getattr(_arg(args, "params_dtype", None), "name", None) or "float32"
    return Checkpoint(iteration, cfg, state, _saved_layout(args), dtype,
                      isinstance(getattr(args, "mindspeed_model_config", None), str))


def _arg(args, name, default):
    value = getattr(args, name, default)
    return default if value is None else value


def _chunks(state: dict, path: str) -> list[dict]:
    if "model" in state:
        chunks = [state["model"]]
    else:
        chunks = [state[k] for k in sorted((k for k in state if re.fullmatch(r"model\d+", k)), key=lambda k: int(k[5:]))]
    if not chunks:
        raise CheckpointError(f"{path} holds no model state (no 'model' or 'model0')")
    for chunk in chunks:
        if not isinstance(chunk, dict):
            raise CheckpointError(f"{path}: its model state is a {type(chunk).__name__}, not a dict of tensors")
    return [{_ours(k) if isinstance(k, str) else k: v for k, v in chunk.items()} for chunk in chunks]


def merge(cfg: ModelConfig, pieces: dict, layout: Layout) -> dict:
    """The inverse of ``split``: {(t, p, e): [chunk state]} -> whole model, float32. A LoRA
    run's checkpoint saved with the adapters only (MindSpeed-LLM's --lora-ckpt-filter) gives
    the adapters only."""
    stages = layout.stages(cfg)
    whole = {}
    adapters_only = all(moved_under_lora(k) or k.endswith(_GROUPED_FACTORS + ("_extra_state",))
                        for chunks in pieces.values() for chunk in chunks for k in chunk)

    def take(p, c, key, ours):
        parts = []
        for t in range(layout.tp):
            e = layout.dense_ep(t)
            chunk = pieces[t, p, e][c]
            if key not in chunk:
                raise CheckpointError(f"{layout.rank_dir(t, p, e)} has no {key}")
            parts.append(_float32(chunk[key]))
        spec = tp_spec(cfg, ours)
        full = unshard(parts, spec) if spec is not None and layout.tp > 1 else parts[0]
        if ours in ("embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias"):
            full = full[:cfg.vocab_size]
        return full

    for p in range(layout.pp):
        for c in range(stages.chunks):
            if len(pieces[0, p, 0]) != stages.chunks:
                raise CheckpointError(f"{layout.rank_dir(0, p, 0)} holds {len(pieces[0, p, 0])} model chunks; its "
                                      f"args give {stages.chunks}")
            stage = stages.stage(p, c)
            for key, ours in ({} if adapters_only else _stage_names(cfg, stages, stage)).items():
                if (key == "output_layer.weight" and ours != key) or (key == "embedding.word_embeddings.weight"
                                                                      and stage != 0):
                    continue  # the last stage's copies: the embedding itself is on the first stage
                whole[ours] = take(p, c, key, ours)
            keys = pieces[0, p, 0][c]
            for mine, prefix, number in _stage_layers(cfg, stages, stage):
                for key in keys:
                    if not key.startswith(prefix) or key.endswith("_extra_state"):
                        continue
                    rest = key[len(prefix):]
                    if rest.startswith("mlp.experts."):
                        continue
                    whole[mine + rest] = take(p, c, key, mine + rest)
                if cfg.is_moe_layer(number):
                    if not adapters_only:
                        whole.update(_experts(cfg, pieces, layout, p, c, prefix, mine, number))
                    if cfg.lora is not None:
                        whole.update(_expert_adapters(cfg, pieces, layout, p, c, prefix, mine))
    return whole


def _experts(cfg, pieces, layout, p, c, theirs, mine, number) -> dict:
    """A layer's stacked experts from every EP rank's local experts (SequentialMLP or
    GroupedMLP names), TP pieces joined; ``theirs``/``mine``: the layer's prefix in the files
    and in our names."""
    prefix = theirs + "mlp.experts."
    per_rank = cfg.moe.num_experts // layout.ep
    f, h = cfg.moe.ffn_hidden_size or cfg.ffn_hidden_size, cfg.hidden_size
    width = 2 * f if cfg.gated else f
    fc1 = ("swiglu",) if cfg.gated else ("split", 0)
    w1, w2, b1, b2 = [], [], [], []

    def stacked(chunks, e, name):
        try:
            return [np.stack([_float32(ch[f"{prefix}local_experts.{j}.{name}"]) for j in range(per_rank)])
                    for ch in chunks]
        except KeyError as exc:
            raise CheckpointError(f"{layout.rank_dir(0, p, e)} has no {exc.args[0]}") from None

    for e in range(layout.ep):
        chunks = [pieces[t, p, e][c] for t in layout.expert_tps(e)]
        cut = len(chunks) > 1
        if prefix + "weight1" in chunks[0]:  # GroupedMLP: flat views of [local experts, hidden, width / TP] and
            # [local experts, ffn / TP, hidden] (megatron-core's weight1.view(E, hidden, -1)), shaped
            # [hidden, local experts x width / TP] and [local experts x ffn / TP, hidden]
            if cfg.add_bias_linear:
                raise CheckpointError(f"{layout.rank_dir(0, p, e)} holds GroupedMLP experts, which have no biases; "
                                      f"the model's experts have them (add_bias_linear)")
            ones = [_float32(ch[prefix + "weight1"]).reshape(per_rank, h, -1).transpose(0, 2, 1) for ch in chunks]
            twos = [_float32(ch[prefix + "weight2"]).reshape(per_rank, -1, h).transpose(0, 2, 1) for ch in chunks]
        else:
            ones, twos = stacked(chunks, e, "linear_fc1.weight"), stacked(chunks, e, "linear_fc2.weight")
            if cfg.add_bias_linear:
                bias_ones, bias_twos = stacked(chunks, e, "linear_fc1.bias"), stacked(chunks, e, "linear_fc2.bias")
        for j in range(per_rank):  # [width, hidden] and [hidden, ffn] per expert, TP pieces joined
            one = unshard([o[j] for o in ones], fc1) if cut else ones[0][j]
            two = unshard([t[j] for t in twos], ("split", 1)) if cut else twos[0][j]
            w1.append(one.T)
            w2.append(two.T)
            if cfg.add_bias_linear:
                b1.append(unshard([o[j] for o in bias_ones], fc1) if cut else bias_ones[0][j])
                b2.append(bias_twos[0][j])
    w1, w2 = np.stack(w1), np.stack(w2)
    if w1.shape != (cfg.moe.num_experts, h, width) or w2.shape != (cfg.moe.num_experts, f, h):
        raise CheckpointError(f"layer {number}'s experts have shapes {w1.shape} and {w2.shape}, not what its args give")
    out = {mine + "mlp.experts.weight1": w1, mine + "mlp.experts.weight2": w2}
    if cfg.add_bias_linear:
        out.update({mine + "mlp.experts.bias1": np.stack(b1), mine + "mlp.experts.bias2": np.stack(b2)})
    return out


# MindSpeed-LLM's GroupedMLP LoRA factors (LoraParallelGroupedMLP): each a flat view of
# [local experts, in, r] (A) or [local experts, r, out] (B), out and in cut over TP as the base's
_GROUPED_FACTORS = ("weight1_lora_a", "weight1_lora_b", "weight2_lora_a", "weight2_lora_b")


def _expert_adapters(cfg, pieces, layout, p, c, theirs, mine) -> dict:
    """A layer's expert LoRA factors, stacked as ours (lora_A.weight1 [E, hidden, r], ...),
    from every EP rank's SequentialMLP experts in peft's names or GroupedMLP's factors, TP
    pieces joined; those the run's targets leave out are absent."""
    prefix, per_rank, r = theirs + "mlp.experts.", cfg.moe.num_experts // layout.ep, cfg.lora.r
    fc1 = ("swiglu",) if cfg.gated else ("split", 0)
    out = {}
    for which, module in EXPERT_TARGETS.items():
        if module not in cfg.lora.targets:
            continue
        a_parts, b_parts = [], []
        for e in range(layout.ep):
            chunks = [pieces[t, p, e][c] for t in layout.expert_tps(e)]
            cut = len(chunks) > 1
            grouped = prefix + which + "_lora_a" in chunks[0]
            try:  # per TP rank: A [local, in(/TP), r], B [local, r, out(/TP)]
                if grouped:
                    a = [_float32(ch[prefix + which + "_lora_a"]).reshape(per_rank, -1, r) for ch in chunks]
                    b = [_float32(ch[prefix + which + "_lora_b"]).reshape(per_rank, r, -1) for ch in chunks]
                else:
                    a = [np.stack([_float32(ch[f"{prefix}local_experts.{j}.{module}.lora_A.weight"]).T
                                   for j in range(per_rank)]) for ch in chunks]
                    b = [np.stack([_float32(ch[f"{prefix}local_experts.{j}.{module}.lora_B.weight"]).T
                                   for j in range(per_rank)]) for ch in chunks]
            except KeyError as exc:
                raise CheckpointError(f"{layout.rank_dir(0, p, e)} has no {exc.args[0]} (LoRA targets "
                                      f"{' '.join(cfg.lora.targets)})") from None
            for j in range(per_rank):  # fc1's B joined as fc1's rows (its columns here), fc2's A as fc2's columns
                if which == "weight1":
                    a_parts.append(a[0][j])
                    b_parts.append(unshard([x[j].T for x in b], fc1).T if cut else b[0][j])
                else:
                    a_parts.append(unshard([x[j].T for x in a], ("split", 1)).T if cut else a[0][j])
                    b_parts.append(b[0][j])
        out[f"{mine}mlp.experts.lora_A.{which}"] = np.stack(a_parts)
        out[f"{mine}mlp.experts.lora_B.{which}"] = np.stack(b_parts)
    return out


def _window_from_args(args) -> dict:
    """MindSpeed-LLM's --sliding-window (every layer) or --interleave-sliding-window (layers
    0, 2, 4, ...) as ModelConfig fields."""
    if _arg(args, "interleave_sliding_window", None):
        return {"sliding_window": args.interleave_sliding_window,
                "sliding_window_layers": interleaved_window_layers(args.num_layers)}
    return {"sliding_window": _arg(args, "sliding_window", None)}


def config_from_args(args) -> ModelConfig:
    """Our config from a checkpoint's args: exactly ours when we wrote it, else from Megatron's names."""
    saved = getattr(args, "mindspeed_model_config", None)
    try:
        if isinstance(saved, str):
            return ModelConfig.from_dict(json.loads(saved))
        heads = args.num_attention_heads
        moe = None
        if _arg(args, "num_experts", None):
            given = {field: getattr(args, name) for field, name in _MOE_ARGS if _arg(args, name, None) is not None}
            if _arg(args, "moe_router_pre_softmax", None) is not None:
                given["norm_topk_prob"] = not args.moe_router_pre_softmax
            moe = MoEConfig(num_experts=args.num_experts, topk=_arg(args, "moe_router_topk", 2),
                            ffn_hidden_size=_arg(args, "moe_ffn_hidden_size", None),
                            shared_expert_size=_arg(args, "moe_shared_expert_intermediate_size", None), **given)
        mla = None
        if _arg(args, "multi_latent_attention", False):
            mla = MLAConfig(kv_lora_rank=args.kv_lora_rank, qk_nope_head_dim=args.qk_head_dim,
                            qk_rope_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim,
                            q_lora_rank=_arg(args, "q_lora_rank", None))
        lora = None
        if _arg(args, "lora_target_modules", None):  # MindSpeed-LLM's LoRA runs: on with target modules
            lora = LoRAConfig(r=_arg(args, "lora_r", 16), alpha=float(_arg(args, "lora_alpha", 32)),
                              dropout=float(_arg(args, "lora_dropout", 0.0)), targets=tuple(args.lora_target_modules))
        return ModelConfig(
            vocab_size=_arg(args, "padded_vocab_size", None) or args.vocab_size, hidden_size=args.hidden_size,
            num_layers=args.num_layers, num_attention_heads=heads,
            num_query_groups=args.num_query_groups if _arg(args, "group_query_attention", False) else heads,
            ffn_hidden_size=_arg(args, "ffn_hidden_size", None), mla=mla,
            kv_channels=None if mla is not None else _arg(args, "kv_channels", None),
            max_position_embeddings=_arg(args, "max_position_embeddings", 2048),
            normalization="layernorm" if _arg(args, "normalization", "LayerNorm") == "LayerNorm" else "rmsnorm",
            norm_epsilon=_arg(args, "norm_epsilon", 1e-5),
            activation="swiglu" if _arg(args, "swiglu", False) else "geglu_tanh" if _arg(args, "gelu_tanh", False)
            else "geglu" if _arg(args, "geglu", False) else "quick_geglu" if _arg(args, "quick_geglu", False)
            else "gelu",
            glu_linear_offset=float(_arg(args, "glu_linear_offset", 0.0) or 0.0),
            activation_func_clamp_value=_arg(args, "activation_func_clamp_value", None),
            attention_sinks=_arg(args, "softmax_type", "vanilla") == "learnable",
            position_embedding_type="learned" if _arg(args, "position_embedding_type", "learned_absolute")
            == "learned_absolute" else "rope",
            rotary_base=float(_arg(args, "rotary_base", 10000)), rotary_percent=float(_arg(args, "rotary_percent", 1.0)),
            add_qkv_bias=bool(_arg(args, "add_qkv_bias", False)),
            add_bias_linear=bool(_arg(args, "add_bias_linear", True)),
            qk_layernorm=bool(_arg(args, "qk_layernorm", False)),
            untie_embeddings_and_output_weights=bool(_arg(args, "untie_embeddings_and_output_weights", False)),
            noop_layers=pipeline.parse_layer_numbers(_arg(args, "noop_layers", None), "noop_layers"), moe=moe, lora=lora,
            moe_layers=_moe_layers(args, args.num_layers) if moe is not None else None,
            mtp_num_layers=int(_arg(args, "mtp_num_layers", 0)),
            mtp_loss_scaling_factor=float(_arg(args, "mtp_loss_scaling_factor", 0.1)),
            **_window_from_args(args), **{field: _arg(args, name, None) or ModelConfig.__dataclass_fields__[field].default
                                          for field, name in _LAYER_ARGS})
    except (AttributeError, TypeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"the checkpoint's args do not describe a model we can build ({exc})") from None
