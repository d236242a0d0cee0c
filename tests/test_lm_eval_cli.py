"""`archscale lm_eval ARGS...`: lm-eval's own command line with our model registered.

On the local-YAML example tasks (multiple choice + rolling log-likelihood, offline): `--model archscale` on a
run and lm-eval's own `--model hf` on that run's `archscale export --format hf` folder give the same scores
(1e-4), for a Transformer++ (native Llama) and a SambaY (trust_remote_code). The seed's argument form works,
device and batch size have sane defaults, and a conflicting `config=` is a one-line error.

lm-eval indexes its ~12,000 built-in task files on every command line (about a minute on 2 busy cores); these
tests only use the local example tasks, so an autouse fixture makes its TaskManager skip the built-in index.
Everything else is lm-eval's real command line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from archscale.cli import main  # noqa: E402

TASKS_DIR = Path(__file__).resolve().parents[1] / "examples" / "lm_eval_tasks"
TASKS = "archscale_mc,archscale_ppl"


@pytest.fixture(autouse=True)
def local_tasks_only(monkeypatch):
    from lm_eval.tasks import TaskManager

    init = TaskManager.__init__

    def without_builtins(self, *args, **kwargs):
        kwargs["include_defaults"] = False
        init(self, *args, **kwargs)

    monkeypatch.setattr(TaskManager, "__init__", without_builtins)


def lm_eval(model: str, model_args: str, out: Path, *extra: str, tasks: str = TASKS) -> dict:
    argv = ["lm_eval", "--model", model, "--model_args", model_args, "--tasks", tasks, "--include_path",
            str(TASKS_DIR), "--limit", "4", "--output_path", str(out), *extra]
    assert main(argv) == 0
    files = sorted(out.rglob("results_*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


def scores(doc: dict) -> dict[str, float]:
    return {f"{task}/{k}": v for task, res in doc["results"].items() for k, v in res.items()
            if isinstance(v, float) and not k.endswith("_stderr,none")}


@pytest.mark.parametrize("arch", ["transformer", "sambay"])
def test_archscale_on_a_run_equals_hf_on_its_export(tiny_runs, tmp_path, arch):
    run = tiny_runs[arch]
    folder = tmp_path / "hf"
    assert main(["export", "--format", "hf", "--checkpoint", str(run), "--out", str(folder)]) == 0
    ours = scores(lm_eval("archscale", f"pretrained={run}", tmp_path / "ours", "--batch_size", "2"))
    hf_args = f"pretrained={folder}" + (",trust_remote_code=True" if arch != "transformer" else "")
    theirs = scores(lm_eval("hf", hf_args, tmp_path / "hf_out", "--batch_size", "2", "--device", "cpu"))
    assert {"archscale_ppl/word_perplexity,none", "archscale_ppl/bits_per_byte,none",
            "archscale_mc/acc_norm,none"} <= set(ours)
    assert set(ours) == set(theirs)
    for k in ours:
        assert ours[k] == pytest.approx(theirs[k], rel=1e-4, abs=1e-4), k


def test_seed_argument_form_with_batch_size_in_both_places(tiny_runs, tmp_path):
    """--model ArchScale, pretrained=...,config=...,max_length=...,batch_size=... and --batch_size together; no
    --device on a CPU machine must not mean lm-eval's default cuda:0."""
    import torch

    run = tiny_runs["sambay"]
    args = f"pretrained={run},config=sambay_d4,max_length=32,batch_size=3"
    doc = lm_eval("ArchScale", args, tmp_path / "a", "--batch_size", "2", tasks="archscale_mc")
    ref = lm_eval("archscale", f"pretrained={run}", tmp_path / "b", tasks="archscale_mc")
    assert "archscale_mc/acc_norm,none" in scores(doc)
    assert scores(doc) == pytest.approx(scores(ref), rel=1e-5)
    if not torch.cuda.is_available():
        assert doc["config"]["model"] == "ArchScale"


def test_conflicting_config_and_bad_args_are_one_line_errors(tiny_runs, tmp_path, capsys):
    run = tiny_runs["transformer"]
    for model_args, msg in ((f"pretrained={run},config=sambay_d16", "conflicts with the checkpoint"),
                            (f"pretrained={run},temperature=2", "unknown key(s) temperature"),
                            ("config=sambay_d16", "needs --model_args pretrained=PATH")):
        argv = ["lm_eval", "--model", "archscale", "--model_args", model_args, "--tasks", TASKS,
                "--include_path", str(TASKS_DIR), "--limit", "1"]
        assert main(argv) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert len(err) == 1 and msg in err[0], err


def test_device_default_follows_the_machine(tiny_runs):
    import torch

    from archscale.eval.lm_eval_model import ArchScaleLM

    ArchScaleLM.cli_default_device = "cuda:0"
    try:
        lm = ArchScaleLM.create_from_arg_obj({"pretrained": str(tiny_runs["transformer"])},
                                             {"device": "cuda:0", "batch_size": 1})
    finally:
        ArchScaleLM.cli_default_device = None
    assert lm.em.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert lm.batch_size_per_gpu == 1


def test_help_passes_through(capsys):
    assert main(["lm_eval", "--help"]) == 0
    assert "lm-eval" in capsys.readouterr().out
