"""`benchmarks/gpu_check.sh --dry`: the GPU check's whole logic on CPU at tiny sizes (every table row, the JSON and
log under $OUT, the built-in test runner collecting the CUDA-marked tests as it must where pytest is absent)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert (tmp_path / "gpu_check.log").read_text().count("measurement") == 1  # one table
    rows = {r["name"]: r for r in report["rows"]}
    assert len(rows) == 12 and not [n for n, r in rows.items() if "error" in r]
    assert report["matmul_tflops"] > 0
    for name, r in rows.items():
        if name.startswith("train"):
            assert r["tokens_per_s"] > 0 and 0 < r["mfu_peak"] < 1 and r["loss"] > 0, name
            assert r["predicted_gib"] > 0 and r["predicted_over_measured"] is None, name  # no CUDA peak on CPU
        elif name.startswith("step"):  # the trainer's step: on CPU every tensor read counts (none is a sync)
            assert r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["host_syncs_per_step"] >= 1, name
        elif name.startswith("decode"):
            assert r["decode_tokens_per_s"] > 0 and r["prefill_s"] > 0, name
    assert rows["train transformer d4 ctx256 docs"]["docs"] > 1
    tests = report["tests"]  # the built-in runner found every CUDA-marked case (collected, not run, on CPU)
    assert tests["runner"] == "builtin" and tests["collected"] >= 15 and tests["failed"] == 0
