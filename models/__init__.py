"""Model definitions and presets, written only against the facade (mindspeed_core.ops, nn, ...)."""
