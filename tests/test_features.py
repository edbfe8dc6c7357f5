"""The feature matrix: well-formed rows, the argument gate, its printouts and its page (docs/feature-matrix.md)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from mindspeed_core import features
from mindspeed_core.compat import megatron_args

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Every row MindSpeed-LLM's feature tables have, by our id; the matrix must keep them all.
REQUIRED_IDS = {
    "tensor-parallel", "pipeline-parallel", "virtual-pipeline", "sequence-parallel", "noop-layers",
    "ring-attention-cp", "ulysses-cp", "hybrid-cp", "expert-parallel", "moe-alltoall-dispatcher",
    "moe-allgather-dispatcher", "distributed-optimizer", "reuse-fp32-param", "swap-attention", "recompute",
    "norm-recompute", "o2-bf16-optimizer", "flash-attention", "flash-attention-varlen", "fused-rmsnorm",
    "fused-swiglu", "fused-rope", "gmm", "matmul-add", "grad-reduce-overlap", "recompute-in-advance",
    "param-gather-overlap", "mc2", "coc", "gloo-ckpt-offload", "profiling", "deterministic", "streaming-inference",
    "chat", "yarn", "handler-general-pretrain", "handler-alpaca", "handler-sharegpt", "handler-alpaca-pairwise",
    "handler-sharegpt-pairwise", "handler-alpaca-prm", "handler-alpaca-ppo", "weight-conversion",
}


def defaults():
    return megatron_args.feature_parser().parse_args([])


def parse(*argv):
    return megatron_args.feature_parser().parse_args(list(argv))


@pytest.mark.framework_free
def test_rows_are_well_formed():
    ids = [f.id for f in features.FEATURES]
    assert len(ids) == len(set(ids))
    assert REQUIRED_IDS <= set(ids)
    for f in features.FEATURES:
        for fw in features.FRAMEWORKS:
            st = f.status(fw)
            assert st.kind in features.STATUSES and (st.kind == "supported" or st.note), (f.id, fw)
            assert set(st.devices) <= set(features.DEVICES)
            for dev_status in st.devices.values():
                assert dev_status.kind in features.STATUSES and dev_status.note


@pytest.mark.framework_free
def test_every_flag_exists_and_defaults_turn_nothing_on():
    from mindspeed_core import convert, inference

    # the rows' flags are train's (check-args takes the same), and convert's and generate's for their own rows
    known = {opt for parser in (megatron_args.training_parser(), convert.parser(), inference.parser())
             for action in parser._actions for opt in action.option_strings}
    for f in features.FEATURES:
        for flag in f.flags:
            assert flag.split()[0] in known, (f.id, flag)
    assert features.active_features(defaults()) == []


@pytest.mark.framework_free
def test_swap_attention_and_mc2_are_unsupported_on_mindspore():
    assert features.get("swap-attention").status("mindspore").kind == "unsupported"
    assert features.get("mc2").status("mindspore").kind == "unsupported"


@pytest.mark.parametrize("argv, expected", [
    (["--swap-attention"], "swap-attention"),
    (["--tensor-model-parallel-size", "2"], "tensor-parallel"),
    (["--context-parallel-size", "2", "--context-parallel-algo", "ulysses_cp_algo"], "ulysses-cp"),
    (["--moe-token-dispatcher-type", "alltoall"], "moe-alltoall-dispatcher"),
    (["--handler-name", "SharegptStyleInstructionHandler"], "handler-sharegpt"),
    (["--use-fused-rmsnorm"], "fused-rmsnorm"),
])
@pytest.mark.framework_free
def test_flags_turn_on_their_feature(argv, expected):
    assert expected in [f.id for f in features.active_features(parse(*argv))]


@pytest.mark.framework_free
def test_gate_rejects_with_the_reason_and_the_alternative():
    with pytest.raises(features.FeatureNotAvailable) as info:
        features.validate(parse("--swap-attention"), "mindspore", "cpu")
    text = str(info.value)
    for part in ("swap-attention", "--swap-attention", "unsupported", "mindspore", "no hook", "--recompute-granularity full"):
        assert part in text
    assert info.value.exit_code == 2
    with pytest.raises(features.FeatureNotAvailable, match="bf16.*MatMul has no bfloat16 kernel"):
        features.validate(parse("--bf16"), "mindspore", "cpu")
    with pytest.raises(features.FeatureNotAvailable, match="recompute-in-advance.*planned"):
        features.validate(parse("--recompute-in-advance"), "pytorch", "cpu")
    ok = features.validate(parse("--use-flash-attn", "--use-fused-rmsnorm"), "mindspore", "cpu")
    assert [f.id for f in ok] == ["flash-attention", "fused-rmsnorm"]


@pytest.mark.framework_free
def test_a_cell_with_a_lowest_release_refuses_older_ones():
    argv = parse("--compile", "--tensor-model-parallel-size", "2")
    with pytest.raises(features.FeatureNotAvailable) as info:
        features.validate(argv, "pytorch", "cpu", "2.6.0+cu124")
    for part in ("compile-tensor-parallel", "needs release >= 2.13", "2.6.0+cu124 is older",
                 "wrong word-embedding gradient", "instead use --compile with data parallelism only"):
        assert part in str(info.value)
    assert "compile-tensor-parallel" in [f.id for f in features.validate(argv, "pytorch", "cpu", "2.13.0")]
    assert features.get("compile-tensor-parallel").status("pytorch").kind == "supported"  # no version: the newest
    assert features.release("2.10.0rc1") == (2, 10)
    assert "supported (>= 2.13)" in features.render_markdown("pytorch")


def _cli(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "mindspeed_core.cli", *argv], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_cli_gate_exits_2_with_one_line(framework):
    out = _cli("check-args", "--ai-framework", "mindspore", "--swap-attention")
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "swap-attention" in out.stderr and "Traceback" not in out.stderr
    out = _cli("check-args", "--ai-framework", framework, "--use-fused-swiglu")
    assert out.returncode == 0 and "fused-swiglu" in out.stdout, out.stderr


@pytest.mark.framework_free
def test_cli_json_lists_every_feature_with_its_status():
    out = _cli("features", "--ai-framework", "mindspore", "--format", "json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["features"]
    assert [r["id"] for r in rows] == [f.id for f in features.FEATURES]
    for row in rows:
        assert row["mindspore"]["status"] in features.STATUSES and "pytorch" not in row
    by_id = {r["id"]: r for r in rows}
    assert by_id["swap-attention"]["mindspore"]["status"] == "unsupported"
    assert by_id["collectives"]["mindspore"]["devices"]["cpu"]["status"] == "emulated"
    cpu = json.loads(_cli("features", "--ai-framework", "mindspore", "--device", "cpu", "--format", "json").stdout)
    assert {r["id"]: r for r in cpu["features"]}["collectives"]["mindspore"]["status"] == "emulated"
    text = _cli("features").stdout
    assert "swap-attention" in text and "pytorch" in text and "mindspore" in text


@pytest.mark.framework_free
def test_readme_table_is_generated_from_the_matrix():
    table = features.readme_table((ROOT / "docs" / "feature-matrix.md").read_text()).strip()
    assert table == features.render_markdown().strip(), (
        "docs/feature-matrix.md drifted from mindspeed_core/features.py; regenerate it with "
        "`mindspeed features --update-readme docs/feature-matrix.md`")


@pytest.mark.framework_free
def test_update_readme_rewrites_only_the_table(tmp_path):
    page = tmp_path / "README.md"
    page.write_text("intro\n<!-- feature-matrix:start -->\nold table\n<!-- feature-matrix:end -->\noutro\n")
    out = _cli("features", "--update-readme", str(page))
    assert out.returncode == 0, out.stderr
    text = page.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "old table" not in text
    assert features.readme_table(text).strip() == features.render_markdown().strip()


@pytest.mark.framework_free
def test_unknown_feature_id_is_a_clear_error():
    with pytest.raises(KeyError, match="no feature 'warp-drive'"):
        features.get("warp-drive")


COMBINATIONS = [  # row -> flags that ask for it (each feature alone is built)
    ("moe-compile-routing", ["--num-experts", "4", "--compile", "--context-parallel-size", "2"]),
    ("moe-compile-routing", ["--num-experts", "4", "--compile", "--expert-model-parallel-size", "2"]),
    ("moe-compile-routing", ["--num-experts", "4", "--compile", "--moe-expert-capacity-factor", "1.0"]),
    ("lora-latent-attention-qkv", ["--multi-latent-attention", "--lora-r", "8"]),
    ("compile-packed-sequences", ["--compile", "--reset-attention-mask"]),
    ("compile-packed-sequences", ["--compile", "--stage", "sft"]),
    ("compile-recompute", ["--compile", "--recompute-activations"]),
    ("alignment-context-parallel", ["--stage", "dpo", "--context-parallel-size", "2"]),
    ("compile-alignment", ["--stage", "simpo", "--compile"]),
]


@pytest.mark.parametrize("row, flags", COMBINATIONS, ids=[f"{c[0]}-{c[1][-1]}" for c in COMBINATIONS])
def test_combinations_not_built_yet_are_rows_the_gate_refuses(capsys, framework, row, flags):
    from mindspeed_core import cli

    feature = features.get(row)
    assert feature.category == "combinations" and feature.status(framework).kind in ("planned", "unsupported")
    assert cli.main(["check-args", "--ai-framework", framework, *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{row} (" in err and feature.status(framework).note in err, err
    assert row in features.render_text(framework)


def test_the_gate_sees_the_models_own_mixture_of_experts(capsys, framework):
    """MoE layers from a preset (or a Hugging Face config), no --num-experts: the configuration's
    gate still refuses a compiled step with context parallelism for them."""
    from mindspeed_core import cli

    assert cli.main(["check-args", "--ai-framework", framework, "--model-name", "tiny-qwen2-moe", "--data-path", "x",
                     "--tokenizer-type", "ByteLevel", "--context-parallel-size", "2", "--seq-length", "64", "--compile"]) == 2
    err = capsys.readouterr().err
    assert "moe-compile-routing (" in err and err.count("\n") == 1, err
