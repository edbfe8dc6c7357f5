"""``mindspeed convert`` (and tools/convert_ckpt.py): Hugging Face <-> Megatron-core
checkpoints, and Megatron -> Megatron under another layout, with MindSpeed-LLM's flags.

    mindspeed convert --load-model-type hf --save-model-type mg --model-type-hf llama2 \\
        --load-dir llama-hf/ --save-dir llama-mg/ \\
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2
    mindspeed convert --load-model-type mg --save-model-type hf --load-dir llama-mg/ --save-dir llama-hf2/
    mindspeed convert --load-model-type mg --save-model-type mg --load-dir llama-mg/ --save-dir llama-pp4/ \\
        --target-tensor-parallel-size 1 --target-pipeline-parallel-size 4

Framework-free: numpy, compat/hf (safetensors) and compat/mcore (Megatron's layout, read
without torch and without running code from the files). ``--load-model-type mg`` also takes
our own checkpoints (``mindspeed train --save``), LoRA adapters merged into their weights.
A Megatron -> Megatron conversion keeps the source's layout for each target flag not given.
"""

from __future__ import annotations

import dataclasses
import os

from mindspeed_core import features, runtime
from mindspeed_core.compat import hf, mcore, megatron_args
from mindspeed_core.errors import CheckpointError, MindSpeedError
from mindspeed_core.models.state import renumber_layers
from mindspeed_core.parallel import pipeline
from mindspeed_core.training import model_source

# --model-type-hf -> our model family
MODEL_TYPES = hf.MODEL_TYPES
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def parser():
    p = megatron_args.ArgumentParser(prog="mindspeed convert",
                                     description="Hugging Face <-> Megatron-core checkpoints, with re-sharding")
    megatron_args.add_framework_args(p)
    p.add_argument("--load-model-type", choices=("hf", "mg"), required=True)
    p.add_argument("--save-model-type", choices=("hf", "mg"), required=True)
    p.add_argument("--model-type-hf", choices=tuple(MODEL_TYPES), default=None,
                   help="the Hugging Face architecture (checked against config.json; names it for a Megatron "
                        "checkpoint whose args do not)")
    p.add_argument("--load-dir", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--target-tensor-parallel-size", type=megatron_args.POSITIVE_INT, default=None)
    p.add_argument("--target-pipeline-parallel-size", type=megatron_args.POSITIVE_INT, default=None)
    p.add_argument("--target-expert-parallel-size", type=megatron_args.POSITIVE_INT, default=None)
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=megatron_args.POSITIVE_INT, default=None)
    p.add_argument("--num-layer-list", default=None, help="comma-separated layer counts, one per pipeline stage")
    p.add_argument("--noop-layers", default=None,
                   help="comma-separated layer numbers (from 0) of no-op layers to add (hf -> mg)")
    p.add_argument("--hf-cfg-dir", default=None,
                   help="mg -> hf: a Hugging Face folder whose config.json describes this model; its tokenizer and "
                        "generation files are copied along")
    p.add_argument("--expert-tensor-parallel-size", type=megatron_args.POSITIVE_INT, default=None,
                   help="the target's tensor parallelism inside the experts (it must equal the tensor parallelism "
                        "here)")
    p.add_argument("--lora-load", default=None, help="LoRA adapters to merge into the --load-dir weights")
    p.add_argument("--lora-r", type=megatron_args.POSITIVE_INT, default=None)
    p.add_argument("--lora-alpha", type=megatron_args.POSITIVE, default=None)
    p.add_argument("--lora-target-modules", nargs="+", default=None)
    p.add_argument("--save-lora-to-hf", action="store_true", help="write the adapters as a PEFT folder")
    p.add_argument("--moe-grouped-gemm", action="store_true",
                   help="(no effect: a kernel choice of training; the weights are the same)")
    p.add_argument("--params-dtype", choices=tuple(DTYPES), default=None,
                   help="the saved weights' dtype (default: fp32 from Hugging Face, the source's for mg -> mg)")
    return p


def _read_hf(args):
    source = model_source.read(args.load_dir, "--load-dir", ("hf",))
    if args.model_type_hf and MODEL_TYPES[args.model_type_hf] != source.cfg.family:
        raise MindSpeedError(f"--model-type-hf {args.model_type_hf}, but {args.load_dir}/config.json is a "
                             f"{source.cfg.family} model")
    return source


def _read_mg(args):
    """A Megatron checkpoint or one of ours, LoRA adapters merged into their weights."""
    if not os.path.isdir(args.load_dir):
        raise MindSpeedError(f"--load-dir {args.load_dir} does not exist")
    if model_source.kind_of(args.load_dir) not in ("megatron", "ours"):
        raise CheckpointError(f"--load-dir {args.load_dir} holds neither a Megatron checkpoint nor ours "
                              f"({mcore.TRACKER} is missing)")
    source = model_source.read(args.load_dir, "--load-dir", ("megatron", "ours")).merged()
    cfg = source.cfg
    if not source.exact:  # Megatron's args name no architecture
        if args.save_model_type == "hf" and not args.model_type_hf:
            raise MindSpeedError(f"{args.load_dir} does not say which Hugging Face architecture it is: give "
                                 f"--model-type-hf")
        if args.model_type_hf:
            cfg.family = MODEL_TYPES[args.model_type_hf]
    elif args.model_type_hf and cfg.family != MODEL_TYPES[args.model_type_hf]:
        raise MindSpeedError(f"--model-type-hf {args.model_type_hf}, but {args.load_dir} holds a {cfg.family} model")
    return source


def _target_layout(args, cfg, source):
    keep = source or mcore.Layout()
    tp = args.target_tensor_parallel_size or keep.tp
    pp = args.target_pipeline_parallel_size or keep.pp
    ep = args.target_expert_parallel_size or (keep.ep if cfg.moe is not None else 1)
    given = args.target_pipeline_parallel_size is not None
    vpp = args.num_layers_per_virtual_pipeline_stage if args.num_layers_per_virtual_pipeline_stage or given \
        else keep.layers_per_virtual_stage
    layer_list = args.num_layer_list if args.num_layer_list or given or vpp else keep.num_layer_list
    return mcore.Layout(tp=tp, pp=pp, ep=ep, layers_per_virtual_stage=vpp, num_layer_list=layer_list)


def run(args, backend=None) -> int:
    """`mindspeed convert` once its flags are parsed (the framework plays no part)."""
    features.note_used("weight-conversion")
    framework = runtime.resolve(args.ai_framework)
    if args.lora_load or args.lora_r or args.lora_alpha or args.lora_target_modules or args.save_lora_to_hf:
        features.refuse("convert-lora", framework)
    target_tp = args.target_tensor_parallel_size or 1
    if args.expert_tensor_parallel_size not in (None, target_tp):
        features.refuse("expert-tensor-parallel", framework)
    if args.hf_cfg_dir is not None and args.save_model_type != "hf":
        raise MindSpeedError("--hf-cfg-dir describes the Hugging Face folder written by --save-model-type hf")
    if args.load_model_type == "hf" and args.save_model_type == "hf":
        raise MindSpeedError("--load-model-type hf --save-model-type hf converts nothing: one of them is mg")
    if args.save_model_type == "hf":
        for flag in ("target_tensor_parallel_size", "target_pipeline_parallel_size", "target_expert_parallel_size",
                     "num_layers_per_virtual_pipeline_stage", "num_layer_list", "noop_layers", "params_dtype"):
            if getattr(args, flag) is not None:
                raise MindSpeedError(f"--{flag.replace('_', '-')} describes a Megatron checkpoint; a Hugging Face "
                                     f"folder (--save-model-type hf) has no layout or dtype to set")
    if os.path.realpath(args.load_dir) == os.path.realpath(args.save_dir):
        raise MindSpeedError("--save-dir is --load-dir: write the conversion to another folder")
    if os.path.isdir(args.save_dir) and os.listdir(args.save_dir):
        raise MindSpeedError(f"--save-dir {args.save_dir} is not empty: choose a new folder")
    source = _read_hf(args) if args.load_model_type == "hf" else _read_mg(args)
    iteration, cfg, state, dtype = source.iteration, source.cfg, source.state, source.dtype
    if args.noop_layers:
        if args.load_model_type != "hf" or cfg.noop_layers:
            raise MindSpeedError("--noop-layers adds no-op layers to a Hugging Face model's (hf -> mg)")
        cfg, state = _with_noop_layers(cfg, state, pipeline.parse_layer_numbers(args.noop_layers, "--noop-layers"))
    if args.save_model_type == "hf":
        if args.hf_cfg_dir is not None:
            hf.check_same_model(args.hf_cfg_dir, cfg)  # before anything is written
        hf.save_folder(args.save_dir, cfg, state)  # no-op layers dropped, LoRA merged
        if args.hf_cfg_dir is not None:
            hf.copy_companions(args.hf_cfg_dir, args.save_dir)
        print(f"wrote the {cfg.family} model ({cfg.num_parameters():,} parameters) as a Hugging Face folder: "
              f"{args.save_dir}")
        return 0
    layout = _target_layout(args, cfg, source.layout)
    dtype = DTYPES[args.params_dtype] if args.params_dtype else dtype
    folder = mcore.save(args.save_dir, iteration, cfg, state, layout, dtype)
    print(f"wrote {folder}: TP={layout.tp} PP={layout.pp} EP={layout.ep}"
          + (f", {layout.layers_per_virtual_stage} layers per virtual stage" if layout.layers_per_virtual_stage else "")
          + (f", layers per stage {layout.num_layer_list}" if layout.num_layer_list else "")
          + (f", no-op layers {','.join(map(str, cfg.noop_layers))}" if cfg.noop_layers else "") + f", {dtype}")
    return 0


def _with_noop_layers(cfg, state, noop: tuple):
    """A model with no-op layers at ``noop`` (MindSpeed's --noop-layers): the real layers keep
    their order, renumbered around the gaps."""
    total = cfg.num_layers + len(noop)
    if any(not 0 <= i < total for i in noop) or len(set(noop)) != len(noop):
        raise MindSpeedError(f"--noop-layers {','.join(map(str, noop))}: layer numbers must be distinct, within the "
                             f"{total} layers the model then has")
    real = [i for i in range(total) if i not in noop]
    renamed = renumber_layers(state, real.__getitem__)
    moe_layers = None if cfg.moe_layers is None else tuple(real[i] for i in cfg.moe_layers)
    return dataclasses.replace(cfg, num_layers=total, noop_layers=tuple(noop), moe_layers=moe_layers), renamed
