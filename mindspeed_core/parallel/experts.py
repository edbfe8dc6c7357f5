"""Expert parallelism, and tensor parallelism inside MoE layers (models/moe.py).

Expert parallelism (--expert-model-parallel-size EP) cuts every MoE layer's experts over the
EP group, EP consecutive data-parallel ranks: group rank j holds experts [j E/EP, (j+1) E/EP).
Each rank routes its own tokens as on one device (same capacity, drops and aux loss), then
a token dispatcher (--moe-token-dispatcher-type) brings the rows to their experts' ranks:

    alltoall   the rows (sorted by expert) go straight to the rank holding their expert in
               one uneven all-to-all; the outputs come back the same way and are weighted
               on the token's own rank. Traffic: the routed rows, twice.
    allgather  every rank gathers all the group's tokens and routing, runs its experts on
               the assignments that chose them, weights them, and a reduce-scatter sums each
               token's output back to its rank. Traffic: EP x the tokens, twice; no
               token-count exchange, fixed shapes.

The dispatchers' backward passes send the gradients back along the same paths, so an expert's
weight gradient already sums the contributions of every token of its EP group; the trainer
then averages it over the expert-data-parallel group (the DP ranks holding the same experts,
and their CP ranks, which routed other tokens) with the data-parallel scale (parallel/plan.py
``expert``). Under context parallelism each rank routes its share of every sequence, and the
load-balancing loss counts the whole sequences (ExpertParallelSeams.sequence_counts).

Tensor parallelism cuts the experts like the dense MLP (weight1's columns, SwiGLU's gate and
up halves apart, bias1 with them; weight2's rows, bias2 added by one rank) and the shared
expert as the dense MLP; the layer works on the whole sequence on every TP rank (gathered under --sequence-parallel), so routing is the
one-device routing, and the experts' partial rows are summed over TP before the weighting.
Router and shared-expert gate thus see every token on every TP rank: their gradients are
whole, not partial, even under sequence parallelism. With --expert-tensor-parallel-size 1 the
experts are not cut: each TP rank runs its whole experts on the whole sequence, their rows and
gradients whole (nothing summed over TP). With EP as well (megatron-core's layout: the EP
groups reach across the TP ranks, parallel/state.py ``ep_over_tp``) each TP rank routes its own
sequence-parallel share instead: the load-balancing counts are summed over TP, the router losses
weigh 1 / TP, and the router's gradient is summed over TP (ExpertParallelSeams ``tp_shares``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mindspeed_core import dist, features, nn, ops
from mindspeed_core.errors import MindSpeedError
from mindspeed_core.models import lora
from mindspeed_core.memory import recompute
from mindspeed_core.models.moe import (MoELayer, MoESeams, Route, assignment_order, padding, run_experts,
                                       through_route, weigh_back)
from mindspeed_core.parallel import mappings
from mindspeed_core.parallel.layers import ColumnParallelLinear, RowParallelLinear
from mindspeed_core.parallel.sharding import shard

DISPATCHERS = ("alltoall", "allgather")


def check_layout(cfg, ep: int, dp: int | None = None) -> None:
    """Refuse an expert-parallel size the model or the job cannot be cut by."""
    if ep == 1:
        return
    if cfg.moe is None:
        raise MindSpeedError(f"--expert-model-parallel-size {ep} needs MoE layers (--num-experts)")
    if cfg.moe.num_experts % ep:
        raise MindSpeedError(f"expert parallel size {ep} does not divide the number of experts "
                             f"({cfg.moe.num_experts})")
    if dp is not None and dp % ep:
        raise MindSpeedError(f"expert parallel size {ep} does not divide the data-parallel size {dp}: expert "
                             f"parallelism is carved out of the data-parallel ranks")


def _host_all_gather(array: np.ndarray, group) -> np.ndarray:
    """[n, ...] of every group rank's host array (same shape on each)."""
    return ops.to_numpy(dist.all_gather(ops.unsqueeze(ops.tensor(np.ascontiguousarray(array)), 0), group=group))


def _take(rows, index: np.ndarray):
    """rows[index]; no rows stay as they are (MindSpore's gradient of a gather from an empty
    tensor fails: a rank that receives no token must still run its backward pass)."""
    return rows if rows.shape[0] == 0 else ops.index_select(rows, 0, ops.tensor(index))


class ExpertParallelSeams(MoESeams):
    """An MoE layer's seams under TP (with or without SP), EP and CP."""

    def __init__(self, ps, sequence_parallel: bool, dispatcher: str, num_experts: int, experts_whole: bool = False,
                 context_shares: bool = False, overlap: bool = False):
        self.overlap = overlap  # --moe-alltoall-overlap-comm: the alltoall dispatch in chunks that overlap
        self.tp = ps.group("tp") if ps.tp > 1 else None
        self.sp = sequence_parallel
        self.ep = ps.group("ep") if ps.ep > 1 else None
        self.ep_size, self.ep_rank, self.tp_size = ps.ep, ps.local_rank("ep"), ps.tp
        self.dispatcher, self.local = dispatcher, num_experts // ps.ep
        # whole experts on every TP rank: their rows and input gradients are whole, not partial
        self.experts_tp = None if experts_whole else self.tp
        # the groups that cut each sequence in shares, each rank routing its own: the CP ranks, and
        # with EP across TP (ps.ep_over_tp, under SP) the TP ranks, each its sequence-parallel share
        self.tp_shares = ps.ep_over_tp and self.tp is not None and sequence_parallel
        self.cp_shares = context_shares
        self.shares = [g for g, on in ((ps.group("cp"), context_shares), (self.tp, self.tp_shares)) if on]
        self.shares_size = (ps.cp if context_shares else 1) * (ps.tp if self.tp_shares else 1)

    def sequence_counts(self, counts):  # each CP (and TP) rank routes its share of every sequence
        if not self.shares:
            return counts, 1
        if self.tp_shares:
            features.note_used("expert-parallel-across-tp")
        if self.cp_shares:
            features.note_used("moe-context-parallel")
        summed = ops.tensor(counts.astype(np.float32))  # exact below 2**24
        for group in self.shares:
            summed = dist.all_reduce(summed, group=group)
        return ops.to_numpy(summed), self.shares_size

    def loss_share(self) -> float:
        """The weight of this rank's router losses: 1 / TP where the TP ranks route shares of the
        sequences (the router's gradient is summed over them, so each adds its share's part of
        the mean); CP ranks' gradients are averaged, so theirs stay 1."""
        return 1.0 / self.tp_size if self.tp_shares else 1.0

    def layer_input(self, x):  # the whole sequence; its gradient is whole on every rank
        if self.tp_shares:  # this rank's sequence-parallel share, routed by itself
            return x
        return mappings.gather_from_region(x, self.tp, dim=1) if self.sp else x

    def expert_input(self, flat):  # the experts' input gradients are partial over TP: summed
        return mappings.copy_to_region(flat, self.experts_tp)

    def expert_output(self, rows):
        return mappings.reduce_from_region(rows, self.experts_tp)

    def layer_output(self, y):
        if self.tp_shares:
            return y
        return mappings.scatter_to_region(y, self.tp, dim=1) if self.sp else y

    def dispatch(self, experts, tokens, routing, grouped, pad_to, zero_memory="disable"):
        if self.ep is None:
            return super().dispatch(experts, tokens, routing, grouped, pad_to, zero_memory)
        features.note_used("expert-parallel")
        features.note_used(f"moe-{self.dispatcher}-dispatcher")
        pad = None if pad_to is None else pad_to * self.ep_size  # each source rank fills up to pad_to
        if self.dispatcher == "alltoall" and self.overlap:
            features.note_used("moe-alltoall-overlap")
            if zero_memory == "level1":  # the whole exchange again in backward (level0: refused with overlap)
                features.note_used("moe-zero-memory")
                return recompute.checkpoint(lambda t, w: self._all_to_all_overlapped(
                    experts, t, dataclasses.replace(routing, weights=w), grouped, pad), tokens, routing.weights)
            return self._all_to_all_overlapped(experts, tokens, routing, grouped, pad)
        route = self._all_to_all(routing, pad) if self.dispatcher == "alltoall" else self._all_gather(routing, pad)
        if route is None:  # all-gather: none of the group's tokens chose this rank's experts
            return self._nothing_chosen(tokens, routing.weights)
        return through_route(route, experts, tokens, routing.weights, grouped, zero_memory)

    def _arriving(self, routing) -> np.ndarray:
        """[source rank, local expert]: the rows every rank of the EP group sends this rank's
        experts (a host all-gather of the group's counts)."""
        table = _host_all_gather(routing.tokens_per_expert, self.ep)  # [source rank, expert]
        return table[:, self.ep_rank * self.local:(self.ep_rank + 1) * self.local]

    def _all_to_all(self, routing, pad) -> Route:
        plan = self.all_to_all_plan(routing, pad)

        def arrive(tokens):
            return plan.arrived(mappings.all_to_all_rows(plan.leaving(tokens), self.ep, plan.send, plan.receive))

        def leave(out, weights):
            return plan.weigh(mappings.all_to_all_rows(plan.returning(out), self.ep, plan.receive, plan.send), weights)

        return Route(arrive, plan.counts, leave)

    def all_to_all_plan(self, routing, pad) -> "AllToAllPlan":
        """The alltoall dispatcher's route of one forward, its exchanges left to the caller (_all_to_all
        makes them; --moe-fb-overlap starts them and computes on another micro-batch meanwhile)."""
        n, local = self.ep_size, self.local
        order = assignment_order(routing)
        mine = self._arriving(routing)  # [source rank, local expert]
        # regroup expert-major (then source), as the experts want their rows together
        starts = np.concatenate([[0], np.cumsum(mine.reshape(-1))[:-1]]).reshape(mine.shape)
        perm = np.concatenate([np.arange(starts[i, e], starts[i, e] + mine[i, e])
                               for e in range(local) for i in range(n)] + [np.zeros(0)]).astype(np.int64)
        counts, pad_rows, unpad = padding(mine.sum(0), pad)
        return AllToAllPlan(self, order, routing.experts.shape[1], routing.tokens_per_expert.reshape(n, local).sum(1),
                            mine.sum(1), perm, counts, pad_rows, unpad)

    def _all_gather(self, routing, pad) -> Route | None:
        me, local = self.ep_rank, self.local
        chosen = np.where(routing.kept, routing.experts, -1)  # dropped: -1
        chosen = _host_all_gather(chosen, self.ep).reshape(-1, chosen.shape[1])
        k = chosen.shape[1]
        slots = np.flatnonzero((chosen.reshape(-1) // local == me) & (chosen.reshape(-1) >= 0))
        order = slots[np.argsort(chosen.reshape(-1)[slots], kind="stable")].astype(np.int64)
        if order.size == 0:
            return None
        counts, pad_rows, unpad = padding(np.bincount(chosen.reshape(-1)[order] - me * local, minlength=local), pad)

        def arrive(tokens):
            everyone = mappings.gather_tokens(tokens, self.ep)  # [n T, h]
            return pad_rows(ops.index_select(everyone, 0, ops.tensor(order // k)))

        def leave(out, weights):
            weights = mappings.gather_tokens(weights, self.ep)  # [n T, k]
            return mappings.reduce_scatter_tokens(weigh_back(self.expert_output(unpad(out)), order, weights), self.ep)

        return Route(arrive, counts, leave)

    def _nothing_chosen(self, tokens, weights):
        """A zero contribution, still a function of both gathers, so their backward collectives
        run here as elsewhere (and no empty gather, whose gradient MindSpore cannot take)."""
        everyone = mappings.gather_tokens(tokens, self.ep)
        weights = mappings.gather_tokens(weights, self.ep)
        partial = everyone * 0.0 + ops.sum(weights) * 0.0
        return mappings.reduce_scatter_tokens(ops.cast(partial, "float32"), self.ep)

    def _all_to_all_overlapped(self, experts, tokens, routing, grouped, pad):
        """The alltoall dispatch in chunks of the local experts (--moe-alltoall-overlap-comm): every
        chunk's rows leave at once, each gathered straight from the tokens (the permutation fused
        with the dispatch); as a chunk arrives its experts run while the later chunks travel, and its
        outputs start back while the next chunk's experts run. Each expert gets the same rows in the
        same order as in one exchange, and the outputs are put back in _all_to_all's order before the
        weighting: the same bits."""
        n, local = self.ep_size, self.local
        k = routing.experts.shape[1]
        order = assignment_order(routing)
        counts = np.asarray(routing.tokens_per_expert, np.int64)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])  # where each expert's assignments start in order
        mine = self._arriving(routing)  # [source rank, local expert]
        chunks, placed = [], []
        for e in range(local):  # one chunk per local expert: its rows from every source rank
            sent = np.concatenate([np.arange(starts[j * local + e], starts[j * local + e] + counts[j * local + e])
                                   for j in range(n)]).astype(np.int64)
            send = counts.reshape(n, local)[:, e]
            arrival = mappings.start_all_to_all_rows(_take(tokens, order[sent] // k), self.ep, send, mine[:, e])
            chunks.append((e, send, arrival))
            placed.append(sent)
        leaving = []
        for e, send, arrival in chunks:
            rows = arrival.wait()  # source-major: one expert's rows, already together
            only = np.zeros(local, np.int64)
            only[e] = mine[:, e].sum()
            out = self.expert_output(run_experts(experts, rows, only, grouped, pad))
            leaving.append(mappings.start_all_to_all_rows(out, self.ep, mine[:, e], send))
        returned = [arrival.wait() for arrival in leaving]
        returned = returned[0] if len(returned) == 1 else ops.cat(returned, dim=0)
        back = np.argsort(np.concatenate(placed)).astype(np.int64)  # to _all_to_all's order of assignments
        return weigh_back(_take(returned, back), order, routing.weights)


@dataclasses.dataclass
class AllToAllPlan:
    """One forward's alltoall dispatch between its two exchanges: ``leaving(tokens)`` the rows
    to send, ``send[j]`` of them to EP rank j; ``receive[i]`` arrive from rank i, and
    ``arrived(rows)`` puts them in the experts' order (``counts`` each); ``returning(out)`` the
    experts' outputs to send back, the same counts reversed, and ``weigh(rows, weights)`` the
    returned rows back on their tokens: [T, h] float32."""

    seams: ExpertParallelSeams
    order: np.ndarray
    topk: int
    send: np.ndarray
    receive: np.ndarray
    perm: np.ndarray
    counts: np.ndarray
    pad_rows: object
    unpad: object

    def leaving(self, tokens):
        return ops.index_select(tokens, 0, ops.tensor(self.order // self.topk))

    def arrived(self, rows):
        return self.pad_rows(_take(rows, self.perm))

    def returning(self, out):
        return _take(self.seams.expert_output(self.unpad(out)), np.argsort(self.perm).astype(np.int64))

    def weigh(self, rows, weights):
        return weigh_back(rows, self.order, weights)


def parallelize_moe_layers(model, ps, sequence_parallel: bool, dispatcher: str, experts_whole: bool = False,
                           context_shares: bool = False, overlap: bool = False) -> dict:
    """Cut the MoE layers of ``model`` (a whole MoEModel or a pipeline chunk) for this rank
    and install their seams; returns {local parameter name: ParamPlan fields} for
    parallel.layers.parallelize. ``experts_whole``: --expert-tensor-parallel-size 1 under TP;
    ``context_shares``: each CP rank holds a share of every sequence (context parallelism)."""
    if dispatcher not in DISPATCHERS:
        raise MindSpeedError(f"unknown MoE token dispatcher {dispatcher!r}: choose one of {', '.join(DISPATCHERS)}")
    check_layout(model.cfg, ps.ep)
    overrides = {}
    for prefix, layer in model.transformer_layers():
        if isinstance(layer.mlp, MoELayer):
            fields = parallelize_moe_layer(layer.mlp, ps, sequence_parallel, dispatcher, model.cfg.gated, experts_whole,
                                           context_shares, overlap)
            overrides.update({f"{prefix}mlp.{name}": f for name, f in fields.items()})
    return overrides


def parallelize_moe_layer(mlp: MoELayer, ps, sequence_parallel: bool, dispatcher: str, gated: bool,
                          experts_whole: bool = False, context_shares: bool = False, overlap: bool = False) -> dict:
    """One MoE layer: keep this rank's experts (and their TP slices, unless ``experts_whole``:
    megatron-core's expert tensor parallel size 1, each TP rank running the whole experts on
    the whole sequence), cut the shared expert over TP, install the seams; returns {parameter
    name in the layer: ParamPlan fields}."""
    tp, tp_rank, ep, ep_rank = ps.tp, ps.local_rank("tp"), ps.ep, ps.local_rank("ep")
    expert_tp = 1 if experts_whole else tp
    # EP across TP (megatron-core's ETP 1 layout): each TP rank routes its own sequence-parallel
    # share, so the router, the shared expert's gate and input see other tokens on each TP rank
    shares = ps.ep_over_tp and tp > 1 and sequence_parallel
    if experts_whole and tp > 1:
        features.note_used("expert-tensor-parallel")
    swiglu = gated  # fc1's gate and up halves are cut apart
    fields = {}
    specs = {"weight1": ("swiglu", 2) if swiglu else ("split", 2), "weight2": ("split", 1)}
    if mlp.experts.bias1 is not None:  # fc1's bias cut with its columns; fc2's whole, added by TP rank 0
        specs.update(bias1=("swiglu", 1) if swiglu else ("split", 1), bias2=None)
        mlp.experts.output_bias = tp_rank == 0 or expert_tp == 1
    for name, spec in specs.items():
        full = np.split(ops.to_numpy(getattr(mlp.experts, name)), ep, axis=0)[ep_rank]
        cut = expert_tp > 1 and spec
        setattr(mlp.experts, name, nn.Parameter(shard(full, spec, tp, tp_rank) if cut else full))
        fields["experts." + name] = {"shard": spec if cut else None, "expert": True,
                                     "partial": spec is None and expert_tp > 1}  # bias2: only rank 0's gradient
    for name, param in lora.expert_factors(mlp.experts).items():
        # the factor on the side TP cuts (fc1's B: its columns; fc2's A: its rows) is cut with its
        # base; the other is whole, its gradient a partial sum over the TP ranks
        kind, which = name.split(".")
        spec = specs[which] if (which == "weight1") == (kind == "lora_B") else None
        full = np.split(ops.to_numpy(param), ep, axis=0)[ep_rank]
        cut = expert_tp > 1 and spec
        setattr(getattr(mlp.experts, kind), which, nn.Parameter(shard(full, spec, tp, tp_rank) if cut else full))
        fields["experts." + name] = {"shard": spec if cut else None, "expert": True,
                                     "partial": spec is None and expert_tp > 1}
    fields["router.weight"] = {"partial": shares}  # sees every token on every TP rank, or its share
    if mlp.router.bias is not None:
        fields["router.bias"] = {"partial": shares}
    if mlp.router.expert_bias is not None:  # the same on every rank, never trained
        fields["router.expert_bias"] = {"partial": False}
    shared = mlp.shared_experts
    if shared is not None:
        if shared.gate_weight is not None:
            fields["shared_experts.gate_weight"] = {"partial": shares}
        if tp > 1:  # on the whole sequence; with shares gathered from them, as a dense MLP under SP
            group, fc1_spec = ps.group("tp"), ("swiglu",) if swiglu else ("split", 0)
            shared.linear_fc1 = ColumnParallelLinear(shared.linear_fc1, group, shares, fc1_spec)
            shared.linear_fc2 = RowParallelLinear(shared.linear_fc2, group, shares)
            fields["shared_experts.linear_fc1.weight"] = {"shard": fc1_spec, "partial": False}
            fields["shared_experts.linear_fc2.weight"] = {"shard": ("split", 1), "partial": False}
            if lora.factors(shared.linear_fc1) is not None:  # as the dense MLP's (parallel/layers.py)
                fields["shared_experts.linear_fc1.lora_B.weight"] = {"shard": fc1_spec, "partial": False}
                fields["shared_experts.linear_fc1.lora_A.weight"] = {"partial": True}
            if lora.factors(shared.linear_fc2) is not None:
                fields["shared_experts.linear_fc2.lora_A.weight"] = {"shard": ("split", 1), "partial": False}
                fields["shared_experts.linear_fc2.lora_B.weight"] = {"partial": True}
    if tp > 1 or ep > 1 or context_shares:
        mlp.use_seams(ExpertParallelSeams(ps, sequence_parallel, dispatcher, mlp.moe.num_experts, experts_whole,
                                          context_shares, overlap))
    return fields
