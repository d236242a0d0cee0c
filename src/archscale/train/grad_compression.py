"""`--grad_compression`: compress DDP's gradient all-reduce with torch's DDP communication hooks, and count the
bytes each rank puts into it.

    none            torch's `allreduce_hook` (the same sums as DDP without a hook), counted
    fp16 | bf16     `default_hooks.fp16_compress_hook` / `bf16_compress_hook`: each bucket is cast to 16 bits,
                    all-reduced and cast back (2 bytes per gradient element instead of 4)
    powersgd:rank=R[,start=S]
                    `powerSGD_hook.powerSGD_hook` (Vogels et al. 2019, layer-wise): every gradient matrix M
                    (n x m) is sent as P = M Q (n x R) and Q = M^T P (m x R) after `S` plain all-reduces
                    (default 2, the least torch allows with error feedback); vectors and matrices too small to
                    gain go uncompressed. Error feedback on: what the compression lost is added to the next
                    step's gradient.

The counter (`CountingHook`) wraps the hook: for every bucket it adds the bytes of the tensors the hook
all-reduces: the bucket itself (none), its 16-bit copy (fp16/bf16), or P, Q and the uncompressed rest (the
number of elements PowerSGD's own state accounts for this bucket, `total_numel_after_compression`). It is the
payload size, per rank; a ring all-reduce moves about 2 (W-1)/W times that over each rank's link.

PowerSGD's state (error feedback, P/Q memories, its iteration and RNG) lives per DDP bucket, and DDP regroups its
buckets after the first iteration of every run (a resumed one too). So the state is kept per parameter
whenever the bucket layout changes and in checkpoints (`state_dict`), and rebuilt for whatever buckets the hook
sees next. The compression is per tensor, so the layout does not change the arithmetic: resume is exact.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from archscale.errors import UserError

METHODS = ("none", "fp16", "bf16", "powersgd")


@dataclass(frozen=True)
class CompressionSpec:
    method: str = "none"
    rank: int = 0  # powersgd: the rank R of the low-rank approximation
    start: int = 2  # powersgd: plain all-reduces before compressing (torch requires > 1 with error feedback)

    def describe(self) -> str:
        return f"powersgd rank {self.rank} after {self.start} plain steps" if self.method == "powersgd" else self.method


def parse_grad_compression(spec: Optional[str]) -> CompressionSpec:
    """`none | fp16 | bf16 | powersgd:rank=R[,start=S]` -> CompressionSpec (a one-line UserError otherwise)."""
    text = "none" if spec in (None, "") else str(spec).strip()
    method, _, opts = text.partition(":")
    usage = "use none, fp16, bf16 or powersgd:rank=R[,start=S] (R >= 1, S >= 2), e.g. powersgd:rank=4"
    if method not in METHODS:
        raise UserError(f"--grad_compression {text!r}: unknown method {method!r}; {usage}")
    if method != "powersgd":
        if opts:
            raise UserError(f"--grad_compression {text!r}: {method} takes no options; {usage}")
        return CompressionSpec(method)
    values = {}
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        if key not in ("rank", "start") or not eq or not value.strip().lstrip("-").isdigit():
            raise UserError(f"--grad_compression {text!r}: cannot read {item!r}; {usage}")
        values[key] = int(value)
    if "rank" not in values or values["rank"] < 1:
        raise UserError(f"--grad_compression {text!r}: PowerSGD needs rank=R with R >= 1; {usage}")
    if values.get("start", 2) < 2:
        raise UserError(f"--grad_compression {text!r}: start must be >= 2 (DDP regroups its buckets after the "
                        f"first step, and error feedback needs the final buckets); {usage}")
    return CompressionSpec("powersgd", rank=values["rank"], start=values.get("start", 2))


def check_grad_compression(spec: Optional[str], strategy: str, precision: str) -> CompressionSpec:
    """Argument-time checks: the method parses, and the run is DDP (the hooks are DDP's)."""
    parsed = parse_grad_compression(spec)
    if parsed.method != "none" and strategy != "ddp":
        raise UserError(f"--grad_compression {spec} compresses DDP's gradient all-reduce; it needs --strategy ddp "
                        f"(got --strategy {strategy}: single process, FSDP2 and DeepSpeed have no DDP hook)")
    if parsed.method == "powersgd" and precision == "fp16-mixed":
        raise UserError("--grad_compression powersgd with --precision fp16-mixed: the error feedback would mix "
                        "loss scales (it is kept in scaled units); use bf16-mixed or fp32")
    return parsed


class CountingHook:
    """The DDP communication hook of a run: torch's hook for `spec`, wrapped to count the bytes it all-reduces,
    plus PowerSGD's state in a form that survives bucket regrouping and checkpoints."""

    def __init__(self, spec: CompressionSpec, names: dict[int, str]):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        self.spec, self.names = spec, names  # names: id(param) -> its name (stable across runs)
        self.step_bytes = 0  # the current step's bytes so far
        self.last_step_bytes = 0  # the last finished step's
        self.total_bytes = 0  # over the whole run (kept in checkpoints)
        self.steps = 0
        self.powersgd = None
        if spec.method == "powersgd":
            self.powersgd = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=spec.rank,
                                                        start_powerSGD_iter=spec.start, use_error_feedback=True,
                                                        warm_start=True, random_seed=0)
            self.inner = powerSGD_hook.powerSGD_hook
        else:
            self.inner = {"none": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
                          "bf16": default_hooks.bf16_compress_hook}[spec.method]
        self._layouts: dict[int, tuple] = {}  # bucket index -> its parameters, as last seen
        self._pool: dict[str, dict[str, torch.Tensor]] = {}  # per-parameter PowerSGD state awaiting its bucket
        self._touched: set[int] = set()  # buckets the hook ran for in the current iteration
        self._iteration_done = True
        # gloo: PowerSGD launches its P and Q all-reduces from callbacks on gloo's threads; with several buckets in
        # flight the ranks then issue them in different orders ("Received data size doesn't match expected size").
        # Finishing each bucket before DDP hands over the next keeps the order (and costs the overlap).
        self.one_bucket_at_a_time = False

    # ------------------------------------------------------------------ the hook
    def hook(self, state, bucket):
        """What DDP calls for every bucket: (state, bucket: GradBucket) -> Future[Tensor]. No annotations: DDP
        compares them with the classes, and this module's annotations are strings."""
        buffer = bucket.buffer()
        if self.powersgd is None:
            itemsize = 2 if self.spec.method in ("fp16", "bf16") else buffer.element_size()
            self.step_bytes += buffer.numel() * itemsize
            return self.inner(state, bucket)
        ps = self.powersgd
        if self._iteration_done:
            self._touched.clear()
            self._iteration_done = False
        self._touched.add(bucket.index())
        if ps.iter < ps.start_powerSGD_iter:
            self.step_bytes += buffer.numel() * buffer.element_size()
        else:
            self._match_layout(bucket)
        before = ps.total_numel_after_compression
        fut = self.inner(ps, bucket)
        self.step_bytes += (ps.total_numel_after_compression - before) * buffer.element_size()
        self._iteration_done = bucket.is_last()
        if self.one_bucket_at_a_time:
            fut.wait()
        return fut

    def end_step(self) -> None:
        """The optimizer step is over (every bucket's future completed in backward)."""
        self.last_step_bytes, self.step_bytes = self.step_bytes, 0
        self.total_bytes += self.last_step_bytes
        self.steps += 1

    # ------------------------------------------------------------------ PowerSGD state per parameter
    def _slices(self, bucket_params):
        """(name, numel, offset in the bucket, compressed?, rows n, cols m, rank r) per parameter, in bucket order,
        and the compressed ones in the order PowerSGD packs P and Q (grouped by matrix shape, first seen first)."""
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

        rows, offset = [], 0
        for p in bucket_params:
            n = p.shape[0] if p.dim() else 1
            m = p.numel() // max(n, 1)
            r = min(n, m, self.spec.rank)
            squeeze = _should_compress(n, m, r, self.powersgd.min_compression_rate)[0]
            rows.append((self.names[id(p)], p.numel(), offset, squeeze, n, m, r))
            offset += p.numel()
        by_shape = defaultdict(list)
        for row in rows:
            if row[3]:
                by_shape[(row[4], row[5])].append(row)
        return rows, [row for group in by_shape.values() for row in group]

    def _to_pool(self, index: int) -> None:
        """Move bucket `index`'s state (error, P, Q) into the per-parameter pool."""
        ps, layout = self.powersgd, self._layouts.pop(index)
        rows, packed = self._slices(layout)
        error, p_mem, q_mem = (d.pop(index, None) for d in (ps.error_dict, ps.p_memory_dict, ps.q_memory_dict))
        if error is not None:
            for name, numel, off, *_ in rows:
                self._pool.setdefault(name, {})["error"] = error[off:off + numel].clone()
        if p_mem is not None and q_mem is not None:
            po = qo = 0
            for name, _, _, _, n, m, r in packed:
                self._pool.setdefault(name, {}).update(p=p_mem[po:po + n * r].clone(), q=q_mem[qo:qo + m * r].clone())
                po, qo = po + n * r, qo + m * r
            if (po, qo) != (p_mem.numel(), q_mem.numel()):  # the packing above must be PowerSGD's
                raise RuntimeError(f"PowerSGD bucket {index}: P/Q hold {p_mem.numel()}/{q_mem.numel()} elements, "
                                   f"the parameters {po}/{qo}")

    def _match_layout(self, bucket: dist.GradBucket) -> None:
        """Before a compressed call: if this bucket's parameters are not the ones its state was made for, move
        the state of every bucket not yet seen this iteration into the pool, then rebuild this one from it."""
        ps, index, params = self.powersgd, bucket.index(), list(bucket.parameters())
        if [id(p) for p in self._layouts.get(index, ())] == [id(p) for p in params]:
            return
        for old in [i for i in self._layouts if i not in self._touched or i == index]:
            self._to_pool(old)
        self._layouts[index] = tuple(params)
        rows, packed = self._slices(params)
        ref = bucket.buffer()
        views = [g.storage_offset() - ref.storage_offset() for g in bucket.gradients()]
        if views != [row[2] for row in rows]:  # the slicing below assumes gradients packed back to back
            raise RuntimeError(f"DDP bucket {index}: gradient offsets {views[:4]}... are not packed in order")
        had_state = bool(rows) and all("error" in self._pool.get(name, {}) for name, *_ in rows)
        if had_state:
            ps.error_dict[index] = torch.cat([self._pool[name].pop("error") for name, *_ in rows]).to(ref)
        if packed and all("q" in self._pool.get(row[0], {}) for row in packed):
            ps.p_memory_dict[index] = torch.cat([self._pool[row[0]].pop("p") for row in packed]).to(ref)
            ps.q_memory_dict[index] = torch.cat([self._pool[row[0]].pop("q") for row in packed]).to(ref)
        elif not packed and had_state:  # nothing to compress here: PowerSGD keeps empty P/Q (no new RNG draw)
            ps.p_memory_dict[index], ps.q_memory_dict[index] = ref.new_empty(0), ref.new_empty(0)
        for name, *_ in rows:
            if not self._pool.get(name, True):
                del self._pool[name]

    def state_dict(self) -> dict:
        """Tensors and JSON only (the train state format): counters, and PowerSGD's iteration, RNG and
        per-parameter error / P / Q."""
        out = {"method": self.spec.describe(), "total_bytes": self.total_bytes, "steps": self.steps}
        ps = self.powersgd
        if ps is None:
            return out
        for index in list(self._layouts):
            self._to_pool(index)  # per parameter; rebuilt by the next compressed call
        self._touched.clear()
        out["powersgd"] = {"iter": ps.iter, "rng": ps.rng.get_state(),
                           "numel_before": ps.total_numel_before_compression,
                           "numel_after": ps.total_numel_after_compression, "next_stats": ps.next_stats_report,
                           "params": {name: dict(v) for name, v in self._pool.items()}}
        return out

    def load_state_dict(self, state: Optional[dict], same_world: bool = True) -> Optional[str]:
        """Restore from a checkpoint's train state; returns a note when some of it cannot apply (another
        method, or another world size: the error feedback is per rank)."""
        if not state:
            return None
        self.total_bytes, self.steps = int(state["total_bytes"]), int(state["steps"])
        if state.get("method") != self.spec.describe():
            return (f"note: the checkpoint was trained with --grad_compression {state.get('method')}; "
                    f"{self.spec.describe()} starts afresh")
        saved, ps = state.get("powersgd"), self.powersgd
        if ps is None or saved is None:
            return None
        if not same_world:
            return "note: the world size changed; PowerSGD's per-rank error feedback starts afresh"
        ps.iter, ps.next_stats_report = int(saved["iter"]), int(saved["next_stats"])
        ps.total_numel_before_compression = int(saved["numel_before"])
        ps.total_numel_after_compression = int(saved["numel_after"])
        ps.rng.set_state(tuple(saved["rng"]))
        ps.error_dict.clear(), ps.p_memory_dict.clear(), ps.q_memory_dict.clear()
        self._layouts.clear()
        self._pool = {name: dict(v) for name, v in saved["params"].items()}
        return None

    def drop_nonfinite(self) -> None:
        """After a step whose gradients were not finite (not applied): forget error feedback and P/Q that caught
        inf/nan, so one bad step does not poison every later one (PowerSGD restarts those buckets)."""
        ps = self.powersgd
        if ps is None:
            return
        for index, err in list(ps.error_dict.items()):
            if not torch.isfinite(err).all():
                err.zero_()
        for index in list(ps.q_memory_dict):
            if not (torch.isfinite(ps.q_memory_dict[index]).all() and torch.isfinite(ps.p_memory_dict[index]).all()):
                ps.q_memory_dict.pop(index), ps.p_memory_dict.pop(index)


def install(ddp_model: torch.nn.Module, spec: CompressionSpec) -> CountingHook:
    """Register the counting hook for `spec` on a DDP module."""
    names = {id(p): n for n, p in ddp_model.module.named_parameters()}
    counting = CountingHook(spec, names)
    counting.one_bucket_at_a_time = dist.get_backend(ddp_model.process_group) == "gloo"
    state = counting.powersgd  # None for the others: the hooks then use the default (world) group
    ddp_model.register_comm_hook(state, counting.hook)
    return counting
