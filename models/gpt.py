"""The decoder-only transformer (Megatron's GPTModel), written only against the facade.

One class covers LLaMA 2/3, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm) and GPT-2
(LayerNorm, learned positions, GELU, biases) through ModelConfig switches.

The fused qkv projection uses Megatron-core's layout: for each query group, its query heads,
then its key head, then its value head, so that tensor parallelism can later split the rows
by query group.
"""

from __future__ import annotations

import contextlib
import math

from mindspeed_core import composite, features, nn, ops
from mindspeed_core.models import rope
from mindspeed_core.models.config import ModelConfig
from mindspeed_core.models.layers import Embedding, Linear, make_norm


class SelfAttention(nn.Module):
    # Random state for dropout on this rank's heads: tensor parallelism swaps in a fork of
    # the tracker's "model-parallel" stream, so ranks holding different heads draw different
    # masks (mindspeed_core.parallel.layers).
    rng_region = staticmethod(contextlib.nullcontext)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        self.linear_qkv = Linear(cfg.hidden_size, cfg.qkv_width, cfg.add_qkv_bias, cfg.init_method_std)
        self.linear_proj = Linear(cfg.num_attention_heads * cfg.kv_channels, cfg.hidden_size, cfg.attention_output_bias,
                                  out_std)
        if cfg.qk_layernorm:
            self.q_layernorm = make_norm(cfg, cfg.kv_channels)
            self.k_layernorm = make_norm(cfg, cfg.kv_channels)
        # on this rank: tensor parallelism divides the groups, or the heads of a group
        self.num_groups = cfg.num_query_groups
        self.heads_per_group = cfg.num_attention_heads // cfg.num_query_groups

    def forward(self, x, cos, sin):
        cfg = self.cfg
        groups, per_group, d = self.num_groups, self.heads_per_group, cfg.kv_channels
        qkv = self.linear_qkv(x)
        b, s = qkv.shape[0], qkv.shape[1]  # the full sequence, also under sequence parallelism
        qkv = ops.reshape(qkv, (b, s, groups, per_group + 2, d))
        q, k, v = ops.split(qkv, [per_group, 1, 1], dim=3)
        q = ops.reshape(q, (b, s, groups * per_group, d))
        k, v = ops.squeeze(k, 3), ops.squeeze(v, 3)
        if cfg.qk_layernorm:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if cos is not None:
            rotary = composite.apply_rotary
            if "rope" in cfg.fused:
                features.note_used("fused-rope")
                rotary = ops.apply_rotary
            q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        p = cfg.attention_dropout if nn.is_training(self) else 0.0
        attention = composite.attention
        if "attention" in cfg.fused:
            features.note_used("flash-attention")
            attention = ops.attention
        with self.rng_region():
            out = attention(q, k, v, causal=True, dropout_p=p)
        return self.linear_proj(ops.reshape(out, (b, s, groups * per_group * d)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.activation = cfg.activation
        self.fused_swiglu = "swiglu" in cfg.fused
        width = 2 * cfg.ffn_hidden_size if cfg.activation == "swiglu" else cfg.ffn_hidden_size
        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        self.linear_fc1 = Linear(cfg.hidden_size, width, cfg.add_bias_linear, cfg.init_method_std)
        self.linear_fc2 = Linear(cfg.ffn_hidden_size, cfg.hidden_size, cfg.add_bias_linear, out_std)

    def forward(self, x):
        h = self.linear_fc1(x)
        if self.activation == "swiglu":  # gate rows first, then up rows (mcore's fc1 layout)
            if self.fused_swiglu:
                features.note_used("fused-swiglu")
                h = ops.swiglu(h)
            else:
                h = composite.swiglu(h)
        else:
            h = ops.gelu(h, approximate="tanh" if self.activation == "gelu_tanh" else "none")
        return self.linear_fc2(h)


class TransformerLayer(nn.Module):
    # Hidden dropout acts on replicated activations, which must draw the same mask on every
    # tensor-parallel rank (the default stream); under sequence parallelism each rank holds
    # other tokens and the tracker's fork is swapped in.
    rng_region = staticmethod(contextlib.nullcontext)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.hidden_dropout = cfg.hidden_dropout
        self.input_layernorm = make_norm(cfg, cfg.hidden_size)
        self.self_attention = SelfAttention(cfg)
        self.pre_mlp_layernorm = make_norm(cfg, cfg.hidden_size)
        self.mlp = MLP(cfg)

    def _dropout(self, x):
        if not self.hidden_dropout or not nn.is_training(self):
            return x
        with self.rng_region():
            return ops.dropout(x, self.hidden_dropout)

    def forward(self, x, cos, sin):
        x = x + self._dropout(self.self_attention(self.input_layernorm(x), cos, sin))
        return x + self._dropout(self.mlp(self.pre_mlp_layernorm(x)))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layers = nn.ModuleList([TransformerLayer(cfg) for _ in range(cfg.num_layers)])
        self.final_layernorm = make_norm(cfg, cfg.hidden_size)

    def forward(self, x, cos, sin):
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.final_layernorm(x)


class LanguageEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.word_embeddings = Embedding(cfg.vocab_size, cfg.hidden_size, cfg.init_method_std)
        if cfg.position_embedding_type == "learned":
            self.position_embeddings = Embedding(cfg.max_position_embeddings, cfg.hidden_size, cfg.init_method_std)
        self.learned_positions = cfg.position_embedding_type == "learned"

    def forward(self, ids):
        x = self.word_embeddings(ids)
        if self.learned_positions:
            x = x + self.position_embeddings(ops.arange(ids.shape[1]))
        return x


class GPTModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embedding = LanguageEmbedding(cfg)
        self.decoder = Decoder(cfg)
        if cfg.untie_embeddings_and_output_weights:
            self.output_layer = Linear(cfg.hidden_size, cfg.vocab_size, False, cfg.init_method_std)
        if cfg.position_embedding_type == "rope":
            cos, sin = rope.tables(cfg.max_position_embeddings, cfg.kv_channels, cfg.rotary_base, cfg.rope_scaling)
            self._rope = (cos, sin)
        else:
            self._rope = None
        self._rope_cache = {}
        self.sequence_multiple = 1  # sequence parallelism raises it to the TP size

    def _rotary(self, seq_len: int, dtype: str):
        if self._rope is None:
            return None, None
        if seq_len > self.cfg.max_position_embeddings:
            raise ValueError(f"sequence length {seq_len} exceeds max_position_embeddings "
                             f"{self.cfg.max_position_embeddings}")
        if (seq_len, dtype) not in self._rope_cache:  # device tensors, built once per length
            cos, sin = self._rope
            self._rope_cache[seq_len, dtype] = (ops.tensor(cos[:seq_len], dtype=dtype),
                                                ops.tensor(sin[:seq_len], dtype=dtype))
        return self._rope_cache[seq_len, dtype]

    def forward(self, ids):
        """ids [batch, seq] int -> logits [batch, seq, vocab], in the parameters' dtype.

        Under tensor parallelism the logits are this rank's vocabulary shard (see
        mindspeed_core.parallel.layers, which also swaps in the vocab-parallel loss)."""
        x = self.embedding(ids)
        cos, sin = self._rotary(ids.shape[1], ops.dtype_of(x))
        x = self.decoder(self.decoder_input(x), cos, sin)
        weight = (self.output_layer.weight if self.cfg.untie_embeddings_and_output_weights
                  else self.embedding.word_embeddings.weight)
        return ops.linear(self.output_input(x), weight)

    @staticmethod
    def decoder_input(x):
        """What the first layer sees (sequence parallelism keeps this rank's slice)."""
        return x

    @staticmethod
    def output_input(x):
        """What the output layer sees (parallelisation replaces this: gather, copy)."""
        return x

    @staticmethod
    def gather_logits(logits):
        """Full-vocabulary logits from forward's output (tensor parallelism gathers shards)."""
        return logits

    @staticmethod
    def token_losses(logits, labels):
        """Per-token cross entropy [N] from logits [N, vocab] (replaced under TP)."""
        return ops.cross_entropy(logits, labels, reduction="none")

    def loss(self, ids, labels, loss_mask=None):
        """Mean next-token cross entropy over the positions loss_mask keeps (all if None)."""
        logits = ops.cast(self(ids), "float32")  # the softmax in fp32 whatever the model dtype
        flat = ops.reshape(logits, (-1, logits.shape[-1]))
        per_token = self.token_losses(flat, ops.reshape(labels, (-1,)))
        if loss_mask is None:
            return ops.mean(per_token)
        mask = ops.cast(ops.reshape(loss_mask, (-1,)), "float32")
        return ops.sum(per_token * mask) / ops.maximum(ops.sum(mask), ops.full((), 1.0))
