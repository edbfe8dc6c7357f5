"""One rank of the parity runs (pipeline, context parallelism): several training
configurations in one launch (starting a job costs more than a tiny model's ten steps,
above all under msrun).

For each configuration (name, flags[, with_grads]) it records on rank 0: <out>/<name>.jsonl
(the metrics of a --train-iters run), <out>/<name>.log (what the trainer printed) and, unless
with_grads is false, <out>/<name>-grads.npz (the whole model's gradients of the first step,
averaged over data-parallel ranks, before any optimizer step: one more build and step).

usage: parity_worker.py OUT_DIR CONFIGS_JSON
(tests/launch.py run_configs)
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import numpy as np

from mindspeed_core import dist, features, runtime

backend = runtime.bind()

from mindspeed_core.compat.megatron_args import training_parser  # noqa: E402
from mindspeed_core.training import distributed  # noqa: E402
from mindspeed_core.training.trainer import Trainer  # noqa: E402

out_dir, configs = sys.argv[1], json.loads(open(sys.argv[2]).read())
for name, flags, *rest in configs:
    with_grads = rest[0] if rest else True
    args = training_parser().parse_args([*flags, "--metrics-file", os.path.join(out_dir, f"{name}.jsonl")])
    features.validate(args, backend.NAME, backend.device.type(), backend.FRAMEWORK_VERSION)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        whole = None
        if with_grads:
            trainer = Trainer(args)
            trainer.build()
            _, grads = trainer.gradients(0)  # the first step's, from the initial weights
            grads = distributed.average_over_dp(grads, trainer.ps, trainer.plan.flags("expert"))
            whole = distributed.gather_pipeline(
                distributed.full_tensors(dict(zip(trainer.names, grads)), trainer.plan.shard_specs, trainer.ps,
                                         trainer.plan.expert_names), trainer.ps)
            args = training_parser().parse_args([*flags, "--metrics-file", os.path.join(out_dir, f"{name}.jsonl")])
        trainer = Trainer(args)
        trainer.run()
    if dist.rank() == 0:
        if whole is not None:
            np.savez(os.path.join(out_dir, f"{name}-grads.npz"), **whole)
        with open(os.path.join(out_dir, f"{name}.log"), "w") as fh:
            fh.write(log.getvalue())
dist.shutdown()
