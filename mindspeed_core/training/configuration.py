"""The run's configuration, made once from the Megatron / MindSpeed-LLM flags: :func:`configure`
fills the defaults, derives the model configuration, runs every check that needs no process
group, no data and no weights, and returns a frozen :class:`RunConfig`: the flags as resolved
(read-only :class:`Flags`) and their typed sections (model, parallel layout, optimization,
data, stage, operations). Nothing assigns into the parsed flags afterwards.

`mindspeed train` (each rank), `mindspeed check-args`, `mindspeed launch` (once, before any
rank starts) and `mindspeed plan` (for each candidate layout) call the same :func:`configure`;
none of them builds a model here. So a refusal that needs only the flags belongs here, not where
the data or the model are built: there, check-args would pass what train refuses.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

from mindspeed_core import device, features, files, ops, runtime
from mindspeed_core.compat import hf
from mindspeed_core.data import gpt_dataset
from mindspeed_core.data.tokenizer import build_tokenizer, check_fits, padded_vocab_size, tokenizer_args
from mindspeed_core.errors import CheckpointError, MindSpeedError
from mindspeed_core.memory import recompute
from mindspeed_core.models import rope
from mindspeed_core.models import families
from mindspeed_core.models.config import (LORA_TARGETS, DSAConfig, LinearAttentionConfig, LoRAConfig, MLAConfig,
                                          ModelConfig, MoEConfig, indexer_layer_types, interleaved_window_layers)
from mindspeed_core.models.families import PRESETS
from mindspeed_core.parallel import context, experts, pipeline
from mindspeed_core.parallel import layers as parallel_layers
from mindspeed_core.training import alignment, boards, checkpoint, grpo, profiling
from mindspeed_core.training.distributed import BUCKET_ELEMENTS

# What `mindspeed train` does with no data flags: a small LLaMA on the standard library's
# source, byte-level tokens, sized to about three minutes on two CPU cores: 1500 steps under
# PyTorch (measured 2 min 35 s, loss 5.6 -> 1.5); MindSpore's CPU step is about six times
# slower, so it takes 300 (loss 5.6 -> about 2.4).
EMBEDDED_ITERS = {"pytorch": 1500, "mindspore": 300}
EMBEDDED_DEFAULTS = dict(model_name="tiny-llama", seq_length=128, micro_batch_size=8, global_batch_size=16,
                         train_iters=None, lr=3e-3, min_lr=3e-4, lr_warmup_iters=20, eval_interval=100, eval_iters=4,
                         log_interval=25, sample_tokens=200, make_vocab_size_divisible_by=8)
# the fine-tuning twin (--stage sft without data): a few epochs of stdlib_instructions
EMBEDDED_SFT_ITERS = {"pytorch": 300, "mindspore": 60}
EMBEDDED_SFT_DEFAULTS = dict(seq_length=256, lr=1e-3, min_lr=1e-4, lr_warmup_iters=10, eval_interval=50)
TRAINING_DEFAULTS = dict(seq_length=256, micro_batch_size=4, global_batch_size=None, train_iters=100, lr=1e-3,
                         eval_interval=1000, eval_iters=100, log_interval=100)

SWAP_OPTIMIZER_TIMES = 16  # MindSpeed's default number of pieces a swapped update moves
LOSS_CHUNK = 1024  # --loss-compute-mode chunk's positions a chunk without --loss-chunk-size

# flag -> the fused kernel it switches on (ModelConfig.fused); Megatron's defaults: all off
FUSED_FLAGS = {"use_flash_attn": "attention", "use_fused_rmsnorm": "rms_norm", "use_fused_swiglu": "swiglu",
               "use_fused_rotary_pos_emb": "rope", "moe_grouped_gemm": "grouped_matmul"}
# flags that name a fused path the embedded run does not turn on by itself (a gradient path, a
# kernel that is not bound): ModelConfig.fused too
FUSED_PATH_FLAGS = {"gemm_gradient_accumulation_fusion": "matmul_add", "use_triton_gdn": "gated_delta_rule",
                    "enable_mla_absorb": "mla_absorb", "use_sparse_flash_attn": "sparse_attention",
                    "use_fused_lightning_indexer": "lightning_indexer",
                    "use_fused_lightning_indexer_loss": "lightning_indexer"}

_MODEL_FLAGS = {  # flag -> ModelConfig field
    "num_layers": "num_layers", "hidden_size": "hidden_size", "ffn_hidden_size": "ffn_hidden_size",
    "num_attention_heads": "num_attention_heads", "num_query_groups": "num_query_groups",
    "kv_channels": "kv_channels", "norm_epsilon": "norm_epsilon", "rotary_base": "rotary_base",
    "rotary_percent": "rotary_percent",
    "init_method_std": "init_method_std", "attention_dropout": "attention_dropout", "hidden_dropout": "hidden_dropout",
}


class Flags:
    """Every flag of a run after its defaults, read-only (attribute access as on argparse's
    namespace; setting one is an error: derive a new value in :func:`configure` instead)."""

    __slots__ = ("_values",)

    def __init__(self, values: dict):
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name):
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"no flag {name!r}") from None

    def __setattr__(self, name, value):
        raise dataclasses.FrozenInstanceError(f"the run's flags are fixed once configured (--{name.replace('_', '-')})")

    def __repr__(self):
        return f"Flags({self._values!r})"

    def as_dict(self) -> dict:
        return dict(self._values)


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    world: int
    tp: int
    pp: int
    cp: int
    ep: int
    dp: int
    sequence_parallel: bool
    layers_per_virtual_stage: int | None
    num_layer_list: str | None  # --num-layer-list: the layers of each pipeline stage, "a,b,..."
    context_parallel_algo: str
    ulysses_degree_in_cp: int | None  # hybrid CP: --ulysses-degree-in-cp (None: the algorithm's own)
    moe_dispatcher: str
    distributed_optimizer: bool
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    # --expert-tensor-parallel-size 1 under TP: every TP rank holds its experts whole (megatron-core's
    # ETP 1); False: the experts are cut over TP as the dense MLP is (ETP = TP, the default)
    experts_whole: bool = False
    # --use-cp-send-recv-overlap: the ring's exchanges travel while its blocks compute (outside a
    # compiled step, whose graph orders its own communication)
    cp_overlap: bool = False
    dualpipev: bool = False  # --schedules-method dualpipev: two chunks a rank in a V (parallel/pipeline.py)
    # --moe-alltoall-overlap-comm: the alltoall dispatch in chunks that travel while experts compute
    moe_overlap: bool = False
    # --moe-fb-overlap: a pipeline's paired forward and backward interleaved (training/fb_overlap.py)
    fb_overlap: bool = False

    @property
    def ep_over_tp(self) -> bool:
        """The EP groups reach across the TP ranks (megatron-core's layout with ETP 1: ep_over_tp)."""
        return self.experts_whole and self.ep > 1

    def stages(self, cfg: ModelConfig) -> pipeline.PipelineLayout:
        """Which of ``cfg``'s layers each pipeline stage holds (parallel/pipeline.py)."""
        return pipeline.model_layout(cfg, self.pp, self.layers_per_virtual_stage, self.num_layer_list, self.dualpipev)


@dataclasses.dataclass(frozen=True)
class Optimization:
    train_iters: int
    micro_batch_size: int
    global_batch_size: int
    lr: float
    min_lr: float
    lr_warmup_iters: int
    lr_decay_iters: int
    lr_decay_style: str
    weight_decay: float
    clip_grad: float
    betas: tuple
    eps: float
    precision: str  # float32, bfloat16 or float16 (dynamic loss scaling)
    initial_loss_scale: float | None
    o2_optimizer: bool
    o2_gradient: bool  # MindSpeed's O2: gradients accumulated, reduced and clipped in bf16
    reuse_fp32_param: bool
    bucket_elements: int | None  # --ddp-bucket-size (None: the default's)
    # --swap-optimizer: the distributed optimizer's state in host memory, updated in this many
    # pieces (--swap-optimizer-times, MindSpeed's default 16); None: on the device
    swap_pieces: int | None = None
    # --calculate-per-token-loss: a step's loss is its global batch's mean over every loss token
    per_token_loss: bool = False
    # --loss-compute-mode chunk: the output layer and the loss this many positions at a time
    loss_chunk: int | None = None
    # --init-norm-weight-in-fp32: under --bf16 / --fp16 the norms' weights and biases stay float32
    norms_float32: bool = False
    muon: MuonOptions | None = None  # --optimizer muon (training/muon.py); None: AdamW
    # --qk-clip's (threshold, alpha), or with --log-max-attention-logit alone (None, None); None: neither
    qk_clip: tuple | None = None
    # the stored dtypes of (exp_avg, exp_avg_sq): bfloat16 both under --o2-optimizer, or as
    # --exp-avg-dtype / --exp-avg-sq-dtype say with --use-precision-aware-optimizer
    moment_dtypes: tuple = ("float32", "float32")


@dataclasses.dataclass(frozen=True)
class MuonOptions:
    """--optimizer muon's settings (the --muon-* flags)."""
    momentum: float
    nesterov: bool
    ns_steps: int
    coefficients: tuple
    scale_mode: str
    extra_scale: float
    split_qkv: bool
    tp_mode: str  # --muon-tp-mode
    layerwise: bool  # dist_muon, or muon with --use-distributed-optimizer: the layer-wise distributed optimizer


@dataclasses.dataclass(frozen=True)
class Data:
    embedded: bool  # no --data-path: the standard library's source (or its instructions), built at run time
    paths: tuple | None
    split: str
    seq_length: int
    seed: int
    tokenizer: str
    shuffle: bool  # samples in a seeded order each epoch (--no-shuffle: in file order)
    # fine-tuning with --no-pad-to-seq-lengths: a micro-batch is as wide as its longest sample,
    # rounded up to this (--pad-to-multiple-of, and what CP and SP cut the sequence by); None:
    # every micro-batch is --seq-length wide
    pad_multiple: int | None
    reset_position_ids: bool  # packed pretraining documents: positions restart at each document
    reset_attention_mask: bool  # ... and attention stays inside it
    dataloader_type: str  # single (in order) or cyclic (Megatron's reshuffled buckets): data/sampler.py


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str  # pretrain, sft, dpo, simpo, orm or prm
    instruction: bool  # the loss counts the assistant's tokens only
    pairwise: bool  # the data are preference pairs
    reward_tokens: tuple | None  # PRM: the step labels' tokens
    settings: alignment.Settings | grpo.Settings | None  # DPO's or SimPO's loss, or GRPO's


@dataclasses.dataclass(frozen=True)
class Memory:
    recompute: recompute.Recompute
    swap_attention: bool


@dataclasses.dataclass(frozen=True)
class Checkpointing:
    """What is saved and loaded, and when."""
    save: str | None
    save_interval: int | None
    whole: bool  # --save-whole: gathered to rank 0, which writes it (else each rank its pieces)
    torch_dist: bool  # --ckpt-format torch_dist: megatron-core's files of the model too
    asynchronous: bool  # --async-save
    save_optimizer: bool
    save_rng: bool
    load: str | None
    load_hf: str | None
    lora_load: str | None
    finetune: bool  # --finetune: the weights only, from iteration 0
    load_optimizer: bool
    load_rng: bool
    exit_on_missing: bool  # --exit-on-missing-checkpoint
    exit_on_signal: bool  # --exit-signal-handler: a SIGTERM or SIGINT saves and stops the run
    # --enable-mg2hf-convert: where each save's Hugging Face folder goes (None: none written), whether
    # only the last iteration's, and the folder whose tokenizer files go with them
    hf_folders: str | None = None
    hf_last_only: bool = False
    hf_companions: str | None = None
    adapters_only: bool = False  # --lora-ckpt-filter: a LoRA run's checkpoints hold its adapters only


@dataclasses.dataclass(frozen=True)
class Loop:
    """What the loop does around the steps."""
    log_interval: int
    eval_interval: int | None
    eval_iters: int
    exit_interval: int | None
    gc_interval: int | None  # --manual-gc: the collector runs every this many steps only (None: Python's own)
    progress: bool
    sample_tokens: int
    metrics_file: str | None  # --metrics-file, or <save>/metrics.jsonl
    compile: bool
    dry_run: bool


@dataclasses.dataclass(frozen=True)
class Operations:
    """What a run does besides training: determinism, the boards, the profiled window."""
    deterministic: bool
    boards: boards.Settings
    profile: profiling.Settings

    def as_dict(self) -> dict:
        """As --dry-run prints them."""
        b, p = self.boards, self.profile
        return {
            "deterministic": self.deterministic,
            "tensorboard": {"dir": b.tensorboard_dir, "log_interval": b.interval, "queue_size": b.queue_size,
                            "timers": b.timers, "memory": b.memory, "validation_ppl": b.validation_ppl},
            "wandb": {"project": b.wandb_project, "name": b.wandb_name, "save_dir": b.wandb_dir},
            "profile": {"on": p.on, "steps": [p.step_start, p.step_end], "ranks": list(p.ranks), "level": p.level,
                        "with_cpu": p.with_cpu, "with_stack": p.with_stack, "with_memory": p.with_memory,
                        "record_shapes": p.record_shapes, "save_path": p.save_path},
        }


@dataclasses.dataclass(frozen=True)
class RunConfig:
    flags: Flags
    model: ModelConfig
    tokenizer: object  # the built tokenizer (data/tokenizer.py)
    layout: ParallelLayout
    optimization: Optimization
    data: Data
    stage: Stage
    memory: Memory
    checkpointing: Checkpointing
    loop: Loop
    operations: Operations


def ep_over_tp(args) -> bool:
    """Whether the EP groups reach across the TP ranks (megatron-core's layout with the experts
    whole on each TP rank: --expert-tensor-parallel-size 1, or MindSpeed's --moe-tp-extend-ep)."""
    return (args.expert_model_parallel_size > 1 and args.expert_tensor_parallel_size == 1
            and args.tensor_model_parallel_size > 1)


def _extend_ep_over_tp(work) -> None:
    """MindSpeed's --moe-tp-extend-ep: the experts over EP x TP ranks, whole on each (its EP
    group is the TP ranks of EP data-parallel ranks): megatron-core's ETP 1 layout at EP x TP."""
    if getattr(work, "moe_tp_extend_ep", False) and work.tensor_model_parallel_size > 1:
        if work.expert_tensor_parallel_size not in (None, 1):
            raise MindSpeedError(f"--moe-tp-extend-ep keeps each expert whole on one rank: drop "
                                 f"--expert-tensor-parallel-size {work.expert_tensor_parallel_size}")
        features.note_used("moe-tp-extend-ep")
        work.expert_model_parallel_size *= work.tensor_model_parallel_size
        work.expert_tensor_parallel_size = 1
        work.moe_tp_extend_ep = False


def configure(args, world: int, framework: str | None = None) -> RunConfig:
    """The run's configuration from parsed flags (``args`` is left as it was) for ``world``
    ranks on ``framework`` (default: the bound one)."""
    work = argparse.Namespace(**(args.as_dict() if isinstance(args, Flags) else vars(args)))
    _extend_ep_over_tp(work)
    embedded = _apply_defaults(work, framework or runtime.bound().NAME)
    tokenizer, model = check_configuration(work, world, default_save=bool(work.save) and not args.save)
    tp, pp, cp = work.tensor_model_parallel_size, work.pipeline_model_parallel_size, work.context_parallel_size
    dp = world // (tp * pp * cp)
    if work.global_batch_size is None:  # one micro-batch per data-parallel rank
        work.global_batch_size = work.micro_batch_size * dp
    flags = Flags(vars(work))
    stage = stage_of(flags)
    return RunConfig(
        flags=flags, model=model, tokenizer=tokenizer,
        layout=ParallelLayout(world, tp, pp, cp, work.expert_model_parallel_size, dp, bool(work.sequence_parallel),
                              work.num_layers_per_virtual_pipeline_stage, work.num_layer_list,
                              work.context_parallel_algo,
                              work.ulysses_degree_in_cp, work.moe_token_dispatcher_type,
                              # (Muon's is its own: layer-wise, training/muon.py)
                              bool(work.use_distributed_optimizer) and work.optimizer == "adam",
                              bool(work.overlap_grad_reduce),
                              bool(work.overlap_param_gather),
                              work.expert_tensor_parallel_size == 1 and tp > 1,
                              bool(work.use_cp_send_recv_overlap) and not work.compile,
                              work.schedules_method == "dualpipev", bool(work.moe_alltoall_overlap_comm),
                              bool(work.moe_fb_overlap)),
        optimization=Optimization(
            work.train_iters, work.micro_batch_size, work.global_batch_size, work.lr, work.min_lr,
            work.lr_warmup_iters, work.lr_decay_iters, work.lr_decay_style, work.weight_decay, work.clip_grad,
            (work.adam_beta1, work.adam_beta2), work.adam_eps, precision(flags), work.initial_loss_scale,
            bool(work.o2_optimizer), bool(work.o2_gradient), bool(work.reuse_fp32_param), work.ddp_bucket_size,
            (work.swap_optimizer_times or SWAP_OPTIMIZER_TIMES) if work.swap_optimizer else None,
            bool(work.calculate_per_token_loss),
            (work.loss_chunk_size or LOSS_CHUNK) if work.loss_compute_mode == "chunk" else None,
            bool(work.init_norm_weight_in_fp32), muon_options(work), qk_clip_options(work), moment_dtypes(work)),
        data=Data(embedded, tuple(work.data_path) if work.data_path else None, work.split, work.seq_length, work.seed,
                  tokenizer.name, not work.no_shuffle,
                  pad_multiple(work.pad_to_multiple_of, tp, cp, work.sequence_parallel)
                  if work.no_pad_to_seq_lengths and stage != "pretrain" else None,
                  bool(work.reset_position_ids), bool(work.reset_attention_mask), work.dataloader_type or "single"),
        stage=Stage(stage, stage != "pretrain", stage in alignment.PAIRWISE,
                    tuple(work.reward_tokens) if work.reward_tokens else None, stage_settings(flags, stage)),
        memory=Memory(recompute.from_args(flags), bool(work.swap_attention)),
        checkpointing=Checkpointing(
            work.save, work.save_interval, bool(work.save_whole), work.ckpt_format == "torch_dist",
            bool(work.async_save), not work.no_save_optim, not work.no_save_rng, work.load, work.load_hf,
            work.lora_load, bool(work.finetune), not work.no_load_optim, not work.no_load_rng,
            bool(work.exit_on_missing_checkpoint), bool(work.exit_signal_handler),
            (work.hf_save_dir or work.save) if work.enable_mg2hf_convert else None,
            bool(work.only_convert_last_checkpoint), work.hf_cfg_dir, bool(work.lora_ckpt_filter)),
        loop=Loop(work.log_interval, work.eval_interval, work.eval_iters, work.exit_interval,
                  work.manual_gc_interval if work.manual_gc else None, not work.no_progress, work.sample_tokens,
                  work.metrics_file or (os.path.join(work.save, "metrics.jsonl") if work.save else None),
                  bool(work.compile), bool(work.dry_run)),
        operations=operations(flags))


def stage_settings(a, stage: str):
    """The preference stage's loss settings (training/alignment.py) or GRPO's (training/grpo.py)."""
    if stage in ("dpo", "simpo"):
        simpo = stage == "simpo"
        return alignment.Settings(a.dpo_loss_type, a.simpo_beta if simpo else a.dpo_beta,
                                  a.simpo_label_smoothing if simpo else a.dpo_label_smoothing, a.simpo_gamma)
    if stage == "grpo":
        return grpo.Settings(
            a.num_generations, a.max_completion_length, a.temperature, a.top_k, a.top_p, a.clip_ratio,
            a.clip_ratio if a.clip_ratio_high is None else a.clip_ratio_high, a.kl_coef, a.grpo_loss_type,
            bool(a.use_bias_correction_kl), a.scale_rewards, a.ppo_epochs, tuple(a.reward_funcs), a.reward_model,
            tuple(a.reward_weights or [1.0] * (len(a.reward_funcs) + bool(a.reward_model))))
    return None


def model_only(args, framework: str | None = None) -> ModelConfig:
    """The model the flags describe, as :func:`configure` makes it, without its checks (some go
    through every layer): for a caller that bounds its work by the model's size first (plan)."""
    work = argparse.Namespace(**(args.as_dict() if isinstance(args, Flags) else vars(args)))
    _apply_defaults(work, framework or runtime.bound().NAME)
    return model_config(work, build_tokenizer(*tokenizer_args(work)).vocab_size)


def pad_multiple(wanted: int, tp: int, cp: int, sequence_parallel: bool) -> int:
    """The multiple a dynamically padded micro-batch's length is rounded up to: --pad-to-multiple-of,
    and what context parallelism (2 x CP chunks) and sequence parallelism (TP slices) cut it by."""
    return math.lcm(wanted, 2 * cp if cp > 1 else 1, tp if sequence_parallel else 1)


def precision(flags) -> str:
    return "bfloat16" if flags.bf16 else "float16" if flags.fp16 else "float32"


def _apply_defaults(args, framework: str) -> bool:
    """Fill unset flags of ``args`` (a copy of the parsed ones); returns True when the embedded
    default corpus is used (for --stage sft the fine-tuning twin: it starts from the default
    run's model when that is saved)."""
    embedded = not args.data_path
    if embedded and args.stage not in (None, "sft"):
        kind, handler = {"prm": ("step-labelled", "AlpacaStyleProcessRewardHandler"),
                         "grpo": ("instruction (prompts with reference answers)", "AlpacaStyleInstructionHandler")
                         }.get(args.stage, ("preference", "AlpacaStylePairwiseHandler"))
        raise MindSpeedError(f"--stage {args.stage} trains on preprocessed {kind} data: give --data-path (the "
                             f"--output-prefix of mindspeed preprocess --handler-name {handler})")
    sft = args.stage == "sft" or args.is_instruction_dataset
    if embedded and args.train_iters is None:
        args.train_iters = (EMBEDDED_SFT_ITERS if sft else EMBEDDED_ITERS)[framework]
    if embedded and sft:
        for key, value in EMBEDDED_SFT_DEFAULTS.items():
            if getattr(args, key, None) is None:
                setattr(args, key, value)
        pretrained = default_save_folder(args.model_name or EMBEDDED_DEFAULTS["model_name"])
        if not (args.load or args.load_hf) and os.path.isdir(pretrained) and \
                checkpoint.latest_iteration(pretrained) is not None:
            args.load, args.finetune = pretrained, True
    for key, value in (EMBEDDED_DEFAULTS if embedded else TRAINING_DEFAULTS).items():
        if key == "make_vocab_size_divisible_by":
            if embedded and args.make_vocab_size_divisible_by == 128:
                args.make_vocab_size_divisible_by = value
        elif getattr(args, key, None) is None and value is not None:
            setattr(args, key, value)
    if embedded:
        args.tokenizer_type, args.tokenizer_name_or_path = "ByteLevel", None
    if embedded and not args.save and (not args.load or args.finetune):
        # the default run keeps its model where `mindspeed generate` finds it (printed at the
        # end), named after that model; check_save_folder guards it as it does a --save given
        lora_on = args.lora_r is not None or args.lora_target_modules is not None
        name = os.path.basename(os.path.abspath(args.load_hf)) if args.load_hf else args.model_name
        args.save = default_save_folder(name + ("-lora" if sft and lora_on else "-sft" if sft else ""))
    if embedded:  # our own run: every fused kernel the device has
        for flag in FUSED_FLAGS:
            setattr(args, flag, True)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:  # Megatron: that share of the decay's iterations
        if args.lr_warmup_iters:
            raise MindSpeedError("give --lr-warmup-fraction or --lr-warmup-iters, not both")
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    if args.async_save and args.save_whole:
        raise MindSpeedError("--async-save writes sharded checkpoints (each rank its own file); drop --save-whole")
    if args.ckpt_format == "torch_dist" and args.save_whole:
        raise MindSpeedError("--ckpt-format torch_dist is written by every rank (Megatron's distributed format); "
                             "drop --save-whole")
    if args.model_type_hf is not None and not (args.enable_hf2mg_convert or args.load_hf or args.enable_mg2hf_convert):
        raise MindSpeedError("--model-type-hf names the Hugging Face architecture of --load with "
                             "--enable-hf2mg-convert (or of --load-hf, or of the folders --enable-mg2hf-convert "
                             "writes): give one of them")
    if args.enable_hf2mg_convert:  # --load is a Hugging Face folder, converted into this run's layout
        if not args.load or args.load_hf:
            raise MindSpeedError("--enable-hf2mg-convert converts the Hugging Face folder of --load: give --load "
                                 "(and no --load-hf)")
        args.load_hf, args.load, args.finetune = args.load, None, False  # its weights, from iteration 0
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:  # as Megatron: nothing to split
        args.sequence_parallel = False
    if args.moe_token_dispatcher_type == "alltoall_seq":  # the same dispatch here (see megatron_args)
        args.moe_token_dispatcher_type = "alltoall"
    return embedded


def default_save_folder(model_name: str) -> str:
    """Where the embedded default run saves its model: ./checkpoints/<model>, the --model-name
    preset's name or the --load-hf folder's (our checkpoints load on either framework)."""
    return os.path.join("checkpoints", model_name)


def model_config(args, vocab_size: int) -> ModelConfig:
    cfg = _model_config(args, vocab_size)
    if args.mtp_num_layers:  # Megatron's default scaling factor 0.1
        try:
            cfg = dataclasses.replace(cfg, mtp_num_layers=args.mtp_num_layers, mtp_loss_scaling_factor=(
                0.1 if args.mtp_loss_scaling_factor is None else args.mtp_loss_scaling_factor))
        except ValueError as exc:
            raise MindSpeedError(f"model configuration: {exc}") from None
    elif args.mtp_loss_scaling_factor is not None:  # Megatron ignores it without modules; refused here, as a
        # weight that weighs nothing (--mtp-mem-efficient-logits is MindSpeed-LLM's choice of how the
        # cross entropy's maximum is taken, for the main logits too: the same math here, accepted)
        raise MindSpeedError("--mtp-loss-scaling-factor qualifies the multi-token prediction modules of "
                             "--mtp-num-layers, which this run has none of: give --mtp-num-layers or drop it")
    try:
        return dataclasses.replace(cfg, lora=lora_config(args), reward_head=stage_of(args) == "orm",
                                   fused=frozenset(op for flag, op in {**FUSED_FLAGS, **FUSED_PATH_FLAGS}.items()
                                                   if getattr(args, flag, False)),
                                   norm_weight_float32=bool(getattr(args, "rmsnorm_weight_in_fp32", False)),
                                   router_float32=bool(getattr(args, "router_gating_in_fp32", False)))
    except ValueError as exc:  # e.g. LoRA flags the model cannot take
        raise MindSpeedError(f"model configuration: {exc}") from None


def lora_config(args) -> LoRAConfig | None:
    """MindSpeed-LLM's LoRA flags: on when --lora-r or --lora-target-modules is given."""
    if args.lora_r is None and args.lora_target_modules is None:
        if args.lora_load:
            raise MindSpeedError("--lora-load resumes LoRA adapters: give the same --lora-r / --lora-target-modules "
                                 "as the run that saved them")
        return None
    try:
        return LoRAConfig(r=args.lora_r or 16, alpha=args.lora_alpha or 32.0, dropout=args.lora_dropout,
                          targets=tuple(args.lora_target_modules or LORA_TARGETS))
    except ValueError as exc:
        raise MindSpeedError(str(exc)) from None


# rope_scaling keys and the flags that set them
_ROPE_FLAGS = {"factor": "--rope-scaling-factor", "low_freq_factor": "--low-freq-factor",
               "high_freq_factor": "--high-freq-factor", "beta_fast": "--beta-fast", "beta_slow": "--beta-slow",
               "mscale": "--rope-scaling-mscale", "mscale_all_dim": "--rope-scaling-mscale-all-dim",
               "original_max_position_embeddings": "--original-max-position-embeddings",
               "long_factor": "--long-factor", "short_factor": "--short-factor", "long_mscale": "--long-mscale",
               "short_mscale": "--short-mscale"}


def _flag_value(args, flag: str):
    return getattr(args, flag[2:].replace("-", "_"), None)


def _rope_scaling(args) -> dict | None:
    """The model's rope_scaling from --rope-scaling-type and its numbers (models/rope.py)."""
    given = [f for f in [*_ROPE_FLAGS.values(), "--rope-scaling-original-max-position-embeddings"]
             if _flag_value(args, f) is not None]
    if not args.rope_scaling_type or args.rope_scaling_type == "plm":
        if given:
            raise MindSpeedError(f"{given[0]} needs --rope-scaling-type" if not args.rope_scaling_type else
                                 f"{given[0]}: --rope-scaling-type plm scales nothing")
        # MindSpeed-LLM's plm: the frequencies over the rotated features at --rotary-base, as RoPE's own
        return None
    scaling = {"rope_type": args.rope_scaling_type}
    for key, flag in _ROPE_FLAGS.items():
        if _flag_value(args, flag) is not None:
            scaling[key] = _flag_value(args, flag)
    if args.rope_scaling_original_max_position_embeddings is not None:  # yarn's and longrope's spelling
        scaling["original_max_position_embeddings"] = args.rope_scaling_original_max_position_embeddings
    wrong = rope.problem(scaling)
    if wrong:
        key, rest = wrong.split(" ", 1)
        flags = dict(_ROPE_FLAGS)
        if args.rope_scaling_type in ("yarn", "longrope"):
            flags["original_max_position_embeddings"] = "--rope-scaling-original-max-position-embeddings"
        raise MindSpeedError(f"--rope-scaling-type {args.rope_scaling_type}: {flags.get(key, key)} {rest}")
    return scaling


# Gemma's and MiniCPM's flags -> ModelConfig fields (switches and numbers; the activation and the
# window apart)
_LAYER_FLAGS = {"add_rmsnorm_offset": "norm_offset", "post_norm": "post_norm", "input_embeds_norm": "scale_embeddings",
                "query_pre_attn_scalar": "query_pre_attn_scalar",
                "attn_logit_softcapping": "attn_logit_softcapping",
                "output_logit_softcapping": "final_logit_softcapping",
                "scale_emb": "scale_emb", "scale_depth": "scale_depth", "dim_model_base": "dim_model_base",
                "glu_linear_offset": "glu_linear_offset", "activation_func_clamp_value": "activation_func_clamp_value"}


def _layer_fields(args, num_layers: int) -> list[tuple]:
    """(flag, ModelConfig field, value) of each Gemma- or MiniCPM-style flag given."""
    out = [(flag, field, getattr(args, flag)) for flag, field in _LAYER_FLAGS.items() if getattr(args, flag) is not None]
    gated = [f for f in ("swiglu", "gelu_tanh", "geglu", "quick_geglu", "squared_relu") if getattr(args, f)]
    if len(gated) > 1:
        raise MindSpeedError(f"--{gated[0].replace('_', '-')} and --{gated[1].replace('_', '-')} choose different "
                             f"MLP activations: give one")
    for flag, activation in (("gelu_tanh", "geglu_tanh"), ("geglu", "geglu"), ("quick_geglu", "quick_geglu"),
                             ("squared_relu", "squared_relu")):
        if getattr(args, flag):
            out.append((flag, "activation", activation))
    if args.softmax_type == "off-by-one":
        raise MindSpeedError("--softmax-type off-by-one (a fixed zero logit beside the keys) is not built: "
                             "--softmax-type learnable (attention sinks) is")
    if args.softmax_type is not None:
        out.append(("softmax_type", "attention_sinks", args.softmax_type == "learnable"))
    windows = [f for f in ("sliding_window", "interleave_sliding_window", "window_size") if getattr(args, f)]
    if len(windows) > 1:
        raise MindSpeedError(f"--{windows[0].replace('_', '-')} and --{windows[1].replace('_', '-')} both set the "
                             f"sliding window: give one")
    if args.window_attn_skip_freq and not args.window_size:
        raise MindSpeedError("--window-attn-skip-freq picks the layers without the window of --window-size: give both")
    if args.sliding_window:
        out += [("sliding_window", "sliding_window", args.sliding_window),
                ("sliding_window", "sliding_window_layers", None)]
    if args.interleave_sliding_window:
        out += [("interleave_sliding_window", "sliding_window", args.interleave_sliding_window),
                ("interleave_sliding_window", "sliding_window_layers", interleaved_window_layers(num_layers))]
    if args.window_size:  # megatron-core counts layers from one: each skip_freq-th has no window
        skip = args.window_attn_skip_freq
        out += [("window_size", "sliding_window", args.window_size),
                ("window_size", "sliding_window_layers",
                 None if not skip else tuple(i for i in range(num_layers) if (i + 1) % skip))]
    return out


def _model_config(args, vocab_size: int) -> ModelConfig:
    scaling = _rope_scaling(args)
    if args.load_hf:
        cfg = hf.load_config(args.load_hf)
        if args.noop_layers:  # MindSpeed-LLM's --enable-hf2mg-convert: the folder's layers are the real ones
            cfg, _ = hf.with_noop_layers(cfg, None, pipeline.parse_layer_numbers(args.noop_layers, "--noop-layers"))
        for flag, field, value in _layer_fields(args, cfg.num_layers):
            if not _same_setting(getattr(cfg, field), value):
                raise MindSpeedError(f"--{flag.replace('_', '-')} disagrees with the Hugging Face folder's "
                                     f"config.json ({field} {getattr(cfg, field)!r})")
        return _agreeing_with_flags(args, cfg, vocab_size, scaling)
    if args.model_name and args.model_name not in PRESETS:
        raise MindSpeedError(f"unknown --model-name {args.model_name!r}; presets: {', '.join(sorted(PRESETS))}")
    base = dict(PRESETS[args.model_name]) if args.model_name else {}
    for flag, field in _MODEL_FLAGS.items():
        if getattr(args, flag, None) is not None:
            base[field] = getattr(args, flag)
    if args.normalization:
        base["normalization"] = args.normalization.lower()
    if args.swiglu:
        base["activation"] = "swiglu"
    if args.position_embedding_type:
        base["position_embedding_type"] = "learned" if args.position_embedding_type == "learned_absolute" else "rope"
    if args.use_rotary_position_embeddings:
        if args.position_embedding_type == "learned_absolute":
            raise MindSpeedError("--use-rotary-position-embeddings and --position-embedding-type learned_absolute "
                                 "contradict each other")
        base["position_embedding_type"] = "rope"
    if args.disable_bias_linear:
        base["add_bias_linear"], base["attention_output_bias"] = False, False
    if args.add_dense_bias:  # MindSpeed-LLM's Phi-3.5-MoE: the attention's output bias alone
        base["attention_output_bias"] = True
    if args.add_output_layer_bias:
        base["output_layer_bias"] = True
    if args.spec:
        base["family"] = spec_family(args.spec, moe=args.num_experts is not None)
        base.update(families.get(base["family"]).spec_fields)
    if _rotary_percent(args) is not None:
        base["rotary_percent"] = _rotary_percent(args)
    if scaling:
        base["rope_scaling"] = scaling
    for flag in ("untie_embeddings_and_output_weights", "add_qkv_bias", "qk_layernorm"):
        if getattr(args, flag):
            base[flag] = True
    if args.noop_layers:
        base["noop_layers"] = pipeline.parse_layer_numbers(args.noop_layers, "--noop-layers")
    base.update((field, value) for _, field, value in _layer_fields(args, base.get("num_layers", ModelConfig.num_layers)))
    if args.num_experts is not None:
        base["moe"], base["moe_layers"] = _moe_config(args, base.get("num_layers", ModelConfig.num_layers))
    linear, linear_layers = _linear_attention(args, base.get("num_layers", ModelConfig.num_layers))
    if linear is not None:
        base["linear_attention"], base["linear_layers"] = linear, linear_layers
    # MindSpeed-LLM's minimax_spec reads --q-lora-rank and --kv-lora-rank as its q/k norms' widths
    norm_widths = base.get("qk_norm_across_heads") and not args.multi_latent_attention
    mla = None if norm_widths else _mla_config(args)
    if mla is not None:  # each head its own key and value, of the MLA flags' width (a preset's GQA aside)
        base["mla"] = mla
        base["dsa"] = _dsa_config(args, base.get("num_layers", ModelConfig.num_layers))
        base.pop("kv_channels", None)  # --kv-channels, when given, was checked by _mla_config
        if args.num_query_groups is None:
            base.pop("num_query_groups", None)
    base["vocab_size"] = _vocab_rows(args, vocab_size)
    base["max_position_embeddings"] = max(args.max_position_embeddings or 0, args.seq_length,
                                          base.get("max_position_embeddings", 0))
    try:
        cfg = ModelConfig(**base)
        if cfg.moe is not None and cfg.moe.shared_expert_size is None and args.n_shared_experts:
            # MindSpeed-LLM's --n-shared-experts: a shared expert as wide as N routed ones (of the
            # experts' width, or the dense MLP's when they have none of their own)
            width = args.n_shared_experts * (cfg.moe.ffn_hidden_size or cfg.ffn_hidden_size)
            cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, shared_expert_size=width))
    except (TypeError, ValueError) as exc:
        raise MindSpeedError(f"model configuration: {exc}") from None
    if args.fc_type is not None and (args.fc_type == "gate_up") != cfg.gated:
        raise MindSpeedError(f"--fc-type {args.fc_type}: the MLP's activation ({cfg.activation}) is "
                             + ("ungated: its first layer is up alone (up_down)" if not cfg.gated else
                                "gated: its first layer is gate and up (gate_up)"))
    if norm_widths:
        for flag, heads in (("q_lora_rank", cfg.num_attention_heads), ("kv_lora_rank", cfg.num_query_groups)):
            if getattr(args, flag) not in (None, heads * cfg.kv_channels):
                raise MindSpeedError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: with --spec {args.spec[0]} it "
                                     f"is the width of the {'query' if flag[0] == 'q' else 'key'} norm, {heads} heads "
                                     f"x {cfg.kv_channels} = {heads * cfg.kv_channels}")
    return cfg


# Megatron's defaults of the multi-latent attention sizes (its --multi-latent-attention flags)
_MLA_DEFAULTS = {"kv_lora_rank": 32, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64, "v_head_dim": 128}


# the gated DeltaNet layers' flags, besides --full-attention-interval that asks for them
_LINEAR_FLAGS = {"linear_num_key_heads": "key_heads", "linear_num_value_heads": "value_heads",
                 "linear_key_head_dim": "key_dim", "linear_value_head_dim": "value_dim", "mamba_d_conv": "conv_kernel",
                 "mamba_chunk_size": "chunk_size"}


def _linear_attention(args, num_layers: int) -> tuple[LinearAttentionConfig | None, tuple | None]:
    """Gated DeltaNet's settings and the layers that run it, from --full-attention-interval N
    (every N-th layer attends) and the --linear-* / --mamba-* flags (megatron-core's defaults)."""
    given = [f for f in (*_LINEAR_FLAGS, "mamba_expand") if getattr(args, f) is not None]
    _check_mamba_expand(args)
    if args.full_attention_interval is None:
        if given:
            raise MindSpeedError(f"--{given[0].replace('_', '-')} qualifies the gated DeltaNet layers of "
                                 "--full-attention-interval, which this run has none of: give it or drop the flag")
        return None, None
    chunk = args.mamba_chunk_size
    if chunk is not None and chunk & (chunk - 1):  # MindSpeed-LLM's kernels tile by powers of two
        raise MindSpeedError(f"--mamba-chunk-size {chunk} is not a power of two (16, 32, 64, ...)")
    defaults = dict(key_heads=16, value_heads=32, key_dim=128, value_dim=128, conv_kernel=4, chunk_size=64)
    try:
        la = LinearAttentionConfig(**{**defaults, **{field: getattr(args, flag) for flag, field in _LINEAR_FLAGS.items()
                                                     if getattr(args, flag) is not None}})
    except ValueError as exc:
        raise MindSpeedError(f"model configuration: {exc}") from None
    return la, tuple(i for i in range(num_layers) if (i + 1) % args.full_attention_interval)


def _check_mamba_expand(args) -> None:
    if args.mamba_expand not in (None, 1):
        raise MindSpeedError(f"--mamba-expand {args.mamba_expand}: gated DeltaNet's widths are the --linear-* flags'; "
                             "an expansion other than 1 is not built")


def _rotary_percent(args) -> float | None:
    """--rotary-percent, or MindSpeed-LLM's --partial-rotary-factor (the same number)."""
    if args.partial_rotary_factor is None:
        return args.rotary_percent
    if args.rotary_percent is not None and args.rotary_percent != args.partial_rotary_factor:
        raise MindSpeedError(f"--partial-rotary-factor {args.partial_rotary_factor} and --rotary-percent "
                             f"{args.rotary_percent} are one setting: give one")
    return args.partial_rotary_factor


def _mla_config(args) -> MLAConfig | None:
    """--multi-latent-attention and its sizes (Megatron's flags; --qk-head-dim is the part of
    each query/key head without position, --qk-pos-emb-head-dim the rotated part)."""
    sizes = ("q_lora_rank", *_MLA_DEFAULTS, "enable_mla_scale_q_lora", "enable_mla_scale_kv_lora")
    if not args.multi_latent_attention:
        given = [f for f in sizes if getattr(args, f)]
        if given:
            raise MindSpeedError(f"--{given[0].replace('_', '-')} sizes multi-latent attention: give "
                                 f"--multi-latent-attention too")
        return None
    value = {f: getattr(args, f) if getattr(args, f) is not None else default for f, default in _MLA_DEFAULTS.items()}
    # --kv-channels: a head's query/key features, or (MindSpeed-LLM's LongCat script) its rotated ones
    if args.kv_channels is not None and args.kv_channels not in (value["qk_head_dim"] + value["qk_pos_emb_head_dim"],
                                                                 value["qk_pos_emb_head_dim"]):
        raise MindSpeedError(f"--kv-channels {args.kv_channels}: multi-latent attention's query/key heads have "
                             f"--qk-head-dim + --qk-pos-emb-head-dim = "
                             f"{value['qk_head_dim'] + value['qk_pos_emb_head_dim']} features")
    try:
        return MLAConfig(kv_lora_rank=value["kv_lora_rank"], qk_nope_head_dim=value["qk_head_dim"],
                         qk_rope_head_dim=value["qk_pos_emb_head_dim"], v_head_dim=value["v_head_dim"],
                         q_lora_rank=args.q_lora_rank, scale_q_lora=bool(args.enable_mla_scale_q_lora),
                         scale_kv_lora=bool(args.enable_mla_scale_kv_lora))
    except ValueError as exc:
        raise MindSpeedError(str(exc)) from None


def spec_family(spec: list, moe: bool = False) -> str:
    """The family a layer spec builds; ``moe``: the model has experts, and MindSpeed-LLM's MoE
    scripts pass their dense family's spec (qwen3_spec with --num-experts is a qwen3_moe model)."""
    module = spec[0].rsplit(".", 1)[-1]
    if module not in families.SPECS:  # MindSpeed-LLM's layer specs (--spec MODULE FUNCTION): the families'
        raise MindSpeedError(f"--spec {' '.join(spec)}: no model family here builds that layer spec; known specs: "
                             f"{', '.join(sorted(families.SPECS))}")
    family = families.SPECS[module]
    return (families.moe_of(family) or family) if moe else family


def _vocab_rows(args, vocab_size: int) -> int:
    """The embedding's rows: --padded-vocab-size, else the tokenizer's vocabulary padded to
    --make-vocab-size-divisible-by."""
    if args.padded_vocab_size is None:
        return padded_vocab_size(vocab_size, args.make_vocab_size_divisible_by)
    if args.padded_vocab_size < vocab_size:
        raise MindSpeedError(f"--padded-vocab-size {args.padded_vocab_size} is smaller than the tokenizer's "
                             f"{vocab_size} tokens")
    return args.padded_vocab_size


def _same_setting(a, b) -> bool:
    """A config's value and a flag's: equal strings, switches or None, or numbers (lists of
    numbers) equal to 1e-6."""
    if isinstance(a, (str, bool)) or isinstance(b, (str, bool)) or a is None or b is None:
        return a == b
    a, b = (list(x) if isinstance(x, (list, tuple)) else [x] for x in (a, b))
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-6) for x, y in zip(a, b))


def _agreeing_with_flags(args, cfg: ModelConfig, vocab_size: int, scaling: dict | None = None) -> ModelConfig:
    """A Hugging Face folder's configuration, checked against the model flags a script also
    passes (MindSpeed-LLM's scripts give both): a flag that disagrees is refused, naming it.
    ``scaling``: the RoPE scaling the flags give, each of its numbers the folder's."""
    given = {field: getattr(args, flag) for flag, field in _MODEL_FLAGS.items() if getattr(args, flag, None) is not None}
    if args.padded_vocab_size is not None:
        given["vocab_size"] = args.padded_vocab_size
    for field, value in given.items():
        if field in ("attention_dropout", "hidden_dropout", "init_method_std"):
            continue  # training settings, not the architecture
        if getattr(cfg, field) != value:
            noop = (f", {len(cfg.noop_layers)} of them --noop-layers" if field == "num_layers" and cfg.noop_layers
                    else "")
            raise MindSpeedError(f"--{field.replace('_', '-')} {value} disagrees with the Hugging Face folder's "
                                 f"config.json ({field} {getattr(cfg, field)!r}{noop})")
    theirs = cfg.rope_scaling or {}
    for key, value in (scaling or {}).items():
        if key not in theirs or not _same_setting(theirs[key], value):
            flag = "--rope-scaling-type" if key == "rope_type" else _ROPE_FLAGS.get(
                key, "--rope-scaling-original-max-position-embeddings")
            raise MindSpeedError(f"{flag} disagrees with the Hugging Face folder's config.json (rope_scaling {key}: "
                                 f"{theirs.get(key, 'not set')!r:.80})")
    if args.model_type_hf is not None and families.named(args.model_type_hf, cfg.moe is not None) != cfg.family:
        raise MindSpeedError(f"--model-type-hf {args.model_type_hf}, but {args.load_hf}/config.json is a {cfg.family} "
                             "model" if args.model_type_hf in families.ALIASES else
                             f"--model-type-hf {args.model_type_hf}: choose one of {', '.join(families.ALIASES)}")
    built = spec_family(args.spec, moe=cfg.moe is not None) if args.spec else None
    if args.spec and cfg.family not in (built, *families.get(built).spec_also):
        raise MindSpeedError(f"--spec {args.spec[0]} builds {built} layers, "
                             f"but the Hugging Face folder holds a {cfg.family} model")
    zero = 0 if cfg.moe is None else cfg.moe.zero_experts
    if args.num_zero_experts is not None and args.num_zero_experts != zero:
        raise MindSpeedError(f"--num-zero-experts {args.num_zero_experts} disagrees with the Hugging Face folder's "
                             f"config.json ({zero} zero-computation experts)")
    for flag, field in (("enable_mla_scale_q_lora", "scale_q_lora"), ("enable_mla_scale_kv_lora", "scale_kv_lora")):
        if getattr(args, flag) and not (cfg.mla is not None and getattr(cfg.mla, field)):
            raise MindSpeedError(f"--{flag.replace('_', '-')}: the Hugging Face folder's latent attention does not "
                                 f"scale that latent")
    if _rotary_percent(args) is not None and _rotary_percent(args) != cfg.rotary_percent:
        raise MindSpeedError(f"--partial-rotary-factor / --rotary-percent {_rotary_percent(args)} disagrees with the "
                             f"Hugging Face folder's config.json (partial_rotary_factor {cfg.rotary_percent})")
    if (cfg.moe is not None and args.num_experts is not None and args.moe_router_score_function != cfg.moe.score_function
            and os.environ.get("RANK", os.environ.get("RANK_ID", "0")) == "0"):
        # the folder is the model (MindSpeed-LLM's minimax27 script leaves megatron-core's softmax default)
        print(f"note: --moe-router-score-function {args.moe_router_score_function} is set aside: the Hugging Face "
              f"folder's experts route by {cfg.moe.score_function} scores", file=sys.stderr)
    return _linear_agreeing_with_flags(args, _dsa_agreeing_with_flags(args, _groups_from_flags(args, cfg)))


def _groups_from_flags(args, cfg: ModelConfig) -> ModelConfig:
    """A folder whose experts route over all of them, trained with the script's groups
    (--moe-router-num-groups, --moe-router-group-topk: MindSpeed-LLM's hunyuan3 script on a
    HY-V3 folder): each token's experts come from its best groups, as megatron-core limits them;
    the folder written back routes over every expert again, as the folder's own model does."""
    if cfg.moe is None or cfg.moe.num_groups is not None or (args.moe_router_num_groups or 1) <= 1:
        return cfg
    try:
        moe = dataclasses.replace(cfg.moe, num_groups=args.moe_router_num_groups,
                                  group_topk=args.moe_router_group_topk)
    except ValueError as exc:
        raise MindSpeedError(f"--moe-router-num-groups on the Hugging Face folder's experts: {exc}") from None
    if cfg.family == "hy_v3":
        features.note_used("hy-v3-group-routing")
    if os.environ.get("RANK", os.environ.get("RANK_ID", "0")) == "0":
        print(f"note: --moe-router-num-groups {moe.num_groups} --moe-router-group-topk {moe.group_topk}: training "
              f"routes each token within its best {moe.group_topk} of {moe.num_groups} expert groups; the Hugging Face "
              f"folder's model routes over every expert (and an exported folder will)", file=sys.stderr)
    return dataclasses.replace(cfg, moe=moe)


# sparse attention's flags besides --enable-dsa-indexer (MindSpeed-LLM's defaults in _dsa_config)
_DSA_FLAGS = {"index_topk": "topk", "index_n_heads": "n_heads", "index_head_dim": "head_dim",
              "indexer_loss_coeff": "loss_coeff"}
_DSA_SCHEDULE = ("index_topk_freq", "index_skip_topk_offset", "index_topk_pattern")
_DSA_TRAINING = ("indexer_dense_warmup",)  # how the run trains the indexer, not what it is


def _dsa_layer_types(args, num_layers: int) -> tuple | None:
    """GLM-5's indexer layers from --index-topk-pattern (F/S per layer) or --index-topk-freq and
    --index-skip-topk-offset (MindSpeed-LLM's defaults 1 and 1: every layer); None: every layer."""
    if args.index_topk_pattern is not None:
        pattern = args.index_topk_pattern.upper()
        if len(pattern) != num_layers or set(pattern) - set("FS"):
            raise MindSpeedError(f"--index-topk-pattern {args.index_topk_pattern!r}: one F (runs its indexer) or S "
                                 f"(shares the last F layer's top-k) per layer, {num_layers} of them")
        return tuple("full" if c == "F" else "shared" for c in pattern)
    if args.index_topk_freq in (None, 1):
        return None
    return indexer_layer_types(num_layers, args.index_topk_freq, args.index_skip_topk_offset or 1)


def _dsa_config(args, num_layers: int) -> DSAConfig | None:
    """--enable-dsa-indexer and its settings, on the latent attention of the MLA flags."""
    if not args.enable_dsa_indexer:
        given = [f for f in (*_DSA_FLAGS, *_DSA_SCHEDULE, *_DSA_TRAINING) if getattr(args, f) is not None]
        if given:
            raise MindSpeedError(f"--{given[0].replace('_', '-')} qualifies sparse attention's indexer: give "
                                 f"--enable-dsa-indexer too")
        return None
    values = dict(topk=2048, n_heads=64, head_dim=128, loss_coeff=1.0)
    values.update((field, getattr(args, flag)) for flag, field in _DSA_FLAGS.items() if getattr(args, flag) is not None)
    try:
        return DSAConfig(**values, layer_types=_dsa_layer_types(args, num_layers),
                         rope_interleave=bool(args.apply_rope_no_in_complex),
                         dense_warmup=bool(args.indexer_dense_warmup))
    except ValueError as exc:
        raise MindSpeedError(f"model configuration: {exc}") from None


def _dsa_agreeing_with_flags(args, cfg: ModelConfig) -> ModelConfig:
    """A folder's sparse attention against the flags: its heads, widths and indexer layers must be
    the folder's; --index-topk and --indexer-loss-coeff are how this run trains (the folder's
    top-k where not given; a different one is noted)."""
    dsa = cfg.dsa
    given = [f for f in (*_DSA_FLAGS, *_DSA_SCHEDULE, *_DSA_TRAINING) if getattr(args, f) is not None]
    if args.apply_rope_no_in_complex and dsa is not None and not dsa.rope_interleave:
        raise MindSpeedError("--apply-rope-no-in-complex rotates the indexer's features in pairs; the Hugging Face "
                             "folder's indexer rotates them in halves (DeepSeek-V3.2): drop the flag")
    if dsa is None:
        if args.enable_dsa_indexer or given:
            raise MindSpeedError(f"--{(given or ['enable_dsa_indexer'])[0].replace('_', '-')}: the Hugging Face "
                                 f"folder's model has no sparse attention indexer")
        return cfg
    for flag in ("index_n_heads", "index_head_dim"):
        if getattr(args, flag) is not None and getattr(args, flag) != getattr(dsa, _DSA_FLAGS[flag]):
            raise MindSpeedError(f"--{flag.replace('_', '-')} {getattr(args, flag)} disagrees with the Hugging Face "
                                 f"folder's config.json ({getattr(dsa, _DSA_FLAGS[flag])})")
    if any(getattr(args, f) is not None for f in _DSA_SCHEDULE):
        types = _dsa_layer_types(args, cfg.num_layers) or tuple(["full"] * cfg.num_layers)
        if types != (dsa.layer_types or tuple(["full"] * cfg.num_layers)):
            raise MindSpeedError("--index-topk-freq / --index-skip-topk-offset / --index-topk-pattern disagree with "
                                 "the Hugging Face folder's indexer_types")
    topk = dsa.topk if args.index_topk is None else args.index_topk
    if topk != dsa.topk and os.environ.get("RANK", os.environ.get("RANK_ID", "0")) == "0":
        print(f"note: --index-topk {topk}: each query keeps {topk} keys (the folder's index_topk is {dsa.topk})",
              file=sys.stderr)
    coeff = 1.0 if args.indexer_loss_coeff is None else args.indexer_loss_coeff
    try:
        return dataclasses.replace(cfg, dsa=dataclasses.replace(dsa, topk=topk, loss_coeff=coeff,
                                                                dense_warmup=bool(args.indexer_dense_warmup)))
    except ValueError as exc:
        raise MindSpeedError(f"model configuration: {exc}") from None


def _linear_agreeing_with_flags(args, cfg: ModelConfig) -> ModelConfig:
    """A folder's gated DeltaNet layers against the flags: each architecture flag given must be
    the folder's; --mamba-chunk-size (how training computes, not what) is taken."""
    la = cfg.linear_attention
    given = [f for f in (*_LINEAR_FLAGS, "full_attention_interval") if getattr(args, f) is not None]
    if la is None:
        if given:
            raise MindSpeedError(f"--{given[0].replace('_', '-')}: the Hugging Face folder's model has no gated "
                                 "DeltaNet layers")
        return cfg
    _check_mamba_expand(args)
    if args.full_attention_interval is not None:
        layers = tuple(i for i in range(cfg.num_layers) if (i + 1) % args.full_attention_interval)
        if layers != (cfg.linear_layers or tuple(range(cfg.num_layers))):
            raise MindSpeedError(f"--full-attention-interval {args.full_attention_interval} disagrees with the "
                                 f"Hugging Face folder's config.json (layer_types: gated DeltaNet in layers "
                                 f"{list(cfg.linear_layers or range(cfg.num_layers))})")
    for flag, field in _LINEAR_FLAGS.items():
        if field != "chunk_size" and getattr(args, flag) is not None and getattr(args, flag) != getattr(la, field):
            raise MindSpeedError(f"--{flag.replace('_', '-')} {getattr(args, flag)} disagrees with the Hugging Face "
                                 f"folder's config.json ({field} {getattr(la, field)})")
    if args.mamba_chunk_size is not None:
        return dataclasses.replace(cfg, linear_attention=dataclasses.replace(la, chunk_size=args.mamba_chunk_size))
    return cfg


def _moe_config(args, num_layers: int) -> tuple[MoEConfig, tuple | None]:
    """MoEConfig and MoE layer numbers from Megatron's --num-experts / --moe-* flags."""
    # MindSpeed-LLM's softmax_topk: the softmax over every expert, its top k kept as they are (or
    # renormalised with --norm-topk-prob), with no load-balancing term
    softmax_topk = args.moe_router_load_balancing_type == "softmax_topk"
    norm = args.norm_topk_prob if softmax_topk else not args.moe_router_pre_softmax
    balancing = "none" if softmax_topk else args.moe_router_load_balancing_type
    # one group (Kimi-K2's --moe-router-num-groups 1): the choice is among every expert, as without groups
    grouped = (args.moe_router_num_groups or 1) > 1
    routing = dict(score_function=args.moe_router_score_function,
                   num_groups=args.moe_router_num_groups if grouped else None,
                   group_topk=args.moe_router_group_topk if grouped else None,
                   scaling_factor=args.moe_router_topk_scaling_factor or 1.0)
    if balancing == "pai_megatron_aux_loss":
        # MindSpeed-LLM's router then takes the softmax over every expert and its top k as they
        # are, with the aux loss, and no groups, scaling or score function of the flags
        balancing, norm = "aux_loss", False
        routing = dict(score_function="softmax", num_groups=None, group_topk=None, scaling_factor=1.0)
    if args.seq_aux:  # MindSpeed-LLM's per-sequence aux loss, whatever the balancing type says
        balancing = "seq_aux_loss"

    try:
        moe = MoEConfig(
            num_experts=args.num_experts, topk=args.moe_router_topk, ffn_hidden_size=args.moe_ffn_hidden_size,
            norm_topk_prob=norm, **routing, load_balancing_type=balancing, aux_loss_coeff=args.moe_aux_loss_coeff,
            z_loss_coeff=args.moe_z_loss_coeff or 0.0, enable_expert_bias=args.moe_router_enable_expert_bias,
            bias_update_rate=args.moe_router_bias_update_rate, capacity_factor=args.moe_expert_capacity_factor,
            pad_to_capacity=args.moe_pad_expert_input_to_capacity, drop_policy=args.moe_token_drop_policy,
            shared_expert_size=args.moe_shared_expert_intermediate_size, shared_expert_gate=args.shared_expert_gate,
            input_jitter_eps=args.moe_input_jitter_eps or 0.0, zero_experts=args.num_zero_experts or 0)
    except ValueError as exc:
        raise MindSpeedError(f"mixture of experts: {exc}") from None
    layers = tuple(i for i in range(num_layers) if i >= args.first_k_dense_replace and i % args.moe_layer_freq == 0)
    if not layers:
        raise MindSpeedError(f"--moe-layer-freq {args.moe_layer_freq} and --first-k-dense-replace "
                             f"{args.first_k_dense_replace} leave none of the {num_layers} layers an MoE layer")
    return moe, None if len(layers) == num_layers else layers


def check_configuration(args, world: int, default_save: bool = False):
    """Every check that needs no process group, no data and no weights: the launcher runs it
    once before starting any rank, and each rank again. Returns (tokenizer, model config).
    ``default_save``: --save is the embedded run's default folder, not the user's."""
    tokenizer = build_tokenizer(*tokenizer_args(args))
    cfg = model_config(args, tokenizer.vocab_size)
    # the matrix's gate again, with the model's own MoE layers (from flags or a Hugging Face
    # config): the combinations not built yet are rows of it
    backend = runtime.bound()
    features.validate(Flags({**vars(args), "num_experts": cfg.moe.num_experts if cfg.moe else None,
                             # from the flags or a Hugging Face folder (phimoe's SparseMixer and input jitter)
                             "moe_router_load_balancing_type": cfg.moe.load_balancing_type if cfg.moe else None,
                             "moe_input_jitter_eps": cfg.moe.input_jitter_eps if cfg.moe else None,
                             "num_attention_heads": cfg.num_attention_heads,
                             "num_query_groups": cfg.num_query_groups}), backend.NAME,
                      device.type(), backend.FRAMEWORK_VERSION)
    if cfg.lora is not None and cfg.lora.r > cfg.hidden_size:
        raise MindSpeedError(f"--lora-r {cfg.lora.r} exceeds the hidden size {cfg.hidden_size}: the adapters would "
                             "not be low-rank (the rank of an adapter is at most its layer's width)")
    if args.lora_ckpt_filter and cfg.lora is None:
        raise MindSpeedError("--lora-ckpt-filter keeps a LoRA run's adapters only: this run has no adapters "
                             "(give --lora-r), or drop the flag")
    if args.lora_ckpt_filter and args.ckpt_format == "torch_dist":
        raise MindSpeedError("--lora-ckpt-filter with --ckpt-format torch_dist: megatron-core's files hold the whole "
                             "model; drop one of them")
    if args.lora_load and not (args.load or args.load_hf):
        raise MindSpeedError("--lora-load takes the adapters only: give the base model with --load or --load-hf")
    check_fits(tokenizer, cfg.vocab_size)
    if args.seq_length > cfg.max_position_embeddings:
        raise MindSpeedError(f"--seq-length {args.seq_length} exceeds the model's max_position_embeddings "
                             f"{cfg.max_position_embeddings}")
    _check_mtp_depth(cfg, args.seq_length)
    if cfg.linear_attention is not None and args.reset_attention_mask:
        raise MindSpeedError("--reset-attention-mask: gated DeltaNet layers carry their state along the whole row, "
                             "so packed sequences are not built for them; drop it (one sequence a row)")
    if args.finetune and not args.load:
        raise MindSpeedError("--finetune takes the weights of the checkpoint in --load: give --load")
    if args.data_path:  # the data's flags alone, as the data sets read them (before any file is)
        gpt_dataset.parse_data_path(args.data_path)
    gpt_dataset.split_parts(args.split)
    profiling.check(args, world)
    if args.wandb_project:
        boards.check_wandb()
    if args.bf16 and args.fp16:
        raise MindSpeedError("--bf16 and --fp16 exclude each other")
    if getattr(args, "gemm_gradient_accumulation_fusion", False) and getattr(args, "compile", False):
        raise MindSpeedError("--gemm-gradient-accumulation-fusion routes the experts' weight gradients past autograd's "
                             "own (a hand-written backward), which --compile does not trace here: drop one of them")
    if args.calculate_per_token_loss and (stage_of(args) not in ("pretrain", "sft") or args.compile):
        raise MindSpeedError("--calculate-per-token-loss averages the language model's loss over the global batch's "
                             "tokens: it runs with pre-training and --stage sft, without --compile"
                             + (f" (this run: --stage {stage_of(args)})" if stage_of(args) not in ("pretrain", "sft")
                                else " (drop --compile)"))
    if args.loss_compute_mode == "chunk" and (stage_of(args) not in ("pretrain", "sft") or args.compile):
        raise MindSpeedError("--loss-compute-mode chunk computes the language model's loss a chunk of positions at a "
                             "time: it runs with pre-training and --stage sft, without --compile"
                             + (f" (this run: --stage {stage_of(args)})" if stage_of(args) not in ("pretrain", "sft")
                                else " (drop --compile)"))
    _check_muon(args, cfg, args.tensor_model_parallel_size)  # before the flags it takes in its own way
    if args.swap_optimizer_times and not args.swap_optimizer:
        raise MindSpeedError("--swap-optimizer-times qualifies --swap-optimizer: add it or drop the flag")
    if args.swap_optimizer and not args.use_distributed_optimizer and args.optimizer != "dist_muon":
        raise MindSpeedError("--swap-optimizer moves the distributed optimizer's state to host memory: add "
                             "--use-distributed-optimizer")
    if args.swap_optimizer and args.reuse_fp32_param:
        raise MindSpeedError("--swap-optimizer with --reuse-fp32-param is not built (the master's residual stays on "
                             "the device): drop one of them")
    if args.o2_gradient and not args.bf16:
        raise MindSpeedError("--o2-gradient keeps the gradients in bf16 and needs bf16 training: add --bf16 "
                             "(as MindSpeed-LLM's O2, it supports bf16 parameters only)")
    _check_precision_aware(args)
    if args.o2_optimizer and not args.bf16:
        raise MindSpeedError("--o2-optimizer keeps the Adam moments in bf16 and needs bf16 training: add --bf16 "
                             "(as MindSpeed-LLM's O2, it supports bf16 parameters only)")
    if args.reuse_fp32_param and not (args.bf16 and args.use_distributed_optimizer):
        raise MindSpeedError("--reuse-fp32-param keeps the distributed optimizer's fp32 master slice as the bf16 "
                             "parameters plus a residual: add "
                             + " and ".join(f for f, on in (("--bf16", args.bf16),
                                                            ("--use-distributed-optimizer",
                                                             args.use_distributed_optimizer)) if not on))
    if args.overlap_param_gather and not args.use_distributed_optimizer:  # as Megatron
        raise MindSpeedError("--overlap-param-gather overlaps the distributed optimizer's gathering of the updated "
                             "parameters: add --use-distributed-optimizer")
    _check_qk_clip(args, cfg)
    dtype = "bfloat16" if args.bf16 else "float16" if args.fp16 else "float32"
    if not device.supports_dtype(dtype):
        raise MindSpeedError(f"{dtype} training is not available on {runtime.bound().NAME} "
                             f"({device.current()}); drop --bf16/--fp16")
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if args.compile and cfg.dsa is not None:  # a folder's sparse attention too
        features.refuse("dsa-compile", runtime.resolve(None))
    if args.compile and cfg.moe is not None and cfg.moe.zero_experts:
        raise MindSpeedError("--compile routes on the device, where zero-computation experts (--num-zero-experts) are "
                             "not built: drop --compile")
    parallel_layers.check_layout(cfg, tp, args.sequence_parallel)
    context.check_layout(cfg, cp, args.context_parallel_algo, args.ulysses_degree_in_cp, tp, args.seq_length,
                         args.sequence_parallel)
    layout = pipeline_layout(args, cfg)
    if layout.v_shape:
        _check_dualpipev(args, cfg)
    if cfg.dsa is not None:  # a stage's first layer must choose its own keys (MindSpeed-LLM's rule too)
        for stage in range(layout.virtual_stages):
            why = cfg.dsa.unsourced(layout.layers(stage))
            if why:
                raise MindSpeedError(f"pipeline stage {stage}: {why}")
    recompute.check(args, [sum(len(layout.layers(layout.stage(r, c))) for c in range(layout.chunks))
                           for r in range(layout.pp)])
    if world % (tp * pp * cp):
        raise MindSpeedError(f"world size {world} is not divisible by the tensor parallel size {tp}"
                             + (f" x the pipeline parallel size {pp}" if pp > 1 else "")
                             + (f" x the context parallel size {cp}" if cp > 1 else ""))
    dp = world // (tp * pp * cp)
    ep = args.expert_model_parallel_size
    if args.moe_fb_overlap and args.moe_alltoall_overlap_comm:
        raise MindSpeedError("--moe-fb-overlap and --moe-alltoall-overlap-comm both overlap the dispatch's all-to-all "
                             "(one with another micro-batch, one with the experts of the same): keep one of them")
    if args.moe_fb_overlap and (getattr(args, "moe_zero_memory", None) or "disable") != "disable":
        raise MindSpeedError(f"--moe-fb-overlap with --moe-zero-memory {args.moe_zero_memory} is not built here (the "
                             "dispatch would be recomputed across its nodes): drop one of them")
    if args.moe_alltoall_overlap_comm and ep > 1 and args.moe_token_dispatcher_type != "alltoall":
        raise MindSpeedError("--moe-alltoall-overlap-comm overlaps the alltoall dispatcher's exchange (as MindSpeed): "
                             "add --moe-token-dispatcher-type alltoall")
    if ep_over_tp(args):  # megatron-core's layout with ETP 1: the EP groups reach across TP x DP
        if not args.sequence_parallel:
            raise MindSpeedError(f"--expert-model-parallel-size {ep} with the experts whole on each of the {tp} "
                                 "tensor-parallel ranks routes each rank's sequence-parallel share: add "
                                 "--sequence-parallel (megatron-core requires it with EP and TP too)")
        if (tp * cp * dp) % ep:
            raise MindSpeedError(f"expert parallel size {ep} does not divide tensor x context x data parallel sizes "
                                 f"({tp} x {cp} x {dp}): with --expert-tensor-parallel-size 1 the EP groups reach "
                                 "across them")
        experts.check_layout(cfg, ep)
    else:
        experts.check_layout(cfg, ep, dp)
    grpo = stage_of(args) == "grpo"  # its global batch counts prompts, its micro-batches completions
    if args.global_batch_size is not None and not grpo and args.global_batch_size % (args.micro_batch_size * dp):
        raise MindSpeedError(f"--global-batch-size {args.global_batch_size} is not a multiple of "
                             f"--micro-batch-size x data-parallel size ({args.micro_batch_size} x {dp})")
    pipeline.check_micro_batches(layout, (args.global_batch_size or args.micro_batch_size * dp)
                                 // (args.micro_batch_size * dp))
    _check_stage(args, dp, cfg.vocab_size)
    if args.save:
        check_save_folder(args, default_save)
    _check_hf_folders(args, cfg)
    return tokenizer, cfg


def _check_hf_folders(args, cfg: ModelConfig) -> None:
    """--enable-mg2hf-convert: a folder to write to, a model a Hugging Face family can hold, and
    --hf-cfg-dir describing it (checked before any step, not at the first save)."""
    given = [f for f in ("only_convert_last_checkpoint", "hf_save_dir", "hf_cfg_dir") if getattr(args, f)]
    if not args.enable_mg2hf_convert:
        if given:
            raise MindSpeedError(f"--{given[0].replace('_', '-')} qualifies --enable-mg2hf-convert: add it or drop "
                                 "the flag")
        return
    if not (args.save or args.hf_save_dir):
        raise MindSpeedError("--enable-mg2hf-convert writes the folders beside the checkpoints: give --save (or "
                             "--hf-save-dir)")
    if args.model_type_hf is not None and families.named(args.model_type_hf, cfg.moe is not None) != cfg.family:
        raise MindSpeedError(f"--model-type-hf {args.model_type_hf}: the model trained here is a {cfg.family} model"
                             if args.model_type_hf in families.ALIASES else
                             f"--model-type-hf {args.model_type_hf}: choose one of {', '.join(families.ALIASES)}")
    try:
        hf.hf_config(cfg)  # the family can hold this model
        if args.hf_cfg_dir is not None:
            hf.check_same_model(args.hf_cfg_dir, dataclasses.replace(cfg, lora=None))
    except CheckpointError as exc:
        raise MindSpeedError(f"--enable-mg2hf-convert: {exc}") from None


def _check_mtp_depth(cfg: ModelConfig, seq_length: int) -> None:
    """Depth k predicts the token k + 1 places on, so a sequence of S tokens gives it S - k
    targets: a depth without any would train on nothing and dilute the others' term."""
    depth = cfg.mtp_num_layers
    if depth >= seq_length:
        raise MindSpeedError(f"--mtp-num-layers {depth} with --seq-length {seq_length}: depth k predicts the token "
                             f"k + 1 places on, so depths {seq_length} and beyond have no targets; give "
                             f"--mtp-num-layers below --seq-length")
    if depth > cfg.num_layers:  # each module is a whole transformer layer on top of the model
        raise MindSpeedError(f"--mtp-num-layers {depth} exceeds the model's {cfg.num_layers} layers (--num-layers): "
                             f"each prediction module is a transformer layer of its own (DeepSeek-V3 uses 1 on 61)")


def stage_of(args) -> str:
    """pretrain, sft, dpo, simpo, orm or prm (--stage rm is orm)."""
    if args.stage == "rm":
        return "orm"
    return args.stage or ("sft" if args.is_instruction_dataset else "pretrain")


def _check_stage(args, dp: int = 1, vocab_size: int | None = None) -> None:
    """What the preference and reward stages' flags must agree on, refused before any rank starts
    (the layouts they cannot run are rows of the matrix)."""
    stage = stage_of(args)
    if stage in ("pretrain", "sft"):
        return
    if stage == "dpo" and args.dpo_label_smoothing and args.dpo_loss_type != "sigmoid":
        raise MindSpeedError(f"--dpo-label-smoothing applies to the sigmoid loss, not --dpo-loss-type "
                             f"{args.dpo_loss_type}")
    if stage == "prm" and not args.reward_tokens:
        raise MindSpeedError("--stage prm needs --reward-tokens: the step labels of the data, as given to mindspeed "
                             "preprocess (e.g. --reward-tokens + -)")
    if stage == "grpo":
        _check_grpo(args, dp, vocab_size)


def _check_grpo(args, dp: int, vocab_size: int | None = None) -> None:
    for flag, on in (("--sequence-parallel", args.sequence_parallel),
                     ("--expert-model-parallel-size", args.expert_model_parallel_size > 1)):
        if on:  # generation runs with tensor parallelism alone (inference.load_model says the same)
            raise MindSpeedError(f"--stage grpo draws its rollouts with the generator, which runs with tensor "
                                 f"parallelism alone: drop {flag}")
    prompts = args.global_batch_size or args.micro_batch_size * dp  # the default, as configure() sets it
    if prompts % dp:
        raise MindSpeedError(f"--stage grpo: --global-batch-size {prompts} (prompts per iteration) is not a "
                             f"multiple of the {dp} data-parallel ranks")
    rows = prompts // dp * args.num_generations
    if rows % args.micro_batch_size:
        raise MindSpeedError(f"--stage grpo: each data-parallel rank trains on {rows} completions per iteration "
                             f"(--global-batch-size / data-parallel ranks x --num-generations), not a multiple of "
                             f"--micro-batch-size {args.micro_batch_size}")
    if args.compile:
        raise MindSpeedError("--stage grpo runs eagerly: drop --compile (its objective reads host rollouts)")
    if args.scale_rewards == "group" and args.num_generations < 2:
        raise MindSpeedError("--stage grpo: a group's advantages need --num-generations 2 or more")
    sources = len(args.reward_funcs) + bool(args.reward_model)
    if not sources:
        raise MindSpeedError("--stage grpo needs a reward: --reward-funcs (accuracy, format, package.module:function) "
                             "or --reward-model")
    if args.reward_weights is not None and len(args.reward_weights) != sources:
        raise MindSpeedError(f"--reward-weights gives {len(args.reward_weights)} weights for {len(args.reward_funcs)} "
                             f"--reward-funcs{' and --reward-model' if args.reward_model else ''}")
    grpo.reward_functions(args.reward_funcs)  # each importable, before any rank starts
    if args.reward_model:  # cut for the policy's tensor parallelism
        rm = grpo.read_reward_model(args.reward_model, weights=False)
        if vocab_size is not None:
            grpo.check_reward_vocabulary(args.reward_model, rm, vocab_size)
        try:
            parallel_layers.check_layout(rm, args.tensor_model_parallel_size)
        except MindSpeedError as e:
            raise MindSpeedError(f"--reward-model {args.reward_model}: {e}") from None


def pipeline_layout(args, cfg: ModelConfig) -> pipeline.PipelineLayout:
    """Which layers each pipeline stage holds (parallel/pipeline.py), from the flags (a run's
    configuration has it as ParallelLayout.stages)."""
    return pipeline.model_layout(cfg, args.pipeline_model_parallel_size, args.num_layers_per_virtual_pipeline_stage,
                                 args.num_layer_list, getattr(args, "schedules_method", None) == "dualpipev")


# the --muon-* flags (their parser default None: given or not) and their defaults (MindSpeed-LLM's)
MUON_DEFAULTS = {"muon_momentum": 0.95, "muon_nesterov": False, "muon_split_qkv": True, "muon_scale_mode": "spectral",
                 "muon_fp32_matmul_prec": "medium", "muon_coefficient_type": "quintic", "muon_num_ns_steps": 5,
                 "muon_tp_mode": "blockwise", "muon_extra_scale_factor": 1.0, "muon_scalar_optimizer": "adam"}


def _muon(args, name: str):
    value = getattr(args, name, None)
    return MUON_DEFAULTS[name] if value is None else value


def muon_options(args) -> MuonOptions | None:
    if args.optimizer not in ("muon", "dist_muon"):
        return None
    return MuonOptions(_muon(args, "muon_momentum"), bool(_muon(args, "muon_nesterov")),
                       _muon(args, "muon_num_ns_steps"), MUON_COEFFICIENTS[_muon(args, "muon_coefficient_type")],
                       _muon(args, "muon_scale_mode"), _muon(args, "muon_extra_scale_factor"),
                       bool(_muon(args, "muon_split_qkv")), _muon(args, "muon_tp_mode"),
                       args.optimizer == "dist_muon" or bool(args.use_distributed_optimizer))


# --muon-coefficient-type: the Newton-Schulz coefficient sets built here (a, b, c of a X + b A X + c A^2 X)
MUON_COEFFICIENTS = {"quintic": (3.4445, -4.7750, 2.0315), "simple": (1.5, -0.5, 0.0)}


DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "uint8"}


def moment_dtypes(args) -> tuple[str, str]:
    """The stored dtypes of Adam's (exp_avg, exp_avg_sq) (Muon's momentum: exp_avg's)."""
    if args.o2_optimizer:
        return "bfloat16", "bfloat16"
    return DTYPES[args.exp_avg_dtype], DTYPES[args.exp_avg_sq_dtype]


def _check_precision_aware(args) -> None:
    """Megatron-LM's rules for the low-precision state flags, and what is not built here."""
    lowered = [f"--{n.replace('_', '-')} {getattr(args, n)}" for n in ("exp_avg_dtype", "exp_avg_sq_dtype",
                                                                        "main_grads_dtype", "main_params_dtype")
               if getattr(args, n) != "fp32"]
    if lowered and not args.use_precision_aware_optimizer:  # megatron-core's OptimizerConfig check
        raise MindSpeedError(f"{lowered[0]} sets a dtype of the precision-aware optimizer: add "
                             "--use-precision-aware-optimizer (without it every optimizer state is fp32)")
    for name in ("main_grads_dtype", "main_params_dtype"):
        if getattr(args, name) != "fp32":
            raise MindSpeedError(f"--{name.replace('_', '-')} {getattr(args, name)} is not built here: the optimizer "
                                 "reads fp32 gradients into fp32 master weights (low-precision moments: "
                                 "--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16)")
    for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        if getattr(args, name) in ("fp16", "fp8"):
            raise MindSpeedError(f"--{name.replace('_', '-')} {getattr(args, name)} is not built here: the moments "
                                 "are stored in fp32 or bf16 (an fp16 second moment underflows without a scale)")
    if args.use_precision_aware_optimizer and args.o2_optimizer:
        raise MindSpeedError("--o2-optimizer and --use-precision-aware-optimizer both set the moments' dtype: use "
                             "one (--o2-optimizer is --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16)")
    if args.fp16 and "bf16" in (args.exp_avg_dtype, args.exp_avg_sq_dtype):
        raise MindSpeedError("bf16 optimizer states with --fp16 are not defined here (as MindSpeed-LLM's O2, bf16 "
                             "states go with --bf16 training): keep them fp32 or train with --bf16")


def _check_muon(args, cfg: ModelConfig, tp: int) -> None:
    """What --optimizer muon does not run with yet, and its settings' values."""
    if args.optimizer not in ("muon", "dist_muon"):
        given = [name for name in MUON_DEFAULTS if getattr(args, name, None) is not None]
        if given:  # a setting of an optimizer that does not run: refused, not ignored
            flag = {"muon_split_qkv": "--muon-no-split-qkv"}.get(given[0], "--" + given[0].replace("_", "-"))
            raise MindSpeedError(f"{flag} qualifies --optimizer muon, and this run uses AdamW: add --optimizer muon "
                                 f"or drop {flag}")
        return
    if _muon(args, "muon_coefficient_type") not in MUON_COEFFICIENTS:
        raise MindSpeedError(f"--muon-coefficient-type {args.muon_coefficient_type!r} is not built here: choose "
                             f"{' or '.join(MUON_COEFFICIENTS)}")
    if _muon(args, "muon_scalar_optimizer") != "adam":
        raise MindSpeedError("--muon-scalar-optimizer lion is not built here: the parameters Muon leaves train with "
                             "AdamW (--muon-scalar-optimizer adam)")
    if args.fp16:
        raise MindSpeedError("fp16 (--fp16) is not defined with --optimizer muon (as in megatron-core and "
                             "MindSpeed-LLM): use --bf16")
    layerwise = args.optimizer == "dist_muon" or args.use_distributed_optimizer
    for flag, on in (("--swap-optimizer", args.swap_optimizer), ("--reuse-fp32-param", args.reuse_fp32_param),
                     ("--overlap-param-gather", args.overlap_param_gather), ("--save-whole", args.save_whole)):
        if on and layerwise:
            raise MindSpeedError(f"{flag} with Muon's layer-wise distributed optimizer is not built here (its state is "
                                 f"whole parameters on their owners): drop {flag}")
    if tp > 1 and _muon(args, "muon_tp_mode") == "blockwise" and cfg.mla is None and cfg.num_query_groups < tp:
        raise MindSpeedError(f"--muon-tp-mode blockwise splits each TP shard's q/k/v rows by its own query groups, and "
                             f"{cfg.num_query_groups} query groups over TP {tp} leave a shard a slice of one: use "
                             f"--muon-tp-mode duplicated")


QK_CLIP_DEFAULTS = {"qk_clip_threshold": 100.0, "qk_clip_alpha": 0.5}  # megatron-core's


def qk_clip_options(args) -> tuple | None:
    if args.qk_clip:
        return tuple(QK_CLIP_DEFAULTS[n] if getattr(args, n) is None else getattr(args, n)
                     for n in ("qk_clip_threshold", "qk_clip_alpha"))
    return (None, None) if args.log_max_attention_logit else None


def _check_qk_clip(args, cfg: ModelConfig) -> None:
    """--qk-clip's values, and what it does not run with."""
    flag = "--qk-clip" if args.qk_clip else "--log-max-attention-logit"
    if not args.qk_clip:
        given = [n for n in QK_CLIP_DEFAULTS if getattr(args, n) is not None]
        if given:
            raise MindSpeedError(f"--{given[0].replace('_', '-')} qualifies --qk-clip: add --qk-clip or drop it")
        if not args.log_max_attention_logit:
            return
    if cfg.mla is not None or all(cfg.is_linear_layer(n) for n in range(cfg.num_layers)):
        raise MindSpeedError(f"{flag} needs softmax attention with a fused q/k/v weight, and this model has "
                             f"{'latent attention (MLA)' if cfg.mla is not None else 'linear attention only'}: its "
                             "logits are not clipped here; drop the flag")
    if cfg.qk_layernorm:
        raise MindSpeedError(f"{flag} scales the query and key weights, and --qk-layernorm normalises their outputs "
                             "again (the logits would not shrink): drop one of them")
    windowed = any(cfg.window_of(n) is not None for n in range(cfg.num_layers))
    for name, on in (("--use-distributed-optimizer", args.use_distributed_optimizer),
                     ("--optimizer dist_muon", args.optimizer == "dist_muon"), ("--compile", args.compile),
                     ("--context-parallel-size", args.context_parallel_size > 1),
                     ("--tensor-model-parallel-size", args.tensor_model_parallel_size > 1),
                     ("--reset-attention-mask", args.reset_attention_mask),
                     ("a sliding attention window", windowed)):
        if on:
            raise MindSpeedError(f"{flag} with {name} is not built here (the logits are measured over each whole "
                                 f"causal sequence, the weights scaled whole on a rank): drop one of them")


def _check_dualpipev(args, cfg: ModelConfig) -> None:
    """What DualPipeV does not run with, as MindSpeed's dualpipev rules (its layout's own rules:
    parallel/pipeline.py)."""
    flag = "--schedules-method dualpipev"
    if cfg.tied_output:  # the first rank would hold both copies of the tied embeddings
        raise MindSpeedError(f"{flag} puts the embedding and the output layer on the first rank and needs them "
                             f"untied (as MindSpeed): add --untie-embeddings-and-output-weights")
    if args.context_parallel_size > 1:
        raise MindSpeedError(f"{flag} does not run with context parallelism (as MindSpeed): drop "
                             f"--context-parallel-size or use the 1F1B schedule")
    for name, on in (("--overlap-grad-reduce", args.overlap_grad_reduce), ("--compile", args.compile)):
        if on:
            raise MindSpeedError(f"{flag} does not run with {name} here: drop {name} or the schedule")


def check_save_folder(args, default: bool = False) -> None:
    """--save must be writable, and must not silently take over another run's checkpoints;
    ``default``: it is the embedded run's default folder (the same guard, its own words)."""
    what = f"the default save folder {args.save}" if default else f"--save {args.save}"
    files.check_writable(args.save, what)
    latest = checkpoint.holds_checkpoints(args.save)
    same = any(src and os.path.realpath(src) == os.path.realpath(args.save) for src in (args.load, args.lora_load))
    if latest is not None and not same and not args.overwrite_checkpoints:
        held = f"up to iteration {latest}" if latest >= 0 else "iteration folders"
        if default:  # resuming it needs --save too: with --load alone a run saves nothing
            raise MindSpeedError(f"{what} already holds another run's checkpoints ({held}): add "
                                 f"--overwrite-checkpoints to replace them, give --save another folder, or "
                                 f"--load {args.save} --save {args.save} to resume that run")
        raise MindSpeedError(f"{what} already holds another run's checkpoints ({held}): pass "
                             f"--load {args.save} to resume that run, choose a new --save folder, or add "
                             f"--overwrite-checkpoints to replace them")


def memory_needed(cfg: ModelConfig, tp: int) -> int:
    """Bytes one rank needs at least: the full fp32 model (built on every rank, then cut),
    plus gradients and AdamW moments for its tensor-parallel shard."""
    params = cfg.num_parameters()
    return 4 * params + 12 * params // tp


def operations(a) -> Operations:
    return Operations(bool(a.use_deterministic_algorithms or a.use_deterministic_comm), boards.settings(a),
                      profiling.settings(a))


def alignment_settings(a, reward_token_ids=None) -> dict | None:
    """What the preference or reward stage's loss takes (training/alignment.py)."""
    stage = stage_of(a)
    if stage == "dpo":
        return {"loss_type": a.dpo_loss_type, "beta": a.dpo_beta, "label_smoothing": a.dpo_label_smoothing,
                "reference": "the starting model's log-likelihoods, computed before the first step"}
    if stage == "simpo":
        return {"beta": a.simpo_beta, "gamma": a.simpo_gamma, "label_smoothing": a.simpo_label_smoothing}
    if stage == "prm":
        return {"reward_tokens": a.reward_tokens, "reward_token_ids": reward_token_ids}
    if stage == "orm":
        return {"head": "rm_head [1, hidden], read at each reply's last token"}
    if stage == "grpo":
        return {"num_generations": a.num_generations, "max_completion_length": a.max_completion_length,
                "reward_funcs": a.reward_funcs, "reward_model": a.reward_model,
                "reward_weights": a.reward_weights or [1.0] * (len(a.reward_funcs) + bool(a.reward_model)),
                "scale_rewards": a.scale_rewards, "loss_type": a.grpo_loss_type, "kl_coef": a.kl_coef,
                "kl_bias_correction": a.use_bias_correction_kl,
                "clip_ratio": [a.clip_ratio, a.clip_ratio if a.clip_ratio_high is None else a.clip_ratio_high],
                "ppo_epochs": a.ppo_epochs, "sampling": {"temperature": a.temperature, "top_k": a.top_k,
                                                         "top_p": a.top_p},
                "reference": "the starting weights, kept on the host" if a.kl_coef else None}
    return None


# what a run does besides training, shown by --dry-run with the rest of the configuration
_RUN_SETTINGS = ("split", "save", "save_interval", "load", "load_hf", "overwrite_checkpoints", "eval_interval",
                 "eval_iters", "log_interval", "exit_interval", "metrics_file", "sample_tokens", "ckpt_format",
                 "exit_on_missing_checkpoint", "no_load_optim", "no_load_rng", "no_save_optim", "no_save_rng",
                 "manual_gc", "manual_gc_interval", "exit_signal_handler")


def kernels(cfg: ModelConfig) -> dict:
    """What runs for each fused operator: the device's native kernel, the composite standing
    in for a fused op the device lacks, or the composite because its flag is off."""
    bound = ops.implementations()
    names = {"attention": "attention", "rms_norm": "rms_norm", "swiglu": "swiglu", "rope": "apply_rotary",
             "grouped_matmul": "grouped_matmul", "matmul_add": "matmul_add"}
    return {op: (bound[names[op]] if op in cfg.fused else "composite (flag off)") for op in names}


def describe(config: RunConfig, data_path, pipeline_layout, grad_accum: int, loss_scale: float,
         reward_token_ids=None) -> dict:
    """Everything the run will do, as `mindspeed train --dry-run` prints it."""
    flags, cfg, tokenizer, lay = config.flags, config.model, config.tokenizer, config.layout
    return {
        "framework": runtime.bound().NAME, "device": device.current(),
        "model": cfg.to_dict(), "kernels": kernels(cfg), "parameters": cfg.num_parameters(),
        "rms_norm_weight": ("times the normed input in float32, cast after" if cfg.norm_weight_float32 or cfg.norm_offset
                            else "times the normed input cast to the model's dtype"),
        "router_logits": (None if cfg.moe is None else "a float32 linear (--router-gating-in-fp32)"
                          if cfg.router_float32 else "a linear in the model's dtype, cast to float32"),
        "flops_per_token": cfg.flops_per_token(flags.seq_length),
        "tokenizer": {"type": tokenizer.name, "end_of_document": tokenizer.eod,
                      "end_of_document_from": tokenizer.eod_source, "bos": tokenizer.bos,
                      "encodes_special_tokens": getattr(tokenizer, "include_special_tokens", None)},
        "data_path": data_path, "stage": config.stage.name, "alignment": alignment_settings(flags, reward_token_ids),
        "seq_length": flags.seq_length, "micro_batch_size": flags.micro_batch_size,
        "micro_batch_width": ("--seq-length" if config.data.pad_multiple is None else
                              f"the longest sample's, rounded up to a multiple of {config.data.pad_multiple}"),
        "sample_order": "seeded shuffle per epoch" if config.data.shuffle else "file order (--no-shuffle)",
        "global_batch_size": flags.global_batch_size, "gradient_accumulation": grad_accum,
        "train_iters": flags.train_iters, "lr": flags.lr, "min_lr": flags.min_lr,
        "lr_warmup_iters": flags.lr_warmup_iters, "lr_decay_style": flags.lr_decay_style,
        "lr_decay_iters": flags.lr_decay_iters,
        "weight_decay": flags.weight_decay, "clip_grad": flags.clip_grad, "seed": flags.seed,
        "adam": {"beta1": flags.adam_beta1, "beta2": flags.adam_beta2, "eps": flags.adam_eps},
        "optimizer": "adamw" if config.optimization.muon is None else {
            "muon": dataclasses.asdict(config.optimization.muon), "the rest": "adamw"},
        "optimizer_states": {"exp_avg": config.optimization.moment_dtypes[0],
                             "exp_avg_sq": config.optimization.moment_dtypes[1]},
        "max_attention_logit": None if config.optimization.qk_clip is None else {
            "logged": True, "clip_threshold": config.optimization.qk_clip[0],
            "clip_alpha": config.optimization.qk_clip[1]},
        "precision": config.optimization.precision, "loss_scale": loss_scale if flags.fp16 else None,
        "compile": bool(flags.compile),
        "loss_chunk": config.optimization.loss_chunk,  # --loss-compute-mode chunk's positions per chunk
        "checkpoints": {"format": "whole (gathered on rank 0)" if flags.save_whole else "sharded (each rank its pieces)"
                        + (", with Megatron's torch_dist files of the model" if flags.ckpt_format == "torch_dist"
                           else ""),
                        "asynchronous": bool(flags.async_save)},
        "recompute_activation_function": (None if not flags.recompute_activation_function else
                                          "in every layer full recompute leaves alone"
                                          if flags.recompute_activation_function_num_layers is None else
                                          f"in the first {flags.recompute_activation_function_num_layers} layers of "
                                          "each chunk that full recompute leaves alone"),
        "parallel": {"tp": lay.tp, "dp": lay.dp, "pp": lay.pp, "cp": lay.cp,
                     "context_parallel_algo": flags.context_parallel_algo if lay.cp > 1 else None,
                     "ulysses_degree": (context.ulysses_degree(lay.cp, flags.context_parallel_algo,
                                                               flags.ulysses_degree_in_cp)
                                        if lay.cp > 1 else None),
                     "sequence_parallel": bool(flags.sequence_parallel),
                     "distributed_optimizer": bool(flags.use_distributed_optimizer),
                     "gradient_bucket_elements": flags.ddp_bucket_size or BUCKET_ELEMENTS,
                     "overlap_grad_reduce": bool(flags.overlap_grad_reduce),
                     "overlap_param_gather": bool(flags.overlap_param_gather),
                     "model_chunks_per_pipeline_rank": pipeline_layout.chunks,
                     "layers_per_virtual_stage": pipeline_layout.describe()},
        "packed_sequences": {"reset_attention_mask": bool(flags.reset_attention_mask),
                             "reset_position_ids": bool(flags.reset_position_ids)},
        "run": {key: getattr(flags, key) for key in _RUN_SETTINGS} | {"progress": not flags.no_progress},
        "operations": config.operations.as_dict(),
    }
