"""Rotary position embedding tables, computed on the host (numpy) for any framework: plain,
and the scalings of Hugging Face configs' rope_scaling: linear, llama3, yarn, dynamic
(NTK-aware, its base growing with the sequence past the model's length) and longrope (Phi-3:
per-dimension factors, short ones up to the original length, long ones past it)."""

from __future__ import annotations

import math

import numpy as np

from mindspeed_core import features

# rope_scaling types, with the keys each needs as positive numbers
SCALINGS = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                              "original_max_position_embeddings"),
            "yarn": ("original_max_position_embeddings",), "dynamic": ("factor",),
            "longrope": ("original_max_position_embeddings",)}


# keys a scaling may carry besides its required ones: positive numbers (mscale and
# mscale_all_dim may be 0, DeepSeek's configs' "not set")
_OPTIONAL = {"factor": 0, "beta_fast": 0, "beta_slow": 0, "attention_factor": 0, "mscale": None, "mscale_all_dim": None,
             "long_mscale": 0, "short_mscale": 0}


def problem(scaling: dict) -> str | None:
    """What is wrong with a rope_scaling dict ({"rope_type": ..., its numbers}), or None."""
    what = kind(scaling)
    if what not in SCALINGS:
        return f"rope_type {what!r} is not supported (supported: {', '.join(SCALINGS)})"
    for key in SCALINGS[what]:
        value = scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            return f"{key} must be a positive number for rope_type {what!r}, got {value!r}"
    if what == "longrope":
        for key in ("short_factor", "long_factor"):
            value = scaling.get(key)
            if not isinstance(value, (list, tuple)) or not value or any(
                    isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0 for x in value):
                return f"{key} must be a list of positive numbers for rope_type 'longrope', got {value!r}"
        if len(scaling["short_factor"]) != len(scaling["long_factor"]):
            return "short_factor and long_factor must be lists of the same length (half the rotary dimensions)"
    for key, low in _OPTIONAL.items():
        value = scaling.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
                value <= 0 if low == 0 else value < 0):
            return f"{key} must be a {'positive' if low == 0 else 'non-negative'} number, got {value!r}"
    return None


def kind(scaling: dict | None) -> str | None:
    return None if not scaling else scaling.get("rope_type", scaling.get("type"))


def extends_positions(scaling: dict | None) -> bool:
    """Whether the scaling is made for sequences longer than max_position_embeddings (dynamic
    NTK); the others define positions up to it."""
    return kind(scaling) == "dynamic"


def switch_length(scaling: dict | None) -> int | None:
    """longrope: the length past which the long factors apply (None: no such switch)."""
    return int(scaling["original_max_position_embeddings"]) if kind(scaling) == "longrope" else None


def _powers(head_dim: int, base: float) -> np.ndarray:
    return base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def _yarn(head_dim: int, base: float, scaling: dict, max_positions: int) -> tuple[np.ndarray, float]:
    """YaRN (Peng et al. 2023): frequencies that turn fewer than beta_slow times over the
    original length are interpolated (divided by the factor), those turning more than beta_fast
    times kept, a linear ramp over the dimensions between; cos and sin are scaled by the
    attention temperature 0.1 ln(factor) + 1 (or the mscale ratio DeepSeek's configs give)."""
    features.note_used("yarn")
    original = float(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or max_positions / original)
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dimension(turns: float) -> float:  # the dimension whose frequency turns `turns` times over `original`
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension(fast), dimension(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of one step, not a division by zero
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    powers = _powers(head_dim, base)
    inv = (1.0 / (factor * powers)) * ramp + (1.0 / powers) * (1.0 - ramp)

    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, all_dims = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (yarn_temperature(factor, mscale) / yarn_temperature(factor, all_dims) if mscale and all_dims
                     else yarn_temperature(factor))
    return inv, float(attention)


def yarn_temperature(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 mscale ln(factor) + 1 (1 when nothing is stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _longrope(head_dim: int, base: float, scaling: dict, seq_len: int, max_positions: int | None):
    """LongRoPE (Phi-3): each frequency divided by its own factor, the short list's for
    sequences up to the original length and the long list's past it (the table is chosen by
    the furthest position); cos and sin scaled by sqrt(1 + ln(factor) / ln(original)), the
    factor being the model's length over the original one unless the config gives it, or by
    MindSpeed-LLM's --long-mscale / --short-mscale when both are given."""
    features.note_used("longrope")
    original = int(scaling["original_max_position_embeddings"])
    factors = np.asarray(scaling["long_factor" if seq_len > original else "short_factor"], np.float64)
    if len(factors) != head_dim // 2:
        raise ValueError(f"rope_scaling's factor lists hold {len(factors)} numbers; the rotary dimensions need "
                         f"{head_dim // 2}")
    factor = float(scaling.get("factor") or (max_positions or original) / original)
    attention = scaling.get("attention_factor")
    if scaling.get("long_mscale") and scaling.get("short_mscale"):
        attention = scaling["long_mscale" if seq_len > original else "short_mscale"]
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return 1.0 / (factors * _powers(head_dim, base)), float(attention)


def frequencies(head_dim: int, base: float, scaling: dict | None = None, seq_len: int = 0,
                max_positions: int | None = None) -> tuple[np.ndarray, float]:
    """The inverse frequencies [head_dim / 2] of a table covering ``seq_len`` positions of a
    model made for ``max_positions``, and the factor cos and sin are multiplied by."""
    what = kind(scaling)
    if what is None:
        return 1.0 / _powers(head_dim, base), 1.0
    if what == "yarn":
        return _yarn(head_dim, base, scaling, max_positions or int(scaling["original_max_position_embeddings"]))
    if what == "longrope":
        return _longrope(head_dim, base, scaling, seq_len, max_positions)
    factor = float(scaling["factor"])
    features.note_used("rope-scaling-flags")  # the row of linear, llama3 and dynamic NTK, from flags or a config
    if what == "linear":
        return 1.0 / _powers(head_dim, base) / factor, 1.0
    if what == "dynamic":  # the base grows with the length past the model's; below it, plain
        length = max(seq_len, max_positions)
        grown = base * (factor * length / max_positions - (factor - 1)) ** (head_dim / (head_dim - 2))
        return 1.0 / _powers(head_dim, grown), 1.0
    if what == "llama3":
        inv = 1.0 / _powers(head_dim, base)
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = np.clip((old / wavelen - low) / (high - low), 0.0, 1.0)
        scaled = (1 - smooth) * inv / factor + smooth * inv
        # long wavelengths are divided by the factor, short ones kept, the band between blended
        return np.where(wavelen > old / low, inv / factor, np.where(wavelen < old / high, inv, scaled)), 1.0
    raise ValueError(f"unsupported rope scaling type {what!r} ({', '.join(SCALINGS)})")


def tables(seq_len: int, head_dim: int, base: float, scaling: dict | None = None,
           max_positions: int | None = None, decided_by: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin of shape [seq_len, head_dim] (the halves repeated, as apply_rotary expects);
    ``decided_by``: the sequence length that sets the frequencies (longrope's choice of
    factors), when the table is longer than that sequence."""
    inv, attention = frequencies(head_dim, base, scaling, seq_len if decided_by is None else decided_by,
                                 max_positions or seq_len)
    angles = np.outer(np.arange(seq_len, dtype=np.float64), inv)
    angles = np.concatenate([angles, angles], axis=-1)
    return (np.cos(angles) * attention).astype(np.float32), (np.sin(angles) * attention).astype(np.float32)
