"""--moe-fb-overlap: one micro-batch's forward beside another's backward, each one's expert
all-to-all exchanges travelling while the other computes (MindSpeed's forward-backward overlap
of MoE models, inside 1F1B's steady state and DualPipeV's).

A model chunk's forward is recorded node by node on a Tape instead of as one graph: the
embedding, each transformer layer, and the head with the loss are compute nodes, each with its
own vjp; an MoE layer whose alltoall dispatcher crosses ranks is cut at its two exchanges into

    attention and routing  ->  dispatch  ->  experts  ->  combine  ->  the layer's output

where dispatch and combine are exchange nodes with hand-written backwards (the same exchange,
its counts reversed). Forward and backward are generators that yield right after starting an
exchange (dist.all_to_all_async); run_overlapped() steps a forward and a backward in turn, so
one's exchange travels while the other computes, and waits for it when it comes back.

Same results, bit for bit: every node computes what the whole forward computes, each tensor
between two nodes has its users in one later node (the shared expert and the zero-computation
experts' share are computed in the attention-and-routing node, beside the other users of its
input), the routers' aux and z losses ride on each layer's output as they ride on the chunk's
output without the flag (models/moe.py with_router_losses: the same gradient), and every
parameter's gradient comes from one node. On MindSpore each node records its forward again at
its backward (autograd.vjp's ``interleaved``), as a pipeline's interleaved forwards do.
"""

from __future__ import annotations

import dataclasses

from mindspeed_core import autograd, dist, features, nn, ops
from mindspeed_core.memory import recompute
from mindspeed_core.models.gpt import TransformerLayer
from mindspeed_core.models.moe import MoELayer, with_router_losses


def why_not(layout, cfg, compile_: bool) -> str | None:
    """Why --moe-fb-overlap has nothing to overlap in this run (logged; the schedule then runs
    each forward and backward in turn, with the same results), or None."""
    if layout.pp == 1:
        return "it pairs a pipeline schedule's forwards and backwards, and this run has no pipeline (PP 1)"
    if compile_:
        return "a compiled stage is one graph, not nodes"
    if cfg.dsa is not None:
        return "sparse attention's indexer losses are not carried through its nodes yet"
    return None


class _Exchange:
    """A tape step that is an all-to-all of rows: ``send[j]`` rows to group rank j, ``receive[i]``
    from rank i; its backward sends the gradients back the same way."""

    def __init__(self, group, send, receive, source: int, result: int):
        self.group, self.send, self.receive = group, [int(n) for n in send], [int(n) for n in receive]
        self.source, self.result = source, result

    def start(self, x, backward: bool = False):
        send, receive = (self.receive, self.send) if backward else (self.send, self.receive)
        return dist.all_to_all_async(x, group=self.group, input_splits=send, output_splits=receive)


class _Compute:
    """A tape step that is a node's vjp: its inputs' and outputs' keys, its parameters."""

    def __init__(self, backward, inputs: list, outputs: list, like: list, params: list):
        self.backward, self.inputs, self.outputs, self.like, self.params = backward, inputs, outputs, like, params


class Tape:
    """One micro-batch's forward through one model chunk, node by node. Values are named by keys;
    ``params``: the chunk's trained parameters (what the schedule takes gradients of)."""

    def __init__(self, params: list, owners: dict):
        self.params = params
        self.owners = owners  # id(gradient sink) -> id(the expert weight it stands for)
        self.steps, self.values = [], {}

    def value(self, tensor) -> int:
        key = len(self.values)
        self.values[key] = tensor
        return key

    def _params_of(self, modules, exclude) -> list:
        """The chunk's trained parameters the ``modules`` hold and the ``exclude`` modules do not
        (an expert weight's gradient sink with its weight)."""
        held = {id(p) for m in modules for p in nn.parameters(m)} - {id(p) for m in exclude for p in nn.parameters(m)}
        return [p for p in self.params if id(p) in held or self.owners.get(id(p)) in held]

    def compute(self, fn, inputs: list, modules, recomputed: bool = False, exclude=()) -> list:
        """fn(*values of ``inputs``) -> tuple of tensors, run as one node with its own vjp, whose
        parameters are those of ``modules`` but ``exclude`` (with ``recomputed``: its activations
        recomputed in its backward, --recompute-granularity full); the outputs' keys."""
        params = self._params_of(modules, exclude)
        run = (lambda *a: recompute.checkpoint(fn, *a)) if recomputed else fn
        outs, backward = autograd.vjp(run, [self.values[k] for k in inputs], params, interleaved=True)
        keys = [self.value(o) for o in outs]
        self.steps.append(_Compute(backward, list(inputs), keys, [(tuple(o.shape), ops.dtype_of(o)) for o in outs],
                                   params))
        return keys

    def exchange(self, source: int, group, send, receive):
        """Generator: start the all-to-all of value ``source``, yield while it travels, then its
        result's key."""
        step = _Exchange(group, send, receive, source, -1)
        pending = step.start(autograd.detach(self.values[source]))
        yield
        step.result = self.value(pending.wait())
        self.steps.append(step)
        return step.result

    def tensor(self, key: int):
        return self.values[key]

    def end(self, key: int):
        """The forward is over: its output; the node inputs stay held by their vjps only."""
        out = self.values[key]
        self.values = {}
        self.output = key
        return out

    def backward(self, cotangent, on_param=None):
        """Generator (it yields while the backward's exchanges travel), returning (the chunk input's
        gradient or None, the gradients of ``params`` in their order). ``on_param(index, g)``: each
        parameter's gradient as soon as its node's backward made it."""
        grads = {self.output: cotangent}
        found = {}
        index = {id(p): i for i, p in enumerate(self.params)}
        uses = {}  # parameter index -> the nodes still to give it a gradient
        for step in self.steps:
            for p in getattr(step, "params", ()):
                uses[index[id(p)]] = uses.get(index[id(p)], 0) + 1
        for step in reversed(self.steps):
            if isinstance(step, _Exchange):
                pending = step.start(grads.pop(step.result), backward=True)
                yield
                _add(grads, step.source, pending.wait())
                continue
            cots = [grads.pop(k) if k in grads else ops.zeros(shape, dtype=dtype)
                    for k, (shape, dtype) in zip(step.outputs, step.like)]
            in_grads, param_grads = step.backward(cots)
            for k, g in zip(step.inputs, in_grads):
                if g is not None:
                    _add(grads, k, g)
            for p, g in zip(step.params, param_grads):
                i = index[id(p)]
                found[i] = g if i not in found else found[i] + g
                uses[i] -= 1
                if on_param is not None and uses[i] == 0:
                    on_param(i, found[i])
        self.steps = []
        params = [found[i] if i in found else ops.zeros(tuple(p.shape), dtype=ops.dtype_of(p))
                  for i, p in enumerate(self.params)]
        return grads.get(0), params


def _add(grads: dict, key: int, g) -> None:
    grads[key] = g if key not in grads else grads[key] + g


def cut_layers(model) -> int:
    """How many of a model chunk's layers are cut at their MoE exchanges."""
    return sum(_split(layer) for layer in model.decoder.layers)


def _split(layer) -> bool:
    """Whether ``layer`` is cut at its MoE exchanges: a transformer layer whose MoE MLP dispatches
    with the alltoall dispatcher over more than one rank (elsewhere nothing travels)."""
    if not isinstance(layer, TransformerLayer) or not isinstance(layer.mlp, MoELayer):
        return False
    seams = layer.mlp.seams
    return getattr(seams, "ep", None) is not None and seams.dispatcher == "alltoall"


def _carrying(layer, out, scale_loss):
    """``out`` with the router losses of the MoE layer this node ran riding on it (scaled as the
    loss): the gradient they get without the flag, where they ride on the chunk's output."""
    moe = getattr(layer, "mlp", None)
    if not isinstance(moe, MoELayer):
        return out
    return with_router_losses(out, scale_loss(moe.routing.aux_loss + moe.routing.z_loss))


def _moe_layer_nodes(tape: Tape, layer, key: int, rotary: tuple, seams, tokens, scale_loss, recomputed: bool):
    """Generator: an MoE transformer layer as its five nodes (see the module's text); the output's key."""
    mlp = layer.mlp
    held = {}

    def attention_and_routing(x):
        x = layer.attend(x, *rotary, seams, tokens)
        start = mlp.begin(layer.mlp_input(x))
        pad = None if start.pad_to is None else start.pad_to * mlp.seams.ep_size  # as the dispatch pads
        plan = mlp.seams.all_to_all_plan(start.routed, pad)
        held["start"], held["plan"] = start, plan
        outs = [plan.leaving(start.tokens), _carrying(layer, x, scale_loss), start.routed.weights]
        if start.zero_experts is not None:
            outs.append(start.zero_experts)
        shared = mlp.shared_output(start.x)
        if shared is not None:
            outs.append(shared)
        return tuple(outs)

    post_norm = [layer.post_mlp_layernorm] if layer.post_norm else []
    rows, x, weights, *rest = tape.compute(attention_and_routing, [key], [layer], recomputed,
                                           exclude=[mlp.experts, *post_norm])
    start, plan = held.pop("start"), held.pop("plan")  # not kept past this forward by the node's closure
    arrived = yield from tape.exchange(rows, mlp.seams.ep, plan.send, plan.receive)

    def experts(rows):
        return (plan.returning(mlp.experts(plan.arrived(rows), plan.counts, mlp.grouped)),)

    [out] = tape.compute(experts, [arrived], [mlp.experts], recomputed)
    returned = yield from tape.exchange(out, mlp.seams.ep, plan.receive, plan.send)
    zero = start.zero_experts is not None
    # what the output node needs of the start besides its tensors: the output's shape and dtype
    start = dataclasses.replace(start, x=None, tokens=None, routed=None, zero_experts=None)

    def output(rows, x, weights, *rest):
        done = dataclasses.replace(start, zero_experts=rest[0] if zero else None)
        shared = rest[-1] if len(rest) > int(zero) else None
        return (layer.add_mixed(x, mlp.finish(plan.weigh(rows, weights), done, shared), seams),)

    [key] = tape.compute(output, [returned, x, weights, *rest], post_norm, recomputed)
    return key


def _layer_node(tape: Tape, layer, key: int, rotary: tuple, seams, tokens, scale_loss, recomputed: bool) -> int:
    [key] = tape.compute(lambda x: (_carrying(layer, layer(x, *rotary, seams, tokens), scale_loss),), [key], [layer],
                         recomputed)
    return key


def chunk_forward(model, losses, params: list, x, labels, tokens):
    """Generator: one model chunk's forward on a Tape, as StepLoss.of_chunk computes it (the loss,
    scaled, on the last stage, given the labels); returns (its output, the tape, whose backward
    generator gives the gradients)."""
    owners = {}
    for moe in getattr(model, "moe_layers", list)():
        for sink, weight in zip(getattr(moe.experts, "grad_sinks", ()), (moe.experts.weight1, moe.experts.weight2)):
            owners[id(sink)] = id(weight)
    tape = Tape(params, owners)
    tokens, positions, seq_len = model.forward_tokens(x, tokens)
    key = tape.value(x)
    if model.pre_process:
        [key] = tape.compute(lambda ids: (model.embed(ids, tokens, positions),), [key], [model.embedding])
    cos, sin, local = model.rotary_for(tape.tensor(key), tokens, positions, seq_len)
    decoder, seams = model.decoder, model.seams
    recomputed = [False] * len(decoder.layers)
    for first, stop, again in decoder.recompute_policy.groups(len(decoder.layers)):
        recomputed[first:stop] = [again] * (stop - first)
    for i, layer in enumerate(decoder.layers):
        rotary = local if decoder.local[i] else (cos, sin)
        if _split(layer):
            features.note_used("moe-fb-overlap")
            key = yield from _moe_layer_nodes(tape, layer, key, rotary, seams, tokens, losses.scaler.scale_loss, recomputed[i])
        else:
            key = _layer_node(tape, layer, key, rotary, seams, tokens, losses.scaler.scale_loss, recomputed[i])
    if any(recomputed):
        features.note_used("recompute")
    if model.post_process:
        mtp_routers = [layer.mlp for _, layer in model.transformer_layers()[len(decoder.layers):]
                       if isinstance(layer.mlp, MoELayer)]

        def head_and_loss(h):
            out = model.after_layers(h, tokens, (cos, sin, positions), logits=losses.chunk is None)
            out = losses.scaler.scale_loss(losses(model, out, labels, tokens))
            return (losses.with_extra_losses(model, out, labels, tokens, routers=mtp_routers),)

        layers = [layer for layer in decoder.layers]
        [key] = tape.compute(head_and_loss, [key], [model], exclude=layers)
    return tape.end(key), tape


def run_overlapped(forward, backward) -> tuple:
    """Step two generators in turn until both are done, the forward first: each runs until it
    has started an exchange, and the other computes while it travels. Returns (the forward's
    result, the backward's, how many exchanges travelled while the other computed)."""
    results, running, hidden = {}, {"forward": forward, "backward": backward}, 0
    while running:
        for name, step in list(running.items()):
            try:
                next(step)
                hidden += len(running) == 2  # its exchange travels while the other takes its turn
            except StopIteration as done:
                results[name] = done.value
                del running[name]
    return results["forward"], results["backward"], hidden


def run_alone(generator):
    """A generator of this module run to its end (a forward or backward with no partner): its result."""
    while True:
        try:
            next(generator)
        except StopIteration as done:
            return done.value
