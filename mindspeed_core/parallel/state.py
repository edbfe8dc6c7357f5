"""Process groups for every kind of parallelism, in Megatron-core's rank order.

A rank's coordinates, fastest-varying first (Megatron's default order "tp-cp-ep-dp-pp"):

    tp = r % TP
    cp = (r // TP) % CP
    dp = (r // (TP * CP)) % DP
    pp = r // (TP * CP * DP)

so tensor-parallel peers are neighbours (the fastest links on a node), and pipeline stages
are outermost. Context-parallel ranks hold the same parameters as data-parallel ones (each
sees other tokens), so gradients are averaged, and the distributed optimizer shards, over
"dp_cp": the DP x CP ranks of one (tp, pp) position (Megatron's data-parallel group with CP).
Expert parallelism splits the data-parallel dimension into EP-sized groups of consecutive DP
ranks ("ep": each holds 1/EP of every MoE layer's experts, and tokens travel between them);
the DP ranks holding the same experts, every EP-th one, with every CP rank of theirs (each saw
other tokens), form the expert-data-parallel group ("edp"), over which expert gradients are
reduced. With the experts whole on every TP rank (megatron-core's --expert-tensor-parallel-size
1, or MindSpeed's --moe-tp-extend-ep) the EP groups are megatron-core's instead
(``ep_over_tp``): EP consecutive ranks of a pipeline stage in rank order, so they reach across
the TP ranks first, then CP and DP (EP divides TP x CP x DP), and "edp" is every EP-th rank of
the stage. Every process builds every group (torch requires it; the MindSpore
backend creates only the groups it belongs to).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mindspeed_core import dist
from mindspeed_core.errors import MindSpeedError

_STATE: dict = {}


@dataclass
class ParallelState:
    world: int
    rank: int
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    groups: dict = field(default_factory=dict)
    ep_over_tp: bool = False  # the EP groups reach across TP x DP (megatron-core's layout with ETP 1)

    def coords(self, r: int) -> dict:
        tp, cp, dp = self.tp, self.cp, self.dp
        return {"tp": r % tp, "cp": (r // tp) % cp, "dp": (r // (tp * cp)) % dp, "pp": r // (tp * cp * dp)}

    def rank_of(self, tp=0, cp=0, dp=0, pp=0) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    # accessors the layers use
    def group(self, kind: str):
        return self.groups[kind]

    def size(self, kind: str) -> int:
        edp = self.tp * self.cp * self.dp // self.ep if self.ep_over_tp else self.dp // self.ep * self.cp
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "cp": self.cp, "ep": self.ep,
                "dp_cp": self.dp * self.cp, "edp": edp}[kind]

    def subgroup(self, kind: str, size: int, strided: bool = False):
        """This rank's group among consecutive ``size``-rank slices of its ``kind`` group
        (``strided``: among the groups of every ``size``-th rank instead, e.g. the ring
        across Ulysses groups). Built for every such group of the job on first use (all
        ranks must ask)."""
        key = f"{kind}/{size}{'/strided' if strided else ''}"
        if key not in self.groups:
            for ranks in _group_ranks(self, kind):
                slices = ([ranks[i::size] for i in range(size)] if strided
                          else [ranks[i:i + size] for i in range(0, len(ranks), size)])
                for members in slices:
                    g = dist.new_group(members)
                    if self.rank in members:
                        self.groups[key] = g
        return self.groups[key]

    def local_rank(self, kind: str) -> int:
        c = self.coords(self.rank)
        if self.ep_over_tp and kind in ("ep", "edp"):  # the place among the stage's ranks, TP fastest
            place = c["tp"] + self.tp * (c["cp"] + self.cp * c["dp"])
            return place % self.ep if kind == "ep" else place // self.ep
        if kind == "ep":
            return c["dp"] % self.ep
        if kind == "edp":  # its members in global rank order: dp, then cp
            return c["cp"] + self.cp * (c["dp"] // self.ep)
        if kind == "dp_cp":
            return c["cp"] + self.cp * c["dp"]
        return c[kind]


def _group_ranks(ps: ParallelState, kind: str) -> list[list[int]]:
    """Every group of the given kind, as lists of global ranks."""
    out = []
    dims = {"tp": ps.tp, "cp": ps.cp, "dp": ps.dp, "pp": ps.pp}
    if kind == "dp_cp":  # the ranks of one (tp, pp) position
        return [[r for r in range(ps.world) if ps.coords(r)["tp"] == t and ps.coords(r)["pp"] == p]
                for p in range(ps.pp) for t in range(ps.tp)]
    others = [k for k in ("tp", "cp", "dp", "pp") if k != kind]
    seen = set()
    for r in range(ps.world):
        c = ps.coords(r)
        key = tuple(c[k] for k in others)
        if key in seen:
            continue
        seen.add(key)
        out.append([ps.rank_of(**{**c, kind: i}) for i in range(dims[kind])])
    return out


def initialize(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, ep_over_tp: bool = False) -> ParallelState:
    """Build the groups for this job (after dist.init()); the data-parallel size is what
    remains of the world. ``ep_over_tp``: the EP groups reach across TP x DP (see above)."""
    world, rank = dist.world_size(), dist.rank()
    model = tp * pp * cp
    if min(tp, pp, cp, ep) < 1 or world % model:
        raise MindSpeedError(f"world size {world} is not divisible by tensor ({tp}) x pipeline ({pp}) x "
                             f"context ({cp}) parallel sizes")
    dp = world // model
    ep_over_tp = ep_over_tp and ep > 1
    if ep_over_tp and (tp * cp * dp) % ep:
        raise MindSpeedError(f"expert parallel size {ep} across the tensor-parallel ranks must divide TP x CP x DP "
                             f"({tp} x {cp} x {dp})")
    if dp % ep and not ep_over_tp:
        raise MindSpeedError(f"expert parallel size {ep} does not divide the data-parallel size {dp}")
    ps = ParallelState(world, rank, tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, ep_over_tp=ep_over_tp)
    for kind in ("tp", "cp", "dp", "pp"):
        for ranks in _group_ranks(ps, kind):
            g = dist.new_group(ranks)
            if rank in ranks:
                ps.groups[kind] = g
    if cp == 1:
        ps.groups["dp_cp"] = ps.groups["dp"]
    else:
        for ranks in _group_ranks(ps, "dp_cp"):
            g = dist.new_group(ranks)
            if rank in ranks:
                ps.groups["dp_cp"] = g
    if pp > 1:  # the first and last stage: tied embeddings' gradients are summed here
        for ranks in _group_ranks(ps, "pp"):
            g = dist.new_group([ranks[0], ranks[-1]])
            if rank in (ranks[0], ranks[-1]):
                ps.groups["embedding"] = g
    if ep_over_tp:
        for p in range(pp):  # the stage's ranks, TP fastest: EP consecutive ones, and every EP-th one
            ranks = [ps.rank_of(tp=t, cp=c, dp=d, pp=p) for d in range(dp) for c in range(cp) for t in range(tp)]
            for kind, groups in (("ep", [ranks[i:i + ep] for i in range(0, len(ranks), ep)]),
                                 ("edp", [ranks[i::ep] for i in range(ep)])):
                for members in groups:
                    g = dist.new_group(members)
                    if rank in members:
                        ps.groups[kind] = g
        _STATE["current"] = ps
        return ps
    for ranks in _group_ranks(ps, "dp"):
        for members in [ranks[i:i + ep] for i in range(0, len(ranks), ep)]:
            g = dist.new_group(members)
            if rank in members:
                ps.groups["ep"] = g
    for ranks in _group_ranks(ps, "dp_cp"):  # of one (tp, pp) position: the same experts, every CP rank
        for i in range(ep):
            members = [r for r in ranks if ps.coords(r)["dp"] % ep == i]
            g = dist.new_group(members)
            if rank in members:
                ps.groups["edp"] = g
    _STATE["current"] = ps
    return ps


def get() -> ParallelState:
    """The job's parallel state (a single-process state when none was initialised)."""
    if "current" not in _STATE:
        _STATE["current"] = ParallelState(1, 0, groups={k: None for k in ("tp", "cp", "dp", "pp", "ep", "edp", "dp_cp")})
    return _STATE["current"]


def reset() -> None:
    _STATE.pop("current", None)
