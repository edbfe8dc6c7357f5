"""Model definitions and presets, written only against the facade (mindspeed_core.ops, nn, ...)."""

from mindspeed_core.models.config import PRESETS, ModelConfig, preset  # noqa: E402,F401
