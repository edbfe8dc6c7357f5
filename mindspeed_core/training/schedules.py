"""How a step's micro-batches go through forward and backward on this rank.

A schedule takes the gradient function of one micro-batch (``grad_fn(ids, labels) ->
(scaled loss, gradients)``) and the step's micro-batches, and returns the step's mean loss
and mean gradients, unscaled. The optimizer, gradient reduction and logging do not care
which schedule ran: the plain loop, or a pipeline schedule (1F1B, interleaved) below.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from mindspeed_core import autograd, dist, features, ops
from mindspeed_core.parallel.pipeline import rank_of_stage, virtual_stage
from mindspeed_core.training import compiled, distributed, fb_overlap


class FinalGradients:
    """Hands each parameter's final gradient of a step to ``on_final(position, gradient)`` while
    the backward of the step's last micro-batch computes it (``params``: the gradient
    function's parameters, ``offset``: the position of the first in the step's gradient list).
    The value is what the schedule ends with, by the same operations in the same order: the
    earlier micro-batches' sum ``accumulated`` plus this one, then divided as the schedule
    divides (``divide``: True for the pipeline's division, False for the multiply)."""

    def __init__(self, on_final, params, offset: int, accumulated, count: int, scale: float, float32_grads: bool,
                 divide: bool):
        self.on_final, self.params, self.offset, self.accumulated = on_final, params, offset, accumulated
        self.count, self.scale, self.float32_grads, self.divide = count, scale, float32_grads, divide

    def hook(self, k: int, g) -> None:
        if self.float32_grads:
            g = ops.cast(g, "float32")
        if self.accumulated is not None:
            g = self.accumulated[k] + g
        if self.count > 1 or self.scale != 1.0:
            g = g / (self.count * self.scale) if self.divide else g * (1.0 / (self.count * self.scale))
        self.on_final(self.offset + k, g)

    def __enter__(self):
        self._hooks = autograd.grad_hooks(self.params, self.hook)
        return self._hooks.__enter__()

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


def forward_backward_no_pipelining(grad_fn, micro_batches, scale: float = 1.0, float32_grads: bool = False,
                                   on_final=None, params=None, count: int | None = None) -> tuple[float, list]:
    """Each micro-batch's forward and backward in turn, the gradients summed as they come.
    ``float32_grads``: low-precision gradients are accumulated in float32. ``on_final``: called
    with each final gradient during the last of the ``count`` micro-batches' backward
    (FinalGradients; ``params``: grad_fn's parameters)."""
    total_loss, grads, count_seen = 0.0, None, 0
    for batch in micro_batches:  # (ids, labels) or (ids, labels, tokens)
        if on_final is not None and count_seen == count - 1:
            with FinalGradients(on_final, params, 0, grads, count, scale, float32_grads, divide=False):
                loss, g = grad_fn(*batch)
        else:
            loss, g = grad_fn(*batch)
        total_loss += float(ops.to_numpy(loss)) / scale
        g = [ops.cast(x, "float32") for x in g] if float32_grads else g
        grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        count_seen += 1
    if count_seen == 0:
        raise ValueError("a step needs at least one micro-batch")
    if on_final is not None and count_seen != count:  # a caller's bug: the hooks ran at the wrong one
        raise ValueError(f"the step had {count_seen} micro-batches, not the {count} announced")
    count = count_seen
    if count > 1 or scale != 1.0:
        grads = [g * (1.0 / (count * scale)) for g in grads]  # a multiply: MindSpore's CPU Div is ~20x slower
    return total_loss / count, grads


# -- pipeline parallelism -------------------------------------------------------------------
#
# A pipeline schedule is worked out in full on every rank before a step runs, without any
# framework: first each rank's order of compute actions (Megatron's 1F1B or interleaved
# order), then, by stepping all ranks together in unit ticks, where each activation and
# gradient crosses between neighbouring stages. Every transfer is a blocking rendezvous of
# its two ranks (MindSpore's CPU runtime has nothing else: see backends/emulated_collectives),
# so the program lists the transfers of each tick in one global order that every rank
# follows: the earliest unfinished transfer always has both its ranks waiting for it, so a
# program cannot deadlock (tests/test_pipeline.py also runs the blocking protocol over a grid).

FORWARD, BACKWARD, SEND, RECV = "F", "B", "send", "recv"
PAIR = "pair"  # --moe-fb-overlap: the forward and the backward that follow run interleaved
DUALPIPEV = "dualpipev"


def pipeline_order(pp: int, chunks: int, micro_batches: int, rank: int, forward_only: bool = False,
                   fb_overlap: bool = False) -> list:
    """The compute actions of pipeline rank ``rank``: (F|B, model chunk, micro-batch).

    Without interleaving (chunks == 1): P - rank - 1 warm-up forwards, then one forward and
    one backward in turn, then the remaining backwards (1F1B). Interleaved: micro-batches
    go through the chunks in groups of P, and the warm-up is (P - rank - 1) * 2 + (V - 1) * P
    forwards (Megatron's interleaved 1F1B). ``fb_overlap``: one warm-up forward more, so that
    every steady-state forward is paired with the backward of another micro-batch (on the last
    stage too), as MindSpeed's --moe-fb-overlap runs 1F1B."""
    total = micro_batches * chunks

    def forward_at(k):
        group, within = divmod(k, pp * chunks)
        return FORWARD, within // pp, group * pp + within % pp

    def backward_at(k):
        _, chunk, mb = forward_at(k)
        return BACKWARD, chunks - 1 - chunk, mb

    if forward_only:  # evaluation's micro-batches need not fill the last group of P (the missing ones are skipped)
        groups = -(-micro_batches // pp)
        return [a for a in map(forward_at, range(groups * pp * chunks)) if a[2] < micro_batches]
    if chunks == 1:
        warmup = min(pp - rank - 1, total)
    else:
        warmup = min((pp - rank - 1) * 2 + (chunks - 1) * pp, total)
    if fb_overlap:
        warmup = min(warmup + 1, total)
    order = [forward_at(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += _pair(forward_at(warmup + k), backward_at(k), fb_overlap)
    order += [backward_at(k) for k in range(total - warmup, total)]
    return order


def _pair(forward: tuple, backward: tuple, fb_overlap: bool) -> list:
    """A steady-state forward and backward: with ``fb_overlap`` one (PAIR, forward, backward) the
    program runs interleaved (never a micro-batch's own backward: it waits on that forward)."""
    if fb_overlap and forward[1:] != backward[1:]:
        return [(PAIR, forward, backward)]
    return [forward, backward]


def dualpipev_order(pp: int, micro_batches: int, rank: int, forward_only: bool = False,
                    fb_overlap: bool = False) -> list:
    """The compute actions of pipeline rank ``rank`` under DualPipeV (DeepSeek's order, which
    MindSpeed's dualpipev follows): chunk 0 runs down the ranks, chunk 1 back up, and each
    chunk takes its micro-batches in turn. 2(P - r - 1) forwards of chunk 0, r + 1 pairs of
    forwards (chunk 0, chunk 1), P - r - 1 times (backward of chunk 1, forward of chunk 1),
    then the steady state of forward 0 & backward 1, forward 1 & backward 0 (one micro-batch's
    forward beside another's backward), and the backwards left, chunk 1 first. Every backward
    computes the input and the weight gradients at once, as MindSpeed's dualpipev does without
    --moe-fb-overlap. Needs micro_batches >= 2P - 1 (pipeline.check_micro_batches). With
    ``fb_overlap`` the forward-and-backward of the steady state and of the B1 F1 B0 phase are
    (PAIR, forward, backward) units, as DeepSeek's DualPipeV overlaps them."""
    done = {FORWARD: [0, 0], BACKWARD: [0, 0]}
    out = []

    def act(kind, chunk):
        done[kind][chunk] += 1
        return kind, chunk, done[kind][chunk] - 1

    def run(count, *actions):
        for _ in range(count):
            i = 0
            while i < len(actions):
                if actions[i] is PAIRED:
                    out.extend(_pair(act(*actions[i + 1]), act(*actions[i + 2]), fb_overlap))
                    i += 3
                else:
                    out.append(act(*actions[i]))
                    i += 1

    F0, F1, B0, B1 = (FORWARD, 0), (FORWARD, 1), (BACKWARD, 0), (BACKWARD, 1)
    if micro_batches < 2 * pp - 1:
        if not forward_only:  # a caller's bug: the configuration refuses such a run
            raise ValueError(f"DualPipeV needs {2 * pp - 1} micro-batches, not {micro_batches}")
        run(micro_batches, F0)  # evaluation's few micro-batches: down the V, then back up
        run(micro_batches, F1)
        return out
    steady = micro_batches - 2 * pp + rank + 1
    run(2 * (pp - rank - 1), F0)
    run(rank + 1, F0, F1)
    run(pp - rank - 1, B1, F1)
    run(steady, PAIRED, F0, B1, PAIRED, F1, B0)
    run(pp - rank - 1, B1, PAIRED, F1, B0)
    run(rank + 1, B1, B0)
    run(pp - rank - 1, B0)
    if forward_only:
        return [a for a in out if a[0] == FORWARD]
    return out


PAIRED = object()  # dualpipev_order's mark: the next two actions are a pair


def pipeline_program(pp: int, chunks: int, micro_batches: int, forward_only: bool = False,
                     schedule: str | None = None, fb_overlap: bool = False) -> dict:
    """{pipeline rank: [instruction]} for one step. Instructions: (F|B, chunk, micro-batch),
    (send|recv, peer pipeline rank, message) with message = ("activation"|"gradient",
    receiving virtual stage, micro-batch), and (PAIR,) before a forward and a backward to run
    interleaved. ``schedule``: None (1F1B, or interleaved with
    several chunks) or DUALPIPEV (two chunks in a V: a stage's neighbour on the same rank
    gets its input without a transfer). ``fb_overlap`` (--moe-fb-overlap): the orders' pairs of a
    forward and a backward start once both have their inputs, and what both send leaves after
    both (forward_backward_pipelining runs the two interleaved)."""
    v_shape = schedule == DUALPIPEV
    fb_overlap = fb_overlap and not forward_only
    if v_shape:
        chunks = 2
        orders = {r: dualpipev_order(pp, micro_batches, r, forward_only, fb_overlap) for r in range(pp)}
    else:
        orders = {r: pipeline_order(pp, chunks, micro_batches, r, forward_only, fb_overlap) for r in range(pp)}
    # the units the ranks step: one action, or a pair, which starts once both have their inputs
    units = {r: [list(a[1:]) if a[0] == PAIR else [a] for a in orders[r]] for r in range(pp)}
    last = pp * chunks - 1
    position = {r: 0 for r in range(pp)}
    arrived = {r: set() for r in range(pp)}
    program = {r: [] for r in range(pp)}
    while any(position[r] < len(units[r]) for r in range(pp)):
        messages, progressed = [], False
        for r in range(pp):
            if position[r] == len(units[r]):
                continue
            needs, sends = [], []
            for kind, chunk, mb in units[r][position[r]]:
                stage = virtual_stage(pp, r, chunk, v_shape)
                if kind == FORWARD:
                    needs.append(("activation", stage, mb) if stage > 0 else None)
                    sends.append(("activation", stage + 1, mb) if stage < last else None)
                else:
                    needs.append(("gradient", stage, mb) if stage < last else None)
                    sends.append(("gradient", stage - 1, mb) if stage > 0 else None)
            if any(need is not None and need not in arrived[r] for need in needs):
                continue  # waits for a neighbour this tick
            if len(units[r][position[r]]) == 2:
                program[r].append((PAIR,))
            program[r].extend(units[r][position[r]])
            position[r] += 1
            progressed = True
            for message in sends:
                if message is None:
                    continue
                to = rank_of_stage(pp, message[1], v_shape)
                if to == r:  # DualPipeV's turn at the last rank: the next action may take it
                    arrived[r].add(message)
                else:
                    messages.append((r, to, message))
        if not progressed:
            raise RuntimeError("pipeline order cannot make progress")  # an order bug, never bad input
        for src, dst, message in sorted(messages, key=lambda m: (min(m[0], m[1]), max(m[0], m[1]), m[2])):
            program[src].append((SEND, dst, message))
            program[dst].append((RECV, src, message))
            arrived[dst].add(message)
    return program


def simulated_timeline(program: dict, chunks: int, schedule: str | None = None, forward: float = 1.0,
                       backward: float = 2.0) -> dict:
    """{pipeline rank: [(F|B, chunk, micro-batch, start, end)]}: a program's compute actions
    as they would run when a forward of one model chunk takes ``forward`` and a backward
    ``backward``, and a transfer nothing (each action starts once its rank is free and its
    input is made; a --moe-fb-overlap pair once both have theirs, the two taking their sum: the
    overlap hides transfers, which take nothing here). A rank's idle time, the step's end less its
    busy time, is the schedule's bubble (the planner's, and the pipeline figure's)."""
    pp = len(program)
    v_shape = schedule == DUALPIPEV
    last = pp * chunks - 1
    made, out = {}, {r: [] for r in program}
    # a rank's compute units: one action, or a --moe-fb-overlap pair, which starts when both have their inputs
    pending = {r: [] for r in program}
    for r, instructions in program.items():
        filling = 0  # actions still to join the pair opened by a (PAIR,) mark
        for i in instructions:
            if i[0] == PAIR:
                pending[r].append([])
                filling = 2
            elif i[0] in (FORWARD, BACKWARD):
                if filling:
                    pending[r][-1].append(i)
                    filling -= 1
                else:
                    pending[r].append([i])
    clock = {r: 0.0 for r in program}

    def needs(r, kind, chunk, mb):
        stage = virtual_stage(pp, r, chunk, v_shape)
        return (("activation", stage, mb) if kind == FORWARD and stage > 0 else
                ("gradient", stage, mb) if kind == BACKWARD and stage < last else None)

    while any(pending.values()):
        progressed = False
        for r in program:
            while pending[r]:
                wanted = [needs(r, *action) for action in pending[r][0]]
                if any(w is not None and w not in made for w in wanted):
                    break
                start = max([clock[r]] + [made[w] for w in wanted if w is not None])
                for kind, chunk, mb in pending[r].pop(0):
                    clock[r] = start + (forward if kind == FORWARD else backward)
                    out[r].append((kind, chunk, mb, start, clock[r]))
                    stage = virtual_stage(pp, r, chunk, v_shape)
                    made[("activation", stage + 1, mb) if kind == FORWARD else ("gradient", stage - 1, mb)] = clock[r]
                    start = clock[r]
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline program cannot make progress")  # a program bug
    return out


def idle_time(timeline: dict) -> dict:
    """{pipeline rank: time the rank waits} in a simulated_timeline."""
    end = max(action[4] for actions in timeline.values() for action in actions)
    return {r: end - sum(a[4] - a[3] for a in actions) for r, actions in timeline.items()}


@dataclass
class PipelineStage:
    """What a pipeline schedule needs from the rank it runs on.

    ``forward(chunk, x, labels, tokens)``: model chunk ``chunk`` on ``x`` (token ids on the first
    virtual stage, the previous stage's hidden states otherwise); on the last virtual stage,
    given the labels, it returns the micro-batch's (scaled) loss, else hidden states; ``tokens``:
    the micro-batch's positions and documents (models/gpt.py Tokens) or None.
    ``send(x, peer)`` / ``recv(peer, ids)``: point-to-point with pipeline rank ``peer``; recv
    knows the dtype, and the hidden states' shape from the micro-batch's token ids (this rank's
    [rows, columns]: their width varies with dynamic padding). ``vjp``: see below."""

    pp: int
    rank: int
    chunks: int
    forward: Callable
    params: list  # per model chunk, the parameters gradients are taken of
    send: Callable
    recv: Callable
    # vjp(chunk, x, labels, tokens, interleaved) -> (output, backward): a compiled forward
    # (training/compiled.py CheckedCompiledStage); None: autograd.vjp of forward
    vjp: Callable | None = None
    v_shape: bool = False  # DualPipeV's placement of the chunks (parallel/pipeline.py)
    # nodes(chunk, x, labels, tokens): --moe-fb-overlap's forward, a generator giving (output, its
    # fb_overlap.Tape) that yields while its exchanges travel; None: the forward is one vjp
    nodes: Callable | None = None

    def virtual(self, chunk: int) -> int:
        return virtual_stage(self.pp, self.rank, chunk, self.v_shape)

    def holds(self, stage: int) -> bool:
        return rank_of_stage(self.pp, stage, self.v_shape) == self.rank


def _interleaved_forwards(program: list) -> set:
    """The (chunk, micro-batch) forwards of a rank's program that other compute follows before
    their backward (autograd.vjp's ``interleaved``): another forward, or another backward (on
    MindSpore, an interleaved one records its forward again)."""
    open_, out = set(), set()
    for instruction in program:
        if instruction[0] in (FORWARD, BACKWARD):
            open_.discard(instruction[1:])
            out |= open_
            if instruction[0] == FORWARD:
                open_.add(instruction[1:])
    return out


def forward_backward_pipelining(stage: PipelineStage, program: list, micro_batches, scale: float = 1.0,
                                float32_grads: bool = False, forward_only: bool = False,
                                timeline: list | None = None, on_final=None,
                                exchanges: dict | None = None) -> tuple[float, list]:
    """Run this rank's part of a pipeline program (pipeline_program()[stage.rank]).

    Returns the mean unscaled loss over the micro-batches (0.0 on ranks without the last
    stage: the caller sums it over the pipeline group) and the mean gradients of every
    chunk's parameters, chunk after chunk ([] when forward_only). The loss of a micro-batch
    is normalised as without pipelining: the step's loss is the mean of the micro-batches'.
    ``timeline``: when a list, gets (F|B, chunk, micro-batch, start, end) per compute action (as
    simulated_timeline's; "FB" for a --moe-fb-overlap pair, its micro-batches "forward's|backward's")
    and ("step", None, None, start, end) for the whole program, in
    time.perf_counter seconds (benchmarks/bench_pipeline.py).
    ``on_final``: called with each final gradient (its position in the returned list) during
    the backward of each chunk's last micro-batch (FinalGradients). ``exchanges``: a dict whose
    "hidden" counts the all-to-all exchanges that travelled while another micro-batch computed
    (--moe-fb-overlap)."""
    features.note_used("pipeline-parallel")
    if stage.v_shape:
        features.note_used("dualpipe")
    elif stage.chunks > 1:
        features.note_used("virtual-pipeline")
    batches = list(micro_batches)
    last = stage.pp * stage.chunks - 1
    interleaved = _interleaved_forwards(program)
    inbox, outbox, pending = {}, {}, {}
    grads = [None] * stage.chunks
    total_loss = [0.0]
    last_backward = {instruction[1]: instruction[2] for instruction in program if instruction[0] == BACKWARD}
    offsets = [sum(len(p) for p in stage.params[:chunk]) for chunk in range(stage.chunks)]
    nodes = stage.nodes is not None and not forward_only

    def forward(chunk, mb):
        """A forward; with ``nodes`` a generator that yields while its exchanges travel."""
        virtual = stage.virtual(chunk)
        ids, labels, *extra = batches[mb]  # extra: the micro-batch's Tokens (packed sequences, CP)
        x = ids if virtual == 0 else inbox.pop(("activation", virtual, mb))
        target = labels if virtual == last else None
        tokens = extra[0] if extra else None

        def run(x):
            return stage.forward(chunk, x, target, tokens)

        if forward_only:
            with autograd.no_grad():
                out = run(x)
        elif nodes:
            out, pending[chunk, mb] = yield from stage.nodes(chunk, x, target, tokens)
        elif stage.vjp is not None:
            out, pending[chunk, mb] = stage.vjp(chunk, x, target, tokens, (chunk, mb) in interleaved)
        else:
            out, pending[chunk, mb] = autograd.vjp(run, [x], stage.params[chunk], interleaved=(chunk, mb) in interleaved)
        if virtual == last:
            total_loss[0] += float(ops.to_numpy(out)) / scale
        elif stage.holds(virtual + 1):  # DualPipeV's turn: this rank's other chunk takes it
            inbox["activation", virtual + 1, mb] = out
        else:
            outbox["activation", virtual + 1, mb] = out

    def backward(chunk, mb):
        """A backward; with ``nodes`` a generator that yields while its exchanges travel."""
        virtual = stage.virtual(chunk)
        # the loss's own cotangent is one (it is already scaled), else the gradient the next stage sent back
        cotangent = ops.ones(()) if virtual == last else inbox.pop(("gradient", virtual, mb))
        final = None
        if on_final is not None and last_backward[chunk] == mb:
            final = FinalGradients(on_final, stage.params[chunk], offsets[chunk], grads[chunk], len(batches), scale,
                                   float32_grads, divide=True)
        if nodes:
            input_grad, param_grads = yield from pending.pop((chunk, mb)).backward(
                cotangent, None if final is None else final.hook)
            input_grads = [input_grad]
        elif final is not None:
            with final:
                input_grads, param_grads = pending.pop((chunk, mb))(cotangent)
        else:
            input_grads, param_grads = pending.pop((chunk, mb))(cotangent)
        if virtual > 0:
            (inbox if stage.holds(virtual - 1) else outbox)["gradient", virtual - 1, mb] = input_grads[0]
        if float32_grads:
            param_grads = [ops.cast(g, "float32") for g in param_grads]
        grads[chunk] = param_grads if grads[chunk] is None else [a + b for a, b in zip(grads[chunk], param_grads)]

    began = time.perf_counter()
    at = 0
    while at < len(program):
        instruction = program[at]
        kind = instruction[0]
        at += 1
        if kind == RECV:
            inbox[instruction[2]] = stage.recv(instruction[1], batches[instruction[2][2]][0])
            continue
        if kind == SEND:
            stage.send(outbox.pop(instruction[2]), instruction[1])
            continue
        start = time.perf_counter()
        if kind == PAIR:  # --moe-fb-overlap: a forward beside a backward (without nodes, one after the other)
            first, second = program[at], program[at + 1]
            at += 2
            if nodes:
                *_, hidden = fb_overlap.run_overlapped(forward(*first[1:]), backward(*second[1:]))
                if exchanges is not None:
                    exchanges["hidden"] = exchanges.get("hidden", 0) + hidden
            else:
                fb_overlap.run_alone(forward(*first[1:]))
                fb_overlap.run_alone(backward(*second[1:]))
            if timeline is not None:  # the pair as one span ("FB", the forward's chunk, "forward's|backward's mb")
                timeline.append((FORWARD + BACKWARD, first[1], f"{first[2]}|{second[2]}", start, time.perf_counter()))
            continue
        fb_overlap.run_alone((forward if kind == FORWARD else backward)(*instruction[1:]))
        if timeline is not None:
            timeline.append((kind, instruction[1], instruction[2], start, time.perf_counter()))
    if timeline is not None:
        timeline.append(("step", None, None, began, time.perf_counter()))
    if inbox or outbox or pending:  # a program bug, never bad input
        raise RuntimeError(f"pipeline step left work behind: {sorted(inbox)} {sorted(outbox)} {sorted(pending)}")
    count = len(batches)
    if forward_only:
        return total_loss[0] / count, []
    flat = [g for chunk_grads in grads for g in (chunk_grads or [])]
    if count > 1 or scale != 1.0:
        flat = [g / (count * scale) for g in flat]
    return total_loss[0] / count, flat


def pipeline_links(ps, cfg, layout, dtype: str, sequence_shards: int = 1) -> tuple[Callable, Callable, Callable]:
    """(send, recv, from_last) between this rank and the ranks of its pipeline (the same
    tensor, context and data-parallel coordinates): ``send(x, pp_rank)``; ``recv(pp_rank, ids)``
    the hidden states of the micro-batch ``ids`` (a pair's two conversations travel together;
    dynamic padding makes each as wide as its samples; sequence parallelism cuts
    ``sequence_shards``); ``from_last(out, ids)`` the last stage's output (logits, this rank's
    vocabulary shard) on every pipeline rank, ``out`` being None elsewhere."""
    me = ps.coords(ps.rank)

    def peer(pp_rank):
        return ps.rank_of(tp=me["tp"], cp=me["cp"], dp=me["dp"], pp=pp_rank)

    def send(x, to):
        dist.send(x, peer(to))

    def recv(src, ids):
        return dist.recv((ids.shape[0], ids.shape[1] // sequence_shards, cfg.hidden_size), dtype, peer(src))

    last = peer(layout.rank_of_stage(layout.virtual_stages - 1))

    def from_last(out, ids):
        if out is None:
            out = ops.zeros((ids.shape[0], ids.shape[1], cfg.vocab_size // ps.tp), dtype=dtype)
        return dist.broadcast(out, last, ps.group("pp"))

    return send, recv, from_last


class StagedModel:
    """This rank's model chunks, run with the other pipeline ranks' as one model for
    forwards without gradients (GRPO's rollouts and log-probabilities, generation and
    evaluation at a pipeline layout): the virtual stages one after another, each on its rank,
    the hidden states passed on point to point; every rank of the pipeline returns the last
    stage's output (logits, this rank's vocabulary shard under TP). A key/value cache serves
    every chunk of a rank (it is keyed by layer number), so each stage keeps its own layers'.

    ``send``, ``recv``, ``from_last``: pipeline_links'."""

    sequence_multiple = 1  # whole sequences: the generator refuses sequence parallelism anyway
    # the stages run on other ranks, one after another: no one graph holds a decode step
    # (models/compiled_decode.py)
    pipelined = True

    def __init__(self, chunks: list, layout, pp_rank: int, send: Callable, recv: Callable, from_last: Callable):
        self.chunks, self.layout = chunks, layout
        self.mine = {layout.stage(pp_rank, chunk): chunk for chunk in range(layout.chunks)}
        self.send, self.recv, self.from_last = send, recv, from_last

    @property
    def seams(self):
        return self.chunks[0].seams  # every chunk's: the same tensor-parallel group

    def gather_logits(self, logits):
        return self.seams.gather_logits(logits)

    def __call__(self, ids, tokens=None):
        last, out, x = self.layout.virtual_stages - 1, None, ids
        for stage in sorted(self.mine):
            if stage > 0 and stage - 1 not in self.mine:  # else DualPipeV's turn: this rank's other chunk's
                x = self.recv(self.layout.rank_of_stage(stage - 1), ids)
            x = self.chunks[self.mine[stage]](x, tokens)
            if stage == last:
                out = x
            elif stage + 1 not in self.mine:
                self.send(x, self.layout.rank_of_stage(stage + 1))
        return self.from_last(out, ids)


def forward_backward_func(run, chunk_params: list):
    """(forward_backward, forward_only, the model rollouts are drawn with, the gradient call of one
    micro-batch or None), chosen once for this rank (megatron-core's get_forward_backward_func):
    without pipelining one gradient call per micro-batch, else the pipeline program over this
    rank's model chunks. forward_backward(micro_batches) -> (mean loss, this rank's gradients),
    forward_only(micro_batches) -> the mean loss, both on every rank of the pipeline. ``run``:
    the trainer, built (its parallel state, model chunks, trained parameters, StepLoss, loss
    scaler, precision, --compile, overlapped reduction and timeline)."""
    ps, losses = run.ps, run.losses
    # low-precision gradients are accumulated in fp32 (Megatron's main_grad), but in bf16 under
    # MindSpeed's --o2-gradient
    float32_grads = run.dtype != "float32" and not run.opt.o2_gradient
    parallel = run.config.layout
    unpaired = fb_overlap.why_not(parallel, run.cfg, run.loop.compile) if parallel.fb_overlap else None
    if unpaired is not None:
        run.say(f"--moe-fb-overlap pairs nothing here: {unpaired}; each forward and backward runs in turn (the same "
                "results)")
    if ps.pp == 1:
        model = run.model
        grad_fn = autograd.value_and_grad(losses.of_model(model), run.grad_targets)
        if run.loop.compile:  # the eager function stays for the first step's check
            grad_fn = compiled.CheckedCompiledStep(model, run.grad_targets, run.train_names, grad_fn, run.scaler,
                                                   run.dtype, ps, run.say)
        hooks = {} if run.overlap is None else dict(on_final=run.overlap.final, params=run.grad_targets,
                                                    count=run.grad_accum)

        def forward_backward(micro_batches):
            return forward_backward_no_pipelining(grad_fn, micro_batches, run.scaler.scale,
                                                  float32_grads=float32_grads, **hooks)

        def forward_only(micro_batches):
            with autograd.no_grad():
                return float(np.mean([float(ops.to_numpy(losses(model, losses.forward_for_loss(model, ids, tokens),
                                                                labels, tokens)))
                                      for ids, labels, tokens in micro_batches]))

        return forward_backward, forward_only, model, grad_fn
    me = ps.coords(ps.rank)
    send, recv, from_last = pipeline_links(ps, run.cfg, run.layout, run.dtype, run.chunks[0].sequence_multiple)
    pp_rank = ps.local_rank("pp")

    def stage(forward, vjp=None, nodes=None):
        return PipelineStage(ps.pp, pp_rank, run.layout.chunks, forward, chunk_params, send=send, recv=recv, vjp=vjp,
                             v_shape=run.layout.v_shape, nodes=nodes)

    def in_nodes(chunk, x, labels, tokens):
        return fb_overlap.chunk_forward(run.chunks[chunk], losses, chunk_params[chunk], x, labels, tokens)

    nodes = in_nodes if parallel.fb_overlap and unpaired is None else None

    vjp = None
    if run.loop.compile:  # each chunk's forward compiled, the first micro-batch checked against eager
        names = iter(run.train_names)
        first_of_stage = all(v == 0 for axis, v in me.items() if axis != "pp")  # each stage checks its own

        def stage_say(text):
            if first_of_stage:
                run.say_all(f"pipeline stage {pp_rank}: {text}")

        vjp = compiled.CheckedCompiledStage(losses.of_compiled_chunk(run.chunks), chunk_params, run.chunks,
                                            [[next(names) for _ in params] for params in chunk_params],
                                            run.scaler, run.dtype, ps, stage_say)
    train_stage = stage(losses.of_chunk(run.chunks), vjp, nodes)
    eval_stage = stage(losses.of_chunk(run.chunks, scaled=False))
    schedule = DUALPIPEV if run.layout.v_shape else None
    program = pipeline_program(ps.pp, run.layout.chunks, run.grad_accum, schedule=schedule,
                               fb_overlap=nodes is not None)[pp_rank]
    if nodes is not None:  # what the flag does on this layout, in the log
        cut = sum(fb_overlap.cut_layers(chunk) for chunk in run.chunks)
        run.say(f"--moe-fb-overlap: {sum(i[0] == PAIR for i in program)} of pipeline rank {pp_rank}'s "
                f"{sum(i[0] == FORWARD for i in program)} forwards a step run beside a backward; "
                + (f"the all-to-all exchanges of its {cut} MoE layer{'s' * (cut > 1)} travel while the other "
                   "computes" if cut else
                   "no MoE layer of it is cut at its exchanges (EP 1, the allgather dispatcher or LongCat's shortcut "
                   "layer, whose exchanges stay inside it): whole layers interleave"))
    eval_program = pipeline_program(ps.pp, run.layout.chunks, max(run.loop.eval_iters, 1), forward_only=True,
                                    schedule=schedule)[pp_rank]

    def forward_backward(micro_batches):
        loss, grads = forward_backward_pipelining(train_stage, program, micro_batches, run.scaler.scale,
                                                  float32_grads=float32_grads, timeline=run.timeline,
                                                  on_final=run.overlap and run.overlap.final,
                                                  exchanges=run.fb_exchanges)
        return distributed.over_pipeline(loss, ps), grads  # the last stage's loss; zero elsewhere

    def forward_only(micro_batches):
        loss, _ = forward_backward_pipelining(eval_stage, eval_program, micro_batches, forward_only=True)
        return distributed.over_pipeline(loss, ps)

    # GRPO draws and scores its rollouts with the whole pipeline
    return forward_backward, forward_only, StagedModel(run.chunks, run.layout, pp_rank, send, recv, from_last), None
