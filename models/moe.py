"""The mixture-of-experts MLP (Megatron-core's MoELayer), written against the facade.

A router (models/router.py) picks ``topk`` of ``num_experts`` expert MLPs per token; the
token's rows are sorted by expert, each expert's rows go through its MLP, and the results
come back to their tokens weighted by the routing weights. An optional shared expert (Qwen2-
MoE, DeepSeek) sees every token, optionally scaled by a sigmoid gate.

The experts' weights are stacked, ``experts.weight1`` [E, hidden, 2 x ffn] (gate columns
then up columns for SwiGLU) and ``experts.weight2`` [E, ffn, hidden], so one grouped matmul
(``ops.grouped_matmul``: the device's kernel where one is bound) runs every expert; the
sequential path runs them one by one with plain matmuls and is the reference.

Parallelism reaches the layer only through its seams (MoESeams: where the tokens come from
and go, and how they travel to the experts): parallel/experts.py fills them in for tensor
and expert parallelism.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

from mindspeed_core import autograd, features, nn, ops
from mindspeed_core.memory import recompute
from mindspeed_core.models import lora, router
from mindspeed_core.models.config import ModelConfig, MoEConfig
from mindspeed_core.models.gpt import MLP, GPTModel, linear
from mindspeed_core.models.layers import Linear, _param, mlp_activation


class Experts(nn.Module):
    recompute_activation = False  # GPTModel.use_memory
    # whether the output bias is added here: under tensor parallelism the rows are partial sums,
    # and one rank adds it (parallel/experts.py)
    output_bias = True

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, num_local: int | None = None):
        super().__init__()
        self.activation = mlp_activation(cfg)
        f = moe.ffn_hidden_size or cfg.ffn_hidden_size
        width = 2 * f if cfg.gated else f
        n = num_local or moe.num_experts
        self.weight1 = _param((n, cfg.hidden_size, width), std=cfg.init_method_std)
        self.weight2 = _param((n, f, cfg.hidden_size), std=cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers))
        # megatron-core's expert biases with --add-bias-linear (GPT-OSS): [E, width] and [E, hidden]
        self.bias1 = _param((n, width), value=0.0) if cfg.add_bias_linear else None
        self.bias2 = _param((n, cfg.hidden_size), value=0.0) if cfg.add_bias_linear else None
        if cfg.lora is not None:  # per-expert adapters on the targeted stacked weights
            lora.attach_experts(self, cfg.lora, {"weight1": (n, cfg.hidden_size, width),
                                                 "weight2": (n, f, cfg.hidden_size)})

    def _activate(self, h):
        return recompute.activation(self.activation, h, self.recompute_activation)

    def _plus(self, x, bias, counts, output: bool = False):
        """x [N, w] (rows sorted by expert, counts[e] of expert e) plus each row's expert's bias."""
        if bias is None:
            return x
        if output and not self.output_bias:
            bias = bias * 0.0  # still used, so every rank's graph holds the parameter
        which = np.repeat(np.arange(len(counts)), counts).astype(np.int64)
        if which.size == 0:
            return x + ops.sum(bias) * 0.0
        return x + ops.cast(ops.index_select(bias, 0, ops.tensor(which)), ops.dtype_of(x))

    def forward(self, rows, counts, grouped: bool = True):
        """rows [N, hidden] sorted by expert, ``counts`` [E] host ints (rows per expert): one
        grouped matmul per weight, or expert by expert."""
        return self.second(self.first(rows, counts, grouped), counts, grouped)

    def first(self, rows, counts, grouped: bool = True):
        """forward's first half: the rows through fc1 (and its bias), [N, width]; second() is the
        rest. --moe-zero-memory level0 keeps this and recomputes what lies on either side."""
        sinks = getattr(self, "grad_sinks", None)
        if grouped:
            return self._plus(self._through("weight1", rows, counts, sinks and sinks[0]), self.bias1, counts)
        return self._per_expert(rows, counts, lambda x, e, one: self._plus(self._through("weight1", x, expert=e),
                                                                            self.bias1, one), "weight1")

    def second(self, h, counts, grouped: bool = True):
        """forward's second half on first()'s output: the activation, fc2 and its bias."""
        sinks = getattr(self, "grad_sinks", None)
        if grouped:
            return self._plus(self._through("weight2", self._activate(h), counts, sinks and sinks[1]), self.bias2,
                              counts, True)
        return self._per_expert(h, counts, lambda x, e, one: self._plus(
            self._through("weight2", self._activate(x), expert=e), self.bias2, one, True), "weight2")

    def _per_expert(self, rows, counts, fn, which: str):
        """fn(rows of expert e, e, counts of e alone) for each expert with rows, concatenated."""
        outs, start = [], 0
        for e, n in enumerate(int(c) for c in counts):
            if n:
                one = np.zeros(len(counts), np.int64)
                one[e] = n
                outs.append(fn(rows[start:start + n], e, one))
            start += n
        if not outs:  # no rows: still a product of them, so a backward pass reaches whatever sent them
            return self._through(which, rows if which == "weight1" else self.activation(rows), expert=0)
        return outs[0] if len(outs) == 1 else ops.cat(outs, dim=0)

    def _through(self, which: str, x, counts=None, sink=None, expert: int | None = None):
        """x through stacked weight ``which`` (rows sorted by expert, ``counts`` of each, or all
        through ``expert``'s), plus its LoRA adapter where it has one."""
        weight = getattr(self, which)
        y = _grouped(x, weight, counts, sink) if expert is None else ops.matmul(x, weight[expert])
        low = lora.expert_adapter(self, which, x, counts, expert)
        return y if low is None else y + low

    def dense(self, tokens, combine, expert_output=lambda y: y):
        """Every token through every expert, weighted by ``combine`` [T, E] (0 for an expert it
        did not choose) and summed: [T, h] -> [T, h] float32. Fixed shapes, no host counts (a
        compiled step's dispatch), at E / k times the routed path's expert FLOPs.
        ``expert_output``: the seam the experts' outputs [E, T, h] pass before the weighting
        (under TP their sum over the ranks: weighting partial rows would leave the router a
        partial gradient)."""
        e, t = self.weight1.shape[0], tokens.shape[0]
        rows = ops.expand(ops.unsqueeze(tokens, 0), (e, t, tokens.shape[-1]))
        h = ops.matmul(rows, self.weight1)  # [E, T, width]
        low = lora.expert_adapter(self, "weight1", rows)
        if low is not None:
            h = h + low
        if self.bias1 is not None:
            h = h + ops.unsqueeze(ops.cast(self.bias1, ops.dtype_of(h)), 1)
        a = self._activate(h)
        y = ops.matmul(a, self.weight2)  # [E, T, h]
        low = lora.expert_adapter(self, "weight2", a)
        if low is not None:
            y = y + low
        if self.bias2 is not None:
            y = y + ops.unsqueeze(ops.cast(self.bias2 if self.output_bias else self.bias2 * 0.0, ops.dtype_of(y)), 1)
        weights = ops.unsqueeze(ops.transpose(combine, 0, 1), -1)  # [E, T, 1]
        return ops.sum(ops.cast(expert_output(y), "float32") * weights, dim=0)


def _grouped(x, weight, counts, sink=None):
    """The experts' grouped matmul; with a ``sink`` (gradient_sinks) the weight's gradient goes
    there, computed in fp32 by ops.matmul_add, and the weight itself gets none."""
    if sink is None:
        return ops.grouped_matmul(x, weight, counts)
    features.note_used("matmul-add")
    sizes = [int(c) for c in counts]

    class _GroupedMatmulAdd(autograd.Function):  # a class per call: the group sizes change every step
        @staticmethod
        def forward(ctx, x, weight, sink):
            ctx.save(x, weight)
            return ops.grouped_matmul(x, weight, sizes)

        @staticmethod
        def backward(ctx, dy):
            x, weight = ctx.saved
            dx = ops.grouped_matmul(dy, ops.transpose(weight, 1, 2), sizes)
            per_expert, start = [], 0
            for n in sizes:  # x_e^T dy_e added in fp32 to a zero accumulator, never rounded to bf16
                acc = ops.zeros(tuple(weight.shape[1:]))
                if n:
                    acc = ops.matmul_add(ops.transpose(x[start:start + n], 0, 1), dy[start:start + n], acc)
                per_expert.append(acc)
                start += n
            return dx, None, ops.stack(per_expert)

    return _GroupedMatmulAdd.apply(x, weight, sink)


def gradient_sinks(moe_layers) -> dict:
    """MindSpeed's --gemm-gradient-accumulation-fusion (npu_groupmatmul_add_fp32: the grouped
    matmul's weight gradient added straight into the fp32 main gradient). Each grouped expert
    weight of ``moe_layers`` gets an fp32 tensor of its shape (a leaf the trainer differentiates
    in the weight's place) that receives its gradient computed in fp32: with bf16 weights the
    per-micro-batch gradient is not rounded to bf16 before the fp32 accumulation; in fp32 it is
    the same arithmetic as without the flag. Returns {id(weight): sink}."""
    sinks = {}
    for layer in moe_layers:
        if not layer.grouped:
            continue
        experts = layer.experts
        pair = tuple(nn.Parameter(np.zeros(tuple(w.shape), np.float32)) for w in (experts.weight1, experts.weight2))
        object.__setattr__(experts, "grad_sinks", pair)  # not a parameter of the module: never saved or updated
        sinks[id(experts.weight1)], sinks[id(experts.weight2)] = pair
    return sinks


class SharedExpert(nn.Module):
    """An MLP every token passes through; with a gate, scaled by sigmoid(x . gate_weight)."""

    recompute_activation = False  # GPTModel.use_memory

    def __init__(self, cfg: ModelConfig, size: int, gated: bool):
        super().__init__()
        self.activation = mlp_activation(cfg)
        width = 2 * size if cfg.gated else size
        self.linear_fc1 = linear(cfg, "linear_fc1", cfg.hidden_size, width, False, cfg.init_method_std)
        self.linear_fc2 = linear(cfg, "linear_fc2", size, cfg.hidden_size, False,
                                 cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers))
        self.gate_weight = _param((1, cfg.hidden_size), std=cfg.init_method_std) if gated else None

    def forward(self, x):
        y = self.linear_fc2(recompute.activation(self.activation, self.linear_fc1(x), self.recompute_activation))
        if self.gate_weight is not None:
            y = y * ops.sigmoid(ops.linear(x, self.gate_weight))
        return y


class MoESeams:
    """Where parallelism changes an MoE layer (parallel/experts.py fills them in); on one
    device each is the identity and dispatching keeps every token here.

    layer_input(x)      [b, s, h] as the layer receives it -> the tokens it routes
    expert_input(flat)  the routed tokens before they reach the experts
    expert_output(rows) the experts' output rows (partial sums under tensor parallelism)
    layer_output(y)     the layer's output -> as the next layer expects it
    dispatch(experts, tokens, routing, grouped, pad_to)
                        every kept assignment through its expert, weighted back to its
                        token: [T, h] -> [T, h] float32 (the token dispatcher)
    sequence_counts(counts)
                        [groups, E] assignments of this rank's share of the sequences ->
                        (those of the whole sequences, how many shares each is cut in):
                        the load-balancing loss's fractions (context parallelism)
    loss_share()        the weight of this rank's aux and z losses (1 / TP where the TP
                        ranks route shares and their router gradients are summed)
    """

    def sequence_counts(self, counts):
        return counts, 1

    def loss_share(self) -> float:
        return 1.0

    def layer_input(self, x):
        return x

    def expert_input(self, flat):
        return flat

    def expert_output(self, rows):
        return rows

    def layer_output(self, y):
        return y

    def dispatch(self, experts, tokens, routing, grouped: bool, pad_to: int | None, zero_memory: str = "disable"):
        route = self.route(routing, pad_to)
        return through_route(route, experts, tokens, routing.weights, grouped, zero_memory)

    def route(self, routing, pad_to: int | None) -> "Route":
        """Where each kept assignment goes and comes back: here, sorted by expert."""
        order = assignment_order(routing)
        counts, pad, unpad = padding(routing.tokens_per_expert, pad_to)

        def arrive(tokens):
            return pad(ops.index_select(tokens, 0, ops.tensor(order // routing.experts.shape[1])))

        def leave(out, weights):
            return weigh_back(self.expert_output(unpad(out)), order, weights)

        return Route(arrive, counts, leave)


@dataclasses.dataclass
class Route:
    """One MoE layer's token dispatch for one forward (MoESeams.route): ``arrive(tokens)`` the
    rows at this rank's experts, sorted by expert, ``counts`` of each; ``leave(out, weights)``
    the experts' output rows back to their tokens, weighted: [T, h] float32. Host work and the
    exchanges of counts are done when it is made; arrive and leave hold the tensor exchanges,
    so a recomputation runs them again."""

    arrive: Callable
    counts: np.ndarray
    leave: Callable


def through_route(route: Route, experts, tokens, weights, grouped: bool, zero_memory: str = "disable"):
    """The routed experts' output [T, h] float32, keeping for backward what --moe-zero-memory
    leaves: everything (disable); fc1's output only, the dispatched rows and the activation and
    fc2 recomputed (level0); the layer's input only, the whole dispatch recomputed (level1)."""
    if zero_memory == "level1":
        features.note_used("moe-zero-memory")
        return recompute.checkpoint(lambda t, w: route.leave(experts(route.arrive(t), route.counts, grouped), w),
                                    tokens, weights)
    if zero_memory == "level0":
        features.note_used("moe-zero-memory")
        h = recompute.checkpoint(lambda t: experts.first(route.arrive(t), route.counts, grouped), tokens)
        return route.leave(recompute.checkpoint(lambda x: experts.second(x, route.counts, grouped), h), weights)
    return route.leave(experts(route.arrive(tokens), route.counts, grouped), weights)


def padding(counts, pad_to: int | None):
    """(counts as the experts see them, pad(rows), unpad(out)): with ``pad_to`` every expert
    takes exactly that many rows, zero rows after its own (--moe-pad-expert-input-to-capacity:
    fixed shapes for kernels that want them), whose outputs are dropped."""
    counts = np.asarray(counts, np.int64)
    if pad_to is None:
        return counts, (lambda rows: rows), (lambda out: out)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    real = np.concatenate([e * pad_to + np.arange(c) for e, c in enumerate(counts)] + [np.zeros(0)]).astype(np.int64)

    def pad(rows):
        n = rows.shape[0]
        padded = np.full((len(counts), pad_to), n, np.int64)  # row n of [rows; 0] is the zero row
        for e, (start, c) in enumerate(zip(starts, counts)):
            padded[e, :c] = np.arange(start, start + c)
        source = ops.cat([rows, ops.zeros((1, rows.shape[-1]), dtype=ops.dtype_of(rows))], dim=0)
        return ops.index_select(source, 0, ops.tensor(padded.reshape(-1)))

    return np.full(len(counts), pad_to), pad, (lambda out: ops.index_select(out, 0, ops.tensor(real)))


class Router(Linear):
    """Hidden states to expert logits (with a trained bias under --add-bias-linear, as
    megatron-core's and GPT-OSS's); with aux-loss-free balancing (``enable_expert_bias``)
    also ``expert_bias`` [E]: float32 state the step's loads move (training/routing.py), never
    the optimizer. It is model state, saved and converted with the weights, as megatron-core's
    buffer ``mlp.router.expert_bias`` and DeepSeek-V3's ``e_score_correction_bias`` are."""

    def __init__(self, hidden: int, experts: int, std: float, expert_bias: bool, bias: bool = False,
                 float32: bool = False):
        super().__init__(hidden, experts, bias, std)
        self.expert_bias = nn.Parameter(np.zeros(experts, np.float32), requires_grad=False) if expert_bias else None
        self.float32 = float32  # --router-gating-in-fp32

    def forward(self, x):
        if not self.float32 or ops.dtype_of(x) == "float32":
            return super().forward(x)
        return ops.linear(ops.cast(x, "float32"), ops.cast(self.weight, "float32"),
                          None if self.bias is None else ops.cast(self.bias, "float32"))


@dataclasses.dataclass
class MoEStart:
    """MoELayer.begin's result: ``x`` the layer's input as the seams give it [b, s, h]; ``tokens``
    the routed tokens [T, h] as the experts' seam gives them; ``routed`` the routing of the real
    experts; ``pad_to`` each expert's row count under --moe-pad-expert-input-to-capacity;
    ``zero_experts`` the zero-computation experts' share [T, h] float32, or None; ``shape`` and
    ``dtype``: x's, the output's."""

    x: object
    tokens: object
    routed: router.Routing | None
    pad_to: int | None
    zero_experts: object | None
    shape: tuple  # x's, which the output takes
    dtype: str


class MoELayer(nn.Module):
    """x [b, s, hidden] -> [b, s, hidden]; ``self.routing`` keeps the last call's routing
    (its aux and z losses, tokens per expert) for the model's loss, and ``self.stats`` sums
    them over the calls since ``reset_stats()`` for the log."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, number: int = 0):
        super().__init__()
        self.moe, self.number = moe, number  # number: the layer's place in the whole model
        self.router = Router(cfg.hidden_size, moe.slots, cfg.init_method_std, moe.enable_expert_bias,
                             cfg.add_bias_linear, cfg.router_float32)
        self.experts = Experts(cfg, moe)
        self.shared_experts = (SharedExpert(cfg, moe.shared_expert_size, moe.shared_expert_gate)
                               if moe.shared_expert_size else None)
        self.grouped = "grouped_matmul" in cfg.fused  # --moe-grouped-gemm; else expert by expert
        self.zero_memory = "disable"  # --moe-zero-memory (GPTModel.use_memory): what the dispatch keeps
        self.seams = MoESeams()
        self.routing = None
        # a compiled step (training/compiled.py) routes on the device: the expert bias arrives
        # as a graph input here, and the routing's figures leave as outputs (figures())
        self.on_device, self.bias_input = False, None
        self.reset_stats()

    def expert_bias(self) -> np.ndarray | None:
        """The router's expert bias (aux-loss-free balancing), or None."""
        bias = self.router.expert_bias
        return None if bias is None else ops.to_numpy(bias).astype(np.float32)

    def set_expert_bias(self, values) -> None:
        nn.assign(self.router.expert_bias, np.asarray(values, np.float32))

    def keep_expert_bias_float32(self, values) -> None:
        """After the layer was cast to a 16-bit dtype: the bias back in float32 with these values
        (saved before the cast), as megatron-core keeps it; in bfloat16 its 1e-3 steps would
        round away."""
        if values is not None:
            self.router.expert_bias = nn.Parameter(np.asarray(values, np.float32), requires_grad=False)

    def use_seams(self, seams: MoESeams) -> None:
        self.seams = seams

    def reset_stats(self) -> None:
        self.stats = {"calls": 0, "aux_loss": 0.0, "z_loss": 0.0, "dropped": 0,
                      "tokens_per_expert": np.zeros(self.moe.slots, np.int64)}

    def figures(self):
        """[3 + E] float32 of the last device routing: aux loss, z loss, dropped (0), tokens per expert."""
        r = self.routing
        return ops.cat([ops.stack([r.aux_loss, r.z_loss, ops.zeros(())]), r.tokens_per_expert], dim=0)

    def record(self, figures: np.ndarray) -> None:
        """Add one device routing's figures() to the stats, as forward does for host routing."""
        self.stats["calls"] += 1
        self.stats["aux_loss"] += float(figures[0])
        self.stats["z_loss"] += float(figures[1])
        self.stats["tokens_per_expert"] += np.rint(figures[3:]).astype(np.int64)

    def forward(self, x):
        if self.on_device:
            return self._forward_on_device(x)
        start = self.begin(x)
        y = self.seams.dispatch(self.experts, start.tokens, start.routed, self.grouped, start.pad_to, self.zero_memory)
        return self.finish(y, start, self.shared_output(start.x))

    def _logits(self, x):
        """(the layer's input as the seams give it [b, s, h], flattened [T, h], the router's float32
        logits [T, E], the expert bias or None)."""
        x = self.seams.layer_input(x)
        b, s, h = x.shape
        flat = ops.reshape(x, (b * s, h))
        logits = ops.cast(self.router(self._jittered(flat)), "float32")
        bias = self.bias_input if self.on_device else self.router.expert_bias
        features.note_used("moe")
        return x, flat, logits, None if bias is None else ops.cast(bias, "float32")

    def _forward_on_device(self, x):
        x, flat, logits, bias = self._logits(x)
        features.note_used("moe-compile")
        routing = self.routing = router.route_on_device(logits, self.moe, bias, sequences=x.shape[0])
        y = self.experts.dense(self.seams.expert_input(flat), routing.combine, self.seams.expert_output)
        return self.finish(y, MoEStart(x, None, None, None, None, tuple(x.shape), ops.dtype_of(x)), self.shared_output(x))

    def begin(self, x) -> "MoEStart":
        """forward up to the dispatch: the routing (kept for the model's loss and the log), and
        what the dispatch and finish() take. --moe-fb-overlap runs the dispatch's exchanges
        between the two (training/fb_overlap.py)."""
        seams = self.seams
        x, flat, logits, bias = self._logits(x)
        b, s = x.shape[0], x.shape[1]
        routing = self.routing = router.route(logits, self.moe, bias, sequences=b, counts_over=seams.sequence_counts,
                                              training=nn.is_training(self))
        share = seams.loss_share()
        if share != 1.0:
            routing = self.routing = dataclasses.replace(routing, aux_loss=routing.aux_loss * share,
                                                         z_loss=routing.z_loss * share)
        routed, identity = self._without_zero_experts(routing)
        if self.grouped:
            features.note_used("gmm")
        if not recompute.recomputing():  # a recomputation in backward routes the same tokens again
            stats = self.stats
            stats["calls"] += 1
            stats["aux_loss"] += float(ops.to_numpy(routing.aux_loss))
            stats["z_loss"] += float(ops.to_numpy(routing.z_loss))
            stats["dropped"] += routing.dropped
            stats["tokens_per_expert"] += routing.tokens_per_expert
        pad_to = router.capacity(b * s, self.moe) if self.moe.pad_to_capacity else None
        # the zero-computation experts' share: the token itself, weighted (whole on every rank)
        kept = None if identity is None else ops.cast(flat, "float32") * identity
        return MoEStart(x, seams.expert_input(flat), routed, pad_to, kept, tuple(x.shape), ops.dtype_of(x))

    def shared_output(self, x):
        """The shared expert's output on begin()'s ``x`` [b, s, h] (under TP with token shares it
        gathers the sequence), or None."""
        return None if self.shared_experts is None else self.shared_experts(x)

    def finish(self, y, start: "MoEStart", shared=None):
        """The layer's output from the dispatch's [T, h] float32 and the shared expert's output."""
        if start.zero_experts is not None:
            y = y + start.zero_experts
        y = ops.reshape(ops.cast(y, start.dtype), start.shape)
        if shared is not None:
            y = y + shared
        return self.seams.layer_output(y)

    def _without_zero_experts(self, routing):
        """(the routing of the real experts, each token's summed weight [T, 1] of the
        zero-computation experts it chose, or None): LongCat-Flash's experts past num_experts
        compute nothing and return their token times its weight."""
        moe = self.moe
        if not moe.zero_experts:
            return routing, None
        features.note_used("moe-zero-experts")
        zero = routing.experts >= moe.num_experts
        real = ops.tensor((~zero).astype(np.float32))
        identity = ops.sum(routing.weights * (1.0 - real), dim=-1, keepdim=True)
        routed = dataclasses.replace(routing, weights=routing.weights * real, kept=routing.kept & ~zero,
                                     experts=np.where(zero, 0, routing.experts),
                                     tokens_per_expert=routing.tokens_per_expert[:moe.num_experts])
        return routed, identity

    def _jittered(self, flat):
        """The router's input: in training with --moe-input-jitter-eps, ``flat`` times noise uniform
        in [1 - eps, 1 + eps] (megatron-core's input jitter; the experts get ``flat`` itself), drawn
        from the default stream: the same on every TP rank (recompute restores the stream)."""
        eps = self.moe.input_jitter_eps
        if not eps or not nn.is_training(self):
            return flat
        features.note_used("moe-input-jitter")
        noise = ops.rand(tuple(flat.shape)) * (2.0 * eps) + (1.0 - eps)
        return flat * ops.cast(noise, ops.dtype_of(flat))


def assignment_order(routing: router.Routing) -> np.ndarray:
    """The kept assignments, as ids t * k + j, sorted by expert (token order within one)."""
    slots = np.flatnonzero(routing.kept.reshape(-1))
    return slots[np.argsort(routing.experts.reshape(-1)[slots], kind="stable")].astype(np.int64)


def run_experts(experts: Experts, rows, counts, grouped: bool, pad_to: int | None = None):
    """rows [N, h] sorted by expert, ``counts[e]`` of them for local expert e -> their
    outputs (``pad_to``: padding())."""
    counts, pad, unpad = padding(counts, pad_to)
    return unpad(experts(pad(rows), counts, grouped))


def weigh_back(rows, order: np.ndarray, weights):
    """rows [N, h], the expert outputs of the assignments ``order`` -> [T, h] float32: per
    token the sum over its slots of weight x row (``weights`` [T, k]). Back to (token, slot) order by a gather (a
    scatter-add with repeated indices is not deterministic on every CPU backend); dropped
    slots read a zero row and have weight 0."""
    t, k = weights.shape
    h = rows.shape[-1]
    where = np.full(t * k, len(order), np.int64)
    where[order] = np.arange(len(order))
    rows = ops.cat([ops.cast(rows, "float32"), ops.zeros((1, h))], dim=0)
    per_slot = ops.reshape(ops.index_select(rows, 0, ops.tensor(where)), (t, k, h))
    return ops.sum(per_slot * ops.unsqueeze(weights, -1), dim=1)


class _CarryLoss(autograd.Function):
    @staticmethod
    def forward(ctx, x, side):
        return x * 1

    @staticmethod
    def backward(ctx, dx):
        return dx, ops.ones(())


def with_router_losses(x, losses):
    """``x`` unchanged, with the scalar ``losses`` riding on it: the backward pass gives them
    the gradient one, as a term of the (scaled) loss being differentiated. Megatron's
    MoEAuxLossAutoScaler in spirit: a pipeline stage whose output is an activation, not a
    loss, still trains its routers, and the loss the trainer reports stays the
    language-model loss."""
    return _CarryLoss.apply(x, losses)


class MoEModel(GPTModel):
    """The decoder-only transformer whose layers in ``cfg.moe_layers`` (all by default) have
    an MoE MLP: Mixtral, Qwen2-MoE, Qwen3-MoE. Its loss is the language-model loss; training
    adds the routers' aux and z losses to the gradient (router_losses, with_router_losses)."""

    def make_mlp(self, number: int) -> nn.Module:
        return MoELayer(self.cfg, self.cfg.moe, number) if self.cfg.is_moe_layer(number) else MLP(self.cfg)

    def moe_layers(self) -> list:
        return [layer.mlp for _, layer in self.transformer_layers() if isinstance(layer.mlp, MoELayer)]

    def router_losses(self, layers=None):
        """The sum of this model's (or pipeline chunk's) MoE layers' aux and z losses from
        its last forward (``layers``: of those MoE layers only): regularisers the trainer adds
        to the gradient (with_router_losses), not to the reported loss."""
        total = ops.zeros(())
        for layer in self.moe_layers() if layers is None else layers:
            total = total + layer.routing.aux_loss + layer.routing.z_loss
        return total
