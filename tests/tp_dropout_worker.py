"""One rank of the tensor-parallel dropout check (run with 2 ranks by torchrun or msrun).

Inside the attention's random region (heads differ per rank) masks must differ across the
TP ranks; hidden dropout on replicated activations must draw the same mask everywhere, and
under sequence parallelism (each rank holds other tokens) different ones again.
usage: tp_dropout_worker.py OUT_DIR
"""

import json
import os
import sys

import numpy as np

from mindspeed_core import dist, ops, random, runtime

runtime.bind()
dist.init()

from mindspeed_core import autograd, nn  # noqa: E402
from mindspeed_core.memory import recompute  # noqa: E402
from mindspeed_core.models.config import ModelConfig  # noqa: E402
from mindspeed_core.models.gpt import GPTModel  # noqa: E402
from mindspeed_core.parallel import layers, state  # noqa: E402

ps = state.initialize(tp=2)
result = {}
for sp in (False, True):
    random.seed(5)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_attention_heads=4, ffn_hidden_size=64,
                      max_position_embeddings=16, attention_dropout=0.5, hidden_dropout=0.5)
    model = GPTModel(cfg)
    layers.parallelize(model, ps, sequence_parallel=sp)
    layers.seed_model_parallel_rng(5, ps)
    layer = model.decoder.layers[0]
    with model.seams.attention_rng():
        attention_mask = ops.to_numpy(ops.dropout(ops.ones((64,)), 0.5))
    hidden_mask = ops.to_numpy(layer._branch(ops.ones((64,)), model.seams))
    # the whole model runs with dropout on, and the tracker's stream moved on
    loss = float(ops.to_numpy(model.loss(ops.tensor(np.arange(16).reshape(1, 16) % 64),
                                         ops.tensor(np.arange(1, 17).reshape(1, 16) % 64))))
    gathered = ops.to_numpy(dist.all_gather(ops.tensor(np.stack([attention_mask, hidden_mask])[None]),
                                            group=ps.group("tp")))
    result[f"sp={sp}"] = {"attention_differs": not np.array_equal(gathered[0, 0], gathered[1, 0]),
                          "hidden_differs": not np.array_equal(gathered[0, 1], gathered[1, 1]),
                          "loss_finite": bool(np.isfinite(loss))}


def gradients(policy, sp):
    """Loss and gradients of a two-layer model with dropout, recomputing as ``policy`` says."""
    random.seed(5)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=64,
                      max_position_embeddings=16, attention_dropout=0.5, hidden_dropout=0.5, qk_layernorm=True)
    model = GPTModel(cfg)
    layers.parallelize(model, ps, sequence_parallel=sp)
    layers.seed_model_parallel_rng(5, ps)
    model.use_memory(policy)
    ids, labels = (ops.tensor(np.arange(k, 16 + k).reshape(1, 16) % 64) for k in (0, 1))
    loss, grads = autograd.value_and_grad(lambda: model.loss(ids, labels), nn.parameters(model))()
    return [ops.to_numpy(loss), *map(ops.to_numpy, grads)]


# recompute replays the forward pass's dropout masks, the tracker's (per-rank) ones included
for sp in (False, True):
    plain = gradients(recompute.NONE, sp)
    for name, policy in (("full", recompute.Recompute("full", "uniform", 1)), ("selective", recompute.Recompute("selective")),
                         ("norm-block", recompute.Recompute("full", "block", 1, norm=True))):
        got = gradients(policy, sp)
        result[f"sp={sp}"][f"recompute {name} exact"] = all(np.array_equal(a, b) for a, b in zip(got, plain))
with open(os.path.join(sys.argv[1], f"rank{dist.rank()}.json"), "w") as fh:
    json.dump(result, fh)
dist.shutdown()
runtime.exit_process(0)  # MindSpore: past the teardown that crashes now and then
