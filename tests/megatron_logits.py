"""megatron-core's own GPTModel (local layer spec, built on CPU, one gloo process per TP rank)
loads the rank files our converter wrote and runs a batch: its logits, for the test to compare
with transformers'.

    python megatron_logits.py SPEC.json

SPEC: {"tp": 2, "port": "29600", "models": {name: {"config": TransformerConfig kwargs,
"activation": "swiglu" | "gelu" | "gelu_tanh", "vocab": padded vocabulary, "tied": bool,
"position": "rope" | "learned_absolute", "rotary_base": float, "folder": the converted checkpoint,
"ids": ids.npy, "out": logits.npy}}}. Rank 0 writes each model's logits [batch, seq, padded vocab]
(gathered over TP), float64. With "ep": the processes are that many expert-parallel ranks too;
with "etp": 1, the experts are whole on each TP rank (megatron-core's expert tensor parallel size).
A model with "dist" (an iteration folder of Megatron's torch_dist format) instead of "folder" is
read with megatron-core's dist_checkpointing.load, as Megatron-LM's --ckpt-format torch_dist
does; with "resave" (a folder), megatron-core then writes it there with
dist_checkpointing.save, at this layout, as Megatron-LM would: the args of the checkpoint it
read, without ours (mindspeed_model_config), its iteration, the tracker.

Three things of megatron-core fail on a CPU-only host without Transformer Engine, and only
those are stubbed: torch.cuda.current_device (asked by the rotary embedding and the MoE router
for where to put their tensors: here the CPU), the CUDA RNG tracker (forked around attention
dropout, which eval mode makes the identity), and moe_utils.te_general_gemm, a name its router
reads but only binds when Transformer Engine imports (None is its own "not available").
Run as a separate process: it imports torch and megatron-core, which a test bound to MindSpore
must not.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import warnings


class _NoCudaRng:
    """The RNG tracker's interface without CUDA: nothing to fork in eval mode (no dropout)."""

    def fork(self, name=None):
        return contextlib.nullcontext()

    def add(self, name, seed):
        pass

    def is_initialized(self):
        return True


def run(rank: int, world: int, spec: dict) -> None:
    warnings.filterwarnings("ignore")
    import numpy as np
    import torch

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", spec["port"]
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    torch.cuda.current_device = lambda: "cpu"  # the stub: where the rotary table is built
    torch.cuda.synchronize = lambda *a, **k: None  # dist_checkpointing.save waits for the device: none here
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.core.transformer.moe import moe_utils

    tensor_parallel.random.get_cuda_rng_tracker = lambda *a, **k: _NoCudaRng()  # the second stub
    if not hasattr(moe_utils, "te_general_gemm"):  # the third: without Transformer Engine the name is never bound
        moe_utils.te_general_gemm = None
    tensor_parallel.get_cuda_rng_tracker = tensor_parallel.random.get_cuda_rng_tracker
    ep = spec.get("ep", 1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world // ep, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=spec.get("etp"))
    for name, m in spec["models"].items():
        c = dict(m["config"])
        c["activation_func"] = {"swiglu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu,
                                "gelu_tanh": functools.partial(torch.nn.functional.gelu, approximate="tanh")}[m["activation"]]
        cfg = TransformerConfig(use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                                bias_activation_fusion=False, masked_softmax_fusion=False, **c)
        if "moe_layer_freq" in c:
            layer_spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False,
                                                    normalization=c.get("normalization", "LayerNorm"))
        else:
            layer_spec = get_gpt_layer_local_spec(num_experts=c.get("num_moe_experts"), moe_grouped_gemm=False,
                                                  qk_layernorm=c.get("qk_layernorm", False),
                                                  normalization=c.get("normalization", "LayerNorm"))
        model = GPTModel(cfg, layer_spec, vocab_size=m["vocab"], max_sequence_length=64, pre_process=True,
                         post_process=True, share_embeddings_and_output_weights=m["tied"],
                         position_embedding_type=m["position"], rotary_base=m["rotary_base"], parallel_output=False)
        if "dist" in m:
            from megatron.core import dist_checkpointing

            # as Megatron-LM's load_checkpoint: the model's part of the state, beside common.pt's args
            loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, m["dist"])
            model.load_state_dict(loaded["model"], strict=True)
        else:
            path = os.path.join(m["folder"], "iter_0000000", f"mp_rank_{rank:02d}", "model_optim_rng.pt")
            model.load_state_dict(torch.load(path, map_location="cpu", weights_only=False)["model"], strict=True)
        if "resave" in m:
            resave(rank, model, m["dist"], m["resave"])
        model.eval()
        ids = torch.as_tensor(np.load(m["ids"]))
        positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
        causal = torch.triu(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool), diagonal=1)[None, None]
        with torch.no_grad():
            logits = model(ids, positions, causal)
        if rank == 0:
            np.save(m["out"], logits.double().numpy())
    torch.distributed.destroy_process_group()


def resave(rank: int, model, source: str, root: str) -> None:
    import torch
    from megatron.core import dist_checkpointing

    common = torch.load(os.path.join(source, "common.pt"), map_location="cpu", weights_only=False)
    args = common["args"]
    del args.mindspeed_model_config  # Megatron's args only: the model is read from its own names
    folder = os.path.join(root, f"iter_{common['iteration']:07d}")
    if rank == 0:
        os.makedirs(folder)
    torch.distributed.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict(), "args": args, "iteration": common["iteration"],
                             "checkpoint_version": common["checkpoint_version"]}, folder)
    if rank == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
            fh.write(str(common["iteration"]))


if __name__ == "__main__":
    import torch.multiprocessing as mp

    spec = json.load(open(sys.argv[1]))
    world = spec["tp"] * spec.get("ep", 1)
    if world > 1:
        mp.spawn(run, args=(world, spec), nprocs=world)
    else:
        run(0, 1, spec)
