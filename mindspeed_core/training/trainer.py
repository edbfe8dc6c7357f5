"""Pre-training with Megatron flags, both frameworks, on one process or many.

A step runs the step's micro-batches through a schedule (training/schedules.py): without
pipelining, one gradient call per micro-batch (the same on PyTorch and MindSpore),

    loss, grads = value_and_grad(model.loss, params)(ids, labels)

and with pipeline parallelism the 1F1B or interleaved schedule over this rank's model
chunks. The gradients are then completed as the parallel plan says (parallel/plan.py),
averaged over data-parallel ranks, clipped by the global norm, and AdamW takes the step.
"""

from __future__ import annotations

import functools
import gc
import math
import shlex
import signal
import sys
import time

import numpy as np

from mindspeed_core import device, dist, features, nn, ops, random, runtime
from mindspeed_core.data import sampler
from mindspeed_core.errors import MindSpeedError, Stopped
from mindspeed_core.models import dsa, lora, moe, registry
from mindspeed_core.models.gpt import load_whole_state
from mindspeed_core.models.state import is_expert_bias
from mindspeed_core.parallel import context
from mindspeed_core.parallel import state as parallel_state
from mindspeed_core.progress import Progress
from mindspeed_core.training import (alignment, batches, boards, build, checkpoint, compiled, configuration,
                                     distributed, grpo, metrics, overlap, preemption, profiling, qk_clip, resume,
                                     routing, sample, schedules, sharded_checkpoint)
from mindspeed_core.training.checkpoint_manager import CheckpointManager, whole_model_arrays
from mindspeed_core.training.loss_scale import LossScaler
from mindspeed_core.training.losses import StepLoss
from mindspeed_core.training.metrics import MetricsLog
from mindspeed_core.training.optimizer import learning_rate


class Trainer:
    def __init__(self, args, out=None):
        """``args``: the parsed flags of `mindspeed train`; they are configured once
        (training/configuration.py), and the run reads the configuration's typed sections."""
        self.config = config = configuration.configure(args, dist.launched_world_size())
        self.opt, self.loop, self.ckpt = config.optimization, config.loop, config.checkpointing
        self._out = out
        self.embedded = self.config.data.embedded
        # instruction fine-tuning and the stages after it: the loss counts the assistant's tokens only
        self.stage_name, self.instruction = self.config.stage.name, self.config.stage.instruction
        self.pairwise = self.config.stage.pairwise
        self.tokenizer, self.cfg = self.config.tokenizer, self.config.model
        # the preference and reward stages' loss (training/alignment.py); None: the LM loss
        self.objective = None
        stage = config.stage
        if self.stage_name in ("dpo", "simpo", "orm", "prm"):
            self.objective = alignment.Objective(
                self.stage_name, stage.settings,
                alignment.reward_token_ids(self.tokenizer, stage.reward_tokens) if self.stage_name == "prm" else None)
        self.reference = alignment.ReferenceTable()  # DPO's, filled by build()
        self.rl = self.stage_name == "grpo"  # online RL: each iteration trains on rollouts it draws
        if self.rl:
            self.grpo = stage.settings
            self.objective = grpo.Objective(self.grpo)
            self.reward_functions = grpo.reward_functions(self.grpo.reward_funcs)
        self.rollouts = self.grpo_reference = None
        self.data_path = batches.data_path(self.config)
        self.dtype = self.config.optimization.precision
        self.scaler = LossScaler(dynamic=self.dtype == "float16", initial=self.opt.initial_loss_scale)
        self.losses = StepLoss(self.objective, self.scaler, self.opt.loss_chunk)
        self.deterministic = config.operations.deterministic
        # before the collectives are set up: HCCL and MindSpore read it there (a dry run leaves the
        # process as it was)
        if self.deterministic and not self.loop.dry_run:
            features.note_used("deterministic")
            device.set_deterministic(True)
        dist.init()
        lay = config.layout
        self.ps = parallel_state.initialize(tp=lay.tp, pp=lay.pp, cp=lay.cp, ep=lay.ep, ep_over_tp=lay.ep_over_tp)
        self.layout = lay.stages(self.cfg)
        self.model_spec = registry.for_config(self.cfg)
        # GRPO's global batch counts prompts (the sampler gives this rank's, one by one), its
        # micro-batches completions
        self.sampler = sampler.for_run(config.data.dataloader_type, self.opt.global_batch_size,
                                       1 if self.rl else self.opt.micro_batch_size, self.ps.dp,
                                       self.ps.local_rank("dp"), self.opt.train_iters)
        self.grad_accum = self.sampler.micro_batches_per_step
        self.tokens_per_step = self.opt.global_batch_size * config.data.seq_length
        if self.rl:
            self.grad_accum = self.grad_accum * self.grpo.num_generations // self.opt.micro_batch_size
            self.tokens_per_step *= self.grpo.num_generations
        self.timeline = None  # a list to receive the pipeline schedule's timings (benchmarks, the --profile window)
        self.fb_exchanges = {}  # --moe-fb-overlap: {"hidden": exchanges that travelled beside another's compute}
        # called as (iteration, gradients, norm) once a step's gradients are reduced, before the
        # update: the gradients as the optimizer takes them (the layout tests compare them)
        self.after_reduction = None
        self.checkpoints = CheckpointManager(self)  # what is saved when (reads the built run)

    # -- set-up ------------------------------------------------------------------------------
    def describe(self) -> dict:
        """The run as --dry-run prints it (training/configuration.py describe)."""
        return configuration.describe(self.config, self.data_path, self.layout, self.grad_accum, self.scaler.scale,
                                      self.objective.candidates if self.stage_name == "prm" else None)

    def build(self):
        config, ckpt = self.config, self.ckpt
        self.data = batches.splits(config, self.data_path)
        if self.loop.compile:  # before any step: a packed dataset's masks appear only on the samples with padding
            compiled.check_data(self.data)
        self.batches = batches.Batches(self.data, self.tokenizer, config.stage, config.data, self.opt.micro_batch_size,
                                       self.ps, self.objective, self.reference)
        random.seed(config.data.seed)
        # The full model is built (and loaded) on every rank, then cut for this rank: a
        # parallel run starts from exactly the single-process weights.
        self.model, self.iteration, saved_optimizer = build.whole_model(self.model_spec, self.cfg, ckpt,
                                                                        config.layout.tp, config.data.seed, self.say)
        self.resumed_from = ckpt.lora_load or ckpt.load
        if self.stage_name == "dpo" and saved_optimizer is None:  # the starting weights are the reference
            self.batches.compute_reference(self.model, self.say)
        ps = self.ps
        self.chunks, self.plan, self.swap = build.cut_for_layout(self.model, self.model_spec, self.layout, ps,
                                                                 config.layout, config.memory, config.data.seed)
        if ps.pp > 1:  # this rank keeps its stages only
            self.model = None
        shards = saved_optimizer if isinstance(saved_optimizer, sharded_checkpoint.Reader) else None
        if shards is not None:  # a sharded checkpoint: this rank's slices, read into the cut model
            entry, held = {p.name: p for p in self.plan.params}, shards.names("model")
            for name, p in zip(self.plan.names, (p for c in self.chunks for p in nn.parameters(c))):
                if name not in held and is_expert_bias(name):  # an older checkpoint's: in its run state
                    continue
                nn.assign(p, ops.tensor(shards.read("model", sharded_checkpoint.held(name, tuple(p.shape), entry[name],
                                                                                    ps))))
        # MoE layers report their routing (aux and z losses, tokens per expert) each step
        self.moe_layers = [layer for chunk in self.chunks for layer in getattr(chunk, "moe_layers", list)()]
        self.moe_stats = self.stage_stats = self.eval_stats = self.mtp_stats = self.indexer_stat = None
        self.mtp_modules = [chunk.mtp for chunk in self.chunks if hasattr(chunk, "mtp")]  # the last stage's
        self.qk_clip, self.qk_stats = None, None  # --qk-clip / --log-max-attention-logit (training/qk_clip.py)
        if self.opt.qk_clip is not None:
            threshold, alpha = self.opt.qk_clip
            self.qk_clip = qk_clip.QKClip(threshold, alpha, clip=threshold is not None)
            qk_clip.track(self.chunks)
        if saved_optimizer is not None:  # after the tracker is seeded: its streams are restored too
            saved = checkpoint.load_trainer_state(self.resumed_from, self.iteration)
            resume.restore_run_state(saved, self.ps, self.scaler, self.moe_layers, self.reference, self.stage_name,
                                     self.batches.pair_counts, self.resumed_from, self.say, ckpt.load_rng)
        if self.dtype != "float32":  # the optimizer keeps fp32 masters
            build.cast_for_mixed_precision(self.chunks, self.moe_layers, self.dtype, self.opt.norms_float32)
        chunk_params = [nn.parameters(c) for c in self.chunks]
        self.params = [p for params in chunk_params for p in params]
        self.names = self.plan.names
        # what is trained: every parameter, or with LoRA the adapters only (the base weights
        # get no gradient and no optimizer state), or in sparse attention's dense warm-up the
        # indexers only; never the routers' expert biases (moved by the loads, training/routing.py)
        warmup = self.cfg.dsa is not None and self.cfg.dsa.dense_warmup
        trained = [(self.cfg.lora is None or lora.is_adapter(n)) and not is_expert_bias(n)
                   and (not warmup or dsa.is_indexer(n)) for n in self.names]
        self.train_plan = self.plan.subset(trained)
        self.train_names = self.train_plan.names
        self.train_params = [p for p, t in zip(self.params, trained) if t]
        chunk_trained = iter(trained)
        chunk_params = [[p for p in params if next(chunk_trained)] for params in chunk_params]
        # what the backward differentiates: the trained parameters, but where the experts' weight
        # gradients go to fp32 sinks (--gemm-gradient-accumulation-fusion) the sinks in their place
        # under LoRA the experts' weights are frozen: no gradient to sink
        sinks = moe.gradient_sinks(self.moe_layers) if "matmul_add" in self.cfg.fused and self.cfg.lora is None else {}
        self.grad_targets = [sinks.get(id(p), p) for p in self.train_params]
        chunk_targets = [[sinks.get(id(p), p) for p in params] for params in chunk_params]
        keep = (saved_optimizer is not None and (shards.names("optimizer") if shards else saved_optimizer[0])
                and ckpt.load_optimizer)
        self.optimizer = build.optimizer(list(zip(self.train_names, self.train_params)), self.train_plan,
                                         self.plan, ps, self.opt, config.layout.distributed_optimizer,
                                         saved_optimizer if keep else None, self.cfg)
        if shards is not None:
            read = distributed.gather_json(shards.bytes_read, ps)
            self.say(f"read {sum(read) / 2**20:.2f} MiB of the checkpoint's {shards.total_bytes() / 2**20:.2f} MiB; "
                     f"bytes read per rank: {read}")
        self.overlap = None  # --overlap-grad-reduce: the optimizer's buckets reduced during backward
        if config.layout.overlap_grad_reduce and (ps.size("dp_cp") > 1 or ps.size("edp") > 1):
            self.overlap = overlap.OverlappedReduction(self.optimizer.buckets(), distributed.summed_across_model_parallel(
                self.train_plan, ps, self.cfg.last_stage_embeddings))
        self.param_gather = None  # --overlap-param-gather: the updated parameters gathered up to their use
        if config.layout.overlap_param_gather and ps.size("dp_cp") > 1:
            self.param_gather = overlap.OverlappedParamGather(self.optimizer, self.chunks)
        self.forward_backward, self.forward_only, self.policy, self.grad_fn = schedules.forward_backward_func(
            self, chunk_targets)
        self.reward_model = grpo.RewardModel(self.grpo.reward_model, self.cfg.vocab_size, ps) \
            if self.rl and self.grpo.reward_model else None
        if self.reward_model is not None:
            held = sum(ops.numel(p) for p in nn.parameters(self.reward_model.model))
            self.say(f"GRPO: reward model {self.grpo.reward_model}: {held:,} of its "
                     f"{self.reward_model.cfg.num_parameters():,} parameters on this rank")
        if self.rl and self.grpo.kl_coef:  # the starting weights of this rank's parameters, for the KL term
            if saved_optimizer is not None:
                self.say("GRPO: the KL reference is the weights this run resumes from (the starting weights of the "
                         "run before are not kept)")
            self.grpo_reference = grpo.Reference(self.params)

    def optimizer_state_line(self) -> str:
        """What the optimizer holds on rank 0, per trained parameter there (its moments' stored
        dtypes: --exp-avg-dtype / --exp-avg-sq-dtype / --o2-optimizer)."""
        held, local = self.optimizer.state_bytes(), sum(ops.numel(p) for p in self.train_params)
        first, second = self.opt.moment_dtypes
        swapped = "" if not getattr(self.optimizer, "swap_pieces", None) else (
            f"; between steps all of it in host memory (--swap-optimizer), "
            f"{self.optimizer.device_state_bytes() / 2**20:.2f} MiB on the device; an update brings it in "
            f"{self.optimizer.swap_pieces} pieces of at most {self.optimizer.piece_bytes() / 2**20:.4f} MiB")
        return (f"optimizer state: {held / 2**20:.2f} MiB on this rank, {held / max(local, 1):.2f} bytes per trained "
                f"parameter (moments stored as exp_avg {first}, exp_avg_sq {second}){swapped}")

    def optimizer_bytes_unsharded(self) -> int:
        """What plain AdamW would hold on this rank: two fp32 moments per local parameter,
        plus fp32 masters for low-precision ones."""
        elements = sum(ops.numel(p) for p in self.train_params)
        masters = sum(ops.numel(p) for p in self.train_params if ops.dtype_of(p) != "float32")
        return 4 * (2 * elements + masters)

    # -- the loop ----------------------------------------------------------------------------
    def say(self, text: str) -> None:
        if self.ps.rank == 0:
            self.say_all(text)

    def say_all(self, text: str) -> None:
        """Print from this rank, whichever it is."""
        print(text, file=self._out or sys.stdout, flush=True)

    def _stage_stats(self, record: str) -> dict | None:
        """The preference or reward figures of the micro-batches since the last call, over every
        data-parallel rank (a collective on every rank): {name: value} (None without a stage
        objective). ``record``: "train" or "valid", the prefix of the names."""
        if self.objective is None:
            return None
        names = ("step_accuracy",) if self.stage_name == "prm" else grpo.STATS if self.rl else alignment.STATS
        mine = self.objective.take_stats()
        values = np.zeros(len(names), np.float32) if mine is None else mine.astype(np.float32)
        # the last stage's figures (zeros elsewhere); GRPO's CP ranks each hold a share of them
        values = distributed.sum_over_dp_and_pp(values, self.ps, ("dp", "pp", "cp") if self.rl else ("dp", "pp"))
        return {f"{record}_{name}": float(v) / self.ps.dp for name, v in zip(names, values)}

    def _mtp_step_losses(self) -> list[float]:
        """Each multi-token prediction depth's loss this step, the mean over micro-batches and
        data-parallel ranks as the loss (a collective over DP and PP: the last stage has them)."""
        mine = np.zeros(self.cfg.mtp_num_layers, np.float32)
        for module in self.mtp_modules:
            mine += (module.take_losses() / self.grad_accum).astype(np.float32)
        return [float(v) / self.ps.dp for v in distributed.sum_over_dp_and_pp(mine, self.ps)]

    def _indexer_step_loss(self) -> float:
        """Sparse attention's indexer loss this step, as megatron-core logs its routers' (before the
        coefficient): the mean KL over the indexer layers, micro-batches and data-parallel ranks."""
        mine = np.zeros(2, np.float32)
        for chunk in self.chunks:
            mine += np.array(chunk.take_indexer_log(), np.float32)
        kl, count = distributed.sum_over_dp_and_pp(mine, self.ps)
        return float(kl / max(count, 1.0))

    def gradients(self, iteration: int) -> tuple[float, list]:
        """The step's mean loss (on every rank) and this rank's gradients, complete as the
        parallel plan asks but not yet reduced over data-parallel ranks."""
        mbs = self.opt.micro_batch_size
        if self.loop.compile:  # a compiled step runs no forward hooks (--overlap-param-gather)
            self.parameters_ready()
        if self.rl:  # this iteration's rollouts; under CP this rank's columns of each row
            columns = None if self.ps.cp == 1 else context.local_columns(self.rollouts.ids.shape[1], self.ps.cp,
                                                                         self.ps.local_rank("cp"))
            micro_batches = (self.rollouts.micro_batch(start, mbs, columns, self.ps.cp)
                             for start in range(0, self.rollouts.rows, mbs))
        else:
            micro_batches = (self.batches.micro_batch("train", rows) for rows in self.sampler.micro_batches(iteration))
            if self.opt.per_token_loss:
                micro_batches = self._per_token(list(micro_batches))
        loss, grads = self.forward_backward(micro_batches)
        plan = self.train_plan
        grads = distributed.sum_partial_over_tp(grads, self.ps, plan.indices("partial"))
        grads = distributed.sum_kv_copies(grads, plan)
        grads = distributed.sum_tied_embeddings(grads, plan, self.ps,
                                                self.cfg.last_stage_embeddings)
        return loss, grads

    def _per_token(self, micro_batches: list) -> list:
        """--calculate-per-token-loss (Megatron's): each kept label's loss weighs micro-batches x DP
        over the global batch's kept labels (summed over the DP ranks), so that the mean over the
        micro-batches and the DP ranks is the mean over every token of the step. Without loss masks
        every micro-batch holds as many labels, and the plain mean is that already."""
        tokens = [tokens for _, _, tokens in micro_batches]  # (ids, labels, tokens) each
        if any(t is None or t.loss_mask is None for t in tokens):
            return micro_batches
        features.note_used("per-token-loss")
        local = sum(float(np.asarray(t.loss_mask, np.float32).sum()) for t in tokens)
        total = local if self.ps.dp == 1 else float(
            ops.to_numpy(dist.all_reduce(ops.tensor([local]), group=self.ps.group("dp")))[0])
        weight = len(micro_batches) * self.ps.dp / max(total, 1.0)
        for t in tokens:
            t.loss_weight = weight
        return micro_batches

    def train_step(self, iteration: int) -> tuple[float, float, float]:
        if self.rl:
            return self._rl_iteration(iteration)
        return self._step(iteration)

    def _rl_iteration(self, iteration: int) -> tuple[float, float, float]:
        """GRPO: draw and score this iteration's rollouts, then --ppo-epochs optimizer steps on them."""
        ps, settings, mbs = self.ps, self.grpo, self.opt.micro_batch_size
        t0 = time.perf_counter()
        indices = [k for rows in self.sampler.micro_batches(iteration) for k in rows]  # this rank's prompts
        rollouts = grpo.draw(self.policy, self.tokenizer, [self.data["train"][i] for i in indices], indices, settings,
                             self.reward_functions, self.reward_model, seq_length=self.config.data.seq_length,
                             micro_batch_size=mbs, seed=self.config.data.seed)
        if self.grpo_reference is not None:
            rollouts.reference = self.grpo_reference.log_probs(self.policy, rollouts, mbs, settings.temperature)
        if settings.loss_type == "dapo":  # the step's completion tokens, over all ranks
            tokens = distributed.sum_over_dp_and_pp(np.array([rollouts.mask.sum()], np.float32), ps, ("dp",))[0]
            rollouts.tokens_per_micro_batch = max(float(tokens), 1.0) / (self.grad_accum * ps.dp)
        if settings.ppo_epochs > 1:  # the policy that drew them, before it moves
            rollouts.old = grpo.log_probs(self.policy, rollouts, mbs, settings.temperature)
        self.rollouts = rollouts
        rollout_seconds = time.perf_counter() - t0
        losses = []
        for _ in range(settings.ppo_epochs):
            loss, lr, norm = self._step(iteration)
            losses.append(loss)
        figures = sorted(rollouts.stats)
        mine = np.array([rollouts.stats[k] for k in figures], np.float32)
        mean = distributed.sum_over_dp_and_pp(mine, ps, ("dp",)) / ps.dp  # every stage drew the same rollouts
        self.stage_stats = {**{f"train_{k}": float(v) for k, v in zip(figures, mean)}, **(self.stage_stats or {})}
        self.timers = {"rollout": rollout_seconds, **self.timers, "iteration": time.perf_counter() - t0}
        return float(np.mean(losses)), lr, norm

    def _step(self, iteration: int) -> tuple[float, float, float]:
        """One optimizer step on iteration ``iteration``'s micro-batches."""
        opt = self.opt
        lr = learning_rate(iteration, opt.lr, opt.min_lr, opt.lr_warmup_iters, opt.lr_decay_iters, opt.lr_decay_style)
        if self.dtype != "float32":
            features.note_used("bf16" if self.dtype == "bfloat16" else "fp16")
        for layer in self.moe_layers:
            layer.reset_stats()
        for module in self.mtp_modules:
            module.reset_stats()
        t0 = time.perf_counter()
        loss, grads = self.gradients(iteration)
        t1 = time.perf_counter()
        grads = self.optimizer.prepare(grads, self.overlap.finish(grads) if self.overlap is not None else None)
        n = self.ps.size("dp_cp")  # CP ranks' losses are means over equal shares of each sequence
        if n > 1:
            loss = float(ops.to_numpy(dist.all_reduce(ops.tensor([loss]), group=self.ps.group("dp_cp")))[0]) / n
        if self.cfg.moe is not None:
            self.moe_stats = routing.step_stats(self.moe_layers, self.cfg, self.ps, self.grad_accum)
        if self.cfg.mtp_num_layers:
            self.mtp_stats = self._mtp_step_losses()
        self.stage_stats = self._stage_stats("train")
        if self.cfg.dsa is not None and self.cfg.dsa.loss_coeff:
            self.indexer_stat = self._indexer_step_loss()
        norm = self.optimizer.grad_norm(grads)
        if self.after_reduction is not None:
            self.after_reduction(iteration, grads, norm)
        if not self.scaler.step_allowed(math.isfinite(loss) and math.isfinite(norm)):
            self.timers = {"forward-backward": t1 - t0, "iteration": time.perf_counter() - t0}
            return loss, lr, float("nan")  # fp16 overflow: step skipped, the scale halved
        if not math.isfinite(loss):
            raise MindSpeedError(f"the loss became {loss} at iteration {iteration + 1}; stopping without saving "
                                 f"(the last checkpoint on disk is intact); lower --lr or check the data")
        if not math.isfinite(norm):
            raise MindSpeedError(f"the gradient norm became {norm} at iteration {iteration + 1}; stopping without "
                                 f"saving (the last checkpoint on disk is intact); lower --lr or check the data")
        self.parameters_ready()  # what no forward waited for (parameters unused last step) first
        started = self.optimizer.step(grads, lr, distributed.clip_coefficient(norm, opt.clip_grad),
                                      gather_later=self.param_gather is not None)
        if self.param_gather is not None:
            self.param_gather.started(started)
        if self.moe_stats is not None:
            routing.update_expert_bias(self.moe_layers, self.cfg, self.moe_stats["tokens_per_expert"])
        if self.qk_clip is not None:  # after the update, as megatron-core clips
            self.parameters_ready()
            self.qk_stats = self.qk_clip.after_step(self.chunks, self.optimizer, self.ps)
        device.synchronize()
        t2 = time.perf_counter()
        # the loss reached the host at t1, so the forward and backward work had finished there;
        # the optimizer's phase holds the gradient reductions, the norm and the update
        self.timers = {"forward-backward": t1 - t0, "optimizer": t2 - t1, "iteration": t2 - t0}
        return loss, lr, norm

    def parameters_ready(self) -> None:
        """Every parameter holds its last update (--overlap-param-gather leaves gathers under way
        for the next forward to wait for)."""
        if self.param_gather is not None:
            self.param_gather.wait_all()

    def evaluate(self) -> float:
        self.parameters_ready()
        mbs = self.opt.micro_batch_size
        micro_batches = [self.batches.micro_batch("valid", range(k * mbs, (k + 1) * mbs))
                         for k in range(self.loop.eval_iters)]
        for chunk in self.chunks:
            nn.set_training(chunk, False)  # no dropout
        try:
            loss = self.forward_only(micro_batches)
        finally:
            for chunk in self.chunks:
                nn.set_training(chunk, True)
        if self.ps.cp > 1:  # each CP rank saw its share of every sequence
            loss = float(ops.to_numpy(dist.all_reduce(ops.tensor([loss]), group=self.ps.group("cp")))[0]) / self.ps.cp
        self.eval_stats = self._stage_stats("valid")
        return loss

    def _sample(self, result: dict, log) -> None:
        """A text sample of the trained model on rank 0 (training/sample.py), printed and logged."""
        model = self.model
        if self.ps.pp > 1 or self.ps.cp > 1:  # one whole single-device model on rank 0
            arrays = whole_model_arrays(self)
            model = None
            if self.ps.rank == 0:
                model = self.model_spec.build(self.cfg)
                load_whole_state(model, arrays)
        if model is not None:
            prompt, ids, text, shown = sample.draw(model, self.tokenizer, self.instruction and self.embedded,
                                                   self.loop.sample_tokens, self.config.data.seq_length,
                                                   self.config.data.seed)
            self.say(shown)
            result["sample"] = text
            log.write({"iteration": self.iteration, "sample_prompt": prompt, "sample_ids": ids, "sample": text})
            log.close()
        if self.ps.pp > 1 or self.ps.cp > 1:
            dist.barrier()

    def _loop(self, log, window, progress, collect, watch, history: list) -> int | None:
        """The steps up to --train-iters (or --exit-interval, or a signal the ranks agree on:
        returned), each logged, evaluated and saved at its intervals."""
        loop, ckpt, train_iters = self.loop, self.ckpt, self.opt.train_iters
        while self.iteration < train_iters:
            window.before_step(self.iteration)
            self.timeline = window.schedule  # --profile: the pipeline schedule's actions join the window's traces
            loss, lr, norm = self.train_step(self.iteration)
            self.iteration += 1
            with log.paused():
                window.after_step(self.iteration)
            log.step(self.tokens_per_step, self.iteration, loss, lr, norm, self.scaler.scale,
                     self.opt.global_batch_size, self.timers)
            if collect and self.iteration % collect == 0:
                gc.collect()
            history.append(loss)
            if progress:
                progress.update(1, f"loss {loss:.3f}")
            if self.iteration % loop.log_interval == 0 or self.iteration == train_iters:
                log.report(self.iteration, train_iters, loss, lr, norm, moe=self.moe_stats,
                           stage=self.stage_stats, mtp=self.mtp_stats, indexer=self.indexer_stat, qk=self.qk_stats)
            # GRPO has no validation loss: its rollouts' rewards are the figures
            if loop.eval_iters and loop.eval_interval and self.iteration % loop.eval_interval == 0 and not self.rl:
                with log.paused():
                    if collect is not None:
                        gc.collect()
                    log.validation(self.iteration, self.evaluate(), self.eval_stats)
            if ckpt.save and ckpt.save_interval and self.iteration % ckpt.save_interval == 0:
                with log.paused():
                    self.checkpoints.save(self.iteration)
            elif self.checkpoints.pending is not None:  # published once every rank's writer is done
                with log.paused():
                    self.checkpoints.finish(only_if_written=True)
            stopped_by = watch.agreed(self.ps) if watch is not None else None
            if stopped_by:  # saved at the end of the run
                features.note_used("exit-signal-handler")
                self.say(f"received {signal.Signals(stopped_by).name}: stopping after iteration {self.iteration}")
                self.parameters_ready()
                return stopped_by
            if loop.exit_interval and self.iteration % loop.exit_interval == 0 and self.iteration < train_iters:
                self.say(f"exiting at iteration {self.iteration} (--exit-interval)")
                break
        self.parameters_ready()
        return None

    def run(self) -> dict:
        config, loop, ckpt = self.config, self.loop, self.ckpt
        self.build()
        self.checkpoints.remove_stale_temporaries()
        peak = metrics.matmul_peak(self.dtype)
        flops_per_token = self.cfg.flops_per_token(config.data.seq_length)
        self.say(f"training {self.cfg.num_parameters() / 1e6:.2f}M parameters on {runtime.bound().NAME} "
                 f"({device.current()}), {self.opt.train_iters} iterations of {self.tokens_per_step} tokens; "
                 f"measured {self.dtype} matmul peak {peak / 1e9:.1f} GFLOP/s")
        if self.ps.world > 1:
            pp = f" PP={self.ps.pp}" + (" x 2 chunks in a V (DualPipeV)" if self.layout.v_shape else
                                         f" x {self.layout.chunks} chunks" if self.layout.chunks > 1 else "")
            lay = config.layout
            cp = f" CP={self.ps.cp} ({lay.context_parallel_algo})" if self.ps.cp > 1 else ""
            if self.ps.ep > 1:
                cp += f" EP={self.ps.ep} ({lay.moe_dispatcher} dispatcher)"
            self.say(f"parallel layout: TP={self.ps.tp} DP={self.ps.dp}{pp if self.ps.pp > 1 else ''}{cp}"
                     f"{' +SP' if lay.sequence_parallel else ''}; "
                     f"each data-parallel rank: {self.grad_accum} micro-batches of {self.opt.micro_batch_size} per step; "
                     f"optimizer state {self.optimizer.state_bytes() / 2**20:.2f} MiB on this rank "
                     f"{'(in host memory: --swap-optimizer) ' if self.opt.swap_pieces else ''}"
                     f"({self.optimizer_bytes_unsharded() / 2**20:.2f} MiB as plain AdamW unsharded)")
        if hasattr(self.optimizer, "describe"):  # --optimizer muon: which parameters it updates
            self.say(self.optimizer.describe())
        self.say(self.optimizer_state_line())
        progress = Progress(self.opt.train_iters, "train", min_interval=1.0) if loop.progress and not self.ps.rank \
            else None
        if progress:
            progress.n = self.iteration
        history = []
        board = boards.build(config.operations.boards, self.describe()) if self.ps.rank == 0 else None
        log = MetricsLog(loop.metrics_file if self.ps.rank == 0 else None, self.say, flops_per_token, peak, self.ps.world,
                         board, "lm loss" if self.objective is None else f"{self.stage_name} loss",
                         functools.partial(metrics.probe_matmul, self.dtype))
        window = profiling.Window(config.operations.profile, self.opt.train_iters, self.ps.rank, self.ps.world,
                                  self.say_all)
        collect = loop.gc_interval
        if collect is not None:  # Megatron's --manual-gc: the collector runs at fixed steps only, not mid-step
            gc.disable()
        watch = preemption.SignalWatch() if ckpt.exit_on_signal else None
        try:  # the watch outlives the last save: a later copy of the signal must not kill a rank mid-save
            try:
                stopped_by = self._loop(log, window, progress, collect, watch, history)
            finally:
                if collect is not None:
                    gc.enable()
                window.close()
                if progress:
                    progress.close()
                log.close()
            if ckpt.save and (not ckpt.save_interval or self.iteration % ckpt.save_interval) and history:
                self.checkpoints.save(self.iteration)
            self.checkpoints.finish()
            if ckpt.hf_folders is not None and ckpt.hf_last_only and history:
                self.checkpoints.write_hf_folder(self.iteration)
        finally:
            if watch is not None:
                watch.close()
        if stopped_by:
            where = (f"saved iteration {self.iteration} in {ckpt.save}; {self._continue_flags()} continues it"
                     if ckpt.save else "nothing saved (no --save)")
            raise Stopped(f"stopped by {signal.Signals(stopped_by).name} after iteration {self.iteration}: {where}",
                          stopped_by)
        if "hidden" in self.fb_exchanges:  # what --moe-fb-overlap did (counted on each rank; said by rank 0)
            self.say(f"--moe-fb-overlap: {self.fb_exchanges['hidden']} all-to-all exchanges of pipeline rank 0 travelled "
                     f"while another micro-batch computed")
        result = {"iterations": self.iteration, "losses": history}
        if loop.sample_tokens and not self.cfg.reward_head:  # a reward model scores text, it writes none
            self._sample(result, log)
        if self.embedded and ckpt.save and history:
            self.say(sample.next_steps(ckpt.save, runtime.bound().NAME, self.instruction, self._continue_flags()))
        return result

    def _continue_flags(self) -> str:
        """The flags that continue this run from its --save: --load it, or with --lora-ckpt-filter
        (the adapters only) the base model's flag and --lora-load it."""
        ckpt = self.ckpt
        if not ckpt.adapters_only:
            return f"--load {shlex.quote(ckpt.save)}"
        base = f"--load {shlex.quote(ckpt.load)}" if ckpt.load else f"--load-hf {shlex.quote(ckpt.load_hf)}"
        return f"{base} --lora-load {shlex.quote(ckpt.save)}"
