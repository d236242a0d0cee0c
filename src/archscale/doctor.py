"""`archscale doctor`: the seed guide's troubleshooting as checks of this machine, one line each with what to do.

    archscale doctor [--train_data_dir DIR] [--tokenizer PATH] [--out_dir DIR] [--train_model M --depth D
                     --vocab_size V --keep_last K]

Reports torch / CUDA / NCCL versions; for every registered mixer the kernel it will use here and how to get the
faster one (read from the registry's `KernelRef`s, so a new mixer's kernels appear by themselves); the compiler the
CPU scan kernel needs; `MASTER_ADDR` resolution and whether `MASTER_PORT` is free for torchrun; the free disk for
the planned checkpoints; the tokenizer and the data folder when given. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

import torch


KERNEL_CHECK_S = 90.0  # longest wait for one kernel's availability check (the CPU scan builds in about a minute)


@dataclass
class Finding:
    status: str  # ok | warn | fail
    what: str
    todo: str = ""

    def line(self) -> str:
        return f"[{self.status:4s}] {self.what}" + (f" -> {self.todo}" if self.todo else "")


def versions() -> list[Finding]:
    out = [Finding("ok", f"torch {torch.__version__}")]
    if torch.cuda.is_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "none"
        out.append(Finding("ok", f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s) "
                                 f"({torch.cuda.get_device_name(0)}), NCCL {nccl}"))
    else:
        built = torch.version.cuda
        out.append(Finding("warn", "no GPU visible: training runs on CPU (gloo)" +
                           (f" although torch was built for CUDA {built}" if built else " (a CPU-only torch build)"),
                           "for GPUs install a CUDA torch wheel and check nvidia-smi" if not built else
                           "check nvidia-smi and CUDA_VISIBLE_DEVICES"))
    return out


def kernels() -> list[Finding]:
    """One line per optional kernel of every registered mixer: used here, or the reference and how to upgrade."""
    from archscale.models.mixers.base import REGISTRY

    out = []
    for spec in REGISTRY.values():
        for k in spec.kernels:
            here, note = _available(k.available)
            if here:
                out.append(Finding("ok", f"{spec.name}: uses {k.name}"))
            else:
                out.append(Finding("warn", f"{spec.name}: {k.name} unavailable{note}; runs {k.reference}",
                                   k.install or "see docs/GPU.md"))
        if not spec.kernels:
            out.append(Finding("ok", f"{spec.name}: pure PyTorch (no optional kernel)"))
    from archscale.kernels import cross_entropy

    liger = cross_entropy.liger_fused_linear_cross_entropy is not None
    out.append(Finding("ok" if liger else "warn", "chunked loss: " + ("Liger-Kernel's fused kernel on CUDA" if liger
                       else "our chunked fp32 loss (Liger-Kernel not installed)"),
                       "" if liger else "on a CUDA machine: pip install liger-kernel"))
    return out


def _available(check, timeout: float = KERNEL_CHECK_S) -> tuple[bool, str]:
    """(available, a note): `check()` on a thread, so a kernel that builds on first use (or waits for another
    process's build) cannot hang the doctor; a broken optional install is a finding, not a crash."""
    import threading

    result: dict = {}

    def target():
        try:
            result["ok"] = bool(check())
        except Exception as e:
            result["error"] = f" ({type(e).__name__}: {e})".splitlines()[0]

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return False, f" (still building or waiting for a build lock after {timeout:.0f} s)"
    return result.get("ok", False), result.get("error", "")


def compiler() -> Finding:
    cxx = os.environ.get("CXX", "c++")
    found = shutil.which(cxx)
    if found:
        return Finding("ok", f"C++ compiler for the CPU scan kernel: {found}")
    return Finding("fail", f"no C++ compiler ({cxx!r} not on PATH): Mamba's CPU scan falls back to the slower "
                           "chunked PyTorch path", "apt-get install g++ (or set CXX to a compiler)")


def rendezvous() -> list[Finding]:
    """MASTER_ADDR resolves (and is this machine or reachable) and MASTER_PORT is free to bind for rank 0."""
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port_text = os.environ.get("MASTER_PORT", "29500")
    try:
        port = int(port_text)
        assert 0 < port < 65536
    except (ValueError, AssertionError):
        return [Finding("fail", f"MASTER_PORT={port_text!r} is not a port", "set MASTER_PORT to 1024..65535")]
    try:
        ip = socket.gethostbyname(addr)
    except OSError as e:
        return [Finding("fail", f"MASTER_ADDR={addr} does not resolve ({e})", "set MASTER_ADDR to rank 0's host")]
    local = ip.startswith("127.") or ip in _local_ips()
    out = [Finding("ok", f"MASTER_ADDR={addr} resolves to {ip}" + (" (this machine)" if local else ""))]
    if not local:
        out.append(Finding("ok", f"MASTER_PORT={port}: checked on rank 0's machine, not here",
                           f"run `archscale doctor` on {addr} too"))
        return out
    with socket.socket() as s:
        try:
            s.bind((ip, port))
            out.append(Finding("ok", f"MASTER_PORT={port} is free for torchrun's rendezvous"))
        except OSError:
            out.append(Finding("fail", f"MASTER_PORT={port} is in use on {ip} (another job or torchrun?)",
                               "pick a free one: torchrun --master_port <port> (or export MASTER_PORT)"))
    return out


def _local_ips() -> set[str]:
    try:
        return set(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        return set()


def disk(a) -> Finding:
    """Free space where checkpoints go against keep_last checkpoints of the planned model (fp32 weights + AdamW)."""
    from archscale.config import ModelConfig
    from archscale.models.model import GPT

    with torch.device("meta"):
        params = GPT(ModelConfig.from_arch(a.train_model, a.depth, vocab_size=a.vocab_size,
                                           block_size=256)).num_params(non_embedding=False)
    need = params * 16 * max(1, a.keep_last)  # fp32 weights (4) + two fp32 moments (8) + slack (4)
    where = Path(a.out_dir).resolve()
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    what = (f"disk: {free / 2**30:.1f} GiB free at {where}; {a.keep_last} checkpoints of {a.train_model} "
            f"d{a.depth} ({params / 1e6:.0f}M params) need ~{need / 2**30:.1f} GiB")
    if free >= need:
        return Finding("ok", what)
    return Finding("fail", what, "free space, point --out_dir elsewhere or lower --keep_last")


def data(a) -> list[Finding]:
    out = []
    if a.tokenizer:
        try:
            from archscale.data.tokenizer import Tokenizer

            tok = Tokenizer(a.tokenizer)
            out.append(Finding("ok", f"tokenizer {a.tokenizer}: {tok!r}"))
        except Exception as e:  # any failure to load is the finding
            out.append(Finding("fail", f"tokenizer {a.tokenizer}: {type(e).__name__}: {e}".splitlines()[0],
                               "give a tokenizer.json, a SentencePiece .model or a folder holding one"))
    if a.train_data_dir:
        folder = Path(a.train_data_dir)
        if not folder.is_dir():
            out.append(Finding("fail", f"data folder {folder} does not exist",
                               "run `archscale prepare --input ... --output_dir DIR --tokenizer ...` first"))
        else:
            shards = sorted(folder.glob("train*.bin"))
            manifest = (folder / "manifest.json").is_file()
            status = "ok" if shards else "fail"
            out.append(Finding(status, f"data folder {folder}: {len(shards)} train*.bin shard(s)" +
                               (", manifest.json" if manifest else ", no manifest.json (pass --vocab_size)"),
                               "" if shards else "run `archscale prepare` into it"))
    return out


def run(a) -> list[Finding]:
    return [*versions(), *kernels(), compiler(), *rendezvous(), disk(a), *data(a)]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="archscale doctor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train_data_dir", default=None, help="check a prepared data folder")
    p.add_argument("--tokenizer", default=None, help="check that a tokenizer loads")
    p.add_argument("--out_dir", default="runs", help="where checkpoints will go (free disk)")
    p.add_argument("--train_model", default="transformer")
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--vocab_size", type=int, default=32000)
    p.add_argument("--keep_last", type=int, default=3)
    findings = run(p.parse_args(argv))
    for f in findings:
        print(f.line())
    failed = [f for f in findings if f.status == "fail"]
    print(f"{len(findings)} checks: {len(failed)} failed, {sum(f.status == 'warn' for f in findings)} warnings")
    return 1 if failed else 0
