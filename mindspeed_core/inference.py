"""`mindspeed generate` (and tools/inference.py): continue prompts with a trained model.

The model comes from one of our checkpoints (--load: its saved configuration, no model flags
needed) or a Hugging Face folder (--load-hf); the prompts from --prompt (repeatable) or
--prompt-file (one per line); --task greedy, do_sample (--temperature, --top-k, --top-p,
--seed), beam_search (--num-beams), beam_search_with_sampling or chat, or several of them, run
in turn; without --task and prompts, all of them on MindSpeed-LLM's prompt, as its inference.py
does. The key/value cache is used unless --no-kv-cache.
--stream prints each token as it is drawn (one prompt at a time; beam search prints when it
ends, its beams reorder until then). Under tensor and pipeline parallelism (`mindspeed launch
... -- generate ...`) every rank runs the same generation loop on the last stage's logits and
rank 0 prints.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from mindspeed_core import chat, dist, features, files, nn, ops
from mindspeed_core.compat import megatron_args
from mindspeed_core.data import chat_templates
from mindspeed_core.data.tokenizer import build_tokenizer, check_fits, tokenizer_args
from mindspeed_core.errors import MindSpeedError
from mindspeed_core.models import generate as gen
from mindspeed_core.models import registry
from mindspeed_core.models.gpt import load_whole_state
from mindspeed_core.models.state import is_expert_bias
from mindspeed_core.parallel import layers as parallel_layers
from mindspeed_core.parallel.plan import ParamPlan
from mindspeed_core.parallel import state as parallel_state
from mindspeed_core.parallel.parallelize import parallelize
from mindspeed_core.streaming import TextStream
from mindspeed_core.training import configuration, distributed, model_source, schedules, sharded_checkpoint


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("generation")
    g.add_argument("--prompt", action="append", default=None, help="a prompt (repeat for a batch)")
    g.add_argument("--prompt-file", default=None, help="prompts, one per line")
    g.add_argument("--max-new-tokens", type=megatron_args.POSITIVE_INT, default=64)
    g.add_argument("--num-beams", type=megatron_args.POSITIVE_INT, default=4)
    g.add_argument("--length-penalty", type=megatron_args.FINITE, default=1.0)
    g.add_argument("--no-kv-cache", action="store_true", help="rerun the whole sequence at each step")
    g.add_argument("--use-kv-cache", action="store_true", help="(the default; MindSpeed-LLM's spelling)")
    g.add_argument("--decode-graph", choices=("auto", "always", "never"), default="auto",
                   help="decode steps as one compiled graph (where the matrix has compiled-decode): once a "
                   "batch and cache size has run enough steps eagerly (auto), at once, or never")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt (chat: per reply)")
    c = parser.add_argument_group("chat (--task chat)")
    chat_templates.add_args(c, "default: the tokenizer's chat template, else empty")
    c.add_argument("--history-turns", type=megatron_args.COUNT, default=3,
                   help="rounds of the conversation the model reads again (0: none)")
    c.add_argument("--system-prompt", default=None, help="the system message (default: the template's)")
    c.add_argument("--do-sample", action="store_true", help="draw replies (--temperature, --top-k, --top-p) "
                   "instead of taking the most likely token")


def parser() -> argparse.ArgumentParser:
    p = megatron_args.training_parser("mindspeed generate", verb=True)
    p.description = "continue prompts with a trained model"
    add_args(p)
    return p


def _prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    for prompt in prompts:
        try:  # bytes the terminal passed that are not UTF-8 arrive as lone surrogates
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise MindSpeedError(f"--prompt {prompt[:20]!r}... is not UTF-8 text (at character {exc.start})") from None
    if args.prompt_file:
        if os.path.isdir(args.prompt_file):
            raise MindSpeedError(f"--prompt-file {args.prompt_file} is a folder: give a text file, one prompt a line")
        try:
            text = files.read_text(args.prompt_file, "--prompt-file ")
        except OSError as exc:
            raise MindSpeedError(f"--prompt-file {args.prompt_file}: {exc.strerror}") from None
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise MindSpeedError(f"--prompt-file {args.prompt_file} holds no prompt: give one a line")
    if any(not p.strip() for p in prompts):
        raise MindSpeedError("an empty prompt: each prompt needs some text")
    return prompts


def load_model(args, replicas: bool = False):
    """(model, config, tokenizer, parallel state, the tokenizer's folder or None) from --load or
    --load-hf, cut for this rank's tensor-parallel share and pipeline stages (the stages run as
    one model: training/schedules.py StagedModel); the model in evaluation mode. The tokenizer
    is the one the flags name, else the model's own (a Hugging Face folder's, or the byte-level
    one our checkpoints record). ``replicas``: the job may hold several copies of the model
    (data parallelism: evaluation splits its questions over them); else exactly one."""
    if bool(args.load) == bool(args.load_hf):
        raise MindSpeedError("give the model to generate with: --load CHECKPOINT_DIR or --load-hf FOLDER")
    if args.context_parallel_size != 1:
        raise MindSpeedError("generation and evaluation run with tensor, pipeline and expert parallelism only: drop "
                             "--context-parallel-size")
    tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    tokenizer_type, tokenizer_path = args.tokenizer_type, args.tokenizer_name_or_path
    named_tokenizer = tokenizer_type is not None or tokenizer_path is not None
    if args.load_hf:
        source = model_source.read(args.load_hf, "--load-hf", ("hf",))
        has_tokenizer = os.path.exists(os.path.join(args.load_hf, "tokenizer.json"))
        if not named_tokenizer and not has_tokenizer:
            raise MindSpeedError(f"{args.load_hf} has no tokenizer.json: give --tokenizer-type / "
                                 "--tokenizer-name-or-path")
        if not named_tokenizer:
            tokenizer_type, tokenizer_path = "PretrainedFromHF", args.load_hf
    else:
        source = model_source.read_sliced(args.load, "--load") or model_source.read(args.load, "--load",
                                                                                    ("megatron", "ours"))
        if source.kind == "megatron" and not named_tokenizer:
            raise MindSpeedError(f"{args.load} is a Megatron checkpoint: give its tokenizer (--tokenizer-type / "
                                 "--tokenizer-name-or-path)")
        if source.kind == "ours" and not named_tokenizer:
            if source.tokenizer != "ByteLevel":
                raise MindSpeedError(f"the checkpoint was trained with the {source.tokenizer} tokenizer: give "
                                     "the same --tokenizer-type / --tokenizer-name-or-path")
            tokenizer_type = "ByteLevel"
    source = source.merged()  # a LoRA run's adapters folded in: plain layers again
    cfg, state = source.cfg, source.state  # state {} when each rank reads its slices (source.shards)
    if cfg.reward_head:
        raise MindSpeedError(f"{args.load or args.load_hf} is a reward model (--stage orm): it scores replies and "
                             "writes no text")
    tokenizer = build_tokenizer(*tokenizer_args(argparse.Namespace(
        **{**vars(args), "tokenizer_type": tokenizer_type, "tokenizer_name_or_path": tokenizer_path})))
    check_fits(tokenizer, cfg.vocab_size)
    if tp > 1:
        parallel_layers.check_layout(cfg, tp, False)
    if ep > 1 and (cfg.moe is None or cfg.moe.num_experts % ep):
        raise MindSpeedError(f"--expert-model-parallel-size {ep} splits a mixture of experts' experts: this model "
                             + ("has none" if cfg.moe is None else f"has {cfg.moe.num_experts}, which {ep} does not "
                                                                   f"divide"))
    layout = configuration.pipeline_layout(args, cfg)  # the layers of each stage, as training cuts them
    ranks, needed = dist.launched_world_size(), tp * pp * ep
    if ranks != needed and not (replicas and ranks % needed == 0):
        sizes = f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp}" + (
            f" x --expert-model-parallel-size {ep}" if ep > 1 else "")
        raise MindSpeedError(
            f"{sizes} needs {needed} ranks: start it with `mindspeed launch --nproc-per-node {needed} -- "
            f"generate|evaluate ...`" if ranks == 1 else
            f"this job has {ranks} ranks for {sizes}: " + (
                f"evaluation runs on a multiple of {needed} (each {needed} a copy of the model)" if replicas else
                f"generation runs on exactly {needed} (a prompt's tokens depend on the ones before: copies of the "
                f"model would wait on each other)"))
    dist.init()
    # expert parallelism's ranks are data-parallel copies of the rest of the model: each runs
    # the same prompts, its experts serving every copy's tokens; further data-parallel ranks
    # (evaluation) are copies of the whole model, each its own questions
    ps = parallel_state.initialize(tp=tp, pp=pp, ep=ep)
    if args.sequence_parallel and ps.rank == 0:  # MindSpeed-LLM's generation scripts pass it at TP
        print("note: --sequence-parallel is set aside: generation and evaluation run whole sequences on each "
              "tensor-parallel rank (the key/value cache needs them); the results are the same", file=sys.stderr)
    model = _on_this_rank(cfg, state, layout, ps, args.seed, source.shards)
    if source.shards is not None and ps.world > 1:  # what each rank read (a collective)
        read = distributed.gather_json(source.shards.bytes_read, ps)
        if ps.rank == 0:
            print(f"note: each rank read the pieces of {args.load} its slices lie in: {sum(read) / 2**20:.2f} MiB in "
                  f"all, of the model's {source.shards.section_bytes('model') / 2**20:.2f} MiB there; bytes read per "
                  f"rank: {read}", file=sys.stderr)
    return model, cfg, tokenizer, ps, tokenizer_path


def _on_this_rank(cfg, state: dict, layout, ps, seed: int, shards=None):
    """The whole model's ``state`` as this rank's share: its pipeline stages (run with the
    other ranks' as one model) cut for tensor parallelism, in evaluation mode. ``shards``
    (a sharded checkpoint's reader, ``state`` empty): the model is cut first, then each rank
    reads its own slices, as a training run resumes."""
    spec = registry.for_config(cfg)
    model = spec.build(cfg)
    if shards is None:
        load_whole_state(model, state)
    chunks = spec.pipeline_chunks(model, layout, ps.local_rank("pp")) if ps.pp > 1 else [model]
    plans = None
    if ps.tp > 1 or ps.ep > 1:
        plans = [parallelize(spec, chunk, ps, False, "megatron_cp_algo", 1, "allgather") for chunk in chunks]
        parallel_layers.seed_model_parallel_rng(seed, ps)  # the layers fork its streams (no dropout here)
    if shards is not None:
        features.note_used("sliced-inference-load")
        entries = ([p for plan in plans for p in plan.params] if plans else
                   [ParamPlan(name) for chunk in chunks for name in chunk.parameter_names()])
        held = shards.names("model")
        for entry, p in zip(entries, (p for chunk in chunks for p in nn.parameters(chunk))):
            if entry.name not in held and is_expert_bias(entry.name):  # an older checkpoint's: in its run state
                continue
            nn.assign(p, ops.tensor(shards.read("model", sharded_checkpoint.held(entry.name, tuple(p.shape), entry,
                                                                                ps))))
    for chunk in chunks:
        nn.set_training(chunk, False)
    if ps.pp == 1:
        return model
    features.note_used("pipeline-inference")
    dtype = ops.dtype_of(nn.parameters(chunks[0])[0])
    return schedules.StagedModel(chunks, layout, ps.local_rank("pp"), *schedules.pipeline_links(ps, cfg, layout, dtype))


# MindSpeed-LLM's inference.py asks each of its tasks this when it runs them all
DEFAULT_PROMPT = "how are you?"


def _tasks(args) -> list[str]:
    """The tasks to run: --task's (in its order), else greedy when prompts are given, else all of
    MindSpeed-LLM's in its order (chat last; left out, with a note, under a launcher, where it
    cannot run). Without --prompt / --prompt-file the prompt is DEFAULT_PROMPT."""
    if args.task:
        wrong = [t for t in args.task if t not in megatron_args.GENERATION_TASKS]
        if wrong:
            raise MindSpeedError(f"--task {wrong[0]} is an evaluation: run it with 'mindspeed evaluate'")
        return list(args.task)  # a name given twice runs twice, as upstream's loop does
    if args.prompt or args.prompt_file:
        return ["greedy"]
    tasks = list(megatron_args.GENERATION_TASKS)
    if dist.launched_world_size() > 1:
        tasks.remove("chat")
    return tasks


# training's flags that generation and evaluation accept and run without, each with why: the
# noise a model in evaluation mode does without (as transformers' Phi-3.5-MoE does; megatron-core's
# router would jitter its input at inference too, drawing other tokens each run), and the
# precision and memory settings of training (inference computes in float32: the saved weights
# widened, as exact as they were saved; a 16-bit inference is not built)
TRAINING_ONLY = {
    "moe_input_jitter_eps": ("--moe-input-jitter-eps", "is training's noise: {verb} runs the model without it"),
    "bf16": ("--bf16", "is set aside: {verb} computes in float32 (the saved weights widened)"),
    "fp16": ("--fp16", "is set aside: {verb} computes in float32 (the saved weights widened)"),
    "reuse_fp32_param": ("--reuse-fp32-param", "is set aside: it is the training optimizer's memory option"),
    "input_layernorm_in_fp32": ("--input-layernorm-in-fp32", "holds: {verb} computes every norm in float32"),
    "init_norm_weight_in_fp32": ("--init-norm-weight-in-fp32", "holds: {verb} computes every norm in float32"),
}


def set_aside_training_flags(args, verb: str) -> None:
    """Drop TRAINING_ONLY's flags from ``args`` (before the matrix's gate), with a note each."""
    given = [name for name in TRAINING_ONLY if getattr(args, name, None)]
    for name in given:
        setattr(args, name, False if isinstance(getattr(args, name), bool) else None)
    if os.environ.get("RANK", os.environ.get("RANK_ID", "0")) == "0":  # one note per job
        for name in given:
            flag, why = TRAINING_ONLY[name]
            print(f"note: {flag} {why.format(verb=verb)}", file=sys.stderr)


def run(args, backend) -> int:
    """`mindspeed generate` once its flags are parsed and the framework bound."""
    tasks = _tasks(args)
    set_aside_training_flags(args, "generation")
    features.validate(args, backend.NAME, backend.device.type(), backend.FRAMEWORK_VERSION)
    if "chat" in tasks:
        _check_chat(args)
    prompts = _prompts(args) if args.prompt or args.prompt_file else [DEFAULT_PROMPT]
    model, cfg, tokenizer, ps, tokenizer_path = load_model(args)
    if any(t.startswith("beam_search") for t in tasks) and args.num_beams > cfg.vocab_size:
        raise MindSpeedError(f"--num-beams {args.num_beams} is more than the model's {cfg.vocab_size} tokens")
    speak = ps.rank == 0
    if speak and not args.task and "chat" not in tasks and not (args.prompt or args.prompt_file):
        print("note: the chat task is left out: it runs in one process, not under a launcher", file=sys.stderr)
    for task in tasks:
        if len(tasks) > 1 and speak and not args.json:  # JSON objects carry their task
            print(f"=== {task} ===", flush=True)
        if task == "chat":
            _chat(args, model, cfg, tokenizer, tokenizer_path)
        else:
            _continue(args, task, prompts, model, cfg, tokenizer, speak)
    dist.shutdown()
    return 0


def _continue(args, task: str, prompts: list[str], model, cfg, tokenizer, speak: bool) -> None:
    """One of the tasks that continue prompts: greedy, do_sample, beam_search (with sampling)."""
    encoded = [tokenizer.encode(p) for p in prompts]
    longest = max(len(e) for e in encoded)
    wrong = gen.fits(cfg.max_position_embeddings, longest, args.max_new_tokens, cfg.rope_scaling)
    if wrong:
        raise MindSpeedError(f"--max-new-tokens {args.max_new_tokens}: {wrong}")
    stop = (tokenizer.eod,) if getattr(tokenizer, "eod", None) is not None else ()
    use_cache = not args.no_kv_cache
    beams = task.startswith("beam_search")
    streamed = args.stream and not beams  # beams reorder until the end: printed when done
    compiled = {"auto": None, "always": True, "never": False}[args.decode_graph]
    sampling = gen.Sampling(greedy=task in ("greedy", "beam_search"), temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    results = []
    if beams:
        results = [gen.beam_search(model, e, args.max_new_tokens, args.num_beams, stop, args.length_penalty,
                                   use_cache, sampling=sampling) for e in encoded]
    elif streamed:
        features.note_used("streaming-inference")
        for prompt, e in zip(prompts, encoded):
            if speak:
                sys.stdout.write(prompt)
            printer = TextStream(tokenizer, speak)
            results += gen.generate(model, [e], args.max_new_tokens, sampling, stop, use_cache, printer.step,
                                    compiled=compiled)
            printer.close()
    else:
        results = gen.generate(model, encoded, args.max_new_tokens, sampling, stop, use_cache, compiled=compiled)
    if speak and not streamed:
        for prompt, ids in zip(prompts, results):
            text = tokenizer.decode(ids)
            print(json.dumps({"prompt": prompt, "output": text, "ids": ids, "task": task}) if args.json
                  else prompt + text)


def _check_chat(args) -> None:
    if args.prompt or args.prompt_file:
        raise MindSpeedError("--task chat reads its messages from the terminal: drop --prompt / --prompt-file")
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size"):
        if getattr(args, flag[2:].replace("-", "_")) != 1:
            raise MindSpeedError(f"--task chat runs in one process: drop {flag}")
    if dist.launched_world_size() > 1:
        raise MindSpeedError("--task chat runs in one process: run it without a launcher")


def _chat(args, model, cfg, tokenizer, tokenizer_path) -> None:
    template = chat_templates.choose(args.prompt_type, args.hf_chat_template, tokenizer_path)
    sampling = gen.Sampling(greedy=not args.do_sample, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    session = chat.Session(model, cfg, tokenizer, template, sampling, args.max_new_tokens, args.history_turns,
                           args.system_prompt, not args.no_kv_cache)
    chat.run(session, speak=True, as_json=args.json)
