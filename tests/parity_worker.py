"""One rank of the parity runs (the layouts of test_parallel, test_pipeline): several training
configurations in one launch (starting a job costs more than a tiny model's ten steps,
above all under msrun). Also run in one process for the single-process references.

For each configuration (name, flags[, with_grads[, options]]) it records on rank 0:
<out>/<name>.jsonl (the metrics of a --train-iters run), <out>/<name>.log (what the trainer
printed; rank k > 0's in <out>/<name>.rank<k>.log) and, unless with_grads is false,
<out>/<name>-grads.npz: the first step's gradients (or step ``options["grads_at"]`` + 1's) as
the optimizer took them (reduced over data-parallel ranks; the distributed optimizer's slices
gathered), each whole (TP pieces, experts and pipeline stages joined), and its gradient norm
under the name "grad_norm". ``options`` {"double": NAME} multiplies the reduced gradient of
parameter NAME by 2 (the fault the gradient comparison must see); {"grads_at": 1} records the
second step's gradients (a LoRA factor A has none in the first, its B starting at zero).

usage: parity_worker.py OUT_DIR CONFIGS_JSON
(tests/launch.py run_configs)
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time

import numpy as np

from mindspeed_core import dist, features, runtime


def train_case(out_dir: str, name: str, flags: list, with_grads: bool = True, options: dict | None = None) -> None:
    from mindspeed_core.compat.megatron_args import training_parser
    from mindspeed_core.training import distributed
    from mindspeed_core.training.trainer import Trainer

    backend = runtime.bound()
    args = training_parser().parse_args([*flags, "--metrics-file", os.path.join(out_dir, f"{name}.jsonl")])
    features.validate(args, backend.NAME, backend.device.type(), backend.FRAMEWORK_VERSION)
    log, first = io.StringIO(), {}
    with contextlib.redirect_stdout(log):
        trainer = Trainer(args)
        double = (options or {}).get("double")
        if double is not None:  # the injected fault: one parameter's reduced gradient twice what it is
            build = trainer.build

            def build_with_fault():
                build()
                prepare = trainer.optimizer.prepare

                def doubled(grads, reduced=None):
                    grads = prepare(grads, reduced)
                    k = trainer.train_names.index(double)
                    grads[k] = grads[k] * 2.0
                    return grads

                trainer.optimizer.prepare = doubled

            trainer.build = build_with_fault

        def record(iteration, grads, norm):
            if iteration != (options or {}).get("grads_at", 0) or not with_grads:
                return
            whole = trainer.optimizer.whole_gradients(grads)
            plan = trainer.train_plan
            first.update(distributed.gather_pipeline(distributed.full_tensors(
                dict(zip(trainer.train_names, whole)), plan.shard_specs, trainer.ps, plan.expert_names), trainer.ps))
            first["grad_norm"] = np.array(norm, np.float64)

        trainer.after_reduction = record
        trainer.run()
    if dist.rank() == 0 and with_grads:
        np.savez(os.path.join(out_dir, f"{name}-grads.npz"), **first)
    with open(os.path.join(out_dir, f"{name}.log" if dist.rank() == 0 else f"{name}.rank{dist.rank()}.log"), "w") as fh:
        fh.write(log.getvalue())


if __name__ == "__main__":
    runtime.bind()
    out, configs = sys.argv[1], json.loads(open(sys.argv[2]).read())
    for case in configs:
        start = time.time()
        train_case(out, *case)
        if dist.rank() == 0:  # in the rank's log: where a launch's time goes
            print(f"case {case[0]}: {time.time() - start:.1f} s", file=sys.stderr, flush=True)
    dist.shutdown()
    runtime.exit_process(0)
