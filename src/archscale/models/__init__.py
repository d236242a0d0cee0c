"""Pure model code: config in, modules out. Nothing here knows about distribution, logging or files."""

from archscale.models.model import GPT

__all__ = ["GPT"]
