"""The facade: the contract every backend module fulfils, and the front end code imports.

Models, parallel layers, training and data code use only these names (plus tensor
arithmetic operators ``+ - * / @``, comparison-free indexing/slicing, ``.shape`` and
``len``), so they run unchanged on PyTorch and MindSpore. Dtypes are named by the strings of
:data:`DTYPES`. Tensors are the framework's own; the facade is functional (no in-place updates)
except where a name ends in ``_`` (initializers, ``ops.write_slice_``), ``nn.assign``, and
``ops.adamw_step``, whose inputs are consumed.

Conventions every entry below shares unless it says otherwise:

* shapes are written ``[b, s, h, d]`` (batch, sequence, heads, head dim) and ``[..., H]``
  (any leading dimensions); ``dim`` may be negative;
* results keep the dtype of the (first) input; arguments broadcast as in numpy;
* every op is differentiable in its float inputs, and takes tensors of the bound framework
  only (numpy goes in through ``ops.tensor``);
* "Framework:" names what differs between PyTorch and MindSpore; where nothing is said, the
  two agree to float32 rounding (the cross-framework parity tests hold them to it).

Code reaches these names through the front end (:mod:`mindspeed_core.frontend`: ``from
mindspeed_core import ops, nn, ...``), which binds nothing when imported.

Argument checks common to every backend (a collective's reduction op, splits and group
membership) run once in the front end, before the backend's function; a backend only checks
what its own implementation needs.

Writing a third backend: provide a module per namespace with every name below (the contract
is this file), then run the suite bound to it. tests/test_facade_coverage.py checks the names,
and the suite's ``--feature-coverage`` run checks that a test called each one.
"""

from __future__ import annotations

DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "int16", "int8", "uint8", "bool")
REDUCE_OPS = ("sum", "max", "min")  # what dist.all_reduce and dist.reduce_scatter reduce with

SPEC = {
    "ops": {
        # creation and conversion
        "tensor": ("tensor(data, dtype=None): a new tensor on the selected device from numpy, a list, a scalar or a "
                   "tensor; float64 data becomes float32 unless dtype says otherwise, integers stay int64"),
        "to_numpy": "to_numpy(x): numpy copy on the host (bfloat16 widened to float32, exactly)",
        "is_tensor": "is_tensor(x): whether x is a tensor of the bound framework",
        "zeros": "zeros(shape, dtype='float32')",
        "ones": "ones(shape, dtype='float32')",
        "full": "full(shape, value, dtype='float32')",
        "empty": ("empty(shape, dtype='float32'): contents undefined, callers overwrite it. Framework: MindSpore "
                  "has no uninitialised allocation and returns zeros"),
        "zeros_like": "zeros_like(x, dtype=None)",
        "ones_like": "ones_like(x, dtype=None)",
        "arange": "arange(start, end=None, step=1, dtype='int64')",
        "cast": "cast(x, dtype): round to nearest even on narrowing floats; float to int truncates toward zero",
        "dtype_of": "dtype_of(x) -> facade dtype name",
        "bitcast": "bitcast(x, dtype): the same bits read as dtype of the same element size (float32<->int32, bfloat16<->int16)",
        "numel": "numel(x) -> number of elements",
        # elementwise
        "add": "add(a, b)", "sub": "sub(a, b)", "mul": "mul(a, b)", "div": "div(a, b)",
        "neg": "neg(x)", "exp": "exp(x)", "log": "log(x)", "sqrt": "sqrt(x)", "rsqrt": "rsqrt(x)",
        "pow": "pow(x, exponent): exponent a Python number or a tensor", "abs": "abs(x)", "tanh": "tanh(x)", "sigmoid": "sigmoid(x)",
        "sin": "sin(x)", "cos": "cos(x)", "silu": "silu(x)", "relu": "relu(x)",
        "gelu": "gelu(x, approximate='none'|'tanh'): the erf form or the tanh approximation (GPT-2's)",
        "maximum": "maximum(a, b)", "minimum": "minimum(a, b)",
        "clamp": "clamp(x, min=None, max=None): Python numbers; the gradient is zero where clamped",
        "eq": "eq(a, b) -> bool", "ne": "ne(a, b)", "lt": "lt(a, b)", "le": "le(a, b)", "gt": "gt(a, b)", "ge": "ge(a, b)",
        "logical_and": "logical_and(a, b)", "logical_or": "logical_or(a, b)", "logical_not": "logical_not(x)",
        "isfinite": "isfinite(x) -> bool tensor, False at inf and NaN",
        # reductions
        "sum": "sum(x, dim=None, keepdim=False): dim an int or a tuple; None reduces everything to a 0-d tensor",
        "mean": "mean(x, dim=None, keepdim=False): float inputs",
        "amax": "amax(x, dim=None, keepdim=False)", "amin": "amin(x, dim=None, keepdim=False)",
        "argmax": "argmax(x, dim=-1, keepdim=False) -> int64; the first maximum on ties (greedy decoding relies on it)",
        "logsumexp": "logsumexp(x, dim=-1, keepdim=False): stable (max subtracted); -inf rows give -inf",
        # linear algebra
        "matmul": "matmul(a, b): numpy matmul semantics (batched, broadcasting leading dims); float32 accumulation", "bmm": "bmm(a, b): [B, n, k] @ [B, k, m]",
        "linear": "linear(x, weight, bias=None): x @ weight.T + bias, weight [out, in]",
        # indexing
        "gather": "gather(x, dim, index int64): out has index's shape, out[i][j] = x[i][index[i][j]] along dim (torch.gather)",
        "scatter_add": "scatter_add(x, dim, index, src): x with src added at index along dim (functional)",
        "index_select": "index_select(x, dim, index int64 [n]): the n slices of x along dim, in index order",
        "masked_fill": "masked_fill(x, mask bool broadcastable to x, value number): value where mask is True",
        "where": "where(cond bool, a, b): a where cond, else b; a and b may be Python numbers",
        "write_slice_": ("write_slice_(dst, src, dim, start): dst[..., start:start + src.shape[dim], ...] = src along "
                         "dim, in place (preallocated buffers such as the key/value cache; outside autograd)"),
        "tril": "tril(x, diagonal=0)", "triu": "triu(x, diagonal=0)",
        # shape
        "reshape": "reshape(x, shape): one -1 allowed; a copy where a view is impossible", "transpose": "transpose(x, dim0, dim1)", "permute": "permute(x, dims)",
        "cat": "cat(xs, dim=0)", "stack": "stack(xs, dim=0)",
        "split": "split(x, size or [sizes], dim=0) -> list; an int size leaves a shorter last piece", "chunk": "chunk(x, chunks, dim=0) -> list of equal pieces (the callers split evenly divisible dims only)",
        "squeeze": "squeeze(x, dim)", "unsqueeze": "unsqueeze(x, dim)", "expand": "expand(x, shape): broadcast to shape, -1 keeps a dim; treat the result as read-only",
        # neural-network functions
        "softmax": "softmax(x, dim=-1)", "log_softmax": "log_softmax(x, dim=-1)",
        "cross_entropy": ("cross_entropy(logits [N, C], target [N] int64, ignore_index=-100, reduction='mean'|'sum'|'none'): "
                          "'mean' averages over non-ignored targets (0/0 gives NaN, as in torch); 'none' gives [N] "
                          "with 0 at ignored targets"),
        "embedding": "embedding(ids int [...], weight [V, H]) -> [..., H]; ids outside [0, V) are the caller's error",
        "topk": "topk(x, k, dim=-1, largest=True) -> (values, int64 indices), sorted by value",
        "cumsum": "cumsum(x, dim)",
        "one_hot": "one_hot(ids, num_classes, dtype='float32')",
        "dropout": ("dropout(x, p, training=True): zero with probability p, scale the rest by 1/(1-p); identity when "
                    "not training or p == 0. Framework: the masks come from each framework's generator, so the two "
                    "draw different masks from one seed (MindSpore's from a replayable host generator, see random)"),
        "rand": "rand(shape, dtype='float32'): uniform [0, 1) from the framework generator (streams differ by framework)",
        "randn": "randn(shape, dtype='float32'): standard normal from the framework generator (streams differ by framework)",
        # fused operators (native kernel where the device has one, composite otherwise)
        "rms_norm": "rms_norm(x [..., H], weight [H], eps=1e-6): x / sqrt(mean(x^2) + eps) in float32, cast back to x's dtype, times weight",
        "layer_norm": "layer_norm(x, weight, bias=None, eps=1e-5) over the last dimension",
        "swiglu": "swiglu(x [..., 2F]) -> [..., F]: silu(first half of the last dim) * second half",
        "apply_rotary": "apply_rotary(x [b, s, h, d], cos, sin [s, d] or broadcastable): rotary embedding, halves rotated",
        "attention": ("attention(q [b, sq, hq, d], k, v [b, sk, hk, d], causal=False, mask=None, dropout_p=0.0, "
                      "scale=None, segment_ids=None, return_lse=False, window=None, softcap=None) -> out [b, sq, hq, d], and with return_lse "
                      "also the float32 log-sum-exp of each query's scores [b, sq, hq] (differentiable; a row "
                      "with no visible key gets about -1e30, never NaN); GQA when hk divides hq; bool mask keeps "
                      "True, float mask is added; causal aligned bottom-right; segment_ids [b, s] (or a pair "
                      "for queries and keys): packed documents, a query sees its own document only; window: a "
                      "query sees only the window latest keys up to itself (sliding-window attention, aligned "
                      "bottom-right); softcap: scores become softcap * tanh(scores / softcap) before the masks"),
        "matmul_add": "matmul_add(a [m, k], b [k, n], acc [m, n] float32): acc + a @ b computed in float32 (gradient accumulation into a main grad)",
        "grouped_matmul": "grouped_matmul(x [T, in], weight [E, in, out], group_sizes int [E] summing to T) -> [T, out]: consecutive rows of group e times weight[e] (MoE experts)",
        "solve_unit_lower": ("solve_unit_lower(a [..., n, n], b [..., n, m]) -> x with a x = b, a unit lower triangular "
                             "(its diagonal and upper part not read); differentiable in a and b (gated DeltaNet's "
                             "chunks)"),
        "adamw_step": ("adamw_step(weights, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decays, "
                       "step) -> (weights, exp_avgs, exp_avg_sqs): one AdamW step (torch's formula, bias-corrected) "
                       "over lists of float32 tensors, weight_decays one float per tensor; the inputs are consumed "
                       "(a fused kernel updates them in place and returns them)"),
        "implementations": "implementations() -> {fused op: 'native' | 'composite'} on the selected device",
    },
    "nn": {
        "Module": "Module: base class; define __init__ (call super().__init__()) and forward",
        "ModuleList": "ModuleList(modules): a list of submodules whose parameters are registered",
        "Parameter": "Parameter(data, requires_grad=True, name=None)",
        "is_parameter": "is_parameter(x)",
        "named_parameters": "named_parameters(module) -> [(dotted name, param)], identical names on both frameworks",
        "parameters": "parameters(module) -> [param] in named_parameters order",
        "requires_grad": "requires_grad(param) -> bool",
        "set_requires_grad": "set_requires_grad(param, flag): freeze or unfreeze",
        "set_training": "set_training(module, mode=True): train / eval mode",
        "is_training": "is_training(module) -> bool",
        "forward_pre_hook": ("forward_pre_hook(module, fn) -> handle: fn(module) runs before each call of the "
                             "module's forward (in eager mode; a compiled step does not run it); handle.remove()"),
        "assign": "assign(param, value): copy a numpy array or tensor of the parameter's shape into it, keeping the parameter's dtype; ValueError on another shape",
        "cast_parameters": "cast_parameters(module, dtype): every parameter to dtype, in place (mixed precision)",
        "state_dict": "state_dict(module) -> {dotted name: numpy array}",
        "load_state_dict": "load_state_dict(module, state, strict=True): CheckpointError on missing/unexpected/mis-shaped",
        "init": "init.normal_/uniform_/xavier_uniform_/xavier_normal_/zeros_/ones_/constant_: from the host generator, same weights on both frameworks",
    },
    "autograd": {
        "value_and_grad": ("value_and_grad(fn, params, has_aux=False) -> f(*args) -> (value, [grad per param]); fn returns a "
                           "scalar (with has_aux, (scalar, aux)); a param fn does not use gets zeros. Framework: "
                           "PyTorch records the eager graph, MindSpore differentiates fn as a function (PyNative)"),
        "vjp": ("vjp(fn, inputs, params=(), interleaved=False) -> (outputs, backward(cotangents) -> (input grads, "
                "param grads)); interleaved: other forwards run before this backward (MindSpore then records the "
                "forward at backward time)"),
        "compiled_value_and_grad": ("compiled_value_and_grad(fn, params, module, has_aux=False) -> f(*tensors) -> "
                                    "(value, [grad per param]): value_and_grad with fn's forward and backward "
                                    "compiled (torch.compile; mindspore.jit trace capture); fn reads params from "
                                    "module; compiled once per input shape, the first call pays the compilation; "
                                    "has_aux: fn returns (value, *aux tensors) and f's value is (value, (aux...)), "
                                    "the aux without gradient"),
        "compiled": ("compiled(fn, params, module) -> f(*tensors) -> fn's outputs: fn compiled, for calls without "
                     "gradients (generation's decode step); fn reads params from module; compiled once per input "
                     "shape"),
        "compiled_vjp": ("compiled_vjp(fn, params, module) -> f(inputs, interleaved=False) -> (outputs, backward): vjp "
                         "with fn compiled (a pipeline stage); MindSpore runs an interleaved forward's graph again, "
                         "with the same random draws, when its backward comes"),
        "Function": ("Function: subclass with static forward(ctx, *args) and backward(ctx, *grads); call .apply(*args). "
                     "Optional static traced(*args): the same forward and backward written in facade ops whose "
                     "autodiff is that backward; MindSpore's trace capture (which ignores hand-written backwards) "
                     "runs it, and refuses a Function without one"),
        "replaying": ("replaying() -> bool: True while a forward runs again at its backward, so code with side "
                      "effects (statistics, logs) counts it once. Framework: never on PyTorch; on MindSpore while "
                      "vjp records an interleaved (or superseded) forward again"),
        "no_grad": "no_grad(): context manager without gradient recording",
        "grad_hooks": ("grad_hooks(params, callback): context manager; while open, callback(k, grad) runs as any "
                       "backward (value_and_grad, vjp, recompute) computes params[k]'s gradient, with its total over "
                       "every use in that backward, before the gradient is returned (gradient reduction overlapped "
                       "with the rest of backward); the callback must not change grad"),
        "detach": "detach(x): the same values, cut from the graph",
        "recompute": ("recompute(fn, *args): drop fn's activations in forward, recompute them in backward; fn must draw "
                      "its random numbers through the tracker so the recomputation sees the same dropout masks"),
        "saved_tensors_hooks": ("saved_tensors_hooks(pack, unpack): context manager; tensors autograd saves for "
                                "backward inside go through pack(x, (storage key, storage bytes)) -> object and come "
                                "back through unpack(object) -> tensor; parameters are kept as they are. "
                                "NotImplementedError where the framework has no such hook (MindSpore)"),
    },
    "random": {
        "seed": ("seed(value): seed every generator (framework, host initializers, numpy, Python); the initializers "
                 "then draw the same weights on both frameworks"),
        "get_state": "get_state() -> state of the framework and host generators, JSON-serialisable (for checkpoints)",
        "set_state": "set_state(state)",
        "host_generator": "host_generator() -> the numpy Generator that initializers draw from",
        "tracker": "tracker() -> RNGStatesTracker: add(name, seed), fork(name), get_states() (JSON-serialisable), set_states(), reset()",
        "implementation": ("implementation() -> 'native' | 'emulated': whether the framework's own generator can be saved "
                           "and replayed. Framework: 'emulated' on MindSpore, whose CPU kernels draw from hidden "
                           "counters; its random ops then draw on the host"),
    },
    "dist": {
        "init": "init(): join the torchrun/msrun job from the environment; alone, a no-op",
        "is_initialized": "is_initialized()",
        "shutdown": "shutdown(wait=True): leave the job (after a barrier unless wait=False) and free its groups",
        "launched_world_size": "launched_world_size(): world size the launcher announced (1 with no launcher)",
        "world_size": "world_size(group=None)",
        "rank": "rank(group=None): rank in the group (-1 for a non-member)",
        "new_group": "new_group(ranks) -> Group: every process calls it",
        "all_reduce": ("all_reduce(x, op='sum'|'max'|'min', group=None) -> a new tensor, the element-wise reduction over "
                       "the group; x is unchanged. Framework: MindSpore's CPU collective sums float32/float16 natively "
                       "and emulates the rest (exactly, see implementations)"),
        "sum_gradient": ("sum_gradient(x, group=None) -> x's values; in backward its gradient is summed over the group "
                         "(Megatron's copy to the tensor-parallel region), written so a compiler keeps that backward "
                         "(MindSpore: InsertGradientOf, also under trace capture)"),
        "all_reduce_async": ("all_reduce_async(x, group=None) -> work: start summing x over the group and return "
                             "at once; work.wait() blocks until done and returns the sum (a new tensor; x unchanged). "
                             "Framework: gloo/nccl work handles on PyTorch; mccl's async all-reduce on MindSpore for "
                             "float32/float16, other dtypes summed before it returns"),
        "all_gather_async": ("all_gather_async(x, group=None) -> work: start gathering; work.wait() returns the "
                             "members' x concatenated along dim 0. Framework: a gloo/nccl work handle on PyTorch; "
                             "on MindSpore the emulated gather's exchange on mccl's asynchronous all-reduce"),
        "all_gather": "all_gather(x, group=None, dim=0) -> members' x (all of x's shape) concatenated along dim, in group-rank order",
        "reduce_scatter": ("reduce_scatter(x, op='sum', group=None, dim=0) -> this rank's 1/n slice along dim of the "
                           "reduction; x.shape[dim] must divide by the group size"),
        "all_to_all": ("all_to_all(x, group=None, input_splits=None, output_splits=None): x split along dim 0 (evenly, "
                       "or by input_splits, one count per rank), piece j sent to group rank j, the arrivals "
                       "concatenated; uneven splits need both lists"),
        "all_to_all_async": ("all_to_all_async(x, group=None, input_splits=None, output_splits=None) -> work: start "
                             "all_to_all; work.wait() returns what arrived. Framework: a gloo/nccl work handle on "
                             "PyTorch; on MindSpore the row counts exchanged first, then the emulated exchange on "
                             "mccl's asynchronous all-reduce"),
        "broadcast": "broadcast(x, src, group=None): src is a global rank",
        "shift": ("shift(x, offset=1, group=None): a ring step; each member sends x to group rank (r + offset) % n "
                  "and returns what group rank (r - offset) % n sent"),
        "shift_async": ("shift_async(x, offset=1, group=None) -> work: start a ring step; work.wait() returns what "
                        "shift would. Framework: a batch of isend/irecv on PyTorch; on MindSpore the emulated "
                        "step's exchange on mccl's asynchronous all-reduce"),
        "send": "send(x, dst): dst is a global rank",
        "recv": "recv(shape, dtype, src) -> tensor: the matching send's data; the caller knows shape and dtype",
        "barrier": "barrier(group=None): returns once every member reached it",
        "implementations": ("implementations() -> {collective: 'native' | 'emulated'}. Framework: on MindSpore CPU only "
                            "all_reduce is native; the others are built from it, with the same results"),
        "comm_stats": "comm_stats() -> {collective: {calls, bytes (caller's payload), wire_bytes (reaching the primitives)}}",
        "reset_comm_stats": "reset_comm_stats()",
    },
    "device": {
        "select": "select(wanted='auto') -> chosen device type (called by binding)",
        "available": "available() -> device types this framework sees, best first",
        "type": "type() -> 'cpu' | 'cuda' | 'npu'",
        "current": "current() -> device string",
        "synchronize": "synchronize(): wait for queued work",
        "supports_dtype": "supports_dtype(name) -> whether training math runs in that dtype here",
        "memory_stats": "memory_stats() -> bytes: host RSS always; device allocator figures where the framework has them",
        "to_host": "to_host(x) -> a copy of x in host memory (page-locked where a device copies it back)",
        "to_device": "to_device(x) -> x on the current device (asynchronous where the device allows)",
        "set_deterministic": ("set_deterministic(on=True): deterministic kernels (and, on accelerators, collectives); "
                              "call before the job's collectives are set up; MindSpore takes it once per process"),
        "matmul_rate": "matmul_rate(n=1024, dtype='float32', min_seconds=0.5) -> measured FLOP/s (the MFU peak)",
    },
    "profiler": {
        "start": ("start(save_path, worker, level='level0', with_cpu=False, with_stack=False, with_memory=False, "
                  "record_shapes=False): open a profiling window (the framework's profiler; CPU activity always on "
                  "the CPU, on an accelerator with with_cpu); the level is the Ascend profiler's"),
        "step": "step(): a training step ended inside the window",
        "stop": ("stop() -> {'files': the traces written under save_path (the framework's viewers open them), "
                 "'ops': [(operator, calls, seconds)] by time}"),
    },
    "io": {
        "save": ("save(path, {name: tensor}, metadata=None): one safetensors file with JSON-able metadata, written "
                 "atomically (a reader sees the old file or the new one); the files are the same on both frameworks"),
        "load": "load(path) -> ({name: tensor}, metadata)",
    },
}


NAMESPACES = tuple(SPEC)  # the one list of facade namespaces (backends have a module for each)


def names(namespace: str) -> list[str]:
    return sorted(SPEC[namespace])
