"""The feature matrix: what each framework (and device) can do, as data.

One row per feature: an id, the flags that turn it on, a category, and per framework a
status (supported, emulated, unsupported, planned) with a one-line note, optionally
overridden per device (cpu, cuda, npu). The same rows

* gate parsed arguments (:func:`validate`): asking for an unsupported or planned feature
  stops before any model is built, with exit code 2 and a message naming the feature, its
  flag, the framework, why, and what to use instead;
* print themselves (``mindspeed features``) as text, markdown or JSON;
* generate the table of docs/feature-matrix.md (a test fails when the two drift);
* demand tests: every supported or emulated cell needs a test marked
  ``@pytest.mark.feature("<id>")`` that runs on that framework (checked by tests/conftest.py).

This module imports no framework.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

from mindspeed_core import usage
from mindspeed_core.errors import FeatureNotAvailable

STATUSES = ("supported", "emulated", "unsupported", "planned")
FRAMEWORKS = ("pytorch", "mindspore")
DEVICES = ("cpu", "cuda", "npu")


@dataclass(frozen=True)
class Status:
    kind: str
    note: str = ""
    instead: str | None = None
    devices: dict = field(default_factory=dict)  # device -> Status overriding this one
    # the oldest framework release (major, minor) this holds for, and why older ones are
    # refused: below it the cell reads as unsupported
    since: tuple | None = None
    older: str = ""

    def on(self, device: str | None, version: str | None = None) -> "Status":
        st = self.devices.get(device, self) if device else self
        if st.since and version and release(version) < st.since:
            return Status("unsupported", f"needs release >= {_dotted(st.since)} ({version} is older: {st.older})",
                          st.instead)
        return st


def release(version: str) -> tuple:
    """(major, minor) of a framework version string such as '2.6.0+cu124'."""
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2])


def _dotted(since: tuple) -> str:
    return ".".join(map(str, since))


def supported(note: str = "", since: tuple | None = None, older: str = "", instead: str | None = None,
              **devices) -> Status:
    """``since``/``older``/``instead``: the oldest release it holds for, why older ones fail and
    what to use there."""
    return Status("supported", note, instead, devices, since, older)


def emulated(note: str, **devices) -> Status:
    return Status("emulated", note, None, devices)


def unsupported(note: str, instead: str | None = None, **devices) -> Status:
    return Status("unsupported", note, instead, devices)


def planned(note: str = "not built yet", instead: str | None = None, **devices) -> Status:
    return Status("planned", note, instead, devices)


def _bf16_only_on_mindspore(instead: str) -> Status:
    """MindSpore's status of a feature that needs --bf16: its CPU has no bfloat16 matmul."""
    return planned("needs --bf16, not yet run on a MindSpore GPU/Ascend device",
                   cpu=unsupported("needs --bf16: MindSpore's CPU MatMul has no bfloat16 kernel", instead=instead))


@dataclass(frozen=True)
class Feature:
    id: str
    title: str
    category: str
    flags: tuple
    pytorch: Status
    mindspore: Status
    active: Callable | None = None  # args -> bool; None: a capability no flag turns on

    def status(self, framework: str, device: str | None = None, version: str | None = None) -> Status:
        """``version``: the installed framework's (None: the newest, as docs/feature-matrix.md shows)."""
        return getattr(self, framework).on(device, version)


HANDLER_ROWS = (  # (row id suffix, --handler-name, what it writes)
    ("general-pretrain", "GeneralPretrainHandler", "each --json-keys text a document (the default)"),
    ("alpaca", "AlpacaStyleInstructionHandler", "Alpaca records (system, history) as conversations, labels on "
                                                "the replies"),
    ("sharegpt", "SharegptStyleInstructionHandler", "ShareGPT conversations (multi-turn, system, tool turns), every "
                                                    "assistant turn trained"),
    ("alpaca-pairwise", "AlpacaStylePairwiseHandler", "a prompt with chosen and rejected replies"),
    ("sharegpt-pairwise", "SharegptStylePairwiseHandler", "a conversation with chosen and rejected replies"),
    ("alpaca-prm", "AlpacaStyleProcessRewardHandler", "step-labelled solutions (placeholder and reward tokens)"),
    ("alpaca-ppo", "PPOAlpacaStyleInstructionHandler", "Alpaca prompts alone (the conversation up to the assistant's "
                                                       "turn, no labels): online-RL data, --stage grpo's prompts"),
)


def _on(name):
    return lambda a: bool(getattr(a, name, False))


def _gt1(name):
    return lambda a: (getattr(a, name, 1) or 1) > 1


def _eq(name, value):
    return lambda a: getattr(a, name, None) == value


def _task(*names):
    """--task names one of ``names`` (it takes several: `mindspeed generate` runs each)."""
    def asked(a):
        task = getattr(a, "task", None)
        return any(t in names for t in ([task] if isinstance(task, str) else task or ()))
    return asked


def _cp(algo):
    return lambda a: (getattr(a, "context_parallel_size", 1) or 1) > 1 and a.context_parallel_algo == algo


_NPU_ONLY = "fuses matmul with communication in Ascend kernels; NPU only"
# a kernel binding that exists in the code but has never run: no such device on these machines
_UNTESTED = "bound, untested (no such device here)"

# MindSpore's CPU runtime has no Send/Receive: a transfer is a sum all-reduce over the pair's
# group with the receiver's slot zero (exact), carrying the bytes as 16-bit lanes in float32;
# and PyNative keeps one recorded forward, so a forward other compute follows before its
# backward runs unrecorded and is recorded again (same random draws) at its backward
_P2P_EMULATED = ("send/recv emulated by a sum all-reduce over the two ranks' group (exact; 2x the payload "
                 "on the wire); a forward that other compute follows before its backward is recorded again "
                 "at its backward (one more forward; no graph held in between)")

_DYNAMIC_PADDING = ("fine-tuning micro-batches padded to their longest sample, rounded up to --pad-to-multiple-of "
                    "(and CP/SP's cut); the same loss, pipeline stages pass each micro-batch's own width")
_OVERLAP = ("each bucket of gradients starts its data-parallel sum ({}) as backward completes it, from a gradient "
            "hook; the same buckets and results as without overlap")
_PARAM_GATHER = ("the distributed optimizer's updated buckets gathered ({}) while the step ends and the next "
                 "begins; each module waits for its own bucket before its forward; the same results")
_ACTIVATION_RECOMPUTE = ("the MLP's (and MoE experts') activation output not kept for backward but computed again "
                         "there, in the layers full recompute leaves alone; the same results")
_ULYSSES_KV = ("each key/value head copied to the Ulysses ranks whose query heads share it (as MindSpeed-LLM does), "
               "the copies' gradients summed back; the Ulysses degree a multiple of the key/value heads per TP rank")
_RING_OVERLAP = ("forward: each ring step's send/receive ({}) starts before the attention of the block at hand and "
                 "is waited for after it; the same blocks in the same order, the same bits; backward's exchanges "
                 "run as without it; a compiled step orders its own communication, and Ulysses alone has no ring "
                 "to overlap")
_DIST_CKPT = "checkpoints here are iter_*/ folders of safetensors (mindspeed convert writes Megatron's .pt layout)"
_TORCH_DIST = ("--ckpt-format torch_dist: every rank also writes its pieces of the model as megatron-core's "
               "dist_checkpointing does (.metadata, __R_0.distcp, common.pt), which its GPTModel loads at any layout; "
               "--load and mindspeed convert read Megatron's torch_dist checkpoints (the model; without torch: the "
               "pickled metadata through the allow-list reader)")
_LINEAR_CP = ("a gated DeltaNet layer's state runs along the whole sequence: handing it from one CP rank to the "
              "next (as MindSpeed does for its Mamba layers) is not built")
_NORM_FP32 = ("under --bf16 / --fp16 every norm's weight and bias (the layers', the latent attention's, the indexer's "
              "key norm, the final one) stays a float32 parameter, without a master copy; each norm computes in "
              "float32 and casts its output to the model's dtype (in float32 training, a no-op)")
_INPUT_NORM_FP32 = ("Hunyuan's layer (MindSpeed-LLM's transformer_layer_hunyuan: the attention fed the input norm's "
                    "output in float32) is not built here")
_SWAP_OPTIMIZER = ("the distributed optimizer's master slice and moments held in host memory between steps "
                   "(device.to_host), each update bringing them to the device in --swap-optimizer-times pieces "
                   "(default 16) and back; the same bits as without (on a CPU-only host both are host memory)")
_GDN_COMPOSITE = ("the same chunked rule as composite ops (models/gated_deltanet.py) on every device: "
                  "flash-linear-attention's Triton kernels are not bound (CPU has no Triton)")
_A2A_OVERLAP = ("with EP and the alltoall dispatcher, the dispatch in one chunk per local expert, each gathered "
                "straight from the tokens; every chunk leaves at once ({}), a chunk's experts compute as it arrives "
                "while the later ones travel, and its outputs start back while the next chunk's experts compute; "
                "the same rows per expert in the same order, the same bits; with EP 1 there is nothing to exchange")
_FB_OVERLAP = ("in 1F1B's steady state (one warm-up forward more), interleaved 1F1B's and DualPipeV's, each forward "
               "is paired with the backward after it: both are cut into nodes at the alltoall dispatcher's exchanges "
               "(attention and routing, dispatch, experts, combine, output) and stepped in turn, so one's all-to-all "
               "({}) travels while the other computes; the same bits. With PP 1, --compile or sparse attention "
               "the run says why nothing is paired")
_MUON = ("megatron-core's choice of matrices (every 2-D weight but embeddings and the output layer, the router's "
         "included; the experts' stacked weights expert by expert) get momentum orthogonalised by a float32 "
         "Newton-Schulz iteration through the facade, the q/k/v weight per query, key and value rows; the rest "
         "AdamW. fp16 is refused")
_LOW_PRECISION_STATES = ("Adam's moments (and Muon's momentum, in --exp-avg-dtype) stored in bf16, each update "
                         "computed in fp32 from them, with fp32 or bf16 training; fp32 master weights; AdamW, the "
                         "distributed optimizer (and --swap-optimizer) and Muon; fp16 and fp8 states are refused")
_MUON_TP = ("under TP with --muon-tp-mode duplicated or distributed each cut matrix's shards are gathered over the TP "
            "group and iterated whole (one process's update); blockwise, the default, iterates each shard alone "
            "(megatron-core's)")
_DIST_MUON = ("megatron-core's layer-wise distributed optimizer: each parameter's Muon or AdamW state and update on "
              "one data-parallel rank (expert weights: one expert-data-parallel rank), the updated parameters "
              "gathered from their owners; checkpoints hold each state once, read at any layout")
_QK_CLIP = ("each step's largest attention logit per query group (over the causal pairs, the micro-batches and "
            "the data-parallel ranks) past the threshold shrinks the group's query rows by eta^alpha and key rows "
            "by eta^(1 - alpha) after the update, as megatron-core does; logged each step. Softmax attention "
            "with fused q/k/v; MLA, q/k norms, sliding windows, TP, CP, packed documents, the distributed "
            "optimizer and --compile are refused")
_ZERO_MEMORY = ("level0: the dispatched rows (fc1's input) and the activation (fc2's input) are not kept; in "
                "backward the dispatch (its all-to-all under EP) and fc1 run again before fc1's backward, and the "
                "activation and fc2 before fc2's (MindSpeed keeps fc1's output and does not run fc1 or fc2 again); "
                "level1: nothing of the routed path is kept but its input, and all of it (dispatch, experts, "
                "combine) runs again in backward; the same bits")
_DUALPIPEV = ("two model chunks a rank in a V (rank r: stages r and 2P-1-r; the embedding, the loss and the MTP "
              "modules on the first rank), fed from both ends in DeepSeek's order as MindSpeed's dualpipev runs it "
              "without --moe-fb-overlap: each backward computes the input and weight gradients at once; a "
              "framework-free program, deadlock-free by construction; untied embeddings, no CP")
_MATMUL_ADD = ("with --moe-grouped-gemm (as MindSpeed's npu_groupmatmul_add_fp32): each expert's weight gradient "
               "computed by ops.matmul_add in fp32 into an fp32 gradient of its own, never rounded to bf16 (in fp32 "
               "the same arithmetic as without the flag); not with --compile")
_DP_EVALUATION = ("`mindspeed launch -- evaluate` on a multiple of TP x PP x EP ranks: each copy of the model scores "
                  "every copies-th question (or perplexity window), the sums gathered once")
_ALTERNATIVE = ("mmlu and boolq in MindSpeed-LLM's other wording, the answer still the most likely option "
                "(framework-free prompts); ceval's needs C-Eval's subject names in Chinese and is refused in one line")
_CYCLIC = ("Megatron's random sampler with data sharding: one bucket of the run's samples per DP rank, read in "
           "an order drawn per epoch (numpy's permutation seeded by the epoch, where Megatron draws torch's)")
_ETP1 = ("each TP rank holds its EP rank's experts whole and runs them on the whole sequence (the layer gathers it "
         "under SP, as with cut experts): no partial rows to sum, whole expert gradients; the EP group stays within "
         "the DP ranks (megatron-core's may reach across TP ranks)")
_MINIMAX_M2 = ("models/families/minimax_m2.py: the q/k RMSNorms over the whole query and key projections (one "
               "mean square over every head; under tensor parallelism each rank's heads' sum of squares all-reduced, "
               "the norms' weights cut with the heads), RoPE on the release's rotary_dim, sigmoid routing steered by "
               "each block's e_score_correction_bias, renormalised; Hugging Face folders in and out, MindSpeed-LLM's "
               "minimax_spec from flags (--q-lora-rank and --kv-lora-rank read as the norms' widths)")
_DSA = ("models/dsa.py: the lightning indexer (its queries from the query latent, one LayerNorm-ed key, partial "
        "RoPE, ReLU scores mixed by per-head weights) and each query's --index-topk best keys among those it may "
        "see; the attention masks the rest (a mask on the dense scores here: ordinary attention's memory plus a "
        "boolean per query and key); the indexer's keys cached beside the latents in generation; TP (+ SP) with the "
        "indexer replicated, PP and DP; not with context parallelism")
_DSA_WARMUP = ("DeepSeek-V3.2's first stage, a flag of ours (MindSpeed-LLM has none): every layer attends to every "
               "key it may see, each indexer's loss is the KL over all of them, and only the indexers' weights train "
               "(the others get no gradient and no optimizer state); the sparse stage then starts from its "
               "checkpoint with --finetune or --no-load-optim")
_DSA_LOSS = ("the indexer's loss: KL of the main attention's probabilities over the chosen keys (summed over its "
             "heads, normalised) to the indexer's softmax over them, averaged over the queries, times "
             "--indexer-loss-coeff; the indexer's inputs detached, so it trains the indexer alone; joins the gradient "
             "as the routers' losses do")
_DSA_SHARED = ("GLM-5's layers that reuse the top-k of the last layer with an indexer (--index-topk-freq, "
               "--index-skip-topk-offset, --index-topk-pattern; config.json's indexer_types); a pipeline stage must "
               "start with a layer that runs its indexer")
_V32 = ("models/families/deepseek_v32.py: DeepSeek-V3's latent attention, MoE and MTP with sparse attention in "
        "every layer (the indexer rotated in halves); Hugging Face folders in and out, logits and greedy tokens equal "
        "transformers'")
_GLM5 = ("models/families/glm_moe_dsa.py: DeepSeek-V3.2's layers with the indexer rotated in pairs and indexer_types' "
         "shared layers; Hugging Face folders in and out, logits and greedy tokens equal transformers'")
_DSA_CP = "the indexer scores every earlier key of the whole sequence: not split over context-parallel ranks yet"
_DSA_CP_INSTEAD = "tensor parallelism with --sequence-parallel (the indexer on the gathered sequence)"
_CHUNK_LOSS = ("models/gpt.py chunked_loss: the output layer and the cross entropy --loss-chunk-size positions "
               "(default 1024) at a time, each chunk recomputed in backward, so one chunk's logits live at once; the "
               "same loss and gradients as the whole logits (float rounding); pre-training and SFT, any layout "
               "(the vocabulary-parallel loss per chunk under TP); not compiled")
_MLA_ABSORB = ("models/mla.py: each head's query without position multiplied into the latent's space by its key "
               "up-projection, attention against the cached latent and the rotated key as one key/value head, the "
               "output projected up by the value up-projection afterwards: the same attention (float rounding), "
               "the up-projected keys and values never formed; in training and generation, every layout")
_MLA_SCALE = ("models/mla.py: the normed query latent, and the normed key/value latent (not the rotated key), times "
              "sqrt(hidden / its rank) before their up-projections (MindSpeed-LLM's and transformers' LongCat-Flash)")
_ZERO_EXPERTS = ("models/moe.py: --num-zero-experts router slots after the real experts, scored, chosen and balanced "
                 "(the expert bias) with them; a token that chooses one gets itself times the weight, computed where "
                 "it is (no dispatch); one process, TP, EP; not compiled, not with groups or a capacity")
_LONGCAT = ("models/longcat.py and models/families/longcat_flash.py: each layer two latent attentions (latents "
            "scaled) each followed by a dense MLP, the MoE fed beside the first MLP and added at the layer's end, "
            "softmax routing over the real and the zero-computation experts with the expert bias; Hugging Face "
            "folders in and out, logits and greedy tokens equal transformers'; MindSpeed-LLM's longcat_spec from flags")
_PER_TOKEN = ("Megatron's per-token loss: each kept label's loss weighs micro-batches x DP over the global batch's "
              "kept labels (summed over the DP ranks), so a step's loss and gradient are the mean over every token "
              "of its global batch rather than the mean of each micro-batch's mean (they differ where fine-tuning's "
              "masks keep different numbers of labels); pre-training and --stage sft, not compiled")
_PLM = ("models/families/plm.py: PLM's folders (model_type plm; their modelling code outside the transformers release) "
        "are DeepSeek-V2-Lite's dense decoder (latent attention without a query latent, RoPE on consecutive pairs) "
        "with a squared-ReLU MLP of up_proj and down_proj and tied embeddings; checked against transformers' "
        "DeepSeek-V2 running that MLP")
_V4 = ("DeepSeek-V4 is a preview upstream (MindSpeed-LLM's deepseek4_flash, transformers' deepseek_v4): not built "
       "yet; DeepSeek-V3.2's sparse attention and DeepSeek-V3's MoE and MTP are")
_TP_EXTEND_CONVERT = ("a Megatron checkpoint whose experts lie whole over TP x EP ranks (MindSpeed's "
                      "--moe-tp-extend-ep) is not written by the converter yet; training reads and shards checkpoints "
                      "at that layout from our own")
_TP_EXTEND_CONVERT_INSTEAD = "convert without it and train with --moe-tp-extend-ep from the converted checkpoint"
_HY_GROUPS = ("as MindSpeed-LLM's hunyuan3 script trains a HY-V3 folder: each token's experts come from its best "
              "--moe-router-group-topk of --moe-router-num-groups groups (megatron-core's group-limited routing on "
              "the folder's sigmoid scores and expert bias), said in a note; a folder written back routes over every "
              "expert, as transformers' HY-V3 does")
_LING = ("models/families/bailing_moe_v2.py: Ling-V2's folders (model_type bailing_moe, BailingMoeV2ForCausalLM; their "
         "modelling code outside transformers, read from the Ling-V2 repository) are GLM-4.5's model under other "
         "names: q/k/v fused as all q, then k, then v heads; q/k norms per head; RoPE in halves on the first "
         "partial_rotary_factor of each head; grouped sigmoid routing with the expert bias beside shared experts; "
         "read and written through GLM-4.5's reader, checked against transformers' GLM-4.5; its multi-token "
         "prediction layers (enorm, hnorm, eh_proj, final_layernorm) map onto megatron-core's module as "
         "MindSpeed-LLM's converter maps them (Ling-V2's own code feeds them the final-normed hidden state: not "
         "compared)")
_TEKKEN = ("mindspeed_core/data/tekken.py reads the folder's tekken.json itself (no mistral-common): its byte-level "
           "BPE ranks, pattern and special tokens, ids offset by the special ones as mistral-common's; text encodes "
           "without special tokens (a template's [INST] is its characters, as MindSpeed-LLM's tokenizer does), the "
           "end of document is </s>")
_MAGISTRAL_TEMPLATE = ("MindSpeed-LLM's magistral prompt type is a reasoning template (its long default system prompt, "
                       "an empty thought added to replies, thoughts dropped from the history) not written here yet")
_MAGISTRAL_TEMPLATE_INSTEAD = "a prompt type of the data's own format, or the model folder's chat_template"
_HY_V3 = ("models/families/hy_v3.py: Qwen3's attention (q/k norms per head, q/k/v/o biases), dense layers where "
          "mlp_layer_types says so, elsewhere experts chosen by sigmoid scores plus the block's expert bias, "
          "renormalised and scaled by router_scaling_factor, beside an ungated shared expert; Hugging Face folders "
          "in and out, hf <-> Megatron")
_SLICED_LOAD = ("from our sharded checkpoints (what training saves) each rank of `generate`/`evaluate` cuts its model "
                "first, then reads only its own slices, at any saved layout, as a resumed training run does (the "
                "bytes each rank read are printed); a LoRA run's checkpoint, an older whole-file one, a Hugging Face "
                "folder or a Megatron checkpoint is read whole on each rank and then cut")
_CONVERT_ETP = ("mindspeed convert --expert-tensor-parallel-size 1 writes megatron-core's ETP 1 layout as "
                "MindSpeed-LLM's converter does (each file's experts whole, files only for the paired TP and EP "
                "ranks: EP rank e with TP rank e mod TP), and every reader (convert, training's --load, generate, "
                "evaluate) takes such a checkpoint from its args")
_EP_ACROSS_TP = ("with --expert-tensor-parallel-size 1 under TP (and --sequence-parallel, as megatron-core requires) the "
                 "EP groups are megatron-core's: EP consecutive ranks of a stage, across the TP ranks first, then CP "
                 "and DP (EP divides TP x CP x DP); each TP rank routes its own sequence-parallel share to the whole "
                 "experts of its group (the load-balancing loss counts the whole sequences, each rank's router "
                 "losses weigh 1 / TP, the router's gradient is summed over TP), expert gradients are reduced over "
                 "the ranks holding the same experts")
_TP_EXTEND_EP = ("MindSpeed's experts over EP x TP ranks, whole on each: megatron-core's EP-across-TP layout at "
                 "--expert-model-parallel-size x --tensor-model-parallel-size (the expert-parallel-across-tp row)")
_ETP = "the experts are cut over the model's TP ranks (the default) or kept whole (1); other sizes are not built"
_ETP_INSTEAD = "--expert-tensor-parallel-size 1, or equal to --tensor-model-parallel-size"
_CONVERT_LORA = ("--lora-load merges a LoRA run's adapters (ours, or a Megatron checkpoint in peft's names, whole or "
                 "adapters only) into --load-dir's model; --save-lora-to-hf writes them as a PEFT folder that peft loads "
                 "onto the transformers model (framework-free)")

# the combinations the trainer cannot run yet (rows at the end of FEATURES)
_ALIGNMENT_STAGES = ("dpo", "simpo", "orm", "rm", "prm")
_LORA_FILTER = ("the checkpoints hold the adapters, their optimizer state and the run's state, not the frozen base "
                "weights; the run resumes with the base model in --load (or --load-hf) and the checkpoint in "
                "--lora-load, as MindSpeed-LLM's; mindspeed convert merges it with --load-dir and --lora-load")
_NO_GLOO_GROUP = ("always so here: no Gloo side group is made (Megatron's, for gathering the distributed optimizer's "
                  "state on the host); each rank writes its slices of the state (sharded checkpoints), and "
                  "--save-whole gathers them on the job's own backend (gloo on CPU, nccl on CUDA, hccl on Ascend); "
                  "--disable-gloo-group is accepted")
_OUTPUT_BIAS = ("the untied output layer's bias, cut with the vocabulary under TP, padded with it in Megatron's "
                "files (lm_head.bias in Hugging Face folders)")
_PHIMOE = ("models/families/phimoe.py: SparseMixer's top-2 (each weight its own thresholded softmax), LayerNorm "
           "with biases, q/k/v/o and output-layer biases, LongRoPE with its mscales; Hugging Face phimoe folders and "
           "MindSpeed-LLM's Megatron layout in and out; its training is the sparsemixer-training row")
_JITTER = ("in training the router's input (not the experts') is multiplied by noise uniform in [1 - eps, 1 + eps], "
           "drawn from the framework's default stream (the same on every tensor-parallel rank, so their routings "
           "agree; recompute restores the stream, as for dropout), as megatron-core's router does; generation and "
           "evaluation set it aside")
_SPARSEMIXER_TRAINING = ("in training each of the two choices is sampled (the kept logits plus Gumbel noise) and its "
                         "weight's gradient is Heun's third-order estimate, as transformers' and MindSpeed-LLM's "
                         "Phi-3.5-MoE train (models/router.py); the draws come from the framework's default stream, the "
                         "same on every tensor-parallel rank; not compiled (moe-compile-routing)")
_MOE_CP = ("each CP rank routes its share of every sequence; the load-balancing loss's fractions count the whole "
           "sequences (summed over the CP group), its mean scores are the share's, so the CP ranks' mean loss and "
           "gradient are one device's; expert gradients are reduced over the expert-data-parallel ranks of every "
           "CP rank; a capacity factor counts each rank's own tokens, as megatron-core's does")
_MOE_LAYOUTS = "TP, SP, PP, DP and EP with a mixture-of-experts model"
_MOE_COMPILE = ("a compiled MoE step routes on the device and runs every expert on every token: expert "
                "parallelism's uneven exchanges, pipeline stages' compiled chunks, a capacity's drops, context "
                "parallelism's load-balancing counts and the router's input jitter are not built for it yet")
_LORA_MOE = ("each expert gets its own adapter on its fc1 and fc2 (linear_fc1, linear_fc2 targets), stacked as the "
             "experts' weights are ([E, in, r] and [E, r, out], folded as W + (alpha / r) A B, without dropout, as "
             "MindSpeed-LLM's grouped LoRA experts), the shared expert's linear layers as the dense MLP's, the router's "
             "weights frozen (its expert bias moves with the loads, as in megatron-core, and is kept with the "
             "adapters by --lora-ckpt-filter and taken by --lora-load); under EP each rank holds its experts' adapters, under TP the factor on the cut side is cut "
             "with its base and the other is whole with a partial gradient; merged by mindspeed convert --lora-load, "
             "read and written as SequentialMLP experts in peft's names (GroupedMLP's weight1_lora_a read too); "
             "PEFT export refuses them. Latent attention with a query latent takes MindSpeed-LLM's linear_qkv target as one "
             "adapter across its fused down-projections (A [r, hidden], B [q_lora + kv_lora + rope, r], its rows "
             "added to the query's and the key/value's latents; whole on every TP rank with partial gradients)")
_COMPILE_PACKED = ("--compile with packed sequences or instruction data is not built yet (the compiled loss takes no "
                   "positions, documents or loss mask)")
_COMPILE_MEMORY = "--compile with activation recompute or --swap-attention is not built yet"
_COMPILE_MEMORY_INSTEAD = "drop --compile or the memory flags"
_LORA_MLA_QKV = ("MindSpeed-LLM's latent attention without a query latent fuses the whole query projection (cut by "
                 "heads here) into its linear_qkv with the key/value down-projection; LoRA on that fused layer is not "
                 "built (with --q-lora-rank it is: one adapter across both down-projections)")
_LORA_MLA_QKV_INSTEAD = "--lora-target-modules linear_proj linear_fc1 linear_fc2"
_ALIGN_CP = ("a preference or reward stage with context parallelism is not built yet: a reply's log-likelihood "
             "would need its sum over the context-parallel ranks")
_COMPILE_ALIGN = "--compile with a preference or reward stage is not built yet"


_MTP_CP = ("multi-token prediction with context parallelism is not built yet: the labels a depth further on "
           "cross the context-parallel ranks' chunks")
_MTP_LAYOUTS = "TP, SP, PP, DP and EP"
_DSA_COMPILE = ("--compile with sparse attention is not built yet (the compiled loss is the next-token loss, without "
                "the indexers' loss)")
_MTP_COMPILE = "--compile with multi-token prediction is not built yet (the compiled loss is the next-token loss)"
_MTP_STAGES = ("multi-token prediction trains with the language-model loss of pre-training and fine-tuning; with a "
               "preference or reward stage, or LoRA adapters, it is not built yet")
_MTP_STAGES_INSTEAD = "leave --mtp-num-layers out"


def _mtp(a) -> bool:
    return bool(getattr(a, "mtp_num_layers", None))


def _moe(a) -> bool:
    return getattr(a, "num_experts", None) is not None


def _ulysses_short_of_kv_heads(a) -> bool:
    """Ulysses splits the heads each TP rank holds: the query heads divide, the key/value heads do not."""
    cp, algo = getattr(a, "context_parallel_size", 1) or 1, getattr(a, "context_parallel_algo", None)
    degree = cp if algo == "ulysses_cp_algo" else (getattr(a, "ulysses_degree_in_cp", None) or 1) if (
        algo == "hybrid_cp_algo") else 1
    heads = getattr(a, "num_attention_heads", None)
    if cp <= 1 or degree <= 1 or not heads:
        return False
    tp = getattr(a, "tensor_model_parallel_size", 1) or 1
    groups = getattr(a, "num_query_groups", None) or heads
    return (heads // tp) % degree == 0 and max(groups // tp, 1) % degree != 0


# DeepSeek-V3's routers keep their aux-loss-free bias as model state in its folders; here it is
# the trainer's run state, so those folders' MoE layers are not read or written yet

FEATURES: tuple[Feature, ...] = (
    # ---- parallelism --------------------------------------------------------------------
    Feature("data-parallel", "Data parallelism (gradients averaged over ranks in buckets)", "parallelism", (),
            supported("torchrun + gloo/nccl/hccl"), supported("msrun + mccl/nccl/hccl; CPU collectives emulated")),
    Feature("tensor-parallel", "Tensor parallelism", "parallelism", ("--tensor-model-parallel-size",),
            supported("column/row-parallel linears, vocab-parallel embedding and loss"),
            supported("as on PyTorch; CPU collectives emulated"), _gt1("tensor_model_parallel_size")),
    Feature("pipeline-parallel", "Pipeline parallelism (1F1B)", "parallelism",
            ("--pipeline-model-parallel-size", "--num-layer-list"),
            supported("1F1B over send/recv between neighbouring stages; uneven splits with --num-layer-list"),
            emulated(_P2P_EMULATED), _gt1("pipeline_model_parallel_size")),
    Feature("virtual-pipeline", "Virtual (interleaved) pipeline", "parallelism", ("--num-layers-per-virtual-pipeline-stage",),
            supported("Megatron's interleaved 1F1B over the model chunks of each rank"), emulated(_P2P_EMULATED),
            lambda a: a.num_layers_per_virtual_pipeline_stage is not None),
    Feature("sequence-parallel", "Sequence parallelism", "parallelism", ("--sequence-parallel",),
            supported("all-gather / reduce-scatter along the sequence around TP regions"),
            supported("as on PyTorch; CPU collectives emulated"), _on("sequence_parallel")),
    Feature("noop-layers", "No-op layers for uneven pipeline splits", "parallelism", ("--noop-layers",),
            supported("identity layers without parameters at the given positions"),
            supported("identity layers without parameters at the given positions"),
            lambda a: a.noop_layers is not None),
    Feature("ring-attention-cp", "Context parallel: ring attention", "parallelism",
            ("--context-parallel-size", "--context-parallel-algo megatron_cp_algo"),
            supported("load-balanced chunks (r, 2C-1-r); key/value blocks passed around the ring by batched "
                      "isend/irecv; partial attentions merged through their log-sum-exp (composite: torch's CPU "
                      "flash kernel does not differentiate it)"),
            emulated("no native point-to-point: the key/value blocks come by one all-gather (backward a "
                     "reduce-scatter), itself a sum all-reduce with a slot per rank (exact); measured faster and "
                     "fewer wire bytes than C-1 emulated ring steps (benchmarks/bench_context.py)"),
            _cp("megatron_cp_algo")),
    Feature("ulysses-cp", "Context parallel: Ulysses", "parallelism",
            ("--context-parallel-size", "--context-parallel-algo ulysses_cp_algo"),
            supported("all-to-all sequence -> heads and back (gloo/nccl/hccl all_to_all); whole-sequence attention "
                      "on 1/C of the heads"),
            emulated("all-to-all as one sum all-reduce with a slot per rank, 16-bit lanes carried in float32 "
                     "(exact): 2C x the bytes of a native all-to-all"),
            _cp("ulysses_cp_algo")),
    Feature("hybrid-cp", "Context parallel: hybrid (Ulysses + ring)", "parallelism",
            ("--context-parallel-size", "--context-parallel-algo hybrid_cp_algo", "--ulysses-degree-in-cp"),
            supported("Ulysses inside groups of --ulysses-degree-in-cp consecutive CP ranks, the ring across them"),
            emulated("as Ulysses and ring attention on MindSpore's CPU: collectives emulated"),
            _cp("hybrid_cp_algo")),
    Feature("moe", "Mixture of experts (MoE layers)", "parallelism", ("--num-experts",),
            supported("top-k router (softmax/sigmoid, groups, capacity, aux/seq-aux/z losses), experts one by one "
                      "or by grouped matmul, shared expert; with DP, TP, SP, PP, EP and the distributed optimizer "
                      "(CP with MoE: planned)"),
            supported("as on PyTorch"), lambda a: a.num_experts is not None),
    Feature("expert-parallel", "MoE expert parallelism", "parallelism", ("--expert-model-parallel-size",),
            supported("experts cut over EP consecutive DP ranks; expert gradients averaged over the expert-data-"
                      "parallel group"),
            emulated("as on PyTorch; the sub-group collectives are emulated on MindSpore's CPU"),
            _gt1("expert_model_parallel_size")),
    Feature("moe-alltoall-dispatcher", "MoE all-to-all token dispatcher", "parallelism",
            ("--moe-token-dispatcher-type alltoall",),
            supported("uneven all-to-all of the routed rows (gloo/nccl/hccl all_to_all_single); a rank may get none"),
            emulated("all-to-all as one sum all-reduce with a slot per rank pair (exact): EP x the bytes"),
            lambda a: getattr(a, "moe_token_dispatcher_type", None) in ("alltoall", "alltoall_seq")),
    Feature("moe-allgather-dispatcher", "MoE all-gather token dispatcher (the default, as Megatron's)", "parallelism",
            ("--moe-token-dispatcher-type allgather",),
            supported("all-gather of the EP group's tokens and routing, reduce-scatter of the weighted outputs"),
            emulated("sub-group all-gather and reduce-scatter built on all-reduce (exact)"),
            lambda a: a.expert_model_parallel_size > 1 and a.moe_token_dispatcher_type == "allgather"),
    # ---- memory and optimizer -------------------------------------------------------------
    Feature("distributed-optimizer", "Distributed optimizer (ZeRO-1 style sharding over DP)", "memory",
            ("--use-distributed-optimizer",),
            supported("fp32 masters and moments sharded over DP; reduce-scatter gradients, all-gather parameters"),
            supported("as on PyTorch; CPU collectives emulated"), _on("use_distributed_optimizer")),
    Feature("reuse-fp32-param", "Parameter-copy reuse (bf16 params share fp32 master memory)", "memory",
            ("--reuse-fp32-param",),
            supported("the distributed optimizer's fp32 master slice kept as the bf16 parameters plus a 16-bit "
                      "residual (2 bytes per element instead of 4; a value exactly on a bf16 tie moves by one fp32 "
                      "ulp); with --bf16 and --use-distributed-optimizer"),
            planned("needs --bf16, not yet run on a MindSpore GPU/Ascend device",
                    cpu=unsupported("needs --bf16: MindSpore's CPU MatMul has no bfloat16 kernel",
                                    instead="an fp32 master (drop --reuse-fp32-param)")),
            _on("reuse_fp32_param")),
    Feature("swap-attention", "Swap attention activations to host memory", "memory", ("--swap-attention",),
            supported("saved-tensor hooks: the input norm's and self attention's saved tensors copied to host "
                      "memory in forward, back on demand in backward (layers full recompute leaves alone)"),
            unsupported("MindSpore has no hook to offload saved activations to host memory",
                        instead="--recompute-granularity full"),
            _on("swap_attention")),
    Feature("recompute", "Activation recompute (full / selective, uniform / block)", "memory",
            ("--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--recompute-activations"),
            supported("torch.utils.checkpoint (non-reentrant); dropout and TP RNG streams replayed"),
            supported("mindspore.recompute; dropout and TP RNG streams replayed"),
            lambda a: a.recompute_granularity is not None or getattr(a, "recompute_activations", False)),
    Feature("norm-recompute", "Norm recompute", "memory", ("--recompute-norm",),
            supported("each norm's internals recomputed; its output stays, kept by the next projection"),
            supported("as on PyTorch, with mindspore.recompute"), _on("recompute_norm")),
    Feature("recompute-in-advance", "Recompute in advance (overlapped with pipeline bubbles)", "memory",
            ("--recompute-in-advance",),
            planned("not built: recompute runs inside each backward; running it ahead needs an asynchronous "
                    "pipeline schedule", instead="--recompute-granularity full"),
            planned("not built: as on PyTorch", instead="--recompute-granularity full"),
            _on("recompute_in_advance")),
    Feature("muon", "The Muon optimizer (--optimizer muon), AdamW for the rest", "optimizer", ("--optimizer muon",),
            supported(_MUON), supported(_MUON),
            lambda a: getattr(a, "optimizer", None) in ("muon", "dist_muon")),
    Feature("muon-tensor-parallel", "Muon under tensor parallelism (whole matrices gathered)", "optimizer",
            ("--muon-tp-mode",), supported(_MUON_TP), supported(_MUON_TP),
            lambda a: getattr(a, "optimizer", "adam") != "adam" and getattr(a, "tensor_model_parallel_size", 1) > 1
            and getattr(a, "muon_tp_mode", None) in ("duplicated", "distributed")),
    Feature("dist-muon", "Muon's layer-wise distributed optimizer", "optimizer",
            ("--optimizer dist_muon", "--use-distributed-optimizer"), supported(_DIST_MUON), supported(_DIST_MUON),
            lambda a: getattr(a, "optimizer", "adam") == "dist_muon" or (
                getattr(a, "optimizer", "adam") == "muon" and bool(getattr(a, "use_distributed_optimizer", False)))),
    Feature("qk-clip", "QK-clip (MuonClip): attention logits held under a threshold", "optimizer",
            ("--qk-clip", "--qk-clip-threshold", "--qk-clip-alpha"), supported(_QK_CLIP), supported(_QK_CLIP),
            _on("qk_clip")),
    Feature("low-precision-optimizer-states", "Low-precision optimizer states (Megatron's precision-aware "
            "optimizer)", "memory", ("--use-precision-aware-optimizer", "--exp-avg-dtype", "--exp-avg-sq-dtype"),
            supported(_LOW_PRECISION_STATES), supported(_LOW_PRECISION_STATES),
            lambda a: getattr(a, "exp_avg_dtype", "fp32") != "fp32" or getattr(a, "exp_avg_sq_dtype", "fp32") != "fp32"),
    Feature("o2-bf16-optimizer", "O2 BF16 optimizer (bf16 optimizer states)", "memory", ("--o2-optimizer",),
            supported("Adam moments kept in bf16, widened to fp32 for each update (with --bf16; also sharded by the "
                      "distributed optimizer)"),
            _bf16_only_on_mindspore("fp32 moments (drop --o2-optimizer)"),
            _on("o2_optimizer")),
    Feature("bf16", "bfloat16 training", "precision", ("--bf16",),
            supported("bf16 parameters and activations, fp32 master weights, moments and softmax"),
            planned("not yet run on a MindSpore GPU/Ascend device",
                    cpu=unsupported("MindSpore's CPU MatMul has no bfloat16 kernel", instead="fp32 (drop --bf16)")),
            _on("bf16")),
    Feature("fp16", "float16 training with loss scaling", "precision", ("--fp16", "--initial-loss-scale"),
            supported("fp16 parameters with dynamic loss scaling and fp32 master weights"),
            planned("not yet run on a MindSpore GPU/Ascend device",
                    cpu=unsupported("MindSpore's CPU MatMul has no float16 kernel", instead="fp32 (drop --fp16)")),
            _on("fp16")),
    # ---- fused operators ------------------------------------------------------------------
    Feature("flash-attention", "Fused attention (flash attention)", "fused-ops", ("--use-flash-attn",),
            supported("torch scaled_dot_product_attention (math kernel on CPU)",
                      cuda=supported(f"torch scaled_dot_product_attention flash/efficient kernels; {_UNTESTED}"),
                      npu=emulated(f"torch scaled_dot_product_attention as torch_npu provides it; {_UNTESTED}")),
            emulated("composite softmax(QK^T)V: MindSpore's FlashAttentionScore is not bound (it has no CPU "
                     "kernel, and the Ascend binding has had no device to run on)"),
            _on("use_flash_attn")),
    Feature("flash-attention-varlen", "Attention on packed variable-length sequences (document mask)", "fused-ops",
            ("--reset-attention-mask", "--reset-position-ids"),
            supported("SDPA (or the composite) with a block-diagonal causal mask from the documents' ids; no "
                      "variable-length kernel is bound on CPU"),
            emulated("the composite attention with a block-diagonal causal mask from the documents' ids"),
            _on("reset_attention_mask")),
    Feature("fused-rmsnorm", "Fused RMSNorm", "fused-ops", ("--use-fused-rmsnorm",),
            supported("torch F.rms_norm", npu=supported(f"torch_npu npu_rms_norm; {_UNTESTED}")),
            emulated("composite: RmsNorm has no CPU/GPU kernel", npu=supported(f"ops.rms_norm; {_UNTESTED}")),
            _on("use_fused_rmsnorm")),
    Feature("fused-layernorm", "Fused LayerNorm (always on, as in Megatron)", "fused-ops", (),
            supported("torch F.layer_norm"), emulated("composite: not bound to a MindSpore LayerNorm kernel yet")),
    Feature("fused-swiglu", "Fused SwiGLU", "fused-ops", ("--use-fused-swiglu",),
            emulated("composite: torch has no SwiGLU kernel on CPU/CUDA",
                     npu=supported(f"torch_npu npu_swiglu; {_UNTESTED}")),
            emulated("composite: Swiglu has no CPU/GPU kernel", npu=supported(f"ops.swiglu; {_UNTESTED}")),
            _on("use_fused_swiglu")),
    Feature("fused-rope", "Fused rotary position embedding", "fused-ops", ("--use-fused-rotary-pos-emb",),
            emulated("composite: torch has no rotary kernel on CPU/CUDA",
                     npu=supported(f"torch_npu npu_rotary_mul; {_UNTESTED}")),
            emulated("composite: RotaryPositionEmbedding is not bound (no CPU kernel; Ascend untested)"),
            _on("use_fused_rotary_pos_emb")),
    Feature("gmm", "Grouped matmul for MoE experts", "fused-ops", ("--moe-grouped-gemm",),
            supported("torch._grouped_mm: every local expert in one kernel call, its backward two more (the input "
                      "and weight gradients; the CPU kernel has none of its own), the same bits as a matmul per "
                      "expert in float32; a matmul per expert where the kernel does not take the shapes (rows not "
                      "16-byte aligned) and on releases without it (torch 2.6)",
                      npu=emulated(f"a matmul per expert: torch_npu's npu_grouped_matmul is not bound; {_UNTESTED}")),
            emulated("composite (one matmul per expert): MindSpore's grouped matmul has no CPU kernel",
                     npu=emulated(f"a matmul per expert: ops.grouped_matmul (Ascend) is not bound; {_UNTESTED}")),
            _on("moe_grouped_gemm")),
    Feature("matmul-add", "Fused weight-gradient accumulation (matmul + add in fp32)", "fused-ops",
            ("--gemm-gradient-accumulation-fusion",),
            supported(_MATMUL_ADD), supported(_MATMUL_ADD), _on("gemm_gradient_accumulation_fusion")),
    Feature("fused-adamw", "Fused AdamW step (always on, as MindSpeed's fused Adam)", "fused-ops", (),
            supported("torch._fused_adamw_ (CPU and CUDA kernel)",
                      npu=supported(f"torch._fused_adamw_ as torch_npu provides it; {_UNTESTED}")),
            supported("AdamWeightDecay kernel, bias correction folded into its learning rate and epsilon",
                      npu=supported(f"AdamWeightDecay; {_UNTESTED}"))),
    # ---- compilation --------------------------------------------------------------------------
    Feature("compile", "Compiled training step (--compile)", "compilation", ("--compile",),
            supported("torch.compile (Inductor) of the loss; AOTAutograd compiles its backward"),
            supported("mindspore.jit trace capture of the loss, parameters as graph inputs; the backward is "
                      "MindSpore's autodiff of the traced graph; dropout masks drawn on the host each step and "
                      "passed in"),
            _on("compile")),
    Feature("compile-tensor-parallel", "Compiled step with tensor (and sequence) parallelism", "compilation",
            ("--compile", "--tensor-model-parallel-size"),
            supported("the collectives' autograd Functions run inside the compiled graph", since=(2, 13),
                      older="torch 2.6's Inductor computes a wrong word-embedding gradient in the tensor-parallel "
                            "model (the first-step check stops it); releases between are untested",
                      instead="--compile with data parallelism only, or tensor parallelism without --compile"),
            supported("trace capture ignores hand-written backwards, so the collectives run their traced "
                      "formulation (InsertGradientOf for the gradient sums)"),
            lambda a: bool(getattr(a, "compile", False)) and (a.tensor_model_parallel_size or 1) > 1),
    Feature("compile-pipeline", "Compiled step with pipeline parallelism", "compilation",
            ("--compile", "--pipeline-model-parallel-size"),
            supported("each model chunk's forward is torch.compile'd and run through autograd like an eager one",
                      since=(2, 13),
                      older="torch 2.6's Inductor computed a wrong word-embedding gradient at PP2 (measured on an "
                            "AVX-512 CPU; the first-step check stops it); releases between are untested",
                      instead="pipeline parallelism without --compile"),
            supported("each model chunk's forward is traced; an interleaved micro-batch's forward graph runs again, "
                      "with the same draws, when its backward comes (as eager records it again)"),
            lambda a: bool(getattr(a, "compile", False)) and (a.pipeline_model_parallel_size or 1) > 1),
    # ---- communication ----------------------------------------------------------------------
    Feature("collectives", "Collectives: all-reduce, all-gather, reduce-scatter, all-to-all, broadcast, send/recv",
            "communication", (),
            supported("gloo / nccl / hccl; gloo has no reduce-scatter, so there it is all-reduce + slice"),
            supported("", cpu=emulated("mccl has only float32 SUM AllReduce on sub-groups; the rest is composed "
                                       "from it with identical results"),
                      cuda=emulated("composed from AllReduce until native NCCL bindings are tested"),
                      npu=emulated("composed from AllReduce until native HCCL bindings are tested"))),
    Feature("grad-reduce-overlap", "Overlap gradient reduction with backward", "communication",
            ("--overlap-grad-reduce",),
            supported(_OVERLAP.format("gloo's / nccl's asynchronous all-reduce")),
            supported(_OVERLAP.format("mccl's asynchronous all-reduce (mint.distributed)")), _on("overlap_grad_reduce")),
    Feature("param-gather-overlap", "Overlap parameter all-gather with forward", "communication",
            ("--overlap-param-gather",), supported(_PARAM_GATHER.format("gloo's / nccl's asynchronous all-gather")),
            supported(_PARAM_GATHER.format("the emulated gather on mccl's asynchronous all-reduce")),
            _on("overlap_param_gather")),
    Feature("mc2", "MC2: matmul fused with all-gather / reduce-scatter", "communication", ("--use-ascend-mc2",),
            planned(_NPU_ONLY, cpu=unsupported(_NPU_ONLY), cuda=unsupported(_NPU_ONLY)),
            unsupported("MC2 kernels are only reachable from torch_npu", instead="plain tensor parallel"),
            _on("use_ascend_mc2")),
    Feature("coc", "CoC: communication-over-computation overlap", "communication",
            ("--use-ascend-coc", "--coc-fused-kernel"),
            planned(_NPU_ONLY, cpu=unsupported(_NPU_ONLY), cuda=unsupported(_NPU_ONLY)),
            planned(_NPU_ONLY, cpu=unsupported(_NPU_ONLY), cuda=unsupported(_NPU_ONLY)),
            lambda a: bool(getattr(a, "use_ascend_coc", False) or getattr(a, "coc_fused_kernel", False))),
    Feature("cp-send-recv-overlap", "Ring attention's send/receive overlapped with its compute", "communication",
            ("--use-cp-send-recv-overlap",), supported(_RING_OVERLAP.format("a batch of isend/irecv")),
            supported(_RING_OVERLAP.format("the one all-gather of every block, on mccl's asynchronous "
                                           "all-reduce, travelling while this rank's own block computes")),
            _on("use_cp_send_recv_overlap")),
    Feature("moe-alltoall-overlap", "MoE all-to-all overlapped with the experts' compute", "communication",
            ("--moe-alltoall-overlap-comm",), supported(_A2A_OVERLAP.format("gloo/nccl's asynchronous all_to_all")),
            supported(_A2A_OVERLAP.format("the emulated exchange on mccl's asynchronous all-reduce")),
            _on("moe_alltoall_overlap_comm")),
    Feature("moe-fb-overlap", "One micro-batch's MoE all-to-all beside another's compute (--moe-fb-overlap)",
            "communication", ("--moe-fb-overlap",), supported(_FB_OVERLAP.format("gloo/nccl's asynchronous all_to_all")),
            supported(_FB_OVERLAP.format("the emulated exchange on mccl's asynchronous all-reduce")),
            _on("moe_fb_overlap")),
    Feature("moe-zero-memory", "MoE dispatch recomputed instead of kept (--moe-zero-memory)", "memory",
            ("--moe-zero-memory level0", "--moe-zero-memory level1"), supported(_ZERO_MEMORY), supported(_ZERO_MEMORY),
            lambda a: (getattr(a, "moe_zero_memory", None) or "disable") != "disable"),
    Feature("gloo-ckpt-offload", "Checkpoint gathering without a Gloo group", "communication",
            ("--disable-gloo-group",), supported(_NO_GLOO_GROUP), supported(_NO_GLOO_GROUP), _on("disable_gloo_group")),
    # ---- operations ---------------------------------------------------------------------------
    Feature("exit-signal-handler", "A last checkpoint on SIGTERM / SIGINT (preemption)", "operations",
            ("--exit-signal-handler",),
            supported("every rank finishes its step, the ranks agree on the signal, save, and exit with 128 + its "
                      "number; a rank killed outright cannot be saved from"), supported("as on PyTorch"),
            _on("exit_signal_handler")),
    Feature("profiling", "Profiling a window of steps, top operators by time", "operations", ("--profile",),
            supported("torch.profiler (torch_npu.profiler on Ascend): a Chrome trace per rank (chrome://tracing, "
                      "Perfetto, TensorBoard's plugin); --profile-level applies on Ascend only"),
            supported("mindspore.profiler: its folder per rank (MindStudio Insight, MindInsight; trace_view.json "
                      "is a Chrome trace), operator times from its statistics"), _on("profile")),
    Feature("deterministic", "Deterministic computing (same seed, same losses bit for bit)", "operations",
            ("--use-deterministic-algorithms", "--use-deterministic-comm"),
            supported("torch.use_deterministic_algorithms, cuDNN without autotuning, a fixed cuBLAS workspace, "
                      "HCCL_DETERMINISTIC on Ascend; gloo and NCCL reduce in a fixed order for a fixed layout"),
            supported("mindspore.set_deterministic before communication starts, HCCL_DETERMINISTIC on Ascend"),
            lambda a: bool(getattr(a, "use_deterministic_algorithms", False) or getattr(a, "use_deterministic_comm",
                                                                                       False))),
    Feature("tensorboard", "TensorBoard event files", "operations", ("--tensorboard-dir",),
            supported("written by our own writer (no TensorFlow or torch needed): Megatron's scalars and names"),
            supported("as on PyTorch"), _on("tensorboard_dir")),
    Feature("wandb", "Weights & Biases logging (offline)", "operations", ("--wandb-project",),
            supported("the TensorBoard scalars, in offline mode (wandb sync uploads them later)"),
            supported("as on PyTorch"), _on("wandb_project")),
    Feature("rng-tracker", "Named RNG states (tensor-parallel dropout)", "operations", (),
            supported("torch generator states"),
            emulated("MindSpore's CPU random kernels cannot be replayed from a saved state; the facade draws "
                     "random masks from its own generator")),
    Feature("sharded-checkpoints", "Sharded checkpoints: every rank writes its pieces, resume at any layout reads "
            "its slices", "operations", ("--save", "--load", "--save-whole"),
            supported("per-rank safetensors and one JSON index; SHA-256 per file and per piece; TP / PP / VPP / DP / "
                      "EP / CP and the distributed optimizer may all change on resume; --save-whole writes the "
                      "gathered single-file format, which stays loadable"), supported("as on PyTorch")),
    Feature("async-save", "Asynchronous checkpoint saves", "operations", ("--async-save",),
            supported("a thread per rank writes a host copy taken between steps; published (tracker moved) after "
                      "every rank's file is durable, checked after each step; a kill leaves the previous checkpoint"),
            supported("as on PyTorch"), _on("async_save")),
    Feature("safetensors-io", "Framework-neutral tensor files (safetensors + JSON metadata)", "operations", (),
            supported(), supported()),
    # ---- inference ----------------------------------------------------------------------------
    Feature("streaming-inference", "Streaming generation", "inference", ("--stream",),
            supported("`mindspeed generate --stream`: each token printed as it is drawn"),
            supported("as on PyTorch"), _on("stream")),
    Feature("greedy-generation", "Generation: greedy decoding", "inference", ("--task greedy",),
            supported("`mindspeed generate`; batched prompts padded on the left; tensor and pipeline parallel via "
                      "`mindspeed launch -- generate`"),
            supported("as on PyTorch"), _task("greedy")),
    Feature("sampling-generation", "Generation: sampling (temperature, top-k, top-p)", "inference",
            ("--task do_sample",), supported("seeded host draws: every tensor-parallel rank picks the same token"),
            supported("as on PyTorch"), _task("do_sample")),
    Feature("beam-search", "Generation: beam search", "inference", ("--task beam_search",
                                                                    "--task beam_search_with_sampling"),
            supported("log-probability over length ** --length-penalty, as transformers' generate(num_beams=...); "
                      "with sampling: the candidates drawn as transformers' beam sampling draws them"),
            supported("as on PyTorch"),
            _task("beam_search", "beam_search_with_sampling")),
    Feature("pipeline-inference", "Generation and evaluation at a pipeline layout", "inference",
            ("--pipeline-model-parallel-size",),
            supported("`mindspeed launch -- generate|evaluate`: the stages run one after another as one model (with "
                      "tensor parallelism inside them), each keeping its layers' key/value cache; the last stage's "
                      "logits go to every stage, where the same tokens are drawn"),
            emulated("send/recv and the logits' broadcast emulated by sum all-reduces over the pipeline's group "
                     "(exact)"),
            lambda a: hasattr(a, "max_new_tokens") and _gt1("pipeline_model_parallel_size")(a)),
    Feature("sliced-inference-load", "Generation and evaluation reading each rank's slices of a checkpoint",
            "inference", ("--load",), supported(_SLICED_LOAD), supported(_SLICED_LOAD)),
    Feature("data-parallel-evaluation", "Evaluation on several copies of the model", "inference", (),
            supported(_DP_EVALUATION), supported(_DP_EVALUATION)),
    Feature("kv-cache", "Key/value cache for generation", "inference", (),
            supported("preallocated per layer (this rank's key/value heads); on unless --no-kv-cache"),
            supported("as on PyTorch"), _on("use_kv_cache")),
    Feature("compiled-decode", "Generation: each decode step one compiled graph", "inference", ("--decode-graph always",),
            planned("eager decoding (torch's cost per operation is a few microseconds; a torch.compile'd step is "
                    "not measured yet)"),
            supported("mindspore.jit trace capture, one graph per batch and cache capacity (a multiple of 64), "
                      "compiled once that size has run 128 decode steps eagerly and checked against eager on its "
                      "first step (--decode-graph always: at once); not with sliding windows or MoE (eager "
                      "there)"), lambda a: getattr(a, "decode_graph", "auto") == "always"),
    Feature("chat", "Chat (multi-turn, chat templates)", "inference", ("--task chat",),
            supported("one process: --prompt-type templates or the tokenizer's Hugging Face chat template (jinja2 "
                      "sandbox), --history-turns, /clear and /exit (and MindSpeed-LLM's clear, new; q, exit, quit)"),
            supported("as on PyTorch"), _task("chat")),
    Feature("benchmark-evaluation", "Evaluation: MMLU, CEval, BoolQ (option likelihood), GSM8K (generated answer)",
            "inference", ("--task mmlu", "--task ceval", "--task gsm8k", "--task boolq"),
            supported("mindspeed evaluate, one process: k-shot prompts, batched, "
                      "per-subject and overall accuracy"),
            supported("as on PyTorch"), _task("mmlu", "ceval", "gsm8k", "boolq")),
    Feature("perplexity", "Evaluation: perplexity of a text or indexed dataset", "inference", ("--task perplexity",),
            supported("mindspeed evaluate: windows of the model's positions, the model's own (vocabulary-parallel "
                      "under TP) cross entropy"),
            supported("as on PyTorch"), _task("perplexity")),
    Feature("rope-scaling-flags", "RoPE scaling set by flags (linear, llama3, dynamic NTK)", "inference",
            ("--rope-scaling-type linear", "--rope-scaling-type llama3", "--rope-scaling-type dynamic"),
            supported("the model's rope_scaling from the flags (or a Hugging Face config's); dynamic NTK grows the "
                      "base past max_position_embeddings"),
            supported("as on PyTorch (tables built on the host)"),
            lambda a: a.rope_scaling_type in ("linear", "llama3", "dynamic")),
    Feature("yarn", "YaRN RoPE scaling", "inference", ("--rope-scaling-type yarn",),
            supported("YaRN frequencies and attention temperature (betas, mscale), from the flags or a Hugging "
                      "Face config"),
            supported("as on PyTorch (tables built on the host)"), _eq("rope_scaling_type", "yarn")),
    Feature("longrope", "LongRoPE scaling (Phi-3 / Phi-3.5)", "inference", ("--rope-scaling-type longrope",
                                                                            "--long-factor", "--short-factor"),
            supported("per-dimension factors, the short list's up to the original length and the long list's past "
                      "it (chosen by the furthest position, as transformers does), the attention scale; from the "
                      "flags (MindSpeed-LLM's) or a Hugging Face config"),
            supported("as on PyTorch (tables built on the host)"), _eq("rope_scaling_type", "longrope")),
    Feature("sliding-window-attention", "Sliding-window attention (Gemma 2/3's, Mistral's, Qwen's)", "models",
            ("--sliding-window", "--interleave-sliding-window", "--window-size", "--window-attn-skip-freq"),
            supported("a query sees itself and the window - 1 tokens before it, in every layer (--sliding-window) "
                      "or every other one from the first (--interleave-sliding-window, Gemma 2's; megatron-core's "
                      "--window-size L,0 with --window-attn-skip-freq N: all but every N-th); one more mask "
                      "of the attention op, so packed documents, the KV cache, TP/SP/PP and ring, Ulysses and "
                      "hybrid CP keep it exactly"),
            supported("as on PyTorch (the composite attention with the window's mask)"),
            lambda a: bool(getattr(a, "sliding_window", None) or getattr(a, "interleave_sliding_window", None)
                           or getattr(a, "window_size", None))),
    Feature("logit-softcapping", "Soft-capping of attention scores and output logits (Gemma 2)", "models",
            ("--attn-logit-softcapping", "--output-logit-softcapping"),
            supported("cap * tanh(x / cap) on each attention score before the masks (the composite attention: "
                      "SDPA has no soft-capping) and on the output logits; per element, so TP's vocabulary shards "
                      "and CP's ring blocks cap exactly as the whole does"),
            supported("as on PyTorch"),
            lambda a: bool(getattr(a, "attn_logit_softcapping", None) or getattr(a, "output_logit_softcapping", None))),
    Feature("attention-sinks", "Attention sinks: a learned logit per head in each softmax (GPT-OSS)", "models",
            ("--softmax-type learnable",),
            supported("megatron-core's learnable softmax offset (self_attention.core_attention.softmax_offset): "
                      "each head's weights shrink by sigmoid(lse - sink) from the attention's log-sum-exp, exact "
                      "for every attention path that returns it (TP splits the sinks by head; SP, PP, the KV "
                      "cache); with context parallelism it is not built (GPT-OSS is MoE, which CP refuses)"),
            supported("as on PyTorch"), _eq("softmax_type", "learnable")),
    Feature("chunk-loss", "The output layer and the loss a sequence chunk at a time (--loss-compute-mode chunk)",
            "memory", ("--loss-compute-mode chunk", "--loss-chunk-size"),
            supported(_CHUNK_LOSS), supported(_CHUNK_LOSS), _eq("loss_compute_mode", "chunk")),
    Feature("mg2hf-convert", "A Hugging Face folder of the model after each save (--enable-mg2hf-convert)",
            "checkpointing", ("--enable-mg2hf-convert", "--only-convert-last-checkpoint", "--hf-save-dir",
                              "--hf-cfg-dir"),
            supported("training/checkpoint_manager.py: the whole model gathered after each save (or the last) and "
                      "written by rank 0 as <--hf-save-dir or --save>/mg2hf_iteration<N>, with --hf-cfg-dir's "
                      "tokenizer files; the family's config.json and tensors (compat/hf.py)"),
            supported("as on PyTorch"), _on("enable_mg2hf_convert")),
    Feature("triton-gdn", "Gated DeltaNet's fused kernels (flash-linear-attention's Triton chunked rule)",
            "fused-ops", ("--use-triton-gdn",),
            emulated(_GDN_COMPOSITE), emulated(_GDN_COMPOSITE), _on("use_triton_gdn")),
    Feature("gated-deltanet", "Gated DeltaNet linear attention in hybrid models (Qwen3-Next, Qwen3.5)", "models",
            ("--full-attention-interval", "--linear-num-key-heads", "--linear-num-value-heads", "--linear-key-head-dim",
             "--linear-value-head-dim", "--mamba-d-conv", "--mamba-chunk-size"),
            supported("models/gated_deltanet.py: the delta rule by chunks (a unit-triangular solve per chunk, the "
                      "WY/UT form) for training and prefill, a token at a time with the cache's state for decoding, "
                      "equal values; the short causal convolution, L2-normed q/k, the gated RMSNorm. Tensor "
                      "parallelism cuts it by heads (in_proj's q, k, v, z, b, a slices, the convolution's channels, "
                      "out_proj's columns), with sequence parallelism around it; TP2, TP2 + SP, PP2 and TP2 x PP2 "
                      "generation equal one process. Context parallelism is refused: the state runs along the "
                      "whole sequence (a hand-over between CP ranks is not built), as are packed sequences"),
            supported("as on PyTorch"), lambda a: getattr(a, "full_attention_interval", None) is not None),
    Feature("attention-output-gate", "Gated attention: each head's output times sigmoid of its own gate "
            "(Qwen3-Next)", "models", (),
            supported("megatron-core's attention_output_gate: linear_qkv holds each query group's heads, their "
                      "gates, the key and the value, so tensor parallelism splits it by group as before"),
            supported("as on PyTorch"), None),
    Feature("hf-gpt-oss", "GPT-OSS folders: biased experts with the clamped quick-GEGLU, MXFP4 experts read "
            "dequantised", "compatibility", (),
            supported("gpt_oss config.json and weights both ways: sinks, alternating sliding windows, YaRN, the "
                      "router's bias, experts' gate/up columns de-interleaved with their biases "
                      "(megatron-core's --quick-geglu, glu_linear_offset 1, activation_func_clamp_value); the "
                      "released MXFP4 blocks and scales are dequantised exactly on load and written back in "
                      "float"),
            supported("as on PyTorch"), None),
    # ---- data and tools -------------------------------------------------------------------
    *(
        Feature(f"handler-{slug}", f"Data handler {name}", "data", (f"--handler-name {name}",),
                supported(f"mindspeed preprocess: {what}; framework-free"), supported("as on PyTorch"),
                _eq("handler_name", name))
        for slug, name, what in HANDLER_ROWS
    ),
    # ---- fine-tuning and alignment ------------------------------------------------------------
    Feature("sft", "Instruction fine-tuning (--stage sft)", "fine-tuning", ("--stage sft", "--is-instruction-dataset"),
            supported("loss on the assistant's tokens only; packed conversations kept apart (positions and "
                      "attention); every parallel layout pre-training has"),
            supported("as on PyTorch"), lambda a: getattr(a, "stage", None) == "sft" or
            bool(getattr(a, "is_instruction_dataset", False))),
    Feature("lora", "LoRA adapters", "fine-tuning", ("--lora-r", "--lora-alpha", "--lora-dropout",
                                                     "--lora-target-modules", "--lora-load"),
            supported("adapters on linear_qkv/linear_proj/linear_fc1/linear_fc2, base weights frozen (no optimizer "
                      "state); under TP and SP without added collectives; --lora-load resumes; merged into the "
                      "base weights for generation and Hugging Face export; dense models only"),
            supported("as on PyTorch"),
            lambda a: getattr(a, "lora_r", None) is not None or getattr(a, "lora_target_modules", None) is not None),
    Feature("stage-dpo", "Direct preference optimisation (--stage dpo)", "fine-tuning",
            ("--stage dpo", "--dpo-loss-type", "--dpo-beta", "--dpo-label-smoothing"),
            supported("sigmoid, hinge and ipo losses; the reference is the starting model, its log-likelihoods "
                      "computed once before the first step and kept in checkpoints; pairs stay whole in micro-batches "
                      "and across pipeline stages; TP, SP, PP, DP and LoRA (not CP)"),
            supported("as on PyTorch"), _eq("stage", "dpo")),
    Feature("stage-simpo", "SimPO (--stage simpo)", "fine-tuning", ("--stage simpo", "--simpo-beta", "--simpo-gamma"),
            supported("reference-free, length-normalised rewards with a target margin; DPO's path through the "
                      "layouts (PP2 checked against one process)"),
            supported("as on PyTorch"), _eq("stage", "simpo")),
    Feature("stage-orm", "Outcome reward model (--stage orm / rm)", "fine-tuning", ("--stage orm", "--stage rm"),
            supported("pairwise Bradley-Terry loss on a scalar head (rm_head) read at each reply's last token; "
                      "starts from a language model's weights; TP + SP checked against one process"),
            supported("as on PyTorch"), lambda a: getattr(a, "stage", None) in ("orm", "rm")),
    Feature("stage-prm", "Process reward model (--stage prm)", "fine-tuning", ("--stage prm", "--reward-tokens"),
            supported("cross entropy over the --reward-tokens' logits where each step ends; TP2 x PP2 checked "
                      "against one process"),
            supported("as on PyTorch"), _eq("stage", "prm")),
    Feature("stage-grpo", "Online RL: GRPO with rollouts from the policy (--stage grpo)", "fine-tuning",
            ("--stage grpo", "--num-generations", "--reward-funcs", "--kl-coef", "--grpo-loss-type"),
            supported("rollouts drawn by the trained weights in the same processes (KV cache, sampling), rewards: "
                      "exact final answer, <think> format, a Python function or an outcome reward model (cut for TP); "
                      "group-relative advantages, clipped ratio, k3 KL to the starting weights (kept on the host); "
                      "grpo, bnpo, dr_grpo and dapo averaging, loss and gradients equal to TRL's; TP, PP, CP and DP"),
            supported("as on PyTorch"), _eq("stage", "grpo")),
    Feature("weight-conversion", "Hugging Face <-> Megatron-core weight conversion with re-sharding", "tools",
            ("--load-model-type", "--save-model-type"),
            supported("mindspeed convert: hf <-> mg (Megatron's legacy layout, TP / PP / VPP / EP, no-op layers, "
                      "fp32 / bf16 / fp16) and mg -> mg; .pt files read without torch and without running code "
                      "from them; mindspeed train --load takes a Megatron folder; framework-free"),
            supported("as on PyTorch"),
            lambda a: a.load_model_type is not None or a.save_model_type is not None),
    # ---- MindSpeed-LLM options not built yet ---------------------------------------------------
    Feature("transformer-engine", "NVIDIA Transformer Engine layers", "compatibility", ("--transformer-impl",),
            unsupported("the layers here are the local implementation", instead="--transformer-impl local"),
            unsupported("the layers here are the local implementation", instead="--transformer-impl local"),
            _eq("transformer_impl", "transformer_engine")),
    Feature("ckpt-format-torch-dist", "Megatron's distributed checkpoint format torch_dist, both ways",
            "compatibility", ("--ckpt-format torch_dist",), supported(_TORCH_DIST), supported("as on PyTorch"),
            _eq("ckpt_format", "torch_dist")),
    Feature("ckpt-format-other", "Megatron's other checkpoint formats (zarr, fsdp_dtensor)", "compatibility",
            ("--ckpt-format zarr", "--ckpt-format fsdp_dtensor"), planned(_DIST_CKPT, instead="--ckpt-format torch"),
            planned(_DIST_CKPT, instead="--ckpt-format torch"),
            lambda a: getattr(a, "ckpt_format", "torch") in ("zarr", "fsdp_dtensor")),
    Feature("family-phimoe", "Phi-3.5-MoE (PhiMoE: SparseMixer routing) in generation, evaluation and conversion",
            "compatibility", ("--model-type-hf phi3.5-moe", "--moe-router-load-balancing-type sparsemixer_topk"),
            supported(_PHIMOE), supported(_PHIMOE),
            lambda a: getattr(a, "model_type_hf", None) == "phi3.5-moe"
            or getattr(a, "moe_router_load_balancing_type", None) == "sparsemixer_topk"),
    Feature("sparsemixer-training", "Training with SparseMixer routing (Phi-3.5-MoE's sampled choice)", "compatibility",
            ("--moe-router-load-balancing-type sparsemixer_topk",),
            supported(_SPARSEMIXER_TRAINING), supported(_SPARSEMIXER_TRAINING),
            lambda a: getattr(a, "moe_router_load_balancing_type", None) == "sparsemixer_topk"),
    Feature("hf-deepseek-v3-moe", "DeepSeek-V3's MoE layers in Hugging Face folders (e_score_correction_bias)",
            "compatibility", ("--model-type-hf deepseek3",),
            supported("sigmoid scores, top-k within the best groups, each router's e_score_correction_bias read "
                      "into and written from its expert bias (model state, moved by the loads in training)"),
            supported("as on PyTorch"),
            lambda a: getattr(a, "model_type_hf", None) == "deepseek3" and getattr(a, "num_experts", None) is not None),
    Feature("family-minimax-m2", "MiniMax-M2 (q/k norms over all heads, partial RoPE, sigmoid-routed experts with "
            "the expert bias)", "compatibility",
            ("--model-type-hf minimax_m2", "--spec mindspeed_llm.tasks.models.spec.minimax_spec layer_spec"),
            supported(_MINIMAX_M2), supported(_MINIMAX_M2),
            lambda a: getattr(a, "model_type_hf", None) == "minimax_m2"
            or "minimax_spec" in " ".join(getattr(a, "spec", None) or ())),
    Feature("dsa-indexer", "DeepSeek sparse attention: the lightning indexer's top-k keys (DeepSeek-V3.2, GLM-5)",
            "models", ("--enable-dsa-indexer", "--index-topk", "--index-n-heads", "--index-head-dim"),
            supported(_DSA), supported(_DSA), _on("enable_dsa_indexer")),
    Feature("dsa-indexer-loss", "Sparse attention's indexer loss (KL to the main attention over the chosen keys)",
            "models", ("--indexer-loss-coeff",), supported(_DSA_LOSS), supported(_DSA_LOSS),
            lambda a: bool(getattr(a, "enable_dsa_indexer", False)) and getattr(a, "indexer_loss_coeff", 1.0) != 0),
    Feature("dsa-dense-warmup", "Sparse attention's dense warm-up stage (the indexers trained alone)", "models",
            ("--indexer-dense-warmup",), supported(_DSA_WARMUP), supported(_DSA_WARMUP), _on("indexer_dense_warmup")),
    Feature("dsa-shared-topk", "GLM-5's layers sharing an earlier layer's top-k", "models",
            ("--index-topk-freq", "--index-skip-topk-offset", "--index-topk-pattern"),
            supported(_DSA_SHARED), supported(_DSA_SHARED),
            lambda a: (getattr(a, "index_topk_freq", None) or 1) > 1 or getattr(a, "index_topk_pattern", None)),
    Feature("sparse-flash-attention", "Sparse attention kernels (MindSpeed's sparse flash attention, lightning "
            "indexer and its loss)", "fused-ops",
            ("--use-sparse-flash-attn", "--use-fused-lightning-indexer", "--use-fused-lightning-indexer-loss"),
            emulated("composite: the dense scores masked to the chosen keys, the indexer and its loss as tensors "
                     "(the same values); no such kernel on CPU/CUDA, and torch_npu's not bound yet (on Ascend the "
                     "composite too)"),
            emulated("composite (no such kernel on CPU; Ascend's not bound yet: the composite there too)"),
            lambda a: any(getattr(a, f, False) for f in ("use_sparse_flash_attn", "use_fused_lightning_indexer",
                                                         "use_fused_lightning_indexer_loss"))),
    Feature("per-token-loss", "A step's loss averaged over every loss token of the global batch", "fine-tuning",
            ("--calculate-per-token-loss",), supported(_PER_TOKEN), supported(_PER_TOKEN),
            _on("calculate_per_token_loss")),
    Feature("deepseek-v4-hyper-connections", "DeepSeek-V4's manifold-constrained hyper-connections", "models",
            ("--enable-mhc", "--hc-mult"), planned(_V4), planned(_V4),
            lambda a: bool(getattr(a, "enable_mhc", False) or getattr(a, "hc_mult", None))),
    Feature("deepseek-v4-compressed-attention", "DeepSeek-V4's compressed sparse attention and grouped output",
            "models", ("--kv-compress", "--compress-ratios", "--compress-rope-theta", "--o-groups", "--o-lora-rank"),
            planned(_V4), planned(_V4),
            lambda a: any(getattr(a, f, None) for f in ("kv_compress", "compress_ratios", "compress_rope_theta",
                                                        "o_groups", "o_lora_rank"))),
    Feature("deepseek-v4-hash-routing", "DeepSeek-V4's hash-routed MoE layers", "models", ("--n-hash-layers",),
            planned(_V4), planned(_V4), lambda a: bool(getattr(a, "n_hash_layers", None))),
    Feature("family-deepseek-v4", "DeepSeek-V4's Hugging Face folders (deepseek_v4; MindSpeed-LLM's deepseek4)",
            "compatibility", ("--model-type-hf deepseek4",),
            planned(_V4 + ": its hyper-connections, compressed sparse attention and hash routing (the rows above)"),
            planned(_V4 + ": its hyper-connections, compressed sparse attention and hash routing (the rows above)"),
            _eq("model_type_hf", "deepseek4")),
    Feature("convert-tp-extend-ep", "Conversion to experts spread over TP x EP (--moe-tp-extend-ep)", "tools",
            ("--moe-tp-extend-ep",), planned(_TP_EXTEND_CONVERT, instead=_TP_EXTEND_CONVERT_INSTEAD),
            planned(_TP_EXTEND_CONVERT, instead=_TP_EXTEND_CONVERT_INSTEAD), None),
    Feature("hy-v3-group-routing", "Hunyuan-V3's folders routed in groups (MindSpeed-LLM's hunyuan3 script)",
            "compatibility", ("--model-type-hf HYV3", "--moe-router-num-groups"), supported(_HY_GROUPS),
            supported(_HY_GROUPS), lambda a: getattr(a, "model_type_hf", None) in ("HYV3", "hy_v3")
            and (getattr(a, "moe_router_num_groups", None) or 1) > 1),
    Feature("family-ling-v2", "Ling-V2's Hugging Face folders (BailingMoeV2)", "compatibility",
            ("--model-type-hf bailing_mini",), supported(_LING), supported(_LING), _eq("model_type_hf", "bailing_mini")),
    Feature("family-plm", "PLM's Hugging Face folders (model_type plm)", "compatibility", ("--model-type-hf plm",),
            supported(_PLM), supported(_PLM), _eq("model_type_hf", "plm")),
    Feature("squared-relu", "Squared-ReLU MLP activation (PLM's)", "models", ("--squared-relu",),
            supported("relu(x)^2 on fc1's output, ungated (Megatron's --squared-relu)"),
            supported("relu(x)^2 on fc1's output, ungated (Megatron's --squared-relu)"), _on("squared_relu")),
    Feature("magistral-tokenizer", "Magistral's Tekken tokenizer (--tokenizer-type MagistralTokenizer)", "data",
            ("--tokenizer-type MagistralTokenizer",), supported(_TEKKEN), supported(_TEKKEN),
            _eq("tokenizer_type", "MagistralTokenizer")),
    Feature("magistral-template", "Magistral's reasoning prompt type (--prompt-type magistral)", "data",
            ("--prompt-type magistral",), planned(_MAGISTRAL_TEMPLATE, instead=_MAGISTRAL_TEMPLATE_INSTEAD),
            planned(_MAGISTRAL_TEMPLATE, instead=_MAGISTRAL_TEMPLATE_INSTEAD), _eq("prompt_type", "magistral")),
    Feature("family-hy-v3", "Hunyuan-V3 (hy_v3: sigmoid routing with the expert bias, scaled, beside a shared "
            "expert)", "compatibility", ("--model-type-hf HYV3",), supported(_HY_V3), supported(_HY_V3),
            lambda a: getattr(a, "model_type_hf", None) in ("HYV3", "hy_v3")),
    Feature("mla-absorb", "Latent attention over the latent (the up-projection absorbed: --enable-mla-absorb)",
            "models", ("--enable-mla-absorb",), supported(_MLA_ABSORB), supported(_MLA_ABSORB),
            _on("enable_mla_absorb")),
    Feature("mla-lora-scaling", "Latent attention's latents scaled by sqrt(hidden / rank) (LongCat-Flash)", "models",
            ("--enable-mla-scale-q-lora", "--enable-mla-scale-kv-lora"),
            supported(_MLA_SCALE), supported(_MLA_SCALE),
            lambda a: bool(getattr(a, "enable_mla_scale_q_lora", False) or getattr(a, "enable_mla_scale_kv_lora", False))),
    Feature("moe-zero-experts", "Zero-computation experts (LongCat-Flash: a token times its weight)", "models",
            ("--num-zero-experts",), supported(_ZERO_EXPERTS), supported(_ZERO_EXPERTS),
            lambda a: bool(getattr(a, "num_zero_experts", None))),
    Feature("family-longcat-flash", "LongCat-Flash (two attentions and a shortcut-connected MoE a layer)",
            "compatibility", ("--model-type-hf longcat", "--spec mindspeed_llm.tasks.models.spec.longcat_spec layer_spec"),
            supported(_LONGCAT), supported(_LONGCAT),
            lambda a: getattr(a, "model_type_hf", None) == "longcat"
            or "longcat_spec" in " ".join(getattr(a, "spec", None) or ())),
    Feature("family-deepseek-v32", "DeepSeek-V3.2 (deepseek_v32: DeepSeek-V3 with sparse attention)", "compatibility",
            ("--model-type-hf deepseek32",), supported(_V32), supported(_V32), _eq("model_type_hf", "deepseek32")),
    Feature("family-glm5", "GLM-5 (glm_moe_dsa: sparse attention, some layers sharing the top-k)", "compatibility",
            ("--model-type-hf glm5",), supported(_GLM5), supported(_GLM5), _eq("model_type_hf", "glm5")),
    Feature("output-layer-bias", "A bias on the output layer (MindSpeed-LLM's Phi-3.5-MoE)", "compatibility",
            ("--add-output-layer-bias",), supported(_OUTPUT_BIAS), supported(_OUTPUT_BIAS),
            _on("add_output_layer_bias")),
    Feature("moe-input-jitter", "Multiplicative jitter on the router's input (--moe-input-jitter-eps)", "parallelism",
            ("--moe-input-jitter-eps",), supported(_JITTER), supported(_JITTER),
            lambda a: bool(getattr(a, "moe_input_jitter_eps", None))),
    Feature("multi-latent-attention", "Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3)", "models",
            ("--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
             "--v-head-dim", "--mla-fa-without-pad", "--mla-mm-split"),
            supported("models/mla.py: keys and values from one normed latent per token, queries straight or "
                      "through their own latent, the rotated part of the key shared by the heads, values of their "
                      "own width, YaRN's mscale on the softmax scale; the KV cache holds the latent and the rotated "
                      "key; TP splits the up-projections by head; SP, PP and CP (ring, Ulysses) keep it exact; "
                      "Hugging Face deepseek_v2 and deepseek_v3 folders load and export. "
                      "--mla-fa-without-pad and --mla-mm-split "
                      "are MindSpeed-LLM's kernel choices: the same math here"),
            supported("as on PyTorch"),
            lambda a: any(getattr(a, f, None) for f in ("multi_latent_attention", "q_lora_rank", "kv_lora_rank",
                                                        "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                                                        "mla_fa_without_pad", "mla_mm_split"))),
    Feature("multi-token-prediction", "Multi-token prediction modules (DeepSeek-V3, --mtp-num-layers)", "models",
            ("--mtp-num-layers", "--mtp-loss-scaling-factor", "--mtp-mem-efficient-logits"),
            supported("D modules after the last layer on the last pipeline stage, each predicting one token further "
                      "from the embedding of the next and the previous depth's hidden state, with the shared "
                      "embedding and output layer; their loss times --mtp-loss-scaling-factor / D joins the "
                      "gradient and is logged apart (mtp_k loss); TP, SP, PP and EP keep it exact; Hugging Face "
                      "deepseek_v3 and glm4_moe folders' extra layers load and export. --mtp-mem-efficient-logits "
                      "is MindSpeed-LLM's memory choice for the logits: the same math here"),
            supported("as on PyTorch"),
            lambda a: any(getattr(a, f, None) for f in ("mtp_num_layers", "mtp_loss_scaling_factor",
                                                        "mtp_mem_efficient_logits"))),
    Feature("moe-tp-extend-ep", "Experts over TP x EP ranks (MindSpeed's --moe-tp-extend-ep)", "parallelism",
            ("--moe-tp-extend-ep",), supported(_TP_EXTEND_EP), supported(_TP_EXTEND_EP), _on("moe_tp_extend_ep")),
    Feature("dualpipe", "The DualPipeV pipeline schedule (--schedules-method dualpipev)", "parallelism",
            ("--schedules-method dualpipev",),
            supported(_DUALPIPEV), supported(_DUALPIPEV), _eq("schedules_method", "dualpipev")),
    Feature("evaluation-alternative-prompt", "MindSpeed-LLM's alternative evaluation prompts (--alternative-prompt)",
            "tools", ("--alternative-prompt",), supported(_ALTERNATIVE), supported(_ALTERNATIVE),
            _on("alternative_prompt")),
    Feature("dataloader-cyclic", "Megatron's cyclic data loader (each rank's bucket reshuffled each epoch)", "data",
            ("--dataloader-type cyclic",), supported(_CYCLIC), supported(_CYCLIC),
            lambda a: getattr(a, "dataloader_type", None) == "cyclic"),
    Feature("dataloader-external", "An external data loader (the user's own iterator)", "data",
            ("--dataloader-type external",),
            planned(instead="--dataloader-type single or cyclic"), planned(instead="--dataloader-type single or cyclic"),
            lambda a: getattr(a, "dataloader_type", None) == "external"),
    Feature("recompute-activation-function", "Recompute of the MLP's activation function", "memory",
            ("--recompute-activation-function", "--recompute-activation-function-num-layers"),
            supported(_ACTIVATION_RECOMPUTE), supported(_ACTIVATION_RECOMPUTE), _on("recompute_activation_function")),
    Feature("swap-optimizer", "Optimizer states swapped to host memory", "memory",
            ("--swap-optimizer", "--swap-optimizer-times"),
            supported(_SWAP_OPTIMIZER), supported(_SWAP_OPTIMIZER),
            lambda a: bool(getattr(a, "swap_optimizer", False) or getattr(a, "swap_optimizer_times", None))),
    Feature("o2-gradient", "bf16 gradients (MindSpeed's O2)", "memory", ("--o2-gradient",),
            supported("gradients accumulated over micro-batches and reduced over DP in bf16 (the distributed "
                      "optimizer's buckets too), widened to fp32 for the update (with --bf16)"),
            _bf16_only_on_mindspore("fp32 gradient accumulation (drop --o2-gradient)"),
            _on("o2_gradient")),
    Feature("dynamic-padding", "Micro-batches padded to their longest sample", "fine-tuning",
            ("--no-pad-to-seq-lengths", "--pad-to-multiple-of"),
            supported(_DYNAMIC_PADDING), supported(_DYNAMIC_PADDING), _on("no_pad_to_seq_lengths")),
    Feature("no-shuffle", "Samples read in order (no shuffle)", "fine-tuning", ("--no-shuffle",),
            supported("each dataset's samples in file order, every epoch"),
            supported("each dataset's samples in file order, every epoch"), _on("no_shuffle")),
    Feature("expert-tensor-parallel", "Whole experts under tensor parallelism (--expert-tensor-parallel-size 1)",
            "parallelism", ("--expert-tensor-parallel-size",), supported(_ETP1), supported(_ETP1),
            lambda a: getattr(a, "expert_tensor_parallel_size", None) == 1
            and (getattr(a, "tensor_model_parallel_size", 1) or 1) > 1),
    Feature("expert-parallel-across-tp", "Expert parallelism reaching across the TP ranks (EP beyond DP)",
            "parallelism", ("--expert-model-parallel-size", "--expert-tensor-parallel-size"),
            supported(_EP_ACROSS_TP), supported(_EP_ACROSS_TP)),
    Feature("convert-expert-tensor-parallel", "Megatron checkpoints with experts not cut as the model's TP",
            "tools", ("--expert-tensor-parallel-size",),
            supported(_CONVERT_ETP), supported(_CONVERT_ETP)),
    Feature("expert-tensor-parallel-other", "Expert tensor parallelism other than 1 or the model's", "parallelism",
            ("--expert-tensor-parallel-size",), planned(_ETP, instead=_ETP_INSTEAD), planned(_ETP, instead=_ETP_INSTEAD),
            lambda a: getattr(a, "expert_tensor_parallel_size", None) not in (
                None, 1, getattr(a, "tensor_model_parallel_size", 1))),
    Feature("lora-checkpoint-filter", "Checkpoints of LoRA runs holding the adapters only", "fine-tuning",
            ("--lora-ckpt-filter",), supported(_LORA_FILTER), supported(_LORA_FILTER), _on("lora_ckpt_filter")),
    Feature("convert-lora", "LoRA adapters in mindspeed convert (merge, PEFT export)", "tools",
            ("--lora-load", "--lora-r", "--save-lora-to-hf"),
            supported(_CONVERT_LORA), supported(_CONVERT_LORA)),
    # ---- combinations not built yet ------------------------------------------------------
    # each row is one pair of features that work alone; the gate refuses the pair (the model's
    # own MoE layers count, from flags or a Hugging Face config)
    Feature("ulysses-kv-copies", "Ulysses over more ranks than key/value heads per tensor-parallel rank",
            "combinations", ("--context-parallel-algo", "--num-query-groups"),
            supported(_ULYSSES_KV), supported(_ULYSSES_KV), _ulysses_short_of_kv_heads),
    Feature("moe-context-parallel", "Mixture of experts with context parallelism", "combinations",
            ("--context-parallel-size", "--num-experts"),
            supported(_MOE_CP), supported(_MOE_CP),
            lambda a: _moe(a) and _gt1("context_parallel_size")(a)),
    Feature("linear-attention-context-parallel", "Gated DeltaNet layers under context parallelism", "combinations",
            ("--context-parallel-size", "--full-attention-interval"),
            planned(_LINEAR_CP, instead="--context-parallel-size 1"), planned(_LINEAR_CP, instead="--context-parallel-size 1"),
            lambda a: getattr(a, "full_attention_interval", None) is not None and _gt1("context_parallel_size")(a)),
    Feature("init-norm-weight-fp32", "Norm weights kept in float32 under bf16 / fp16 training", "precision",
            ("--init-norm-weight-in-fp32",), supported(_NORM_FP32),
            planned("bf16 / fp16 training is not yet run on a MindSpore GPU/Ascend device",
                    cpu=unsupported("MindSpore's CPU MatMul has no bfloat16 kernel", instead="fp32 (drop --bf16)")),
            lambda a: bool(getattr(a, "init_norm_weight_in_fp32", False))
            and bool(getattr(a, "bf16", False) or getattr(a, "fp16", False))),
    Feature("input-layernorm-fp32", "Hunyuan's input norm output in float32", "precision",
            ("--input-layernorm-in-fp32",), planned(_INPUT_NORM_FP32), planned(_INPUT_NORM_FP32),
            lambda a: bool(getattr(a, "input_layernorm_in_fp32", False))),
    Feature("moe-compile", "Compiled step with MoE layers", "combinations", ("--compile", "--num-experts"),
            supported("routing on the device (the same top-k, weights, expert bias, aux and z losses as eager), "
                      "every token through every expert weighted by its routing: fixed shapes at E/k times the "
                      "routed path's expert FLOPs; one process, data and tensor parallelism"),
            supported("as on PyTorch"),
            lambda a: _moe(a) and bool(getattr(a, "compile", False))),
    Feature("moe-compile-routing", "Compiled MoE step with expert, pipeline or context parallelism, a capacity "
            "factor, input jitter or SparseMixer routing", "combinations", ("--compile", "--expert-model-parallel-size",
                                                       "--pipeline-model-parallel-size", "--context-parallel-size",
                                                       "--moe-expert-capacity-factor", "--moe-input-jitter-eps",
                                                       "--moe-router-load-balancing-type sparsemixer_topk"),
            planned(_MOE_COMPILE, instead="drop --compile"), planned(_MOE_COMPILE, instead="drop --compile"),
            lambda a: _moe(a) and bool(getattr(a, "compile", False)) and (
                _gt1("expert_model_parallel_size")(a) or _gt1("pipeline_model_parallel_size")(a)
                or _gt1("context_parallel_size")(a) or getattr(a, "moe_expert_capacity_factor", None) is not None
                or bool(getattr(a, "moe_pad_expert_input_to_capacity", False))
                or bool(getattr(a, "moe_input_jitter_eps", None))
                or getattr(a, "moe_router_load_balancing_type", None) == "sparsemixer_topk")),
    Feature("lora-moe", "LoRA adapters on mixture-of-experts models", "combinations", ("--lora-r", "--num-experts"),
            supported(_LORA_MOE), supported(_LORA_MOE),
            lambda a: _moe(a) and (getattr(a, "lora_r", None) is not None
                                   or getattr(a, "lora_target_modules", None) is not None)),
    Feature("lora-latent-attention-qkv", "LoRA's linear_qkv target on latent attention without a query latent",
            "combinations",
            ("--lora-target-modules", "--multi-latent-attention"),
            planned(_LORA_MLA_QKV, instead=_LORA_MLA_QKV_INSTEAD), planned(_LORA_MLA_QKV, instead=_LORA_MLA_QKV_INSTEAD),
            lambda a: bool(getattr(a, "multi_latent_attention", False)) and getattr(a, "q_lora_rank", None) is None
            and (getattr(a, "lora_r", None) is not None or getattr(a, "lora_target_modules", None) is not None)
            and "linear_qkv" in (getattr(a, "lora_target_modules", None) or ("linear_qkv",))),
    Feature("dsa-compile", "Compiled step with sparse attention", "combinations", ("--compile", "--enable-dsa-indexer"),
            planned(_DSA_COMPILE, instead="drop --compile"), planned(_DSA_COMPILE, instead="drop --compile"),
            lambda a: bool(getattr(a, "enable_dsa_indexer", False)) and bool(getattr(a, "compile", False))),
    Feature("dsa-context-parallel", "Sparse attention with context parallelism", "combinations",
            ("--enable-dsa-indexer", "--context-parallel-size"),
            planned(_DSA_CP, instead=_DSA_CP_INSTEAD), planned(_DSA_CP, instead=_DSA_CP_INSTEAD),
            lambda a: bool(getattr(a, "enable_dsa_indexer", False)) and _gt1("context_parallel_size")(a)),
    Feature("mtp-context-parallel", "Multi-token prediction with context parallelism", "combinations",
            ("--mtp-num-layers", "--context-parallel-size"),
            planned(_MTP_CP, instead=_MTP_LAYOUTS), planned(_MTP_CP, instead=_MTP_LAYOUTS),
            lambda a: _mtp(a) and _gt1("context_parallel_size")(a)),
    Feature("mtp-compile", "Compiled step with multi-token prediction", "combinations",
            ("--compile", "--mtp-num-layers"),
            planned(_MTP_COMPILE, instead="drop --compile"), planned(_MTP_COMPILE, instead="drop --compile"),
            lambda a: _mtp(a) and bool(getattr(a, "compile", False))),
    Feature("mtp-other-stages", "Multi-token prediction in a preference or reward stage, or with LoRA",
            "combinations", ("--mtp-num-layers", "--stage", "--lora-r"),
            planned(_MTP_STAGES, instead=_MTP_STAGES_INSTEAD), planned(_MTP_STAGES, instead=_MTP_STAGES_INSTEAD),
            lambda a: _mtp(a) and (getattr(a, "stage", None) in _ALIGNMENT_STAGES or getattr(a, "lora_r", None)
                                   is not None or getattr(a, "lora_target_modules", None) is not None)),
    Feature("compile-context-parallel", "Compiled step with context parallelism", "combinations",
            ("--compile", "--context-parallel-size"),
            supported("ring, Ulysses and hybrid attention inside the compiled graph"),
            supported("the ring and all-to-all exchanges run their traced formulation (each an all-gather of "
                      "zero-padded slots, n times the payload)"),
            lambda a: bool(getattr(a, "compile", False)) and _gt1("context_parallel_size")(a)),
    Feature("compile-packed-sequences", "Compiled step on packed sequences or instruction data", "combinations",
            ("--compile", "--reset-attention-mask", "--reset-position-ids", "--stage sft", "--is-instruction-dataset"),
            planned(_COMPILE_PACKED, instead="drop --compile"), planned(_COMPILE_PACKED, instead="drop --compile"),
            lambda a: bool(getattr(a, "compile", False)) and (
                bool(getattr(a, "reset_attention_mask", False)) or bool(getattr(a, "reset_position_ids", False))
                or getattr(a, "stage", None) == "sft" or bool(getattr(a, "is_instruction_dataset", False)))),
    Feature("compile-recompute", "Compiled step with activation recompute or swap attention", "combinations",
            ("--compile", "--recompute-granularity", "--recompute-activations", "--recompute-norm", "--swap-attention",
             "--recompute-activation-function"),
            planned(_COMPILE_MEMORY, instead=_COMPILE_MEMORY_INSTEAD),
            planned(_COMPILE_MEMORY, instead=_COMPILE_MEMORY_INSTEAD),
            lambda a: bool(getattr(a, "compile", False)) and any(
                getattr(a, k, None) for k in ("recompute_granularity", "recompute_activations", "recompute_norm",
                                              "swap_attention", "recompute_activation_function"))),
    Feature("alignment-context-parallel", "Preference and reward stages with context parallelism", "combinations",
            ("--stage", "--context-parallel-size"),
            planned(_ALIGN_CP, instead="TP, SP, PP and DP"), planned(_ALIGN_CP, instead="TP, SP, PP and DP"),
            lambda a: getattr(a, "stage", None) in _ALIGNMENT_STAGES and _gt1("context_parallel_size")(a)),
    Feature("compile-alignment", "Compiled step of a preference or reward stage", "combinations",
            ("--compile", "--stage"),
            planned(_COMPILE_ALIGN, instead="drop --compile"), planned(_COMPILE_ALIGN, instead="drop --compile"),
            lambda a: getattr(a, "stage", None) in _ALIGNMENT_STAGES and bool(getattr(a, "compile", False))),
)

BY_ID = {f.id: f for f in FEATURES}


def handler_feature(name: str) -> str:
    """The matrix row of a --handler-name."""
    return next(f"handler-{slug}" for slug, n, _ in HANDLER_ROWS if n == name)


def get(feature_id: str) -> Feature:
    try:
        return BY_ID[feature_id]
    except KeyError:
        raise KeyError(f"no feature {feature_id!r} in the matrix") from None


def note_used(feature_id: str) -> None:
    """Called where a feature takes effect (the kernel is chosen, the collective runs, the
    parallel layer is built): the test harness counts a cell as proved only when this ran
    during a passing test marked with it. Free unless recording is on (mindspeed_core.usage)."""
    if feature_id not in BY_ID:
        raise KeyError(f"no feature {feature_id!r} in the matrix")
    usage.note("feature:" + feature_id)


def active_features(args) -> list[Feature]:
    return [f for f in FEATURES if f.active is not None and f.active(args)]


def refuse(feature_id: str, framework: str, device: str | None = None) -> None:
    """Raise the matrix's refusal of one row (a verb that parses no training flags asks by id)."""
    f = get(feature_id)
    st = f.status(framework, device)
    if st.kind in ("unsupported", "planned"):
        raise FeatureNotAvailable(_refusal(f, st, framework, device))


def _refusal(f: Feature, st: Status, framework: str, device: str | None) -> str:
    where = framework + (f" on {device}" if device else "")
    return (f"{f.id} ({' '.join(f.flags[:1])}) is {st.kind} for {where}: {st.note}"
            + (f"; instead use {st.instead}" if st.instead else ""))


def validate(args, framework: str, device: str | None = None, version: str | None = None) -> list[Feature]:
    """Reject arguments that ask for a feature the framework/device cannot provide.

    Returns the active features when all are available; raises FeatureNotAvailable (exit
    code 2) naming every offending feature otherwise.
    """
    active = active_features(args)
    problems = []
    for f in active:
        st = f.status(framework, device, version)
        if st.kind in ("unsupported", "planned"):
            problems.append(_refusal(f, st, framework, device))
    if problems:
        raise FeatureNotAvailable("; ".join(problems))
    return active


# ---- rendering ------------------------------------------------------------------------------

def _cell(st: Status) -> str:
    text = st.kind + (f" (>= {_dotted(st.since)})" if st.since else "")
    for dev in DEVICES:
        if dev in st.devices:
            text += f"; {dev}: {st.devices[dev].kind}"
    return text


def as_records(framework: str | None = None, device: str | None = None) -> list[dict]:
    frameworks = (framework,) if framework else FRAMEWORKS
    out = []
    for f in FEATURES:
        rec = {"id": f.id, "title": f.title, "category": f.category, "flags": list(f.flags)}
        for fw in frameworks:
            base = getattr(f, fw)
            st = base.on(device)
            rec[fw] = {"status": st.kind, "note": st.note}
            if st.since:
                rec[fw]["since"] = _dotted(st.since)
            if st.instead:
                rec[fw]["instead"] = st.instead
            if device is None and base.devices:
                rec[fw]["devices"] = {d: {"status": s.kind, "note": s.note} for d, s in base.devices.items()}
        out.append(rec)
    return out


def render_json(framework: str | None = None, device: str | None = None) -> str:
    return json.dumps({"features": as_records(framework, device)}, indent=2)


def render_markdown(framework: str | None = None) -> str:
    frameworks = (framework,) if framework else FRAMEWORKS
    head = "| feature | id | flags | " + " | ".join(frameworks) + " |"
    rows = [head, "|" + "---|" * (3 + len(frameworks))]
    for f in FEATURES:
        flags = ", ".join(f"`{x}`" for x in f.flags) or "(always on)"
        cells = " | ".join(_cell(getattr(f, fw)) for fw in frameworks)
        rows.append(f"| {f.title} | `{f.id}` | {flags} | {cells} |")
    return "\n".join(rows) + "\n"


def render_text(framework: str | None = None, device: str | None = None) -> str:
    frameworks = (framework,) if framework else FRAMEWORKS
    width = max(len(f.id) for f in FEATURES)
    lines = [f"{'feature'.ljust(width)}  " + "  ".join(fw.ljust(28) for fw in frameworks)]
    for f in FEATURES:
        cells = []
        for fw in frameworks:
            st = getattr(f, fw)
            cells.append((st.on(device).kind if device else _cell(st)).ljust(28))
        lines.append(f"{f.id.ljust(width)}  " + "  ".join(cells))
    return "\n".join(lines) + "\n"


README_START, README_END = "<!-- feature-matrix:start -->", "<!-- feature-matrix:end -->"


def readme_table(text: str) -> str:
    if README_START not in text or README_END not in text:
        raise FeatureNotAvailable(f"the file has no {README_START} ... {README_END} markers")
    return text.split(README_START, 1)[1].split(README_END, 1)[0]


def update_readme(path: str) -> None:
    with open(path) as fh:
        text = fh.read()
    old = readme_table(text)
    with open(path, "w") as fh:
        fh.write(text.replace(README_START + old + README_END, README_START + "\n" + render_markdown() + README_END))
