"""Which transformer layers each pipeline stage holds (framework-free, checked from flags).

A model of L layers on P pipeline ranks with V model chunks per rank has P * V virtual
stages; virtual stage s = chunk * P + rank (Megatron's interleaving: rank r holds stages
r, r + P, r + 2P, ...). Layers are numbered globally 0..L-1 and split into consecutive runs:

    even          L / (P * V) layers per virtual stage
    --num-layer-list a,b,...   P runs of the given lengths (V = 1), MindSpeed's uneven split
    --noop-layers i,j,...      those positions keep their place in the split but hold an
                               identity layer without parameters (MindSpeed's padding of L
                               to a multiple of P); a model has the same no-op layers at
                               any layout, so a single process computes the same function.

The first virtual stage also holds the embedding, the last the final norm, the output
layer and the loss.

DualPipeV (``--schedules-method dualpipev``, MindSpeed's and DeepSeek's V-shaped schedule)
keeps the even split over 2P virtual stages but folds them back: rank r holds stage r (its
chunk 0) and stage 2P - 1 - r (its chunk 1), so the first rank holds the embedding and the
loss, and the last rank hands its chunk 0's output to its own chunk 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from mindspeed_core.errors import MindSpeedError


@dataclass(frozen=True)
class PipelineLayout:
    pp: int
    chunks: int  # model chunks per rank (V); 1 without interleaving
    stages: tuple  # per virtual stage: its global layer positions (no-op ones included)
    noop: frozenset = frozenset()
    v_shape: bool = False  # DualPipeV's placement: two chunks, the second running back up the ranks

    @property
    def virtual_stages(self) -> int:
        return self.pp * self.chunks

    def stage(self, pp_rank: int, chunk: int) -> int:
        return virtual_stage(self.pp, pp_rank, chunk, self.v_shape)

    def rank_of_stage(self, stage: int) -> int:
        return rank_of_stage(self.pp, stage, self.v_shape)

    def layers(self, stage: int) -> tuple:
        """Global numbers of the real (not no-op) layers of a virtual stage."""
        return tuple(i for i in self.stages[stage] if i not in self.noop)

    def describe(self) -> list:
        return [list(s) for s in self.stages]


def virtual_stage(pp: int, pp_rank: int, chunk: int, v_shape: bool = False) -> int:
    """The virtual stage of model chunk ``chunk`` on pipeline rank ``pp_rank``: Megatron's
    interleaving (chunk * P + rank), or DualPipeV's V (rank, then 2P - 1 - rank)."""
    if v_shape:
        return pp_rank if chunk == 0 else 2 * pp - 1 - pp_rank
    return chunk * pp + pp_rank


def rank_of_stage(pp: int, stage: int, v_shape: bool = False) -> int:
    """The pipeline rank holding virtual stage ``stage`` (virtual_stage's inverse)."""
    return 2 * pp - 1 - stage if v_shape and stage >= pp else stage % pp


def parse_layer_numbers(text: str | None, flag: str) -> tuple:
    """'1,3, 5' -> (1, 3, 5); a clear error for anything else."""
    if text is None:
        return ()
    try:
        numbers = tuple(int(x) for x in str(text).replace(" ", "").split(",") if x != "")
    except ValueError:
        raise MindSpeedError(f"{flag} {text!r}: expected comma-separated integers, e.g. 3,5") from None
    if not numbers:
        raise MindSpeedError(f"{flag} {text!r}: expected comma-separated integers, e.g. 3,5")
    return numbers


def model_layout(cfg, pp: int, layers_per_virtual_stage: int | None = None,
                 num_layer_list: str | None = None, dualpipev: bool = False) -> PipelineLayout:
    """plan_layout for the model ``cfg`` (its layer count and its no-op layers)."""
    return plan_layout(cfg.num_layers, pp, layers_per_virtual_stage, num_layer_list,
                       ",".join(map(str, cfg.noop_layers)) or None, dualpipev)


def plan_layout(num_layers: int, pp: int = 1, layers_per_virtual_stage: int | None = None,
                num_layer_list: str | None = None, noop_layers: str | None = None,
                dualpipev: bool = False) -> PipelineLayout:
    """The layout for these flags, or a MindSpeedError naming the flag that does not fit."""
    noop = parse_layer_numbers(noop_layers, "--noop-layers")
    bad = [i for i in noop if not 0 <= i < num_layers]
    if bad:
        raise MindSpeedError(f"--noop-layers {noop_layers}: layer {bad[0]} is outside the model's {num_layers} layers "
                             f"(numbered from 0)")
    if len(set(noop)) == num_layers:
        raise MindSpeedError(f"--noop-layers {noop_layers} leaves no real layer of {num_layers}")
    sizes = parse_layer_numbers(num_layer_list, "--num-layer-list")
    if dualpipev:
        return _v_layout(num_layers, pp, layers_per_virtual_stage, sizes, frozenset(noop))
    if sizes:
        if layers_per_virtual_stage is not None:
            raise MindSpeedError("--num-layer-list and --num-layers-per-virtual-pipeline-stage exclude each other")
        if len(sizes) != pp:
            raise MindSpeedError(f"--num-layer-list {num_layer_list} has {len(sizes)} entries; it needs one per "
                                 f"pipeline stage ({pp})")
        if min(sizes) < 1:
            raise MindSpeedError(f"--num-layer-list {num_layer_list}: every stage needs at least one layer")
        if sum(sizes) != num_layers:
            raise MindSpeedError(f"--num-layer-list {num_layer_list} sums to {sum(sizes)}, not to the model's "
                                 f"{num_layers} layers (--num-layers)")
        chunks = 1
    else:
        if num_layers % pp:
            raise MindSpeedError(f"pipeline parallel size {pp} does not divide the {num_layers} layers: change "
                                 f"--num-layers (pad with --noop-layers) or give --num-layer-list")
        per_rank = num_layers // pp
        if layers_per_virtual_stage is not None:
            if pp < 2:
                raise MindSpeedError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
            if per_rank % layers_per_virtual_stage:
                raise MindSpeedError(f"--num-layers-per-virtual-pipeline-stage {layers_per_virtual_stage} does not "
                                     f"divide the {per_rank} layers of each pipeline stage")
            chunks = per_rank // layers_per_virtual_stage
        else:
            chunks = 1
        sizes = (num_layers // (pp * chunks),) * (pp * chunks)
    stages, start = [], 0
    for n in sizes:
        stages.append(tuple(range(start, start + n)))
        start += n
    return PipelineLayout(pp, chunks, tuple(stages), frozenset(noop))


def _v_layout(num_layers: int, pp: int, layers_per_virtual_stage, sizes: tuple, noop: frozenset) -> PipelineLayout:
    """DualPipeV's layout: L / 2P layers in each of the 2P stages, folded into a V
    (MindSpeed's dualpipev rules, each refused in one line saying what to change)."""
    flag = "--schedules-method dualpipev"
    if pp < 2:
        raise MindSpeedError(f"{flag} needs --pipeline-model-parallel-size 2 or more (it folds 2P stages onto P ranks)")
    if layers_per_virtual_stage is not None:
        raise MindSpeedError(f"{flag} gives each rank its own two model chunks: drop "
                             f"--num-layers-per-virtual-pipeline-stage")
    if sizes:
        raise MindSpeedError(f"{flag} splits the layers evenly: drop --num-layer-list (pad with --noop-layers)")
    if num_layers % (2 * pp):
        raise MindSpeedError(f"{flag} puts two chunks of equal layers on each of the {pp} pipeline ranks, so the "
                             f"{num_layers} layers must be a multiple of 2 x {pp}: change --num-layers (pad with "
                             f"--noop-layers) or --pipeline-model-parallel-size")
    per = num_layers // (2 * pp)
    stages = tuple(tuple(range(s * per, (s + 1) * per)) for s in range(2 * pp))
    return PipelineLayout(pp, 2, stages, noop, v_shape=True)


def check_micro_batches(layout: PipelineLayout, micro_batches: int) -> None:
    """The interleaved schedule walks micro-batches in groups of P (Megatron's rule); DualPipeV
    fills its V from both ends with 2P - 1 of them at least (MindSpeed's rule)."""
    if layout.v_shape:
        if micro_batches < 2 * layout.pp - 1:
            raise MindSpeedError(f"--schedules-method dualpipev needs at least 2 x {layout.pp} - 1 = "
                                 f"{2 * layout.pp - 1} micro-batches per step, and this run has {micro_batches} "
                                 f"(= global batch / (micro batch x data-parallel size)): raise --global-batch-size "
                                 f"or lower --micro-batch-size")
        return
    if layout.chunks > 1 and micro_batches % layout.pp:
        raise MindSpeedError(f"the interleaved pipeline schedule needs the micro-batches per step ({micro_batches} = "
                             f"global batch / (micro batch x data-parallel size)) to be a multiple of the pipeline "
                             f"parallel size {layout.pp}")
