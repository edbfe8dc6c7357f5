"""Collectives composed from one primitive: a float32 sum all-reduce over a group.

MindSpore's CPU backend (mccl) reduces only float32/float16 with SUM, gathers and
broadcasts only on the world group, and has no ReduceScatter, AlltoAll or Send/Receive.
Everything else is built here from the sum, with identical results:

* data movement (gather, broadcast, all-to-all, send/recv) puts each rank's bytes into its
  own zero-filled slot, encoded as 16-bit lanes held in float32 (every lane value is an
  integer below 2**16, and x + 0 is exact), sums, and decodes: bit-exact for every dtype;
* integer sums split each value into 16-bit limbs, sum the limbs in float32 (exact while
  ranks * 65535 < 2**24) and recombine with carries: exact;
* float16/bfloat16 sums go through float32 (exact for up to 256 ranks); float64 sums
  are carried as a float32 high part and low part (about 48 significant bits);
* max/min gather every rank's tensor and reduce locally.

Works on host numpy arrays; ``sum_f32(array, group)`` is the backend's native all-reduce.
The cost is the slot overhead (group size times the payload for gathers), which the
communication accounting reports.
"""

from __future__ import annotations

import numpy as np

_MAX_RANKS_EXACT = 256


class EmulatedCollectives:
    def __init__(self, sum_f32, group_size, group_rank):
        self._sum = sum_f32  # (np.float32 array, group) -> np.float32 array
        self._size = group_size  # group -> int
        self._rank = group_rank  # group -> this process's rank within the group

    # -- exact byte transport ---------------------------------------------------------------
    @staticmethod
    def _lanes(arr: np.ndarray) -> np.ndarray:
        raw = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        if raw.size % 2:
            raw = np.concatenate([raw, np.zeros(1, np.uint8)])
        return raw.view(np.uint16).astype(np.float32)

    @staticmethod
    def _unlanes(lanes: np.ndarray, dtype, shape) -> np.ndarray:
        raw = np.rint(lanes).astype(np.uint16).view(np.uint8)
        count = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return raw[:count].view(dtype).reshape(shape).copy()

    def _lane_count(self, dtype, shape) -> int:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return (nbytes + 1) // 2

    def _exchange(self, slots: int, mine: int, arr: np.ndarray, group) -> np.ndarray:
        """Each rank writes its lanes into slot ``mine`` of ``slots``; returns all slots."""
        lanes = self._lanes(arr)
        buf = np.zeros((slots, lanes.size), np.float32)
        if mine >= 0:
            buf[mine] = lanes
        return self._sum(buf, group)

    # -- collectives ------------------------------------------------------------------------
    def all_reduce(self, arr: np.ndarray, op: str, group) -> np.ndarray:
        if op in ("max", "min"):
            stacked = self.all_gather_stack(arr, group)
            return (stacked.max(axis=0) if op == "max" else stacked.min(axis=0)).astype(arr.dtype)
        if op != "sum":
            raise ValueError(f"all_reduce op {op!r} is not supported (sum, max, min)")
        if self._size(group) > _MAX_RANKS_EXACT:
            raise ValueError(f"emulated all_reduce is exact up to {_MAX_RANKS_EXACT} ranks")
        kind = arr.dtype.kind
        if arr.dtype == np.float32:
            return self._sum(arr, group)
        if arr.dtype == np.float16:
            return self._sum(arr.astype(np.float32), group).astype(np.float16)
        if arr.dtype == np.float64:
            hi = arr.astype(np.float32)
            lo = (arr - hi.astype(np.float64)).astype(np.float32)
            both = self._sum(np.stack([hi, lo]), group).astype(np.float64)
            return both[0] + both[1]
        if kind in "iub":
            wide = arr.astype(np.int64)
            limbs = np.stack([((wide >> (16 * i)) & 0xFFFF) for i in range(4)]).astype(np.float32)
            summed = np.rint(self._sum(limbs, group)).astype(np.int64)
            total = np.zeros_like(wide)
            for i in range(4):
                total += summed[i] << (16 * i)  # int64 wraps like the native sum would
            return total.astype(np.bool_) if kind == "b" else total.astype(arr.dtype)
        raise ValueError(f"all_reduce does not support dtype {arr.dtype}")

    def all_gather_stack(self, arr: np.ndarray, group) -> np.ndarray:
        return self.gathered(self._sum(self.gather_slots(arr, group), group), arr.dtype, arr.shape)

    def gather_slots(self, arr: np.ndarray, group) -> np.ndarray:
        """What an all-gather sums: this rank's bytes in its own slot, zeros elsewhere (the
        caller may run the sum asynchronously)."""
        lanes = self._lanes(arr)
        buf = np.zeros((self._size(group), lanes.size), np.float32)
        buf[self._rank(group)] = lanes
        return buf

    def gathered(self, summed: np.ndarray, dtype, shape) -> np.ndarray:
        """Every rank's array, stacked, from the summed slots."""
        return np.stack([self._unlanes(summed[i], dtype, shape) for i in range(summed.shape[0])])

    def broadcast(self, arr: np.ndarray, src_group_rank: int, group) -> np.ndarray:
        mine = 0 if self._rank(group) == src_group_rank else -1
        return self._unlanes(self._exchange(1, mine, arr, group)[0], arr.dtype, arr.shape)

    def all_to_all(self, chunks: list[np.ndarray], group) -> list[np.ndarray]:
        """chunks[j] goes to group rank j; returns the chunk received from each rank.

        Chunks may differ in their first dimension (uneven splits); their other dimensions
        and dtype must agree across ranks.
        """
        rows = np.array([c.shape[0] for c in chunks], np.int64)
        all_rows = self.all_gather_stack(rows, group)  # [src, dst]
        return self.all_to_all_received(self._sum(self.all_to_all_slots(chunks, all_rows, group), group),
                                        chunks[0].dtype, chunks[0].shape[1:], all_rows, group)

    def all_to_all_slots(self, chunks: list[np.ndarray], all_rows: np.ndarray, group) -> np.ndarray:
        """What an all-to-all sums: this rank's chunk for rank j in slot [me, j], zeros elsewhere
        (``all_rows`` [src, dst]: every rank's row counts, which size the slots; the caller may
        run the sum asynchronously)."""
        n, me = self._size(group), self._rank(group)
        width = self._lane_count(chunks[0].dtype, (int(all_rows.max()),) + tuple(chunks[0].shape[1:]))
        buf = np.zeros((n, n, width), np.float32)
        for j, c in enumerate(chunks):
            lanes = self._lanes(c)
            buf[me, j, : lanes.size] = lanes
        return buf

    def all_to_all_received(self, summed: np.ndarray, dtype, tail: tuple, all_rows: np.ndarray, group) -> list:
        """The chunks that arrived at this rank, from the summed slots."""
        n, me = self._size(group), self._rank(group)
        return [self._unlanes(summed[i, me], dtype, (int(all_rows[i, me]),) + tuple(tail)) for i in range(n)]

    def shift(self, arr: np.ndarray, offset: int, group) -> np.ndarray:
        """Every rank's array moves ``offset`` places along the group: one slot per rank, each
        rank writes into its receiver's slot (a permutation: one writer per slot) and reads
        its own. The group carries n times the payload, as an all-gather would."""
        return self.shifted(self._sum(self.shift_slots(arr, offset, group), group), arr.dtype, arr.shape, group)

    def shift_slots(self, arr: np.ndarray, offset: int, group) -> np.ndarray:
        """What a ring step sums: this rank's bytes in its receiver's slot, zeros elsewhere (the
        caller may run the sum asynchronously)."""
        n, me = self._size(group), self._rank(group)
        lanes = self._lanes(arr)
        buf = np.zeros((n, lanes.size), np.float32)
        buf[(me + offset) % n] = lanes
        return buf

    def shifted(self, summed: np.ndarray, dtype, shape, group) -> np.ndarray:
        """What arrived at this rank, from the summed slots."""
        return self._unlanes(summed[self._rank(group)], dtype, shape)

    def send(self, arr: np.ndarray, pair_group) -> None:
        """Point-to-point over a two-rank group: the receiver's slot is zero, so the sum
        it gets is exactly the sender's lanes."""
        self._sum(self._lanes(arr), pair_group)

    def recv(self, shape, dtype, pair_group) -> np.ndarray:
        lanes = self._sum(np.zeros(self._lane_count(dtype, shape), np.float32), pair_group)
        return self._unlanes(lanes, dtype, shape)

    def barrier(self, group) -> None:
        self._sum(np.zeros(1, np.float32), group)
