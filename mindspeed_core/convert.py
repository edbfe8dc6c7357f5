"""``mindspeed convert`` (and tools/convert_ckpt.py): Hugging Face <-> Megatron-core
checkpoints, and Megatron -> Megatron under another layout, with MindSpeed-LLM's flags.

    mindspeed convert --load-model-type hf --save-model-type mg --model-type-hf llama2 \\
        --load-dir llama-hf/ --save-dir llama-mg/ \\
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2
    mindspeed convert --load-model-type mg --save-model-type hf --load-dir llama-mg/ --save-dir llama-hf2/
    mindspeed convert --load-model-type mg --save-model-type mg --load-dir llama-mg/ --save-dir llama-pp4/ \\
        --target-tensor-parallel-size 1 --target-pipeline-parallel-size 4
    mindspeed convert --load-model-type mg --save-model-type hf --load-dir llama-mg/ --lora-load lora-run/ \\
        --lora-r 16 --lora-alpha 32 --save-dir llama-hf-merged/
    mindspeed convert --load-model-type mg --save-model-type hf --load-dir lora-run/ --save-lora-to-hf \\
        --lora-r 16 --lora-alpha 32 --save-dir llama-hf/

Framework-free: numpy, compat/hf (safetensors) and compat/mcore (Megatron's layout, read
without torch and without running code from the files). ``--load-model-type mg`` also takes
our own checkpoints (``mindspeed train --save``), LoRA adapters merged into their weights.
A Megatron -> Megatron conversion keeps the source's layout for each target flag not given.

LoRA as MindSpeed-LLM's convert_ckpt_v2.py: ``--lora-load`` merges a LoRA run's adapters (ours,
or a Megatron checkpoint with peft's names, whole or adapters only) into the ``--load-dir``
model; ``--save-lora-to-hf`` writes the ``--load-dir`` run's adapters as a PEFT folder
(compat/peft.py), beside the Hugging Face model that --save-dir may already hold. ``--lora-r``,
``--lora-alpha`` and ``--lora-target-modules`` must agree with what the run recorded, and
supply what it did not.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from mindspeed_core import features, runtime
from mindspeed_core.compat import hf, mcore, megatron_args, peft
from mindspeed_core.errors import CheckpointError, MindSpeedError
from mindspeed_core.models import families
from mindspeed_core.models.config import LORA_TARGETS, LoRAConfig
from mindspeed_core.models.state import (adapter_rank, adapter_target, check_adapters, is_adapter, merge_lora,
                                         moved_under_lora)
from mindspeed_core.parallel import pipeline
from mindspeed_core.training import checkpoint, model_source

# --model-type-hf -> our model family
MODEL_TYPES = families.ALIASES
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# MindSpeed-LLM's --model-type-hf values of families not built here -> the matrix row that says so
NOT_BUILT = {"phi3.5-moe": "family-phimoe", "deepseek4": "family-deepseek-v4"}


def parser():
    p = megatron_args.ArgumentParser(prog="mindspeed convert",
                                     description="Hugging Face <-> Megatron-core checkpoints, with re-sharding")
    megatron_args.add_framework_args(p)
    p.add_argument("--load-model-type", choices=("hf", "mg"), required=True)
    p.add_argument("--save-model-type", choices=("hf", "mg"), required=True)
    p.add_argument("--model-type-hf", choices=(*MODEL_TYPES, *NOT_BUILT), default=None,
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
    p.add_argument("--hf-cfg-dir", "--hf-dir", default=None,
                   help="mg -> hf: a Hugging Face folder whose config.json describes this model; its tokenizer and "
                        "generation files are copied along")
    p.add_argument("--expert-tensor-parallel-size", type=megatron_args.POSITIVE_INT, default=None,
                   help="the target's tensor parallelism inside the experts: 1 writes each file's experts whole "
                        "(megatron-core's ETP 1: the TP and EP ranks in pairs), the target TP size cuts them as the "
                        "dense MLP (the default; a Megatron source's own otherwise)")
    p.add_argument("--lora-load", default=None, help="a LoRA run whose adapters are merged into the --load-dir weights")
    p.add_argument("--lora-r", type=megatron_args.POSITIVE_INT, default=None,
                   help="the adapters' rank (checked against the run's record)")
    p.add_argument("--lora-alpha", type=megatron_args.POSITIVE, default=None,
                   help="the adapters' alpha (scale alpha / r; checked against the run's record)")
    p.add_argument("--lora-target-modules", nargs="+", choices=LORA_TARGETS, default=None,
                   help="the layers that carry adapters (checked against the run's record)")
    p.add_argument("--save-lora-to-hf", action="store_true",
                   help="write the --load-dir LoRA run's adapters as a PEFT folder (adapter_config.json, "
                        "adapter_model.safetensors) into --save-dir")
    p.add_argument("--mtp-num-layers", type=megatron_args.POSITIVE_INT, default=None,
                   help="multi-token prediction modules: read from a Hugging Face folder's layers after the last "
                        "(hf -> mg); a Megatron checkpoint's must be these many")
    p.add_argument("--first-k-dense-replace", type=megatron_args.DENSE_LAYERS, default=None,
                   help="the dense layers before the MoE ones (MindSpeed-LLM's flag): checked against the model's")
    p.add_argument("--moe-grouped-gemm", action="store_true",
                   help="(no effect: a kernel choice of training; the weights are the same)")
    p.add_argument("--moe-tp-extend-ep", action="store_true",
                   help="experts spread whole over TP x EP ranks in the target's files (refused: the "
                        "convert-tp-extend-ep row, planned)")
    p.add_argument("--save-layer-by-layer", action="store_true",
                   help="(no effect: MindSpeed-LLM's converter writes a layer at a time to bound its memory; this one "
                        "holds the whole model and refuses, before reading, one that does not fit)")
    p.add_argument("--mla-mm-split", action="store_true",
                   help="latent attention's projections stored apart (linear_q_down_proj, linear_kv_down_proj, ...): "
                        "the layout written and read here in any case")
    p.add_argument("--params-dtype", choices=tuple(DTYPES), default=None,
                   help="the saved weights' dtype (default: fp32 from Hugging Face, the source's for mg -> mg)")
    return p


def _read_hf(args):
    source = model_source.read(args.load_dir, "--load-dir", ("hf",), mtp_num_layers=args.mtp_num_layers or 0)
    if args.model_type_hf and MODEL_TYPES[args.model_type_hf] != source.cfg.family:
        raise MindSpeedError(f"--model-type-hf {args.model_type_hf}, but {args.load_dir}/config.json is a "
                             f"{source.cfg.family} model")
    return source


def _read_mg(args, adapters: bool = False):
    """A Megatron checkpoint or one of ours, LoRA adapters merged into their weights; with
    ``adapters`` the adapters kept apart (and a save holding them alone welcome)."""
    if not os.path.isdir(args.load_dir):
        raise MindSpeedError(f"--load-dir {args.load_dir} does not exist")
    if model_source.kind_of(args.load_dir) not in ("megatron", "ours"):
        raise CheckpointError(f"--load-dir {args.load_dir} holds neither a Megatron checkpoint nor ours "
                              f"({mcore.TRACKER} is missing)")
    source = model_source.read(args.load_dir, "--load-dir", ("megatron", "ours"), adapters=adapters)
    source = source if adapters else source.merged()
    cfg = source.cfg
    if not source.exact:  # Megatron's args name no architecture
        if args.save_model_type == "hf" and not args.model_type_hf:
            raise MindSpeedError(f"{args.load_dir} does not say which Hugging Face architecture it is: give "
                                 f"--model-type-hf")
        if args.model_type_hf:
            source.cfg = cfg = dataclasses.replace(cfg, family=MODEL_TYPES[args.model_type_hf])
    elif args.model_type_hf and cfg.family != MODEL_TYPES[args.model_type_hf]:
        want, why = MODEL_TYPES[args.model_type_hf], ""
        if want in ("deepseek_v2", "deepseek_v3") and cfg.mla is None:  # tiny-deepseek-v3's routing on GQA, say
            why = (f" (Hugging Face's {want} is multi-latent attention, which this model has not: a DeepSeek run "
                   f"to export trains with --multi-latent-attention and --spec mindspeed_llm.tasks.models.spec."
                   f"deepseek_spec layer_spec, or from a {want} folder with --load-hf)")
        raise MindSpeedError(f"--model-type-hf {args.model_type_hf}, but {args.load_dir} holds a {cfg.family} "
                             f"model{why}")
    return source


def _lora_of(args, source, flag: str) -> LoRAConfig:
    """The adapters' configuration: what the run recorded, which the --lora-* flags must
    match, or (a Megatron checkpoint that does not say) the flags, the rank read off the
    factors and the targets off their names."""
    saved, held = source.cfg.lora, [k for k in source.state if is_adapter(k)]
    if not held:
        raise MindSpeedError(f"{flag} {source.path} holds no LoRA adapters")
    if saved is not None:
        for name, given, recorded in (("--lora-r", args.lora_r, saved.r), ("--lora-alpha", args.lora_alpha, saved.alpha),
                                      ("--lora-target-modules", args.lora_target_modules and
                                       sorted(args.lora_target_modules), sorted(saved.targets))):
            if given is not None and given != recorded:
                shown = " ".join(recorded) if isinstance(recorded, list) else recorded
                raise MindSpeedError(f"{name} {' '.join(given) if isinstance(given, list) else given}, but the LoRA "
                                     f"run in {source.path} was trained with {name} {shown}")
        return saved
    if args.lora_alpha is None:
        raise MindSpeedError(f"{source.path} does not record the adapters' alpha: give --lora-alpha (and --lora-r) as "
                             "the run had them")
    targets = args.lora_target_modules or sorted({adapter_target(k) for k in held})
    first = next(k for k in held if ".lora_A." in k)
    rank = adapter_rank(first, source.state[first].shape)
    return LoRAConfig(r=args.lora_r or rank, alpha=float(args.lora_alpha), targets=tuple(targets))


def _adapters(args, source, flag: str) -> tuple:
    """(LoRA config, adapters) of a LoRA run, checked against the model they adapt."""
    lora = _lora_of(args, source, flag)
    cfg = dataclasses.replace(source.cfg, lora=lora)
    adapters = {k: v for k, v in source.state.items() if is_adapter(k)}
    try:
        check_adapters(cfg, adapters, f"{flag} {source.path}")
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    return cfg, adapters


def _with_adapters(args, base):
    """The --load-dir model with the --lora-load run's adapters folded in."""
    run = model_source.read(args.lora_load, "--lora-load", ("megatron", "ours"), adapters=True)
    cfg, adapters = _adapters(args, dataclasses.replace(run, cfg=dataclasses.replace(
        base.cfg, lora=run.cfg.lora)), "--lora-load")
    for name, value in run.state.items():  # a whole LoRA checkpoint: trained on these base weights?
        if moved_under_lora(name):  # the adapters, and the expert biases the run moved (taken below)
            continue
        mine = base.state.get(name)
        if mine is None or mine.shape != value.shape:
            raise CheckpointError(f"--lora-load {args.lora_load} is a LoRA run of another model than --load-dir "
                                  f"{args.load_dir} ({name})")
        # the same weights, up to the rounding of one of them to 16 bits
        if np.abs(mine - value).max() > 2.0 ** -7 * max(float(np.abs(mine).max()), 1e-30):
            raise CheckpointError(f"--lora-load {args.lora_load} was trained on other weights than --load-dir "
                                  f"{args.load_dir}'s ({name} differs)")
    moved = {k: v for k, v in run.state.items() if moved_under_lora(k) and not is_adapter(k)}
    merged_cfg, state = merge_lora(cfg, {**base.state, **moved, **adapters})
    print(f"merged the LoRA adapters of {args.lora_load} (rank {cfg.lora.r}, alpha {cfg.lora.alpha:g}, "
          f"{' '.join(cfg.lora.targets)}) into the weights of {args.load_dir}")
    return dataclasses.replace(base, cfg=merged_cfg, state=state)


def _export_adapters(args) -> int:
    """--save-lora-to-hf: the --load-dir run's adapters as a PEFT folder."""
    if args.load_model_type != "mg" or args.save_model_type != "hf":
        raise MindSpeedError("--save-lora-to-hf exports a LoRA run's adapters: --load-model-type mg "
                             "--save-model-type hf")
    if args.lora_load:
        raise MindSpeedError("--save-lora-to-hf exports the adapters of --load-dir; --lora-load merges adapters into "
                             "a model: give one of them")
    for name in (peft.CONFIG, peft.WEIGHTS):
        if os.path.exists(os.path.join(args.save_dir, name)):
            raise MindSpeedError(f"--save-dir {args.save_dir} already holds {name}: choose another folder")
    cfg, adapters = _adapters(args, _read_mg(args, adapters=True), "--load-dir")
    if args.hf_cfg_dir is not None:  # the model the adapters go with
        hf.check_same_model(args.hf_cfg_dir, dataclasses.replace(cfg, lora=None))
    peft.check_exportable(cfg)
    peft.save_adapter(args.save_dir, cfg, adapters)
    print(f"wrote the LoRA adapters of {args.load_dir} (rank {cfg.lora.r}, alpha {cfg.lora.alpha:g}, "
          f"{len(adapters) // 2} linear layers) as a PEFT folder: {args.save_dir}")
    return 0


def _target_layout(args, cfg, source):
    keep = source or mcore.Layout()
    tp = args.target_tensor_parallel_size or keep.tp
    pp = args.target_pipeline_parallel_size or keep.pp
    ep = args.target_expert_parallel_size or (keep.ep if cfg.moe is not None else 1)
    given = args.target_pipeline_parallel_size is not None
    vpp = args.num_layers_per_virtual_pipeline_stage if args.num_layers_per_virtual_pipeline_stage or given \
        else keep.layers_per_virtual_stage
    layer_list = args.num_layer_list if args.num_layer_list or given or vpp else keep.num_layer_list
    # the experts' TP: the flag's (1 or the model's TP), else the source's (whole experts stay whole)
    etp = args.expert_tensor_parallel_size if args.expert_tensor_parallel_size is not None else keep.etp
    if etp not in (None, 1, tp):
        features.refuse("expert-tensor-parallel-other", runtime.resolve(args.ai_framework))
    return mcore.Layout(tp=tp, pp=pp, ep=ep, layers_per_virtual_stage=vpp, num_layer_list=layer_list, etp=etp)


def run(args, backend=None) -> int:
    """`mindspeed convert` once its flags are parsed (the framework plays no part)."""
    features.note_used("weight-conversion")
    framework = runtime.resolve(args.ai_framework)
    if args.model_type_hf in NOT_BUILT:
        features.refuse(NOT_BUILT[args.model_type_hf], framework)
    if args.moe_tp_extend_ep:
        features.refuse("convert-tp-extend-ep", framework)
    if args.lora_load or args.save_lora_to_hf:
        features.note_used("convert-lora")
    if args.hf_cfg_dir is not None and args.save_model_type != "hf":
        raise MindSpeedError("--hf-cfg-dir describes the Hugging Face folder written by --save-model-type hf")
    if args.load_model_type == "hf" and args.save_model_type == "hf":
        raise MindSpeedError("--load-model-type hf --save-model-type hf converts nothing: one of them is mg")
    if args.save_model_type == "hf":
        if args.params_dtype is not None:
            raise MindSpeedError("--params-dtype sets a Megatron checkpoint's dtype; a Hugging Face folder "
                                 "(--save-model-type hf) is written in the dtype it was trained in")
        # MindSpeed-LLM's scripts pass their layout to the export too, and its converter ignores it
        layout = [f for f in ("target_tensor_parallel_size", "target_pipeline_parallel_size",
                              "target_expert_parallel_size", "expert_tensor_parallel_size",
                              "num_layers_per_virtual_pipeline_stage", "num_layer_list")
                  if getattr(args, f) is not None]
        if layout:
            print(f"note: {', '.join('--' + f.replace('_', '-') for f in layout)} describe a Megatron layout; a "
                  f"Hugging Face folder has none, so they are ignored")
            for f in layout:
                setattr(args, f, None)
    if os.path.realpath(args.load_dir) == os.path.realpath(args.save_dir):
        raise MindSpeedError("--save-dir is --load-dir: write the conversion to another folder")
    if args.save_lora_to_hf:
        return _export_adapters(args)
    if (args.lora_r or args.lora_alpha or args.lora_target_modules) and not args.lora_load:
        raise MindSpeedError("--lora-r, --lora-alpha and --lora-target-modules describe the adapters of --lora-load "
                             "(merge) or of --save-lora-to-hf (export): give one of those")
    if os.path.isdir(args.save_dir) and os.listdir(args.save_dir):
        raise MindSpeedError(f"--save-dir {args.save_dir} is not empty: choose a new folder")
    source = _read_hf(args) if args.load_model_type == "hf" else _read_mg(args)
    _check_model_flags(args, source.cfg)
    if args.lora_load:
        source = _with_adapters(args, source)
    iteration, cfg, state, dtype = source.iteration, source.cfg, source.state, source.dtype
    _say_weights_only(args, source)
    if args.noop_layers:
        noop = pipeline.parse_layer_numbers(args.noop_layers, "--noop-layers")
        if args.save_model_type == "hf" and args.load_model_type == "mg":  # MindSpeed-LLM's export names them again
            if tuple(noop) != tuple(cfg.noop_layers):
                raise MindSpeedError(f"--noop-layers {args.noop_layers}, but {args.load_dir} holds no-op layers "
                                     f"{','.join(map(str, cfg.noop_layers)) or 'none'}")
        elif args.load_model_type != "hf" or cfg.noop_layers:
            raise MindSpeedError("--noop-layers adds no-op layers to a Hugging Face model's (hf -> mg)")
        else:
            cfg, state = hf.with_noop_layers(cfg, state, noop)
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
    if layout.experts_whole:
        features.note_used("convert-expert-tensor-parallel")
    dtype = DTYPES[args.params_dtype] if args.params_dtype else dtype
    folder = mcore.save(args.save_dir, iteration, cfg, state, layout, dtype)
    print(f"wrote {folder}: TP={layout.tp} PP={layout.pp} EP={layout.ep}" + (" (experts whole: ETP=1)" if layout.experts_whole else "")
          + (f", {layout.layers_per_virtual_stage} layers per virtual stage" if layout.layers_per_virtual_stage else "")
          + (f", layers per stage {layout.num_layer_list}" if layout.num_layer_list else "")
          + (f", no-op layers {','.join(map(str, cfg.noop_layers))}" if cfg.noop_layers else "") + f", {dtype}")
    return 0


def _say_weights_only(args, source) -> None:
    """A conversion writes weights: say so where the source holds an optimizer state too (ours:
    Adam's moments, Muon's momentum, fp32 masters), and how to carry it to another layout."""
    held = _optimizer_state_names(source) if source.kind == "ours" else []
    if held:
        kinds = sorted({name.split(".", 1)[0] for name in held})
        print(f"note: a conversion writes the weights only: the optimizer state {args.load_dir} holds ({len(held)} "
              f"tensors: {', '.join(kinds)}) is not converted, as MindSpeed-LLM's converter; a training run resumes "
              f"with it at any layout from {args.load_dir} itself (mindspeed train --load)")


def _optimizer_state_names(source) -> list[str]:
    """The optimizer tensors one of our checkpoints holds: a sharded save's index names them, a
    --save-whole save's optimizer.safetensors header does (its tensors are not read)."""
    index = (source.meta or {}).get("index")
    if index is not None:
        return list(index.get("optimizer") or {})
    path = os.path.join(checkpoint.iteration_dir(source.path, source.iteration), "optimizer.safetensors")
    if not os.path.exists(path):
        return []
    with open(path, "rb") as fh:  # safetensors: an 8-byte little-endian length, then the JSON header
        header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
    return [name for name in header if name != "__metadata__"]


def _check_model_flags(args, cfg) -> None:
    """MindSpeed-LLM's model flags of a conversion describe the model read: they must agree."""
    if args.mtp_num_layers is not None and args.mtp_num_layers != cfg.mtp_num_layers:
        raise MindSpeedError(f"--mtp-num-layers {args.mtp_num_layers}, but {args.load_dir} holds "
                             f"{cfg.mtp_num_layers} multi-token prediction modules")
    if args.first_k_dense_replace is not None:  # -1: none (MindSpeed-LLM)
        dense = 0 if cfg.moe is None else min(cfg.moe_layer_numbers(), default=cfg.num_layers)
        after = [i for i in range(dense, cfg.num_layers + cfg.mtp_num_layers) if i not in cfg.noop_layers]
        if cfg.moe is None or dense != max(args.first_k_dense_replace, 0) or cfg.moe_layer_numbers() != after:
            raise MindSpeedError(f"--first-k-dense-replace {args.first_k_dense_replace}, but {args.load_dir} holds "
                                 + (f"a model with {dense} dense layers before its MoE layers" if cfg.moe is not None
                                    else "a model without MoE layers"))

