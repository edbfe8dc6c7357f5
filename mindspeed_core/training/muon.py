"""Muon (--optimizer muon): momentum orthogonalised by a Newton-Schulz iteration for the
matrices, AdamW for the rest, written with facade ops only.

Which parameters, as megatron-core 0.16 chooses them (optimizer/muon.py): every trained
two-dimensional weight but the word and position embeddings and the output layer (the router's
weight included); the experts' stacked weights [E, in, out] as E matrices. Norms, biases (the
experts' stacked biases [E, width] too) and every other shape fall back to AdamW with the run's
--adam-* settings and learning rate.

One step of a matrix W with gradient G, as megatron-core's and torch.optim.Muon's:

    W  <- W (1 - lr wd)                       decoupled weight decay
    M  <- M + (1 - mu) (G - M)                 the momentum, an average of the gradients
    U  <- G + mu (M - G) with Nesterov, else M
    W  <- W - lr s NS(U)                       s: the update scale rule, times the extra factor

NS(U) runs ``steps`` quintic Newton-Schulz iterations X <- a X + (b A + c A^2) X, A = X X^T,
from X = U / |U|_F on the wide orientation (a tall U is transposed, then back), in float32.
With the qkv split (megatron-core's default) a fused q/k/v weight [groups x (q + k + v) rows,
hidden] is orthogonalised per logical matrix: all query rows, all key rows, all value rows
(and with an attention output gate, its gate rows), each scaled by its own shape; a gated
MLP's fused gate/up weight stays one matrix, as in megatron-core.

Under tensor parallelism (--muon-tp-mode, megatron-core's three): duplicated and distributed
gather each rank's shard of a cut matrix over the TP group and iterate on the whole matrix, so
the update equals one process's (megatron-core's distributed mode splits the iteration's
products over the ranks instead, the same arithmetic; here both gather); blockwise (MindSpeed-
LLM's default) iterates on each rank's shard as if it were the matrix, scaled by the shard's
shape, its q/k/v rows split by the shard's own query groups: no communication, and not one
process's update.

--optimizer dist_muon is megatron-core's layer-wise distributed optimizer: every trained
parameter belongs to one data-parallel rank (sorted by size, dealt out to the ranks back and
forth; expert weights over the expert-data-parallel ranks), which alone keeps its optimizer
state and computes its update; the updated parameters are then gathered from their owners.
"""

from __future__ import annotations

import math

import numpy as np

from mindspeed_core import autograd, dist, features, nn, ops
from mindspeed_core.errors import CheckpointError
from mindspeed_core.parallel.sharding import placement, shard, unshard
from mindspeed_core.training.optimizer import AdamW, adamw, missing_state, narrow, widen

QUINTIC = (3.4445, -4.7750, 2.0315)  # megatron-core's (and torch's) default coefficients
SCALE_MODES = ("spectral", "shape_scaling", "unit_rms_norm")
EPS = 1e-7  # the norm's floor before the iteration (torch.optim.Muon's)


def scale_factor(rows: int, columns: int, mode: str) -> float:
    """The update's scale for a [rows (out), columns (in)] matrix: spectral sqrt(max(rows, columns));
    shape_scaling sqrt(max(1, rows / columns)) (Keller Jordan's, torch.optim.Muon's "original");
    unit_rms_norm sqrt(rows / columns)."""
    if mode == "spectral":
        return math.sqrt(max(rows, columns))
    if mode == "shape_scaling":
        return math.sqrt(max(1.0, rows / columns))
    if mode == "unit_rms_norm":
        return math.sqrt(rows / columns)
    raise ValueError(f"unknown Muon scale mode {mode!r} ({', '.join(SCALE_MODES)})")


def newton_schulz(u, steps: int, coefficients=QUINTIC):
    """The orthogonalisation of the 2-D float32 tensor ``u`` (see the module's text)."""
    a, b, c = coefficients
    tall = u.shape[0] > u.shape[1]
    x = ops.transpose(u, 0, 1) if tall else u
    x = x / ops.maximum(ops.sqrt(ops.sum(x * x)), ops.full((), EPS))
    for _ in range(steps):
        gram = ops.matmul(x, ops.transpose(x, 0, 1))
        x = x * a + ops.matmul(gram * b + ops.matmul(gram, gram) * c, x)
    return ops.transpose(x, 0, 1) if tall else x


class FacadeTensors:
    """parallel/sharding's array operations on facade tensors (its cuts of a TP shard)."""
    chunk = staticmethod(lambda x, n, axis: ops.chunk(x, n, dim=axis))
    split = staticmethod(lambda x, sizes, axis: ops.split(x, list(sizes), dim=axis))
    cat = staticmethod(lambda xs, axis: ops.cat(xs, dim=axis))
    reshape = staticmethod(lambda x, shape: ops.reshape(x, tuple(shape)))


def uses_muon(name: str, param) -> bool:
    """Whether Muon updates the trained parameter ``name`` (else AdamW): a matrix that is not an
    embedding or the output layer, or an MoE layer's stacked expert weights."""
    if ".experts." in name:  # the stacked weights [E, in, out]; their biases [E, width] go to AdamW
        return name.endswith((".experts.weight1", ".experts.weight2")) and len(param.shape) == 3
    if "embedding" in name or name.startswith(("output_layer.", "rm_head.")):  # the model's ends
        return False
    return len(param.shape) == 2


def logical_rows(name: str, rows: int, cfg) -> list[list[int]] | None:
    """The row groups a fused weight of ``rows`` rows is orthogonalised in (each a list of row
    indices): a q/k/v weight's query, (gate,) key and value rows over every query group it
    holds; None: one matrix."""
    if cfg is None or not name.endswith("self_attention.linear_qkv.weight"):
        return None
    d = cfg.kv_channels
    per_group = cfg.num_attention_heads // cfg.num_query_groups
    parts = [per_group * d] * (2 if cfg.attention_output_gate else 1) + [d, d]
    # the whole weight's query groups, or a tensor-parallel shard's (blockwise), as megatron-core counts them
    groups, rest = divmod(rows, sum(parts))
    if rest or not groups:  # not the layout this rule knows: one matrix
        return None
    out, start = [], 0
    for width in parts:
        out.append([g * sum(parts) + start + i for g in range(groups) for i in range(width)])
        start += width
    return out


def layerwise_owners(names: list[str], sizes: list[int], expert: list[bool], ps) -> list[tuple[str, int]]:
    """Per parameter (its group, the rank of it that owns it): dense parameters over the data-
    (x context-) parallel ranks, expert weights over the expert-data-parallel ones; within each,
    sorted by size (stable) and dealt to ranks 0, 1, .., n-1, n-1, .., 0, 0, .. so that every
    rank holds about as much (megatron-core's LayerWiseDistributedOptimizer.shard_params). Two
    parameters of one name (DualPipeV's first rank: the embeddings and the MTP module's copy of
    them) share their owner, so the name's state is one rank's."""
    out = [None] * len(sizes)
    for of_experts, kind in ((False, "dp_cp"), (True, "edp")):
        n = ps.size(kind)
        turns = list(range(n)) + list(range(n))[::-1]
        members = sorted((i for i in range(len(sizes)) if expert[i] == of_experts), key=lambda i: sizes[i])
        owner_of: dict = {}
        for i in members:
            if names[i] not in owner_of:
                owner_of[names[i]] = turns[len(owner_of) % len(turns)]
            out[i] = (kind, owner_of[names[i]])
    return out


class Muon(AdamW):
    """Muon for the matrices, AdamW for the rest, over the trained parameters ``named_params``
    (the trainer drives it as it drives AdamW: prepare, grad_norm, step). ``cfg``: the model's
    configuration (the q/k/v split's head layout), or None. ``tp_mode``: --muon-tp-mode;
    ``layerwise``: --optimizer dist_muon (see the module's text)."""

    def __init__(self, named_params, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.999), eps: float = 1e-8,
                 ps=None, plan=None, moment_dtype: str = "float32", bucket_elements: int | None = None,
                 momentum: float = 0.95, nesterov: bool = False, ns_steps: int = 5, coefficients=QUINTIC,
                 scale_mode: str = "spectral", extra_scale: float = 1.0, split_qkv: bool = True, cfg=None,
                 tp_mode: str = "blockwise", layerwise: bool = False):
        self.tp_mode, self.layerwise = tp_mode, layerwise and ps is not None
        super().__init__(named_params, lr, weight_decay, betas, eps, ps, plan, moment_dtype, bucket_elements)
        if ns_steps < 1:
            raise ValueError(f"Newton-Schulz steps must be at least 1, not {ns_steps}")
        scale_factor(1, 1, scale_mode)  # an unknown mode fails here, not at the first step
        self.momentum_beta, self.nesterov, self.ns_steps = momentum, nesterov, ns_steps
        self.coefficients, self.scale_mode, self.extra_scale = tuple(coefficients), scale_mode, extra_scale
        # the matrices a rank holds a tensor-parallel shard of, gathered whole for the iteration
        cut = [q.shard for q in plan.params] if plan is not None and ps is not None and ps.tp > 1 \
            else [None] * len(self.named)
        self.gathered = [spec if o and tp_mode != "blockwise" else None for spec, o in zip(cut, self.orthogonal)]
        whole_rows = [placement(spec, tuple(p.shape), ps.tp, ps.local_rank("tp"))[0][0] if spec is not None
                      else p.shape[0] for spec, (_, p) in zip(self.gathered, self.named)]
        self.rows = [logical_rows(n, rows, cfg) if split_qkv and o else None
                     for (n, _), rows, o in zip(self.named, whole_rows, self.orthogonal)]
        # a matrix keeps one momentum buffer instead of Adam's two moments
        # (in exp_avg's dtype: --exp-avg-dtype, as megatron-core's momentum buffer is Adam's first moment)
        self.momentum = [ops.zeros(p.shape, dtype=self.moment_dtypes[0]) if o and m else None
                         for (_, p), o, m in zip(self.named, self.orthogonal, self.mine)]

    def _held_state(self) -> tuple[list[bool], list[bool]]:
        """(AdamW.__init__ asks before it allocates) Muon's matrices keep a momentum, not Adam's
        moments; layer-wise, a rank keeps the state of the parameters it owns only."""
        self.orthogonal = [uses_muon(n, p) for n, p in self.named]
        self.owner = layerwise_owners([n for n, _ in self.named], [ops.numel(p) for _, p in self.named], self.expert,
                                      self.ps) if self.layerwise else None
        # the parameters whose state this rank keeps and whose update it computes: all, or its own
        self.mine = [True] * len(self.named) if self.owner is None else \
            [r == self.ps.local_rank(kind) for kind, r in self.owner]
        return self.mine, [m and not o for m, o in zip(self.mine, self.orthogonal)]

    def wants_state(self, name: str) -> bool:
        return any(m for (n, _), m in zip(self.named, self.mine) if n == name)

    def describe(self) -> str:
        """What updates what, for the log."""
        counts = [(sum(1 for o in self.orthogonal if o == kind),
                   sum(ops.numel(p) for (_, p), o in zip(self.named, self.orthogonal) if o == kind)) for kind in (True, False)]
        rule = (f"momentum {self.momentum_beta}{', Nesterov' if self.nesterov else ''}, {self.ns_steps} Newton-Schulz "
                f"steps, {self.scale_mode} scale x {self.extra_scale}")
        if any(spec is not None for spec in self.gathered):
            rule += f"; TP shards gathered whole ({self.tp_mode})"
        elif self.ps is not None and self.ps.tp > 1:
            rule += "; each TP shard on its own (blockwise)"
        held = "" if self.owner is None else \
            f"; layer-wise distributed: this rank updates {sum(self.mine)} of {len(self.mine)} parameters"
        return (f"optimizer: Muon for {counts[0][0]} matrices ({counts[0][1]:,} parameters; {rule}), AdamW for "
                f"{counts[1][0]} others ({counts[1][1]:,} parameters: embeddings, output layer, norms, biases){held}")

    def _moments(self) -> list:
        return super()._moments() + [b for b in self.momentum if b is not None]

    def _orthogonalised(self, i: int, u):
        """The scaled NS of parameter i's update direction ``u`` (float32, this rank's shape): of
        the whole matrix joined from the TP group's shards as its plan cut it (parallel/sharding,
        on facade tensors), this rank's part; or of ``u`` itself."""
        spec = self.gathered[i]
        if spec is None:
            return self._orthogonalised_whole(i, u)
        features.note_used("muon-tensor-parallel")
        n, shape = self.ps.tp, tuple(u.shape)
        shards = ops.chunk(dist.all_gather(ops.reshape(u, (-1,)), group=self.ps.group("tp")), n)
        whole = unshard([ops.reshape(s, shape) for s in shards], spec, FacadeTensors)
        return shard(self._orthogonalised_whole(i, whole), spec, n, self.ps.local_rank("tp"), FacadeTensors)

    def _orthogonalised_whole(self, i: int, u):
        if len(u.shape) == 3:  # stacked experts [E, in, out]: each expert's [out, in] matrix
            return ops.stack([ops.transpose(self._matrix(ops.transpose(u[e], 0, 1)), 0, 1)
                              for e in range(u.shape[0])])
        rows = self.rows[i]  # blockwise: the shard's own query groups' rows
        if rows is None:
            return self._matrix(u)
        parts = [self._matrix(ops.index_select(u, 0, ops.tensor(np.asarray(r, np.int64)))) for r in rows]
        order = np.argsort(np.concatenate([np.asarray(r, np.int64) for r in rows])).astype(np.int64)
        return ops.index_select(ops.cat(parts, dim=0), 0, ops.tensor(order))

    def _matrix(self, u):
        scale = scale_factor(u.shape[0], u.shape[1], self.scale_mode) * self.extra_scale
        return newton_schulz(u, self.ns_steps, self.coefficients) * scale

    def step(self, grads, lr: float, scale: float = 1.0, gather_later: bool = False) -> None:
        self.steps += 1
        features.note_used("muon")
        with autograd.no_grad():
            if scale != 1.0:
                grads = [g * scale for g in grads]
            weights = [p if w is None else w for (_, p), w in zip(self.named, self.master)]
            fallback = [i for i, o in enumerate(self.orthogonal) if not o and self.mine[i]]
            if fallback:
                decays = [self.weight_decay if self.decay[i] else 0.0 for i in fallback]
                new, m, v = adamw([weights[i] for i in fallback], [grads[i] for i in fallback],
                                  widen([self.exp_avg[i] for i in fallback]),
                                  widen([self.exp_avg_sq[i] for i in fallback]), lr, decays, self.betas, self.eps,
                                  self.steps)
                for j, i in enumerate(fallback):
                    weights[i] = new[j]
                    (self.exp_avg[i],), (self.exp_avg_sq[i],) = (narrow([x], d) for x, d in zip((m[j], v[j]),
                                                                                             self.moment_dtypes))
            mu = self.momentum_beta
            for i, o in enumerate(self.orthogonal):
                if not o or not self.mine[i]:
                    continue
                g = ops.cast(grads[i], "float32")
                w = weights[i] if ops.dtype_of(weights[i]) == "float32" else ops.cast(weights[i], "float32")
                if self.weight_decay:
                    w = w * (1.0 - lr * self.weight_decay)
                buf = widen([self.momentum[i]])[0]
                buf = buf + (g - buf) * (1.0 - mu)
                u = g + (buf - g) * mu if self.nesterov else buf
                weights[i] = w - self._orthogonalised(i, u) * lr
                self.momentum[i] = narrow([buf], self.moment_dtypes[0])[0]
            self._store(weights)
            if self.owner is not None:
                self._share()

    def _share(self) -> None:
        """dist_muon: every parameter from the rank that updated it; per group and dtype, one
        all-gather of each rank's own parameters laid end to end (padded to the longest)."""
        features.note_used("dist-muon")
        for kind in ("dp_cp", "edp"):
            n, me = self.ps.size(kind), self.ps.local_rank(kind)
            if n == 1:
                continue
            by_dtype: dict = {}
            for i, (group, _) in enumerate(self.owner):
                if group == kind:
                    by_dtype.setdefault(ops.dtype_of(self.named[i][1]), []).append(i)
            for dtype, members in sorted(by_dtype.items()):
                held = [[i for i in members if self.owner[i][1] == r] for r in range(n)]
                sizes = [sum(ops.numel(self.named[i][1]) for i in h) for h in held]
                longest = max(sizes)
                if not longest:
                    continue
                mine = [ops.reshape(self.named[i][1], (-1,)) for i in held[me]]
                if sizes[me] < longest:
                    mine.append(ops.zeros((longest - sizes[me],), dtype=dtype))
                every = dist.all_gather(ops.cat(mine) if len(mine) > 1 else mine[0], group=self.ps.group(kind))
                for r in range(n):
                    at = r * longest
                    for i in held[r] if r != me else []:
                        p = self.named[i][1]
                        nn.assign(p, ops.reshape(every[at:at + ops.numel(p)], tuple(p.shape)))
                        at += ops.numel(p)

    def state(self) -> dict:
        out = {}
        for (name, _), m, v, b, w, mine in zip(self.named, self.exp_avg, self.exp_avg_sq, self.momentum, self.master,
                                               self.mine):
            if not mine:  # dist_muon: its owner's
                continue
            if b is not None:
                out[f"momentum.{name}"] = b
            else:
                out[f"exp_avg.{name}"], out[f"exp_avg_sq.{name}"] = m, v
            if w is not None:
                out[f"master.{name}"] = w
        return out

    def load_state(self, tensors: dict, steps: int) -> None:
        for i, (name, p) in enumerate(self.named):
            if not self.mine[i]:
                continue
            stores = [("momentum", self.momentum)] if self.orthogonal[i] else \
                [("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)]
            if self.master[i] is not None:
                stores.append(("master", self.master))
            for key, store in stores:
                t = tensors.get(f"{key}.{name}")
                if t is None:
                    raise CheckpointError(missing_state(key, name) if key != "momentum" or
                                          f"exp_avg.{name}" not in tensors else
                                          f"the checkpoint's optimizer state of {name} is AdamW's: it was saved "
                                          f"without --optimizer muon; start from its weights with --no-load-optim")
                if tuple(t.shape) != tuple(p.shape):
                    raise CheckpointError(f"optimizer {key} of {name} has shape {tuple(t.shape)}, "
                                          f"the model's is {tuple(p.shape)}")
                store[i] = ops.cast(t, "float32" if key == "master" else self.moment_dtypes[key == "exp_avg_sq"])
        self.steps = steps
