"""Generation (models/generate.py, models/kv_cache.py) and `mindspeed generate`: the cache
changes no token, batched prompts padded on the left equal one at a time, sampling is
reproducible and cut where it says, beam search on a hand-checked case, tensor parallelism
draws what one process draws. Parity with transformers' generate is in test_hf.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mindspeed_core import cli, features, nn, ops, random
from mindspeed_core.models import generate as gen
from mindspeed_core.models.config import ModelConfig
from mindspeed_core.models.gpt import GPTModel
from test_training import SMALL, corpus, train  # noqa: F401  (corpus is a fixture)

CFG = dict(vocab_size=48, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
           ffn_hidden_size=64, max_position_embeddings=40, init_method_std=0.3)
PROMPTS = [[5, 9, 2, 7, 7, 1], [3], [11, 4, 30]]


@pytest.fixture(scope="module")
def model():
    random.seed(3)
    m = GPTModel(ModelConfig(**CFG))
    nn.set_training(m, False)
    return m


@pytest.mark.feature("greedy-generation")
@pytest.mark.feature("kv-cache")
def test_the_cache_changes_no_token_and_padding_changes_nothing(model):
    cached = gen.generate(model, PROMPTS, 12)
    assert gen.generate(model, PROMPTS, 12, use_cache=False) == cached
    assert [len(c) for c in cached] == [12, 12, 12]
    # each prompt alone (no padding) continues as it does in the left-padded batch
    assert [gen.generate(model, [p], 12)[0] for p in PROMPTS] == cached


@pytest.mark.feature("compiled-decode")
def test_compiled_decode_steps_give_the_eager_tokens_with_one_graph_per_bucket(model, monkeypatch):
    """Where the matrix supports it (MindSpore) each decode step is one graph per batch and
    cache capacity: prompts of other lengths in the same bucket reuse it, and the tokens are
    eager's. A bucket compiles once MIN_STEPS of its steps have run eagerly (here 15), or at
    once when asked. Elsewhere generation decodes eagerly."""
    from mindspeed_core import runtime
    from mindspeed_core.models import compiled_decode

    backend = runtime.bound()
    for store in ("_decode_graphs", "_decode_steps"):
        model.__dict__.pop(store, None)
    monkeypatch.setattr(compiled_decode, "MIN_STEPS", 15)
    want = gen.generate(model, PROMPTS, 12)  # 11 decode steps: eager, counted
    graphs = model.__dict__.get("_decode_graphs", {})
    assert not graphs
    if features.get("compiled-decode").status(backend.NAME).kind != "supported":
        assert not compiled_decode.eligible(model) and gen.generate(model, PROMPTS, 12, compiled=True) == want
        assert not model.__dict__.get("_decode_graphs")
        return
    # three rows, capacity 64: 4 more eager steps reach 15, the 16th compiles (checked against
    # eager), the 7 after it run the graph
    assert gen.generate(model, PROMPTS, 12) == want
    [graph] = graphs.values()
    assert graph.checked and graph.steps == 6, graph.steps
    # the same bucket: the same graph, checked already (prompts two tokens longer, and a short run)
    gen.generate(model, [p + [1, 2] for p in PROMPTS], 12)
    gen.generate(model, PROMPTS, 3)
    assert len(graphs) == 1 and graph.steps == 19, (graphs, graph.steps)
    # compiled=True: a new bucket (one row) compiles at its first step; False: never
    assert gen.generate(model, PROMPTS[:1], 12, compiled=True) == want[:1] and len(graphs) == 2
    assert gen.generate(model, PROMPTS[1:2], 12, compiled=False) == want[1:2] and graph.steps == 19


def test_a_compiled_decode_step_that_disagrees_with_eager_is_dropped_for_eager(model, monkeypatch, capsys):
    from mindspeed_core import runtime
    from mindspeed_core.models import compiled_decode

    if features.get("compiled-decode").status(runtime.bound().NAME).kind != "supported":
        assert not compiled_decode.eligible(model)  # eager decoding: nothing compiled to disagree
        return
    want = gen.generate(model, PROMPTS[:2], 8, use_cache=False)
    model.__dict__.pop("_decode_graphs", None)
    monkeypatch.setattr(compiled_decode, "TOLERANCE", -1.0)  # any difference, even none, is too much
    assert gen.generate(model, PROMPTS[:2], 8, compiled=True) == want
    assert list(model.__dict__["_decode_graphs"].values()) == [False]
    err = capsys.readouterr().err
    assert err.count("the compiled decode step's logits differ from eager's") == 1, err


def test_a_stop_token_ends_its_row_only(model):
    free = gen.generate(model, PROMPTS, 10)
    stop = free[0][3]
    first = free[0].index(stop)  # where row 0 meets it
    out = gen.generate(model, PROMPTS, 10, stop_ids=(stop,))
    for row, whole in zip(out, free):
        assert row == (whole[:whole.index(stop)] if stop in whole else whole)
    seen = []
    gen.generate(model, PROMPTS, 10, stop_ids=(stop,), on_step=seen.append)
    assert [s[0] for s in seen[:first + 1]] == free[0][:first] + [None]
    assert all(s[0] is None for s in seen[first:])


@pytest.mark.feature("sampling-generation")
def test_sampling_is_reproducible_and_cut_where_it_says(model):
    draw = gen.Sampling(greedy=False, temperature=1.5, seed=11)
    first = gen.generate(model, PROMPTS, 10, draw)
    assert gen.generate(model, PROMPTS, 10, draw) == first
    assert gen.generate(model, PROMPTS, 10, gen.Sampling(greedy=False, temperature=1.5, seed=12)) != first
    assert gen.generate(model, PROMPTS, 10, draw, use_cache=False) == first
    greedy = gen.generate(model, PROMPTS, 10)
    for cut in (gen.Sampling(greedy=False, top_k=1, seed=5), gen.Sampling(greedy=False, top_p=1e-6, seed=5)):
        assert gen.generate(model, PROMPTS, 10, cut) == greedy


def test_top_k_and_top_p_keep_the_most_likely_tokens():
    logits = np.log(np.array([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    rng = np.random.default_rng(0)
    drawn = {gen.choose(logits, gen.Sampling(greedy=False, top_k=2), rng)[0] for _ in range(300)}
    assert drawn == {0, 1}
    drawn = {gen.choose(logits, gen.Sampling(greedy=False, top_p=0.8), rng)[0] for _ in range(300)}
    assert drawn == {0, 1, 2}  # 0.5 + 0.2 < 0.8 <= 0.5 + 0.2 + 0.15
    counts = np.bincount([gen.choose(logits, gen.Sampling(greedy=False), rng)[0] for _ in range(4000)], minlength=5)
    np.testing.assert_allclose(counts / 4000, [0.5, 0.2, 0.15, 0.1, 0.05], atol=0.03)
    with pytest.raises(ValueError, match="top_p"):
        gen.Sampling(greedy=False, top_p=0.0)


class Bigram:
    """A stand-in model whose next-token log-probabilities depend on the last token only
    (vocabulary 0..3; 3 ends), so beam search can be followed by hand."""

    TABLE = np.log(np.array([
        [0.05, 0.50, 0.40, 0.05],  # after 0
        [0.05, 0.05, 0.30, 0.60],  # after 1: most likely the end
        [0.90, 0.04, 0.03, 0.03],  # after 2: almost surely 0
        [0.25, 0.25, 0.25, 0.25],
    ]))
    sequence_multiple = 1

    def __call__(self, ids, tokens=None):
        return ops.tensor(self.TABLE[ops.to_numpy(ids)].astype(np.float32))

    def gather_logits(self, logits):
        return logits


@pytest.mark.feature("beam-search")
def test_beam_search_on_a_hand_checked_case():
    # from 0: greedy takes 1 (0.5) then ends (0.6): 0.30 over 2 tokens drawn.
    # Two beams: [1] 0.5, [2] 0.4; then [1, end] 0.30 ends, [2, 0] 0.36 and [1, 2] 0.15 stay
    # open; then [2, 0, 1] 0.18 and [2, 0, 2] 0.144. With length penalty 0 the probability
    # decides: [1] (ended, 0.30) beats every open beam, which can only shrink.
    model = Bigram()
    assert gen.beam_search(model, [0], 6, num_beams=2, stop_ids=(3,), length_penalty=0.0, use_cache=False) == [1]
    assert gen.generate(model, [[0]], 6, stop_ids=(3,), use_cache=False) == [[1]]
    # per token (penalty 1) the pairs 2, 0 score log 0.36 / 2 = -0.51 a token and beat ending early
    # ([1, end]: log 0.30 / 2 = -0.60; [2, 0, 1, end]: log 0.108 / 4 = -0.56): the beams run to the limit
    assert gen.beam_search(model, [0], 6, num_beams=2, stop_ids=(3,), length_penalty=1.0,
                           use_cache=False) == [2, 0, 2, 0, 2, 0]


@pytest.mark.feature("beam-search")
def test_beam_search_with_sampling_draws_candidates_over_the_beams_and_ranks_them():
    """One beam, one step from 0 (p = 0.05, 0.5, 0.4, 0.05; 3 ends): two candidates are drawn
    without replacement, then ranked by score, so the result is 1 whenever 1 is drawn: with
    probability 1 - sum_a p_a (1 - 0.5 / (1 - p_a)) = 0.886 (not 0.5, as taking the first draw
    would give, nor 0.75 with replacement), and 2 with 0.109."""
    model = Bigram()
    got = [tuple(gen.beam_search(model, [0], 1, num_beams=1, stop_ids=(3,), use_cache=False,
                                 sampling=gen.Sampling(greedy=False, seed=seed))) for seed in range(2000)]
    share = {k: got.count(k) / len(got) for k in set(got)}
    assert abs(share[(1,)] - 0.886) < 0.03 and abs(share[(2,)] - 0.109) < 0.03, share
    # seeded: the same draws again; at temperature 3 (flatter) the seeds draw different beams
    runs = {seed: gen.beam_search(model, [0], 6, 2, (3,), 1.0, False,
                                  sampling=gen.Sampling(greedy=False, seed=seed, temperature=3.0))
            for seed in range(12)}
    assert gen.beam_search(model, [0], 6, 2, (3,), 1.0, False,
                           sampling=gen.Sampling(greedy=False, seed=0, temperature=3.0)) == runs[0]
    assert len({tuple(r) for r in runs.values()}) >= 3, runs
    # top_k cuts each beam's own tokens: one beam with top_k 1 follows its likeliest token (1, then
    # the end). With two beams each keeps 2 (1 + the stop tokens, as transformers does): [1] and
    # [2], then all four candidates are drawn and ranked, and [2, 0] (0.36) beats the ended [1]
    # (0.30); a cut to 1 token would leave [1] alone
    one = gen.Sampling(greedy=False, top_k=1)
    assert gen.beam_search(model, [0], 6, 1, (3,), 0.0, False, sampling=one) == [1]
    assert gen.beam_search(model, [0], 2, 2, (3,), 0.0, False, sampling=one) == [2, 0]


def test_beam_search_with_the_cache_equals_without(model):
    for prompt in PROMPTS:
        want = gen.beam_search(model, prompt, 8, num_beams=3, stop_ids=(0,), use_cache=False)
        assert gen.beam_search(model, prompt, 8, num_beams=3, stop_ids=(0,)) == want


def test_bad_generation_input_is_a_clear_error(model):
    with pytest.raises(ValueError, match="empty prompt"):
        gen.generate(model, [[1, 2], []], 4)
    assert gen.fits(40, 30, 10, None) is None
    assert "passes the model's 40 positions" in gen.fits(40, 30, 11, None)
    assert gen.fits(40, 30, 11, {"rope_type": "dynamic", "factor": 2.0}) is None


@pytest.fixture(scope="module")
def checkpoint(corpus, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("generate")
    assert cli.main(["train", *SMALL, "--data-path", corpus, "--train-iters", "3", "--save", str(root / "ckpt")]) == 0
    return root / "ckpt"


@pytest.fixture(scope="module")
def wide_checkpoint(corpus, tmp_path_factory):  # noqa: F811
    """A model whose next token depends on the whole context: weights drawn with std 0.3 (one
    step; the loss about 9), where three steps at 0.02 have learnt little but to repeat a
    space. A layout that loses a stage's cache or positions changes its tokens."""
    root = tmp_path_factory.mktemp("wide")
    assert cli.main(["train", *SMALL, "--data-path", corpus, "--train-iters", "1", "--init-method-std", "0.3",
                     "--save", str(root / "ckpt"), "--sample-tokens", "0"]) == 0
    return root / "ckpt"


@pytest.fixture(scope="module")
def wide_hybrid_checkpoint(corpus, tmp_path_factory):  # noqa: F811
    """wide_checkpoint's sizes as MindSpeed-LLM's gated-DeltaNet hybrid (its qwen3_next spec):
    layer 0 gated DeltaNet (2 key heads, 4 value heads), layer 1 gated attention."""
    root = tmp_path_factory.mktemp("wide-hybrid")
    assert cli.main(["train", *SMALL, "--spec", "mindspeed_llm.tasks.models.spec.qwen3_next_spec", "layer_spec",
                     "--qk-layernorm", "--add-rmsnorm-offset", "--full-attention-interval", "2",
                     "--linear-num-key-heads", "2", "--linear-num-value-heads", "4", "--linear-key-head-dim", "16",
                     "--linear-value-head-dim", "16", "--mamba-chunk-size", "8", "--partial-rotary-factor", "0.5",
                     "--data-path", corpus, "--train-iters", "1", "--init-method-std", "0.3",
                     "--save", str(root / "ckpt"), "--sample-tokens", "0"]) == 0
    return root / "ckpt"


@pytest.fixture(scope="module")
def wide_moe_checkpoint(corpus, tmp_path_factory):  # noqa: F811
    """wide_checkpoint's model with a mixture of 4 experts (top 2) in each layer."""
    root = tmp_path_factory.mktemp("wide-moe")
    assert cli.main(["train", *SMALL, "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
                     "--data-path", corpus, "--train-iters", "1", "--init-method-std", "0.3",
                     "--save", str(root / "ckpt"), "--sample-tokens", "0"]) == 0
    return root / "ckpt"


@pytest.mark.feature("greedy-generation")
@pytest.mark.feature("streaming-inference")
def test_generate_command_continues_prompts_from_a_checkpoint(capsys, checkpoint):
    capsys.readouterr()
    argv = ["generate", "--load", str(checkpoint), "--prompt", "def f(", "--prompt", "import", "--max-new-tokens", "6"]
    assert cli.main([*argv, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["prompt"] for r in rows] == ["def f(", "import"] and all(len(r["ids"]) <= 6 for r in rows)
    assert cli.main([*argv, "--stream"]) == 0  # the same text, printed as it comes
    out = capsys.readouterr().out
    for r in rows:
        assert r["prompt"] + r["output"] in out
    assert cli.main([*argv, "--json", "--stream", "--task", "beam_search", "--num-beams", "2"]) == 0
    beams = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]  # printed at the end
    assert [b["prompt"] for b in beams] == ["def f(", "import"]


@pytest.mark.feature("chat")
@pytest.mark.feature("sampling-generation")
def test_without_a_prompt_the_tasks_of_mindspeed_llms_inference_run(capsys, monkeypatch, checkpoint):
    """MindSpeed-LLM's inference.py without --task: greedy, do_sample, beam_search,
    beam_search_with_sampling, then chat, each on "how are you?"; --task picks and orders them."""
    import io

    base = ["generate", "--load", str(checkpoint), "--max-new-tokens", "5", "--num-beams", "2", "--json"]
    monkeypatch.setattr("sys.stdin", io.StringIO("def \nq\nnever read\n"))
    capsys.readouterr()
    assert cli.main(base) == 0
    out = capsys.readouterr().out
    rows = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    tasks = ["greedy", "do_sample", "beam_search", "beam_search_with_sampling"]
    assert [r.get("task") for r in rows] == [*tasks, None] and rows[-1]["user"] == "def ", rows
    assert all(r["prompt"] == "how are you?" for r in rows[:4])
    monkeypatch.setattr("sys.stdin", io.StringIO("quit\n"))
    assert cli.main(base[:-1]) == 0  # as text: a heading before each task
    out = capsys.readouterr().out
    assert [x for x in out.splitlines() if x.startswith("===")] == [f"=== {t} ===" for t in [*tasks, "chat"]]
    assert "how are you?" + rows[0]["output"] in out
    # each equals the task run alone on the prompt; a list runs in its own order
    for task in ("greedy", "beam_search"):
        assert cli.main([*base, "--task", task, "--prompt", "how are you?"]) == 0
        alone = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
        assert alone == [r for r in rows if r.get("task") == task]
    assert cli.main([*base, "--task", "beam_search_with_sampling", "do_sample"]) == 0
    again = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert again == [rows[3], rows[1]]  # seeded draws: the same as in the whole set


def test_generation_runs_on_exactly_its_tensor_parallel_ranks(capsys, checkpoint, monkeypatch):
    """A job of more ranks than the TP size would generate the same text on each (data-parallel
    copies are not built); chat reads the terminal, so it runs without a launcher."""
    from mindspeed_core import dist

    monkeypatch.setattr(dist, "launched_world_size", lambda: 2)
    capsys.readouterr()
    for argv, message in ((["--prompt", "x"], "this job has 2 ranks for --tensor-model-parallel-size 1"),
                          (["--task", "chat"], "--task chat runs in one process: run it without a launcher")):
        assert cli.main(["generate", "--load", str(checkpoint), *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("flags, message", [
    (["--prompt", ""], "an empty prompt"),
    (["--prompt", "x", "--max-new-tokens", "100"], "passes the model's 32 positions"),
])
def test_bad_generate_flags_are_one_line(capsys, checkpoint, flags, message):
    capsys.readouterr()
    assert cli.main(["generate", "--load", str(checkpoint), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_generate_needs_a_model(capsys, tmp_path):
    assert cli.main(["generate", "--prompt", "x"]) == 2
    assert "--load CHECKPOINT_DIR or --load-hf FOLDER" in capsys.readouterr().err
    assert cli.main(["generate", "--load", str(tmp_path), "--prompt", "x"]) == 2
    assert "no checkpoint in" in capsys.readouterr().err


# layout -> (ranks, flags, tasks): each launch runs its tasks one after another, as one process does
PARALLEL_GENERATION = {
    # where the matrix has compiled-decode, from the second step through the graph (the TP
    # vocabulary gather traced inside it), against one eager process
    "tp2": (2, ["--tensor-model-parallel-size", "2"], ["do_sample"]),
    # the stages one after another, each with its layer's cache, each cut for TP; beams reorder
    # every stage's (PP without TP runs the same stages: a launch of its own proved nothing more).
    # The model is the gated-DeltaNet hybrid: stage 0's linear layer keeps its convolution history
    # and state (its heads cut by TP), stage 1's gated attention its keys and values.
    # --sequence-parallel as MindSpeed-LLM's generation scripts pass it at TP: set aside, the same tokens
    "tp2-pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel"],
                ["greedy", "beam_search"]),
    # a mixture of experts with each rank holding half the experts (DeepSeek-V3's generate
    # script runs at EP): both ranks run the prompts, each one's experts serving both
    "ep2": (2, ["--expert-model-parallel-size", "2"], ["greedy", "do_sample"]),
    # Phi-3.5-MoE from a Hugging Face folder (hf_reference.py's): SparseMixer's routing on every
    # TP rank, the experts and the output layer's bias cut over TP
    "phimoe-tp2": (2, ["--tensor-model-parallel-size", "2"], ["greedy", "do_sample"]),
}


# the most one rank reads of our sharded checkpoint, as a share of its model's bytes (the safetensors
# header on top). The pieces are the unit read (each checked against its SHA-256), and these checkpoints
# were saved by one process, one piece a tensor: a TP or EP rank reads every piece its slices lie in
# (measured 1.016 and 1.011), a PP2 rank its stage's (0.517); never the optimizer's state, which is
# two thirds of the files (reading the model whole read the files whole)
READ_SHARE = {"tp2": 1.05, "tp2-pp2": 0.55, "ep2": 1.05}


def _marks(*ids):
    return [pytest.mark.feature(i) for i in ids]


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [
    pytest.param("tp2", marks=_marks("sampling-generation", "tensor-parallel", "compiled-decode",
                                     "sliced-inference-load")),
    pytest.param("tp2-pp2", marks=_marks("greedy-generation", "beam-search", "tensor-parallel", "pipeline-inference",
                                         "sliced-inference-load",
                                         "gated-deltanet")),
    pytest.param("ep2", marks=_marks("greedy-generation", "sampling-generation", "expert-parallel")),
    pytest.param("phimoe-tp2", marks=_marks("greedy-generation", "family-phimoe", "output-layer-bias",
                                            "tensor-parallel"))])
def test_parallel_generation_draws_what_one_process_draws(framework, capsys, request, tmp_path, layout):
    """`mindspeed launch -- generate` at the layout: every task's tokens are one process's."""
    from launch import free_port

    ranks, flags, tasks = PARALLEL_GENERATION[layout]
    if layout == "phimoe-tp2":  # pre-tokenized prompts: NullTokenizer over the folder's 96 ids (95 the end)
        folder = request.getfixturevalue("hf_references")
        ids = np.load(folder / "phimoe.npz")["ids"]
        source = ["--load-hf", str(folder / "phimoe"), "--tokenizer-type", "NullTokenizer", "--vocab-size", "95",
                  "--prompt", " ".join(map(str, ids[0, :12])), "--prompt", " ".join(map(str, ids[1, :9])),
                  "--moe-input-jitter-eps", "0.01", "--bf16"]  # as its generate script passes them: set aside
    else:
        checkpoint = request.getfixturevalue({"ep2": "wide_moe_checkpoint", "tp2-pp2": "wide_hybrid_checkpoint"}.get(
            layout, "wide_checkpoint"))
        source = ["--load", str(checkpoint), "--prompt", "def f(", "--prompt", "class"]
    common = [*source, "--max-new-tokens", "8", "--json", "--task", *tasks, "--seed", "4", "--num-beams", "3"]
    capsys.readouterr()
    assert cli.main(["generate", *common]) == 0
    captured = capsys.readouterr()
    want = [json.loads(x) for x in captured.out.splitlines() if x.startswith("{")]
    assert ("--moe-input-jitter-eps is training's noise" in captured.err) == ("--moe-input-jitter-eps" in common)
    assert ("--bf16 is set aside: generation computes in float32" in captured.err) == ("--bf16" in common)
    assert [w["task"] for w in want] == [t for t in tasks for _ in range(2)]
    assert all(len(set(w["ids"])) > 4 for w in want)  # not a repeated token
    cmd = [sys.executable, "-m", "mindspeed_core.cli", "launch", "--nproc-per-node", str(ranks), "--master-port",
           str(free_port()), "--log-dir", str(tmp_path / "logs"), "--", "generate", "--ai-framework", framework,
           *common, *flags]
    graph = layout == "tp2" and features.get("compiled-decode").status(framework).kind == "supported"
    cmd += ["--decode-graph", "always"] if graph else []
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=str(tmp_path),
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    logs = "".join(p.read_text() for p in sorted((tmp_path / "logs").glob("*")) if p.is_file()) \
        if (tmp_path / "logs").is_dir() else ""
    assert done.returncode == 0, done.stderr[-3000:] + logs[-3000:]
    text = done.stdout if '{"prompt"' in done.stdout else logs  # msrun: in the workers' logs (and echoed)
    got = [json.loads(x[x.index("{"):]) for x in text.splitlines() if '{"prompt"' in x]
    assert [(g["task"], g["ids"]) for g in got] == [(w["task"], w["ids"]) for w in want], (got, want)
    assert "differ from eager" not in done.stderr + logs  # the graph ran: it agreed on its first step
    if "--load" in common:  # our sharded checkpoint: each rank read its own slices only
        note = next((x for x in (done.stdout + done.stderr + logs).splitlines() if "each rank read the pieces" in x),
                    done.stdout[-2000:] + done.stderr[-2000:])
        per_rank = json.loads(note.split("bytes read per rank: ")[1])
        model = float(note.split("of the model's ")[1].split(" MiB")[0]) * 2**20
        assert len(per_rank) == ranks and max(per_rank) <= READ_SHARE[layout] * model, (per_rank, model)
    assert ("--sequence-parallel is set aside" in done.stdout + done.stderr + logs) == ("--sequence-parallel" in flags)


def test_the_embedded_default_saves_where_generate_finds_it(capsys, monkeypatch, tmp_path, framework):
    """`mindspeed train` with no data flags keeps its model in ./checkpoints/tiny-llama and says
    how to go on from it; a second run leaves that model alone, as a --save given would, unless
    --overwrite-checkpoints. (docs/generation.md's commands on that model, with the flag:
    test_verbs.py.)"""
    monkeypatch.chdir(tmp_path)
    fast = ["--sample-tokens", "0", "--eval-iters", "0", "--no-progress"]
    assert cli.main(["train", "--train-iters", "2", *fast]) == 0
    out = capsys.readouterr().out
    folder = os.path.join("checkpoints", "tiny-llama")
    assert f"mindspeed generate --ai-framework {framework} --load {folder} --prompt 'def ' --stream" in out
    assert cli.main(["generate", "--load", folder, "--prompt", "def ", "--max-new-tokens", "4", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out.splitlines()[-1])["ids"]) <= 4
    assert cli.main(["train", "--train-iters", "1", *fast]) == 2
    err = capsys.readouterr().err
    assert f"the default save folder {folder} already holds another run's checkpoints (up to iteration 2)" in err
    assert err.count("\n") == 1 and "--overwrite-checkpoints" in err
    assert cli.main(["train", "--train-iters", "1", "--overwrite-checkpoints", *fast]) == 0
    assert "the model is saved in" in capsys.readouterr().out
