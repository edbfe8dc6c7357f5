"""Where a model's weights come from, read one way for train, generate, evaluate and convert:
a Hugging Face folder (compat/hf.py), a Megatron checkpoint at any TP / PP / EP / VPP layout
(compat/mcore.py), or one of our checkpoints (training/checkpoint.py, LoRA adapters included).
Each gives the model's configuration and its whole state as numpy arrays under our names; no
framework is needed to read them.
"""

from __future__ import annotations

import dataclasses
import os

from mindspeed_core.backends.common import check_fits_in_memory
from mindspeed_core.compat import hf, mcore
from mindspeed_core.errors import CheckpointError, MindSpeedError
from mindspeed_core.models.config import ModelConfig
from mindspeed_core.models.state import check_adapters, is_adapter, merge_lora, moved_under_lora
from mindspeed_core.training import checkpoint

KINDS = ("hf", "megatron", "ours")


@dataclasses.dataclass
class Source:
    path: str
    kind: str  # one of KINDS
    cfg: ModelConfig
    state: dict  # {our parameter name: numpy array} of the whole model
    iteration: int = 0
    layout: mcore.Layout | None = None  # a Megatron checkpoint's saved layout
    dtype: str = "float32"  # the saved weights' dtype
    exact: bool = True  # False: Megatron's args did not name the architecture (the family is a guess)
    meta: dict | None = None  # ours: the checkpoint's meta.json
    # ours, sharded, read by slices (read_sliced): its reader; ``state`` is then empty
    shards: object = None

    @property
    def adapters_only(self) -> bool:
        """A LoRA run's checkpoint that holds its adapters (and expert biases) and no base model."""
        return any(is_adapter(k) for k in self.state) and all(moved_under_lora(k) for k in self.state)

    @property
    def tokenizer(self) -> str | None:
        """The tokenizer an our-checkpoint was trained with (None where the source does not say)."""
        return (self.meta or {}).get("tokenizer")

    def merged(self) -> "Source":
        """The same model with any LoRA adapters folded into their base weights (plain layers)."""
        if self.shards is not None:  # read_sliced takes no LoRA run
            return self
        cfg, state = merge_lora(self.cfg, self.state)
        return dataclasses.replace(self, cfg=cfg, state=state)


def kind_of(path: str) -> str | None:
    """Which kind of source ``path`` holds: "megatron", "ours", "hf", or None (nothing readable)."""
    if not os.path.isdir(path):
        return None
    if checkpoint.is_ours(path):  # ours, also where --ckpt-format torch_dist put Megatron's files beside it
        return "ours"
    if mcore.is_megatron_checkpoint(path):
        return "megatron"
    if checkpoint.latest_iteration(path) is not None:
        return "ours"
    if os.path.isfile(os.path.join(path, "config.json")):
        return "hf"
    return None


def _checked(source: Source) -> Source:
    """The weights must be the model the configuration describes: the same number of
    parameters (a configuration edited by hand, or files from another model, stop here, before
    any model is built or written from them), and LoRA factors of the shapes it gives."""
    if source.cfg.lora is not None:
        try:
            check_adapters(source.cfg, source.state, source.path)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
    if source.adapters_only:
        return source
    _check_parameter_count(source.path, source.cfg, sum(int(v.size) for k, v in source.state.items()
                                                        if not is_adapter(k)))
    return source


def _check_parameter_count(path: str, cfg: ModelConfig, held: int) -> None:
    expected = cfg.num_parameters()
    if held != expected:
        raise CheckpointError(f"{path}: its weights hold {held:,} parameters but its configuration describes "
                              f"{expected:,} (hidden size {cfg.hidden_size}, {cfg.num_layers} layers, "
                              f"MLP {cfg.ffn_hidden_size}, vocabulary {cfg.vocab_size}): the "
                              "configuration does not belong to these weights")


def read_hf(folder: str, mtp_num_layers: int = 0) -> Source:
    cfg, state = hf.load_folder(folder, mtp_num_layers)
    return _checked(Source(folder, "hf", cfg, state))


def read_megatron(root: str) -> Source:
    ckpt = mcore.load(root)
    return _checked(Source(root, "megatron", ckpt.cfg, ckpt.state, ckpt.iteration, ckpt.layout, ckpt.dtype,
                           ckpt.exact))


def read_ours(root: str, iteration: int | None = None) -> Source:
    """The newest (or the given) iteration of one of our checkpoints: weights only, not the
    optimizer's copies."""
    it, meta, cfg = _ours_config(root, iteration)
    check_fits_in_memory(4 * cfg.num_parameters(), f"the model in {root} ({cfg.num_parameters():,} parameters)")
    return _checked(Source(root, "ours", cfg, checkpoint.load_model_arrays(root, it), it, meta=meta))


def read_sliced(root: str, flag: str) -> Source | None:
    """One of our sharded checkpoints with its weights left in the files, for each rank to read
    its own slices once its model is cut (generation and evaluation, as a training run resumes);
    None where ``root`` is another kind, an older whole-file save, or a LoRA run's (its adapters
    are folded into the weights read whole)."""
    if _kind(root, flag, KINDS) != "ours":
        return None
    it, meta, cfg = _ours_config(root)
    shards = checkpoint.reader(root, it)
    if shards is None or cfg.lora is not None or meta.get("adapters_only"):
        return None
    # each rank builds the whole model before it cuts it, as read_ours's reader holds it whole
    check_fits_in_memory(4 * cfg.num_parameters(), f"the model in {root} ({cfg.num_parameters():,} parameters)")
    held = sum(shards.elements("model", name) for name in shards.names("model") if not is_adapter(name))
    _check_parameter_count(root, cfg, held)
    return Source(root, "ours", cfg, {}, it, meta=meta, shards=shards)


def _ours_config(root: str, iteration: int | None = None) -> tuple[int, dict, ModelConfig]:
    """(iteration, meta, model configuration) of one of our checkpoints, no weights read."""
    it = checkpoint.latest_iteration(root) if iteration is None else iteration
    if it is None:
        raise CheckpointError(f"no checkpoint in {root} (no {checkpoint.TRACKER})")
    meta = checkpoint.read_meta(root, it)
    checkpoint.check_megatron_copy(root, it)
    try:
        return it, meta, ModelConfig.from_dict(meta["model"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"the checkpoint in {root} (iteration {it}) holds no valid model configuration "
                              f"({exc})") from None


def _kind(path: str, flag: str, kinds: tuple) -> str:
    """Which of ``kinds`` the folder ``path`` holds, or a one-line error naming what ``flag`` takes."""
    if not os.path.isdir(path):
        raise MindSpeedError(f"{flag} {path} does not exist" if not os.path.exists(path)
                             else f"{flag} {path} is a file: give the folder that holds the model")
    kind = kind_of(path)
    if kind is None or kind not in kinds:
        wanted = {"hf": "a Hugging Face folder (config.json)", "megatron": f"a Megatron checkpoint ({mcore.TRACKER})",
                  "ours": f"one of our checkpoints ({checkpoint.TRACKER})"}
        raise CheckpointError(f"no checkpoint in {path}: {flag} takes " + " or ".join(wanted[k] for k in kinds))
    return kind


def read_config(path: str, flag: str, kinds: tuple = KINDS) -> ModelConfig:
    """The configuration of the model ``read`` would return, reading no weights (a Megatron
    checkpoint's architecture comes with its weights: read whole)."""
    kind = "hf" if kinds == ("hf",) else _kind(path, flag, kinds)
    if kind == "hf":
        return hf.load_config(path)
    if kind == "ours":
        return _ours_config(path)[2]
    return read_megatron(path).cfg


def read(path: str, flag: str, kinds: tuple = KINDS, adapters: bool = False, mtp_num_layers: int = 0) -> Source:
    """The model in ``path`` (given with ``flag``, for the messages), of one of ``kinds``;
    ``adapters``: a LoRA checkpoint holding the adapters alone is welcome too;
    ``mtp_num_layers``: a Hugging Face folder's multi-token prediction modules to read."""
    if kinds == ("hf",):  # the folder's own checks name what is missing or wrong
        return read_hf(path, mtp_num_layers)
    kind = _kind(path, flag, kinds)
    source = {"hf": read_hf, "megatron": read_megatron, "ours": read_ours}[kind](path)
    if source.adapters_only and not adapters:
        raise CheckpointError(f"{flag} {path} holds LoRA adapters only, no base model: give the model they were "
                              f"trained on, and these adapters beside it (--lora-load)")
    return source
