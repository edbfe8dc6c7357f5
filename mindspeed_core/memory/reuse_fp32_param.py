"""Parameter-copy reuse (--reuse-fp32-param, MindSpeed's name): the distributed optimizer's
fp32 master slice is kept as the bf16 parameters every rank holds anyway plus a 16-bit
residual, instead of as a second, fp32 copy. Between optimizer steps, where the activation
peak is, a data-parallel rank holds 2 bytes per element of its slice instead of 4.

On the bit patterns read as integers, fp32 = bf16 * 2**16 + residual, where bf16 is the
value rounded to nearest (ties to even, what a cast does) and the residual lies in
[-2**15, 2**15]. That is 2**16 + 1 values: the two ties (exactly half-way between two bf16
numbers) both round to the same even bf16, so no 16-bit residual can tell every fp32 number
apart (a pigeonhole, whatever the layout). A tie is moved by one fp32 unit in the last place
towards the bf16 it rounds to (the residual becomes +-(2**15 - 1)): the bf16 value, which is
all that forward and backward see, is unchanged; the master changes by 2**-23 relative, in
the 1 / 65536 of elements that land exactly on a tie.
"""

from __future__ import annotations

from mindspeed_core import features, ops

_HALF = 1 << 15  # a residual of +-_HALF is a tie


def split(master):
    """fp32 ``master`` -> (its bf16 rounding, the int16 residual); join() undoes it, exactly
    but for ties (moved by one ulp, see the module's note)."""
    features.note_used("reuse-fp32-param")
    high = ops.cast(master, "bfloat16")
    residual = ops.bitcast(master, "int32") - ops.cast(ops.bitcast(high, "int16"), "int32") * (1 << 16)
    return high, ops.cast(ops.clamp(residual, -(_HALF - 1), _HALF - 1), "int16")


def join(high, residual):
    """The fp32 number whose bf16 rounding is ``high`` with ``residual`` below it."""
    features.note_used("reuse-fp32-param")
    bits = ops.cast(ops.bitcast(high, "int16"), "int32") * (1 << 16) + ops.cast(residual, "int32")
    return ops.bitcast(bits, "float32")
