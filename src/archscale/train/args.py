"""`archscale pretrain` flags: the jsonargparse parser derived from `PretrainConfig` (its own module so that the
CLI, the study runner's dry run and the launch scripts parse flags the same way without importing each other)."""

from __future__ import annotations

import dataclasses
from typing import Sequence


def explicit_flags(argv: Sequence[str]) -> set[str]:
    """Names of the flags the user typed (`--base_hps.b0=1` -> 'base_hps.b0')."""
    return {a[2:].split("=", 1)[0] for a in argv if a.startswith("--")}


def one_line(message: str, limit: int = 400) -> str:
    text = " ".join(str(message).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def pretrain_parser():
    from jsonargparse import ActionConfigFile, ArgumentParser

    from archscale.errors import UserError
    from archscale.train.config import PretrainConfig, field_help

    class Parser(ArgumentParser):
        def error(self, message, ex=None):  # one line + a pointer, instead of the whole usage
            raise UserError(f"archscale pretrain: {one_line(message)} (see archscale pretrain --help)")

    p = Parser(prog="archscale pretrain", description="Pretrain a language model on LITPKDS shards.",
               default_env=False)
    p.add_argument("--config", action=ActionConfigFile, help="YAML file with any of the flags below")
    p.add_class_arguments(PretrainConfig, nested_key=None, as_group=False)
    helps = field_help()
    for action in p._actions:  # the dataclass comments are the flags' help (jsonargparse reads docstrings only)
        if not action.help and action.dest in helps:
            action.help = helps[action.dest]
    return p


def parse_pretrain(argv: list[str]):
    """argv -> (PretrainConfig, the flags given explicitly)."""
    from archscale.scaling_rules import BaseHyperparameters
    from archscale.train.config import PretrainConfig

    # The deepspeed/torchrun launchers may pass --local_rank; it is read from the environment instead.
    argv = [a for a in argv if not a.startswith("--local_rank")]
    # A boolean flag given bare (`--dry_run`, `--compile`) means true.
    bools = {f"--{f.name}" for f in dataclasses.fields(PretrainConfig) if f.type in (bool, "bool")}
    argv = [f"{a}=true" if a in bools and (i + 1 == len(argv) or argv[i + 1].startswith("--")) else a
            for i, a in enumerate(argv)]
    ns = pretrain_parser().parse_args(argv)
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(PretrainConfig)}
    hps = values["base_hps"]
    if not isinstance(hps, BaseHyperparameters):
        hps = BaseHyperparameters(**{k: v for k, v in vars(hps).items()})
    values["base_hps"] = hps
    return PretrainConfig(**values), explicit_flags(argv)
