"""Hugging Face model folders <-> our models (config.json + safetensors, sharded or not).

Works on numpy state dicts, so it runs the same under either framework:
``load_folder`` -> (ModelConfig, state in our names); ``save_folder`` writes a folder that
transformers loads. What each model type's config.json and tensors mean is its family's
(models/families/, one module each); here is what every family shares: the folder, its shards
and dtypes, the refusal of unknown types and quantizations, the output layer or reward head,
multi-token prediction layers after the last one, and no-op layers.
"""

from __future__ import annotations

import dataclasses

import json
import os
import shutil

import numpy as np

from mindspeed_core import features, nn, tensor_files
from mindspeed_core.backends.common import check_fits_in_memory
from mindspeed_core.errors import CheckpointError
from mindspeed_core.models import families, registry
from mindspeed_core.models.config import ModelConfig
from mindspeed_core.models.gpt import whole_state
from mindspeed_core.models.state import merge_lora, renumber_layers

# the model types read: each a family's (models/families/), which config.json's model_type picks
SUPPORTED = tuple(families.BY_MODEL_TYPE)


# ---- configs ---------------------------------------------------------------------------------

# the sizes config_from_hf reads, checked before any arithmetic on them
_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
          "intermediate_size", "max_position_embeddings", "n_embd", "n_layer", "n_head", "n_inner", "n_positions",
          "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step")
_COUNTS = ("num_experts",)  # sizes that may also be 0 (none: Qwen3-Next's dense hybrids)


def config_from_hf(hf: dict) -> ModelConfig:
    """Our config from a Hugging Face config.json; anything missing, malformed or not
    supported is a CheckpointError naming the key."""
    if not isinstance(hf, dict):
        raise CheckpointError(f"config.json is a JSON {type(hf).__name__}, not an object")
    for key in _SIZES:
        value = hf.get(key)
        if value is not None and (type(value) is not int or value < (key not in _COUNTS)):
            raise CheckpointError(f"config.json: {key} must be a "
                                  f"{'non-negative' if key in _COUNTS else 'positive'} integer, got {value!r}")
    try:
        return _config_from_hf(hf)
    except KeyError as exc:
        raise CheckpointError(f"config.json has no {exc.args[0]!r}") from None
    except (TypeError, ValueError, ZeroDivisionError) as exc:
        raise CheckpointError(f"config.json: {exc}") from None


def _config_from_hf(hf: dict) -> ModelConfig:
    cfg = _decoder_config_from_hf(hf)
    # a sequence classifier with one label (XForSequenceClassification, num_labels 1) is a
    # reward model: its `score` is our rm_head
    architectures = hf.get("architectures") or []
    if any(str(a).endswith("ForSequenceClassification") for a in architectures):
        if hf.get("num_labels", len(hf.get("id2label") or {0: 0})) != 1:
            raise CheckpointError("config.json: a sequence classifier with more than one label is not a reward model")
        cfg = dataclasses.replace(cfg, reward_head=True)
    return cfg


def _decoder_config_from_hf(hf: dict) -> ModelConfig:
    kind = hf.get("model_type")
    refused = next((f.refused_model_types[kind] for f in families.FAMILIES.values()
                    if kind in f.refused_model_types), None)
    if refused:
        raise CheckpointError(refused)
    if kind not in families.BY_MODEL_TYPE:
        raise CheckpointError(f"model_type {kind!r} is not supported; supported: {', '.join(SUPPORTED)}")
    family = families.BY_MODEL_TYPE[kind]
    quantized = hf.get("quantization_config")
    if quantized is not None:
        method = quantized.get("quant_method") if isinstance(quantized, dict) else quantized
        if method not in family.quantizations:
            raise CheckpointError(f"config.json: quantization_config: quant_method {method!r} weights are not read "
                                  f"here (only gpt_oss's MXFP4 experts are): use a dequantised (bf16) folder")
    return family.config_from_hf(hf)


def hf_config(cfg: ModelConfig) -> dict:
    family = families.get(cfg.family)
    if cfg.moe is not None and not family.experts:
        moe = ", ".join(f.name for f in families.FAMILIES.values() if f.dense)
        dense = ", ".join(f"{f.dense}'s" for f in families.FAMILIES.values() if f.dense)
        raise CheckpointError(f"a {cfg.family} model with MoE layers has no Hugging Face architecture: export MoE "
                              f"models as {moe} (their attention is {dense})")
    out = family.hf_config(cfg)
    if cfg.reward_head:  # transformers' sequence classifier with one label: the reward
        out["architectures"] = [out["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")
                                .replace("LMHeadModel", "ForSequenceClassification")]
        out["num_labels"] = 1
    return out


# ---- weights ---------------------------------------------------------------------------------

# buffers some Hugging Face checkpoints carry that are no weights of the model
_NOT_WEIGHTS = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


def from_hf_state(cfg: ModelConfig, hf: dict) -> dict:
    """Hugging Face names/layouts -> ours. Raises CheckpointError for missing tensors, and for
    tensors its config.json does not describe (a layer count edited down would drop weights)."""
    return _from_hf_state(cfg, dict(hf))


def _from_hf_state(cfg: ModelConfig, hf: dict) -> dict:
    out = {}
    hf = families.get(cfg.family).tensors_in(cfg, hf)
    left = hf  # what take() has not consumed, checked at the end

    def take(name):
        try:
            return hf.pop(name)
        except KeyError:
            raise CheckpointError(f"the Hugging Face checkpoint has no tensor {name!r}") from None

    families.get(cfg.family).body_from_hf(cfg, hf, take, out)
    _head_from_hf(cfg, out, take)
    _mtp_from_hf(cfg, hf, take, out)
    return _all_taken(cfg, out, left)


# a multi-token prediction module in a Hugging Face folder (DeepSeek-V3, GLM-4.5): layer
# num_hidden_layers + k holds a whole layer and these, by our names; it also saves copies of
# the embedding and the output layer, which are the model's own
_MTP_NAMES = ("enorm.weight", "hnorm.weight", "eh_proj.weight")
_MTP_COPIES = {"embed_tokens.weight": "embedding.word_embeddings.weight", "shared_head.head.weight": "output_layer.weight"}


def _mtp_layer_names(cfg: ModelConfig, k: int) -> tuple[str, str, str]:
    """(Hugging Face prefix, our layer's prefix as numbered in the decoder, our module's prefix)."""
    n = cfg.num_layers + k
    return f"model.layers.{n}.", f"decoder.layers.{n}.", f"mtp.layers.{k}."


def _check_mtp_family(cfg: ModelConfig) -> None:
    if cfg.mtp_num_layers and not families.get(cfg.family).mtp_layers:
        raise CheckpointError(f"{cfg.family} folders hold no multi-token prediction layers (deepseek_v3 and "
                              f"glm4_moe do): leave --mtp-num-layers out")


def _mtp_from_hf(cfg: ModelConfig, hf: dict, take, out: dict) -> None:
    _check_mtp_family(cfg)
    if cfg.mtp_num_layers:
        features.note_used("multi-token-prediction")
    for k in range(cfg.mtp_num_layers):
        theirs, as_layer, mine = _mtp_layer_names(cfg, k)
        if theirs + "eh_proj.weight" not in hf:
            raise CheckpointError(f"the Hugging Face checkpoint has no multi-token prediction layer {k} "
                                  f"({theirs}eh_proj.weight) for --mtp-num-layers {cfg.mtp_num_layers}")
        out.update((mine + name, take(theirs + name)) for name in _MTP_NAMES)
        out[f"mtp.final_layernorms.{k}.weight"] = take(theirs + "shared_head.norm.weight")
        for name, model_name in _MTP_COPIES.items():
            if theirs + name in hf:
                copy, own = take(theirs + name), out.get(model_name, out["embedding.word_embeddings.weight"])
                if not np.array_equal(copy, own):
                    raise CheckpointError(f"{theirs}{name} differs from the model's own {model_name}: a module with "
                                          f"an embedding or output layer of its own is not supported")
        layer = {}
        families.get(cfg.family).layer_from_hf(cfg, cfg.num_layers + k, hf, take, layer)
        out.update((mine + "transformer_layer." + name[len(as_layer):], value) for name, value in layer.items())


def _all_taken(cfg: ModelConfig, out: dict, left: dict) -> dict:
    # a tied output layer may be saved beside the embedding it shares (a copy, not a weight)
    tied_copy = ("lm_head.weight",) if cfg.tied_output else ()
    # the multi-token prediction layers after the last one, which transformers does not read either
    mtp = tuple(f"model.layers.{cfg.num_layers + k}." for k in range(8)) \
        if families.get(cfg.family).trailing_layers else ()
    extra = sorted(k for k in left if not k.endswith(_NOT_WEIGHTS) and k not in tied_copy and not k.startswith(mtp))
    if extra:
        raise CheckpointError(f"the Hugging Face checkpoint holds {len(extra)} tensors its config.json does not "
                              f"describe ({extra[0]}, ...): the configuration does not belong to these weights")
    return out


def _head_from_hf(cfg: ModelConfig, out: dict, take) -> None:
    if cfg.reward_head:
        out["rm_head.weight"] = take("score.weight")
    elif cfg.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = take("lm_head.weight")
        if cfg.output_layer_bias:
            out["output_layer.bias"] = take("lm_head.bias")


def _head_to_hf(cfg: ModelConfig, out: dict, ours: dict) -> None:
    if cfg.reward_head:
        out["score.weight"] = ours["rm_head.weight"]
    elif cfg.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = ours["output_layer.weight"]
        if cfg.output_layer_bias:
            out["lm_head.bias"] = ours["output_layer.bias"]


def to_hf_state(cfg: ModelConfig, ours: dict) -> dict:
    ours = dict(ours)
    out = {}
    families.get(cfg.family).body_to_hf(cfg, ours, out)
    _head_to_hf(cfg, out, ours)
    _mtp_to_hf(cfg, ours, out)
    return families.get(cfg.family).tensors_out(cfg, out)


def _mtp_to_hf(cfg: ModelConfig, ours: dict, out: dict) -> None:
    """The multi-token prediction modules as layers num_hidden_layers + k, with the copies of
    the embedding and output layer DeepSeek-V3's folders carry."""
    _check_mtp_family(cfg)
    if cfg.mtp_num_layers:
        features.note_used("multi-token-prediction")
    for k in range(cfg.mtp_num_layers):
        theirs, as_layer, mine = _mtp_layer_names(cfg, k)
        out.update((theirs + name, ours[mine + name]) for name in _MTP_NAMES)
        out[theirs + "shared_head.norm.weight"] = ours[f"mtp.final_layernorms.{k}.weight"]
        for name, model_name in _MTP_COPIES.items():
            out[theirs + name] = ours.get(model_name, ours["embedding.word_embeddings.weight"])
        inner = mine + "transformer_layer."
        families.get(cfg.family).layer_to_hf(cfg, cfg.num_layers + k,
                     {as_layer + n[len(inner):]: v for n, v in ours.items() if n.startswith(inner)}, out)


# ---- folders ---------------------------------------------------------------------------------

def _read_tensors(folder: str) -> dict:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as fh:
                weight_map = json.load(fh)["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{index} is not a valid index (a JSON object with a weight_map of file names)") from None
    elif os.path.exists(os.path.join(folder, "model.safetensors")):
        shards = ["model.safetensors"]
    else:
        raise CheckpointError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")
    state = {}
    for shard in shards:
        tensors, _ = tensor_files.load(_inside(folder, shard))
        for name, t in tensors.items():
            state[name] = t.float32() if t.dtype == "bfloat16" else t.array
    return state


def _inside(folder: str, name) -> str:
    """A shard named by the index, refused unless it is a plain file name inside the folder
    (an absolute path or ../ in a downloaded index must not read elsewhere)."""
    if not isinstance(name, str) or not name or os.path.isabs(name) or os.path.normpath(name).startswith(".."):
        raise CheckpointError(f"the index of {folder} names {name!r}, which is not a file inside that folder")
    path = os.path.join(folder, name)
    if os.path.commonpath([os.path.realpath(folder), os.path.realpath(path)]) != os.path.realpath(folder):
        raise CheckpointError(f"the index of {folder} names {name!r}, which leads outside that folder")
    return path


def load_config(folder: str) -> ModelConfig:
    """Only the config of a Hugging Face model folder (reads no weights)."""
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as fh:
            hf = json.load(fh)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError:
        raise CheckpointError(f"{path} is not valid JSON") from None
    return config_from_hf(hf)


# what a Hugging Face folder holds besides the model: copied along by --hf-cfg-dir
COMPANIONS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
              "generation_config.json", "vocab.json", "merges.txt", "chat_template.jinja")


def check_same_model(folder: str, cfg: ModelConfig) -> None:
    """``folder``'s config.json must describe the model ``cfg`` (the same shapes and family)."""
    theirs = load_config(folder)
    keys = ("family", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
            "kv_channels", "vocab_size")
    ours = {k: getattr(cfg, k) for k in keys}
    ours["num_layers"] = cfg.real_layers  # the folder has no no-op layers
    differ = [k for k in keys if getattr(theirs, k) != ours[k]]
    if differ:
        k = differ[0]
        raise CheckpointError(f"--hf-cfg-dir {folder}: its config.json has {k} {getattr(theirs, k)!r} but the "
                              f"converted model {ours[k]!r}: it describes another model")


def copy_companions(source: str, target: str) -> None:
    """The tokenizer and generation files of ``source`` into the written folder ``target``."""
    for name in COMPANIONS:
        if os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(target, name))


def load_folder(folder: str, mtp_num_layers: int = 0) -> tuple[ModelConfig, dict]:
    """A Hugging Face model folder -> (our config, our numpy state dict, float32). A config
    too large for this machine is refused before any weight is read. ``mtp_num_layers``: the
    multi-token prediction modules to read too (transformers reads none)."""
    cfg = load_config(folder)
    if mtp_num_layers:
        cfg = dataclasses.replace(cfg, mtp_num_layers=mtp_num_layers)
    check_fits_in_memory(4 * cfg.num_parameters(), f"the model in {folder} ({cfg.num_parameters():,} parameters)")
    try:
        state = from_hf_state(cfg, _read_tensors(folder))
    except ValueError as exc:  # a tensor whose shape its config.json does not describe
        raise CheckpointError(f"the weights in {folder} do not fit its config.json ({exc})") from None
    return cfg, {k: np.asarray(v, dtype=np.float32) for k, v in state.items()}


def without_noop_layers(cfg: ModelConfig, state: dict) -> tuple[ModelConfig, dict]:
    """A Hugging Face model has no no-op layers: number the real ones 0, 1, ... (as
    MindSpeed-LLM's converter drops them)."""
    if not cfg.noop_layers:
        return cfg, state
    real = [i for i in range(cfg.num_layers) if i not in cfg.noop_layers]
    index = {layer: j for j, layer in enumerate(real)}
    renamed = renumber_layers(state, index.__getitem__)
    return cfg.renumbered(index, len(real), ()), renamed


def with_noop_layers(cfg: ModelConfig, state: dict | None, noop: tuple) -> tuple[ModelConfig, dict | None]:
    """The inverse: a Hugging Face model with no-op layers at ``noop`` (MindSpeed's
    --noop-layers, numbered among all the layers), the real ones keeping their order."""
    total = cfg.num_layers + len(noop)
    if any(not 0 <= i < total for i in noop) or len(set(noop)) != len(noop) or len(noop) >= total:
        raise CheckpointError(f"--noop-layers {','.join(map(str, noop))}: layer numbers must be distinct, within the "
                              f"{total} layers the model then has, and leave some real")
    real = [i for i in range(total) if i not in noop]
    renamed = None if state is None else renumber_layers(state, real.__getitem__)
    return cfg.renumbered(dict(enumerate(real)), total, tuple(sorted(noop))), renamed


def save_folder(folder: str, cfg: ModelConfig, state: dict, max_shard_bytes: int | None = None) -> None:
    """Write config.json and safetensors (sharded with an index past max_shard_bytes) from a
    whole model's state in our names (LoRA adapters merged into their base weights)."""
    cfg, state = without_noop_layers(*merge_lora(cfg, state))
    # both can refuse the model: before the folder exists, so that a refusal leaves nothing
    config = {**hf_config(cfg), "torch_dtype": "float32"}
    hf = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in to_hf_state(cfg, state).items()}
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
    shards, current, size = [], {}, 0
    for name in sorted(hf):
        if current and max_shard_bytes and size + hf[name].nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = hf[name]
        size += hf[name].nbytes
    shards.append(current)
    raw = {"format": "pt"}
    if len(shards) == 1:
        tensor_files.save(os.path.join(folder, "model.safetensors"),
                          {k: tensor_files.HostTensor(v) for k, v in shards[0].items()}, raw_metadata=raw)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensor_files.save(os.path.join(folder, fname), {k: tensor_files.HostTensor(v) for k, v in shard.items()},
                          raw_metadata=raw)
        weight_map.update({k: fname for k in shard})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": int(sum(v.nbytes for v in hf.values()))}, "weight_map": weight_map},
                  fh, indent=2)


def load_model(folder: str):
    """Build our model (the family's, models/registry.py) from a Hugging Face folder on the
    bound framework, in evaluation mode (no dropout, no router input jitter), as transformers'
    from_pretrained returns it."""
    cfg, state = load_folder(folder)
    model = registry.for_config(cfg).build(cfg)
    nn.load_state_dict(model, state)
    nn.set_training(model, False)
    return model


def save_model(model, folder: str, max_shard_bytes: int | None = None) -> None:
    save_folder(folder, model.cfg, whole_state(model), max_shard_bytes)
