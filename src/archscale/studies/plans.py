"""A study's runs without running them: resolved plans (`--dry_run`) and cluster launch scripts (`--emit`)."""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import sys
from pathlib import Path
from typing import Optional

from archscale.errors import UserError
from archscale.studies.sweep import Study, _ovr, markdown_table


# ---------------------------------------------------------------- dry run

def dry_run_plans(study: Study) -> list[dict]:
    """Each run's resolved plan from `archscale pretrain --dry_run` (run in-process: the same JSON)."""
    from archscale.cli import main

    plans = []
    for r in study.runs:
        buf, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
            try:
                rc = main(["pretrain", *r.args(), "--dry_run=true"])
            except SystemExit as e:  # a parser that exits still reports: its message is in `err`
                rc = e.code if isinstance(e.code, int) else 2
        if rc != 0:
            raise UserError(f"run {r.name}: pretrain --dry_run failed: "
                            f"{err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else rc}")
        text = buf.getvalue()
        plan = json.loads(text[text.index("{"):])
        plans.append({"name": r.name, "overrides": r.overrides, "out_dir": r.out_dir, "plan": plan,
                      "warnings": [w for w in err.getvalue().splitlines() if w.strip()]})
    return plans


def plan_table(plans: list[dict]) -> str:
    rows = []
    for p in plans:
        pl = p["plan"]
        n, t = pl["n_params_non_embedding"], pl["max_tokens"]
        rows.append([p["name"], _ovr(p["overrides"]), f"{n / 1e6:.3f}M", f"{pl['n_params'] / 1e6:.3f}M",
                     f"{t:.3g}", f"{6 * n * t:.3g}", f"{pl['flops_per_token'] * t:.3g}",
                     str(pl["optimizer_steps"]), str(pl["batch_tokens"]), f"{pl['lr_matrix']:.3g}"])
    return markdown_table(["run", "overrides", "params (non-emb)", "params (all)", "tokens", "FLOPs 6NT",
                           "FLOPs model", "steps", "batch", "lr matrix"], rows)



# ---------------------------------------------------------------- cluster scripts

def emit_scripts(study: Study, kind: str, nodes: int = 1, gpus_per_node: int = 8, partition: Optional[str] = None,
                 account: Optional[str] = None, parallel: Optional[int] = None, resume: str = "auto") -> list[Path]:
    """Write a launch script per run (a torchrun line) and, for `slurm`, one SLURM array script over them.
    Nothing is run. Returns the files written."""
    if kind not in ("slurm", "torchrun"):
        raise UserError(f"--emit {kind!r}: choose slurm or torchrun")
    d = study.out_dir / "launch"
    d.mkdir(parents=True, exist_ok=True)
    written = []
    py_cmd = study.command
    if py_cmd[:1] == [sys.executable] or (py_cmd and Path(py_cmd[0]).name.startswith("python")):
        target = py_cmd[1:] if py_cmd[1:2] != ["-m"] else ["-m", *py_cmd[2:]]
        prog = " ".join(shlex.quote(x) for x in target)
    elif py_cmd and Path(py_cmd[0]).name == "torchrun":  # the study already names a torchrun command
        prog = " ".join(shlex.quote(x) for x in py_cmd[1:] if not x.startswith("--n"))
    else:
        prog = " ".join(shlex.quote(x) for x in py_cmd)
    for r in study.runs:
        args = " \\\n    ".join(shlex.quote(a) for a in [*r.args(), f"--resume={resume}"])
        threads = r.threads or study.threads
        text = (
            "#!/usr/bin/env bash\n"
            f"# {study.name} / {r.name}: {_ovr(r.overrides)}\n"
            "# Launch on every node (SLURM sets the variables; alone it runs one node).\n"
            "set -euo pipefail\n"
            f"NNODES=${{SLURM_NNODES:-{nodes}}}\n"
            f"NPROC=${{GPUS_PER_NODE:-{gpus_per_node}}}\n"
            "MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames \"${SLURM_JOB_NODELIST:-localhost}\" "
            "2>/dev/null | head -n 1 || echo localhost)}\n"
            "MASTER_PORT=${MASTER_PORT:-29500}\n"
            + (f"export OMP_NUM_THREADS={int(threads)}\n" if threads else "")
            + f"mkdir -p {shlex.quote(r.out_dir)}\n"
            "torchrun --nnodes=\"$NNODES\" --nproc_per_node=\"$NPROC\" --rdzv_backend=c10d \\\n"
            "    --rdzv_id=\"${SLURM_JOB_ID:-0}\" --rdzv_endpoint=\"$MASTER_ADDR:$MASTER_PORT\" \\\n"
            f"    {prog} \\\n    {args}\n")
        p = d / f"{r.name}.sh"
        p.write_text(text)
        p.chmod(0o755)
        written.append(p)
    (d / "runs.txt").write_text("".join(f"{r.name}\n" for r in study.runs))
    written.append(d / "runs.txt")
    if kind == "slurm":
        times = [r.timeout or study.timeout for r in study.runs]
        limit = max((t for t in times if t), default=None)
        hh = f"{int(limit // 3600):02d}:{int(limit % 3600 // 60):02d}:{int(limit % 60):02d}" if limit else None
        par = f"%{int(parallel or study.parallel)}" if (parallel or study.parallel or 1) > 1 else ""
        sb = (
            "#!/usr/bin/env bash\n"
            f"#SBATCH --job-name={study.name}\n"
            f"#SBATCH --array=0-{len(study.runs) - 1}{par}\n"
            f"#SBATCH --nodes={nodes}\n"
            "#SBATCH --ntasks-per-node=1\n"
            f"#SBATCH --gpus-per-node={gpus_per_node}\n"
            + (f"#SBATCH --time={hh}\n" if hh else "")
            + (f"#SBATCH --partition={partition}\n" if partition else "")
            + (f"#SBATCH --account={account}\n" if account else "")
            + f"#SBATCH --output={d}/slurm-%A_%a.out\n"
            f"# {len(study.runs)} runs of {study.name}; submit with: sbatch {d}/{study.name}.sbatch\n"
            "set -euo pipefail\n"
            f"RUN=$(sed -n \"$((SLURM_ARRAY_TASK_ID + 1))p\" {shlex.quote(str(d / 'runs.txt'))})\n"
            "export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\n"
            "export MASTER_PORT=$((29500 + SLURM_ARRAY_TASK_ID % 1000))\n"
            f"export GPUS_PER_NODE={gpus_per_node}\n"
            f"srun --nodes={nodes} --ntasks-per-node=1 bash {shlex.quote(str(d))}/\"$RUN\".sh\n")
        p = d / f"{study.name}.sbatch"
        p.write_text(sb)
        p.chmod(0o755)
        written.append(p)
    return written
