"""Model configuration: one decoder-only transformer whose switches cover every family
(models/families/: each family's Hugging Face reading and writing and its presets)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from mindspeed_core.models import rope

FUSED_KERNELS = ("attention", "rms_norm", "swiglu", "rope", "grouped_matmul", "matmul_add", "gated_delta_rule",
                 "mla_absorb", "sparse_attention", "lightning_indexer")
# the MLP activations; the gated ones (fc1 holds gate rows, then up rows) first
GATED_ACTIVATIONS = ("swiglu", "geglu", "geglu_tanh", "quick_geglu")
ACTIVATIONS = GATED_ACTIVATIONS + ("gelu", "gelu_tanh", "squared_relu")


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP (Megatron's --num-experts and --moe-* flags): the router
    (models/router.py) sends each token to ``topk`` of ``num_experts`` experts."""

    num_experts: int = 8
    topk: int = 2
    ffn_hidden_size: int | None = None  # each expert's; None: the model's ffn_hidden_size
    score_function: str = "softmax"  # softmax | sigmoid
    norm_topk_prob: bool = True  # the chosen experts' weights renormalised to sum to 1
    num_groups: int | None = None  # group-limited routing (DeepSeek-V3): experts in groups,
    group_topk: int | None = None  # tokens choose among the best group_topk groups
    scaling_factor: float = 1.0  # routed weights times this (DeepSeek-V3's routed_scaling_factor)
    # aux_loss | seq_aux_loss | none | sparsemixer_topk (Phi-3.5-MoE's routing, router.sparsemixer:
    # top-2, no balancing loss; sparsemixer_eps is its jitter epsilon, transformers' router_jitter_noise)
    load_balancing_type: str = "aux_loss"
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    enable_expert_bias: bool = False  # aux-loss-free balancing: a bias on selection only
    bias_update_rate: float = 1e-3
    capacity_factor: float | None = None  # None: no token dropped
    pad_to_capacity: bool = False
    drop_policy: str = "probs"  # probs | position: which tokens over capacity are dropped
    shared_expert_size: int | None = None  # an MLP every token passes through (Qwen2-MoE, DeepSeek)
    shared_expert_gate: bool = False  # scaled by sigmoid(x . gate) (Qwen2-MoE)
    sparsemixer_eps: float = 0.01
    # training's noise on the router's input (--moe-input-jitter-eps; Phi-3.5-MoE's input_jitter_noise):
    # read and written, not built for training (the matrix's moe-input-jitter row); evaluation runs without it
    input_jitter_eps: float = 0.0
    # zero-computation experts (LongCat-Flash; MindSpeed-LLM's --num-zero-experts): this many more
    # router slots after the num_experts real ones, each returning its token times its weight
    zero_experts: int = 0

    @property
    def slots(self) -> int:
        """The router's outputs: the real experts, then the zero-computation ones."""
        return self.num_experts + self.zero_experts

    @property
    def sparsemixer(self) -> bool:
        return self.load_balancing_type == "sparsemixer_topk"

    @property
    def balanced(self) -> bool:
        """A load-balancing loss is added (aux_loss or seq_aux_loss, with a coefficient)."""
        return self.load_balancing_type in ("aux_loss", "seq_aux_loss") and self.aux_loss_coeff > 0

    def __post_init__(self):
        if type(self.num_experts) is not int or self.num_experts < 1:
            raise ValueError(f"num_experts must be a positive integer, got {self.num_experts!r}")
        if type(self.zero_experts) is not int or self.zero_experts < 0:
            raise ValueError(f"zero_experts must be a non-negative integer, got {self.zero_experts!r}")
        if type(self.topk) is not int or not 1 <= self.topk <= self.slots:
            raise ValueError(f"topk must be between 1 and the {self.slots} experts"
                             + (f" ({self.num_experts} real, {self.zero_experts} of zero computation)"
                                if self.zero_experts else "") + f", got {self.topk!r}")
        if self.zero_experts and (self.num_groups is not None or self.sparsemixer or self.capacity_factor is not None):
            raise ValueError("zero-computation experts with group-limited routing, SparseMixer or a capacity are not "
                             "built (LongCat-Flash routes by softmax top-k without them)")
        for name, allowed in (("score_function", ("softmax", "sigmoid")),
                              ("load_balancing_type", ("aux_loss", "seq_aux_loss", "none", "sparsemixer_topk")),
                              ("drop_policy", ("probs", "position"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.sparsemixer and (self.topk != 2 or self.score_function != "softmax" or self.num_groups is not None
                                 or self.enable_expert_bias or self.scaling_factor != 1.0):
            raise ValueError(f"sparsemixer_topk routes each token to 2 experts by its own softmax (no groups, expert "
                             f"bias or scaling); got topk {self.topk}")
        if not (isinstance(self.input_jitter_eps, (int, float)) and 0 <= self.input_jitter_eps < 1):
            raise ValueError(f"input_jitter_eps must be in [0, 1), got {self.input_jitter_eps!r}")
        if (self.num_groups is None) != (self.group_topk is None):
            raise ValueError("group-limited routing needs both num_groups and group_topk")
        if self.num_groups is not None:
            if self.num_experts % self.num_groups or not 1 <= self.group_topk <= self.num_groups:
                raise ValueError(f"{self.num_experts} experts do not split into {self.num_groups} groups of which "
                                 f"{self.group_topk} are chosen")
            if self.group_topk * (self.num_experts // self.num_groups) < self.topk:
                raise ValueError(f"the {self.group_topk} chosen groups hold fewer than topk {self.topk} experts")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be positive, got {self.capacity_factor!r}")
        if self.pad_to_capacity and self.capacity_factor is None:
            raise ValueError("pad_to_capacity needs a capacity_factor")
        for name in ("ffn_hidden_size", "shared_expert_size"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value <= 0):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


def interleaved_window_layers(num_layers: int) -> tuple:
    """The layers MindSpeed-LLM's --interleave-sliding-window gives a window (Gemma 2's): every
    other one from the first (its layer numbers 1, 3, 5, ... counted from one)."""
    return tuple(range(0, num_layers, 2))


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # Megatron's module names


# multi-latent attention's projections as megatron-core names them: split by head under tensor
# parallelism (up), or whole on every rank (down)
MLA_UP = ("linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj")
MLA_DOWN = ("linear_q_down_proj", "linear_kv_down_proj")


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3; models/mla.py), in Megatron's
    flags: keys and values come from one shared latent of ``kv_lora_rank`` features per token
    (--kv-lora-rank), queries straight from the hidden state or through a latent of their own
    (--q-lora-rank). Each head's query and key are ``qk_nope_head_dim`` features without
    position (--qk-head-dim) then ``qk_rope_head_dim`` rotated ones (--qk-pos-emb-head-dim;
    the key's shared by every head); its value has ``v_head_dim`` (--v-head-dim)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    # the rotated features stored in (even, odd) pairs, as DeepSeek's weights are (Megatron's
    # MLA regroups them as the model runs); False: halves, as in the other families
    rope_interleave: bool = True
    # LongCat-Flash's scalings (MindSpeed-LLM's --enable-mla-scale-q-lora / -kv-lora): the normed
    # query latent, and the normed key/value latent (not the rotated key), times sqrt(hidden / rank)
    scale_q_lora: bool = False
    scale_kv_lora: bool = False

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_lora_rank"):
            value = getattr(self, name)
            if (value is not None or name != "q_lora_rank") and (type(value) is not int or value <= 0):
                raise ValueError(f"multi-latent attention's {name} must be a positive integer, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim {self.qk_rope_head_dim}: RoPE rotates pairs of features")
        if self.scale_q_lora and self.q_lora_rank is None:
            raise ValueError("scale_q_lora scales the query latent: it needs a q_lora_rank")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class DSAConfig:
    """DeepSeek sparse attention (DeepSeek-V3.2, GLM-5; models/dsa.py) on top of multi-latent
    attention with a query latent, in MindSpeed-LLM's flags: a lightning indexer of
    ``n_heads`` heads of ``head_dim`` features (--index-n-heads, --index-head-dim) scores every
    earlier key, and each query attends to its ``topk`` best (--index-topk). The indexer learns
    from its own loss, KL(main attention over the chosen keys || its softmax over them), times
    ``loss_coeff`` (--indexer-loss-coeff). ``rope_interleave``: the indexer's rotated
    features stored in pairs (GLM-5's) or halves (DeepSeek-V3.2's). ``layer_types``: per layer
    "full" (its own indexer) or "shared" (the top-k of the nearest full layer before it: GLM-5's
    --index-topk-freq / --index-skip-topk-offset); None: every layer full. ``dense_warmup``:
    DeepSeek-V3.2's first stage (--indexer-dense-warmup): the attention sees every key, and the
    indexer learns from the loss over all of them (training then moves the indexers alone)."""

    topk: int = 2048
    n_heads: int = 64
    head_dim: int = 128
    loss_coeff: float = 0.0
    rope_interleave: bool = False
    layer_types: tuple | None = None
    dense_warmup: bool = False

    def __post_init__(self):
        for name in ("topk", "n_heads", "head_dim"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"sparse attention's {name} must be a positive integer, got {value!r}")
        if not isinstance(self.loss_coeff, (int, float)) or not math.isfinite(self.loss_coeff) or self.loss_coeff < 0:
            raise ValueError(f"the indexer loss coefficient must be a finite non-negative number, "
                             f"got {self.loss_coeff!r}")
        if self.dense_warmup and not self.loss_coeff:
            raise ValueError("the dense warm-up trains the indexers from their loss alone: an indexer loss "
                             "coefficient of 0 leaves nothing to train")
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            wrong = sorted({t for t in self.layer_types if t not in ("full", "shared")})
            if wrong:
                raise ValueError(f"indexer layer types are 'full' or 'shared', got {wrong}")
            if self.layer_types and self.layer_types[0] != "full":
                raise ValueError("the first layer shares the top-k of an earlier layer with an indexer, and there "
                                 "is none: it must be 'full'")

    def runs_indexer(self, number: int | None) -> bool:
        """Layer ``number`` chooses its own keys (None: a multi-token prediction layer, which does)."""
        return number is None or self.layer_types is None or number >= len(self.layer_types) \
            or self.layer_types[number] == "full"

    def source_of(self, number: int) -> int:
        """The layer whose choice of keys layer ``number`` uses (itself when it runs an indexer)."""
        while not self.runs_indexer(number):
            number -= 1
        return number

    def unsourced(self, numbers) -> str | None:
        """Why the layers ``numbers`` (a pipeline stage's) cannot run alone: the first that uses the
        choice of a layer they do not hold, or None."""
        for number in numbers:
            source = self.source_of(number)
            if source not in numbers:
                return (f"layer {number + 1} uses the top-k keys of layer {source + 1}, which this pipeline stage does "
                        f"not hold: start each stage with a layer that runs its indexer (--num-layer-list, "
                        f"--index-topk-freq, --index-skip-topk-offset)")
        return None


def indexer_layer_types(layers: int, freq: int, offset: int) -> tuple:
    """GLM-5's schedule (MindSpeed-LLM's --index-topk-freq, --index-skip-topk-offset; transformers'
    glm_moe_dsa reads the same keys): layer i (from 0) runs its indexer when
    max(i + 1 - offset, 0) is a multiple of ``freq``, else shares the last such layer's top-k."""
    if type(freq) is not int or freq < 1 or type(offset) is not int or offset < 0:
        raise ValueError(f"--index-topk-freq must be a positive integer and --index-skip-topk-offset a "
                         f"non-negative one, got {freq!r} and {offset!r}")
    return tuple("full" if max(i + 1 - max(offset, 1), 0) % freq == 0 else "shared" for i in range(layers))


@dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters on the decoder's linear layers (models/lora.py; --lora-* flags)."""

    r: int
    alpha: float
    dropout: float = 0.0
    targets: tuple = LORA_TARGETS

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(self.targets))
        if type(self.r) is not int or self.r < 1:
            raise ValueError(f"the LoRA rank must be a positive integer, got {self.r!r}")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets:
            raise ValueError(f"LoRA target modules {unknown or '(none)'}: choose among {', '.join(LORA_TARGETS)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"the LoRA dropout must be in [0, 1), got {self.dropout}")

    @property
    def scale(self) -> float:
        return self.alpha / self.r


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet layers (models/gated_deltanet.py): transformers' linear_* keys, MindSpeed-LLM's
    --linear-* flags, --mamba-d-conv (the convolution's width) and --mamba-chunk-size (the chunk of
    the training form; the values do not depend on it)."""
    key_heads: int = 4
    value_heads: int = 8
    key_dim: int = 32
    value_dim: int = 32
    conv_kernel: int = 4
    chunk_size: int = 64

    def __post_init__(self):
        for name in ("key_heads", "value_heads", "key_dim", "value_dim", "conv_kernel", "chunk_size"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"linear attention's {name} must be a positive integer, got {value!r}")
        if self.value_heads % self.key_heads:
            raise ValueError(f"linear attention's {self.value_heads} value heads do not divide among its "
                             f"{self.key_heads} key heads")

    def sections(self) -> tuple[tuple, tuple]:
        """(in_proj's row sections: q, k, v, z, b, a; the convolution's channel sections: q, k, v).
        Tensor parallelism cuts each in equal slices (megatron-core's GatedDeltaNet holds them so)."""
        qk, v = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        return (qk, qk, v, v, self.value_heads, self.value_heads), (qk, qk, v)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    hidden_size: int = 128
    num_layers: int = 2
    num_attention_heads: int = 4
    num_query_groups: int | None = None  # kv heads (GQA/MQA); None: same as attention heads
    ffn_hidden_size: int | None = None  # None: 4h (gelu) or the LLaMA rule (swiglu)
    kv_channels: int | None = None  # head dim; None: hidden / heads
    max_position_embeddings: int = 256
    normalization: str = "rmsnorm"  # rmsnorm | layernorm
    norm_epsilon: float = 1e-5
    # swiglu | geglu | geglu_tanh (gated: gelu or its tanh form) | quick_geglu (gated: x sigmoid(1.702 x),
    # GPT-OSS's) | gelu | gelu_tanh | squared_relu (relu(x)^2, PLM's: Megatron's --squared-relu)
    activation: str = "swiglu"
    # Megatron's glu_linear_offset and activation_func_clamp_value (GPT-OSS: 1 and 7): a gated
    # MLP computes act(min(gate, c)) * (clip(up, -c, c) + offset)
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: float | None = None
    position_embedding_type: str = "rope"  # rope | learned
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0  # the share of each head's features RoPE rotates (the first ones; GLM-4.5: 0.5)
    rope_scaling: dict | None = None  # {"rope_type": linear|llama3|yarn|dynamic|longrope, "factor": ..., ...} (models/rope.py)
    add_qkv_bias: bool = False
    # biases on the attention output and the MLP (Megatron's switch; an MoE layer's router and
    # experts too, as megatron-core's)
    add_bias_linear: bool = False
    attention_output_bias: bool | None = None  # None: as add_bias_linear (Llama's attention_bias without mlp_bias)
    output_layer_bias: bool = False  # a bias on the untied output layer (Phi-3.5-MoE's lm_head.bias)
    qk_layernorm: bool = False  # with mla: the norms of the query and key/value latents
    # the q/k RMSNorms over all heads of the layer at once (MiniMax-M2: weights of the queries' and the
    # keys' whole width, one mean square over it), not over each head
    qk_norm_across_heads: bool = False
    # multi-head latent attention instead of linear_qkv (DeepSeek); kv_channels is then the
    # query/key head dim and every head has its own key and value
    mla: MLAConfig | None = None
    dsa: DSAConfig | None = None  # sparse attention on the latent attention (DeepSeek-V3.2, GLM-5)
    # LongCat-Flash's layer (models/longcat.py): two latent attentions each followed by a dense MLP,
    # the MoE fed beside the first MLP and added at the layer's end
    shortcut_moe: bool = False
    # Gemma's switches (MindSpeed-LLM's flags in brackets): RMSNorm weights held as offsets from
    # one, x * (1 + w) [--add-rmsnorm-offset]; a norm after attention and after the MLP, before
    # each residual add [--post-norm]; embeddings times sqrt(hidden) [--input-embeds-norm];
    # scores scaled by query_pre_attn_scalar ** -0.5 instead of the head dim's; tanh
    # soft-capping cap * tanh(x / cap) of attention scores and of the output logits
    norm_offset: bool = False
    post_norm: bool = False
    scale_embeddings: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # MiniCPM's scalings (its config's names; MindSpeed-LLM's flags --scale-emb, --scale-depth,
    # --dim-model-base): embeddings times scale_emb, each residual branch times
    # scale_depth / sqrt(layers, no-op ones not counted), the final norm's output divided by
    # hidden / dim_model_base
    scale_emb: float | None = None
    scale_depth: float | None = None
    dim_model_base: float | None = None
    # sliding-window attention: a query sees itself and the sliding_window - 1 tokens before it,
    # in the layers numbered in sliding_window_layers (None: every layer; Gemma 2: every other)
    sliding_window: int | None = None
    sliding_window_layers: tuple | None = None
    # Gemma 3: the sliding-window layers rotate with this base and no scaling (None: as the others)
    local_rotary_base: float | None = None
    # attention sinks (GPT-OSS; Megatron's --softmax-type learnable): a learned logit per head
    # joins each query's softmax as one more key with no value, so a head may attend to nothing
    attention_sinks: bool = False
    # gated attention (Qwen3-Next; megatron-core's attention_output_gate): linear_qkv also makes a
    # gate per query head, and each head's output is times sigmoid(gate) before linear_proj
    attention_output_gate: bool = False
    # linear-attention hybrids (Qwen3-Next, Qwen3.5): gated DeltaNet in place of self-attention in
    # the layers numbered in linear_layers (None: every layer)
    linear_attention: LinearAttentionConfig | None = None
    linear_layers: tuple | None = None
    untie_embeddings_and_output_weights: bool = True
    init_method_std: float = 0.02
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    # MindSpeed's --noop-layers: positions among the num_layers that hold an identity layer
    # (no parameters), so that the layer count divides over pipeline stages
    noop_layers: tuple = ()
    family: str = "llama"  # a family of models/families/
    # mixture of experts: the MLP of the layers numbered in moe_layers (None: every layer)
    moe: MoEConfig | None = None
    moe_layers: tuple | None = None
    # low-rank adapters on the linear layers (models/lora.py; --lora-r and friends)
    lora: LoRAConfig | None = None
    # an outcome reward model: a scalar head (rm_head, [1, hidden]) where the output layer
    # would be; its value at a reply's last token is the reply's reward (--stage orm)
    reward_head: bool = False
    # multi-token prediction (DeepSeek-V3, --mtp-num-layers): modules after the last layer that
    # predict the tokens 2..1+mtp_num_layers ahead (models/mtp.py); their loss, times
    # mtp_loss_scaling_factor / mtp_num_layers, joins the gradient
    mtp_num_layers: int = 0
    mtp_loss_scaling_factor: float = 0.1
    extra: dict = field(default_factory=dict)  # family-specific fields kept for export
    # Which fused kernels the layers call (ops.<op>: the device's native kernel, or the
    # composite where it has none; the flags --use-flash-attn, --use-fused-*); the others
    # run mindspeed_core.composite. How the math runs, not what it is: not saved, not compared.
    fused: frozenset = field(default_factory=frozenset, compare=False)
    # --rmsnorm-weight-in-fp32: a plain RMSNorm scales by its weight in float32 and casts after (the
    # offset norms always compute so); how the math runs, not saved, not compared
    norm_weight_float32: bool = field(default=False, compare=False)
    # --router-gating-in-fp32: the MoE routers' linear on float32 copies of its input and weight
    # (else in the model's dtype, the logits cast after); how the math runs, as above
    router_float32: bool = field(default=False, compare=False)

    def __post_init__(self):
        # frozen once built: the checks below, and the derived defaults filled here (with
        # object.__setattr__), are the only writes; a changed configuration is a new one
        # (dataclasses.replace runs them again)
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
                     "ffn_hidden_size", "kv_channels", "max_position_embeddings"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value <= 0):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.rope_scaling is not None:
            wrong = rope.problem(self.rope_scaling) if isinstance(self.rope_scaling, dict) else "must be a dict"
            if wrong:
                raise ValueError(f"rope_scaling: {wrong}")
        for name, low, high in (("attention_dropout", 0, 1), ("hidden_dropout", 0, 1)):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not low <= value < high:
                raise ValueError(f"{name} must be in [{low}, {high}), got {value!r}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "scale_emb",
                     "scale_depth", "dim_model_base"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0):
                raise ValueError(f"{name} must be a positive number or None, got {value!r}")
        if not isinstance(self.glu_linear_offset, (int, float)) or not math.isfinite(self.glu_linear_offset):
            raise ValueError(f"glu_linear_offset must be a finite number, got {self.glu_linear_offset!r}")
        clamp = self.activation_func_clamp_value
        if clamp is not None and (not isinstance(clamp, (int, float)) or not math.isfinite(clamp) or clamp <= 0):
            raise ValueError(f"activation_func_clamp_value must be a positive number or None, got {clamp!r}")
        if self.sliding_window is not None and (type(self.sliding_window) is not int or self.sliding_window <= 0):
            raise ValueError(f"sliding_window must be a positive integer or None, got {self.sliding_window!r}")
        if self.sliding_window_layers is not None:
            if self.sliding_window is None:
                raise ValueError("sliding_window_layers without a sliding_window")
            object.__setattr__(self, "sliding_window_layers",
                               tuple(sorted({int(i) for i in self.sliding_window_layers})))
            if any(not 0 <= i < self.num_layers for i in self.sliding_window_layers):
                raise ValueError(f"sliding_window_layers {list(self.sliding_window_layers)} must be among the layers "
                                 f"0..{self.num_layers - 1}")
        if self.qk_norm_across_heads and not self.qk_layernorm:  # how the norms run, without norms: none
            object.__setattr__(self, "qk_norm_across_heads", False)
        if self.qk_norm_across_heads and not (self.mla is None and self.normalization == "rmsnorm"):
            raise ValueError("qk_norm_across_heads normalises the q/k projections of grouped-query attention with "
                             "RMSNorm over all heads: it needs rmsnorm and no multi-latent attention")
        if self.local_rotary_base is not None:
            if not isinstance(self.local_rotary_base, (int, float)) or not self.local_rotary_base > 0:
                raise ValueError(f"local_rotary_base must be a positive number, got {self.local_rotary_base!r}")
            if self.sliding_window is None:
                raise ValueError("local_rotary_base is the sliding-window layers' RoPE base: it needs a sliding_window")
        if self.norm_offset and self.normalization != "rmsnorm":
            raise ValueError("norm_offset (weights as offsets from one) is for RMSNorm only")
        for name in ("norm_epsilon", "rotary_base", "init_method_std"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite non-negative number, got {value!r}")
        try:
            object.__setattr__(self, "noop_layers", tuple(sorted({int(i) for i in self.noop_layers})))
        except (TypeError, ValueError):
            raise ValueError(f"noop_layers must be layer numbers, got {self.noop_layers!r}") from None
        if any(not 0 <= i < self.num_layers for i in self.noop_layers) or len(self.noop_layers) >= self.num_layers:
            raise ValueError(f"noop_layers {list(self.noop_layers)} must be some, not all, of the layers "
                             f"0..{self.num_layers - 1}")
        if type(self.mtp_num_layers) is not int or self.mtp_num_layers < 0:
            raise ValueError(f"mtp_num_layers must be a non-negative integer, got {self.mtp_num_layers!r}")
        if (not isinstance(self.mtp_loss_scaling_factor, (int, float)) or not math.isfinite(self.mtp_loss_scaling_factor)
                or self.mtp_loss_scaling_factor < 0):
            raise ValueError(f"mtp_loss_scaling_factor must be a finite non-negative number, "
                             f"got {self.mtp_loss_scaling_factor!r}")
        if self.mtp_num_layers and self.reward_head:
            raise ValueError("multi-token prediction predicts tokens: a reward model has no output layer for it")
        if self.mtp_num_layers and self.position_embedding_type == "learned":
            raise ValueError("multi-token prediction with learned position embeddings is not built (DeepSeek-V3 "
                             "and GLM-4.5 use RoPE)")
        if isinstance(self.moe, dict):  # from to_dict / a saved config
            object.__setattr__(self, "moe", MoEConfig(**self.moe))
        if isinstance(self.lora, dict):
            object.__setattr__(self, "lora", LoRAConfig(**self.lora))
        if isinstance(self.mla, dict):
            object.__setattr__(self, "mla", MLAConfig(**self.mla))
        if isinstance(self.dsa, dict):
            object.__setattr__(self, "dsa", DSAConfig(**self.dsa))
        if self.shortcut_moe and (self.mla is None or self.moe is None or self.moe_layers is not None
                                  or self.mtp_num_layers or self.dsa is not None):
            raise ValueError("the shortcut-connected MoE layer (LongCat-Flash) has latent attention and an MoE in "
                             "every layer, without multi-token prediction or sparse attention")
        if self.dsa is not None:
            if self.mla is None or self.mla.q_lora_rank is None:
                raise ValueError("sparse attention's indexer reads the query latent: it needs multi-latent attention "
                                 "with --q-lora-rank")
            if self.dsa.head_dim < self.mla.qk_rope_head_dim:
                raise ValueError(f"the indexer rotates qk_rope_head_dim {self.mla.qk_rope_head_dim} of its "
                                 f"--index-head-dim {self.dsa.head_dim} features: it needs at least as many")
            if self.dsa.layer_types is not None and len(self.dsa.layer_types) != self.num_layers:
                raise ValueError(f"{len(self.dsa.layer_types)} indexer layer types for {self.num_layers} layers")
            if self.dsa.dense_warmup and self.lora is not None:
                raise ValueError("the dense warm-up trains the indexers alone, and LoRA only its adapters: one "
                                 "stage at a time (drop --lora-r / --lora-target-modules or --indexer-dense-warmup)")
        if isinstance(self.linear_attention, dict):
            object.__setattr__(self, "linear_attention", LinearAttentionConfig(**self.linear_attention))
        if self.linear_layers is not None:
            if self.linear_attention is None:
                raise ValueError("linear_layers without a linear_attention config")
            object.__setattr__(self, "linear_layers", tuple(sorted({int(i) for i in self.linear_layers})))
            if any(not 0 <= i < self.num_layers for i in self.linear_layers):
                raise ValueError(f"linear_layers {list(self.linear_layers)} must be among the layers "
                                 f"0..{self.num_layers - 1}")
        if self.linear_attention is not None and self.mla is not None:
            raise ValueError("linear attention layers beside multi-latent attention are not built")
        if self.mla is not None:
            for name, value in (("kv_channels", self.mla.qk_head_dim), ("num_query_groups", self.num_attention_heads)):
                if getattr(self, name) not in (None, value):
                    raise ValueError(f"multi-latent attention has {name} {value} (each head its own key and value, "
                                     f"of qk_nope_head_dim + qk_rope_head_dim features), got {getattr(self, name)}")
                object.__setattr__(self, name, value)
            # MindSpeed-LLM's latent attention fuses the down-projections into one linear_qkv that LoRA
            # adapts as one layer (models/lora.py FusedAdapter); without a query latent its linear_qkv
            # holds the query projection too, which is not built (features: lora-latent-attention-qkv)
            if self.lora is not None and "linear_qkv" in self.lora.targets and self.mla.q_lora_rank is None:
                raise ValueError("LoRA's linear_qkv target on multi-latent attention without a query latent "
                                 "(--q-lora-rank) is not built: --lora-target-modules linear_proj linear_fc1 "
                                 "linear_fc2 (lora-latent-attention-qkv)")
            if self.position_embedding_type != "rope" or self.rotary_percent != 1.0:
                raise ValueError("multi-latent attention rotates its qk_rope_head_dim features: it needs rope "
                                 "position embeddings and no rotary_percent")
        if self.moe_layers is not None:
            if self.moe is None:
                raise ValueError("moe_layers without a moe config")
            object.__setattr__(self, "moe_layers", tuple(sorted({int(i) for i in self.moe_layers})))
            if any(not 0 <= i < self.num_layers for i in self.moe_layers):
                raise ValueError(f"moe_layers {list(self.moe_layers)} must be among the layers 0..{self.num_layers - 1}")
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.attention_output_bias is None:
            object.__setattr__(self, "attention_output_bias", self.add_bias_linear)
        if self.output_layer_bias and not self.untie_embeddings_and_output_weights:
            raise ValueError("output_layer_bias needs an output layer of its own (untie_embeddings_and_output_weights)")
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden size {self.hidden_size} is not divisible by {self.num_attention_heads} heads")
            object.__setattr__(self, "kv_channels", self.hidden_size // self.num_attention_heads)
        if not isinstance(self.rotary_percent, (int, float)) or not 0 < self.rotary_percent <= 1:
            raise ValueError(f"rotary_percent must be in (0, 1], got {self.rotary_percent!r}")
        if self.rotary_dim % 2 or self.rotary_dim == 0:
            raise ValueError(f"rotary_percent {self.rotary_percent} of {self.kv_channels} head features is "
                             f"{self.kv_channels * self.rotary_percent:g}: RoPE needs a positive even count")
        scaling = self.rope_scaling or {}
        for key in ("short_factor", "long_factor"):  # longrope: one factor per rotary frequency
            if key in scaling and len(scaling[key]) != self.rotary_dim // 2:
                raise ValueError(f"rope_scaling's {key} holds {len(scaling[key])} numbers; heads of "
                                 f"{self.rotary_dim} rotated dimensions rotate at {self.rotary_dim // 2} frequencies")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"{self.num_attention_heads} attention heads do not divide into "
                             f"{self.num_query_groups} query groups")
        if self.ffn_hidden_size is None:
            if self.gated:  # LLaMA: 2/3 of 4h, rounded up to a multiple of 64
                object.__setattr__(self, "ffn_hidden_size", 64 * ((int(8 * self.hidden_size / 3) + 63) // 64))
            else:
                object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        object.__setattr__(self, "fused", frozenset(self.fused))
        if not self.fused <= set(FUSED_KERNELS):
            raise ValueError(f"fused kernels must be among {FUSED_KERNELS}, got {sorted(self.fused)}")
        from mindspeed_core.models.families import FAMILIES  # they are built of this module's configs

        for name, allowed in (("normalization", ("rmsnorm", "layernorm")), ("activation", ACTIVATIONS),
                              ("position_embedding_type", ("rope", "learned")), ("family", tuple(FAMILIES))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if (self.glu_linear_offset or self.activation_func_clamp_value is not None) and not self.gated:
            raise ValueError(f"glu_linear_offset and activation_func_clamp_value act on a gated MLP's halves: "
                             f"activation {self.activation} is not gated")
        if self.attention_sinks and self.mla is not None:
            raise ValueError("attention sinks with multi-latent attention are not built")
        if self.moe is not None and self.moe.shared_expert_size and self.add_bias_linear:
            raise ValueError("add_bias_linear with a shared expert: biases on shared experts are not built")

    @property
    def rotary_dim(self) -> int:
        """How many of each head's features RoPE rotates (the first ones; with multi-latent
        attention the last qk_rope_head_dim)."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(round(self.kv_channels * self.rotary_percent))

    @property
    def gated(self) -> bool:
        """Whether the MLP is gated (fc1: gate rows, then up rows; twice the ffn width)."""
        return self.activation in GATED_ACTIVATIONS

    def is_linear_layer(self, number: int) -> bool:
        """Layer ``number`` runs gated DeltaNet instead of self-attention (multi-token prediction's
        layers, numbered on from num_layers, attend)."""
        return (self.linear_attention is not None and number < self.num_layers
                and (self.linear_layers is None or number in self.linear_layers))

    def rotates_locally(self, number: int) -> bool:
        """Whether layer ``number`` takes the local RoPE tables (Gemma 3's sliding layers)."""
        return self.local_rotary_base is not None and self.window_of(number) is not None

    def window_of(self, number: int) -> int | None:
        """Layer ``number``'s sliding window (None: it attends to every earlier token)."""
        if self.sliding_window_layers is None or number in self.sliding_window_layers:
            return self.sliding_window
        return None

    def renumbered(self, number: dict, num_layers: int, noop_layers: tuple) -> "ModelConfig":
        """This config with its layers renumbered by ``number`` {old: new} (the layers it leaves
        out dropped from the per-layer sets), ``num_layers`` and ``noop_layers`` in all."""
        def moved(layers):
            return None if layers is None else tuple(number[i] for i in layers if i in number)

        dsa = self.dsa
        if dsa is not None and dsa.layer_types is not None:  # a no-op layer passes the choice before it on
            types = ["shared"] * num_layers
            for old, new in number.items():
                types[new] = dsa.layer_types[old]
            dsa = dataclasses.replace(dsa, layer_types=("full", *types[1:]))
        return dataclasses.replace(self, num_layers=num_layers, noop_layers=noop_layers,
                                   moe_layers=moved(self.moe_layers),
                                   sliding_window_layers=moved(self.sliding_window_layers),
                                   linear_layers=moved(self.linear_layers), dsa=dsa)

    def moe_layer_numbers(self) -> list[int]:
        """The numbers of the layers that run an MoE MLP (no-op layers run none), the
        multi-token prediction layers' (numbered on from num_layers) among them."""
        return [i for i in range(self.num_layers + self.mtp_num_layers)
                if self.is_moe_layer(i) and i not in self.noop_layers]

    def is_moe_layer(self, number: int) -> bool:
        """Layer ``number``'s MLP is an MoE layer; a multi-token prediction layer's is when the
        last real layer's is (DeepSeek-V3's is)."""
        if number >= self.num_layers:
            number = max(i for i in range(self.num_layers) if i not in self.noop_layers)
        return self.moe is not None and (self.moe_layers is None or number in self.moe_layers)

    @property
    def tied_output(self) -> bool:
        """Whether the output layer is the word embeddings (a reward model has no output layer)."""
        return not self.untie_embeddings_and_output_weights and not self.reward_head

    @property
    def last_stage_embeddings(self) -> bool:
        """Whether a last pipeline stage without the embedding holds a copy of the word
        embeddings, summed with the first stage's gradient: as its output layer (tied), or for
        multi-token prediction's input."""
        return self.tied_output or self.mtp_num_layers > 0

    @property
    def qkv_width(self) -> int:
        """linear_qkv's output rows: the query heads (and their gates), a key and a value per group."""
        heads = self.num_attention_heads * (2 if self.attention_output_gate else 1)
        return (heads + 2 * self.num_query_groups) * self.kv_channels

    def linear_layer_count(self) -> int:
        return sum(self.is_linear_layer(i) for i in range(self.num_layers) if i not in self.noop_layers)

    def _linear_attention_weights(self) -> int:
        """A gated DeltaNet layer's matrix entries (in_proj, out_proj)."""
        la, h = self.linear_attention, self.hidden_size
        qk, v = la.key_heads * la.key_dim, la.value_heads * la.value_dim
        return h * (2 * qk + 2 * v + 2 * la.value_heads) + v * h

    def _linear_attention_parameters(self) -> int:
        la = self.linear_attention
        conv = (2 * la.key_heads * la.key_dim + la.value_heads * la.value_dim) * la.conv_kernel
        return self._linear_attention_weights() + conv + 2 * la.value_heads + la.value_dim

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        del out["fused"], out["norm_weight_float32"], out["router_float32"]
        return out

    @classmethod
    def from_dict(cls, values: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown model config fields: {', '.join(unknown)}")
        return cls(**values)

    @property
    def real_layers(self) -> int:
        """Layers that compute something (no-op layers excluded)."""
        return self.num_layers - len(self.noop_layers)

    def num_parameters(self) -> int:
        h, f, L, v = self.hidden_size, self.ffn_hidden_size, self.real_layers, self.vocab_size
        norm = h * (2 if self.normalization == "layernorm" else 1)
        norms_per_layer = 4 if self.post_norm else 2
        attn = self._attention_parameters()
        fc1 = (2 * f if self.gated else f)
        mlp = h * fc1 + f * h + ((fc1 + h) if self.add_bias_linear else 0)
        total = L * (attn + mlp + norms_per_layer * norm) + norm + v * h
        if self.linear_attention is not None:
            total += self.linear_layer_count() * (self._linear_attention_parameters() - attn)
        moe_layers = sum(self.is_moe_layer(i) for i in range(self.num_layers) if i not in self.noop_layers)
        if moe_layers:
            total += moe_layers * (self._moe_mlp_parameters(active=False) - mlp)
        total += h if self.reward_head else v * h if self.untie_embeddings_and_output_weights else 0
        total += v if self.output_layer_bias and not self.reward_head else 0
        total += self.max_position_embeddings * h if self.position_embedding_type == "learned" else 0
        if self.mtp_num_layers:  # each: a layer like the last, its three norms and eh_proj [h, 2h]
            layer_mlp = self._moe_mlp_parameters(active=False) if self.is_moe_layer(self.num_layers) else mlp
            total += self.mtp_num_layers * (attn + layer_mlp + (norms_per_layer + 3) * norm + 2 * h * h)
        if self.shortcut_moe:  # a second attention and two dense MLPs beside the MoE, four norms
            total += L * (attn + 2 * mlp + norms_per_layer * norm)
        if self.dsa is not None:  # an indexer in each layer that runs one and in each MTP layer
            dsa = self.dsa
            indexers = sum(dsa.runs_indexer(i) for i in range(self.num_layers) if i not in self.noop_layers)
            # wq_b [n d, q_lora_rank], wk [d, h], k_norm's weight and bias, weights_proj [n, h]
            total += (indexers + self.mtp_num_layers) * (self.mla.q_lora_rank * dsa.n_heads * dsa.head_dim
                                                         + h * dsa.head_dim + 2 * dsa.head_dim + h * dsa.n_heads)
        return total

    def _attention_weights(self) -> int:
        """The attention's matrix entries in one layer (what its matmuls multiply by)."""
        h, heads, mla = self.hidden_size, self.num_attention_heads, self.mla
        if mla is None:
            return h * self.qkv_width + heads * self.kv_channels * h
        q = heads * mla.qk_head_dim
        return ((h * q if mla.q_lora_rank is None else (h + q) * mla.q_lora_rank)
                + h * (mla.kv_lora_rank + mla.qk_rope_head_dim)
                + mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim) + heads * mla.v_head_dim * h)

    def _attention_parameters(self) -> int:
        attn = self._attention_weights() + (self.hidden_size if self.attention_output_bias else 0)
        attn += self.num_attention_heads if self.attention_sinks else 0
        if self.mla is None:
            attn += self.qkv_width if self.add_qkv_bias else 0
            if self.qk_layernorm:
                heads_normed = (self.num_attention_heads + self.num_query_groups) if self.qk_norm_across_heads else 2
                attn += heads_normed * self.kv_channels
        else:  # DeepSeek's attention_bias: the down-projections' too; the latents' norms
            latents = self.mla.kv_lora_rank + (self.mla.q_lora_rank or 0)
            attn += (latents + self.mla.qk_rope_head_dim) if self.attention_output_bias else 0
            attn += latents if self.qk_layernorm else 0
        return attn

    def training_bytes(self) -> int:
        """Host/device bytes one unsharded fp32 training process needs at least: parameters,
        gradients and two AdamW moments (activations come on top)."""
        return 16 * self.num_parameters()

    def flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs per token (forward + backward = 3x forward), matmuls and attention."""
        h, L = self.hidden_size, self.real_layers
        attn_width = self.num_attention_heads * self.kv_channels
        fc1 = (2 if self.gated else 1) * self.ffn_hidden_size
        per_layer = 2 * (self._attention_weights() + h * fc1 + self.ffn_hidden_size * h)
        per_layer += 2 * 2 * seq_length * attn_width  # QK^T and PV (MLA: PV narrower, counted as wide)
        moe_layers = sum(self.is_moe_layer(i) for i in range(self.num_layers) if i not in self.noop_layers)
        # an MoE layer computes its router and the k experts each token goes to, not the dense MLP
        dense_mlp = h * fc1 + self.ffn_hidden_size * h
        extra = 2 * moe_layers * (self._moe_mlp_parameters(active=True) - dense_mlp) if moe_layers else 0
        if self.linear_attention is not None:  # in_proj and out_proj, and the chunks' products in place of QK^T, PV
            la = self.linear_attention
            linear = 2 * self._linear_attention_weights() + 2 * 2 * 2 * la.chunk_size * la.value_heads * la.value_dim
            extra += self.linear_layer_count() * (linear - 2 * self._attention_weights() - 2 * 2 * seq_length * attn_width)
        head = 2 * h * (1 if self.reward_head else self.vocab_size)
        # each multi-token prediction module: a layer, eh_proj [h, 2h] and the output layer again
        mtp = self.mtp_num_layers * (per_layer + 2 * 2 * h * h + head)
        if self.mtp_num_layers and self.is_moe_layer(self.num_layers):
            mtp += self.mtp_num_layers * 2 * (self._moe_mlp_parameters(active=True) - dense_mlp)
        return 3.0 * (L * per_layer + extra + head + mtp)

    def _moe_mlp_parameters(self, active: bool) -> int:
        """An MoE layer's MLP parameters (router with its expert bias, experts, shared expert);
        with ``active`` only the k experts a token uses."""
        moe, h = self.moe, self.hidden_size
        per_width = 2 if self.gated else 1
        f = moe.ffn_hidden_size or self.ffn_hidden_size
        expert = h * per_width * f + f * h + ((per_width * f + h) if self.add_bias_linear else 0)
        router = (h + (1 if moe.enable_expert_bias else 0) + (1 if self.add_bias_linear else 0)) * moe.slots
        total = router + (moe.topk if active else moe.num_experts) * expert  # (zero experts hold nothing)
        if moe.shared_expert_size:
            s = moe.shared_expert_size
            total += h * per_width * s + s * h + (h if moe.shared_expert_gate else 0)
        return total
