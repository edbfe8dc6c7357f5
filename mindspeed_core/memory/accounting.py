"""What a training step holds in memory, measured, and what the literature predicts.

* ``SavedBytes``: the bytes autograd keeps for backward (distinct buffers, parameters
  excluded), counted through the framework's saved-tensor hooks: the live activations at
  the end of the forward pass. PyTorch only (MindSpore has no such hook).
* ``host_peak_during``: the peak of the process's resident memory above where it started,
  over a call (Linux VmHWM, reset through /proc/self/clear_refs): what the step really
  needed, activations and temporaries included, on any framework. Run it in a fresh process
  with MALLOC_MMAP_THRESHOLD_ fixed (``MALLOC_ENV``): then every large buffer is mapped
  when allocated and unmapped when freed, and memory an earlier step freed cannot hide a peak.
* ``layer_activation_bytes``: Korthikanti et al. (2022, section 4.1), per transformer layer,
  generalised to this model's widths, element size and gated MLP.

The command that measures a training step with these is :mod:`mindspeed_core.measure`.
"""

from __future__ import annotations

from mindspeed_core import autograd

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}


class SavedBytes:
    """Counts what autograd keeps for backward of the code run under ``counting()``, as
    distinct buffers (views of one buffer count once), parameters excluded. Tensors that
    another mechanism takes over (recompute drops them, swap moves them) are not seen."""

    def __init__(self):
        self._buffers = {}

    @property
    def bytes(self) -> int:
        return sum(self._buffers.values())

    def _pack(self, x, storage):
        key, size = storage
        self._buffers[key] = max(size, self._buffers.get(key, 0))
        return x

    def counting(self):
        return autograd.saved_tensors_hooks(self._pack, lambda x: x)


def _status(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no {key} in /proc/self/status")


def host_peak_during(fn):
    """(fn(), peak resident bytes above the resident bytes at the start)."""
    start = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:  # the peak (VmHWM) restarts from now
        fh.write("5")
    result = fn()
    return result, _status("VmHWM") - start


def layer_activation_bytes(s: int, b: int, h: int, a: int, f: int, element: int, dropout: bool,
                           gated: bool, part: str = "all") -> int:
    """Activations one transformer layer keeps for backward (Korthikanti et al. 2022, 4.1):
    sbh(34 + 5as/h) bytes for their 16-bit GPT layer with dropout; here with element size
    ``element``, MLP width ``f`` (gated: fc1 gives 2f), 1-byte dropout masks only with
    dropout. ``part``: "all", "attention" (input norm and self attention), "scores" (the
    a s^2 b terms: what selective recompute drops)."""
    sbh, as2b = s * b * h, a * s * s * b
    mask = 1 if dropout else 0
    scores = element * as2b + (mask + element) * as2b * mask  # softmax out; with dropout: mask and output
    attention = element * sbh + element * 5 * sbh + scores + mask * sbh  # norm in, qkv in, q k v, proj in
    if part == "scores":
        return scores
    if part == "attention":
        return attention
    mlp = element * sbh + element * sbh + element * s * b * f * (3 if gated else 2) + mask * sbh
    return attention + mlp


def estimated_peak_bytes(policy, layers: int, swap: bool = False, **size) -> int:
    """Activation bytes the transformer layers hold at the step's peak under ``policy``
    (memory/recompute.py Recompute), from ``layer_activation_bytes(**size)``: full recompute
    keeps each group's input and, in backward, one group's recomputed activations at a time;
    swap moves the attention blocks of the layers it covers to the host. The norm recompute
    built here saves nothing this formula counts (the norm's output stays; its internals,
    which the formula leaves out, go)."""
    whole = layer_activation_bytes(**size)
    if policy.granularity == "selective":
        whole -= layer_activation_bytes(**size, part="scores")
    group_input = size["element"] * size["s"] * size["b"] * size["h"]
    groups = policy.groups(layers)
    kept = sum(group_input if recomputed else (stop - start) * whole for start, stop, recomputed in groups)
    if swap:
        kept -= sum(stop - start for start, stop, recomputed in groups if not recomputed) * layer_activation_bytes(
            **size, part="attention")
    biggest = max((stop - start for start, stop, recomputed in groups if recomputed), default=0)
    return max(kept, sum(group_input for *_, r in groups if r) + biggest * whole)
