"""Token mixers and feed-forwards, one file each. Importing this package registers every one of them; a new
mixer is its own file plus one line in `MODULES`."""

import importlib

MODULES = (
    "attention",
    "mamba",
    "mamba2",
    "gmu",
    "gated_deltanet",
    "swiglu",
    "moe",
)

for _name in MODULES:
    importlib.import_module(f"{__name__}.{_name}")

from archscale.models.mixers.base import (REGISTRY, ForwardContext, MixerSpec, Role,  # noqa: E402
                                         memory_source, options_of, spec_for)

__all__ = ["REGISTRY", "ForwardContext", "MixerSpec", "Role", "memory_source", "options_of", "spec_for"]
