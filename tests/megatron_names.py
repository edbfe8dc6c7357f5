"""What megatron-core itself names and shapes: its GPTModel (local layer spec) built on CPU for
each requested pipeline stage at tensor-parallel size TP, one process per TP rank (gloo).

    python megatron_names.py SPEC.json OUT_PREFIX

SPEC: {"tp": 2, "port": "29600", "models": {name: {"config": TransformerConfig kwargs,
"vocab": padded vocabulary, "tied": bool, "position": "rope" | "learned_absolute",
"stages": [[pre_process, post_process, layers, TransformerConfig kwargs of the stage], ...]}}}. Writes OUT_PREFIX.<rank>.json:
{name: {"<pre><post><layers>": {state dict key: shape or null}}}. Run as a separate process: it
imports torch and megatron-core, which a test bound to MindSpore must not.
"""

from __future__ import annotations

import json
import os
import sys
import warnings


def build(rank: int, world: int, spec: dict, out: str) -> None:
    warnings.filterwarnings("ignore")
    import torch

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", spec["port"]
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    # the learned softmax offset (attention sinks) is made on the current CUDA device: here the CPU
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    result = {}
    for name, m in spec["models"].items():
        c = m["config"]
        layer_spec = get_gpt_layer_local_spec(num_experts=c.get("num_moe_experts"), moe_grouped_gemm=False,
                                              qk_layernorm=c.get("qk_layernorm", False),
                                              normalization=c.get("normalization", "LayerNorm"))
        result[name] = {}
        for pre, post, layers, extra in m["stages"]:
            cfg = TransformerConfig(use_cpu_initialization=True, **{**c, **extra, "num_layers": layers})
            if "moe_layer_freq" in extra:  # dense and MoE layers mixed: megatron-core's block spec per layer
                layer_spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False,
                                                        normalization=c.get("normalization", "LayerNorm"))
            model = GPTModel(cfg, layer_spec, vocab_size=m["vocab"], max_sequence_length=64, pre_process=bool(pre),
                             post_process=bool(post), share_embeddings_and_output_weights=m["tied"],
                             position_embedding_type=m["position"])
            result[name][f"{pre}{post}{layers}"] = {k: (list(v.shape) if hasattr(v, "shape") else None)
                                                   for k, v in model.state_dict().items()}
    with open(f"{out}.{rank}.json", "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    import torch.multiprocessing as mp

    spec = json.load(open(sys.argv[1]))
    if spec["tp"] > 1:
        mp.spawn(build, args=(spec["tp"], spec, sys.argv[2]), nprocs=spec["tp"])
    else:
        build(0, 1, spec, sys.argv[2])
