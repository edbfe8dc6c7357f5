"""Named random-number-generator states (Megatron's CUDA RNG tracker, for any framework).

Tensor parallelism needs dropout that differs across tensor-parallel ranks inside the
parallel region and agrees outside it. The tracker keeps one saved generator state per
name; ``fork(name)`` swaps that state in for the duration of a block and saves where it
left off. It only needs the backend's ``get_state``/``set_state``/``seed``, plus, for
checkpoints, ``encode``/``decode`` between a framework state and a JSON-serialisable value.
"""

from __future__ import annotations

import contextlib

from mindspeed_core import features


class RNGStatesTracker:
    def __init__(self, get_state, set_state, seed, encode=lambda s: s, decode=lambda s: s):
        self._get, self._set, self._seed = get_state, set_state, seed
        self._encode, self._decode = encode, decode
        self._states: dict[str, object] = {}
        self._seeds: set[int] = set()
        self._forked: list[str] = []  # the names of the open forks, innermost last

    def reset(self) -> None:
        self._states.clear()
        self._seeds.clear()

    def add(self, name: str, seed: int) -> None:
        if seed in self._seeds:
            raise ValueError(f"RNG seed {seed} is already used by another tracked state")
        if name in self._states:
            raise ValueError(f"RNG state {name!r} is already tracked")
        self._seeds.add(seed)
        outer = self._get()
        self._seed(seed)
        self._states[name] = self._get()
        self._set(outer)

    def get_states(self) -> dict:
        """{name: state} in a JSON-serialisable form (what checkpoints store)."""
        return {name: self._encode(state) for name, state in self._states.items()}

    def set_states(self, states: dict) -> None:
        self._states = {name: self._decode(state) for name, state in states.items()}

    def snapshot(self) -> dict:
        """The tracked states as they are now, for ``restore`` (not serialisable)."""
        return dict(self._states)  # fork replaces entries, never mutates one

    def restore(self, snapshot: dict) -> None:
        self._states = dict(snapshot)

    @contextlib.contextmanager
    def fork(self, name: str):
        if name not in self._states:
            raise KeyError(f"RNG state {name!r} is not tracked; add it first (known: {sorted(self._states)})")
        features.note_used("rng-tracker")
        outer = self._get()
        self._set(self._states[name])
        self._forked.append(name)
        try:
            yield
        finally:
            self._forked.pop()
            self._states[name] = self._get()
            self._set(outer)

    @property
    def active(self) -> str | None:
        """The state draws come from now: the innermost open fork's name, None outside any."""
        return self._forked[-1] if self._forked else None
