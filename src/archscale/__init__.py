"""archscale: pretraining for language-model architecture research.

`from archscale import ModelConfig, GPT` works; the names are imported lazily so that light tools (data
preparation workers, the CLI's --help) do not pay for importing torch.
"""

__version__ = "0.1.0"
__all__ = ["GPT", "ModelConfig", "BaseHyperparameters", "__version__"]


def __getattr__(name):
    if name == "ModelConfig":
        from archscale.config import ModelConfig
        return ModelConfig
    if name == "GPT":
        from archscale.models.model import GPT
        return GPT
    if name == "BaseHyperparameters":
        from archscale.scaling_rules import BaseHyperparameters
        return BaseHyperparameters
    raise AttributeError(f"module 'archscale' has no attribute {name!r}")
