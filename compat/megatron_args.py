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
# MindSpeed-LLM's inference.py runs these in this order when --task is not given
GENERATION_TASKS = ("greedy", "do_sample", "beam_search", "beam_search_with_sampling", "chat")
EVALUATION_TASKS = ("mmlu", "ceval", "gsm8k", "boolq", "perplexity")
STAGES = ("sft", "dpo", "simpo", "orm", "rm", "prm", "grpo")  # rm: the outcome reward model (orm)
DATA_HANDLERS = (
    "GeneralPretrainHandler", "AlpacaStyleInstructionHandler", "SharegptStyleInstructionHandler",
    "AlpacaStylePairwiseHandler", "SharegptStylePairwiseHandler", "AlpacaStyleProcessRewardHandler",
    "PPOAlpacaStyleInstructionHandler",
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
LAYER_FREQ = _number(int, -1, what="a positive integer, or -1 (MindSpeed-LLM: every layer)")
DENSE_LAYERS = _number(int, -1, what="zero or a positive integer, or -1 (MindSpeed-LLM: none)")
FINITE = _number(float)
COUNT = _number(int, 0, what="zero or a positive integer")
POSITIVE = _number(float, 0, low_open=True, what="positive")
NON_NEGATIVE = _number(float, 0, what="zero or positive")
PROBABILITY = _number(float, 0, 1, high_open=True, what="in [0, 1)")
FRACTION = _number(float, 0, 1, low_open=True, high_open=True, what="strictly between 0 and 1")
SMOOTHING = _number(float, 0, 0.5, high_open=True, what="in [0, 0.5)")
UNIT = _number(float, 0, 1, low_open=True, what="in (0, 1]")
# every seed derived from it (data order, tracker streams) stays valid for both frameworks
SEED = _number(int, 0, 2**32 - 1 - 100_000, what="in [0, 4294867295]")
PORT = _number(int, 1, 65535, what="a TCP port (1-65535)")


def _causal_window(text: str) -> int:
    """megatron-core's --window-size "L,R" -> L + 1 keys a query sees (itself among them);
    causal attention has no keys after the query, so R must be 0 (or -1, none)."""
    parts = text.split(",")
    try:
        left, right = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two integers L,R, got {text!r}") from None
    if left < 1 or right not in (0, -1):
        raise argparse.ArgumentTypeError(f"expected L,0 with L a positive number of earlier keys (causal attention "
                                         f"has none after the query), got {text!r}")
    return left + 1


def TRISTATE(text: str):  # noqa: N802 - an argparse type, named like the others
    """MindSpeed-LLM's true / false / none switches."""
    try:
        return {"true": True, "false": False, "none": None}[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"{text!r} is not true, false or none") from None
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
    p.add_argument("--schedules-method", choices=("dualpipev",), default=None,
                   help="MindSpeed's DualPipeV schedule (refused: the matrix's dualpipe row)")
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
    # alltoall_seq: MindSpeed-LLM's alltoall for sequence-parallel token layouts; the same routing
    # and result as alltoall here (the dispatcher takes each rank's tokens as they are)
    p.add_argument("--moe-token-dispatcher-type", choices=("allgather", "alltoall", "alltoall_seq"),
                   default="allgather")
    p.add_argument("--expert-tensor-parallel-size", type=POSITIVE_INT, default=None,
                   help="tensor parallelism inside the experts (default: --tensor-model-parallel-size)")
    e = parser.add_argument_group("mixture of experts (models/router.py, models/moe.py)")
    e.add_argument("--num-experts", type=POSITIVE_INT, default=None)
    e.add_argument("--num-zero-experts", type=COUNT, default=None,
                   help="LongCat-Flash's zero-computation experts beside --num-experts: each returns its token times "
                        "its routing weight")
    e.add_argument("--moe-router-topk", type=POSITIVE_INT, default=2)
    e.add_argument("--moe-ffn-hidden-size", "--moe-intermediate-size", type=POSITIVE_INT, default=None,
                   help="each expert's; default --ffn-hidden-size")
    e.add_argument("--moe-shared-expert-intermediate-size", type=POSITIVE_INT, default=None)
    e.add_argument("--shared-expert-gate", action="store_true", help="scale the shared expert by sigmoid(x . gate)")
    e.add_argument("--router-gating-in-fp32", action="store_true",
                   help="the router's linear on float32 copies of its input and weight (under --bf16 / --fp16)")
    e.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid"), default="softmax")
    e.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="the top-k weights are the softmax over all experts, not renormalised over the k")
    e.add_argument("--moe-router-topk-scaling-factor", type=POSITIVE, default=None)
    e.add_argument("--moe-router-num-groups", type=POSITIVE_INT, default=None)
    e.add_argument("--moe-router-group-topk", type=POSITIVE_INT, default=None)
    # softmax_topk: MindSpeed-LLM's softmax over every expert, then the top k (no aux loss term)
    # pai_megatron_aux_loss: MindSpeed-LLM's (from PAI-Megatron) top-k of the softmax over every
    # expert, kept as they are, with the aux loss
    e.add_argument("--moe-router-load-balancing-type", choices=("aux_loss", "seq_aux_loss", "none", "softmax_topk",
                                                                "sparsemixer_topk", "pai_megatron_aux_loss"),
                   default="aux_loss")
    e.add_argument("--seq-aux", action="store_true",
                   help="MindSpeed-LLM's: the aux loss per sequence (as seq_aux_loss)")
    e.add_argument("--n-shared-experts", type=POSITIVE_INT, default=None,
                   help="MindSpeed-LLM's: a shared expert N times --moe-ffn-hidden-size wide (unless "
                        "--moe-shared-expert-intermediate-size gives its width)")
    e.add_argument("--moe-tp-extend-ep", action="store_true",
                   help="MindSpeed's experts over TP x EP ranks, whole on each (the EP groups reach across TP)")
    e.add_argument("--norm-topk-prob", action="store_true",
                   help="renormalise the top-k weights to sum to one (MindSpeed-LLM; with softmax_topk)")
    e.add_argument("--moe-aux-loss-coeff", type=NON_NEGATIVE, default=0.0)
    e.add_argument("--moe-input-jitter-eps", type=NON_NEGATIVE, default=None,
                   help="multiplicative noise on the router's input in training (refused: the matrix's "
                        "moe-input-jitter row)")
    e.add_argument("--moe-z-loss-coeff", type=NON_NEGATIVE, default=None)
    e.add_argument("--moe-router-enable-expert-bias", action="store_true")
    e.add_argument("--moe-router-bias-update-rate", type=POSITIVE, default=1e-3)
    e.add_argument("--moe-expert-capacity-factor", type=POSITIVE, default=None)
    e.add_argument("--moe-pad-expert-input-to-capacity", action="store_true")
    e.add_argument("--moe-token-drop-policy", choices=("probs", "position"), default="probs")
    e.add_argument("--moe-layer-freq", type=LAYER_FREQ, default=1,
                   help="every N-th layer (from 0) is an MoE layer (-1: every layer, as MindSpeed-LLM's scripts say)")
    e.add_argument("--first-k-dense-replace", type=DENSE_LAYERS, default=0,
                   help="the first k layers keep a dense MLP (-1: none)")

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
    m.add_argument("--o2-gradient", action="store_true", help="MindSpeed's O2: gradients kept in bf16")
    # Megatron-LM's low-precision optimizer states (its TransformerEngine precision-aware
    # optimizer): the moments stored in the dtype given, computed in fp32 (training/optimizer.py)
    m.add_argument("--use-precision-aware-optimizer", action="store_true",
                   help="store the optimizer's moments in --exp-avg-dtype / --exp-avg-sq-dtype")
    for flag, what in (("--exp-avg-dtype", "Adam's first moment (and Muon's momentum)"),
                       ("--exp-avg-sq-dtype", "Adam's second moment")):
        m.add_argument(flag, choices=("fp32", "fp16", "bf16", "fp8"), default="fp32",
                       help=f"the stored dtype of {what}, with --use-precision-aware-optimizer; fp32 or bf16 here")
    m.add_argument("--main-grads-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="the dtype of the gradients the optimizer reads: fp32 here (MindSpeed's --o2-gradient: bf16)")
    m.add_argument("--main-params-dtype", choices=("fp32", "fp16"), default="fp32",
                   help="the dtype of the master weights: fp32 here")
    m.add_argument("--init-norm-weight-in-fp32", action="store_true",
                   help="under --bf16 / --fp16 every norm's weight and bias kept in float32, the norm computed in "
                        "float32 and cast to the model's dtype after")
    m.add_argument("--input-layernorm-in-fp32", action="store_true",
                   help="MindSpeed-LLM's Hunyuan input norm output in fp32 (refused: the input-layernorm-fp32 row)")
    m.add_argument("--swap-optimizer", action="store_true", help="MindSpeed: optimizer states swapped to the host")
    m.add_argument("--swap-optimizer-times", type=POSITIVE_INT, default=None,
                   help="--swap-optimizer's pieces per update (default 16)")
    m.add_argument("--recompute-activation-function", action="store_true",
                   help="MindSpeed: recompute the MLP's activation function in backward (its output is not kept) in "
                        "the layers full recompute leaves alone")
    m.add_argument("--recompute-activation-function-num-layers", type=POSITIVE_INT, default=None,
                   help="--recompute-activation-function: in this many of those layers of each model chunk only")
    m.add_argument("--calculate-per-token-loss", action="store_true",
                   help="the step's loss as the mean over every loss token of the global batch (Megatron's), not "
                        "the mean of each micro-batch's mean")
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
    f.add_argument("--loss-compute-mode", choices=("default", "chunk"), default="default",
                   help="MindSpeed-LLM's cross entropy: default (the logits whole), or chunk (the output layer and "
                        "the loss --loss-chunk-size positions at a time, each chunk recomputed in backward: the same "
                        "loss with one chunk's logits in memory)")
    f.add_argument("--loss-chunk-size", type=POSITIVE_INT, default=None,
                   help="--loss-compute-mode chunk's positions per chunk (default 1024)")
    f.add_argument("--use-triton-gdn", action="store_true",
                   help="gated DeltaNet's fused (Triton) kernels on CUDA / Ascend")

    f.add_argument("--compile", action="store_true",
                   help="compile the loss and its gradient (torch.compile / mindspore.jit); the first step pays "
                        "the compilation")

    c = parser.add_argument_group("communication")
    c.add_argument("--overlap-grad-reduce", action="store_true",
                   help="reduce each bucket of gradients over data-parallel ranks as backward completes it, while "
                        "the rest of backward runs (the same results)")
    c.add_argument("--overlap-param-gather", action="store_true",
                   help="with --use-distributed-optimizer: gather the updated parameters while the step ends and "
                        "the next one prepares its data (the same results)")
    c.add_argument("--ddp-bucket-size", type=POSITIVE_INT, default=None,
                   help="elements per gradient bucket of the data-parallel reduction (default 4M)")
    c.add_argument("--use-ascend-mc2", action="store_true")
    c.add_argument("--use-ascend-coc", action="store_true")
    c.add_argument("--coc-fused-kernel", action="store_true", help="MindSpeed-LLM: CoC with fused kernels")
    c.add_argument("--use-cp-send-recv-overlap", action="store_true",
                   help="MindSpeed: overlap ring attention's send/receive with its compute")
    c.add_argument("--moe-zero-memory", choices=("disable", "level0", "level1"), default="disable",
                   help="MindSpeed: recompute the MoE dispatch in backward instead of keeping its activations "
                        "(level0: the dispatched rows and the activation; level1: all of the routed path)")
    c.add_argument("--moe-alltoall-overlap-comm", action="store_true",
                   help="MindSpeed: the alltoall dispatch in chunks of the local experts, each chunk's experts "
                        "computing while the next travels (the same results)")
    c.add_argument("--moe-fb-overlap", action="store_true",
                   help="MindSpeed: in the pipeline schedule's steady state, one micro-batch's forward runs beside "
                        "another's backward, each one's expert all-to-all travelling while the other computes "
                        "(the same results)")
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
    o.add_argument("--task", nargs="+", choices=GENERATION_TASKS + EVALUATION_TASKS, default=None,
                   help="mindspeed generate: one or more of " + ", ".join(GENERATION_TASKS) + " (run in the "
                   "order given; default: greedy with --prompt, all of them in this order without); mindspeed "
                   "evaluate: one of "
                   + ", ".join(EVALUATION_TASKS))
    o.add_argument("--rope-scaling-type", choices=("linear", "llama3", "yarn", "dynamic", "longrope", "plm"), default=None,
                   help="plm (MindSpeed-LLM's PLM): RoPE's own frequencies over the rotated features, no scaling")
    o.add_argument("--handler-name", choices=DATA_HANDLERS, default=None)

    a = parser.add_argument_group("fine-tuning and alignment")
    a.add_argument("--stage", choices=STAGES, default=None,
                   help="sft: instruction fine-tuning; dpo, simpo: preference alignment on pairwise data; orm (or rm): "
                        "a pairwise outcome reward model; prm: a process reward model; grpo: online reinforcement "
                        "learning with rollouts from the policy (the default is pre-training)")
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
    # online RL (training/grpo.py); the names as TRL's GRPOTrainer has them, where it has them
    a.add_argument("--num-generations", type=POSITIVE_INT, default=8,
                   help="--stage grpo: completions drawn per prompt (a group)")
    a.add_argument("--max-completion-length", type=POSITIVE_INT, default=256,
                   help="--stage grpo: the longest completion, in tokens")
    a.add_argument("--reward-funcs", nargs="*", default=["accuracy"],
                   help="--stage grpo: accuracy (the final answer, after #### or in \\boxed{}, equals the reference's), "
                        "format (<think>...</think> then an answer), or package.module:function, called as "
                        "function(completions, references, prompts) -> [float]")
    a.add_argument("--reward-model", default=None,
                   help="--stage grpo: an outcome reward model (a --stage orm checkpoint, or a Hugging Face "
                        "folder of one) that scores each completion too, after the --reward-funcs")
    a.add_argument("--reward-weights", nargs="+", type=FINITE, default=None,
                   help="--stage grpo: one weight per --reward-funcs entry, then one for --reward-model "
                        "(default: 1 each)")
    a.add_argument("--scale-rewards", choices=("group", "none"), default="group",
                   help="--stage grpo: divide advantages by their group's standard deviation, or not (Dr. GRPO)")
    a.add_argument("--grpo-loss-type", choices=("grpo", "bnpo", "dr_grpo", "dapo"), default="grpo",
                   help="--stage grpo: average over each completion's tokens then completions (grpo), over the "
                        "micro-batch's tokens (bnpo), sum / (completions x --max-completion-length) (dr_grpo), or "
                        "over the step's tokens (dapo, TRL's default)")
    a.add_argument("--kl-coef", type=NON_NEGATIVE, default=0.04,
                   help="--stage grpo: weight of the k3 KL estimate to the starting model (0: no reference)")
    a.add_argument("--use-bias-correction-kl", action="store_true",
                   help="--stage grpo: weigh the KL term by the policy ratio (DeepSeek-V3.2; TRL's default)")
    a.add_argument("--clip-ratio", type=UNIT, default=0.2, help="--stage grpo: the policy ratio's clip epsilon")
    a.add_argument("--clip-ratio-high", type=UNIT, default=None,
                   help="--stage grpo: the upper clip epsilon (default: --clip-ratio; DAPO raises it)")
    a.add_argument("--ppo-epochs", type=POSITIVE_INT, default=1,
                   help="--stage grpo: optimizer steps over each iteration's rollouts")
    # sampling: generation's (mindspeed generate --task do_sample, chat --do-sample) and GRPO's rollouts
    a.add_argument("--temperature", type=POSITIVE, default=1.0)
    a.add_argument("--top-k", type=COUNT, default=0)
    a.add_argument("--top-p", type=UNIT, default=1.0)
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
    m.add_argument("--rotary-percent", type=POSITIVE, default=None,
                   help="the share of each head's features RoPE rotates (the first ones)")
    m.add_argument("--partial-rotary-factor", type=POSITIVE, default=None,
                   help="MindSpeed-LLM's name of --rotary-percent (Qwen3-Next: 0.25)")
    # linear-attention hybrids (Qwen3-Next and MindSpeed-LLM's gated-DeltaNet models,
    # models/gated_deltanet.py): megatron-core's linear_* settings and MindSpeed-LLM's --mamba-*
    m.add_argument("--full-attention-interval", type=POSITIVE_INT, default=None,
                   help="every N-th layer attends, the others are gated DeltaNet (Qwen3-Next: 4)")
    m.add_argument("--linear-num-key-heads", type=POSITIVE_INT, default=None)
    m.add_argument("--linear-num-value-heads", type=POSITIVE_INT, default=None)
    m.add_argument("--linear-key-head-dim", type=POSITIVE_INT, default=None)
    m.add_argument("--linear-value-head-dim", type=POSITIVE_INT, default=None)
    m.add_argument("--mamba-d-conv", type=POSITIVE_INT, default=None,
                   help="the width of gated DeltaNet's causal convolution (default 4)")
    m.add_argument("--mamba-chunk-size", type=POSITIVE_INT, default=None,
                   help="gated DeltaNet's chunk in training (default 64; the values do not depend on it)")
    m.add_argument("--mamba-expand", type=POSITIVE_INT, default=None,
                   help="Mamba's inner expansion; gated DeltaNet's widths are the --linear-* flags' (1 only)")
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
    # longrope (Phi-3.5): the per-dimension factors as comma-separated numbers, the attention
    # scales for sequences past / up to the original length
    m.add_argument("--long-factor", type=_factor_list, default=None)
    m.add_argument("--short-factor", type=_factor_list, default=None)
    m.add_argument("--long-mscale", type=POSITIVE, default=None)
    m.add_argument("--short-mscale", type=POSITIVE, default=None)
    m.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None)
    m.add_argument("--add-qkv-bias", action="store_true", default=None)
    m.add_argument("--add-dense-bias", action="store_true", default=None,
                   help="a bias on the attention's output projection (with --disable-bias-linear: that one only)")
    m.add_argument("--add-output-layer-bias", action="store_true", default=None,
                   help="a bias on the output layer (refused: the matrix's output-layer-bias row)")
    m.add_argument("--qk-layernorm", action="store_true", default=None)
    # DeepSeek's multi-head latent attention and multi-token prediction (refused: the matrix's
    # multi-latent-attention and multi-token-prediction rows, not built yet)
    m.add_argument("--multi-latent-attention", action="store_true", default=None)
    m.add_argument("--q-lora-rank", type=POSITIVE_INT, default=None)
    m.add_argument("--kv-lora-rank", type=POSITIVE_INT, default=None)
    m.add_argument("--qk-head-dim", type=POSITIVE_INT, default=None)
    m.add_argument("--qk-pos-emb-head-dim", type=POSITIVE_INT, default=None)
    m.add_argument("--v-head-dim", type=POSITIVE_INT, default=None)
    m.add_argument("--mla-fa-without-pad", action="store_true", default=None)
    m.add_argument("--mla-mm-split", action="store_true", default=None)
    m.add_argument("--enable-mla-absorb", action="store_true", default=None,
                   help="latent attention computed over the latent itself (one key/value head): the key/value "
                        "up-projection folded into each head's query and output, the same attention")
    m.add_argument("--enable-mla-scale-q-lora", action="store_true", default=None,
                   help="LongCat-Flash: the normed query latent times sqrt(hidden / --q-lora-rank)")
    m.add_argument("--enable-mla-scale-kv-lora", action="store_true", default=None,
                   help="LongCat-Flash: the normed key/value latent times sqrt(hidden / --kv-lora-rank)")
    # DeepSeek sparse attention (DeepSeek-V3.2, GLM-5; models/dsa.py), MindSpeed-LLM's flags and defaults
    m.add_argument("--enable-dsa-indexer", action="store_true", default=None,
                   help="the lightning indexer: each query attends to its --index-topk best keys")
    m.add_argument("--index-topk", type=POSITIVE_INT, default=None, help="keys each query keeps (default 2048)")
    m.add_argument("--index-n-heads", type=POSITIVE_INT, default=None, help="the indexer's heads (default 64)")
    m.add_argument("--index-head-dim", type=POSITIVE_INT, default=None,
                   help="the indexer's head width (default 128)")
    m.add_argument("--indexer-loss-coeff", type=NON_NEGATIVE, default=None,
                   help="the indexer loss's weight (default 1.0; 0: the indexer does not learn)")
    m.add_argument("--indexer-dense-warmup", action="store_true", default=None,
                   help="DeepSeek-V3.2's warm-up stage (a flag of ours, none upstream): dense attention, and only "
                        "the indexers train, from their loss over every key")
    m.add_argument("--index-topk-freq", type=POSITIVE_INT, default=None,
                   help="GLM-5: every N-th layer from the offset runs its indexer, the others share its top-k")
    m.add_argument("--index-skip-topk-offset", type=COUNT, default=None,
                   help="GLM-5: the layers before this one (counted from 1) each run their indexer")
    m.add_argument("--index-topk-pattern", default=None,
                   help="per layer F (its own indexer) or S (the last F layer's top-k); overrides the two above")
    m.add_argument("--use-sparse-flash-attn", action="store_true", default=None,
                   help="MindSpeed's sparse flash attention kernel (Ascend); elsewhere the masked composite")
    m.add_argument("--use-fused-lightning-indexer", action="store_true", default=None,
                   help="MindSpeed's lightning indexer kernel (Ascend); elsewhere the composite")
    m.add_argument("--use-fused-lightning-indexer-loss", action="store_true", default=None,
                   help="MindSpeed's fused indexer KL loss kernel (Ascend); elsewhere the composite")
    # DeepSeek-V4's mechanisms (MindSpeed-LLM's deepseek4_flash preview scripts): refused by planned rows
    m.add_argument("--enable-mhc", action="store_true", default=None,
                   help="DeepSeek-V4's manifold-constrained hyper-connections (planned)")
    m.add_argument("--hc-mult", type=POSITIVE_INT, default=None, help="--enable-mhc's residual streams (planned)")
    m.add_argument("--kv-compress", action="store_true", default=None,
                   help="DeepSeek-V4's compressed sparse attention (planned)")
    m.add_argument("--compress-ratios", default=None, help="--kv-compress's per-layer ratios (planned)")
    m.add_argument("--compress-rope-theta", type=POSITIVE, default=None, help="--kv-compress's RoPE base (planned)")
    m.add_argument("--o-groups", type=POSITIVE_INT, default=None, help="DeepSeek-V4's grouped output projection (planned)")
    m.add_argument("--o-lora-rank", type=POSITIVE_INT, default=None, help="DeepSeek-V4's output latent (planned)")
    m.add_argument("--n-hash-layers", type=POSITIVE_INT, default=None,
                   help="DeepSeek-V4's layers routed by token hash (planned)")
    m.add_argument("--apply-rope-no-in-complex", action="store_true", default=None,
                   help="MindSpeed-LLM's GLM-5.2 switch: the indexer's rotated features taken in pairs, as the "
                        "attention's (transformers' glm_moe_dsa); without it in halves (DeepSeek-V3.2's)")
    m.add_argument("--mtp-num-layers", type=POSITIVE_INT, default=None)
    m.add_argument("--mtp-loss-scaling-factor", type=NON_NEGATIVE, default=None)
    m.add_argument("--mtp-mem-efficient-logits", action="store_true", default=None)
    # Gemma 2 (MindSpeed-LLM's spellings): RMSNorm weights as offsets from one, a norm after
    # attention and after the MLP, embeddings times sqrt(hidden), a gated GELU (--gelu-tanh: its
    # tanh form), the score scale query_pre_attn_scalar ** -0.5, tanh soft-capping, and a
    # sliding window in every layer or in every other layer from the first
    m.add_argument("--add-rmsnorm-offset", action="store_true", default=None)
    m.add_argument("--rmsnorm-weight-in-fp32", action="store_true",
                   help="RMSNorm: the normed input times the weight in float32, then cast to the model's dtype "
                        "(under --bf16 / --fp16; the offset norms always do)")
    m.add_argument("--post-norm", action="store_true", default=None)
    m.add_argument("--input-embeds-norm", action="store_true", default=None)
    m.add_argument("--gelu-tanh", action="store_true", default=None)
    m.add_argument("--geglu", action="store_true", default=None)
    m.add_argument("--query-pre-attn-scalar", type=POSITIVE, default=None)
    # MiniCPM's scalings (models/config.py)
    m.add_argument("--scale-emb", type=POSITIVE, default=None)
    m.add_argument("--scale-depth", type=POSITIVE, default=None)
    m.add_argument("--dim-model-base", type=POSITIVE, default=None)
    m.add_argument("--attn-logit-softcapping", type=POSITIVE, default=None)
    m.add_argument("--output-logit-softcapping", type=POSITIVE, default=None)
    m.add_argument("--sliding-window", type=POSITIVE_INT, default=None)
    m.add_argument("--interleave-sliding-window", type=POSITIVE_INT, default=None)
    # megatron-core's GPT-OSS switches: a window of L keys before each query (--window-size L,0)
    # in every layer but each N-th (--window-attn-skip-freq N), the learned per-head softmax
    # offset (attention sinks), the quick-GELU gated MLP with an offset on its linear half and
    # both halves clamped
    m.add_argument("--window-size", type=_causal_window, default=None,
                   help="L,0: each query sees itself and the L keys before it (megatron-core's tuple)")
    m.add_argument("--window-attn-skip-freq", type=POSITIVE_INT, default=None,
                   help="N: every N-th layer attends without the window (the others slide)")
    m.add_argument("--softmax-type", choices=("vanilla", "off-by-one", "learnable"), default=None)
    m.add_argument("--quick-geglu", action="store_true", default=None)
    m.add_argument("--squared-relu", action="store_true", default=None,
                   help="the MLP's activation relu(x)^2, ungated (Megatron's; PLM's)")
    m.add_argument("--fc-type", choices=("gate_up", "up_down"), default=None,
                   help="MindSpeed-LLM's name for the MLP's first layer: gate and up (a gated activation) or up "
                        "alone; checked against the activation")
    m.add_argument("--glu-linear-offset", type=FINITE, default=None)
    m.add_argument("--activation-func-clamp-value", type=POSITIVE, default=None)
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
    # --optimizer muon (training/muon.py), with MindSpeed-LLM's flags (its MuonOptimizerFeature) and
    # Megatron-LM's names where they differ
    t.add_argument("--optimizer", choices=("adam", "muon", "dist_muon"), default="adam",
                   help="adam (AdamW), or muon: Newton-Schulz-orthogonalised momentum for the matrices, AdamW for "
                        "embeddings, the output layer, norms and biases; dist_muon (MindSpeed-LLM: deprecated for "
                        "muon with --use-distributed-optimizer): muon with megatron-core's layer-wise distributed "
                        "optimizer")
    # (default None: given without --optimizer muon, they are refused; configuration.MUON_DEFAULTS)
    t.add_argument("--muon-momentum", type=PROBABILITY, default=None, help="default 0.95")
    t.add_argument("--muon-nesterov", "--muon-use-nesterov", dest="muon_nesterov", action="store_true", default=None)
    t.add_argument("--muon-no-split-qkv", dest="muon_split_qkv", action="store_false", default=None,
                   help="orthogonalise a fused q/k/v weight as one matrix, not its query, key and value rows apart")
    t.add_argument("--muon-scale-mode", choices=("spectral", "unit_rms_norm", "shape_scaling"), default=None,
                   help="default spectral")
    t.add_argument("--muon-fp32-matmul-prec", choices=("low", "medium", "high"), default=None,
                   help="an accelerator's float32 matmul precision for the iteration (default medium); the CPU "
                        "multiplies in float32 whatever it says")
    t.add_argument("--muon-coefficient-type", default=None, help="the Newton-Schulz coefficients: quintic "
                                                                 "(a, b, c = 3.4445, -4.7750, 2.0315; the default) "
                                                                 "or simple")
    t.add_argument("--muon-num-ns-steps", type=POSITIVE_INT, default=None, help="default 5")
    t.add_argument("--muon-tp-mode", choices=("blockwise", "duplicated", "distributed"), default=None,
                   help="how TP shards are orthogonalised (default blockwise: each shard on its own; duplicated "
                        "and distributed: the whole matrix, gathered)")
    t.add_argument("--muon-extra-scale-factor", type=POSITIVE, default=None, help="default 1.0")
    t.add_argument("--muon-scalar-optimizer", choices=("adam", "lion"), default=None,
                   help="the optimizer of what Muon does not update (default adam)")
    # QK-clip (MuonClip; megatron-core's TransformerConfig fields), training/qk_clip.py
    t.add_argument("--qk-clip", action="store_true",
                   help="after each update, shrink the query and key weights of the attention groups whose largest "
                        "logit passed --qk-clip-threshold")
    t.add_argument("--qk-clip-alpha", type=FRACTION, default=None,
                   help="the query's share of the shrinking (default 0.5)")
    t.add_argument("--qk-clip-threshold", type=POSITIVE, default=None, help="default 100")
    t.add_argument("--log-max-attention-logit", action="store_true",
                   help="log each step's largest attention logit (--qk-clip logs it too)")
    t.add_argument("--adam-beta1", type=PROBABILITY, default=0.9)
    t.add_argument("--adam-beta2", type=PROBABILITY, default=0.999)
    t.add_argument("--adam-eps", type=POSITIVE, default=1e-8)
    t.add_argument("--clip-grad", type=NON_NEGATIVE, default=1.0)
    t.add_argument("--seed", type=SEED, default=1234)

    d = parser.add_argument_group("data")
    d.add_argument("--data-path", nargs="+", default=None, help="prefix, or weight/prefix pairs")
    d.add_argument("--split", default="969,30,1")
    d.add_argument("--alternative-prompt", action="store_true",
                   help="evaluation: MindSpeed-LLM's other prompt wording, for mmlu (every dev question first) "
                        "and boolq (the passage's title, options A. Yes / B. No)")
    d.add_argument("--dataloader-type", choices=("single", "cyclic", "external"), default=None,
                   help="single: each step's consecutive global batch; cyclic: Megatron's random sampler (each "
                        "data-parallel rank's bucket of the run's samples, reshuffled each epoch); external is "
                        "refused by the matrix's dataloader-external row")
    add_tokenizer_args(d)

    c = parser.add_argument_group("checkpoints and logging")
    c.add_argument("--save", default=None,
                   help="where checkpoints go (default: none; a run on the embedded data without --load saves in "
                        "./checkpoints/<its --model-name, or its --load-hf folder's name>)")
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
    c.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM or SIGINT every rank finishes its step, saves (with --save) and exits with 128 + "
                        "the signal's number (training/preemption.py)")
    c.add_argument("--save-whole", action="store_true",
                   help="gather the whole model and optimizer state to rank 0 and write them as one model.safetensors "
                        "and one optimizer.safetensors (the format before sharded saves; default: every rank writes "
                        "its own pieces, training/sharded_checkpoint.py)")
    c.add_argument("--async-save", action="store_true",
                   help="each rank's checkpoint file is written by a thread from a host copy taken between steps, "
                        "while training goes on; the iteration is published once every rank's file is durable")
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


_SAME_RESULTS = ("a performance option of MindSpeed's MoE kernels; the experts here compute the same results without "
                 "it")
# Flags of Megatron / MindSpeed-LLM scripts that change nothing here, each with the reason. They
# are parsed so that those scripts run unchanged; tests/test_flags.py checks each has no effect.
# (flag -> (argparse keywords, reason))
ACCEPTED_NO_OPS = {
    "--index-share-for-mtp-iteration": ({"action": "store_true"},
                                        "MindSpeed-LLM's GLM-5.2 switch, read by no code there: each multi-token "
                                        "prediction layer runs its own indexer, as without it"),
    "--use-sparse-c8-indexer": ({"action": "store_true"},
                                "MindSpeed's 8-bit indexer cache behind a Hadamard rotation (an Ascend kernel's): "
                                "the scores here are float32, which the rotation leaves unchanged"),
    "--no-use-sparse-c8-indexer": ({"action": "store_true"}, "the indexer's scores are float32 here either way"),
    "--broadcast": ({"action": "store_true"},
                    "evaluation runs in one process here and generation's tensor-parallel ranks draw the same "
                    "tokens: there is nothing to broadcast"),
    "--moe-router-dtype": ({"choices": ("fp32",), "default": None},
                           "the router's logits, scores and weights are float32 here, whatever the model's dtype"),
    "--distributed-timeout-minutes": ({"type": POSITIVE_INT, "default": None},
                                      "the collectives keep the framework's default timeout; a rank that dies stops "
                                      "the job through the launcher"),
    "--num-workers": ({"type": COUNT, "default": None},
                      "the data is read in the training process from memory-mapped indexed files; there are no loader "
                      "workers"),
    "--variable-seq-lengths": ({"action": "store_true"},
                               "every pipeline rank reads each micro-batch's token ids and so knows its activations' "
                               "shape (dynamic padding included): there is no shape to exchange first"),
    "--no-bias-dropout-fusion": ({"action": "store_true"},
                                 "the bias, dropout and residual add run as separate operations here in any case"),
    "--no-bias-swiglu-fusion": ({"action": "store_true"},
                                "the MLP has no bias to fuse into SwiGLU here; --use-fused-swiglu chooses its kernel"),
    "--shape-order": ({"choices": ("SBH", "BSH", "BSND", "BNSD", "TND"), "default": None},
                      "the tensor layout inside MindSpeed's fused attention kernel; attention here takes [batch, seq, "
                      "heads, dim] whatever the value"),
    "--use-mcore-models": ({"action": "store_true"}, "the models here are megatron-core's (there is no legacy model)"),
    "--distributed-backend": ({"choices": ("nccl", "gloo", "hccl", "mccl"), "default": None},
                              "the framework's launcher picks the collectives' backend for the device"),
    "--attention-softmax-in-fp32": ({"action": "store_true"},
                                    "attention's softmax accumulates in float32 here in every precision"),
    "--no-masked-softmax-fusion": ({"action": "store_true"},
                                   "attention has no separate masked-softmax kernel to fuse here"),
    "--topk-softmax-in-fp32": ({"action": "store_true"},
                               "the router's softmax and top-k run on float32 logits here in every precision"),
    "--no-enable-linear-qkv": ({"action": "store_true"},
                               "MindSpeed-LLM's separate q, k and v projections (for its fused kernels): here "
                               "linear_qkv is one layer, computing the same values"),
    "--no-gradient-accumulation-fusion": ({"action": "store_true"},
                                          "gradient accumulation is not fused here (--gemm-gradient-accumulation-fusion "
                                          "is the matrix's row for it)"),
    "--tokenizer-not-use-fast": ({"action": "store_true"},
                                 "the tokenizers here are the fast (Rust) ones, which give the slow ones' ids"),
    "--log-throughput": ({"action": "store_true"}, "every log line shows tokens/s, TFLOP/s and MFU already"),
    "--no-shared-storage": ({"action": "store_true"},
                            "rank 0 writes checkpoints and every rank reads --load: across nodes without shared "
                            "storage, copy the checkpoint folder to each node"),
    "--attention-mask-type": ({"choices": ("causal", "general"), "default": "causal"},
                              "masks are built from each token's column and document, so both values mean the same"),
    "--lora-fusion": ({"action": "store_true"}, "LoRA runs as two small matmuls beside the layer; there is no fused "
                                                "kernel to choose"),
    "--moe-permutation-async-comm": ({"action": "store_true"}, _SAME_RESULTS),
    "--moe-permute-fusion": ({"action": "store_true"},
                             "MindSpeed's fused permute kernel (torch_npu): the tokens are gathered by expert with "
                             "one index_select here, the same results"),
    "--workers": ({"type": POSITIVE_INT, "default": None}, "preprocessing's worker count; training reads "
                                                          "preprocessed data"),
    "--pack": ({"action": "store_true"}, "packing happens in mindspeed preprocess --pack; packed data is read as "
                                         "packed"),
    "--neat-pack": ({"action": "store_true"}, "packed samples here always attend within their own sample (what neat "
                                              "packing asks for)"),
    "--padded-samples": ({"action": "store_true"},
                         "the sampler here reads every sample of each epoch once, in a full last global batch"),
    "--enable-thinking": ({"type": TRISTATE, "default": None},
                          "the chat template's thinking switch applies at preprocessing (the data holds its result)"),
    "--tokenizer-padding-side": ({"choices": ("left", "right"), "default": "right"},
                                 "padding is kept out of attention and the loss, and RoPE scores depend on relative "
                                 "positions only: either side gives the same numbers"),
    "--prompt-type": ({"default": None}, "the chat template is applied at preprocessing (the data holds its result)"),
    "--no-chat-template": ({"action": "store_true"}, "prompts go to the model as they are unless --prompt-type or "
                                                     "--hf-chat-template asks for a template"),
    "--overwrite-cache": ({"action": "store_true"}, "preprocessing keeps no cache: each run writes its outputs anew"),
    "--is-pairwise-dataset": ({"action": "store_true"}, "--stage dpo, simpo and orm read pairwise data already"),
    "--use-fused-moe-token-permute-and-unpermute": ({"action": "store_true"},
                                                    "a performance option of MindSpeed's MoE kernels; the experts "
                                                    "here compute the same results without it"),
    "--longrope-freqs-type": ({"choices": ("outer", "mul"), "default": "mul"},
                              "both compute longrope's frequencies 1 / (factor x base^(2i/d)), in another order"),
    "--no-rope-fusion": ({"action": "store_true"}, "RoPE runs unfused unless --use-fused-rotary-pos-emb asks for the "
                                                   "fused kernel, which gives the same results"),
    "--local-rank": ({"type": int, "default": None}, "python -m torch.distributed.launch passes each worker's "
                                                    "rank; the rank comes from the launcher's environment here"),
}


def add_compat_args(parser: argparse.ArgumentParser, skip: tuple = ()) -> None:
    """The accepted no-ops (``skip``: flags the verb's own parser already defines)."""
    g = parser.add_argument_group("accepted for Megatron / MindSpeed-LLM scripts, without effect here")
    for flag, (keywords, reason) in ACCEPTED_NO_OPS.items():
        if flag in skip:
            continue
        names = [flag, "--local_rank"] if flag == "--local-rank" else [flag]
        g.add_argument(*names, help=f"(no effect: {reason})", **keywords)


def add_mindspeed_llm_args(parser: argparse.ArgumentParser) -> None:
    """MindSpeed-LLM's training flags that take effect here."""
    g = parser.add_argument_group("MindSpeed-LLM")
    g.add_argument("--transformer-impl", choices=("local", "transformer_engine"), default="local",
                   help="local: the layers here (transformer_engine is refused by the matrix)")
    g.add_argument("--disable-bias-linear", action="store_true",
                   help="no biases on the attention output and the MLP (Megatron's default adds them)")
    g.add_argument("--use-rotary-position-embeddings", action="store_true", help="--position-embedding-type rope")
    g.add_argument("--padded-vocab-size", type=POSITIVE_INT, default=None,
                   help="the embedding's rows, instead of the tokenizer's vocabulary padded to "
                        "--make-vocab-size-divisible-by")
    g.add_argument("--lr-warmup-fraction", type=PROBABILITY, default=None,
                   help="warm up over this fraction of --lr-decay-iters (instead of --lr-warmup-iters)")
    g.add_argument("--spec", nargs="+", default=None,
                   help="the layer spec's module (and function) of MindSpeed-LLM; mapped onto a model family here")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="with --load: stop when it holds no checkpoint (instead of starting from scratch)")
    g.add_argument("--no-load-optim", action="store_true", help="--load: not the optimizer state")
    g.add_argument("--no-load-rng", action="store_true", help="--load: not the random generators' states")
    g.add_argument("--no-save-optim", action="store_true", help="checkpoints without the optimizer state")
    g.add_argument("--no-save-rng", action="store_true", help="checkpoints without the random generators' states")
    g.add_argument("--ckpt-format", choices=("torch", "torch_dist", "zarr", "fsdp_dtensor"), default="torch",
                   help="torch: the checkpoint layout here (iter_*/ folders; Megatron's .pt files via mindspeed "
                        "convert); torch_dist: also megatron-core's distributed format of the model, in the same "
                        "folders; zarr and fsdp_dtensor are refused")
    g.add_argument("--enable-hf2mg-convert", action="store_true",
                   help="--load is a Hugging Face folder, converted into this run's layout as it loads")
    # MindSpeed-LLM's training with Hugging Face folders out (training/checkpoint_manager.py)
    g.add_argument("--enable-mg2hf-convert", action="store_true",
                   help="after each save, also write the model as a Hugging Face folder, "
                        "<--hf-save-dir or --save>/mg2hf_iteration<N>")
    g.add_argument("--only-convert-last-checkpoint", action="store_true",
                   help="--enable-mg2hf-convert: the folder of the last iteration only, when training ends")
    g.add_argument("--hf-save-dir", default=None, help="--enable-mg2hf-convert: where the folders go (default --save)")
    g.add_argument("--hf-cfg-dir", default=None,
                   help="--enable-mg2hf-convert: a Hugging Face folder of this model whose tokenizer and generation "
                        "files go with each folder written (its config.json must describe the model)")
    g.add_argument("--model-type-hf", default=None,
                   help="with --enable-hf2mg-convert: the Hugging Face architecture (checked against its config)")
    g.add_argument("--manual-gc", action="store_true",
                   help="Python's garbage collector runs at --manual-gc-interval steps (and evaluations) only")
    g.add_argument("--manual-gc-interval", type=COUNT, default=0,
                   help="--manual-gc: collect every N steps (0: at evaluations only)")
    g.add_argument("--no-pad-to-seq-lengths", action="store_true",
                   help="fine-tuning: pad each micro-batch to its longest sample instead of --seq-length (the loss "
                        "is the same; shorter micro-batches take less time)")
    g.add_argument("--pad-to-multiple-of", type=POSITIVE_INT, default=8,
                   help="--no-pad-to-seq-lengths: round each micro-batch's length up to a multiple of this "
                        "(and of what context and sequence parallelism cut it by)")
    g.add_argument("--npu-deterministic", dest="use_deterministic_algorithms", action="store_true",
                   help="MindSpeed's spelling of --use-deterministic-algorithms")
    g.add_argument("--lora-ckpt-filter", action="store_true", help="LoRA runs: checkpoints hold the adapters only")
    g.add_argument("--no-shuffle", action="store_true",
                   help="read each dataset's samples in file order, epoch after epoch (blends still interleave "
                        "by weight)")


def _factor_list(text: str) -> list:
    """--long-factor / --short-factor: comma-separated positive numbers."""
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a comma-separated list of numbers") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError("the factors must be positive numbers")
    return values


def training_parser(prog: str = "mindspeed train", verb: bool = False) -> argparse.ArgumentParser:
    """``verb``: the base of another verb's parser (generate, evaluate), whose own flags of the
    same name (--prompt-type, ...) replace the accepted no-ops."""
    parser = ArgumentParser(prog=prog, allow_abbrev=False, conflict_handler="resolve" if verb else "error",
                            description="pre-train a GPT model (Megatron-style flags)")
    add_framework_args(parser)
    add_feature_args(parser)
    add_training_args(parser)
    add_mindspeed_llm_args(parser)
    add_compat_args(parser)
    return parser
