"""``mindspeed plan``: choose the parallel layout of a training run before running it (the idea
of MindSpeed's auto-settings), for this implementation.

Given the model (a preset, model flags, or a Hugging Face folder), the sequence length and
global batch size, a device count and each device's memory and speed, it enumerates tensor,
pipeline, context, expert and data parallel sizes, the micro-batch size, activation recompute
(none, selective, full) and the distributed optimizer; keeps the layouts the trainer accepts
(its own configuration check) and that fit in memory; and ranks them by predicted step time.
Each line ends in the exact ``mindspeed launch`` command.

Memory per device, on the most loaded pipeline stage: the framework's own resident memory
(measured by the probe); this rank's parameters (TP cuts the linear layers, EP the experts, PP
the layers; the first stage holds the embedding, the last the output layer or, when tied and
PP > 1, its copy) as weights, with two AdamW moments (a master copy for 16-bit weights; the
distributed optimizer keeps master, moments and its masks for 1/DP of them); what building the
whole model on every rank before cutting it leaves in the allocator; and the larger of the
step's two peaks: at the loss (activations per Korthikanti et al. 2022 on s/CP tokens, cut by TP
with sequence parallelism on, under the recompute policy, the first stage holding min(PP,
micro-batches) micro-batches, or one where the framework records a pipeline forward again at
its backward; the last stage's logits) and after the backward (the gradients in the copies this
trainer holds). The counts of copies differ by framework and are read off this machine
(StepCounts; benchmarks/bench_plan.py).
Step time: the step's matmul and attention FLOPs on this rank (full recompute adds a forward,
selective the attention scores) over the measured matmul rate at the layout's matrix shapes;
element-wise passes over the activations and logits at the measured element-wise rate; the
pipeline bubble ((PP - 1) micro-batch slots); the collectives: the analytical bytes of
parallel/traffic.py for TP, SP and DP (and the pipeline's, CP's and EP's exchanges), each kind
at the framework's own rate and cost per call, measured on two local ranks (emulated
collectives included); and the distributed optimizer's extra passes. Nothing overlaps (as in
this trainer).

On the CPU device the "devices" are processes sharing the host's cores: the probe measures the
host's matmul rate (at each layout's shape) and each of N ranks gets 1/N of it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import shlex
import time

from mindspeed_core import device, dist, launcher, ops, runtime
from mindspeed_core.backends.common import host_memory_stats
from mindspeed_core.compat import megatron_args
from mindspeed_core.errors import MindSpeedError
from mindspeed_core.memory.accounting import estimated_peak_bytes
from mindspeed_core.memory.recompute import Recompute
from mindspeed_core.parallel import pipeline, traffic
from mindspeed_core.training import configuration, schedules
from mindspeed_core.training.optimizer import moment_bytes

GIB = 2**30


@dataclasses.dataclass
class Machine:
    devices: int
    memory_bytes: float  # per device
    matmul_flops: dict  # (m, k, n) -> FLOP/s one device reaches on that shape
    peak_flops: float  # per device, the big-matmul rate (shapes not probed fall back to it)
    link_bytes_per_s: float  # an all-reduce's payload per second between two devices
    link_latency_s: float  # and its cost per call
    baseline_bytes: float  # a bound framework process before any model
    framework: str = "pytorch"  # whose StepCounts the predictions use
    # {collective: (seconds per call, payload bytes per second)} between two devices, measured;
    # None: every collective on a ring of the link above
    collectives: dict | None = None
    elementwise_rate: float = 1e9  # float32 elements per second of one element-wise operator

    def counts(self) -> "StepCounts":
        return COUNTS.get(self.framework, COUNTS["pytorch"])

    def collective_seconds(self, op: str, payload: float, group: int, calls: float = 0) -> float:
        """``calls`` calls of ``op`` over ``group`` members moving ``payload`` bytes in all."""
        if group <= 1:
            return 0.0
        if self.collectives is not None:
            latency, rate = self.collectives[op]
        else:
            latency, rate = self.link_latency_s, self.link_bytes_per_s / ring_factor(op, 2)
        return calls * latency + payload * ring_factor(op, group) / ring_factor(op, 2) / rate

    def rate(self, m: int, k: int, n: int) -> float:
        return self.matmul_flops.get((m, k, n), self.peak_flops)


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    cp: int = 1
    ep: int = 1
    mbs: int = 1
    recompute: str = "none"  # none, selective, full
    distopt: bool = False
    # --expert-tensor-parallel-size 1: the experts whole on every TP rank, the EP groups reaching
    # across TP (EP divides TP x CP x DP), as MindSpeed-LLM's largest MoE scripts run
    etp1: bool = False
    dualpipev: bool = False  # --schedules-method dualpipev: two chunks a rank in a V

    @property
    def sp(self) -> bool:
        return self.tp > 1

    @property
    def expert_tp(self) -> int:
        return 1 if self.etp1 else self.tp

    @property
    def edp(self) -> int:
        """The ranks holding copies of the same experts (expert data parallelism): the ranks of a
        stage over EP, each group's experts cut over the expert TP."""
        return self.tp * self.cp * self.dp // (self.ep * self.expert_tp)

    def flags(self) -> list[str]:
        out = ["--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp)]
        if self.cp > 1:
            out += ["--context-parallel-size", str(self.cp)]
        if self.ep > 1:
            out += ["--expert-model-parallel-size", str(self.ep), "--moe-token-dispatcher-type", "alltoall"]
        if self.etp1:
            out += ["--expert-tensor-parallel-size", "1"]
        if self.sp:
            out.append("--sequence-parallel")
        out += ["--micro-batch-size", str(self.mbs)]
        if self.recompute == "selective":
            out.append("--recompute-activations")
        elif self.recompute == "full":
            out += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
        if self.distopt:
            out.append("--use-distributed-optimizer")
        if self.dualpipev:
            out += ["--schedules-method", "dualpipev"]
        return out

    def describe(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}", f"DP{self.dp}"] + ([f"CP{self.cp}"] if self.cp > 1 else []) + \
                ([f"EP{self.ep}" + (" (ETP1)" if self.etp1 else "")] if self.ep > 1 else [])
        return "x".join(parts) + f" mbs {self.mbs}" + (f" {self.recompute}" if self.recompute != "none" else "") + \
            (" distopt" if self.distopt else "")


# ---- parameters per rank --------------------------------------------------------------------

def _layer_split(cfg, layer: int, tp: int, ep: int, expert_tp: int) -> tuple:
    """One transformer layer's parameters on one rank (linear layers cut by TP, experts by EP and
    then the expert TP; norms, router and output biases replicated): (those besides the routed
    experts, the routed experts')."""
    h = cfg.hidden_size
    norm = h * (2 if cfg.normalization == "layernorm" else 1)
    attn = _attention_split(cfg, layer, tp)
    gated = cfg.gated
    if cfg.moe is not None and cfg.is_moe_layer(layer):
        moe = cfg.moe
        f = moe.ffn_hidden_size or cfg.ffn_hidden_size
        per_width = 2 if gated else 1
        expert = h * per_width * f + f * h + ((per_width * f + h) if cfg.add_bias_linear else 0)
        experts = moe.num_experts / ep * expert / expert_tp
        # the router (with its expert bias, a slot for each zero-computation expert too), whole on each rank
        mlp = (h + (1 if moe.enable_expert_bias else 0) + (1 if cfg.add_bias_linear else 0)) * moe.slots
        if moe.shared_expert_size:
            s = moe.shared_expert_size
            mlp += (h * (2 if gated else 1) * s + s * h) / tp + (h if moe.shared_expert_gate else 0)
    else:
        mlp = _dense_mlp_split(cfg, tp)
        experts = 0.0
    if cfg.shortcut_moe:  # LongCat-Flash: a second attention and two dense MLPs beside the MoE, four norms
        return 2 * attn + mlp + 2 * _dense_mlp_split(cfg, tp) + 4 * norm, experts
    return attn + mlp + 2 * norm, experts


def _dense_mlp_split(cfg, tp: int) -> float:
    """A dense MLP's parameters on one rank (fc1 column-cut, fc2 row-cut, fc2's bias replicated)."""
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    fc1 = (2 if cfg.gated else 1) * f
    return (h * fc1 + f * h) / tp + ((fc1 / tp + h) if cfg.add_bias_linear else 0)


def _attention_split(cfg, layer: int, tp: int) -> float:
    """One layer's attention parameters on one rank: q/k/v and the output projection cut by TP
    (a key/value head copied to several ranks when TP exceeds the groups); latent attention's
    down-projections, latent norms and biases whole on each rank, its up-projections and output
    cut; a sparse-attention indexer whole on each rank."""
    h, kv = cfg.hidden_size, cfg.kv_channels
    mla = cfg.mla
    if mla is not None:
        heads = cfg.num_attention_heads
        cut = (heads * mla.qk_head_dim * (mla.q_lora_rank or h)  # linear_q_up_proj or linear_q_proj
               + mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim) + heads * mla.v_head_dim * h)
        attn = cfg._attention_parameters() - cut + cut / tp
        if cfg.dsa is not None and cfg.dsa.runs_indexer(layer):
            dsa = cfg.dsa
            attn += mla.q_lora_rank * dsa.n_heads * dsa.head_dim + h * dsa.head_dim + 2 * dsa.head_dim + h * dsa.n_heads
        return attn
    q_width, groups = cfg.num_attention_heads * kv, cfg.num_query_groups
    kv_local = 2 * kv * max(groups // tp, 1)  # a key/value head copied to several ranks when TP > groups
    attn = h * (q_width / tp + kv_local) + q_width * h / tp
    attn += (q_width / tp + kv_local) if cfg.add_qkv_bias else 0
    attn += h if cfg.attention_output_bias else 0
    attn += 2 * kv if cfg.qk_layernorm else 0
    return attn


def stage_parameters(cfg, layout, tp: int, ep: int, stage: int, pp: int, expert_tp: int | None = None) -> float:
    """Parameters of one rank of pipeline stage ``stage`` (the experts cut over ``expert_tp``,
    TP unless given)."""
    return stage_parameter_split(cfg, layout, tp, ep, stage, pp, expert_tp)[0]


def stage_parameter_split(cfg, layout, tp: int, ep: int, stage: int, pp: int,
                          expert_tp: int | None = None) -> tuple[float, float]:
    """(stage_parameters, the routed experts' share of them), in one walk over the stage's
    layers: the experts' optimizer state shards over the expert-data-parallel ranks, the
    rest's over the data-parallel ones."""
    h, v = cfg.hidden_size, cfg.vocab_size
    expert_tp = tp if expert_tp is None else expert_tp
    total = experts = 0.0
    for chunk in range(layout.chunks):
        for i in layout.layers(layout.stage(stage, chunk)):
            rest, routed = _layer_split(cfg, i, tp, ep, expert_tp)
            total, experts = total + rest + routed, experts + routed
    norm = h * (2 if cfg.normalization == "layernorm" else 1)
    held = {layout.stage(stage, chunk) for chunk in range(layout.chunks)}  # DualPipeV's first rank holds both ends
    if 0 in held:
        total += v * h / tp
        total += cfg.max_position_embeddings * h if cfg.position_embedding_type == "learned" else 0
    if layout.virtual_stages - 1 in held:
        total += norm
        if cfg.reward_head:
            total += h
        elif cfg.untie_embeddings_and_output_weights or pp > 1:
            total += v * h / tp  # the output layer, or the tied embedding's copy on the last stage
    return total, experts


# ---- the predictions --------------------------------------------------------------------------

def _activation_bytes(cfg, lay: Layout, seq: int, layers: int, element: int) -> float:
    """Activations of ``layers`` layers for one micro-batch on one rank."""
    f = cfg.ffn_hidden_size
    if cfg.moe is not None:  # an average layer: each token visits top-k experts in MoE layers
        f = max(f, (cfg.moe.ffn_hidden_size or f) * cfg.moe.topk + (cfg.moe.shared_expert_size or 0))
    policy = {"none": Recompute(), "selective": Recompute("selective"),
              "full": Recompute("full", "uniform", 1)}[lay.recompute]
    size = dict(s=seq // lay.cp, b=lay.mbs, h=cfg.hidden_size, a=cfg.num_attention_heads, f=f, element=element,
                dropout=bool(cfg.attention_dropout or cfg.hidden_dropout), gated=cfg.gated)
    return estimated_peak_bytes(policy, layers, **size) / lay.tp if layers else 0.0


@dataclasses.dataclass(frozen=True)
class StepCounts:
    """What a step holds besides weights and optimizer states, in copies, what it runs twice and
    what it spends besides matmuls and collectives, as this implementation runs on one framework.
    Read off benchmarks/bench_plan.py's calibration layouts on this machine (peak resident
    memory phase by phase, step times), not derived: each framework's allocator and autograd
    keep different temporaries.

    ``logits``: fp32 logits at the loss, for TP = 1 and TP > 1 (the logits, their exponentials,
    the log-softmax and its gradient; the vocabulary-parallel cross entropy keeps the maximum,
    the exponentials' share and their sum too). ``gradients``: after the backward, without and
    with accumulation (the gradients and their clipped copy; with accumulation also the running
    sum and a micro-batch's). ``distopt``, ``distopt_shard``: the distributed optimizer's
    gradient copies (the gradients, their flat copy, the reduction's) and its step's temporaries
    of the rank's shard (the scaled gradient, the decayed master, AdamW's new master and moments,
    the norm's two masked copies). ``built``: what building the whole model on every rank leaves
    resident, per fp32 parameter not on this rank, and ``build_extra`` per fp32 parameter of the
    whole model on every rank. ``activations``: the activations over Korthikanti's count.
    ``records_again``: a pipeline stage runs a forward that other compute follows before its
    backward without recording and records it again at the backward (autograd.vjp's
    ``interleaved``): one micro-batch's activations held, one more forward computed.
    Time besides the matmuls and the collectives, in passes of the probed element-wise rate
    (Machine.elementwise_rate): ``elementwise_passes`` over a micro-batch's activation and
    logit elements; ``distopt_passes`` over the rank's parameters per step, what the distributed
    optimizer's flattening, masks and slices add to the plain optimizer's step."""

    logits: tuple = (4.3, 6.0)
    gradients: tuple = (2, 4)
    distopt: float = 3
    distopt_shard: float = 7
    built: float = 1.0
    build_extra: float = 0.0
    activations: float = 1.0
    records_again: bool = False
    elementwise_passes: float = 0.0
    distopt_passes: float = 0.0


COUNTS = {
    "pytorch": StepCounts(elementwise_passes=13, distopt_passes=24),
    # MindSpore 2.10 PyNative on CPU: its memory pool keeps what a phase freed for its own
    # later use and the autograd record holds more per operator; the distributed optimizer's
    # gathers and reductions are emulated through host arrays (backends/emulated_collectives.py),
    # several copies of the gradients each
    "mindspore": StepCounts(logits=(7.0, 8.6), gradients=(2, 5), distopt=16, distopt_shard=0, built=2.2,
                            build_extra=1.2, activations=3.1, records_again=True, elementwise_passes=42,
                            distopt_passes=63),
}


@functools.lru_cache(maxsize=64)
def pipeline_bubble(pp: int, micro: int, dualpipev: bool = False) -> float:
    """A rank's idle time in a step, in micro-batch slots (one stage's forward and backward of
    one micro-batch): the schedule's program run in simulation (schedules.simulated_timeline)
    with a backward twice a forward. 1F1B's is P - 1; DualPipeV's is the same on P ranks less
    what its V fills. Past 2P micro-batches the steady state adds no idle time, so longer
    steps are simulated at 4P."""
    if not dualpipev:
        return float(pp - 1)  # what the simulation gives too (tests/test_plan.py)
    program = schedules.pipeline_program(pp, 2, min(micro, 4 * pp), schedule=schedules.DUALPIPEV)
    # a stage's micro-batch slot is 3 units (forward 1, backward 2); DualPipeV's chunk is half a stage
    timeline = schedules.simulated_timeline(program, 2, schedules.DUALPIPEV, 0.5, 1.0)
    return max(schedules.idle_time(timeline).values()) / 3.0


def predict_memory(cfg, lay: Layout, seq: int, gbs: int, machine: Machine, dtype: str = "float32",
                   moments: int = 8) -> dict:
    """Bytes per device on the most loaded pipeline stage, by part: the fixed parts (baseline,
    weights, optimizer states, what building the whole model left) plus the larger of the
    step's two peaks: at the loss (activations, logits) and after the backward (gradients).
    ``moments``: the bytes per parameter of Adam's two moments as stored (8 in fp32; 4 with
    --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 or --o2-optimizer)."""
    layout = pipeline.model_layout(cfg, lay.pp, dualpipev=lay.dualpipev)
    element = 4 if dtype == "float32" else 2
    copies = machine.counts()
    micro = gbs // (lay.mbs * lay.dp)
    accumulates = micro > 1
    whole = cfg.num_parameters()
    best = None
    for stage in range(lay.pp):
        params, experts = stage_parameter_split(cfg, layout, lay.tp, lay.ep, stage, lay.pp, lay.expert_tp)
        weights = element * params
        grads = 4 * params
        # the dense part's states shard over the DP x CP ranks, the experts' over the expert-data-parallel ones
        state = sum((16 + moments) * n / shards if lay.distopt and shards > 1  # fp32 master, moments, three masks
                    else (moments + (4 if element == 2 else 0)) * n  # the moments (and the master of 16-bit weights)
                    for n, shards in ((params - experts, lay.dp * lay.cp), (experts, lay.edp)))
        # 1F1B: the first stage holds PP micro-batches; DualPipeV: every rank 2P + 1 chunks' (half a stage's each)
        in_flight = (1 if copies.records_again else min(2 * lay.pp + 1, 2 * micro) / 2 if lay.dualpipev
                     else min(lay.pp - stage, micro))
        layers = sum(len(layout.layers(layout.stage(stage, c))) for c in range(layout.chunks))
        acts = in_flight * copies.activations * _activation_bytes(cfg, lay, seq, layers, element)
        logits = (copies.logits[lay.tp > 1] * 4 * lay.mbs * (seq // lay.cp) * cfg.vocab_size / lay.tp
                  if layout.rank_of_stage(layout.virtual_stages - 1) == stage else 0)
        after_backward = copies.gradients[accumulates] * grads
        if lay.distopt and lay.dp * lay.cp > 1:
            after_backward = max(after_backward, (copies.distopt + copies.distopt_shard / (lay.dp * lay.cp)) * grads)
        # every rank builds the whole model in fp32 and keeps its cut
        built = 4 * (copies.built * (whole - params) + copies.build_extra * whole)
        parts = {"baseline": machine.baseline_bytes, "weights": weights, "optimizer": state, "built": built,
                 "activations": acts, "logits": logits, "held_gradients": grads if accumulates else 0,
                 "gradients": after_backward, "stage": stage}
        parts["total"] = memory_total(parts)
        if best is None or parts["total"] > best["total"]:
            best = parts
    return best


def memory_total(parts: dict) -> float:
    """predict_memory's total from its parts: the fixed parts plus the larger of the step's two
    peaks, at the loss (activations, logits, the gradients accumulated so far) and after the
    backward (gradients)."""
    at_loss = parts["activations"] + parts["logits"] + parts["held_gradients"]
    return parts["baseline"] + parts["weights"] + parts["optimizer"] + parts["built"] + max(at_loss, parts["gradients"])


def _flops_per_micro(cfg, lay: Layout, seq: int) -> float:
    """Training FLOPs of one micro-batch on one rank of the busiest stage."""
    per_token = cfg.flops_per_token(seq)
    if lay.recompute == "full":  # one more forward of every layer
        per_token *= 4 / 3
    elif lay.recompute == "selective":  # the attention scores again
        per_token += 2 * 2 * seq * cfg.num_attention_heads * cfg.kv_channels * cfg.real_layers
    return per_token * lay.mbs * seq / (lay.tp * lay.pp * lay.cp)


def matmul_shape(cfg, lay: Layout, seq: int) -> tuple:
    """The layout's typical GEMM: the micro-batch's tokens on this rank times the MLP's first
    weight cut by TP."""
    width = (2 if cfg.gated else 1) * cfg.ffn_hidden_size
    return (lay.mbs * seq // lay.cp, cfg.hidden_size, max(width // lay.tp, 1))


def predict_step(cfg, lay: Layout, seq: int, gbs: int, machine: Machine) -> dict:
    """Seconds per training step, by part."""
    counts = machine.counts()
    micro = gbs // (lay.mbs * lay.dp)
    rate = machine.rate(*matmul_shape(cfg, lay, seq))
    per_micro = _flops_per_micro(cfg, lay, seq) / rate
    if counts.records_again and lay.pp > 1 and micro > 1:  # the first stage's forwards run twice
        per_micro *= 1 + 1 / 3
    # what is not a matmul, per micro-batch: element-wise passes over the activations (as if
    # none were recomputed: the work happens either way; a full recompute runs the forward's
    # again) and the logits
    L = cfg.real_layers / lay.pp
    elements = (_activation_bytes(cfg, dataclasses.replace(lay, recompute="none"), seq, max(round(L), 1), 4) / 4
                * (4 / 3 if lay.recompute == "full" else 1) + lay.mbs * (seq // lay.cp) * cfg.vocab_size / lay.tp)
    per_micro += counts.elementwise_passes * elements / machine.elementwise_rate
    compute = micro * per_micro
    bubble = pipeline_bubble(lay.pp, micro, lay.dualpipev) * per_micro
    params = cfg.num_parameters() / (lay.tp * lay.pp)
    sharded = lay.distopt and lay.dp * lay.cp > 1
    optimizer = counts.distopt_passes * params / machine.elementwise_rate if sharded else 0.0
    tokens = lay.mbs * seq // lay.cp
    h = cfg.hidden_size
    comm = 0.0
    # the tensor-parallel group's collectives, then the data-parallel (x CP) group's gradient reduction
    for group, sizes, calls in ((lay.tp, dict(tp=lay.tp, dp=1), (4 * L + 2) * micro),
                                (lay.dp * lay.cp, dict(tp=1, dp=lay.dp * lay.cp), 3)):
        moved = traffic.step_bytes(_Sizes(cfg, L), micro_batch=lay.mbs, seq_length=seq // lay.cp, grad_accum=micro,
                                   sp=lay.sp and sizes["tp"] > 1, distributed_optimizer=lay.distopt,
                                   local_params=int(params), sp_partial_params=0, **sizes)
        for op, n in moved.items():  # the calls shared among the group's kinds of collective
            comm += machine.collective_seconds(op, n, group, calls / len(moved))
    if lay.pp > 1:  # each micro-batch's activation forward and its gradient back, per stage boundary
        comm += machine.collective_seconds("send", 2 * micro * 4 * tokens * h / lay.tp, 2, 2 * micro)
    if lay.cp > 1:  # the ring passes the keys and values on (CP - 1) times per layer, their gradients back
        kv = 2 * tokens * cfg.num_query_groups * cfg.kv_channels * 4 / lay.tp
        n = 3 * L * micro * (lay.cp - 1)
        comm += machine.collective_seconds("send", n * kv, 2, n)
    if lay.ep > 1 and cfg.moe is not None:  # tokens to their experts and back, forward and backward
        moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers)) / lay.pp
        comm += machine.collective_seconds(
            "all_gather", 4 * moe_layers * micro * tokens * cfg.moe.topk * h * 4 / lay.tp / lay.ep, lay.ep,
            4 * moe_layers * micro)
    return {"compute": compute, "bubble": bubble, "optimizer": optimizer, "communication": comm,
            "total": compute + bubble + optimizer + comm}


class _Sizes:
    """What traffic.step_bytes reads of a model config: the stage's share of the layers."""

    def __init__(self, cfg, layers: float):
        self.hidden_size, self.num_layers, self.moe = cfg.hidden_size, layers, None


# ---- enumeration -----------------------------------------------------------------------------

# The search's bounds, so that `plan` answers within seconds whatever the sizes, or says in one
# line why it will not. Checking and predicting one layout costs about as much as going through
# CHECK_LAYERS layers, plus each layer of the model once (~3 us a layer on a 2-core host): the
# layouts times (CHECK_LAYERS + layers) stay within MAX_WORK (~10 s there).
CHECK_LAYERS = 400
MAX_WORK = 3_000_000
MAX_LAYERS = 100_000  # the deepest models trained have about 130
MAX_DIVISIONS = 5_000_000  # the trial divisions that list the layouts (~0.5 s)


def _divisors(n: int, limit: int | None = None) -> list[int]:
    """``n``'s divisors up to ``limit``, by at most min(limit, sqrt n) trial divisions."""
    limit = n if limit is None else min(limit, n)
    root = math.isqrt(n)
    if limit <= root:
        return [d for d in range(1, limit + 1) if n % d == 0]
    small = [d for d in range(1, root + 1) if n % d == 0]
    return sorted(d for d in set(small + [n // d for d in small]) if d <= limit)


def layout_space(cfg, args, world: int, devices_per_node: int) -> list[Layout]:
    """The layouts worth asking the trainer about, found by arithmetic: each size no larger than
    what it cuts (TP the heads, PP the layers, CP the sequence, DP the batch, EP the experts),
    TP within a node. Refused in one line past MAX_DIVISIONS or MAX_WORK."""
    gbs, seq, out = args.global_batch_size, args.seq_length, []
    divisions = 0

    def divisors(n: int, limit: int, what: str) -> list[int]:
        nonlocal divisions
        divisions += min(limit, math.isqrt(n))
        if divisions > MAX_DIVISIONS:
            raise MindSpeedError(f"{what}: too large to search (more than {MAX_DIVISIONS:,} trial divisions to list "
                                 f"the layouts)")
        return _divisors(n, limit)

    devices = f"--devices {world}"
    for tp in divisors(world, min(devices_per_node, cfg.num_attention_heads), devices):
        for pp in divisors(world // tp, cfg.num_layers, devices):
            for cp in divisors(world // (tp * pp), seq, devices):
                dp = world // (tp * pp * cp)
                if gbs % dp:
                    continue
                # EP within DP x CP, its experts cut over TP; and under TP with the experts whole
                # (ETP 1), EP within TP x CP x DP
                eps = [(e, False) for e in divisors(dp * cp, cfg.moe.num_experts, devices)
                       if cfg.moe.num_experts % e == 0] if cfg.moe is not None else [(1, False)]
                if cfg.moe is not None and tp > 1:
                    eps += [(e, True) for e in divisors(tp * dp * cp, cfg.moe.num_experts, devices)
                            if e > 1 and cfg.moe.num_experts % e == 0]
                mbss = divisors(gbs // dp, args.max_micro_batch_size,
                                f"--global-batch-size {gbs} with --max-micro-batch-size {args.max_micro_batch_size}")
                out += [Layout(tp, pp, dp, cp, ep, mbs, recompute, distopt, etp1, v)
                        for (ep, etp1), mbs, recompute, distopt, v in itertools.product(
                            eps, mbss, ("none", "selective", "full"), (False, True) if dp * cp > 1 else (False,),
                            (False, True) if pp > 1 else (False,))]
                if len(out) * (CHECK_LAYERS + cfg.num_layers) > MAX_WORK:
                    most = MAX_WORK // (CHECK_LAYERS + cfg.num_layers)
                    raise MindSpeedError(f"--devices {world} with --global-batch-size {gbs}: more layouts to check "
                                         f"(TP x PP x CP x DP x EP, micro-batch sizes up to --max-micro-batch-size "
                                         f"{args.max_micro_batch_size}, recompute, distributed optimizer) than the "
                                         f"{most:,} the planner checks for a model of {cfg.num_layers} layers (each "
                                         f"check goes through every layer); lower --max-micro-batch-size or give "
                                         f"--devices-per-node")
    return out


def candidates(cfg, args, world: int, devices_per_node: int, check) -> list[Layout]:
    """Every layout of ``world`` devices the trainer accepts (``check(layout)`` raises
    MindSpeedError otherwise): TP within a node."""
    out = []
    for lay in layout_space(cfg, args, world, devices_per_node):
        try:
            check(lay)
        except MindSpeedError:
            continue
        out.append(lay)
    return out


# ---- the probe ---------------------------------------------------------------------------------

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send")


def ring_factor(op: str, group: int) -> float:
    """Bytes each member sends on a ring of ``group`` members per byte of the caller's payload
    (all_gather's payload is one member's part, reduce_scatter's the whole)."""
    return {"all_reduce": 2 * (group - 1) / group, "all_gather": group - 1, "reduce_scatter": (group - 1) / group,
            "send": 1.0}[op]


def probe_collectives(ranks: int = 2, small: int = 1 << 10, large: int = 1 << 22) -> dict:
    """{collective: (seconds per call, payload bytes per second)} of the bound framework's own
    collectives (dist.all_reduce, all_gather, reduce_scatter, send/recv as the pipeline uses
    them) between ``ranks`` local processes started by its launcher: whatever they cost here,
    emulation included, from a small and a large float32 payload."""
    import os
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="mindspeed-plan-") as folder:
        out = os.path.join(folder, "collectives.json")
        cmd, env = launcher.local_script_command(ranks, os.path.abspath(__file__),
                                                 ["--collectives-rank", out, str(small), str(large)],
                                                 runtime.bound().NAME, os.path.join(folder, "logs"))
        env["OMP_NUM_THREADS"] = "1"
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=folder, timeout=300)
            failure = done.stderr[-500:] if done.returncode or not os.path.exists(out) else None
        except subprocess.TimeoutExpired:
            failure = "no answer in 300 s"
        if failure is not None:
            raise MindSpeedError(f"the probe of the collectives on {ranks} local ranks failed ({failure!r}); "
                                 "give --link-gbps and --link-latency-us instead")
        with open(out) as fh:
            return {op: tuple(v) for op, v in json.load(fh).items()}


def _collectives_rank(out: str, small: int, large: int) -> None:
    """One rank of probe_collectives: rank 0 writes the fitted latency and bandwidth."""
    runtime.bind()
    dist.init()
    me = dist.rank()

    def call(op, x):
        if op == "send":  # there and back: two transfers
            peer = 1 - me
            if me == 0:
                dist.send(x, peer)
                x = dist.recv(x.shape, "float32", peer)
            else:
                x = dist.recv(x.shape, "float32", peer)
                dist.send(x, peer)
            return x
        return getattr(dist, op)(x)

    seconds = {}
    for op in COLLECTIVES:
        for n in (small, large):
            x = ops.ones((n // 4,))
            start = time.perf_counter()
            ops.to_numpy(call(op, x)[:1])
            # the ranks agree on one count of calls (each call is collective): ~0.2 s
            first = float(ops.to_numpy(dist.all_reduce(ops.tensor([time.perf_counter() - start]), op="max"))[0])
            reps = min(max(int(0.2 / max(first, 1e-6)), 3), 200)
            start = time.perf_counter()
            for _ in range(reps):
                ops.to_numpy(call(op, x)[:1])
            device.synchronize()
            seconds[op, n] = (time.perf_counter() - start) / reps / (2 if op == "send" else 1)
    if me == 0:
        fitted = {}
        for op in COLLECTIVES:
            t_small, t_large = seconds[op, small], seconds[op, large]
            per_byte = (t_large - t_small) / (large - small)
            if per_byte <= 0:  # noise hid the payload's cost (seen for send): the large call's whole time
                per_byte = t_large / large  # prices it, a lower bound on the rate, never an absurd one
            fitted[op] = (max(t_small - small * per_byte, 0.0), 1.0 / per_byte)
        with open(out, "w") as fh:
            json.dump(fitted, fh)
    dist.shutdown()


def _calls_per_second(fn, seconds: float, every: int) -> float:
    """Calls of ``fn`` per second over at least ``seconds``; every ``every`` calls a corner of
    the result is read back (and the device synchronized) so that queued work is counted."""
    reps, start = 0, time.perf_counter()
    while True:
        c = fn()
        reps += 1
        if reps % every == 0:
            ops.to_numpy(ops.reshape(c, (-1,))[:1])
            device.synchronize()
            if time.perf_counter() - start >= seconds:
                return reps / (time.perf_counter() - start)


def probe_matmul(shapes, min_seconds: float = 0.1, rounds: int = 5) -> dict:
    """{(m, k, n): FLOP/s} of the bound framework's matmul on each shape (float32): the median
    of ``rounds`` short runs per shape, the shapes taken in turn, so that a disturbance of the
    host lands in one run of several shapes rather than in all runs of one."""
    import statistics

    operands = {shape: (ops.ones(shape[:2]), ops.ones(shape[1:])) for shape in shapes}
    runs = {shape: [] for shape in shapes}
    for _ in range(rounds):
        for (m, k, n), (a, b) in operands.items():
            ops.to_numpy(ops.matmul(a, b)[:1, :1])
            rate = _calls_per_second(lambda: ops.matmul(a, b), min_seconds / rounds, every=2)
            runs[m, k, n].append(2.0 * m * k * n * rate)
    return {shape: statistics.median(r) for shape, r in runs.items()}


def probe_elementwise(elements: int = 1 << 22, min_seconds: float = 0.1, rounds: int = 5) -> float:
    """Float32 elements per second of a binary element-wise operator on a large tensor (the
    median of ``rounds`` short runs)."""
    import statistics

    a, b = ops.ones((elements,)), ops.ones((elements,))
    ops.to_numpy((a * b)[:1])
    return statistics.median(elements * _calls_per_second(lambda: a * b, min_seconds / rounds, every=4)
                             for _ in range(rounds))


def baseline_bytes() -> float:
    """This process's resident memory now: a bound framework that has run a few operators."""
    return float(host_memory_stats().get("host_rss_bytes", 0))


# ---- the command ---------------------------------------------------------------------------------

PLAN_FLAGS = ("--devices", "--devices-per-node", "--memory-per-device", "--memory-headroom", "--matmul-tflops",
              "--elementwise-gelems", "--link-gbps", "--link-latency-us", "--baseline-gb", "--top",
              "--max-micro-batch-size", "--json")


def _parser():
    parser = megatron_args.training_parser("mindspeed plan")
    parser.description = "rank the parallel layouts of a training run by predicted step time"
    g = parser.add_argument_group("plan")
    g.add_argument("--devices", type=megatron_args.POSITIVE_INT, required=True, help="devices (ranks) of the job")
    g.add_argument("--devices-per-node", type=megatron_args.POSITIVE_INT, default=None,
                   help="devices per node (default: all); TP stays within a node")
    g.add_argument("--memory-per-device", type=megatron_args.POSITIVE, required=True, help="GiB per device")
    g.add_argument("--matmul-tflops", type=megatron_args.POSITIVE, default=None,
                   help="one device's float32 matmul rate (default: measured here, per shape)")
    g.add_argument("--elementwise-gelems", type=megatron_args.POSITIVE, default=None,
                   help="one device's float32 element-wise rate in G elements/s (default: measured here)")
    g.add_argument("--link-gbps", type=megatron_args.POSITIVE, default=None,
                   help="bandwidth between devices in GB/s, every collective on a ring of it (default: each of the "
                        "framework's collectives measured on two local ranks)")
    g.add_argument("--link-latency-us", type=megatron_args.NON_NEGATIVE, default=None,
                   help="latency per collective in microseconds (default: measured here, or 10 with --link-gbps)")
    g.add_argument("--baseline-gb", type=megatron_args.NON_NEGATIVE, default=None,
                   help="the framework's own memory per process in GiB (default: measured here)")
    g.add_argument("--memory-headroom", type=megatron_args.PROBABILITY, default=0.15,
                   help="the share of each device's memory the prediction keeps free (it was within 15%% of the "
                        "measured peaks here, mostly below)")
    g.add_argument("--top", type=megatron_args.POSITIVE_INT, default=5, help="layouts to print")
    g.add_argument("--max-micro-batch-size", type=megatron_args.POSITIVE_INT, default=16)
    g.add_argument("--json", action="store_true", help="print every layout's prediction as JSON")
    return parser


LAYOUT_FLAGS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
                "--expert-model-parallel-size", "--micro-batch-size", "--sequence-parallel", "--use-distributed-optimizer",
                "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--recompute-activations",
                "--moe-token-dispatcher-type")


def _base_argv(argv: list[str], parser) -> list[str]:
    """The user's flags without the planner's own and the layout's (the plan sets those)."""
    out, i = [], 0
    while i < len(argv):
        name = argv[i].split("=", 1)[0]
        action = parser._option_string_actions.get(name)
        width = 1
        if action is not None and "=" not in argv[i] and action.nargs != 0:
            width = 2
            if action.nargs in ("+", "*"):
                while i + width < len(argv) and not argv[i + width].startswith("--"):
                    width += 1
        if name not in LAYOUT_FLAGS and name not in PLAN_FLAGS:
            out += argv[i:i + width]
        i += width
    return out


def measure_machine(args, world: int, shapes) -> Machine:
    ops.to_numpy(ops.matmul(ops.ones((8, 8)), ops.ones((8, 8))))  # the framework's kernels loaded
    base = args.baseline_gb * GIB if args.baseline_gb is not None else baseline_bytes()
    share = world if device.type() == "cpu" else 1  # the ranks share the host's cores
    if args.matmul_tflops:
        peak, rates = args.matmul_tflops * 1e12, {}
    else:
        rates = {shape: r / share for shape, r in probe_matmul(sorted(set(shapes))).items()}
        peak = device.matmul_rate(n=512, min_seconds=0.2) / share
    elementwise = args.elementwise_gelems * 1e9 * share if args.elementwise_gelems else probe_elementwise()
    collectives = None
    if args.link_gbps is None and world > 1:
        collectives = probe_collectives(2)
    lat, bw = collectives["all_reduce"] if collectives else (1e-5, 1e9)
    if args.link_gbps or args.link_latency_us is not None:  # given: every collective on a ring of that link
        collectives = None
        bw = args.link_gbps * 1e9 if args.link_gbps else bw
        lat = args.link_latency_us * 1e-6 if args.link_latency_us is not None else lat
    return Machine(world, args.memory_per_device * GIB, rates, peak, bw, lat, base, runtime.bound().NAME,
                   collectives, elementwise / share)


def parse(argv: list[str]):
    """The plan's flags; ``args.base_argv`` keeps the user's training flags without the planner's
    own and the layout's (each candidate layout adds its own)."""
    parser = _parser()
    args = parser.parse_args(argv)
    args.base_argv = _base_argv(argv, parser)
    return args


def plan(args) -> dict:
    """Enumerate, predict; returns {"machine": ..., "default": ..., "ranked": [...]}. ``args``:
    :func:`parse`'s, with the framework bound."""
    world = args.devices
    if args.seq_length is None or args.global_batch_size is None:
        raise MindSpeedError("give --seq-length and --global-batch-size: the plan divides that batch of sequences")
    if args.bf16 or args.fp16:
        dtype = "bfloat16" if args.bf16 else "float16"
    else:
        dtype = "float32"
    base = args.base_argv
    # the configuration check reads no data; a placeholder keeps it from the embedded run's settings
    base_check = base if args.data_path else [*base, "--data-path", "plan"]
    if args.tokenizer_type is None and not args.load_hf:
        base_check = [*base_check, "--tokenizer-type", "ByteLevel"]
    train_parser = megatron_args.training_parser()

    def check(lay: Layout):
        return configuration.configure(train_parser.parse_args([*base_check, *lay.flags()]), world)

    one = train_parser.parse_args([*base_check, "--micro-batch-size", "1"])
    depth = configuration.model_only(one).num_layers  # each check below walks the layers: bounded first
    if depth > MAX_LAYERS:
        raise MindSpeedError(f"--num-layers {depth}: the planner checks each layout with the trainer's configuration, "
                             f"which goes through every layer, and plans models of up to {MAX_LAYERS:,} layers")
    one_run = configuration.configure(one, 1)
    cfg = one_run.model
    stored = one_run.optimization.moment_dtypes
    moments = sum(moment_bytes(d) for d in stored)
    # each kind of parallelism cuts something finite: the batch (DP), the layers (PP), the heads
    # (TP) and the sequence (CP); a job larger than all of them has no layout (and none is tried)
    most = args.global_batch_size * cfg.num_layers * cfg.num_attention_heads * args.seq_length
    if world > most:
        raise MindSpeedError(f"--devices {world}: no layout of this model and batch uses that many devices (at most "
                             f"{most:,}: global batch x layers x heads x sequence length)")
    layouts = candidates(cfg, args, world, args.devices_per_node or world, check)
    if not layouts:
        raise MindSpeedError(f"no layout of {world} devices suits this model and batch (global batch "
                             f"{args.global_batch_size}, sequence {args.seq_length}): check the sizes divide")
    seq, gbs = args.seq_length, args.global_batch_size
    machine = measure_machine(args, world, [matmul_shape(cfg, lay, seq) for lay in layouts])
    rows = []
    for lay in layouts:
        mem = predict_memory(cfg, lay, seq, gbs, machine, dtype, moments)
        step = predict_step(cfg, lay, seq, gbs, machine)
        rows.append({"layout": lay, "memory": mem, "step": step,
                     "fits": mem["total"] <= (1 - args.memory_headroom) * machine.memory_bytes,
                     "command": launch_command(world, base, lay, args.devices_per_node)})
    rows.sort(key=lambda r: (not r["fits"], r["step"]["total"], r["memory"]["total"]))
    default = next((r for r in rows if r["layout"] == Layout(1, 1, world, mbs=args.micro_batch_size or 1)), None)
    return {"machine": machine, "model_parameters": cfg.num_parameters(), "rows": rows, "default": default,
            "moments": (stored, moments, 4 if dtype != "float32" else 0),
            "tokens_per_step": gbs * seq, "args": args}


def launch_command(world: int, base: list[str], lay: Layout, per_node: int | None) -> str:
    nodes = "" if not per_node or per_node >= world else f" --nnodes {world // per_node} --node-rank 0"
    nproc = per_node if per_node and per_node < world else world
    return shlex.join(["mindspeed", "launch", "--nproc-per-node", str(nproc)]) + nodes + " -- " + \
        shlex.join([*base, *lay.flags()])


def run(args, backend) -> int:
    """`mindspeed plan` once its flags are parsed and the framework bound."""
    result = plan(args)
    machine, rows, args = result["machine"], result["rows"], result["args"]
    if args.json:
        print(json.dumps([{"layout": dataclasses.asdict(r["layout"]), "memory": r["memory"], "step": r["step"],
                           "fits": r["fits"], "command": r["command"]} for r in rows], indent=1))
        return 0
    fitting = [r for r in rows if r["fits"]]
    print(f"{result['model_parameters'] / 1e6:.1f}M parameters, {result['tokens_per_step']} tokens per step, "
          f"{machine.devices} devices of {machine.memory_bytes / GIB:.1f} GiB; matmul {machine.peak_flops / 1e12:.3f} "
          f"TFLOP/s per device, all-reduce {machine.link_bytes_per_s / 1e9:.2f} GB/s and "
          f"{machine.link_latency_s * 1e6:.0f} us per call, framework baseline {machine.baseline_bytes / GIB:.2f} GiB")
    if runtime.bound().device.type() != "cpu":
        print("note: the copy counts and element-wise passes were read off a CPU host (benchmarks/bench_plan.py); "
              "on this device keep more --memory-headroom until they are measured here")
    (first, second), moments, master = result["moments"]
    print(f"optimizer state: {moments + master} bytes per parameter (exp_avg {first}, exp_avg_sq {second}"
          f"{', an fp32 master' if master else ''}); the distributed optimizer shards it, with its masters and masks, "
          f"over the data-parallel ranks")
    print(f"{len(rows)} layouts the trainer accepts, {len(fitting)} fit in memory (keeping "
          f"{100 * args.memory_headroom:.0f}% free)")
    header = f"{'#':>3}  {'layout':<34} {'memory GiB':>10} {'step s':>9} {'tokens/s':>10}"
    print(header)
    for k, r in enumerate(fitting[:args.top], 1):
        print(f"{k:>3}  {r['layout'].describe():<34} {r['memory']['total'] / GIB:>10.2f} {r['step']['total']:>9.3f} "
              f"{result['tokens_per_step'] / r['step']['total']:>10.0f}")
    default = result["default"]
    if default is not None:
        state = "fits" if default["fits"] else "does not fit"
        print(f"  default ({default['layout'].describe()}): {default['memory']['total'] / GIB:.2f} GiB ({state}), "
              f"{default['step']['total']:.3f} s per step")
    if not fitting:
        least = min(rows, key=lambda r: r["memory"]["total"])
        raise MindSpeedError(f"no layout fits in {machine.memory_bytes / GIB:.1f} GiB per device (keeping "
                             f"{100 * args.memory_headroom:.0f}% free); the smallest "
                             f"needs {least['memory']['total'] / GIB:.2f} GiB ({least['layout'].describe()}): add "
                             "devices or memory, or shorten the sequence")
    print("commands, best first" + (" (node 0's; node k runs it with --node-rank k and --master-addr of node 0)"
                                     if args.devices_per_node and args.devices_per_node < args.devices else "") + ":")
    for r in fitting[:args.top]:
        print("  " + r["command"])
    return 0


if __name__ == "__main__":  # one rank of probe_collectives, started by the framework's launcher
    import sys

    if sys.argv[1:2] == ["--collectives-rank"]:
        _collectives_rank(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        runtime.exit_process(0)
