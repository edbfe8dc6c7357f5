"""Pipeline parallelism: the schedules (no processes), the layout and its bad inputs, and
multi-process runs whose losses and first-step gradients equal the single-process run's,
with checkpoints crossing pipeline sizes."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

from launch import run_configs as launch_configs
from test_parallel import assert_same_curve, aux_losses, gradient_difference, grad_norms, mtp_losses, same_records
from test_training import corpus, losses, train  # noqa: F401  (corpus is a fixture)

from mindspeed_core.errors import MindSpeedError
from mindspeed_core.parallel.pipeline import plan_layout, rank_of_stage, virtual_stage
from mindspeed_core.training.schedules import BACKWARD, DUALPIPEV, FORWARD, PAIR, RECV, SEND, pipeline_program

# -- the schedules -------------------------------------------------------------------------

GRID = [(p, v, m) for p in (2, 3, 4) for v in (1, 2, 3) for m in range(1, 13) if v == 1 or m % p == 0]


def run_blocking(program: dict, chunks: int, v_shape: bool = False) -> dict:
    """Execute a program as the ranks do: compute never waits, a transfer completes only when
    its sender and receiver both have it next (DualPipeV's turn on the last rank needs none).
    Returns per rank the peak number of chunk-micro-batches whose forward ran and whose
    backward did not; fails on a deadlock or on a compute action whose input has not arrived."""
    pp = len(program)
    pos = {r: 0 for r in program}
    arrived = {r: set() for r in program}
    live = {r: 0 for r in program}
    peak = {r: 0 for r in program}
    total = pp * chunks
    while any(pos[r] < len(program[r]) for r in program):
        moved = False
        for r in program:
            while pos[r] < len(program[r]) and program[r][pos[r]][0] in (FORWARD, BACKWARD, PAIR):
                if program[r][pos[r]][0] == PAIR:  # --moe-fb-overlap: both inputs are there before the forward
                    first, second = program[r][pos[r] + 1:pos[r] + 3]
                    assert first[0] == FORWARD and second[0] == BACKWARD and first[1:] != second[1:], program[r][pos[r]:]
                    stage = virtual_stage(pp, r, second[1], v_shape)
                    assert stage == total - 1 or ("gradient", stage, second[2]) in arrived[r], (r, second)
                    pos[r] += 1
                    continue
                kind, chunk, mb = program[r][pos[r]]
                stage = virtual_stage(pp, r, chunk, v_shape)
                if kind == FORWARD and stage > 0:
                    assert ("activation", stage, mb) in arrived[r], (r, program[r][pos[r]])
                if kind == BACKWARD and stage < total - 1:
                    assert ("gradient", stage, mb) in arrived[r], (r, program[r][pos[r]])
                nxt = stage + 1 if kind == FORWARD else stage - 1  # a hand-over within the rank
                if 0 <= nxt < total and rank_of_stage(pp, nxt, v_shape) == r:
                    arrived[r].add(("activation" if kind == FORWARD else "gradient", nxt, mb))
                live[r] += 1 if kind == FORWARD else -1
                peak[r] = max(peak[r], live[r])
                pos[r] += 1
                moved = True
            if pos[r] == len(program[r]):
                continue
            kind, peer, message = program[r][pos[r]]
            if kind == SEND and pos[peer] < len(program[peer]) and program[peer][pos[peer]] == (RECV, r, message):
                arrived[peer].add(message)
                pos[r] += 1
                pos[peer] += 1
                moved = True
        assert moved, f"deadlock: {[program[r][pos[r]] if pos[r] < len(program[r]) else None for r in program]}"
    return peak


def test_interleaved_forwards_are_those_with_other_compute_before_their_backward():
    from mindspeed_core.training.schedules import _interleaved_forwards

    program = pipeline_program(2, 1, 4)
    # the first stage runs F0 F1 B0 F2 B1 F3 B2 B3: each forward has other compute before its
    # backward (F3 has B2, which records its forward again on MindSpore); the last stage runs
    # each backward right after its forward
    assert _interleaved_forwards(program[0]) == {(0, mb) for mb in range(4)}
    assert _interleaved_forwards(program[1]) == set()
    assert _interleaved_forwards([(FORWARD, 0, 0), (SEND, 1, "x"), (RECV, 1, "y"), (BACKWARD, 0, 0)]) == set()


@pytest.mark.parametrize("fb_overlap", (False, True), ids=("plain", "fb-overlap"))
@pytest.mark.parametrize("pp, chunks, micro_batches", GRID, ids=[f"p{p}-v{v}-m{m}" for p, v, m in GRID])
def test_pipeline_programs_run_to_the_end_with_1f1b_memory(pp, chunks, micro_batches, fb_overlap):
    """1F1B and interleaved programs; with --moe-fb-overlap one warm-up forward more, every
    steady-state forward paired with the backward of another micro-batch (run_blocking checks
    that both inputs are there before the pair starts), and a stage holding one more."""
    program = pipeline_program(pp, chunks, micro_batches, fb_overlap=fb_overlap)
    peak = run_blocking(program, chunks)
    every = {(c, mb) for c in range(chunks) for mb in range(micro_batches)}
    for r, prog in program.items():
        forwards = [(i[1], i[2]) for i in prog if i[0] == FORWARD]
        backwards = [(i[1], i[2]) for i in prog if i[0] == BACKWARD]
        assert sorted(forwards) == sorted(every) and sorted(backwards) == sorted(every)
        assert all(prog.index((BACKWARD, *x)) > prog.index((FORWARD, *x)) for x in every)
        # the warm-up bounds what a stage holds: P - rank micro-batches for 1F1B, Megatron's
        # interleaved warm-up + 1 chunk-micro-batches when interleaved; never everything at
        # once when there are more micro-batches than that
        if chunks == 1:
            bound = min(pp - r + fb_overlap, micro_batches)
        else:
            bound = min((pp - r - 1) * 2 + (chunks - 1) * pp + 1 + fb_overlap, micro_batches * chunks)
        assert peak[r] <= bound, (r, peak[r], bound)
        # the pairs: every forward after the warm-up (Megatron's + 1), none without the flag
        warmup = pp - r - 1 if chunks == 1 else (pp - r - 1) * 2 + (chunks - 1) * pp
        pairs = max(micro_batches * chunks - warmup - 1, 0) if fb_overlap else 0
        assert sum(i[0] == PAIR for i in prog) == pairs, (r, prog)
    for a in range(pp):  # each link carries the same messages in the same order at both ends
        for b in range(pp):
            sent = [i[2] for i in program[a] if i[0] == SEND and i[1] == b]
            received = [i[2] for i in program[b] if i[0] == RECV and i[1] == a]
            assert sent == received
    if chunks == 1 and micro_batches >= pp + fb_overlap:
        assert peak[0] == pp + fb_overlap  # the bound is reached, so it is what limits memory
    for m in {micro_batches, micro_batches + 1}:  # evaluation's micro-batches: any count, interleaved too
        forward_only = pipeline_program(pp, chunks, m, forward_only=True)
        run_blocking(forward_only, chunks)
        assert all(i[0] != BACKWARD for prog in forward_only.values() for i in prog)
        assert all(sorted(i[1:] for i in prog if i[0] == FORWARD) == [(c, mb) for c in range(chunks) for mb in range(m)]
                   for prog in forward_only.values())


DUALPIPEV_GRID = [(p, m) for p in (2, 3, 4, 8) for m in (2 * p - 1, 2 * p, 2 * p + 3, 20)]


@pytest.mark.parametrize("fb_overlap", (False, True), ids=("plain", "fb-overlap"))
@pytest.mark.parametrize("pp, micro_batches", DUALPIPEV_GRID, ids=[f"p{p}-m{m}" for p, m in DUALPIPEV_GRID])
def test_dualpipev_programs_run_to_the_end_holding_2p_plus_1_chunks(pp, micro_batches, fb_overlap):
    """DualPipeV's programs; with --moe-fb-overlap the steady state's two forward-backward pairs
    and the B1 F1 B0 phase's one are pairs (DeepSeek's overlapped steps), in the same order."""
    program = pipeline_program(pp, 2, micro_batches, schedule=DUALPIPEV, fb_overlap=fb_overlap)
    peak = run_blocking(program, 2, v_shape=True)
    if fb_overlap:
        plain = pipeline_program(pp, 2, micro_batches, schedule=DUALPIPEV)
        assert {r: [i for i in p if i[0] in (FORWARD, BACKWARD)] for r, p in program.items()} == \
            {r: [i for i in p if i[0] in (FORWARD, BACKWARD)] for r, p in plain.items()}
        for r, prog in program.items():  # 2 (M - 2P + r + 1) in the steady state, P - r - 1 after it
            assert sum(i[0] == PAIR for i in prog) == 2 * (micro_batches - 2 * pp + r + 1) + pp - r - 1, r
    every = {(c, mb) for c in range(2) for mb in range(micro_batches)}
    for r, prog in program.items():
        forwards = [(i[1], i[2]) for i in prog if i[0] == FORWARD]
        backwards = [(i[1], i[2]) for i in prog if i[0] == BACKWARD]
        assert sorted(forwards) == sorted(every) and sorted(backwards) == sorted(every)
        for chunk in (0, 1):  # each chunk takes the micro-batches in turn, both ways
            assert [mb for c, mb in forwards if c == chunk] == list(range(micro_batches))
            assert [mb for c, mb in backwards if c == chunk] == list(range(micro_batches))
        # DeepSeek's figure: every rank holds 2P + 1 chunks' activations at its peak (1F1B's first
        # stage holds P stages' worth, 2P chunks); with the least micro-batches, the first rank fewer
        assert peak[r] == 2 * pp + 1 or (micro_batches == 2 * pp - 1 and r == 0 and peak[r] < 2 * pp + 1), (r, peak)
        # the V: chunk 0 sends down to r + 1, chunk 1 up to r - 1; the last rank turns without a transfer
        for kind, peer, (what, stage, _) in (i for i in prog if i[0] in (SEND, RECV)):
            assert abs(peer - r) == 1 and rank_of_stage(pp, stage, True) == (peer if kind == SEND else r)
    last = program[pp - 1]
    turn = {("activation", pp), ("gradient", pp - 1)}  # stage P's input and stage P - 1's gradient stay on the rank
    assert not any(i[0] in (SEND, RECV) and i[2][:2] in turn for i in last)
    for a in range(pp):  # each link carries the same messages in the same order at both ends
        for b in range(pp):
            assert [i[2] for i in program[a] if i[0] == SEND and i[1] == b] == \
                [i[2] for i in program[b] if i[0] == RECV and i[1] == a]
    for m in (1, micro_batches):  # evaluation: fewer micro-batches than training needs too
        forward_only = pipeline_program(pp, 2, m, forward_only=True, schedule=DUALPIPEV)
        run_blocking(forward_only, 2, v_shape=True)
        assert all(i[0] != BACKWARD for prog in forward_only.values() for i in prog)


@pytest.mark.parametrize("pp, schedule", [(2, None), (4, None), (4, DUALPIPEV)])
def test_simulated_pairs_start_when_both_inputs_are_there_and_run_back_to_back(pp, schedule):
    """--moe-fb-overlap's pairs in the simulation behind the planner and the figures: each pair's
    backward starts as its forward ends, and the forward not before the backward's gradient is made."""
    from mindspeed_core.training.schedules import simulated_timeline

    chunks = 2 if schedule else 1
    program = pipeline_program(pp, chunks, 3 * pp, schedule=schedule, fb_overlap=True)
    timeline = simulated_timeline(program, chunks, schedule, 1.0, 2.0)
    made = {}  # per rank: action -> its simulated span
    for r, prog in program.items():
        compute = [i for i in prog if i[0] in (FORWARD, BACKWARD)]
        assert [a[:3] for a in timeline[r]] == compute  # the program's order
        ends = {a[:3]: a for a in timeline[r]}
        pairs = [(prog[k + 1], prog[k + 2]) for k, i in enumerate(prog) if i[0] == PAIR]
        assert pairs
        for forward, backward in pairs:
            assert ends[backward][3] == ends[forward][4], (r, forward, backward)
        made[r] = ends
    v = schedule == DUALPIPEV
    for r, prog in program.items():  # a pair's forward starts once the backward's gradient is made
        for k, i in enumerate(prog):
            if i[0] != PAIR:
                continue
            forward, backward = prog[k + 1], prog[k + 2]
            stage = virtual_stage(pp, r, backward[1], v)
            if stage == pp * chunks - 1:  # the loss's own gradient
                continue
            giver = rank_of_stage(pp, stage + 1, v)
            chunk = next(c for c in range(chunks) if virtual_stage(pp, giver, c, v) == stage + 1)
            assert made[r][forward][3] >= made[giver][(BACKWARD, chunk, backward[2])][4], (r, forward, backward)


@pytest.mark.parametrize("pp", (2, 4, 8))
def test_simulated_bubbles_are_1f1bs_formula_and_dualpipevs_smaller(pp):
    """The timeline simulation behind the planner and the pipeline figure: 1F1B's idle time is
    the published (P - 1)(F + B) on every rank; DualPipeV's on the same P ranks (chunks of half a
    stage, so F and B halve) is below it and within DeepSeek's (P - 1)(F&B + B) - F, F&B = F + B
    here (nothing overlaps), and the same on every rank."""
    from mindspeed_core.training.schedules import idle_time, simulated_timeline

    m = 3 * pp
    for forward, backward in ((1.0, 2.0), (1.0, 1.0), (1.0, 3.0)):
        one = idle_time(simulated_timeline(pipeline_program(pp, 1, m), 1, None, forward, backward))
        assert set(one.values()) == {(pp - 1) * (forward + backward)}
        f, b = forward / 2, backward / 2
        v = idle_time(simulated_timeline(pipeline_program(pp, 2, m, schedule=DUALPIPEV), 2, DUALPIPEV, f, b))
        assert len(set(v.values())) == 1
        assert max(v.values()) <= (pp - 1) * (f + b + b) - f < max(one.values()), (v, one)


# -- the layout ----------------------------------------------------------------------------

def test_layouts_split_the_layers_as_megatron_and_mindspeed_do():
    assert plan_layout(8, 2).stages == ((0, 1, 2, 3), (4, 5, 6, 7))
    interleaved = plan_layout(8, 2, layers_per_virtual_stage=2)
    assert interleaved.chunks == 2 and interleaved.stages == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert [interleaved.rank_of_stage(s) for s in range(4)] == [0, 1, 0, 1]  # rank 0 holds stages 0 and 2
    assert plan_layout(8, 2, num_layer_list="3,5").stages == ((0, 1, 2), (3, 4, 5, 6, 7))
    noop = plan_layout(8, 2, noop_layers="7")
    assert noop.layers(1) == (4, 5, 6) and noop.layers(0) == (0, 1, 2, 3)
    with pytest.raises(MindSpeedError, match="does not divide the 5 layers"):
        plan_layout(5, 2)
    v = plan_layout(8, 2, dualpipev=True)  # MindSpeed-LLM's converter: pp2 holds [0 1 6 7 | 2 3 4 5]
    assert v.chunks == 2 and [v.layers(v.stage(r, c)) for r in range(2) for c in range(2)] == \
        [(0, 1), (6, 7), (2, 3), (4, 5)]
    v4 = plan_layout(8, 4, dualpipev=True)  # pp4: [0 7 | 1 6 | 2 5 | 3 4]
    assert [v4.layers(v4.stage(r, c)) for r in range(4) for c in range(2)] == [(i,) for i in (0, 7, 1, 6, 2, 5, 3, 4)]
    assert [v4.rank_of_stage(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]


@pytest.mark.parametrize("flags, message", [
    (["--pipeline-model-parallel-size", "3"], "pipeline parallel size 3 does not divide the 4 layers"),
    (["--pipeline-model-parallel-size", "2", "--num-layer-list", "1,2"], "sums to 3, not to the model's 4 layers"),
    (["--pipeline-model-parallel-size", "2", "--num-layer-list", "1,1,2"], "has 3 entries; it needs one per"),
    (["--pipeline-model-parallel-size", "2", "--num-layer-list", "a,b"], "expected comma-separated integers"),
    (["--pipeline-model-parallel-size", "2", "--num-layer-list", "0,4"], "every stage needs at least one layer"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"],
     "does not divide the 2 layers of each pipeline stage"),
    (["--num-layers-per-virtual-pipeline-stage", "1"], "needs --pipeline-model-parallel-size > 1"),
    (["--noop-layers", "4"], "noop_layers [4] must be some, not all, of the layers 0..3"),
    (["--noop-layers", "0,1,2,3"], "must be some, not all"),
    (["--schedules-method", "dualpipev", "--untie-embeddings-and-output-weights"],
     "--schedules-method dualpipev needs --pipeline-model-parallel-size 2 or more"),
    (["--schedules-method", "dualpipev", "--untie-embeddings-and-output-weights", "--pipeline-model-parallel-size",
      "4"], "the 4 layers must be a multiple of 2 x 4: change --num-layers (pad with --noop-layers)"),
    (["--schedules-method", "dualpipev", "--untie-embeddings-and-output-weights", "--pipeline-model-parallel-size",
      "2", "--num-layers-per-virtual-pipeline-stage", "1"], "drop --num-layers-per-virtual-pipeline-stage"),
    (["--schedules-method", "dualpipev", "--pipeline-model-parallel-size", "2", "--model-name", "tiny-gpt2",
      "--num-query-groups", "4"], "add --untie-embeddings-and-output-weights"),
    (["--schedules-method", "dualpipev", "--untie-embeddings-and-output-weights", "--pipeline-model-parallel-size",
      "2", "--context-parallel-size", "2"], "does not run with context parallelism"),
    # GLM-5's shared top-k: the second stage would start with a layer reusing the first stage's choice
    (["--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "8", "--qk-head-dim", "8",
      "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8", "--qk-layernorm", "--enable-dsa-indexer",
      "--index-topk-pattern", "FFSF", "--pipeline-model-parallel-size", "2", "--num-query-groups", "4"],
     "pipeline stage 1: layer 3 uses the top-k keys of layer 2, which this pipeline stage does not hold"),
])
def test_bad_pipeline_layouts_are_one_line_before_any_model_is_built(capsys, corpus, tmp_path, flags, message):  # noqa: F811
    code, out, err = train(capsys, *SMALL4, "--data-path", corpus, "--train-iters", "1", *flags)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and "training" not in out


def test_dualpipev_needs_2p_minus_1_micro_batches(corpus):  # noqa: F811
    """Checked where the world size is known (the configuration of a two-rank launch)."""
    from mindspeed_core.compat.megatron_args import training_parser
    from mindspeed_core.training import configuration

    flags = [*SMALL4, "--data-path", corpus, "--schedules-method", "dualpipev", "--untie-embeddings-and-output-weights",
             "--pipeline-model-parallel-size", "2"]
    configuration.configure(training_parser().parse_args([*flags, "--global-batch-size", "6"]), 2)  # 3: enough
    with pytest.raises(MindSpeedError, match=r"needs at least 2 x 2 - 1 = 3 micro-batches per step, and this run has "
                                             r"2 \(= global batch / \(micro batch x data-parallel size\)\): raise"):
        configuration.configure(training_parser().parse_args([*flags, "--global-batch-size", "4"]), 2)


def test_interleaving_needs_micro_batches_in_groups_of_the_pipeline_size(corpus, tmp_path):  # noqa: F811
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "mindspeed_core.cli", "launch", "--nproc-per-node", "2", "--",
                          *SMALL4, "--data-path", corpus, "--train-iters", "1", "--pipeline-model-parallel-size", "2",
                          "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "6"],
                         capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert out.returncode == 2, out.stdout + out.stderr
    assert "needs the micro-batches per step (3" in out.stderr and "multiple of the pipeline parallel size 2" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "msrun_log").exists()


# -- multi-process parity ------------------------------------------------------------------

SMALL4 = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
          "--ffn-hidden-size", "128", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
          "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "2", "--eval-iters", "0", "--log-interval", "1",
          "--make-vocab-size-divisible-by", "8", "--no-progress", "--seed", "7", "--sample-tokens", "0",
          "--lr-decay-iters", "10"]
MODELS = {"base": SMALL4 + ["--eval-iters", "2", "--eval-interval", "2", "--split", "90,10,0"],  # evaluation runs forward-only too
          "noop": SMALL4 + ["--noop-layers", "3"],
          "tied": SMALL4 + ["--model-name", "tiny-gpt2", "--num-query-groups", "4"],
          # documents packed into samples: every stage needs their attention boundaries and positions
          "packed": SMALL4 + ["--reset-attention-mask", "--reset-position-ids"],
          # MindSpeed-LLM's dense gated-DeltaNet hybrid (its qwen3_next spec): layers 0 and 2 linear
          # attention (chunks of 8 over the 32 tokens), 1 and 3 gated attention; one of each a stage
          "hybrid": SMALL4 + ["--spec", "mindspeed_llm.tasks.models.spec.qwen3_next_spec", "layer_spec",
                              "--qk-layernorm", "--add-rmsnorm-offset", "--full-attention-interval", "2",
                              "--linear-num-key-heads", "2", "--linear-num-value-heads", "4",
                              "--linear-key-head-dim", "16", "--linear-value-head-dim", "16", "--mamba-chunk-size", "8",
                              "--partial-rotary-factor", "0.5"]}
# DeepSeek-V3's pipeline ingredients for DualPipeV: top-2 of 4 experts after a dense first layer,
# one multi-token prediction module (on the first rank, the V's last stage), untied output, and
# evaluation of 3 micro-batches (the V's own order at PP2, down and back up at PP4)
MOE_MTP = SMALL4 + ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
                    "--moe-aux-loss-coeff", "0.01", "--first-k-dense-replace", "1", "--mtp-num-layers", "1",
                    "--mtp-loss-scaling-factor", "0.3", "--untie-embeddings-and-output-weights", "--eval-iters", "3",
                    "--eval-interval", "2", "--split", "90,10,0"]
MODELS["moe-mtp"] = MOE_MTP
# Muon for the matrices (Nesterov, the shape_scaling rule), AdamW for the rest: each stage's matrices whole
MODELS["muon"] = SMALL4 + ["--optimizer", "muon", "--muon-nesterov", "--muon-scale-mode", "shape_scaling",
                           "--weight-decay", "0.1"]
# Muon on a MoE model (top-2 of 4 experts, alltoall): the experts' weights expert by expert
MODELS["muon-moe"] = MODELS["muon"] + ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
                                       "--moe-aux-loss-coeff", "0.01", "--moe-token-dispatcher-type", "alltoall"]
# the same on 8 layers, 7 micro-batches a step: DualPipeV's least at PP4 (2P - 1)
MODELS["moe-mtp-8"] = MOE_MTP + ["--num-layers", "8", "--global-batch-size", "14"]
# 12 sequences a step: 3 micro-batches on each of two data-parallel ranks (DualPipeV's least at PP2)
MODELS["moe-mtp-12"] = MOE_MTP + ["--global-batch-size", "12"]
# with a shared expert beside the routed ones (DeepSeek's): --moe-fb-overlap computes it in the attention
# node, beside the router and the dispatched rows, the other users of the layer's normed input
MODELS["moe-mtp-12-shared"] = MODELS["moe-mtp-12"] + ["--moe-shared-expert-intermediate-size", "32"]
ITERS = 6  # the single-process run of the base model and the resumes
FROM_SINGLE = 3  # the iteration of the single-process checkpoint a PP2 run continues
LAYOUT_ITERS = 2  # the pipelined launches: the first steps of the same schedule (--lr-decay-iters)
RESUMED_TO = LAYOUT_ITERS + 2  # the resumes at other layouts: two steps on the loaded weights and moments
PP = ["--pipeline-model-parallel-size"]
TWO = [  # (name, model, flags), on two ranks
    ("pp2", "base", PP + ["2", "--save", "{out}/ckpt-pp2", "--save-interval", str(LAYOUT_ITERS)]),
    ("pp2-interleaved-recompute", "base", PP + ["2", "--num-layers-per-virtual-pipeline-stage", "1",
                                                "--recompute-granularity", "full", "--recompute-method", "uniform",
                                                "--recompute-num-layers", "1", "--save", "{out}/ckpt-vpp"]),
    # full recompute of each stage's first layer, norms recomputed in the rest: bit-identical to pp2
    ("pp2-recompute-block-norm", "base", PP + ["2", "--recompute-granularity", "full", "--recompute-method", "block",
                                              "--recompute-num-layers", "1", "--recompute-norm"]),
    ("pp2-noop", "noop", PP + ["2"]),
    ("pp2-uneven", "base", PP + ["2", "--num-layer-list", "1,3"]),
    ("pp2-tied", "tied", PP + ["2"]),
    ("pp2-hybrid", "hybrid", PP + ["2"]),
    ("pp2-dualpipev", "moe-mtp", PP + ["2", "--schedules-method", "dualpipev", "--save", "{out}/ckpt-dualpipev"]),
    ("pp2-muon", "muon", PP + ["2", "--save", "{out}/ckpt-muon"]),
    # --moe-fb-overlap under interleaved 1F1B (two chunks a rank, their pairs across chunks), at EP 1:
    # whole layers interleave, equal to one process
    ("pp2-vpp-fb", "moe-mtp", PP + ["2", "--num-layers-per-virtual-pipeline-stage", "1", "--moe-fb-overlap"]),
]
FOUR = [
    ("pp4", "base", PP + ["4", "--save", "{out}/ckpt-pp4", "--save-interval", str(LAYOUT_ITERS)]),
    ("tp2-pp2-sp-tied-selective-norm", "tied", PP + ["2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                                     "--recompute-activations", "--recompute-norm"]),
    ("pp4-packed", "packed", PP + ["4"]),  # the middle stages too
    ("pp2-dp2-distopt", "base", PP + ["2", "--use-distributed-optimizer", "--ddp-bucket-size", "3000"]),
    # each chunk's buckets start reducing during its last backward: the same bits as pp2-dp2-distopt
    ("pp2-dp2-distopt-overlap", "base", PP + ["2", "--use-distributed-optimizer", "--ddp-bucket-size", "3000",
                                              "--overlap-grad-reduce", "--overlap-param-gather"]),
    ("cp2-pp2", "base", PP + ["2", "--context-parallel-size", "2"]),  # ring attention between stages
    # saved when it ends (a sharded checkpoint: four files of distinct pieces), resumed at DP4 below
    ("tp2-pp2-distopt", "base", PP + ["2", "--tensor-model-parallel-size", "2", "--use-distributed-optimizer",
                                      "--save", "{out}/ckpt-tp2-pp2"]),
    ("pp4-dualpipev", "moe-mtp-8", PP + ["4", "--schedules-method", "dualpipev"]),
    # DeepSeek-V3's combination: DualPipeV with the experts over EP2 (the data-parallel pair), their
    # dispatch chunked and overlapped
    ("pp2-ep2-dualpipev", "moe-mtp-12", PP + ["2", "--schedules-method", "dualpipev", "--expert-model-parallel-size",
                                              "2", "--moe-token-dispatcher-type", "alltoall",
                                              "--moe-alltoall-overlap-comm"]),
    # --moe-fb-overlap (test_fb_overlap_changes_no_bit): DualPipeV's pairs beside the run above, and
    # 1F1B's (3 micro-batches: 1 pair on the first stage, 2 on the last) with full recompute and a
    # shared expert beside the same run without both
    ("pp2-ep2-dualpipev-fb", "moe-mtp-12", PP + ["2", "--schedules-method", "dualpipev", "--expert-model-parallel-size",
                                                 "2", "--moe-token-dispatcher-type", "alltoall", "--moe-fb-overlap"]),
    # Muon at TP2 (the matrices' shards gathered whole: duplicated) x EP2 with the layer-wise distributed
    # optimizer over the DP pair (saved, resumed whole at DP4 below)
    ("tp2-ep2-dist-muon", "muon-moe", ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                                       "--sequence-parallel", "--optimizer", "dist_muon", "--muon-tp-mode",
                                       "duplicated", "--save", "{out}/ckpt-dist-muon"]),
    ("pp2-ep2", "moe-mtp-12-shared", PP + ["2", "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                                           "alltoall"]),
    # (its second step profiled: the schedule's spans are in the traces)
    ("pp2-ep2-fb-recompute", "moe-mtp-12-shared", PP + ["2", "--expert-model-parallel-size", "2",
                                                       "--moe-token-dispatcher-type", "alltoall", "--moe-fb-overlap",
                                                       "--recompute-granularity", "full", "--recompute-method",
                                                       "uniform", "--recompute-num-layers", "1", "--profile",
                                                       "--profile-step-start", "1", "--profile-step-end", "2",
                                                       "--profile-save-path", "{out}/profile-fb"]),
]


@pytest.fixture(scope="module")
def single(corpus, tmp_path_factory):  # noqa: F811
    """Per model: the single-process loss curve and grad norms and first-step gradients as the
    optimizer took them (parity_worker.train_case, in this process); the base model's over ITERS
    steps with a checkpoint of iteration FROM_SINGLE, the others' over the launches' steps."""
    from parity_worker import train_case

    root = tmp_path_factory.mktemp("single")
    out, ckpt = {}, root / "ckpt-base"
    for name, argv in MODELS.items():
        saves = ["--train-iters", str(ITERS), "--save", str(ckpt), "--save-interval", str(FROM_SINGLE)] \
            if name == "base" else ["--train-iters", str(RESUMED_TO if name in RESHARDED else LAYOUT_ITERS)]
        train_case(str(root), name, [*argv, "--data-path", corpus, *saves])
        out[name] = {"losses": losses(root / f"{name}.jsonl"), "eval": eval_losses(root / f"{name}.jsonl"),
                     "norms": grad_norms(root / f"{name}.jsonl"), "grads": dict(np.load(root / f"{name}-grads.npz")),
                     "mtp": mtp_losses(root / f"{name}.jsonl"), "aux": aux_losses(root / f"{name}.jsonl")}
    out["base"]["ckpt"] = iteration_only(ckpt, FROM_SINGLE, root / "ckpt-from-single")
    assert sorted(out["base"]["eval"]) == list(range(2, ITERS + 1, 2))  # so the pipelined evaluation is compared
    return out


def eval_losses(path):
    return {r["iteration"]: r["eval_loss"] for r in map(json.loads, open(path)) if "eval_loss" in r}


def iteration_only(root, iteration, dest):
    """A checkpoint folder holding only ``iteration`` of ``root`` (to resume from it)."""
    name = f"iter_{iteration:07d}"
    shutil.copytree(root / name, dest / name)
    (dest / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return dest


def run_configs(framework, nproc, configs, corpus, tmp_path, extra=()):  # noqa: F811
    out = tmp_path / "out"
    spec = [[name, [*MODELS[model], *(f.format(out=out) for f in flags), "--data-path", corpus, "--train-iters",
                    str(LAYOUT_ITERS)]] for name, model, flags in configs] + list(extra)
    return launch_configs(framework, nproc, spec, tmp_path)


def check_parity(out, configs, single, table):
    for name, model, _ in configs:
        want = single[model]
        got = losses(out / f"{name}.jsonl")
        assert_same_curve(got, {i: want["losses"][i] for i in range(1, LAYOUT_ITERS + 1)})
        if want["eval"]:
            assert_same_curve(eval_losses(out / f"{name}.jsonl"), {i: v for i, v in want["eval"].items()
                                                                   if i <= LAYOUT_ITERS})
        assert_same_curve(grad_norms(out / f"{name}.jsonl"), {i: want["norms"][i] for i in range(1, LAYOUT_ITERS + 1)},
                          tol=1e-4)  # as test_parallel.check_cases
        # the logged MoE and MTP losses too: on MindSpore a forward that other compute follows is recorded
        # again at its backward, and the logs must count it once (DualPipeV's first rank holds both)
        for logged, read in (("mtp", mtp_losses), ("aux", aux_losses)):
            if want[logged]:
                assert_same_curve(read(out / f"{name}.jsonl"), {i: want[logged][i] for i in range(1, LAYOUT_ITERS + 1)})
        worst, where = gradient_difference(np.load(out / f"{name}-grads.npz"), want["grads"])
        assert worst < 1e-5, (name, where, worst)
        table[name] = max(abs(got[i] - want["losses"][i]) / abs(want["losses"][i]) for i in got)


def resume_single(capsys, corpus, ckpt, model, tmp_path, want, first):  # noqa: F811
    metrics = tmp_path / f"resume-{first}.jsonl"
    code, out, err = train(capsys, *MODELS[model], "--data-path", corpus, "--train-iters", str(ITERS), "--load",
                           str(ckpt), "--metrics-file", str(metrics))
    assert code == 0, err
    assert_same_curve(losses(metrics), {i: want[i] for i in range(first, ITERS + 1)})
    return out


@pytest.mark.multiprocess
@pytest.mark.feature("pipeline-parallel")
@pytest.mark.feature("virtual-pipeline")
@pytest.mark.feature("noop-layers")
@pytest.mark.feature("recompute")
@pytest.mark.feature("norm-recompute")
@pytest.mark.feature("gated-deltanet")
@pytest.mark.feature("attention-output-gate")
@pytest.mark.feature("dualpipe")
@pytest.mark.feature("muon")
def test_pipelines_on_two_ranks_equal_one_process(capsys, framework, corpus, single, two, tmp_path):  # noqa: F811
    """PP2 (saving), interleaved, no-op layers, an uneven split, tied embeddings, a gated-DeltaNet
    hybrid, Muon, and a PP2 run started from a single-process checkpoint: one launch."""
    table = {}
    out = two
    check_parity(out, TWO, single, table)
    # recompute changes nothing under PP2 either: the same bits, first-step gradients and curve
    assert losses(out / "pp2-recompute-block-norm.jsonl") == losses(out / "pp2.jsonl")
    plain, recomputed = np.load(out / "pp2-grads.npz"), np.load(out / "pp2-recompute-block-norm-grads.npz")
    assert all(np.array_equal(plain[n], recomputed[n]) for n in plain.files)
    # a PP2 checkpoint continues on one process
    text = resume_single(capsys, corpus, iteration_only(out / "ckpt-pp2", LAYOUT_ITERS, tmp_path / "pp2-last"), "base",
                         tmp_path, single["base"]["losses"], LAYOUT_ITERS + 1)
    assert "PP=2" in text
    # and a single-process checkpoint started a PP2 run from the same weights
    assert_same_curve(losses(out / "pp2-from-single.jsonl"), {i: single["base"]["losses"][i]
                                                                 for i in range(FROM_SINGLE + 1, ITERS + 1)})
    print("parity (max relative loss difference):", json.dumps(table))


# sharded checkpoints (training/sharded_checkpoint.py) resumed at other layouts in the four-rank
# launch, each to RESUMED_TO on the single-process curve: name -> (flags after the model's, the
# checkpoint: four's tp2-pp2-distopt or two's pp2-interleaved-recompute, both of LAYOUT_ITERS)
RESHARD = {
    "dp4-distopt-from-tp2-pp2": (["--use-distributed-optimizer"], "four", "ckpt-tp2-pp2"),
    "pp4-from-pp2-vpp": (PP + ["4"], "two", "ckpt-vpp"),
    # TP2 x uneven PP2 without the distributed optimizer
    "tp2-pp2-uneven-from-pp2-vpp": (PP + ["2", "--num-layer-list", "1,3", "--tensor-model-parallel-size", "2"],
                                    "two", "ckpt-vpp"),
    # DualPipeV's checkpoint (the first rank wrote the embeddings, not the MTP module's copy of them) in 1F1B
    "pp2-dp2-from-dualpipev": (PP + ["2"], "two", "ckpt-dualpipev", "moe-mtp"),
    # Muon's momentum and AdamW's moments of the rest, saved by the PP2 ranks, read whole at DP4
    "dp4-from-pp2-muon": ([], "two", "ckpt-muon", "muon"),
    # the layer-wise distributed optimizer's checkpoint (each state written by its owner) at DP4 x EP2 with it
    # (the experts' states owned over their two expert-data-parallel ranks), and PP2's at DP4 with it (each
    # owner reads its parameters' state)
    "dp4-ep2-dist-muon-from-tp2-ep2": (["--expert-model-parallel-size", "2", "--optimizer", "dist_muon"], "four",
                                       "ckpt-dist-muon", "muon-moe"),
    "dp4-dist-muon-from-pp2-muon": (["--use-distributed-optimizer"], "two", "ckpt-muon", "muon"),
}
RESHARDED = {entry[3] for entry in RESHARD.values() if len(entry) > 3}  # models besides base


@pytest.fixture(scope="module")
def two(corpus, single, tmp_path_factory):  # noqa: F811
    """One two-rank launch: the TWO parity cases (the interleaved one saves) and a PP2 run
    started from a single-process checkpoint."""
    from conftest import FRAMEWORK

    tmp = tmp_path_factory.mktemp("two")
    from_single = ["pp2-from-single", [*MODELS["base"], *PP, "2", "--data-path", corpus, "--train-iters", str(ITERS),
                                       "--load", str(single["base"]["ckpt"])], False]
    return run_configs(FRAMEWORK, 2, TWO, corpus, tmp, extra=[from_single])


@pytest.fixture(scope="module")
def four(corpus, two, tmp_path_factory):  # noqa: F811
    """One four-rank launch: the FOUR parity cases, then the RESHARD resumes."""
    from conftest import FRAMEWORK

    tmp = tmp_path_factory.mktemp("four")
    out = {"two": two, "four": tmp / "out"}
    extra = [[name, [*MODELS[model[0] if model else "base"], *flags, "--data-path", corpus, "--train-iters",
                     str(RESUMED_TO), "--load", str(out[where] / ckpt)], False]
             for name, (flags, where, ckpt, *model) in RESHARD.items()]
    return run_configs(FRAMEWORK, 4, FOUR, corpus, tmp, extra=extra)


@pytest.mark.multiprocess
@pytest.mark.feature("pipeline-parallel")
@pytest.mark.feature("tensor-parallel")
@pytest.mark.feature("sequence-parallel")
@pytest.mark.feature("data-parallel")
@pytest.mark.feature("distributed-optimizer")
@pytest.mark.feature("ring-attention-cp")
@pytest.mark.feature("recompute")
@pytest.mark.feature("norm-recompute")
@pytest.mark.feature("grad-reduce-overlap")
@pytest.mark.feature("param-gather-overlap")
@pytest.mark.feature("dualpipe")
@pytest.mark.feature("moe-alltoall-overlap")
@pytest.mark.feature("muon")
@pytest.mark.feature("muon-tensor-parallel")
@pytest.mark.feature("dist-muon")
def test_pipelines_on_four_ranks_equal_one_process(capsys, framework, corpus, single, four, tmp_path):  # noqa: F811
    """PP4 (saving), TP2xPP2 with sequence parallelism and tied embeddings, PP2xDP2 with the
    distributed optimizer, CP2xPP2, DualPipeV at PP4 and at PP2 x EP2: one launch; the PP4
    checkpoint continues on one process."""
    table = {}
    out = four
    check_parity(out, FOUR, single, table)
    assert same_records(out / "pp2-dp2-distopt-overlap.jsonl", out / "pp2-dp2-distopt.jsonl")
    # Muon's TP2 x EP2 run iterated on whole matrices, each rank updating its own share of the parameters
    log = (out / "tp2-ep2-dist-muon.log").read_text()
    assert "TP shards gathered whole (duplicated)" in log and "layer-wise distributed: this rank updates" in log, log
    text = resume_single(capsys, corpus, iteration_only(out / "ckpt-pp4", LAYOUT_ITERS, tmp_path / "pp4-last"), "base",
                         tmp_path, single["base"]["losses"], LAYOUT_ITERS + 1)
    assert "PP=4" in text
    print("parity (max relative loss difference):", json.dumps(table))


@pytest.mark.multiprocess
@pytest.mark.feature("moe-fb-overlap")
@pytest.mark.feature("expert-parallel")
def test_fb_overlap_changes_no_bit(framework, four):
    """--moe-fb-overlap at PP2 x EP2, 1F1B (with full recompute) and DualPipeV, in the four-rank
    launch: forwards ran beside backwards, their all-to-all exchanges travelled while the other
    micro-batch computed, and every loss, gradient norm and first-step gradient is the same bits
    as the same layout's without the flag (check_parity compares both with one process)."""
    for overlapped, plain in (("pp2-ep2-fb-recompute", "pp2-ep2"), ("pp2-ep2-dualpipev-fb", "pp2-ep2-dualpipev")):
        assert same_records(four / f"{overlapped}.jsonl", four / f"{plain}.jsonl"), overlapped
        a, b = np.load(four / f"{overlapped}-grads.npz"), np.load(four / f"{plain}-grads.npz")
        assert a.files == b.files and all(np.array_equal(a[n], b[n]) for n in a.files), overlapped
        log = (four / f"{overlapped}.log").read_text()
        pairs = re.search(r"--moe-fb-overlap: (\d+) of pipeline rank 0's \d+ forwards a step run beside a backward; "
                          r"the all-to-all exchanges of its (\d+) MoE layer", log)
        hidden = re.search(r"--moe-fb-overlap: (\d+) all-to-all exchanges of pipeline rank 0 travelled", log)
        assert pairs and hidden, log
        # (pairs, exchanges hidden) a step on the first rank. 1F1B: the third micro-batch's forward
        # beside the first's backward, through layers 0 (dense) and 1 (MoE): each starts the MoE
        # layer's two exchanges, each travelling while the other computes: 4. DualPipeV (the least
        # micro-batches): chunk 1's forward (layer 3, MoE) beside chunk 0's backward (layer 0,
        # dense), which runs whole while the forward's dispatch travels: 1.
        want = {"pp2-ep2-fb-recompute": (1, 4), "pp2-ep2-dualpipev-fb": (1, 1)}[overlapped]
        assert (int(pairs.group(1)), int(hidden.group(1))) == (want[0], LAYOUT_ITERS * want[1]), log
    # the profiled step's schedule, per rank (global ranks 0, 1: the first stage; 2, 3: the last):
    # the first stage's F0 F1 (F2 & B0) B1 B2, the last's F0 (F1 & B0) (F2 & B1) B2, inside the step
    from mindspeed_core.training.profiling import read_schedule

    for rank, order, pairs in ((0, ["F", "F", "FB", "B", "B"], ["2|0"]), (3, ["F", "FB", "FB", "B"], ["1|0", "2|1"])):
        actions = read_schedule(four / "profile-fb" / f"schedule_rank{rank}.trace.json")
        (step,) = [a for a in actions if a[0] == "step"]
        compute = [a for a in actions if a[0] != "step"]
        assert [a[0] for a in compute] == order and [a[2] for a in compute if a[0] == "FB"] == pairs, compute
        assert all(step[3] <= a[3] <= a[4] <= step[4] for a in compute), (step, compute)


def test_fb_overlap_without_a_pipeline_says_it_pairs_nothing(capsys, corpus):  # noqa: F811
    """With PP 1 there is no forward to pair with a backward: the run says so, and trains."""
    code, out, err = train(capsys, *SMALL4, "--num-experts", "4", "--moe-ffn-hidden-size", "64", "--moe-fb-overlap",
                           "--data-path", corpus, "--train-iters", "1", "--global-batch-size", "4")
    assert code == 0, err
    assert "--moe-fb-overlap pairs nothing here: it pairs a pipeline schedule's forwards and backwards, and this run " \
           "has no pipeline (PP 1)" in out, out


def bytes_read(log: str) -> list[int]:
    """Each rank's bytes read of a sharded checkpoint, as the trainer reports them."""
    return json.loads(re.search(r"bytes read per rank: (\[[0-9, ]*\])", log).group(1))


def saved_bytes(ckpt) -> dict:
    """{section: bytes of its tensors' values} of a sharded checkpoint (fp32 here), from its index."""
    meta = json.loads((ckpt / f"iter_{LAYOUT_ITERS:07d}" / "meta.json").read_text())
    return {section: sum(4 * int(np.prod(p[3])) for record in tensors.values() for p in record["pieces"])
            for section, tensors in meta["index"].items()}


@pytest.mark.multiprocess
@pytest.mark.feature("pipeline-parallel")
@pytest.mark.feature("virtual-pipeline")
@pytest.mark.feature("tensor-parallel")
@pytest.mark.feature("distributed-optimizer")
@pytest.mark.feature("sharded-checkpoints")
def test_sharded_checkpoints_resume_at_other_layouts_reading_their_slices(framework, single, two, four):
    """Every rank writes its own pieces; each resume reads only what its layout needs and
    continues the single-process curve: TP2 x PP2 with the distributed optimizer -> DP4 with it
    (each rank reads the whole model and a quarter of the optimizer state), PP2 interleaved ->
    PP4 (each rank reads its layer), and -> TP2 x uneven PP2 without it; DualPipeV's -> PP2 x DP2;
    Muon's PP2 -> DP4 (with and without its layer-wise distributed optimizer), its layer-wise
    TP2 x EP2 -> DP4 x EP2."""
    for name, (*_, model) in ((n, (*e, "base")[:4]) for n, e in RESHARD.items()):
        want = single[model]["losses"]
        log = (four / f"{name}.log").read_text()
        assert "resumed from" in log and "sharded" in log, log
        assert_same_curve(losses(four / f"{name}.jsonl"), {i: want[i] for i in range(LAYOUT_ITERS + 1, RESUMED_TO + 1)})
    # TP2 x PP2 at DP1: four owners of distinct pieces, four files
    last = f"iter_{LAYOUT_ITERS:07d}"
    assert len(list((four / "ckpt-tp2-pp2" / last).glob("rank_*.safetensors"))) == 4
    assert len(list((two / "ckpt-vpp" / last).glob("rank_*.safetensors"))) == 2
    tp2pp2 = saved_bytes(four / "ckpt-tp2-pp2")
    header = 64 * 1024  # the safetensors headers each rank reads, generously
    read = bytes_read((four / "dp4-distopt-from-tp2-pp2.log").read_text())
    assert len(read) == 4 and all(tp2pp2["model"] <= r < tp2pp2["model"] + tp2pp2["optimizer"] / 2 + header
                                  for r in read), (read, tp2pp2)
    vpp = saved_bytes(two / "ckpt-vpp")
    total = vpp["model"] + vpp["optimizer"]
    read = bytes_read((four / "pp4-from-pp2-vpp.log").read_text())
    assert len(read) == 4 and max(read) < total / 2 and sum(read) < total + 4 * header, (read, vpp)
    print("bytes read per rank: DP4 from TP2xPP2", bytes_read((four / "dp4-distopt-from-tp2-pp2.log").read_text()),
          "of", tp2pp2, "; PP4 from PP2 VPP", read, "of", vpp)


@pytest.mark.multiprocess
def test_the_other_framework_resumes_a_four_rank_sharded_checkpoint(framework, single, four, corpus,  # noqa: F811
                                                                    tmp_path):
    """The TP2 x PP2 distributed-optimizer checkpoint of this framework continues in one
    process of the other (test_parity: within its tolerances)."""
    from test_parity import OTHER, rel, run_other

    metrics = tmp_path / "other.jsonl"
    out = run_other(OTHER[framework], *MODELS["base"], "--data-path", corpus, "--train-iters", str(ITERS), "--load",
                    str(four / "ckpt-tp2-pp2"), "--metrics-file", str(metrics))
    assert f"saved on {framework}, TP=2 DP=1 PP=2" in out, out
    got, want = losses(metrics), single["base"]["losses"]
    first = LAYOUT_ITERS + 1
    assert sorted(got) == list(range(first, ITERS + 1))
    assert rel(got[first], want[first]) < 1e-5 and all(rel(got[i], want[i]) < 1e-4 for i in got), (got, want)
