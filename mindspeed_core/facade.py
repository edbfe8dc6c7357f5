"""The facade: the contract every backend module fulfils, and the front end code imports.

Models, parallel layers, training and data code use only these names (plus tensor
arithmetic operators ``+ - * / @``, comparison-free indexing/slicing, ``.shape`` and
``len``), so they run unchanged on PyTorch and MindSpore. Dtypes are named by strings:
float32, float64, float16, bfloat16, int32, int64, int16, int8, uint8, bool. Tensors are the
framework's own; the facade is functional (no in-place updates) except where a name ends
in ``_`` (initializers, ``ops.write_slice_``), ``nn.assign``, and ``ops.adamw_step``, whose inputs are
consumed.

Code reaches these names through the front end (:mod:`mindspeed_core.frontend`: ``from
mindspeed_core import ops, nn, ...``), which binds nothing when imported.

The conformance suite (tests/) checks that both backends provide every name below and that
each one is exercised by a test; the one-line contracts are the documentation.
"""

from __future__ import annotations

SPEC = {
    "ops": {
        # creation and conversion
        "tensor": "tensor(data, dtype=None): from numpy/list/scalar; float64 data becomes float32 unless dtype says otherwise",
        "to_numpy": "to_numpy(x): numpy copy on the host (bfloat16 widened to float32, exactly)",
        "is_tensor": "is_tensor(x): whether x is a tensor of the bound framework",
        "zeros": "zeros(shape, dtype='float32')",
        "ones": "ones(shape, dtype='float32')",
        "full": "full(shape, value, dtype='float32')",
        "empty": "empty(shape, dtype='float32'): uninitialised (zero-filled where the framework has no empty)",
        "zeros_like": "zeros_like(x, dtype=None)",
        "ones_like": "ones_like(x, dtype=None)",
        "arange": "arange(start, end=None, step=1, dtype='int64')",
        "cast": "cast(x, dtype)",
        "dtype_of": "dtype_of(x) -> facade dtype name",
        "bitcast": "bitcast(x, dtype): the same bits read as dtype of the same element size (float32<->int32, bfloat16<->int16)",
        "numel": "numel(x) -> number of elements",
        # elementwise
        "add": "add(a, b)", "sub": "sub(a, b)", "mul": "mul(a, b)", "div": "div(a, b)",
        "neg": "neg(x)", "exp": "exp(x)", "log": "log(x)", "sqrt": "sqrt(x)", "rsqrt": "rsqrt(x)",
        "pow": "pow(x, exponent)", "abs": "abs(x)", "tanh": "tanh(x)", "sigmoid": "sigmoid(x)",
        "sin": "sin(x)", "cos": "cos(x)", "silu": "silu(x)", "relu": "relu(x)",
        "gelu": "gelu(x, approximate='none'|'tanh')",
        "maximum": "maximum(a, b)", "minimum": "minimum(a, b)",
        "clamp": "clamp(x, min=None, max=None)",
        "eq": "eq(a, b) -> bool", "ne": "ne(a, b)", "lt": "lt(a, b)", "le": "le(a, b)", "gt": "gt(a, b)", "ge": "ge(a, b)",
        "logical_and": "logical_and(a, b)", "logical_or": "logical_or(a, b)", "logical_not": "logical_not(x)",
        "isfinite": "isfinite(x) -> bool",
        # reductions
        "sum": "sum(x, dim=None, keepdim=False)", "mean": "mean(x, dim=None, keepdim=False)",
        "amax": "amax(x, dim=None, keepdim=False)", "amin": "amin(x, dim=None, keepdim=False)",
        "argmax": "argmax(x, dim=-1, keepdim=False) -> int64",
        "logsumexp": "logsumexp(x, dim=-1, keepdim=False)",
        # linear algebra
        "matmul": "matmul(a, b): batched, broadcasting", "bmm": "bmm(a, b): [B, n, k] @ [B, k, m]",
        "linear": "linear(x, weight, bias=None): x @ weight.T + bias, weight [out, in]",
        # indexing
        "gather": "gather(x, dim, index): out[i][j] = x[i][index[i][j]] along dim",
        "scatter_add": "scatter_add(x, dim, index, src): x with src added at index along dim (functional)",
        "index_select": "index_select(x, dim, index)",
        "masked_fill": "masked_fill(x, mask, value): value where mask is True",
        "where": "where(cond, a, b)",
        "write_slice_": ("write_slice_(dst, src, dim, start): dst[..., start:start + src.shape[dim], ...] = src along "
                         "dim, in place (preallocated buffers such as the key/value cache; outside autograd)"),
        "tril": "tril(x, diagonal=0)", "triu": "triu(x, diagonal=0)",
        # shape
        "reshape": "reshape(x, shape)", "transpose": "transpose(x, dim0, dim1)", "permute": "permute(x, dims)",
        "cat": "cat(xs, dim=0)", "stack": "stack(xs, dim=0)",
        "split": "split(x, size or [sizes], dim=0) -> list", "chunk": "chunk(x, chunks, dim=0) -> list",
        "squeeze": "squeeze(x, dim)", "unsqueeze": "unsqueeze(x, dim)", "expand": "expand(x, shape): broadcast view",
        # neural-network functions
        "softmax": "softmax(x, dim=-1)", "log_softmax": "log_softmax(x, dim=-1)",
        "cross_entropy": "cross_entropy(logits [N, C], target [N] int, ignore_index=-100, reduction='mean'|'sum'|'none')",
        "embedding": "embedding(ids, weight [V, H]) -> [..., H]",
        "topk": "topk(x, k, dim=-1, largest=True) -> (values, int64 indices)",
        "cumsum": "cumsum(x, dim)",
        "one_hot": "one_hot(ids, num_classes, dtype='float32')",
        "dropout": "dropout(x, p, training=True): zero with probability p, scale the rest by 1/(1-p)",
        "rand": "rand(shape, dtype='float32'): uniform [0, 1) from the framework generator",
        "randn": "randn(shape, dtype='float32'): standard normal from the framework generator",
        # fused operators (native kernel where the device has one, composite otherwise)
        "rms_norm": "rms_norm(x, weight, eps=1e-6): normalised in float32, cast back, times weight",
        "layer_norm": "layer_norm(x, weight, bias=None, eps=1e-5) over the last dimension",
        "swiglu": "swiglu(x): silu(first half of the last dim) * second half",
        "apply_rotary": "apply_rotary(x [b, s, h, d], cos, sin [s, d] or broadcastable): rotary embedding, halves rotated",
        "attention": ("attention(q [b, sq, hq, d], k, v [b, sk, hk, d], causal=False, mask=None, dropout_p=0.0, "
                      "scale=None, segment_ids=None, return_lse=False) -> out [b, sq, hq, d], and with return_lse "
                      "also the float32 log-sum-exp of each query's scores [b, sq, hq] (differentiable; a row "
                      "with no visible key gets about -1e30, never NaN); GQA when hk divides hq; bool mask keeps "
                      "True, float mask is added; causal aligned bottom-right; segment_ids [b, s] (or a pair "
                      "for queries and keys): packed documents, a query sees its own document only"),
        "matmul_add": "matmul_add(a, b, acc): acc + a @ b computed in float32 (gradient accumulation)",
        "grouped_matmul": "grouped_matmul(x [T, in], weight [E, in, out], group_sizes [E]): rows of each group times its weight",
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
        "assign": "assign(param, value): copy a numpy array or tensor into the parameter, keeping its dtype",
        "cast_parameters": "cast_parameters(module, dtype): every parameter to dtype, in place (mixed precision)",
        "state_dict": "state_dict(module) -> {dotted name: numpy array}",
        "load_state_dict": "load_state_dict(module, state, strict=True): CheckpointError on missing/unexpected/mis-shaped",
        "init": "init.normal_/uniform_/xavier_uniform_/xavier_normal_/zeros_/ones_/constant_: from the host generator, same weights on both frameworks",
    },
    "autograd": {
        "value_and_grad": "value_and_grad(fn, params, has_aux=False) -> f(*args) -> (value, [grad per param])",
        "vjp": ("vjp(fn, inputs, params=(), interleaved=False) -> (outputs, backward(cotangents) -> (input grads, "
                "param grads)); interleaved: other forwards run before this backward (MindSpore then records the "
                "forward at backward time)"),
        "compiled_value_and_grad": ("compiled_value_and_grad(fn, params, module) -> f(*tensors) -> (value, [grad per "
                                    "param]): value_and_grad with fn's forward and backward compiled (torch.compile; "
                                    "mindspore.jit trace capture); fn reads params from module; compiled once per "
                                    "input shape, the first call pays the compilation"),
        "Function": "Function: subclass with static forward(ctx, *args) and backward(ctx, *grads); call .apply(*args)",
        "no_grad": "no_grad(): context manager without gradient recording",
        "detach": "detach(x): the same values, cut from the graph",
        "recompute": "recompute(fn, *args): drop fn's activations in forward, recompute them in backward",
        "saved_tensors_hooks": ("saved_tensors_hooks(pack, unpack): context manager; tensors autograd saves for "
                                "backward inside go through pack(x, (storage key, storage bytes)) -> object and come "
                                "back through unpack(object) -> tensor; parameters are kept as they are. "
                                "NotImplementedError where the framework has no such hook (MindSpore)"),
    },
    "random": {
        "seed": "seed(value): seed every generator (framework, host initializers, numpy, Python)",
        "get_state": "get_state() -> state of the framework and host generators, JSON-serialisable (for checkpoints)",
        "set_state": "set_state(state)",
        "host_generator": "host_generator() -> the numpy Generator that initializers draw from",
        "tracker": "tracker() -> RNGStatesTracker: add(name, seed), fork(name), get_states() (JSON-serialisable), set_states(), reset()",
        "implementation": "implementation() -> 'native' | 'emulated' (framework generator replayable natively or not)",
    },
    "dist": {
        "init": "init(): join the torchrun/msrun job from the environment; alone, a no-op",
        "is_initialized": "is_initialized()",
        "shutdown": "shutdown(wait=True): leave the job (after a barrier unless wait=False) and free its groups",
        "launched_world_size": "launched_world_size(): world size the launcher announced (1 with no launcher)",
        "world_size": "world_size(group=None)",
        "rank": "rank(group=None): rank in the group (-1 for a non-member)",
        "new_group": "new_group(ranks) -> Group: every process calls it",
        "all_reduce": "all_reduce(x, op='sum'|'max'|'min', group=None) -> new tensor",
        "all_gather": "all_gather(x, group=None, dim=0) -> members' x concatenated along dim",
        "reduce_scatter": "reduce_scatter(x, op='sum', group=None, dim=0) -> this rank's slice of the reduction",
        "all_to_all": "all_to_all(x, group=None, input_splits=None, output_splits=None): along dim 0",
        "broadcast": "broadcast(x, src, group=None): src is a global rank",
        "shift": ("shift(x, offset=1, group=None): a ring step; each member sends x to group rank (r + offset) % n "
                  "and returns what group rank (r - offset) % n sent"),
        "send": "send(x, dst): dst is a global rank",
        "recv": "recv(shape, dtype, src) -> tensor",
        "barrier": "barrier(group=None)",
        "implementations": "implementations() -> {collective: 'native' | 'emulated'}",
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
        "save": "save(path, {name: tensor}, metadata=None): safetensors with JSON metadata, atomic",
        "load": "load(path) -> ({name: tensor}, metadata)",
    },
}


NAMESPACES = tuple(SPEC)  # the one list of facade namespaces (backends have a module for each)


def names(namespace: str) -> list[str]:
    return sorted(SPEC[namespace])
