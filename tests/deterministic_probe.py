"""One rank of `mindspeed train` (the arguments after the output folder) that records its
framework's determinism switches three times: before the run, when the job's collectives are set
up (HCCL and cuBLAS read theirs there) and when the run is over. Writes <folder>/<pid>.json."""

from __future__ import annotations

import json
import os
import sys

from mindspeed_core import cli


def switches(framework: str) -> dict:
    state = {k: os.environ.get(k) for k in ("HCCL_DETERMINISTIC", "CUBLAS_WORKSPACE_CONFIG")}
    if framework == "pytorch":
        import torch

        state.update(algorithms=torch.are_deterministic_algorithms_enabled(),
                     cudnn_deterministic=torch.backends.cudnn.deterministic,
                     cudnn_benchmark=torch.backends.cudnn.benchmark)
    else:
        import mindspore

        state["mindspore"] = mindspore.get_context("deterministic")
    return state


def main() -> int:
    folder, argv = sys.argv[1], sys.argv[2:]
    framework = os.environ["MINDSPEED_AI_FRAMEWORK"]
    if framework == "pytorch":
        from mindspeed_core.backends.torch import dist
    else:
        from mindspeed_core.backends.mindspore import dist
    record, init = {"before": switches(framework)}, dist.init

    def recording_init(*args, **kwargs):
        record["at_init"] = switches(framework)
        return init(*args, **kwargs)

    dist.init = recording_init  # before the framework is bound: the binding takes this one
    code = cli.main(argv)
    record["end"] = switches(framework)
    with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as fh:
        json.dump(record, fh)
    return code


if __name__ == "__main__":
    from mindspeed_core import runtime

    runtime.exit_process(main())
