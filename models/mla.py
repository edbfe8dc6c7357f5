"""Multi-head latent attention (DeepSeek-V2/V3; Megatron-core's MLASelfAttention), written only
against the facade.

Keys and values are not projected from the hidden state per head: one latent of
``kv_lora_rank`` features per token is (linear_kv_down_proj, which also yields the token's
rotated key part, qk_rope_head_dim features shared by every head), normed (kv_layernorm), and
projected up to each head's key features without position and its value (linear_kv_up_proj).
Queries come from linear_q_proj, or through a latent of their own (linear_q_down_proj,
q_layernorm, linear_q_up_proj). Parameter names are megatron-core's (its local spec).

The rotated features are stored interleaved in pairs, as DeepSeek's weights have them
(MLAConfig.rope_interleave); they are regrouped as (even features, odd features) before the
usual rotate-half RoPE, which is what megatron-core and transformers do too: q.k does not
depend on the order in which both lay out their features.

Generation caches the normed latent and the rotated key part, kv_lora_rank +
qk_rope_head_dim numbers a token per layer (the saving MLA exists for), and projects keys and
values up from them at each step.

Under tensor parallelism (parallel/layers.py) the up-projections split by head and the
down-projections are replicated: their gradients (and the latents' norms') are partial sums
over the heads of each rank, like the column layers' inputs.
"""

from __future__ import annotations

import math

from mindspeed_core import autograd, composite, features, nn, ops
from mindspeed_core.memory import recompute
from mindspeed_core.models import dsa, lora, rope
from mindspeed_core.models.gpt import SINGLE_DEVICE, linear, layer_scores
from mindspeed_core.models.layers import Linear, make_norm


def softmax_scale(cfg) -> float:
    """1/sqrt(qk head dim), times YaRN's mscale(factor, mscale_all_dim) squared where the
    scaling gives mscale_all_dim (DeepSeek's configs)."""
    scale = cfg.mla.qk_head_dim ** -0.5
    scaling = cfg.rope_scaling or {}
    if rope.kind(scaling) not in (None, "default") and scaling.get("mscale_all_dim"):
        scale *= rope.yarn_temperature(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return scale


def _per_head(x, w):
    """[b, s, heads, n] times each head's [heads, n, m] -> [b, s, heads, m]."""
    return ops.transpose(ops.matmul(ops.transpose(x, 1, 2), ops.unsqueeze(w, 0)), 1, 2)


def deinterleave(x):
    """The last dim's features as (even ones, odd ones)."""
    *lead, d = x.shape
    pairs = ops.reshape(x, (*lead, d // 2, 2))
    return ops.reshape(ops.transpose(pairs, -1, -2), (*lead, d))


class MLASelfAttention(nn.Module):
    recompute_policy = recompute.NONE  # as SelfAttention's
    layer_number = 0
    cache_key = None  # the KV cache's key when a layer holds two attentions (LongCat-Flash's), else its number

    def __init__(self, cfg, number: int | None = None):
        """``number``: the layer's (None: a multi-token prediction layer's), for sparse attention's
        layers that share another's choice of keys."""
        super().__init__()
        self.cfg = cfg
        mla, h, heads, std = cfg.mla, cfg.hidden_size, cfg.num_attention_heads, cfg.init_method_std
        bias = cfg.attention_output_bias  # DeepSeek's attention_bias: the down-projections' and the output's
        if mla.q_lora_rank is None:
            self.linear_q_proj = Linear(h, heads * mla.qk_head_dim, False, std)
        else:
            self.linear_q_down_proj = Linear(h, mla.q_lora_rank, bias, std)
            if cfg.qk_layernorm:
                self.q_layernorm = make_norm(cfg, mla.q_lora_rank)
            self.linear_q_up_proj = Linear(mla.q_lora_rank, heads * mla.qk_head_dim, False, std)
        self.linear_kv_down_proj = Linear(h, mla.kv_lora_rank + mla.qk_rope_head_dim, bias, std)
        if cfg.qk_layernorm:
            self.kv_layernorm = make_norm(cfg, mla.kv_lora_rank)
        self.linear_kv_up_proj = Linear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), False, std)
        if cfg.lora is not None and "linear_qkv" in cfg.lora.targets:  # MindSpeed-LLM's fused down-projections'
            self.linear_qkv = lora.FusedAdapter(h, mla.q_lora_rank + mla.kv_lora_rank + mla.qk_rope_head_dim, cfg.lora)
        out_std = std / math.sqrt(2.0 * cfg.num_layers)
        self.linear_proj = linear(cfg, "linear_proj", heads * mla.v_head_dim, h, bias, out_std)
        self.scale = softmax_scale(cfg)
        if mla.scale_q_lora or mla.scale_kv_lora:  # LongCat-Flash's
            self.q_lora_scale = math.sqrt(h / mla.q_lora_rank) if mla.q_lora_rank else 1.0
            self.kv_lora_scale = math.sqrt(h / mla.kv_lora_rank)
        if cfg.dsa is not None and cfg.dsa.runs_indexer(number):
            self.dsa_indexer = dsa.Indexer(cfg)
        # the last training forward's (sparse attention): its loss for the step's gradient, its KL for the log
        self.indexer_loss = self.indexer_kl = None

    def _down_adapter(self, x):
        """The fused down-projections' LoRA output split as the query latent's and the key/value
        latent's (with the rotated key), or (None, None)."""
        adapter = getattr(self, "linear_qkv", None)
        if adapter is None:
            return None, None
        mla = self.cfg.mla
        return ops.split(adapter(x), [mla.q_lora_rank, mla.kv_lora_rank + mla.qk_rope_head_dim], dim=-1)

    def _queries(self, x, low=None):
        """(the queries, the normed query latent or None)."""
        if self.cfg.mla.q_lora_rank is None:
            return self.linear_q_proj(x), None
        latent = self.linear_q_down_proj(x)
        if low is not None:
            latent = latent + low
        if self.cfg.qk_layernorm:
            latent = self.recompute_policy.norm_of(self.q_layernorm, latent)
        if self.cfg.mla.scale_q_lora:  # the indexer reads the latent unscaled
            return self.linear_q_up_proj(latent * self.q_lora_scale), latent
        return self.linear_q_up_proj(latent), latent

    def _rotate(self, x, cos, sin):
        if self.cfg.mla.rope_interleave:
            x = deinterleave(x)
        if "rope" in self.cfg.fused:
            features.note_used("fused-rope")
            return ops.apply_rotary(x, cos, sin)
        return composite.apply_rotary(x, cos, sin)

    def forward(self, x, cos, sin, seams=SINGLE_DEVICE, tokens=None):
        cfg, mla = self.cfg, self.cfg.mla
        groups, per_group = seams.heads(cfg)
        heads = groups * per_group  # this rank's
        features.note_used("multi-latent-attention")
        if mla.scale_q_lora or mla.scale_kv_lora:
            features.note_used("mla-lora-scaling")
        low_q, low_kv = self._down_adapter(x)
        q, q_latent = self._queries(x, low_q)
        b, s = q.shape[0], q.shape[1]  # the full sequence, also under sequence parallelism
        q_nope, q_rope = ops.split(ops.reshape(q, (b, s, heads, mla.qk_head_dim)),
                                   [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        combined = self.linear_kv_down_proj(x)
        if low_kv is not None:
            combined = combined + low_kv
        latent, k_rope = ops.split(combined, [mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        if cfg.qk_layernorm:
            latent = self.recompute_policy.norm_of(self.kv_layernorm, latent)
        if mla.scale_kv_lora:
            latent = latent * self.kv_lora_scale
        q_rope = self._rotate(q_rope, cos, sin)
        k_rope = self._rotate(ops.reshape(k_rope, (b, s, 1, mla.qk_rope_head_dim)), cos, sin)
        latent = ops.reshape(latent, (b, s, 1, mla.kv_lora_rank))
        if tokens is not None and tokens.cache is not None:  # the latents of every token so far
            latent, k_rope = tokens.cache.extend(self.cache_key or self.layer_number, latent, k_rope)
        sk = latent.shape[1]
        absorb = "mla_absorb" in cfg.fused
        if absorb:  # attention over the latent itself (MQA): the up-projection folded into q and the output
            features.note_used("mla-absorb")
            w_uk, w_uv = self._up_weights(heads)
            q = ops.cat([_per_head(q_nope, w_uk), q_rope], dim=-1)  # [b, s, heads, kv_lora_rank + rope]
            k, v = ops.cat([latent, k_rope], dim=-1), latent  # one key/value head of the latent
        else:
            kv = ops.reshape(self.linear_kv_up_proj(ops.reshape(latent, (b, sk, mla.kv_lora_rank))),
                             (b, sk, heads, mla.qk_nope_head_dim + mla.v_head_dim))
            k_nope, v = ops.split(kv, [mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
            q = ops.cat([q_nope, q_rope], dim=-1)
            k = ops.cat([k_nope, ops.expand(k_rope, (b, sk, heads, mla.qk_rope_head_dim))], dim=-1)
        p = cfg.attention_dropout if nn.is_training(self) else 0.0
        fused = "attention" in cfg.fused
        if fused:
            features.note_used("flash-attention")
        scores = layer_scores(cfg, self.layer_number, self.scale)
        keep = None if cfg.dsa is None else self._choose(x, q_latent, q, k, cos, sin, seams, tokens)

        def core(q, k, v):
            with seams.attention_rng():
                return seams.attention(q, k, v, p, fused, tokens, scores, keep=keep)

        out = self.recompute_policy.attention(core, q, k, v)
        if absorb:  # each head's latent output projected up to its value width
            out = _per_head(out, ops.transpose(w_uv, 1, 2))
        return self.linear_proj(ops.reshape(out, (b, s, heads * mla.v_head_dim)))

    def _up_weights(self, heads: int) -> tuple:
        """linear_kv_up_proj's weight as each head's (key, value) up-projections, [heads,
        qk_nope_head_dim, kv_lora_rank] and [heads, v_head_dim, kv_lora_rank] (this rank's heads)."""
        mla = self.cfg.mla
        w = ops.reshape(self.linear_kv_up_proj.weight, (heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank))
        return ops.split(w, [mla.qk_nope_head_dim, mla.v_head_dim], dim=1)

    def _choose(self, x, q_latent, q, k, cos, sin, seams, tokens):
        """Sparse attention's keys for each query (models/dsa.py): this layer's indexer's choice, or
        the one of the layer it shares (kept in ``tokens.choices`` for this forward); in
        training also the indexer's loss, times its coefficient and this rank's share."""
        cfg = self.cfg
        indexer = getattr(self, "dsa_indexer", None)
        self.indexer_loss = self.indexer_kl = None
        if indexer is None:
            features.note_used("dsa-shared-topk")
            return tokens.choices[cfg.dsa.source_of(self.layer_number)]
        cache = None if tokens is None else tokens.cache
        if cfg.fused & {"sparse_attention", "lightning_indexer"}:  # Ascend's kernels: the composite here
            features.note_used("sparse-flash-attention")
        scores = indexer(x, q_latent, cos, sin, cache, self.layer_number)
        allowed = dsa.allowed_keys(q.shape[1], k.shape[1], tokens)
        if cfg.dsa.dense_warmup:  # every key the attention may see, the indexer learning them all
            features.note_used("dsa-dense-warmup")
            keep, chosen = None, allowed
        else:
            keep = chosen = dsa.choose(scores, allowed, cfg.dsa.topk)
        if tokens is not None and tokens.choices is not None:
            tokens.choices[self.layer_number] = keep
        if cfg.dsa.loss_coeff and nn.is_training(self):
            kl = dsa.indexer_loss(q, k, self.scale, scores, chosen, seams.sum_over_heads)
            self.indexer_loss = kl * (cfg.dsa.loss_coeff * seams.replicated_loss_share())
            self.indexer_kl = autograd.detach(kl)  # the whole KL on every TP rank: the log's
        return keep
