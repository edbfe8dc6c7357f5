"""The distributed optimizer (--use-distributed-optimizer): AdamW whose state is sharded
over the data-parallel ranks (ZeRO stage 1, Megatron's DistributedOptimizer).

All trainable parameters of this rank are laid end to end in one flat float32 vector,
padded to a multiple of the data-parallel size; data-parallel rank r owns the r-th slice.
With expert parallelism the expert weights form a second vector, sharded over the
expert-data-parallel group (the DP ranks holding the same experts, with their CP ranks).
Per step:

    gradients   reduce-scattered (and averaged): each rank receives its slice only
    norm        sums of squares of the slices, all-reduced (sharded TP pieces also over TP)
    update      Adam on the slice, with fp32 master weights and moments for the slice only
    parameters  the updated slices all-gathered and copied back into the parameters

so each rank keeps 3/DP of the fp32 state (masters, two moments; the moments in bf16 under
--o2-optimizer, the master slice as the bf16 parameters plus a 16-bit residual under
--reuse-fp32-param: memory/reuse_fp32_param.py) instead of the full two or three copies. Checkpoints hold the same full
per-parameter state as plain AdamW, so a run can switch optimizers or layouts when it resumes.
"""

from __future__ import annotations

import math

import numpy as np

from mindspeed_core import autograd, device, dist, features, nn, ops
from mindspeed_core.errors import CheckpointError
from mindspeed_core.memory import reuse_fp32_param
from mindspeed_core.training.distributed import Bucket, by_size, over_pipeline, sum_of_squares
from mindspeed_core.training.optimizer import (adamw, missing_state, moment_bytes, moment_pair, narrow,
                                               no_weight_decay, widen)


class _Partition:
    """Some of the parameters, laid end to end in buckets of a flat float32 vector, each bucket
    padded to a multiple of ``ranks`` and sharded over ``group`` (``ranks`` ranks, this one the
    ``index``-th owns the index-th slice of every bucket: Megatron's layout, so that each
    bucket is reduce-scattered, and all-gathered, on its own); gradients arrive summed over the
    group and are multiplied by ``grad_scale``, in ``grad_dtype`` (bfloat16 under MindSpeed's
    --o2-gradient, whose gradient buffer is bf16; the update widens the slice). With
    ``reuse_fp32_param`` the fp32 master slice is not stored: the parameters (bf16) are its high
    half, ``residual`` the rest."""

    def __init__(self, named, sharded, weights, weight_decay, group, ranks: int, index: int, grad_scale: float,
                 moment_dtype: str = "float32", reuse_fp32_param: bool = False, bucket_elements: int | None = None,
                 grad_dtype: str = "float32", swap_pieces: int | None = None):
        self.named, self.group, self.ranks, self.grad_scale = named, group, ranks, grad_scale
        self.grad_dtype = grad_dtype
        # --swap-optimizer: the master and moments live in host memory between steps, and the
        # update moves them to the device and back in this many pieces
        self.swap_pieces, self._held = swap_pieces, {}
        self.sizes = [ops.numel(p) for _, p in named]
        self.runs = by_size(list(range(len(self.sizes))), self.sizes, bucket_elements)  # parameters per bucket
        # per bucket: where it starts in the padded flat vector, its padded length, this rank's slice
        self.bucket_starts, self.bucket_lengths, at = [], [], 0
        self.offsets = [0] * len(self.sizes)  # each parameter's start in the padded flat vector
        for run in self.runs:
            self.bucket_starts.append(at)
            for k in run:
                self.offsets[k] = at
                at += self.sizes[k]
            length = -(-(at - self.bucket_starts[-1]) // ranks) * ranks
            self.bucket_lengths.append(length)
            at = self.bucket_starts[-1] + length
        self.padded = at
        self.slices = [(start + index * length // ranks, start + (index + 1) * length // ranks)
                       for start, length in zip(self.bucket_starts, self.bucket_lengths)]
        self.shard = self.padded // ranks
        decay = np.zeros(self.padded, np.float32)
        tp_sharded = np.zeros(self.padded, np.float32)
        counted = np.zeros(self.padded, np.float32)  # elements the global norm counts on this rank
        for (name, p), is_sharded, size, offset, w in zip(named, sharded, self.sizes, self.offsets, weights):
            decay[offset:offset + size] = 0.0 if no_weight_decay(name, p) else weight_decay
            tp_sharded[offset:offset + size] = 1.0 if is_sharded else 0.0
            counted[offset:offset + size] = 1.0 if w is None else np.asarray(w, np.float32).reshape(-1)
        mine = np.concatenate([np.arange(lo, hi) for lo, hi in self.slices])
        self.decay = ops.tensor(decay[mine])
        self.tp_mask = ops.tensor(tp_sharded[mine])
        self.counted = ops.tensor(counted[mine])
        self.residual = None  # set by keep_master under --reuse-fp32-param
        self.reuse_fp32_param = reuse_fp32_param
        self.keep_master(self.window([autograd.detach(p) for _, p in named]))
        # (exp_avg's, exp_avg_sq's): bfloat16 under --o2-optimizer, or --exp-avg-dtype / --exp-avg-sq-dtype
        self.moment_dtypes = moment_pair(moment_dtype)
        self.exp_avg = ops.zeros((self.shard,), dtype=self.moment_dtypes[0])
        self.exp_avg_sq = ops.zeros((self.shard,), dtype=self.moment_dtypes[1])

    # the state (master slice, moments): device tensors, or host copies under --swap-optimizer
    def _get(self, key: str):
        if key not in self._held:
            raise AttributeError(key)
        return device.to_device(self._held[key]) if self.swap_pieces else self._held[key]

    def _put(self, key: str, value) -> None:
        self._held[key] = device.to_host(value) if self.swap_pieces else value

    exp_avg = property(lambda self: self._get("exp_avg"), lambda self, v: self._put("exp_avg", v))
    exp_avg_sq = property(lambda self: self._get("exp_avg_sq"), lambda self, v: self._put("exp_avg_sq", v))
    _master = property(lambda self: self._get("master"), lambda self, v: self._put("master", v))

    def update(self, grad, lr: float, betas, eps: float, step: int):
        """This slice's update, kept (keep_master) and returned (the new fp32 master slice, on the
        device, for the gather): decoupled weight decay first (per element: the flat shard mixes
        decayed and undecayed parameters), then the fused step without decay, the same update,
        as Adam's term does not read the weights. Under --swap-optimizer the state comes from
        host memory piece by piece and goes back: elementwise, so the same bits as at once."""
        if self.swap_pieces:
            master = self._swapped_update(grad, lr, betas, eps, step)
        else:
            master = self.master()
            master = master - master * (self.decay * lr)
            (master,), exp_avg, exp_avg_sq = adamw([master], [grad], widen([self.exp_avg]), widen([self.exp_avg_sq]),
                                                   lr, [0.0], betas, eps, step)
            (self.exp_avg,), (self.exp_avg_sq,) = (narrow(m, d) for m, d in zip((exp_avg, exp_avg_sq),
                                                                                self.moment_dtypes))
        self.keep_master(master)
        return master

    def _swap_bounds(self) -> list[int]:
        return [int(b) for b in np.linspace(0, self.shard, min(self.swap_pieces, self.shard) + 1)]

    def piece_bytes(self) -> int:
        """--swap-optimizer: the largest piece of state an update brings to the device at once
        (the fp32 master's and both moments' elements of it, as stored)."""
        bounds = self._swap_bounds()
        per_element = 4 + sum(map(moment_bytes, self.moment_dtypes))
        return max(hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])) * per_element

    def _swapped_update(self, grad, lr: float, betas, eps: float, step: int):
        features.note_used("swap-optimizer")
        bounds = self._swap_bounds()
        masters, first, second = [], [], []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            master = device.to_device(self._held["master"][lo:hi])
            master = master - master * (self.decay[lo:hi] * lr)
            # tensors of their own (x 1.0): MindSpore's in-place AdamWeightDecay does not write
            # through a slice of the host tensor
            moments = [device.to_device(self._held[k][lo:hi]) * 1.0 for k in ("exp_avg", "exp_avg_sq")]
            (master,), exp_avg, exp_avg_sq = adamw([master], [grad[lo:hi]], widen(moments[:1]), widen(moments[1:]), lr,
                                                   [0.0], betas, eps, step)
            masters.append(master)
            first.append(device.to_host(narrow(exp_avg, self.moment_dtypes[0])[0]))
            second.append(device.to_host(narrow(exp_avg_sq, self.moment_dtypes[1])[0]))
        self._held["exp_avg"], self._held["exp_avg_sq"] = ops.cat(first), ops.cat(second)
        return ops.cat(masters)

    def keep_master(self, flat) -> None:
        """Keep ``flat`` (this rank's fp32 slice) as the master; under --reuse-fp32-param only its
        residual below the bf16 rounding, which the caller puts into the parameters."""
        if self.reuse_fp32_param:
            self.residual = reuse_fp32_param.split(flat)[1]
        else:
            self._master = flat

    def master(self):
        """This rank's fp32 master slice."""
        if not self.reuse_fp32_param:
            return self._master
        high = ops.cast(self.window([autograd.detach(p) for _, p in self.named]), "bfloat16")
        return reuse_fp32_param.join(high, self.residual)

    def window(self, tensors, dtype: str = "float32"):
        """This rank's slices of the flat vector of ``tensors``, built from the pieces inside them:
        tensors of their own (a slice of the whole flat vector would keep all of it alive)."""
        return self.window_from(lambda k, a, b: ops.reshape(ops.cast(tensors[k], dtype), (-1,))[a:b], dtype)

    def window_from(self, piece, dtype: str = "float32"):
        """This rank's slices, ``piece(k, a, b)`` giving parameter k's flat elements a..b-1."""
        return ops.cat([ops.zeros((b - a,), dtype=dtype) if k is None else piece(k, a, b) for k, a, b in self.owned()])

    def owned(self) -> list:
        """What this rank's slices hold, in order: (parameter k, its flat elements a..b-1), or
        (None, 0, n) for n elements of a bucket's padding."""
        out = []
        for (lo, hi), run in zip(self.slices, self.runs):
            at = lo
            for k in run:
                a, b = max(lo, self.offsets[k]), min(hi, self.offsets[k] + self.sizes[k])
                if a < b:
                    out.append((k, a - self.offsets[k], b - self.offsets[k]))
                    at = b
            if at < hi:  # the bucket's padding
                out.append((None, 0, hi - at))
        return out

    def unflatten(self, flat) -> list:
        """The parameters' tensors from the whole (gathered) flat vector."""
        return [ops.reshape(flat[o:o + size], tuple(p.shape)) for o, size, (_, p) in zip(self.offsets, self.sizes,
                                                                                         self.named)]

    def start_gather(self, part) -> list:
        """Start gathering each bucket of the flat vector from every rank's slices (``part``:
        this rank's); each work's wait() gives that bucket's whole vector."""
        return [dist.all_gather_async(x, group=self.group)
                for x in ops.split(part, [hi - lo for lo, hi in self.slices])]

    def assign_bucket(self, b: int, whole) -> None:
        """Bucket ``b``'s gathered vector into its parameters."""
        start = self.bucket_starts[b]
        for k in self.runs[b]:
            (_, p), o = self.named[k], self.offsets[k] - start
            nn.assign(p, ops.reshape(whole[o:o + self.sizes[k]], tuple(p.shape)))

    def gather(self, part):
        """The whole flat vector from every rank's slices (``part``: this rank's)."""
        if self.ranks == 1:
            return part
        mine = ops.split(part, [hi - lo for lo, hi in self.slices])
        whole = [dist.all_gather(x, group=self.group) for x in mine]
        return ops.cat(whole) if len(whole) > 1 else whole[0]

    def buckets(self, positions: list[int]) -> list[Bucket]:
        """The buckets for a reduction overlapped with backward; ``positions``: these parameters'
        places in the step's gradient list."""
        group = self.group if self.ranks > 1 else None
        return [Bucket(tuple(positions[k] for k in run), group, length - sum(self.sizes[k] for k in run),
                       dtype=self.grad_dtype)
                for run, length in zip(self.runs, self.bucket_lengths)]

    def reduce(self, grads, reduced: list | None = None):
        """This rank's slices of the summed gradient, times grad_scale: each bucket
        reduce-scattered. ``reduced``: each bucket's whole sum, already made (overlap); the slice
        is then cut from it, as a reduce-scatter is an all-reduce and a slice where the
        collectives have no reduce-scatter (gloo, MindSpore's CPU): the same values."""
        if self.ranks == 1:
            flat = self.window(grads, self.grad_dtype)
        else:
            parts, local = [], self.buckets(list(range(len(self.sizes))))  # by this partition's own positions
            for b, (lo, hi) in enumerate(self.slices):
                if reduced is not None:
                    start = lo - self.bucket_starts[b]
                    parts.append(reduced[b][start:start + hi - lo])
                else:
                    parts.append(dist.reduce_scatter(local[b].flat(grads), group=self.group))
            flat = ops.cat(parts) if len(parts) > 1 else parts[0]
        return flat * self.grad_scale if self.grad_scale != 1.0 else flat

    def norm_parts(self, g):
        """[TP-sharded, replicated] sums of squares of this partition's counted gradient,
        summed over its group."""
        counted = g * self.counted  # masks are 0/1, so squares of the masked gradient are the counted squares
        on_tp = sum_of_squares(counted * self.tp_mask)
        both = ops.stack([on_tp, sum_of_squares(counted) - on_tp])
        return dist.all_reduce(both, group=self.group) if self.ranks > 1 else both


class DistributedAdamW:
    def __init__(self, named_params, lr: float, weight_decay: float, betas, eps: float, ps, plan,
                 moment_dtype: str = "float32", reuse_fp32_param: bool = False, bucket_elements: int | None = None,
                 grad_dtype: str = "float32", swap_pieces: int | None = None):
        named_params = list(named_params)
        self.bucket_elements = bucket_elements
        trainable = [i for i, (_, p) in enumerate(named_params) if nn.requires_grad(p)]
        sharded, expert = plan.sharded(), plan.flags("expert") if ps.ep > 1 else [False] * len(named_params)
        weights = plan.norm_weights([p.shape for _, p in named_params]) or [None] * len(named_params)
        self.named = [named_params[i] for i in trainable]
        self.lr, self.weight_decay, self.betas, self.eps, self.ps = lr, weight_decay, betas, eps, ps
        self.reuse_fp32_param = reuse_fp32_param
        self.steps = 0
        # the dense parameters sharded over the ranks holding them: DP, times CP with context
        # parallelism; expert weights over the DP (x CP) ranks holding the same experts (their
        # gradients are already sums over the EP group: divided by the whole DP x CP size)
        self.members, self.partitions = [], []
        for of_experts in (False, True):
            mine = [k for k, i in enumerate(trainable) if expert[i] == of_experts]
            if not mine and of_experts:
                continue
            kind = "edp" if of_experts else "dp_cp"
            self.members.append(mine)
            self.partitions.append(_Partition(
                [self.named[k] for k in mine], [sharded[trainable[k]] for k in mine],
                [weights[trainable[k]] for k in mine], weight_decay, ps.group(kind), ps.size(kind),
                ps.local_rank(kind), 1.0 / ps.size("dp_cp"), moment_dtype, reuse_fp32_param, bucket_elements,
                grad_dtype, swap_pieces))

    # -- the trainer's interface -------------------------------------------------------------
    def buckets(self) -> list[Bucket]:
        """Each partition's buckets, in order (see _Partition.buckets)."""
        return [b for part, mine in zip(self.partitions, self.members) for b in part.buckets(mine)]

    def prepare(self, grads, reduced: list | None = None) -> list:
        """Per partition, this rank's slice of the averaged gradient; ``reduced``: the sums of
        buckets() already made (overlapped with backward: training/overlap.py)."""
        if self.ps.dp > 1:
            features.note_used("data-parallel")
        if reduced is None:
            return [part.reduce([grads[k] for k in mine]) for part, mine in zip(self.partitions, self.members)]
        out, at = [], 0
        for part, mine in zip(self.partitions, self.members):
            count = len(part.runs)
            out.append(part.reduce([grads[k] for k in mine], reduced[at:at + count]))
            at += count
        return out

    def whole_gradients(self, g) -> list:
        """Each trained parameter's gradient from what prepare gave (this rank's slices): every
        rank's slices gathered (a collective of the partitions' groups)."""
        out = [None] * len(self.named)
        for part, mine, x in zip(self.partitions, self.members, g):
            for k, whole in zip(mine, part.unflatten(part.gather(x))):
                out[k] = whole
        return out

    def grad_norm(self, g) -> float:
        sums = [part.norm_parts(x) for part, x in zip(self.partitions, g)]
        if len(sums) > 1:  # expert weights: each EP rank holds other experts
            sums[1] = dist.all_reduce(sums[1], group=self.ps.group("ep"))
        sharded, replicated = (float(x) for x in ops.to_numpy(sums[0] + sums[1] if len(sums) > 1 else sums[0]))
        if self.ps.tp > 1:
            sharded = float(ops.to_numpy(dist.all_reduce(ops.tensor([sharded]), group=self.ps.group("tp")))[0])
        return math.sqrt(over_pipeline(sharded + replicated, self.ps))

    def step(self, g, lr: float, scale: float = 1.0, gather_later: bool = False) -> list | None:
        """The update of this rank's slices; then the parameters gathered from every rank's, or
        with ``gather_later`` the gathers started: [(partition, bucket, work)] for the caller to
        finish with assign_gathered (training/overlap.py: --overlap-param-gather)."""
        features.note_used("distributed-optimizer")
        started = []
        self.steps += 1
        with autograd.no_grad():
            for part, grad in zip(self.partitions, g):
                if scale != 1.0:
                    grad = grad * scale
                master = part.update(grad, lr, self.betas, self.eps, self.steps)
                # the parameters take the master's bf16 rounding: under --reuse-fp32-param, the
                # high half that keep_master's residual completes
                if gather_later:
                    started += [(part, b, work) for b, work in enumerate(part.start_gather(master))]
                    continue
                for (_, p), value in zip(part.named, part.unflatten(part.gather(master))):
                    nn.assign(p, value)
        return started if gather_later else None

    @staticmethod
    def assign_gathered(part, b: int, work) -> None:
        with autograd.no_grad():
            part.assign_bucket(b, work.wait())

    @property
    def swap_pieces(self) -> int | None:
        return self.partitions[0].swap_pieces if self.partitions else None

    def device_state_bytes(self) -> int:
        """What of state_bytes stays on the device between steps: none under --swap-optimizer."""
        return 0 if self.swap_pieces else self.state_bytes()

    def piece_bytes(self) -> int:
        """--swap-optimizer: the most state an update brings to the device at once."""
        return max(part.piece_bytes() for part in self.partitions)

    def state_bytes(self) -> int:
        master = 2 if self.reuse_fp32_param else 4  # a residual below the parameters, or an fp32 copy
        return sum((master + sum(map(moment_bytes, part.moment_dtypes))) * part.shard for part in self.partitions)

    # -- checkpoints: the same per-parameter state as plain AdamW ----------------------------
    def _note_no_gloo_group(self) -> None:
        if any(part.ranks > 1 for part in self.partitions):  # a DP-sharded state saved with no Gloo side group
            features.note_used("gloo-ckpt-offload")

    def state(self) -> dict:
        out = {}
        self._note_no_gloo_group()  # gathered on the job's own backend
        for part in self.partitions:
            for key in ("exp_avg", "exp_avg_sq", "master"):
                mine = part.master() if key == "master" else widen([getattr(part, key)])[0]  # gathered in fp32:
                # every backend's collectives have it
                for (name, p), value in zip(part.named, part.unflatten(part.gather(mine))):
                    if key != "master" or ops.dtype_of(p) != "float32":
                        out[f"{key}.{name}"] = value
        return out

    def held_state(self) -> list:
        """This rank's state as a sharded checkpoint writes it: (state name, parameter name, the
        parameter's flat elements (a, b) held, their values as numpy), its slices only."""
        self._note_no_gloo_group()  # each rank writes its slices: nothing is gathered
        out = []
        for part in self.partitions:
            owned = part.owned()
            for key in ("exp_avg", "exp_avg_sq", "master"):
                flat = ops.to_numpy(part.master() if key == "master" else widen([getattr(part, key)])[0])
                at = 0
                for k, a, b in owned:
                    if k is not None and (key != "master" or ops.dtype_of(part.named[k][1]) != "float32"):
                        name = part.named[k][0]
                        out.append((f"{key}.{name}", name, (a, b), flat[at:at + b - a]))
                    at += b - a
        return out

    def load_state(self, tensors: dict, steps: int) -> None:
        for part in self.partitions:
            for key in ("exp_avg", "exp_avg_sq", "master"):
                values = []
                for name, p in part.named:
                    t = tensors.get(f"{key}.{name}")
                    if t is None and key == "master":
                        t = autograd.detach(p)  # an fp32 parameter is its own master
                    if t is None:
                        raise CheckpointError(missing_state(key, name))
                    if tuple(t.shape) != tuple(p.shape):
                        raise CheckpointError(f"optimizer {key} of {name} has shape {tuple(t.shape)}, "
                                              f"the model's is {tuple(p.shape)}")
                    values.append(t)
                self._keep(part, key, part.window(values))
        self.steps = steps

    def load_slices(self, read, steps: int) -> None:
        """The state of this rank's slices only, ``read(state name, parameter name, shape, (a, b))``
        giving that parameter's flat elements a..b-1 (numpy) or None where the checkpoint has none."""
        for part in self.partitions:
            for key in ("exp_avg", "exp_avg_sq", "master"):
                def piece(k, a, b, key=key, part=part):
                    name, p = part.named[k]
                    got = read(f"{key}.{name}", name, tuple(p.shape), (a, b))
                    if got is None and key == "master":  # an fp32 parameter is its own master
                        return ops.reshape(ops.cast(autograd.detach(p), "float32"), (-1,))[a:b]
                    if got is None:
                        raise CheckpointError(missing_state(key, name))
                    return ops.tensor(got)

                self._keep(part, key, part.window_from(piece))
        self.steps = steps

    @staticmethod
    def _keep(part, key: str, flat) -> None:
        if key == "master":  # the parameters were loaded from the same checkpoint: its bf16 rounding
            part.keep_master(flat)
        else:
            setattr(part, key, narrow([flat], part.moment_dtypes[key == "exp_avg_sq"])[0])
