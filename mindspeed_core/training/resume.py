"""What a run starts from: the weights of --load-hf, --load (one of our checkpoints to resume
or fine-tune from, or a Megatron checkpoint at any layout) and --lora-load, put into the whole
model before it is cut for this rank's layout; and the run's state beyond the tensors (random
generators, loss scale, DPO's reference) saved with each checkpoint and put
back on resume. Each source is checked against the run's model configuration first; a
mismatch is one line naming the flags to pass.
"""

from __future__ import annotations

import dataclasses

from mindspeed_core import nn, random, runtime
from mindspeed_core.errors import CheckpointError
from mindspeed_core.models import lora
from mindspeed_core.models.config import LoRAConfig, ModelConfig
from mindspeed_core.models.gpt import load_whole_state, whole_state
from mindspeed_core.models.state import moved_under_lora
from mindspeed_core.training import checkpoint, distributed, model_source


def same_model(saved, cfg: ModelConfig, ignore_lora: bool = False, ignore_head: bool = False) -> bool:
    """Whether a checkpoint's model config is ``cfg`` (fields added since it was saved take
    their defaults); ``ignore_lora``: the base models only; ``ignore_head``: the models up
    to their output (a language model starting a reward model)."""
    try:
        saved = ModelConfig.from_dict(saved)
    except (TypeError, ValueError, AttributeError):
        return False
    if ignore_lora:
        saved, cfg = dataclasses.replace(saved, lora=None), dataclasses.replace(cfg, lora=None)
    if ignore_head:
        saved, cfg = dataclasses.replace(saved, reward_head=False), dataclasses.replace(cfg, reward_head=False)
    if saved.dsa is not None and cfg.dsa is not None:  # how many keys, the indexer loss and the warm-up stage
        # are how a run trains the same weights (the sparse stage starts from the dense warm-up's)
        saved = dataclasses.replace(saved, dsa=dataclasses.replace(saved.dsa, topk=cfg.dsa.topk,
                                                                   loss_coeff=cfg.dsa.loss_coeff,
                                                                   dense_warmup=cfg.dsa.dense_warmup))
    return saved == cfg


def saved_lora(values: dict) -> LoRAConfig | None:
    try:
        return LoRAConfig(**values)
    except (TypeError, ValueError):
        return None




def adapters(model) -> dict:
    """The whole model's LoRA factors as they stand ({whole-model name: numpy})."""
    return {n: v for n, v in whole_state(model).items() if lora.is_adapter(n)}


def with_head(model, cfg: ModelConfig, arrays: dict) -> dict:
    """A language model's weights for this model: a reward model drops the output layer
    and keeps its scalar head's fresh start."""
    if not cfg.reward_head or "rm_head.weight" in arrays:
        return arrays
    out = {n: v for n, v in arrays.items() if not n.startswith("output_layer.")}
    out["rm_head.weight"] = nn.state_dict(model)["rm_head.weight"]
    return out


def load_hf(model, cfg: ModelConfig, state: dict) -> None:
    """A Hugging Face folder's weights (read with model_source.read_hf before the model was built;
    whole-model names: with no-op layers its layers' numbers are not their places)."""
    load_whole_state(model, with_head(model, cfg, {**adapters(model), **state}))


def load_megatron(model, cfg: ModelConfig, root: str, say) -> None:
    """The weights of a Megatron checkpoint (compat/mcore.py; any TP / PP / EP / VPP) for
    this model, cut later for this run's layout; iteration 0, a fresh optimizer."""
    source = model_source.read(root, "--load", ("megatron",))
    if source.cfg.lora is not None and cfg.lora is None:  # a LoRA run taken as a plain model
        source = source.merged()
    elif source.cfg.lora is not None and source.cfg.lora != cfg.lora:
        raise CheckpointError(f"the Megatron checkpoint in {root} holds LoRA adapters (rank {source.cfg.lora.r}, "
                              f"alpha {source.cfg.lora.alpha:g}, {' '.join(source.cfg.lora.targets)}): pass the same "
                              f"--lora-* flags")
    saved = source.cfg if source.exact else dataclasses.replace(source.cfg, family=cfg.family)
    lm_start = cfg.reward_head and not saved.reward_head
    if not same_model(saved.to_dict(), cfg, ignore_lora=cfg.lora is not None, ignore_head=lm_start):
        raise CheckpointError(f"the Megatron checkpoint in {root} was saved for a different model configuration; "
                              f"pass the model flags of its args (num_layers {saved.num_layers}, hidden_size "
                              f"{saved.hidden_size}, padded vocabulary {saved.vocab_size}, ...)")
    load_whole_state(model, with_head(model, cfg, {**adapters(model), **source.state}))
    lay = source.layout
    say(f"took the weights of the Megatron checkpoint {root} (iteration {source.iteration}, saved at "
        f"TP={lay.tp} PP={lay.pp} EP={lay.ep}, {source.dtype}); no optimizer state: training starts at iteration 0")


def resume(model, cfg: ModelConfig, root: str, finetune: bool, say, adapters_only: bool = False,
           exit_on_missing: bool = False):
    """Load the whole model from the newest checkpoint in ``root``; returns (iteration, its
    optimizer arrays and steps) or (0, None) for the weights only; for a sharded checkpoint
    (iteration, its sharded_checkpoint.Reader), the model not loaded: each rank reads its
    slices after the model is cut. With LoRA, a checkpoint
    without adapters is a base model: its weights only, whatever --finetune says.
    ``adapters_only`` (--lora-load): the adapters and the training state, the base weights are
    kept."""
    flag = "--lora-load" if adapters_only else "--load"
    if not adapters_only and model_source.kind_of(root) == "megatron":
        load_megatron(model, cfg, root, say)
        return 0, None
    it = checkpoint.latest_iteration(root, flag)
    if it is None and (finetune or adapters_only):
        raise CheckpointError(f"{flag}: {root} holds no checkpoint to take the weights from")
    if it is None and checkpoint.holds_checkpoints(root) is not None:  # iteration folders, no tracker
        raise CheckpointError(f"{flag} {root} holds iteration folders but no {checkpoint.TRACKER}: an interrupted "
                              f"save or conversion left them; remove them, or write that checkpoint again")
    if it is None and exit_on_missing:
        raise CheckpointError(f"{flag} {root} holds no checkpoint (--exit-on-missing-checkpoint)")
    if it is None:
        say(f"no checkpoint in {root} yet: starting from scratch")
        return 0, None
    meta = checkpoint.read_meta(root, it)
    if meta.get("adapters_only") and not adapters_only:
        raise CheckpointError(f"{root} (iteration {it}) holds a LoRA run's adapters only (--lora-ckpt-filter): give "
                              f"the base model with --load (or --load-hf) and this checkpoint with --lora-load")
    checkpoint.check_megatron_copy(root, it)
    saved = meta.get("model") or {}
    saved_adapters = saved.get("lora")
    base_only = cfg.lora is not None and saved_adapters is None and not adapters_only
    # a language model starting a reward model: its weights only, the scalar head fresh
    lm_start = cfg.reward_head and not saved.get("reward_head")
    if saved_adapters is not None and saved_lora(saved_adapters) != cfg.lora:
        raise CheckpointError(f"the checkpoint in {root} (iteration {it}) holds LoRA adapters (rank "
                              f"{saved_adapters['r']}, alpha {saved_adapters['alpha']}, dropout "
                              f"{saved_adapters['dropout']}, targets {' '.join(saved_adapters['targets'])}): pass the "
                              f"same --lora-* flags")
    if adapters_only and saved_adapters is None:
        raise CheckpointError(f"--lora-load: the checkpoint in {root} (iteration {it}) holds no LoRA adapters")
    if not same_model(meta.get("model"), cfg, ignore_lora=base_only, ignore_head=lm_start):
        raise CheckpointError(f"the checkpoint in {root} (iteration {it}) was saved for a different model "
                              f"configuration; pass the same model flags as when it was saved")
    if finetune and not adapters_only or base_only or lm_start:
        # the weights only: iteration 0, a fresh optimizer, the data from its start
        load_whole_state(model, with_head(model, cfg, {**adapters(model), **checkpoint.load_model_arrays(root, it)}))
        why = ("--finetune" if finetune else "LoRA on a base model" if base_only else
               "a reward model from a language model")
        say(f"fine-tuning from the weights of {checkpoint.iteration_dir(root, it)} ({why})")
        return 0, None
    layout = meta.get("parallel", {})
    saved_at = (f"saved on {meta.get('framework')}, TP={layout.get('tp', 1)} DP={layout.get('dp', 1)} "
                f"PP={layout.get('pp', 1)}")
    shards = None if adapters_only else checkpoint.reader(root, it)
    if shards is not None:  # each rank reads its own slices once the model is cut (Trainer.build)
        if not shards.names("optimizer"):
            say(f"{checkpoint.iteration_dir(root, it)} holds no optimizer state (saved with --no-save-optim): the "
                "optimizer starts afresh")
        say(f"resumed from {checkpoint.iteration_dir(root, it)} ({saved_at}; sharded: each rank reads its slices)")
        return it, shards
    model_arrays, optimizer_arrays, steps = checkpoint.load(root, it)
    if not optimizer_arrays:
        say(f"{checkpoint.iteration_dir(root, it)} holds no optimizer state (saved with --no-save-optim): the "
            "optimizer starts afresh")
    else:  # a float32 save holds no masters (its weights are): a --bf16 resume takes them, unrounded
        optimizer_arrays = {**{f"master.{n}": v for n, v in model_arrays.items()}, **optimizer_arrays}
    if adapters_only:  # the base weights stay those of --load / --load-hf (the expert biases are the run's)
        model_arrays = {**nn.state_dict(model), **{n: v for n, v in model_arrays.items() if moved_under_lora(n)}}
    load_whole_state(model, model_arrays)
    say(f"resumed {'the LoRA adapters ' if adapters_only else ''}from {checkpoint.iteration_dir(root, it)} "
        f"({saved_at})")
    return it, (optimizer_arrays, steps)


def run_state(ps, scaler, reference, rng: bool = True) -> dict:
    """What exact resumption needs beyond the tensors (collective: every rank calls it): each
    rank's generator states (dropout draws, the tracker's tensor-parallel streams), the fp16
    loss scale with its clean-step counter and DPO's reference log-likelihoods (aux-loss-free
    balancing's expert biases are model state: the routers' ``expert_bias``)."""
    mine = {}
    if rng:  # --no-save-rng: none
        mine.update(default=random.get_state(), tracker=random.tracker().get_states())
    if reference and ps.local_rank("dp") == 0 and ps.local_rank("tp") == 0:
        mine["reference"] = reference.state()  # one copy: the last stage's first rank's
    return {"framework": runtime.bound().NAME, **scaler.state(), "layout": _layout(ps),
            "rng": distributed.gather_json(mine, ps)}


def _layout(ps) -> dict:
    return {"world": ps.world, "tp": ps.tp, "dp": ps.dp, "pp": ps.pp, "cp": ps.cp}


def restore_run_state(state: dict, ps, scaler, moe_layers: list, reference, stage: str, pair_counts, resumed_from: str,
                      say, rng: bool = True) -> None:
    """Put back what :func:`run_state` saved; generator states only where the framework and the
    layout are the saving run's (the shared stream carries over a layout change)."""
    if not state:  # a checkpoint from before trainer states were saved
        say("this checkpoint holds no RNG states or loss scale: dropout and fp16 resume approximately")
        return
    try:
        scaler.load_state(state)
        ranks, layout = state["rng"], {"pp": 1, "cp": 1, **state["layout"]}  # saved before PP/CP: one of each
        _restore_expert_bias(ranks, moe_layers)
        if stage == "dpo":
            _restore_reference(ranks, reference, pair_counts(), resumed_from)
        framework = runtime.bound().NAME
        if not rng:
            say("--no-load-rng: dropout draws start afresh")
        elif "default" not in ranks[0]:
            say("this checkpoint was saved without RNG states (--no-save-rng): dropout draws start afresh")
        elif state["framework"] != framework:  # generator states are framework-specific
            say(f"RNG states were saved on {state['framework']}: dropout draws start afresh on {framework}")
        elif layout == _layout(ps):
            random.set_state(ranks[ps.rank]["default"])
            random.tracker().set_states(ranks[ps.rank]["tracker"])
        else:  # the shared stream carries over; per-rank tensor-parallel streams start afresh
            random.set_state(ranks[0]["default"])
            if any(r["tracker"] for r in ranks):
                say(f"saved at TP={layout.get('tp')} DP={layout.get('dp')} PP={layout.get('pp')}, resumed at "
                    f"TP={ps.tp} DP={ps.dp} PP={ps.pp}: tensor-parallel dropout streams are reseeded")
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise CheckpointError(f"the checkpoint's {checkpoint.STATE_FILE} is malformed ({exc!r})") from None


def _restore_reference(ranks: list, reference, pair_counts: dict, resumed_from: str) -> None:
    """DPO's reference log-likelihoods as the saving run computed them, from every rank (the
    layout may have changed since)."""
    saved = [r["reference"] for r in ranks if "reference" in r]
    if not saved:
        raise CheckpointError(f"the checkpoint in {resumed_from} holds no DPO reference: it was not saved by "
                              f"a --stage dpo run; start DPO from its weights with --finetune")
    reference.load(saved[0], pair_counts)


def _restore_expert_bias(ranks: list, moe_layers: list) -> None:
    """Checkpoints written before the expert biases were model state kept them here."""
    saved = checkpoint.legacy_expert_biases({"rng": ranks})
    for layer in moe_layers:
        if layer.expert_bias() is not None and layer.number in saved:
            layer.set_expert_bias(saved[layer.number])
