"""Rotary position embedding tables, computed once on the host (numpy) for any framework."""

from __future__ import annotations

import math

import numpy as np


def inverse_frequencies(head_dim: int, base: float, scaling: dict | None = None) -> np.ndarray:
    inv = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = np.clip((old / wavelen - low) / (high - low), 0.0, 1.0)
        scaled = (1 - smooth) * inv / factor + smooth * inv
        # long wavelengths are divided by the factor, short ones kept, the band between blended
        return np.where(wavelen > old / low, inv / factor, np.where(wavelen < old / high, inv, scaled))
    raise ValueError(f"unsupported rope scaling type {kind!r} (linear, llama3; yarn is planned)")


def tables(seq_len: int, head_dim: int, base: float, scaling: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin of shape [seq_len, head_dim] (the halves repeated, as apply_rotary expects)."""
    angles = np.outer(np.arange(seq_len, dtype=np.float64), inverse_frequencies(head_dim, base, scaling))
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
