"""Megatron-LM / MindSpeed-LLM command-line flags, with their usual spellings and defaults.

Only the flags that select a feature of the matrix (mindspeed_core.features) live here for
now; the trainer's own flags (sizes, batch, schedule, data) join them with the trainer.
Every feature flag is parsed even when the feature is not built yet, so that asking for it
gets the matrix's explanation instead of argparse's "unrecognized arguments".
"""

from __future__ import annotations

import argparse
import math

from mindspeed_core.errors import MindSpeedError
from mindspeed_core.models.config import LORA_TARGETS

CONTEXT_PARALLEL_ALGOS = ("megatron_cp_algo", "ulysses_cp_algo", "hybrid_cp_algo")
GENERATION_TASKS = ("greedy", "do_sample", "beam_search", "chat")
EVALUATION_TASKS = ("mmlu", "ceval", "gsm8k", "boolq", "perplexity")
STAGES = ("sft", "dpo", "simpo", "orm", "rm", "prm")  # rm: the outcome reward model (orm)
DATA_HANDLERS = (
    "GeneralPretrainHandler", "AlpacaStyleInstructionHandler", "SharegptStyleInstructionHandler",
    "AlpacaStylePairwiseHandler", "SharegptStylePairwiseHandler", "AlpacaStyleProcessRewardHandler",
)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line (raised as MindSpeedError, printed by the CLI with
    exit status 2) instead of the usage block followed by the message."""

    def error(self, message):
        raise MindSpeedError(message)


def _number(kind, low=None, high=None, low_open=False, high_open=False, what=""):
    """An argparse type: a finite ``kind`` within [low, high] (ends open where asked)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        if (low is not None and (value <= low if low_open else value < low)) or \
                (high is not None and (value >= high if high_open else value > high)):
            raise argparse.ArgumentTypeError(f"{text} is out of range: must be {what}")
        return value
    return parse


POSITIVE_INT = _number(int, 1, what="a positive integer")
FINITE = _number(float)
COUNT = _number(int, 0, what="zero or a positive integer")
POSITIVE = _number(float, 0, low_open=True, what="positive")
NON_NEGATIVE = _number(float, 0, what="zero or positive")
PROBABILITY = _number(float, 0, 1, high_open=True, what="in [0, 1)")
SMOOTHING = _number(float, 0, 0.5, high_open=True, what="in [0, 0.5)")
UNIT = _number(float, 0, 1, low_open=True, what="in (0, 1]")
# every seed derived from it (data order, tracker streams) stays valid for both frameworks
SEED = _number(int, 0, 2**32 - 1 - 100_000, what="in [0, 4294867295]")
PORT = _number(int, 1, 65535, what="a TCP port (1-65535)")
PROFILE_RANK = _number(int, -1, what="a rank (or -1: every rank)")


def add_framework_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("framework")
    group.add_argument("--ai-framework", choices=("pytorch", "mindspore"), default=None,
                       help="framework to run on (default: $MINDSPEED_AI_FRAMEWORK, else pytorch)")
    group.add_argument("--device", default=None, help="auto (default), cpu, cuda/gpu or npu/ascend")


def add_feature_args(parser: argparse.ArgumentParser) -> None:
    """The flags the feature matrix gates, Megatron/MindSpeed spelling."""
    p = parser.add_argument_group("parallelism")
    p.add_argument("--tensor-model-parallel-size", type=POSITIVE_INT, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=POSITIVE_INT, default=1)
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=POSITIVE_INT, default=None)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--noop-layers", type=str, default=None,
                   help="comma-separated layer numbers (from 0) that hold an identity layer, to balance pipeline stages")
    p.add_argument("--num-layer-list", type=str, default=None,
                   help="comma-separated layer counts, one per pipeline stage (uneven split)")
    p.add_argument("--context-parallel-size", type=POSITIVE_INT, default=1)
    p.add_argument("--context-parallel-algo", choices=CONTEXT_PARALLEL_ALGOS, default="megatron_cp_algo")
    p.add_argument("--ulysses-degree-in-cp", type=POSITIVE_INT, default=None,
                   help="hybrid_cp_algo: CP ranks per Ulysses group (the ring runs across the groups)")
    p.add_argument("--cp-attention-mask-type", choices=("causal", "general"), default="causal",
                   help="accepted for MindSpeed-LLM scripts: every CP mask is built here from each token's column "
                        "and document (packed sequences), so both values mean the same")
    p.add_argument("--expert-model-parallel-size", type=POSITIVE_INT, default=1)
    p.add_argument("--moe-token-dispatcher-type", choices=("allgather", "alltoall"), default="allgather")
    e = parser.add_argument_group("mixture of experts (models/router.py, models/moe.py)")
    e.add_argument("--num-experts", type=POSITIVE_INT, default=None)
    e.add_argument("--moe-router-topk", type=POSITIVE_INT, default=2)
    e.add_argument("--moe-ffn-hidden-size", type=POSITIVE_INT, default=None, help="each expert's; default --ffn-hidden-size")
    e.add_argument("--moe-shared-expert-intermediate-size", type=POSITIVE_INT, default=None)
    e.add_argument("--shared-expert-gate", action="store_true", help="scale the shared expert by sigmoid(x . gate)")
    e.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid"), default="softmax")
    e.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="the top-k weights are the softmax over all experts, not renormalised over the k")
    e.add_argument("--moe-router-topk-scaling-factor", type=POSITIVE, default=None)
    e.add_argument("--moe-router-num-groups", type=POSITIVE_INT, default=None)
    e.add_argument("--moe-router-group-topk", type=POSITIVE_INT, default=None)
    e.add_argument("--moe-router-load-balancing-type", choices=("aux_loss", "seq_aux_loss", "none"),
                   default="aux_loss")
    e.add_argument("--moe-aux-loss-coeff", type=NON_NEGATIVE, default=0.0)
    e.add_argument("--moe-z-loss-coeff", type=NON_NEGATIVE, default=None)
    e.add_argument("--moe-router-enable-expert-bias", action="store_true")
    e.add_argument("--moe-router-bias-update-rate", type=POSITIVE, default=1e-3)
    e.add_argument("--moe-expert-capacity-factor", type=POSITIVE, default=None)
    e.add_argument("--moe-pad-expert-input-to-capacity", action="store_true")
    e.add_argument("--moe-token-drop-policy", choices=("probs", "position"), default="probs")
    e.add_argument("--moe-layer-freq", type=POSITIVE_INT, default=1, help="every N-th layer (from 0) is an MoE layer")
    e.add_argument("--first-k-dense-replace", type=COUNT, default=0, help="the first k layers keep a dense MLP")

    m = parser.add_argument_group("memory and optimizer")
    m.add_argument("--use-distributed-optimizer", action="store_true")
    m.add_argument("--reuse-fp32-param", action="store_true")
    m.add_argument("--swap-attention", action="store_true")
    m.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    m.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    m.add_argument("--recompute-num-layers", type=POSITIVE_INT, default=None)
    m.add_argument("--recompute-activations", action="store_true",
                   help="Megatron's shorthand for --recompute-granularity selective")
    m.add_argument("--recompute-norm", action="store_true")
    m.add_argument("--recompute-in-advance", action="store_true")
    m.add_argument("--o2-optimizer", action="store_true")
    m.add_argument("--bf16", action="store_true")
    m.add_argument("--fp16", action="store_true")
    m.add_argument("--initial-loss-scale", type=POSITIVE, default=None,
                   help="--fp16: the dynamic loss scale to start from (default 65536)")

    f = parser.add_argument_group("fused operators")
    f.add_argument("--use-flash-attn", action="store_true")
    f.add_argument("--reset-attention-mask", action="store_true",
                   help="packed sequences: attention stays inside each document (documents end at EOD)")
    f.add_argument("--reset-position-ids", action="store_true",
                   help="packed sequences: position ids restart at 0 after each EOD")
    f.add_argument("--use-fused-rmsnorm", action="store_true")
    f.add_argument("--use-fused-swiglu", action="store_true")
    f.add_argument("--use-fused-rotary-pos-emb", action="store_true")
    f.add_argument("--moe-grouped-gemm", action="store_true")
    f.add_argument("--gemm-gradient-accumulation-fusion", action="store_true")

    f.add_argument("--compile", action="store_true",
                   help="compile the loss and its gradient (torch.compile / mindspore.jit); the first step pays "
                        "the compilation")

    c = parser.add_argument_group("communication")
    c.add_argument("--overlap-grad-reduce", action="store_true")
    c.add_argument("--overlap-param-gather", action="store_true")
    c.add_argument("--use-ascend-mc2", action="store_true")
    c.add_argument("--use-ascend-coc", action="store_true")
    c.add_argument("--disable-gloo-group", action="store_true")

    o = parser.add_argument_group("operations, inference and tools")
    # profiling (training/profiling.py): MindSpeed's flags and defaults
    o.add_argument("--profile", action="store_true", help="record a window of training steps with the framework's profiler")
    o.add_argument("--profile-step-start", type=COUNT, default=10,
                   help="the first profiled step, counted from 0 (Megatron's count)")
    o.add_argument("--profile-step-end", type=POSITIVE_INT, default=12, help="the step the window ends before")
    o.add_argument("--profile-ranks", type=PROFILE_RANK, nargs="+", default=[-1], help="global ranks to profile (-1: all)")
    o.add_argument("--profile-level", choices=("level0", "level1", "level2"), default="level0",
                   help="how much the Ascend profiler collects (torch_npu's and MindSpore's profiler_level)")
    o.add_argument("--profile-with-cpu", action="store_true",
                   help="host-side activity too (on the CPU device it is what is recorded anyway)")
    o.add_argument("--profile-with-stack", action="store_true", help="the Python stack of each operator")
    o.add_argument("--profile-with-memory", action="store_true", help="memory allocated and freed by each operator")
    o.add_argument("--profile-record-shapes", action="store_true", help="the input shapes of each operator")
    o.add_argument("--profile-save-path", default="./profile_dir", help="where each profiled rank writes its trace")
    o.add_argument("--use-deterministic-algorithms", action="store_true",
                   help="deterministic kernels and collectives: the same seed gives the same losses, bit for bit")
    o.add_argument("--use-deterministic-comm", action="store_true",
                   help="MindSpeed's spelling of --use-deterministic-algorithms (the collectives' part is included)")
    # the boards (training/boards.py): Megatron's TensorBoard flags, Weights & Biases offline
    o.add_argument("--tensorboard-dir", default=None, help="write TensorBoard event files here (rank 0)")
    o.add_argument("--tensorboard-log-interval", type=POSITIVE_INT, default=1,
                   help="the step figures (loss, lr, grad norm, loss scale, batch size) every N steps")
    o.add_argument("--tensorboard-queue-size", type=POSITIVE_INT, default=1000,
                   help="events held before they are written to the file")
    o.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="each report's mean seconds per step of forward-backward, optimizer and the whole step")
    o.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="rank 0's memory at each report (host RSS and peak; device allocator figures)")
    o.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    o.add_argument("--wandb-project", default=None, help="log the same figures to Weights & Biases (offline)")
    o.add_argument("--wandb-exp-name", default=None, help="the run's name in Weights & Biases")
    o.add_argument("--wandb-save-dir", default=None, help="where the offline run is kept (default: <save>/wandb)")
    o.add_argument("--stream", action="store_true")
    o.add_argument("--task", choices=GENERATION_TASKS + EVALUATION_TASKS, default=None,
                   help="mindspeed generate: " + ", ".join(GENERATION_TASKS) + "; mindspeed evaluate: "
                   + ", ".join(EVALUATION_TASKS))
    o.add_argument("--rope-scaling-type", choices=("linear", "llama3", "yarn", "dynamic"), default=None)
    o.add_argument("--handler-name", choices=DATA_HANDLERS, default=None)

    a = parser.add_argument_group("fine-tuning and alignment")
    a.add_argument("--stage", choices=STAGES, default=None,
                   help="sft: instruction fine-tuning; dpo, simpo: preference alignment on pairwise data; orm (or rm): "
                        "a pairwise outcome reward model; prm: a process reward model (the default is pre-training)")
    a.add_argument("--is-instruction-dataset", action="store_true",
                   help="--data-path is instruction data (MindSpeed-LLM's spelling; --stage sft implies it)")
    # preference alignment and reward models (training/alignment.py)
    a.add_argument("--dpo-loss-type", choices=("sigmoid", "hinge", "ipo"), default="sigmoid")
    a.add_argument("--dpo-beta", type=POSITIVE, default=0.1, help="DPO's inverse temperature beta")
    a.add_argument("--dpo-label-smoothing", type=SMOOTHING, default=0.0,
                   help="the assumed share of flipped preference labels (conservative DPO; sigmoid loss)")
    a.add_argument("--simpo-beta", type=POSITIVE, default=2.5, help="SimPO's reward scale beta")
    a.add_argument("--simpo-gamma", type=NON_NEGATIVE, default=1.0, help="SimPO's target reward margin gamma")
    a.add_argument("--simpo-label-smoothing", type=SMOOTHING, default=0.0)
    a.add_argument("--reward-tokens", nargs="+", default=None,
                   help="--stage prm: the step labels of the data, one token each (as given to mindspeed preprocess)")
    # LoRA (models/lora.py): on when a rank or target modules are given
    a.add_argument("--lora-r", type=POSITIVE_INT, default=None, help="LoRA rank (default 16 when targets are given)")
    a.add_argument("--lora-alpha", type=POSITIVE, default=None, help="LoRA scaling numerator (default 32)")
    a.add_argument("--lora-dropout", type=PROBABILITY, default=0.0)
    a.add_argument("--lora-target-modules", nargs="+", choices=LORA_TARGETS, default=None,
                   help="the linear layers that get adapters (default: all four)")
    a.add_argument("--lora-load", default=None,
                   help="resume the adapters, optimizer and iteration from this checkpoint folder; the base "
                        "weights come from --load or --load-hf")
    o.add_argument("--load-model-type", choices=("hf", "mg"), default=None)
    o.add_argument("--save-model-type", choices=("hf", "mg"), default=None)


def feature_parser(prog: str = "mindspeed") -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=prog, allow_abbrev=False)
    add_framework_args(parser)
    add_feature_args(parser)
    return parser


def add_training_args(parser: argparse.ArgumentParser) -> None:
    """The trainer's flags, Megatron spelling and defaults where they exist."""
    m = parser.add_argument_group("model")
    m.add_argument("--model-name", default=None, help="a preset (see models/config.py PRESETS)")
    m.add_argument("--load-hf", default=None, help="initialise from a Hugging Face model folder")
    m.add_argument("--num-layers", type=POSITIVE_INT, default=None)
    m.add_argument("--hidden-size", type=POSITIVE_INT, default=None)
    m.add_argument("--ffn-hidden-size", type=POSITIVE_INT, default=None)
    m.add_argument("--num-attention-heads", type=POSITIVE_INT, default=None)
    m.add_argument("--group-query-attention", action="store_true")
    m.add_argument("--num-query-groups", type=POSITIVE_INT, default=None)
    m.add_argument("--kv-channels", type=POSITIVE_INT, default=None)
    m.add_argument("--max-position-embeddings", type=POSITIVE_INT, default=None)
    m.add_argument("--normalization", choices=("RMSNorm", "LayerNorm"), default=None)
    m.add_argument("--norm-epsilon", type=POSITIVE, default=None)
    m.add_argument("--swiglu", action="store_true", default=None)
    m.add_argument("--position-embedding-type", choices=("rope", "learned_absolute"), default=None)
    m.add_argument("--rotary-base", type=POSITIVE, default=None)
    # RoPE scaling (with --rope-scaling-type), MindSpeed-LLM's spellings: llama3 takes the low /
    # high frequency factors and --original-max-position-embeddings, yarn the betas, mscales and
    # --rope-scaling-original-max-position-embeddings
    m.add_argument("--rope-scaling-factor", type=POSITIVE, default=None)
    m.add_argument("--low-freq-factor", type=POSITIVE, default=None)
    m.add_argument("--high-freq-factor", type=POSITIVE, default=None)
    m.add_argument("--original-max-position-embeddings", type=POSITIVE_INT, default=None)
    m.add_argument("--rope-scaling-original-max-position-embeddings", type=POSITIVE_INT, default=None)
    m.add_argument("--beta-fast", "--rope-scaling-beta-fast", dest="beta_fast", type=POSITIVE, default=None)
    m.add_argument("--beta-slow", "--rope-scaling-beta-slow", dest="beta_slow", type=POSITIVE, default=None)
    m.add_argument("--rope-scaling-mscale", type=NON_NEGATIVE, default=None)
    m.add_argument("--rope-scaling-mscale-all-dim", type=NON_NEGATIVE, default=None)
    m.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None)
    m.add_argument("--add-qkv-bias", action="store_true", default=None)
    m.add_argument("--qk-layernorm", action="store_true", default=None)
    m.add_argument("--init-method-std", type=NON_NEGATIVE, default=None)
    m.add_argument("--attention-dropout", type=PROBABILITY, default=None)
    m.add_argument("--hidden-dropout", type=PROBABILITY, default=None)
    m.add_argument("--make-vocab-size-divisible-by", type=POSITIVE_INT, default=128)

    t = parser.add_argument_group("training")
    t.add_argument("--seq-length", type=POSITIVE_INT, default=None)
    t.add_argument("--micro-batch-size", type=POSITIVE_INT, default=None)
    t.add_argument("--global-batch-size", type=POSITIVE_INT, default=None)
    t.add_argument("--train-iters", type=POSITIVE_INT, default=None)
    t.add_argument("--lr", type=NON_NEGATIVE, default=None)
    t.add_argument("--min-lr", type=NON_NEGATIVE, default=0.0)
    t.add_argument("--lr-warmup-iters", type=COUNT, default=0)
    t.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="cosine")
    t.add_argument("--lr-decay-iters", type=POSITIVE_INT, default=None)
    t.add_argument("--weight-decay", type=NON_NEGATIVE, default=0.01)
    t.add_argument("--adam-beta1", type=PROBABILITY, default=0.9)
    t.add_argument("--adam-beta2", type=PROBABILITY, default=0.999)
    t.add_argument("--adam-eps", type=POSITIVE, default=1e-8)
    t.add_argument("--clip-grad", type=NON_NEGATIVE, default=1.0)
    t.add_argument("--seed", type=SEED, default=1234)

    d = parser.add_argument_group("data")
    d.add_argument("--data-path", nargs="+", default=None, help="prefix, or weight/prefix pairs")
    d.add_argument("--split", default="969,30,1")
    add_tokenizer_args(d)

    c = parser.add_argument_group("checkpoints and logging")
    c.add_argument("--save", default=None)
    c.add_argument("--save-interval", type=POSITIVE_INT, default=None)
    c.add_argument("--load", default=None)
    c.add_argument("--finetune", action="store_true",
                   help="with --load: take the checkpoint's weights only and start at iteration 0 with a fresh "
                        "optimizer (fine-tuning a pre-trained model)")
    c.add_argument("--overwrite-checkpoints", action="store_true",
                   help="let --save replace the checkpoints of another run in that folder")
    # None: the trainer fills Megatron's defaults (eval every 1000 steps over 100 batches, a log
    # line every 100), or the embedded run's own
    c.add_argument("--eval-interval", type=POSITIVE_INT, default=None)
    c.add_argument("--eval-iters", type=COUNT, default=None)
    c.add_argument("--log-interval", type=POSITIVE_INT, default=None)
    c.add_argument("--exit-interval", type=POSITIVE_INT, default=None, help="stop (after saving) at a multiple of this iteration")
    c.add_argument("--metrics-file", default=None, help="JSONL metrics (default: <save>/metrics.jsonl)")
    c.add_argument("--sample-tokens", type=COUNT, default=None, help="tokens of text to sample at the end")
    c.add_argument("--dry-run", action="store_true", help="print the resolved configuration and exit")
    c.add_argument("--no-progress", action="store_true")


def add_tokenizer_args(group) -> None:
    """Megatron's tokenizer flags (shared by training and preprocessing)."""
    group.add_argument("--tokenizer-type", default=None,
                       help="ByteLevel, PretrainedFromHF (HuggingFaceTokenizer), GPT2BPETokenizer or NullTokenizer")
    group.add_argument("--tokenizer-name-or-path", "--tokenizer-model", default=None,
                       help="a Hugging Face tokenizer folder or tokenizer.json")
    # Megatron encodes with the tokenizer's post-processor (BOS and the like) unless told not to
    group.add_argument("--tokenizer-hf-no-include-special-tokens", dest="tokenizer_hf_include_special_tokens",
                       action="store_false", default=True,
                       help="encode text without the tokenizer's special tokens (no BOS before each document)")
    group.add_argument("--tokenizer-hf-include-special-tokens", dest="tokenizer_hf_include_special_tokens",
                       action="store_true", help="the default; Megatron-core 0.16's spelling of it")
    group.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    group.add_argument("--vocab-size", type=POSITIVE_INT, default=None,
                       help="NullTokenizer: ids 0..N-1 are tokens, N is end-of-document")


def training_parser(prog: str = "mindspeed train") -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=prog, allow_abbrev=False,
                            description="pre-train a GPT model (Megatron-style flags)")
    add_framework_args(parser)
    add_feature_args(parser)
    add_training_args(parser)
    return parser
