"""One rank of the expert-parallel dispatch check (4 ranks, tests/launch.py).

For EP in {2, 4} and both token dispatchers, with routing spread over the experts and routing
that sends every token to experts 0 and 1 (so some ranks receive no token at all), and with
and without padding to capacity: this rank's MoE layer output and the gradients of its
tokens and router equal the one-device layer's on the same tokens, and its experts'
gradients equal the one-device gradients summed over the EP group. With identity experts,
dispatch then combine gives each token back (times its weights' sum, one).
usage: moe_worker.py OUT_DIR
"""

import json
import os
import sys

import numpy as np

from mindspeed_core import autograd, dist, nn, ops, runtime

runtime.bind()
dist.init()

from mindspeed_core.models.config import ModelConfig, MoEConfig  # noqa: E402
from mindspeed_core.models.moe import MoELayer  # noqa: E402
from mindspeed_core.parallel import experts, state  # noqa: E402

CFG = ModelConfig(hidden_size=16, num_layers=2, num_attention_heads=2, ffn_hidden_size=24)
ME = dist.rank()


def build(moe: MoEConfig, skewed: bool) -> MoELayer:
    layer = MoELayer(CFG, moe)
    g = np.random.default_rng(5)  # the same weights on every rank
    weights = {k: (g.standard_normal(v.shape) * 0.3).astype(np.float32) for k, v in nn.state_dict(layer).items()}
    if skewed:  # positive tokens and a router favouring experts 0 and 1 by a wide margin
        weights["router.weight"] = np.zeros_like(weights["router.weight"])
        weights["router.weight"][0], weights["router.weight"][1] = 2.0, 1.0
    nn.load_state_dict(layer, weights)
    return layer


def run(layer, x, cot):
    params = nn.parameters(layer)
    inputs = nn.Parameter(ops.tensor(x))
    value, grads = autograd.value_and_grad(lambda: ops.sum(layer(inputs) * ops.tensor(cot)), [inputs, *params])()
    names = ["input"] + [n for n, _ in nn.named_parameters(layer)]
    return ops.to_numpy(layer(ops.tensor(x))), dict(zip(names, (ops.to_numpy(g) for g in grads)))


class Identity(nn.Module):
    def forward(self, rows, counts, grouped=True):
        return rows * 1


failures, checks = [], []


def expect(tag, got, want, tol=1e-5):
    checks.append(tag)
    scale = max(float(np.max(np.abs(want))), 1e-6) if want.size else 1.0
    if got.shape != want.shape or (got.size and float(np.max(np.abs(got - want))) > tol * scale):
        worst = float(np.max(np.abs(got - want))) if got.shape == want.shape and got.size else None
        failures.append(f"{tag}: shapes {got.shape} vs {want.shape}, worst {worst}")


MOES = {"spread": MoEConfig(num_experts=4, topk=2),
        "padded": MoEConfig(num_experts=4, topk=2, capacity_factor=2.0, pad_to_capacity=True)}
g = np.random.default_rng(100 + ME)  # other tokens on every rank
for ep in (2, 4):
    ps = state.initialize(ep=ep)
    for dispatcher in experts.DISPATCHERS:
        for routing in ("spread", "skewed", "padded"):
            moe = MOES["padded" if routing == "padded" else "spread"]
            x = g.standard_normal((2, 6, 16)).astype(np.float32)
            if routing == "skewed":
                x = np.abs(x)
            cot = g.standard_normal(x.shape).astype(np.float32)
            one = build(moe, routing == "skewed")
            mine = build(moe, routing == "skewed")
            fields = experts.parallelize_moe_layer(mine, ps, False, dispatcher, CFG.gated)
            tag = f"EP={ep} {dispatcher} {routing}"
            want, want_grads = run(one, x, cot)
            got, got_grads = run(mine, x, cot)
            expect(f"{tag} output", got, want)
            for name in ("input", "router.weight"):
                expect(f"{tag} gradient of {name}", got_grads[name], want_grads[name])
            local = moe.num_experts // ep
            for name in ("experts.weight1", "experts.weight2"):
                assert fields[name]["expert"]
                summed = ops.to_numpy(dist.all_reduce(ops.tensor(want_grads[name]), group=ps.group("ep")))
                r = ps.local_rank("ep")
                expect(f"{tag} gradient of {name}", got_grads[name], summed[r * local:(r + 1) * local])
            if routing == "skewed":
                counts = ops.tensor(one.routing.tokens_per_expert.astype(np.float32))
                counts = ops.to_numpy(dist.all_reduce(counts, group=ps.group("ep")))  # every source's rows
                received = int(counts[ps.local_rank("ep") * local:][:local].sum())
                checks.append(f"{tag}: this rank's experts got {received} rows")
            mine.experts = Identity()
            expect(f"{tag} identity experts give the tokens back", run(mine, x, cot)[0], x)

json.dump({"failures": failures, "checks": checks}, open(os.path.join(sys.argv[1], f"rank{ME}.json"), "w"))
dist.shutdown()
runtime.exit_process(0)  # MindSpore: past the teardown that crashes now and then
