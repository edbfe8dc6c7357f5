"""The decoder-only transformer (Megatron's GPTModel), written only against the facade.

One class covers LLaMA 2/3, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm) and GPT-2
(LayerNorm, learned positions, GELU, biases) through ModelConfig switches.

The fused qkv projection uses Megatron-core's layout: for each query group, its query heads,
then its key head, then its value head, so that tensor parallelism can later split the rows
by query group.

What parallelism may change in the model is declared in one place, ``Seams``: the model
calls it at the decoder's input and output, for the per-token loss, for the heads a rank
holds and around dropout; a parallel plan supplies its own (``GPTModel.use_seams``), and
nothing else of the model is touched from outside. A pipeline stage is a GPTModel built with
a subset of the layers and without the embedding (not first) or the head (not last).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from mindspeed_core import autograd, composite, features, nn, ops, random
from mindspeed_core.errors import CheckpointError
from mindspeed_core.memory import recompute
from mindspeed_core.models import lora, rope
from mindspeed_core.models.config import ModelConfig
from mindspeed_core.models.layers import Embedding, HeadsRMSNorm, Linear, _param, make_norm, mlp_activation


@dataclass
class Tokens:
    """Where a micro-batch's tokens sit, over whole sequences (host numpy, [b, S] or [1, S]):
    ``positions`` for the position embeddings (None: 0..S-1; reset per document with
    --reset-position-ids) and ``documents``, the document each token belongs to in a packed
    sequence (None: one per row; attention stays inside a document); ``loss_mask``, 1 where
    a label counts in the loss (None: everywhere; 0 on the padding of packed samples);
    ``cache``, generation's key/value cache (models/kv_cache.py): then the tokens are the new
    positions only, and ``documents`` marks each 1 (a token) or 0 (left padding).
    ``position_inputs``: (position ids, (cos, sin), local (cos, sin) or None) as device tensors,
    given by a compiled forward (GPTModel.rotary_tables, rotary_rows) in place of those forward
    makes on the host (which a traced graph would freeze)."""

    positions: np.ndarray | None = None
    documents: np.ndarray | None = None
    loss_mask: np.ndarray | None = None
    # --calculate-per-token-loss: what each kept label's loss is multiplied by instead of 1 / this
    # micro-batch's count (micro-batches x DP / the global batch's count: training/trainer.py)
    loss_weight: float | None = None
    cache: object = None
    position_inputs: tuple | None = None
    # sparse attention: each indexer layer's choice of keys in this forward, for the layers that
    # share it (models/dsa.py; GPTModel.forward gives each forward its own)
    choices: dict | None = None
    _documents: object = field(default=None, repr=False, compare=False)

    def document_tensor(self):
        if self._documents is None:
            self._documents = ops.tensor(np.ascontiguousarray(self.documents, dtype=np.int64))
        return self._documents


@dataclass(frozen=True)
class Scores:
    """How a layer's attention scores differ from plain causal softmax(q.k / sqrt(d)): the
    scale (None: 1/sqrt(head dim)), tanh soft-capping, a sliding window (the facade's
    attention arguments of those names)."""

    scale: float | None = None
    softcap: float | None = None
    window: int | None = None

    def arguments(self) -> dict:
        return {"scale": self.scale, "softcap": self.softcap, "window": self.window}


PLAIN = Scores()


class Seams:
    """The single-device behaviour of everything a parallel plan may replace."""

    # sequences are split into this many equal pieces between the decoder's input and output
    # (sequence parallelism)
    sequence_shards = 1
    # and into this many pieces over the whole model (context parallelism)
    context_shards = 1

    def local_tokens(self, whole):
        """The columns of a whole-sequence array [b, S] that this rank's tokens are."""
        return whole

    def attention(self, q, k, v, dropout_p: float, fused: bool, tokens: Tokens | None, scores: Scores = PLAIN,
                  return_lse: bool = False, keep=None):
        """Causal self-attention of the local tokens (inside their documents when packed); with
        ``return_lse`` also each query's log-sum-exp of its scores [b, s, heads]; ``keep``: bool
        [b, 1, queries, keys], the only keys each query may see besides (sparse attention's)."""
        fn = ops.attention if fused else composite.attention
        how = dict(scores.arguments(), return_lse=return_lse, mask=keep)
        if tokens is None or tokens.documents is None:
            return fn(q, k, v, causal=True, dropout_p=dropout_p, **how)
        if tokens.cache is not None:  # the new queries against every cached key, padding kept apart
            return fn(q, k, v, causal=True, dropout_p=dropout_p,
                      segment_ids=(tokens.document_tensor(), tokens.cache.key_documents()), **how)
        features.note_used("flash-attention-varlen")
        return fn(q, k, v, causal=True, dropout_p=dropout_p, segment_ids=tokens.document_tensor(), **how)

    def heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """(query groups, query heads per group) that this rank computes."""
        return cfg.num_query_groups, cfg.num_attention_heads // cfg.num_query_groups

    def sum_over_heads(self, x):
        """A sum over this rank's heads completed over every head of the layer (a norm across
        heads: each tensor-parallel rank holds some)."""
        return x

    def replicated_loss_share(self) -> float:
        """The weight of a loss that every tensor-parallel rank computes whole (sparse attention's
        indexer loss): its parameters' gradients are then summed over the ranks."""
        return 1.0

    def attention_rng(self):
        """Random state for attention dropout on this rank's heads."""
        return contextlib.nullcontext()

    def hidden_rng(self):
        """Random state for dropout on the hidden states between layers."""
        return contextlib.nullcontext()

    def decoder_input(self, x):
        """What the first layer sees, from the embedding's output."""
        return x

    def output_input(self, x):
        """What the output layer sees, from the final norm's output."""
        return x

    def gather_logits(self, logits):
        """Full-vocabulary logits from the output layer's."""
        return logits

    def token_losses(self, logits, labels):
        """Per-token cross entropy [N] from logits [N, vocab]."""
        return ops.cross_entropy(logits, labels, reduction="none")

    def scalar_head(self, x, weight):
        """A replicated head's values [b, S, 1] over whole sequences from the final norm's
        output (the reward model's rm_head)."""
        return ops.linear(x, weight)

    def vocab_columns(self, logits, token_ids: list[int]):
        """The logits [N, k] of the vocabulary entries ``token_ids`` from logits [N, vocab]
        (differentiable): a product with their one-hot columns, exact in float arithmetic."""
        return ops.matmul(logits, ops.tensor(vocab_selector(0, logits.shape[-1], token_ids)))


SINGLE_DEVICE = Seams()


def vocab_selector(start: int, size: int, token_ids: list[int]) -> np.ndarray:
    """[size, k] float32: column j is one at row token_ids[j] - start when that id lies in
    this vocabulary slice [start, start + size), else zero."""
    pick = np.zeros((size, len(token_ids)), np.float32)
    for j, t in enumerate(token_ids):
        if start <= t < start + size:
            pick[t - start, j] = 1.0
    return pick


def linear(cfg: ModelConfig, name: str, n_in: int, n_out: int, bias: bool, std: float):
    """The decoder's linear layer ``name`` (Megatron's module name), with a LoRA adapter when
    the config targets it."""
    if cfg.lora is not None and name in cfg.lora.targets:
        return lora.LoRALinear(n_in, n_out, bias, std, cfg.lora)
    return Linear(n_in, n_out, bias, std)


def layer_scores(cfg: ModelConfig, number: int, scale: float | None = None) -> Scores:
    """Layer ``number``'s Scores: ``scale`` (default: query_pre_attn_scalar's, else the head
    dim's), the soft cap and the layer's window."""
    window = cfg.window_of(number)
    if window is not None:
        features.note_used("sliding-window-attention")
    if cfg.attn_logit_softcapping is not None:
        features.note_used("logit-softcapping")
    if scale is None and cfg.query_pre_attn_scalar is not None:
        scale = cfg.query_pre_attn_scalar ** -0.5
    return Scores(scale, cfg.attn_logit_softcapping, window)


class CoreAttention(nn.Module):
    """megatron-core's core_attention, here only as the home of the attention sinks' learned
    logits, one per head (its ``softmax_offset``, --softmax-type learnable)."""

    def __init__(self, heads: int, std: float):
        super().__init__()
        self.softmax_offset = _param((heads,), std=std)


def with_sinks(out, lse, sinks):
    """Attention output [b, s, heads, d] as if each head's softmax had one more key of logit
    ``sinks`` [heads] and no value: the weights of the real keys shrink by
    e^lse / (e^lse + e^sink) = sigmoid(lse - sink), from the log-sum-exp ``lse`` [b, s, heads]
    of their scores. Exact for any attention that returns its log-sum-exp."""
    features.note_used("attention-sinks")
    keep = ops.sigmoid(lse - ops.cast(sinks, "float32"))
    return out * ops.unsqueeze(ops.cast(keep, ops.dtype_of(out)), -1)


class SelfAttention(nn.Module):
    # what to recompute in backward (GPTModel.use_recompute; not `recompute`: a MindSpore Cell method)
    recompute_policy = recompute.NONE
    layer_number = 0  # the layer's global number (its slot in a key/value cache); set by Decoder
    # --qk-clip / --log-max-attention-logit (training/qk_clip.py): each training forward's largest
    # attention logit per (local) query head, the maximum over the step's forwards, kept in max_logits
    track_logits = False
    max_logits = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        self.linear_qkv = linear(cfg, "linear_qkv", cfg.hidden_size, cfg.qkv_width, cfg.add_qkv_bias,
                                 cfg.init_method_std)
        self.linear_proj = linear(cfg, "linear_proj", cfg.num_attention_heads * cfg.kv_channels, cfg.hidden_size,
                                  cfg.attention_output_bias, out_std)
        if cfg.qk_layernorm and cfg.qk_norm_across_heads:  # MiniMax-M2: one norm over all query (key) heads
            self.q_layernorm = HeadsRMSNorm(cfg.num_attention_heads, cfg.kv_channels, cfg.norm_epsilon)
            self.k_layernorm = HeadsRMSNorm(cfg.num_query_groups, cfg.kv_channels, cfg.norm_epsilon)
        elif cfg.qk_layernorm:
            self.q_layernorm = make_norm(cfg, cfg.kv_channels)
            self.k_layernorm = make_norm(cfg, cfg.kv_channels)
        if cfg.attention_sinks:
            self.core_attention = CoreAttention(cfg.num_attention_heads, cfg.init_method_std)

    def forward(self, x, cos, sin, seams=SINGLE_DEVICE, tokens=None):
        cfg = self.cfg
        (groups, per_group), d = seams.heads(cfg), cfg.kv_channels
        qkv = self.linear_qkv(x)
        b, s = qkv.shape[0], qkv.shape[1]  # the full sequence, also under sequence parallelism
        gated = cfg.attention_output_gate  # per group: its query heads, their gates, a key, a value
        qkv = ops.reshape(qkv, (b, s, groups, per_group * (2 if gated else 1) + 2, d))
        if gated:
            q, gate, k, v = ops.split(qkv, [per_group, per_group, 1, 1], dim=3)
            gate = ops.reshape(gate, (b, s, groups * per_group, d))
        else:
            q, k, v = ops.split(qkv, [per_group, 1, 1], dim=3)
        q = ops.reshape(q, (b, s, groups * per_group, d))
        k, v = ops.squeeze(k, 3), ops.squeeze(v, 3)
        if cfg.qk_layernorm and cfg.qk_norm_across_heads:  # the mean square over every head: TP ranks add theirs
            q, k = self.q_layernorm(q, seams.sum_over_heads), self.k_layernorm(k, seams.sum_over_heads)
        elif cfg.qk_layernorm:
            norm = self.recompute_policy.norm_of
            q, k = norm(self.q_layernorm, q), norm(self.k_layernorm, k)
        if cos is not None:
            rotary = composite.apply_rotary
            if "rope" in cfg.fused:
                features.note_used("fused-rope")
                rotary = ops.apply_rotary
            if cfg.rotary_dim < d:  # partial rotary (GLM-4.5): the first rotary_dim features of each head
                q, k = (ops.cat([rotary(r, cos, sin), rest], dim=-1)
                        for r, rest in (ops.split(t, [cfg.rotary_dim, d - cfg.rotary_dim], dim=-1) for t in (q, k)))
            else:
                q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        if tokens is not None and tokens.cache is not None:  # attend to every key so far
            k, v = tokens.cache.extend(self.layer_number, k, v)
        p = cfg.attention_dropout if nn.is_training(self) else 0.0
        fused = "attention" in cfg.fused
        if fused:
            features.note_used("flash-attention")
        scores = layer_scores(cfg, self.layer_number)
        if self.track_logits and nn.is_training(self):
            self._note_max_logits(q, k, d ** -0.5 if scores.scale is None else scores.scale)

        sinks = (self.core_attention.softmax_offset,) if cfg.attention_sinks else ()

        def core(q, k, v, *sinks):  # the sinks an input, so that recomputation differentiates them
            with seams.attention_rng():
                if not sinks:
                    return seams.attention(q, k, v, p, fused, tokens, scores)
                return with_sinks(*seams.attention(q, k, v, p, fused, tokens, scores, return_lse=True), *sinks)

        out = self.recompute_policy.attention(core, q, k, v, *sinks)
        if gated:
            features.note_used("attention-output-gate")
            out = ops.cast(ops.cast(out, "float32") * ops.sigmoid(ops.cast(gate, "float32")), ops.dtype_of(out))
        return self.linear_proj(ops.reshape(out, (b, s, groups * per_group * d)))


    def _note_max_logits(self, q, k, scale: float) -> None:
        """The largest scaled logit q.k of each query head over the causal pairs of the sequence
        (q [b, s, H, d], k [b, s, G, d]), into max_logits (a forward run again at its backward
        finds the same maximum)."""
        with autograd.no_grad():
            b, s, heads, d = q.shape
            groups = k.shape[2]
            k = ops.reshape(ops.expand(ops.unsqueeze(k, 3), (b, s, groups, heads // groups, d)), (b, s, heads, d))
            qh, kh = (ops.transpose(ops.cast(t, "float32"), 1, 2) for t in (q, k))  # [b, H, s, d]
            logits = ops.matmul(qh, ops.transpose(kh, 2, 3)) * scale
            future = ops.tensor(np.triu(np.ones((s, s), bool), 1))
            logits = ops.masked_fill(logits, future, float("-inf"))
            found = ops.to_numpy(ops.amax(ops.reshape(ops.transpose(logits, 0, 1), (heads, -1)), dim=1))
        self.max_logits = found if self.max_logits is None else np.maximum(self.max_logits, found)


class MLP(nn.Module):
    recompute_activation = False  # GPTModel.use_memory

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self._activate = mlp_activation(cfg, "swiglu" in cfg.fused)
        width = 2 * cfg.ffn_hidden_size if cfg.gated else cfg.ffn_hidden_size
        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        self.linear_fc1 = linear(cfg, "linear_fc1", cfg.hidden_size, width, cfg.add_bias_linear, cfg.init_method_std)
        self.linear_fc2 = linear(cfg, "linear_fc2", cfg.ffn_hidden_size, cfg.hidden_size, cfg.add_bias_linear, out_std)

    def forward(self, x):
        return self.linear_fc2(recompute.activation(self._activate, self.linear_fc1(x), self.recompute_activation))


class TransformerLayer(nn.Module):
    recompute_policy = recompute.NONE
    swap = contextlib.nullcontext  # GPTModel.use_memory

    def __init__(self, cfg: ModelConfig, mlp: nn.Module | None = None, number: int | None = None):
        """``number``: the layer's global number (its kind of token mixer); None: attention."""
        super().__init__()
        self.hidden_dropout = cfg.hidden_dropout
        self.input_layernorm = make_norm(cfg, cfg.hidden_size)
        if number is not None and cfg.is_linear_layer(number):
            from mindspeed_core.models.gated_deltanet import GatedDeltaNet  # it builds on this module's pieces

            self.self_attention = GatedDeltaNet(cfg)
        elif cfg.mla is not None:
            from mindspeed_core.models.mla import MLASelfAttention  # it builds on this module's pieces

            self.self_attention = MLASelfAttention(cfg, number)
        else:
            self.self_attention = SelfAttention(cfg)
        self.pre_mlp_layernorm = make_norm(cfg, cfg.hidden_size)
        self.mlp = MLP(cfg) if mlp is None else mlp
        self.post_norm = cfg.post_norm
        # MiniCPM: each branch scaled before its residual add
        self.branch_scale = None if cfg.scale_depth is None else cfg.scale_depth / math.sqrt(cfg.real_layers)
        if cfg.post_norm:  # Gemma 2: each block's output normed before its residual add (MindSpeed-LLM's names)
            self.post_attn_norm = make_norm(cfg, cfg.hidden_size)
            self.post_mlp_layernorm = make_norm(cfg, cfg.hidden_size)

    def attentions(self) -> list:
        """[(attribute name, its token mixer)]: what parallelism and memory policies act on."""
        return [("self_attention", self.self_attention)]

    def dense_mlps(self) -> list:
        """[(attribute name, dense MLP)]: the MLPs tensor parallelism cuts as megatron-core's (an MoE
        layer's are parallel/experts.py's)."""
        return [("mlp", self.mlp)] if isinstance(self.mlp, MLP) else []

    def _branch(self, x, seams):
        """What a block adds to the residual stream: its output, scaled (MiniCPM), dropped out."""
        if self.branch_scale is not None:
            x = x * self.branch_scale
        if not self.hidden_dropout or not nn.is_training(self):
            return x
        with seams.hidden_rng():
            return ops.dropout(x, self.hidden_dropout)

    def forward(self, x, cos, sin, seams=SINGLE_DEVICE, tokens=None):
        x = self.attend(x, cos, sin, seams, tokens)
        return self.add_mixed(x, self.mlp(self.mlp_input(x)), seams)

    def attend(self, x, cos, sin, seams=SINGLE_DEVICE, tokens=None):
        """The residual stream after the attention block (forward's first half)."""
        norm = self.recompute_policy.norm_of
        with self.swap():  # --swap-attention: what this block saves waits in host memory
            attended = self.self_attention(norm(self.input_layernorm, x), cos, sin, seams, tokens)
        if self.post_norm:
            attended = norm(self.post_attn_norm, attended)
        return x + self._branch(attended, seams)

    def mlp_input(self, x):
        return self.recompute_policy.norm_of(self.pre_mlp_layernorm, x)

    def add_mixed(self, x, mixed, seams=SINGLE_DEVICE):
        """The residual stream ``x`` plus the MLP's output ``mixed`` (forward's end)."""
        if self.post_norm:
            mixed = self.recompute_policy.norm_of(self.post_mlp_layernorm, mixed)
        return x + self._branch(mixed, seams)


class Decoder(nn.Module):
    """The layers with the given global numbers (no-op layers are simply absent), and the
    final norm when this is the last stage."""

    recompute_policy = recompute.NONE

    def __init__(self, cfg: ModelConfig, numbers: tuple, final_norm: bool = True, make_mlp=None):
        super().__init__()
        self.numbers = tuple(numbers)
        if cfg.shortcut_moe:  # LongCat-Flash's layer (it builds on this module's pieces)
            from mindspeed_core.models.longcat import ShortcutMoELayer as layer_class
        else:
            layer_class = TransformerLayer
        self.layers = nn.ModuleList([layer_class(cfg, None if make_mlp is None else make_mlp(n), n)
                                     for n in self.numbers])
        self.local = [cfg.rotates_locally(n) for n in self.numbers]  # which layers take the local RoPE
        for number, layer in zip(self.numbers, self.layers):
            for _, attention in layer.attentions():
                attention.layer_number = number
        if cfg.dsa is not None and cfg.dsa.unsourced(self.numbers):  # a shared choice must be made in this forward
            raise ValueError(cfg.dsa.unsourced(self.numbers))
        if final_norm:
            self.final_layernorm = make_norm(cfg, cfg.hidden_size)
        self.has_final_norm = final_norm

    def run_layers(self, x, cos, sin, seams=SINGLE_DEVICE, tokens=None, local=None):
        """The layers' output, before the final norm (GPTModel.after_layers applies it). ``local``:
        the (cos, sin) of the layers that rotate locally (Gemma 3), or None."""
        for start, stop, recomputed in self.recompute_policy.groups(len(self.layers)):
            def run(x, indices=range(start, stop)):
                for i in indices:
                    x = self.layers[i](x, *(local if self.local[i] else (cos, sin)), seams, tokens)
                return x

            if recomputed:
                features.note_used("recompute")
                x = recompute.checkpoint(run, x)
            else:
                x = run(x)
        return x


class LanguageEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.word_embeddings = Embedding(cfg.vocab_size, cfg.hidden_size, cfg.init_method_std)
        if cfg.position_embedding_type == "learned":
            self.position_embeddings = Embedding(cfg.max_position_embeddings, cfg.hidden_size, cfg.init_method_std)
        self.learned_positions = cfg.position_embedding_type == "learned"
        # Gemma: times sqrt(hidden) in the embeddings' dtype (bf16 rounds sqrt(3072) to 55.5, as
        # transformers does)
        self.scale = math.sqrt(cfg.hidden_size) if cfg.scale_embeddings else cfg.scale_emb  # MiniCPM: scale_emb

    def forward(self, ids, positions=None):
        """``positions``: [b or 1, s] int tensor (None: 0..s-1)."""
        x = self.word_embeddings(ids)
        if self.scale is not None:
            x = x * ops.full((), self.scale, dtype=ops.dtype_of(x))
        if self.learned_positions:
            x = x + self.position_embeddings(ops.arange(ids.shape[1]) if positions is None else positions)
        return x


class GPTModel(nn.Module):
    """The whole model, or one pipeline stage of it: ``layers`` are the global numbers of the
    transformer layers it holds (default: every layer that is not a no-op), ``pre_process``
    whether it starts with the embedding (else it takes the previous stage's hidden states),
    ``post_process`` whether it ends with the final norm and the output layer (else it
    returns hidden states). Parameter names are the whole model's (``decoder.layers.<global
    number>``: ``parameter_names``), so checkpoints do not depend on the layout."""

    def __init__(self, cfg: ModelConfig, layers: tuple | None = None, pre_process: bool = True,
                 post_process: bool = True):
        super().__init__()
        self.cfg = cfg
        self.pre_process, self.post_process = pre_process, post_process
        if layers is None:
            layers = tuple(i for i in range(cfg.num_layers) if i not in cfg.noop_layers)
        if cfg.noop_layers:
            features.note_used("noop-layers")
        # the last stage's multi-token prediction reads the word embeddings: a stage without
        # them holds a copy, summed with the first stage's like a tied output layer's
        if pre_process or (post_process and cfg.mtp_num_layers):
            self.embedding = LanguageEmbedding(cfg)
        self.decoder = Decoder(cfg, layers, final_norm=post_process, make_mlp=self.make_mlp)
        if post_process and cfg.mtp_num_layers:
            from mindspeed_core.models.mtp import MultiTokenPrediction  # it builds on this module's layers

            self.mtp = MultiTokenPrediction(cfg, self.make_mlp)
        self._mtp_input = {}  # what the last forward leaves for mtp_loss (a dict: a Cell's attribute)
        self.indexer_log = []  # (summed KL, indexer layers) per training forward: the step's log
        if post_process and cfg.reward_head:
            self.rm_head = Linear(cfg.hidden_size, 1, False, cfg.init_method_std)
        elif post_process and cfg.untie_embeddings_and_output_weights:
            self.output_layer = Linear(cfg.hidden_size, cfg.vocab_size, cfg.output_layer_bias, cfg.init_method_std)
        elif post_process and not pre_process and not cfg.mtp_num_layers:
            # tied weights on a stage without the embedding: a copy of the word embeddings,
            # whose gradient the pipeline sums with the first stage's (Megatron's embedding group)
            self.output_layer = Linear(cfg.hidden_size, cfg.vocab_size, False, cfg.init_method_std)
        if cfg.position_embedding_type == "rope":  # longrope: the short factors' table (the long: _table)
            self._rope = rope.tables(cfg.max_position_embeddings, cfg.rotary_dim, cfg.rotary_base, cfg.rope_scaling,
                                     cfg.max_position_embeddings, decided_by=rope.switch_length(cfg.rope_scaling))
        else:
            self._rope = None
        self._local_rope = None if cfg.local_rotary_base is None else rope.tables(
            cfg.max_position_embeddings, cfg.rotary_dim, cfg.local_rotary_base, None, cfg.max_position_embeddings)
        self._rope_cache = {}
        self._long_rope = {}
        self.seams = SINGLE_DEVICE

    def transformer_layers(self) -> list:
        """[(local name prefix, layer)] of this stage's transformer layers: the decoder's, then
        multi-token prediction's."""
        layers = [(f"decoder.layers.{i}.", layer) for i, layer in enumerate(self.decoder.layers)]
        if hasattr(self, "mtp"):
            layers += [(f"mtp.layers.{k}.transformer_layer.", m.transformer_layer) for k, m in enumerate(self.mtp.layers)]
        return layers

    def make_mlp(self, number: int) -> nn.Module:
        """The MLP of layer ``number`` (a model family with other MLPs overrides this)."""
        return MLP(self.cfg)

    def use_seams(self, seams: Seams) -> None:
        """Run with a parallel plan's seams (mindspeed_core.parallel.layers)."""
        self.seams = seams

    def use_memory(self, policy: recompute.Recompute, swap=None) -> None:
        """Recompute in backward what ``policy`` says instead of keeping it
        (memory/recompute.py); with ``swap`` (memory/swap.py HostSwap), the attention block
        of every layer that full recompute leaves alone keeps its saved tensors in host memory."""
        self.decoder.recompute_policy = policy
        layers = self.decoder.layers
        for layer, activation in zip(layers, policy.activation_in(len(layers))):
            layer.recompute_policy = policy
            for _, attention in layer.attentions():
                attention.recompute_policy = policy
            for mlp in (layer.mlp, getattr(layer.mlp, "experts", None), getattr(layer.mlp, "shared_experts", None),
                        *(m for _, m in layer.dense_mlps())):
                if mlp is not None and hasattr(mlp, "recompute_activation"):
                    mlp.recompute_activation = activation
            if hasattr(layer.mlp, "zero_memory"):  # an MoE layer: --moe-zero-memory
                layer.mlp.zero_memory = policy.moe_zero_memory
        if swap is not None:
            for start, stop, recomputed in policy.groups(len(layers)):
                for i in range(start, stop):
                    if not recomputed:
                        layers[i].swap = swap.block

    @property
    def sequence_multiple(self) -> int:
        """Sequence lengths must be a multiple of this (sequence parallelism splits them)."""
        return self.seams.sequence_shards

    def parameter_names(self) -> list[str]:
        """The whole model's name of each parameter, in nn.named_parameters order."""
        return [self.global_name(n) for n, _ in nn.named_parameters(self)]

    def global_name(self, name: str) -> str:
        if name.startswith("decoder.layers."):
            local, rest = name[len("decoder.layers."):].split(".", 1)
            return f"decoder.layers.{self.decoder.numbers[int(local)]}.{rest}"
        if name.startswith("output_layer.") and self.cfg.tied_output:
            return "embedding.word_embeddings." + name[len("output_layer."):]
        return name

    def local_state(self, full: dict) -> dict:
        """The entries of a whole-model state dict {name: array} that this stage holds, under
        its own parameter names."""
        return {n: full[g] for n, g in zip((n for n, _ in nn.named_parameters(self)), self.parameter_names())
                if g in full}

    def _positions(self, seq_len: int, tokens):
        """This rank's position ids [b or 1, s] (numpy), or None for 0..s-1 on every row."""
        if (tokens is None or tokens.positions is None) and self.seams.context_shards == 1:
            return None
        whole = np.arange(seq_len)[None] if tokens is None or tokens.positions is None else tokens.positions
        if whole.shape[1] != seq_len:
            raise ValueError(f"positions cover {whole.shape[1]} tokens, the sequence has {seq_len}")
        if int(whole.max()) >= self.cfg.max_position_embeddings and not rope.extends_positions(self.cfg.rope_scaling):
            raise ValueError(f"position {int(whole.max())} exceeds max_position_embeddings "
                             f"{self.cfg.max_position_embeddings}")
        return self.seams.local_tokens(whole)

    def _table(self, length: int, local: bool = False):
        """cos, sin (host) for positions 0..length-1. Past max_position_embeddings only a
        scaling made for it (dynamic NTK) has them, with frequencies set by the length;
        longrope's long factors take over past its original length. ``local``: the unscaled
        tables of local_rotary_base (Gemma 3's sliding layers), past max_position_embeddings
        where the others go there."""
        cfg = self.cfg
        if local:
            if length <= cfg.max_position_embeddings:
                return self._local_rope
            self._table(length)  # the same refusal past max_position_embeddings
            return rope.tables(length, cfg.rotary_dim, cfg.local_rotary_base, None, length)
        switch = rope.switch_length(cfg.rope_scaling)
        if length <= cfg.max_position_embeddings and (switch is None or length <= switch):
            return self._rope
        if length > cfg.max_position_embeddings and not rope.extends_positions(cfg.rope_scaling):
            raise ValueError(f"sequence length {length} exceeds max_position_embeddings {cfg.max_position_embeddings}")
        size = max(length, cfg.max_position_embeddings)  # longrope: one long table, whatever the length past it
        if size not in self._long_rope:  # one length kept: generation grows it a token at a time
            self._long_rope = {size: rope.tables(size, cfg.rotary_dim, cfg.rotary_base, cfg.rope_scaling,
                                                 cfg.max_position_embeddings, decided_by=length)}
        return self._long_rope[size]

    def _rotary(self, seq_len: int, dtype: str, positions=None, local: bool = False):
        if self._rope is None:
            return None, None
        if positions is not None:  # per token: [b or 1, s, 1, d] gathered on the host
            cos, sin = self._table(int(positions.max()) + 1, local)  # dynamic NTK: set by the furthest position
            return tuple(ops.tensor(t[positions][:, :, None, :], dtype=dtype) for t in (cos, sin))
        cos, sin = self._table(seq_len, local)
        if seq_len > self.cfg.max_position_embeddings:  # a length of its own, not kept
            return ops.tensor(cos, dtype=dtype), ops.tensor(sin, dtype=dtype)
        if (seq_len, dtype, local) not in self._rope_cache:  # device tensors, built once per length
            self._rope_cache[seq_len, dtype, local] = (ops.tensor(cos[:seq_len], dtype=dtype),
                                                       ops.tensor(sin[:seq_len], dtype=dtype))
        return self._rope_cache[seq_len, dtype, local]

    def _rotaries(self, seq_len: int, dtype: str, positions):
        """(cos, sin) and the local layers' (cos, sin) or None."""
        local = None if self._local_rope is None else self._rotary(seq_len, dtype, positions, local=True)
        return self._rotary(seq_len, dtype, positions), local

    def rotary_tables(self, tokens: Tokens, dtype: str, rows: int) -> tuple:
        """For a compiled forward, made before it (a tensor made inside a traced graph is frozen
        into it): ``tokens``' positions (whole sequences, below ``rows``) as a device tensor, and
        the RoPE tables that cover them cut or padded to ``rows`` rows (so that their shape, a
        graph input's, does not grow with dynamic NTK's), (cos, sin) and the local layers' (cos,
        sin) or None (None without RoPE); rotary_rows picks their rows inside the graph."""
        positions = self._positions(tokens.positions.shape[1], tokens)
        if int(positions.max()) >= rows:
            raise ValueError(f"position {int(positions.max())} is past the {rows} rows of the tables asked for")
        tables = None
        if self._rope is not None:
            length = int(positions.max()) + 1  # dynamic NTK: set by the furthest position, as _rotary
            tables = tuple(None if local and self._local_rope is None else self._table_tensors(length, local, dtype, rows)
                           for local in (False, True))
        return ops.tensor(positions), tables

    def _table_tensors(self, length: int, local: bool, dtype: str, rows: int):
        cos, sin = self._table(length, local)
        kept = self._rope_cache.get(("table", local, dtype, rows))
        if kept is None or kept[0] is not cos:  # the host table changed (a longer or scaled one)
            def fit(t):
                return np.pad(t[:rows], ((0, max(0, rows - len(t))), (0, 0)))

            kept = self._rope_cache["table", local, dtype, rows] = (cos, ops.tensor(fit(cos), dtype=dtype),
                                                                    ops.tensor(fit(sin), dtype=dtype))
        return kept[1:]

    @staticmethod
    def rotary_rows(tables, positions) -> tuple:
        """((cos, sin), local (cos, sin) or None) [b or 1, s, 1, d] of ``positions`` [b or 1,
        s] from rotary_tables' tables, by device gathers: what forward's host gather makes."""
        if tables is None:
            return (None, None), None
        b, s = positions.shape
        flat = ops.reshape(positions, (-1,))

        def rows(t):
            return ops.reshape(ops.index_select(t, 0, flat), (b, s, 1, t.shape[-1]))

        return tuple(None if pair is None else tuple(rows(t) for t in pair) for pair in tables)

    def output_weight(self):
        if hasattr(self, "embedding") and not self.cfg.untie_embeddings_and_output_weights:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight

    def forward(self, x, tokens: Tokens | None = None, logits: bool = True):
        """ids [batch, seq] int -> logits [batch, seq, vocab], in the parameters' dtype; a
        stage without the embedding takes, and one without the head returns, the hidden
        states between layers ([batch, seq / sequence shards, hidden]). ``tokens``: positions
        and documents of packed sequences (models/gpt.py Tokens). ``logits`` False: the last
        stage returns the final norm's output instead (chunked_loss applies the head).

        Under tensor parallelism the logits are this rank's vocabulary shard; under context
        parallelism ids are this rank's columns of each sequence (Seams.local_tokens)."""
        tokens, positions, seq_len = self.forward_tokens(x, tokens)
        if self.pre_process:
            x = self.embed(x, tokens, positions)
        cos, sin, local = self.rotary_for(x, tokens, positions, seq_len)
        x = self.decoder.run_layers(x, cos, sin, self.seams, tokens, local)
        return self.after_layers(x, tokens, (cos, sin, positions), logits)

    def forward_tokens(self, x, tokens: Tokens | None):
        """forward's start: (the tokens as this forward uses them, the positions or None, the
        whole sequence's length) for its input ``x`` (ids, or the previous stage's hidden states)."""
        seams = self.seams
        if self.cfg.dsa is not None:  # this forward's choices of keys, apart from any other's
            tokens = Tokens(choices={}) if tokens is None else dataclasses.replace(tokens, choices={})
        local = x.shape[1] if self.pre_process else x.shape[1] * seams.sequence_shards
        seq_len = local * seams.context_shards  # the whole sequence
        given = None if tokens is None else tokens.position_inputs
        return tokens, self._positions(seq_len, tokens) if given is None else None, seq_len

    def embed(self, ids, tokens: Tokens | None, positions):
        """The decoder's input from the token ids (the first stage)."""
        given = None if tokens is None else tokens.position_inputs
        where = given[0] if given is not None else None if positions is None else ops.tensor(positions)
        return self.seams.decoder_input(self.embedding(ids, where))

    def rotary_for(self, x, tokens: Tokens | None, positions, seq_len: int) -> tuple:
        """(cos, sin, the local layers' (cos, sin) or None) for the decoder's input ``x``."""
        given = None if tokens is None else tokens.position_inputs
        _, (cos, sin), local = given or (None, *self._rotaries(seq_len, ops.dtype_of(x), positions))
        return cos, sin, local

    def after_layers(self, x, tokens: Tokens | None, rotary: tuple, logits: bool = True):
        """forward's end from the layers' output: the final norm and the output layer, where this
        stage has them (``rotary``: (cos, sin, positions), which multi-token prediction takes)."""
        if self.post_process and hasattr(self, "mtp") and (tokens is None or tokens.cache is None):
            self._mtp_input["last"] = (x, *rotary)  # the modules start from the layers' output
        if self.decoder.has_final_norm:
            x = self.decoder.final_layernorm(x)
        if not self.post_process or not logits:
            return x
        if self.cfg.reward_head:
            return self.seams.scalar_head(x, self.rm_head.weight)
        return self._head(x)

    def _head(self, x):
        """Logits from the final norm's output."""
        return self._logits(self.seams.output_input(x))

    def _logits(self, x):
        """Logits from the output layer's input (the final norm's output as the layout gives it)."""
        if self.cfg.dim_model_base is not None:  # MiniCPM: the output divided by hidden / dim_model_base
            x = x / (self.cfg.hidden_size / self.cfg.dim_model_base)
        bias = None
        if self.cfg.output_layer_bias:  # cut with the vocabulary under TP
            features.note_used("output-layer-bias")
            bias = self.output_layer.bias
        logits = ops.linear(x, self.output_weight(), bias)
        cap = self.cfg.final_logit_softcapping
        if cap is not None:  # Gemma 2: elementwise, so a vocabulary shard is capped as the whole is
            features.note_used("logit-softcapping")
            logits = ops.tanh(logits * (1.0 / cap)) * cap
        return logits

    def gather_logits(self, logits):
        """Full-vocabulary logits from forward's output."""
        return self.seams.gather_logits(logits)

    def loss_from_logits(self, logits, labels, tokens: Tokens | None = None):
        """Mean next-token cross entropy over the positions tokens.loss_mask keeps (all if
        None), over whole sequences: under context parallelism each rank returns its share
        times the shard count, so the mean over the context-parallel ranks is the loss."""
        per_token = self._token_losses(logits, labels)
        weights = self._loss_weights(tokens)
        return ops.mean(per_token) if weights is None else ops.sum(per_token * ops.tensor(weights.reshape(-1)))

    def _token_losses(self, logits, labels):
        logits = ops.cast(logits, "float32")  # the softmax in fp32 whatever the model dtype
        return self.seams.token_losses(ops.reshape(logits, (-1, logits.shape[-1])), ops.reshape(labels, (-1,)))

    def _loss_weights(self, tokens):
        """[b, s] float32 (this rank's columns): each label's weight in the loss, or None for the
        plain mean. The denominator counts the whole sequences' kept labels (known on the host),
        or with --calculate-per-token-loss the global batch's."""
        if tokens is None or tokens.loss_mask is None:
            return None
        whole = np.asarray(tokens.loss_mask, np.float32)
        share = tokens.loss_weight if tokens.loss_weight is not None else 1.0 / max(float(whole.sum()), 1.0)
        return np.ascontiguousarray(self.seams.local_tokens(whole)) * (self.seams.context_shards * share)

    def chunked_loss(self, hidden, labels, tokens: Tokens | None, chunk: int):
        """loss_from_logits of the final norm's output ``hidden`` (forward with logits=False),
        the output layer and the cross entropy ``chunk`` sequence positions at a time, each chunk
        recomputed in backward (--loss-compute-mode chunk): only one chunk's logits live at once."""
        features.note_used("chunk-loss")
        x = self.seams.output_input(hidden)  # the whole local sequence (gathered under SP)
        b, s = labels.shape[0], labels.shape[1]
        weights = self._loss_weights(tokens)
        if weights is None:
            weights = np.full((b, s), 1.0 / (b * s), np.float32)
        total = None
        for start in range(0, s, chunk):
            stop = min(start + chunk, s)
            share = ops.tensor(np.ascontiguousarray(np.broadcast_to(weights, (b, s))[:, start:stop]).reshape(-1))

            def piece(xc, start=start, stop=stop, share=share):
                return ops.sum(self._token_losses(self._logits(xc), labels[:, start:stop]) * share)

            part = recompute.checkpoint(piece, x[:, start:stop])
            total = part if total is None else total + part
        return total

    def mtp_loss(self, labels, tokens: Tokens | None = None):
        """Multi-token prediction's term of the gradient (models/mtp.py) from the last forward's
        layers' output: mtp_loss_scaling_factor / D times the depths' mean cross entropies,
        each also kept for the log (self.mtp.losses). Whole sequences (context parallelism
        is refused with it)."""
        if "last" not in self._mtp_input:
            raise RuntimeError("mtp_loss needs a forward of the last stage first")
        from mindspeed_core.models.mtp import depth_mask, shift_left

        hidden, cos, sin, positions = self._mtp_input.pop("last")
        features.note_used("multi-token-prediction")
        seams, shape = self.seams, tuple(labels.shape)
        position_tensor = None if positions is None else ops.tensor(positions)
        total, ahead = None, labels  # ahead: the token k places on from each position
        for k, (layer, norm) in enumerate(zip(self.mtp.layers, self.mtp.final_layernorms), 1):
            embedded = seams.decoder_input(self.embedding(ahead, position_tensor))
            hidden = layer(hidden, embedded, cos, sin, seams, tokens)
            ahead = shift_left(ahead)
            mask = depth_mask(None if tokens is None else tokens.loss_mask, shape, k)
            depth = self.loss_from_logits(self._head(norm(hidden)), ahead, Tokens(loss_mask=mask))
            if not recompute.recomputing():  # the log counts each micro-batch once
                self.mtp.losses[k - 1].append(autograd.detach(depth))
            total = depth if total is None else total + depth
        return total * self.mtp.scale

    def indexer_losses(self):
        """The sum of this model's (or pipeline chunk's) sparse-attention indexer losses from its
        last training forward (models/dsa.py), or None: like the routers' losses, a term of the
        gradient, not of the reported loss."""
        attentions = [attention for _, layer in self.transformer_layers() for _, attention in layer.attentions()
                      if getattr(attention, "indexer_loss", None) is not None]
        if not attentions:
            return None
        kls = [a.indexer_kl for a in attentions]
        if not recompute.recomputing():  # the log counts each micro-batch once
            self.indexer_log.append((sum(kls[1:], kls[0]), len(kls)))
        losses = [a.indexer_loss for a in attentions]
        return sum(losses[1:], losses[0])

    def take_indexer_log(self) -> tuple[float, int]:
        """(the indexer layers' KLs summed, how many) over the training forwards since the last call."""
        kl, count = sum(float(ops.to_numpy(v)) for v, _ in self.indexer_log), sum(n for _, n in self.indexer_log)
        self.indexer_log = []
        return kl, count

    def loss(self, ids, labels, tokens: Tokens | None = None):
        """The whole model's loss (see loss_from_logits)."""
        return self.loss_from_logits(self(ids, tokens), labels, tokens)


def whole_state(model: GPTModel) -> dict:
    """{whole-model parameter name: numpy array} of this model or stage."""
    return dict(zip(model.parameter_names(), nn.state_dict(model).values()))


def load_whole_state(model: GPTModel, arrays: dict) -> None:
    """Load a whole model's {name: array} into this whole model (strict both ways)."""
    unexpected = sorted(set(arrays) - set(model.parameter_names()))
    if unexpected:
        raise CheckpointError(f"unexpected tensors for this model: {', '.join(unexpected[:5])}")
    nn.load_state_dict(model, model.local_state(arrays))


def pipeline_chunks(model: GPTModel, layout, pp_rank: int) -> list:
    """This pipeline rank's model chunks of a whole ``model``, holding its values (a tied
    output copy starts as the word embeddings). Building them draws no random numbers."""
    state = whole_state(model)
    saved = random.get_state()  # construction initialises weights, which are replaced at once
    chunks = []
    for chunk in range(layout.chunks):
        stage = layout.stage(pp_rank, chunk)
        part = type(model)(model.cfg, layout.layers(stage), pre_process=stage == 0,
                           post_process=stage == layout.virtual_stages - 1)
        nn.load_state_dict(part, part.local_state(state))
        chunks.append(part)
    random.set_state(saved)
    return chunks
