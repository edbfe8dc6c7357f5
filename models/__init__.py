"""Model definitions and presets, written only against the facade (mindspeed_core.ops, nn, ...)."""

from mindspeed_core.models.config import ModelConfig  # noqa: E402,F401
from mindspeed_core.models.families import PRESETS, preset  # noqa: E402,F401
