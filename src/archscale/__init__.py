"""archscale: pretraining for language-model architecture research."""

from archscale.config import ModelConfig
from archscale.models.model import GPT

__version__ = "0.1.0"
__all__ = ["GPT", "ModelConfig", "__version__"]
