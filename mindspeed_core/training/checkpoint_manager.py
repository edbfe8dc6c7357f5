"""Saving a run (torchtitan's CheckpointManager, in small): what each rank writes and when it is
published. The formats are checkpoint.py's (folders, atomicity, the whole format) and
sharded_checkpoint.py's (each rank's pieces and their index); reading a checkpoint back is
build.py's and resume.py's.

A save is whole (--save-whole: gathered to rank 0, which writes it) or sharded (every rank
writes the pieces it owns, with a torch_dist copy for --ckpt-format torch_dist); with
--async-save the pieces are copied on the host and written by a thread while training goes on,
and published (every rank's file written, the tracker moved) at the next step that finds them
done, or before the next save, or at the end.
"""

from __future__ import annotations

import os
import time

import numpy as np

from mindspeed_core import dist, features, ops, runtime
from mindspeed_core.compat import hf, mcore
from mindspeed_core.errors import MindSpeedError
from mindspeed_core.models.state import moved_under_lora
from mindspeed_core.training import checkpoint, distributed, resume, sharded_checkpoint


class CheckpointManager:
    """The run's saves. ``run``: the trainer, built (its configuration, parallel state, model
    pieces, optimizer, loss scaler, DPO reference and say())."""

    def __init__(self, run):
        self.run = run
        self.pending = None  # a checkpoint being written (--async-save), not yet published

    def remove_stale_temporaries(self) -> None:
        """What interrupted saves left in --save (rank 0, before the first step)."""
        save = self.run.ckpt.save
        if save and self.run.ps.rank == 0:
            removed = checkpoint.remove_stale_temporaries(save)
            if removed:
                self.run.say(f"removed what interrupted saves left in {save}: {', '.join(removed)}")

    def save(self, iteration: int) -> None:
        """Every rank saves iteration ``iteration`` (a collective)."""
        run = self.run
        self.finish()  # --async-save: the previous save first
        run.parameters_ready()
        bad = _first_non_finite(run.names, run.params)
        if bad is not None:  # never let a diverged model overwrite the last good checkpoint
            raise MindSpeedError(f"parameter {bad} is no longer finite at iteration {iteration}; not saving "
                                 f"(the last checkpoint on disk is intact); lower --lr or check the data")
        ps = run.ps
        meta = {"framework": runtime.bound().NAME, "model": run.cfg.to_dict(), "tokenizer": run.tokenizer.name,
                "adapters_only": run.ckpt.adapters_only,
                "consumed_samples": iteration * run.opt.global_batch_size,
                "parallel": {"tp": ps.tp, "dp": ps.dp, "pp": ps.pp, "cp": ps.cp, "ep": ps.ep,
                             "chunks": run.layout.chunks, "sequence_parallel": run.config.layout.sequence_parallel}}
        if run.ckpt.whole:
            self._save_whole(iteration, meta)
        else:
            self._save_sharded(iteration, meta)
        if run.ckpt.hf_folders is not None and not run.ckpt.hf_last_only:
            self.write_hf_folder(iteration)

    def write_hf_folder(self, iteration: int) -> None:
        """--enable-mg2hf-convert: the whole model (gathered, a collective) as a Hugging Face folder
        <folders>/mg2hf_iteration<N> on rank 0, with --hf-cfg-dir's tokenizer files."""
        run, ckpt = self.run, self.run.ckpt
        features.note_used("mg2hf-convert")
        arrays = whole_model_arrays(run)
        if run.ps.rank == 0:
            folder = os.path.join(ckpt.hf_folders, f"mg2hf_iteration{iteration}")
            hf.save_folder(folder, run.cfg, arrays)
            if ckpt.hf_companions is not None:
                hf.copy_companions(ckpt.hf_companions, folder)
            run.say(f"wrote the Hugging Face folder {folder}")
        dist.barrier()

    def _save_sharded(self, iteration: int, meta: dict) -> None:
        """Every rank writes the pieces it owns (training/sharded_checkpoint.py)."""
        run = self.run
        ps, ckpt = run.ps, run.ckpt
        # by name, the first of a name: DualPipeV's first rank holds the word embeddings and, later, the
        # last stage's copy of them (which never writes: parallel/plan.py's tied_copy)
        entry = {p.name: p for p in reversed(run.plan.params)}
        shapes = {n: tuple(p.shape) for n, p in zip(run.names, run.params)}
        model = [(sharded_checkpoint.held(n, shapes[n], plan, ps), ops.to_numpy(p), ops.dtype_of(p))
                 for n, p, plan in zip(run.names, run.params, run.plan.params) if _kept(run.ckpt, n)]
        optimizer, seen = [], set()
        for state, name, flat, values in (run.optimizer.held_state() if ckpt.save_optimizer else []):
            if (state, flat) in seen:  # the copy's state, equal to the embeddings' it follows
                continue
            seen.add((state, flat))
            # a distributed optimizer's slices: each rank writes its own (expert weights' too: they are
            # sharded over the expert-data-parallel group, which spans the CP ranks)
            # (dist_muon: each state is its owner's, written by it)
            writes = None if flat is None and not getattr(run.optimizer, "owner", None) else True
            optimizer.append((sharded_checkpoint.held(state, shapes[name], entry[name], ps, flat, writes), values,
                              "float32"))
        trainer_state = resume.run_state(ps, run.scaler, run.reference, rng=ckpt.save_rng)  # collective
        megatron = None
        if ckpt.torch_dist:
            features.note_used("ckpt-format-torch-dist")
            lay = run.config.layout
            layout = mcore.Layout(ps.tp, ps.pp, ps.ep, lay.layers_per_virtual_stage, lay.num_layer_list,
                                  etp=1 if lay.experts_whole else None)
            common = {"args": mcore.megatron_args(run.cfg, layout, run.dtype, iteration),
                      "checkpoint_version": mcore.CHECKPOINT_VERSION, "iteration": iteration}
            cfg = run.cfg  # megatron-core stacks the layers' tensors when the layers are alike
            alike = cfg.moe is None or all(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
            megatron = sharded_checkpoint.TorchDistCopy(cfg.num_layers, alike, cfg.moe.num_experts if cfg.moe else 0,
                                                        ps.local_rank("tp"), common, ps.ep_over_tp)
        background = ckpt.asynchronous
        if background:  # the writer must not see the next steps' in-place updates
            features.note_used("async-save")
            model = [(h, np.array(v, copy=True), d) for h, v, d in model]
            optimizer = [(h, np.array(v, copy=True), d) for h, v, d in optimizer]
        pieces = {"model": model, "optimizer": optimizer}
        self.pending = checkpoint.start_sharded(ckpt.save, iteration, ps.rank, pieces, run.optimizer.steps, meta,
                                                trainer_state, self._gather, dist.barrier, background, megatron)
        if not background:
            self.finish()

    def _gather(self, value) -> list:
        return distributed.gather_json(value, self.run.ps)

    def finish(self, only_if_written: bool = False) -> None:
        """Publish the save under way, if any (a collective); ``only_if_written``: only if every
        rank's file is written by now (--async-save's check after each step; else it waits)."""
        pending = self.pending
        if pending is None:
            return
        if only_if_written:
            flag = ops.tensor(np.array([0.0 if pending.written() else 1.0], np.float32))
            if float(ops.to_numpy(dist.all_reduce(flag, op="max"))[0]) > 0:
                return
        self.pending = None
        t0 = time.perf_counter()
        path = pending.finish(self._gather, dist.barrier)
        waited = f" (waited {time.perf_counter() - t0:.2f} s for the writers)" if pending.thread is not None else ""
        self.run.say(f"saved checkpoint {path}{waited}")

    def _save_whole(self, iteration: int, meta: dict) -> None:
        """--save-whole: the whole state gathered to rank 0, which writes it."""
        run = self.run
        ps, ckpt = run.ps, run.ckpt
        model_arrays = {n: v for n, v in whole_model_arrays(run).items() if _kept(ckpt, n)}  # collective: every rank
        opt, specs = (run.optimizer.state() if ckpt.save_optimizer else {}), run.plan.shard_specs
        opt_spec = {k: specs[k.split(".", 1)[1]] for k in opt if k.split(".", 1)[1] in specs}
        opt_experts = {k for k in opt if k.split(".", 1)[1] in run.plan.expert_names}
        optimizer_arrays = distributed.gather_pipeline(distributed.full_tensors(opt, opt_spec, ps, opt_experts), ps)
        trainer_state = resume.run_state(ps, run.scaler, run.reference, rng=ckpt.save_rng)  # collective
        if ps.rank == 0:
            path = checkpoint.save(ckpt.save, iteration, model_arrays, optimizer_arrays, run.optimizer.steps, meta,
                                   {n: run.dtype for n in model_arrays}, trainer_state)
            run.say(f"saved checkpoint {path}")
        dist.barrier()


def whole_model_arrays(run) -> dict:
    """{name: numpy} of the whole model on rank 0 (a collective: every rank calls it)."""
    named = dict(zip(run.names, run.params))
    return distributed.gather_pipeline(distributed.full_tensors(named, run.plan.shard_specs, run.ps,
                                                                run.plan.expert_names), run.ps)


def _first_non_finite(names: list, params: list):
    for name, p in zip(names, params):
        bad = ops.sum(ops.cast(ops.logical_not(ops.isfinite(p)), "float32"))
        if float(ops.to_numpy(bad)):
            return name
    return None


def _kept(ckpt, name: str) -> bool:
    """Whether a checkpoint holds the model tensor ``name``: every one, or with --lora-ckpt-filter
    the adapters (and the expert biases the run moved) only: the frozen base weights are the ones
    --load gave the run."""
    if not ckpt.adapters_only:
        return True
    features.note_used("lora-checkpoint-filter")
    return moved_under_lora(name)
