"""The parallel layout (train/parallel_layout.py): the mesh's shape and this rank's place in it for every flag
combination, the combination rules in one place, strategies looked up in a registry, and a trainer that names
no strategy, pipeline or expert parallelism in any of its conditions."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from archscale.errors import UserError
from archscale.train.parallel_layout import DIMS, check_layout, make_layout, run_strategy
from archscale.train.strategy import STRATEGIES, strategy_for

TRAINER = Path(__file__).resolve().parents[1] / "src" / "archscale" / "train" / "trainer.py"
# identifiers and string constants that name a strategy or a parallelism: none may steer the trainer's control flow
STRATEGY_WORDS = re.compile(r"^(pipe|pipeline|PipelineStrategy|Pipeline|experts|ExpertParallel|ep|pp|fsdp|"
                            r"FSDPStrategy|deepspeed|DeepSpeedStrategy|zero|zero_stage|zero3|ddp|DDPStrategy|single|"
                            r"fsdp_save_mem)$")


def _cfg(**kw):
    base = dict(strategy="auto", fsdp_save_mem=False, pp=1, ep=1, pp_schedule="1f1b", pp_layers=None,
                varlen=False, curriculum="none", precision="fp32", grad_compression="none")
    return SimpleNamespace(**{**base, **kw})


def strategy_branches(source: str) -> list[str]:
    """Every condition (if / while / ternary / comparison / and-or / dict keyed by name) of `source` that
    mentions a strategy or parallelism name, as 'line: text'."""
    tree = ast.parse(source)
    found = []

    def words(node):
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name):
                yield sub.id
            elif isinstance(sub, ast.Attribute):
                yield sub.attr
            elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                yield sub.value

    for node in ast.walk(tree):
        tests = []
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            tests.append(node.test)
        elif isinstance(node, (ast.Compare, ast.BoolOp)):
            tests.append(node)
        elif isinstance(node, ast.comprehension):
            tests.extend(node.ifs)
        elif isinstance(node, ast.Dict):
            tests.extend(k for k in node.keys if k is not None)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
            tests.append(node)
        for test in tests:
            bad = sorted({w for w in words(test) if STRATEGY_WORDS.match(w)})
            if bad:
                found.append(f"{test.lineno}: {ast.unparse(test)[:90]} ({', '.join(bad)})")
    return sorted(set(found), key=lambda f: int(f.split(":")[0]))


def test_the_trainer_branches_on_no_strategy_pipeline_or_expert_parallelism():
    assert strategy_branches(TRAINER.read_text()) == []


def test_the_branch_check_sees_each_kind_of_branch():
    """The negative control: each way today's trainer branched (found by this check on it) is caught."""
    samples = ["if self.pipe is not None:\n    pass\n",
               "run = a if self.pipe is not None else b\n",
               "zero3 = self.env.strategy == 'deepspeed' and cfg.zero_stage == 3\n",
               "if cfg.ep > 1:\n    pass\n",
               "cls = {'ddp': A, 'fsdp': B}.get(name)\n",
               "ok = isinstance(s, PipelineStrategy)\n",
               "x = cfg.fsdp_save_mem and y\n"]
    for sample in samples:
        assert strategy_branches(sample), sample
    assert strategy_branches("if self.strategy.scaler is not None:\n    pass\n") == []  # a capability, no name


def test_layout_shapes_and_data_ranks():
    """rank = ((r * dp_shard + s) * pp + p) * ep + e; the ranks of one pipeline share their data rank."""
    pp2 = make_layout(_cfg(pp=2), "ddp", 4, rank=3)
    assert pp2.shape == (2, 1, 2, 1) and pp2.coords == {"dp_replicate": 1, "dp_shard": 0, "pp": 1, "ep": 0}
    assert (pp2.data_rank, pp2.data_world, pp2.kind) == (1, 2, "pipeline")
    assert [make_layout(_cfg(pp=2), "fsdp", 4, rank=r).data_rank for r in range(4)] == [0, 0, 1, 1]
    assert make_layout(_cfg(pp=2), "fsdp", 4).shape == (1, 2, 2, 1)
    ep = [make_layout(_cfg(ep=2), "fsdp", 4, rank=r) for r in range(4)]
    assert ep[0].shape == (1, 2, 1, 2) and [x.data_rank for x in ep] == [0, 1, 2, 3]
    assert ep[3].coords == {"dp_replicate": 0, "dp_shard": 1, "pp": 0, "ep": 1}
    one = make_layout(_cfg(), "single", 1)
    assert (one.shape, one.data_world, one.kind, one.build_mesh()) == ((1, 1, 1, 1), 1, "single", None)
    assert DIMS == ("dp_replicate", "dp_shard", "pp", "ep")


def test_strategies_are_a_registry():
    import archscale.train.pipeline  # noqa: F401 - registers the pipeline

    assert set(STRATEGIES) == {"single", "ddp", "fsdp", "deepspeed", "pipeline"}
    for kind, cls in STRATEGIES.items():
        assert cls.name == kind
    got = strategy_for(make_layout(_cfg(pp=2), "ddp", 2), _cfg(pp=2))
    assert type(got).__name__ == "PipelineStrategy" and got.model is None


def test_combination_rules_live_in_one_place():
    assert run_strategy(_cfg(pp=2)) == "ddp" and run_strategy(_cfg(fsdp_save_mem=True)) == "fsdp"
    assert run_strategy(_cfg()) == "auto"
    bad = {"--ep 2 must divide the number of processes": (_cfg(ep=2), 3),
           "--ep 2 composes with --strategy ddp or fsdp": (_cfg(ep=2, strategy="deepspeed"), 2),
           "--pp 2 does not combine with --strategy deepspeed: DeepSpeed's engine": (_cfg(pp=2, strategy="deepspeed"), 2),
           "--pp 2 does not combine with --precision fp16-mixed": (_cfg(pp=2, precision="fp16-mixed"), 2),
           "--pp_layers cuts a pipeline": (_cfg(pp_layers="2,2"), 1)}
    for message, (cfg, world) in bad.items():
        with pytest.raises(UserError, match=re.escape(message)):
            check_layout(cfg, world, n_layer=4, microbatches=4)
    check_layout(_cfg(ep=2, strategy="fsdp"), 4, n_layer=4, microbatches=4)
