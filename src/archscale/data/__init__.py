"""Data: tokenizers, the packed shard format, preparation and the stateful loader."""
