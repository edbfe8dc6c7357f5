"""Float64 numpy references for facade checks: values and finite-difference gradients."""

from __future__ import annotations

import math

import numpy as np

from mindspeed_core import autograd, nn, ops


def rng(seed=0):
    return np.random.default_rng(seed)


def numeric_grad(f, inputs, i, eps=1e-6):
    """d f(inputs) / d inputs[i] by central differences, f scalar-valued, float64."""
    x = inputs[i]
    grad = np.zeros_like(x)
    flat = x.reshape(-1)
    g = grad.reshape(-1)
    for j in range(flat.size):
        old = flat[j]
        flat[j] = old + eps
        plus = f(*inputs)
        flat[j] = old - eps
        minus = f(*inputs)
        flat[j] = old
        g[j] = (plus - minus) / (2 * eps)
    return grad


def check_op(facade_fn, ref_fn, inputs, wrt=(), rtol=1e-5, atol=1e-6, grad_rtol=2e-3, grad_atol=2e-4,
             dtype="float32", seed=1):
    """Compare facade_fn(*tensors) with ref_fn(*arrays) in float64, and, for the inputs
    whose positions are in ``wrt``, the facade's gradients of sum(out * c) with finite
    differences of the reference (c a fixed random cotangent)."""
    arrays = [np.asarray(a) for a in inputs]
    tensors = [ops.tensor(a, dtype=dtype if a.dtype.kind == "f" else None) for a in arrays]
    out = facade_fn(*tensors)
    ref = ref_fn(*[a.astype(np.float64) if a.dtype.kind == "f" else a for a in arrays])
    outs, refs = (out, ref) if isinstance(out, (tuple, list)) else ((out,), (ref,))
    for o, r in zip(outs, refs):
        got = ops.to_numpy(o)
        assert got.shape == np.shape(r), f"shape {got.shape} != reference {np.shape(r)}"
        np.testing.assert_allclose(got.astype(np.float64) if got.dtype.kind == "f" else got, r, rtol=rtol, atol=atol)
    if not wrt:
        return
    ref0 = np.asarray(refs[0], dtype=np.float64)
    cot = rng(seed).standard_normal(ref0.shape)
    params = [nn.Parameter(tensors[i]) for i in wrt]

    def loss(*_):
        args = list(tensors)
        for k, i in enumerate(wrt):
            args[i] = params[k]
        o = facade_fn(*args)
        o = o[0] if isinstance(o, (tuple, list)) else o
        return ops.sum(ops.cast(o, "float32") * ops.tensor(cot.astype(np.float32)))

    _, grads = autograd.value_and_grad(loss, params)()
    f64 = [np.array(a, dtype=np.float64 if a.dtype.kind == "f" else a.dtype, order="C") for a in arrays]

    def scalar(*xs):
        r = ref_fn(*xs)
        r = r[0] if isinstance(r, (tuple, list)) else r
        return float(np.sum(np.asarray(r, dtype=np.float64) * cot))

    for k, i in enumerate(wrt):
        expected = numeric_grad(scalar, f64, i)
        np.testing.assert_allclose(ops.to_numpy(grads[k]).astype(np.float64), expected, rtol=grad_rtol, atol=grad_atol,
                                   err_msg=f"gradient of input {i}")


# ---- references -------------------------------------------------------------------------------

def softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def log_softmax(x, axis=-1):
    m = x.max(axis=axis, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=axis, keepdims=True))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def gelu(x, approximate="none"):
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    erf = np.vectorize(math.erf)
    return 0.5 * x * (1 + erf(x / math.sqrt(2)))


def cross_entropy(logits, target, ignore_index=-100, reduction="mean"):
    lp = log_softmax(logits)
    keep = target != ignore_index
    safe = np.where(keep, target, 0)
    losses = -lp[np.arange(len(target)), safe] * keep
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / keep.sum()


def rms_norm(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def layer_norm(x, w, b=None, eps=1e-5):
    c = x - x.mean(-1, keepdims=True)
    y = c / np.sqrt((c * c).mean(-1, keepdims=True) + eps) * w
    return y if b is None else y + b


def swiglu(x):
    a, b = np.split(x, 2, axis=-1)
    return a * sigmoid(a) * b


def apply_rotary(x, cos, sin):
    cos = cos.reshape(1, cos.shape[0], 1, cos.shape[1])
    sin = sin.reshape(1, sin.shape[0], 1, sin.shape[1])
    a, b = np.split(x, 2, axis=-1)
    return x * cos + np.concatenate([-b, a], axis=-1) * sin


def attention(q, k, v, causal=False, mask=None, scale=None, segment_ids=None, return_lse=False, window=None,
              softcap=None):
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    rep = hq // hk
    k = np.repeat(k, rep, axis=2)
    v = np.repeat(v, rep, axis=2)
    scale = 1 / math.sqrt(d) if scale is None else scale
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    if window is not None:  # the window latest keys up to each query (bottom-right aligned)
        s = np.where(np.arange(sk)[None, :] > np.arange(sq)[:, None] + (sk - sq) - window, s, -np.inf)
    if mask is not None:
        s = np.where(mask, s, -np.inf) if mask.dtype == np.bool_ else s + mask
    if causal:
        keep = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)
        s = np.where(keep, s, -np.inf)
    if segment_ids is not None:
        s = np.where((segment_ids[:, :, None] == segment_ids[:, None, :])[:, None], s, -np.inf)
    out = np.einsum("bhqk,bkhd->bqhd", softmax(s), v)
    if not return_lse:
        return out
    peak = s.max(axis=-1, keepdims=True)
    lse = (np.log(np.exp(s - peak).sum(axis=-1, keepdims=True)) + peak)[..., 0]  # [b, h, q]
    return out, lse.transpose(0, 2, 1)


def rope_tables(s, d, base=10000.0):
    inv = 1.0 / base ** (np.arange(0, d, 2) / d)
    ang = np.outer(np.arange(s), inv)
    ang = np.concatenate([ang, ang], axis=-1)
    return np.cos(ang), np.sin(ang)


def _dense_model(state: dict, cfg):
    """(weights in float64, norm(x, name), layer(x, prefix, cos, sin)) of a dense LLaMA-style
    model (RMSNorm or LayerNorm, RoPE, SwiGLU or GELU, grouped-query attention, no biases):
    our model's layout written out in numpy, a reference independent of the facade."""
    w = {k: np.asarray(v, np.float64) for k, v in state.items()}

    def norm(x, name):
        if cfg.normalization == "layernorm":
            return layer_norm(x, w[name + ".weight"], w[name + ".bias"], cfg.norm_epsilon)
        return rms_norm(x, w[name + ".weight"], cfg.norm_epsilon)

    act = swiglu if cfg.activation == "swiglu" else lambda h: gelu(h, "tanh" if cfg.activation == "gelu_tanh" else "none")
    d = cfg.kv_channels
    groups, per_group = cfg.num_query_groups, cfg.num_attention_heads // cfg.num_query_groups

    def layer(x, p, cos, sin):
        b, s = x.shape[:2]
        h = norm(x, p + "input_layernorm")
        qkv = (h @ w[p + "self_attention.linear_qkv.weight"].T).reshape(b, s, groups, per_group + 2, d)
        q = qkv[:, :, :, :per_group].reshape(b, s, groups * per_group, d)
        k, v = qkv[:, :, :, per_group], qkv[:, :, :, per_group + 1]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attention(q, k, v, causal=True).reshape(b, s, -1)
        x = x + out @ w[p + "self_attention.linear_proj.weight"].T
        h = norm(x, p + "pre_mlp_layernorm")
        return x + act(h @ w[p + "mlp.linear_fc1.weight"].T) @ w[p + "mlp.linear_fc2.weight"].T

    return w, norm, layer


def gpt_logits(state: dict, cfg, ids: np.ndarray) -> np.ndarray:
    """Float64 logits [s, vocab] of one sequence ``ids`` [s] through a dense LLaMA-style model
    given its whole-model state dict (_dense_model)."""
    w, norm, layer = _dense_model(state, cfg)
    cos, sin = rope_tables(len(ids), cfg.kv_channels, cfg.rotary_base)
    x = w["embedding.word_embeddings.weight"][ids][None]  # [1, s, h]
    for n in range(cfg.num_layers):
        x = layer(x, f"decoder.layers.{n}.", cos, sin)
    x = norm(x, "decoder.final_layernorm")
    head = w.get("output_layer.weight", w["embedding.word_embeddings.weight"])
    return (x @ head.T)[0]


def mtp_losses(state: dict, cfg, ids: np.ndarray, labels: np.ndarray, loss_mask=None) -> list[float]:
    """Float64 multi-token prediction losses of a dense model with cfg.mtp_num_layers modules
    (DeepSeek-V3's eq. 21-25): depth k's mean cross entropy of the token k + 1 places on,
    over the positions where it exists (and counts in ``loss_mask`` [b, S], k places on)."""
    w, norm, layer = _dense_model(state, cfg)
    b, s = ids.shape
    cos, sin = rope_tables(s, cfg.kv_channels, cfg.rotary_base)
    emb = w["embedding.word_embeddings.weight"]
    head = w.get("output_layer.weight", emb)
    hidden = emb[ids]
    for n in range(cfg.num_layers):
        hidden = layer(hidden, f"decoder.layers.{n}.", cos, sin)
    mask = np.ones((b, s)) if loss_mask is None else np.asarray(loss_mask, np.float64)
    out = []
    for k in range(1, cfg.mtp_num_layers + 1):
        p = f"mtp.layers.{k - 1}."
        token_ahead = np.zeros_like(labels)
        token_ahead[:, :s - k + 1] = labels[:, k - 1:]  # t_{i+k}
        joined = np.concatenate([norm(emb[token_ahead], p + "enorm"), norm(hidden, p + "hnorm")], axis=-1)
        hidden = layer(joined @ w[p + "eh_proj.weight"].T, p + "transformer_layer.", cos, sin)
        logp = log_softmax(norm(hidden, f"mtp.final_layernorms.{k - 1}") @ head.T)
        target, keep = np.zeros_like(labels), np.zeros((b, s))
        target[:, :s - k], keep[:, :s - k] = labels[:, k:], mask[:, k:]
        nll = -np.take_along_axis(logp, target[..., None], -1)[..., 0]
        out.append(float((nll * keep).sum() / max(keep.sum(), 1.0)))
    return out


def token_log_probs(state: dict, cfg, ids) -> np.ndarray:
    """log p(ids[t + 1] | ids[:t + 1]) for t < len(ids) - 1, float64."""
    ids = np.asarray(ids)
    logp = log_softmax(gpt_logits(state, cfg, ids[:-1]))
    return logp[np.arange(len(ids) - 1), ids[1:]]
