"""Export trained models to other ecosystems. Each exporter imports its third-party library lazily."""

from archscale.export.hf import (from_llama_state_dict, llama_incompatibility, to_llama_config, to_llama_model,
                                 to_llama_state_dict)

__all__ = ["from_llama_state_dict", "llama_incompatibility", "to_llama_config", "to_llama_model",
           "to_llama_state_dict"]
