"""One rank of the context-parallel attention check (4 ranks, tests/launch.py).

For C in {2, 4} and each algorithm, with a causal mask and with packed documents whose
boundaries fall inside and across chunks: this rank's attention output and the gradients of
its q, k, v equal single-device attention's at its columns.
usage: cp_worker.py OUT_DIR
"""

import json
import os
import sys

import numpy as np

from mindspeed_core import autograd, composite, dist, nn, ops, runtime

runtime.bind()
if os.environ.get("CP_WORKER_DUMP"):  # debugging a hang: every rank prints its stack after that many seconds
    import faulthandler

    faulthandler.dump_traceback_later(int(os.environ["CP_WORKER_DUMP"]), exit=True)
dist.init()

from mindspeed_core.models.gpt import Seams, Tokens  # noqa: E402
from mindspeed_core.parallel import context, state  # noqa: E402

B, S, HQ, HK, D = 2, 16, 8, 4, 8
g = np.random.default_rng(7)
Q, K, V, COT = (g.standard_normal(shape).astype(np.float32) for shape in
                ((B, S, HQ, D), (B, S, HK, D), (B, S, HK, D), (B, S, HQ, D)))
DOCS = np.array([[0] * 5 + [1] * 7 + [2] * 4, [0] * 3 + [1] * 13])  # boundaries inside and across chunks


def attend(fn, q, k, v, cot):
    params = [nn.Parameter(ops.tensor(a)) for a in (q, k, v)]
    value, grads = autograd.value_and_grad(lambda: ops.sum(fn(*params) * ops.tensor(cot)), params)()
    return ops.to_numpy(fn(*[ops.tensor(a) for a in (q, k, v)])), [ops.to_numpy(x) for x in grads]


failures, checks = [], []
for packed in (False, True):
    tokens = Tokens(documents=DOCS) if packed else None
    segments = ops.tensor(DOCS) if packed else None
    want, want_grads = attend(lambda q, k, v: composite.attention(q, k, v, causal=True, segment_ids=segments),
                              Q, K, V, COT)
    for cp in (2, 4):
        ps = state.initialize(cp=cp)
        cols = context.local_columns(S, cp, ps.local_rank("cp"))
        for algo, degree in (("megatron_cp_algo", None), ("ulysses_cp_algo", None), ("hybrid_cp_algo", 2)):
            if algo == "hybrid_cp_algo" and cp == 2:
                continue  # a 2-rank hybrid is one of the other two
            # the ring's other form too (all-gather where point-to-point is native, and back)
            forms = [(True, False), (False, False)] + ([(False, True)] if algo != "ulysses_cp_algo" else [])
            for fused, other_form in forms:
                seams = context.ContextParallelSeams(Seams(), ps, algo, degree)
                if other_form:
                    seams.ring_by_gather = not seams.ring_by_gather
                tag = f"C={cp} {algo} {'packed' if packed else 'causal'} {'fused' if fused else 'composite'}"
                if algo != "ulysses_cp_algo":
                    tag += f" ring by {'all-gather' if seams.ring_by_gather else 'shift'}"
                tokens = Tokens(documents=DOCS) if packed else None
                got, grads = attend(lambda q, k, v: seams.attention(q, k, v, 0.0, fused, tokens),
                                    Q[:, cols], K[:, cols], V[:, cols], COT[:, cols])
                checks.append(tag)
                for what, a, b in [("output", got, want[:, cols])] + [
                        (f"gradient of {n}", x, w[:, cols]) for n, x, w in zip("qkv", grads, want_grads)]:
                    err = float(np.abs(a - b).max())
                    if not err <= 1e-5:
                        failures.append(f"{tag}: {what} off by {err:.2e}")
with open(os.path.join(sys.argv[1], f"rank{dist.rank()}.json"), "w") as fh:
    json.dump({"checks": checks, "failures": failures}, fh)
dist.shutdown()
runtime.exit_process(0)  # MindSpore: past the teardown that crashes now and then
