"""The scheduler: one thread that owns the model and decodes every active sequence together.

Each loop iteration admits waiting sequences into free slots (prompts of one length prefilled together as one
batch, up to `PREFILL_TOKENS` tokens a forward, the others alone; then stacked into the batch:
`batching.BatchState`), drops cancelled ones, and runs one `decode_step` for all active rows; a row leaves as soon
as it finishes (EOS, a stop string, max_tokens, or its client went away), so requests join and leave at token
boundaries. Sampling is per row (its own temperature / top-k / top-p / repetition penalty / seeded generator), with
`archscale generate`'s sampler. Results go back through each sequence's `emit` callback (called on this thread).

A request can only fail itself: rows are independent in the decode step's arithmetic, each row's logits are
checked for non-finite values and each row is sampled under its own guard, so a row that goes NaN (or whose sampler
fails) ends with `finish_reason: "error"` while the rows beside it carry on with exactly their tokens.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import secrets
import threading
import time
from typing import Callable

import torch

from archscale.models.generation import sample_next
from archscale.serve.batching import BatchState, decode_step, prefill, prefill_batch

PREFILL_TOKENS = 8192  # the most prompt tokens one batched prefill forward takes (bounds its activations)


class QueueFull(Exception):
    """More sequences are waiting than the server accepts (HTTP 503; a request larger than the whole queue is
    refused before it gets here, with a 400)."""


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: int | None = None  # top alternatives per token (0: only the chosen token's logprob)
    ignore_eos: bool = False
    echo: bool = False


@dataclasses.dataclass
class TokenInfo:
    """One token of a logprobs listing: its text, logprob under the model, and the top alternatives."""

    text: str
    logprob: float | None
    top: dict[str, float] | None


@dataclasses.dataclass
class Event:
    index: int  # the choice this sequence answers
    text: str  # text since the previous event (held back while it may still become a stop string)
    tokens: list[TokenInfo]
    finish_reason: str | None = None  # "stop", "length", "error" (last event only)
    error: str | None = None


class Sequence:
    """One completion being decoded: prompt ids, sampling parameters, and what has been produced so far."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, emit: Callable[[Event], None], index: int = 0):
        self.prompt_ids, self.params, self.emit, self.index = prompt_ids, params, emit, index
        self.out_ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of text already emitted
        self.prefix_at = self.read_at = 0  # incremental detokenization offsets into out_ids
        self.cancelled = False
        self.finish_reason: str | None = None
        self.generator: torch.Generator | None = None
        self.submitted = time.monotonic()


def _plain_greedy(p: SamplingParams) -> bool:
    """Greedy with nothing that reads the row's logits beyond their argmax (no penalty, no logprobs)."""
    return p.temperature <= 0 and p.repetition_penalty == 1.0 and p.logprobs is None


def _top(logprobs: torch.Tensor, n: int, decode) -> dict[str, float]:
    vals, ids = torch.topk(logprobs, min(n, logprobs.shape[-1]))
    return {decode([i]): float(v) for v, i in zip(vals.tolist(), ids.tolist())}


class Engine:
    def __init__(self, model, tokenizer, *, max_batch: int = 16, max_queue: int = 256, max_model_len: int = 2048,
                 autocast: Callable[[], contextlib.AbstractContextManager] | None = None):
        self.model, self.tok = model, tokenizer
        self.device = next(model.parameters()).device
        self.max_batch, self.max_queue, self.max_model_len = max_batch, max_queue, max_model_len
        self.autocast = autocast or contextlib.nullcontext
        self.batch = BatchState(model, max_batch)
        self.rows: list[Sequence] = []  # rows[i] is decoded in batch row i
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.cv = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="archscale-engine", daemon=True)
        self.steps = 0  # decode steps run
        self.peak_rows = 0  # most rows ever decoded in one step (shows batching happened)
        self.batched_prefills = 0  # forwards that prefilled several prompts at once

    # ------------------------------------------------------------------------------------------------ control
    def start(self) -> "Engine":
        self._warmup()
        self.thread.start()
        return self

    def shutdown(self) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify_all()
        if self.thread.is_alive():
            self.thread.join(timeout=10)

    def submit(self, seqs: list[Sequence]) -> None:
        with self.cv:
            if len(self.waiting) + len(seqs) > self.max_queue:
                raise QueueFull(f"{len(self.waiting)} sequences are already waiting (limit {self.max_queue})")
            self.waiting.extend(seqs)
            self.cv.notify_all()

    def cancel(self, seq: Sequence) -> None:
        """Stop decoding `seq` (its client left); the engine frees its slot at the next token boundary."""
        if seq.finish_reason is None:
            seq.cancelled = True
            with self.cv:
                self.cv.notify_all()

    def stats(self) -> dict:
        return {"active": len(self.rows), "waiting": len(self.waiting), "slots": self.max_batch, "steps": self.steps,
                "peak_batch": self.peak_rows, "batched_prefills": self.batched_prefills}

    def _warmup(self) -> None:
        """Prefill and batch one short sequence at startup, so an unbatchable layer state fails now, not later."""
        with torch.inference_mode(), self.autocast():
            _, cache = prefill(self.model, [self.tok.eos_id] * 2, capacity=4)
            probe = BatchState(self.model, 1)
            probe.insert(cache)
            decode_step(probe, torch.tensor([self.tok.eos_id], device=self.device))

    # --------------------------------------------------------------------------------------------- the loop
    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self.cv:
                    while not self.waiting and not self.rows and not self.stopping:
                        self.cv.wait()
                    if self.stopping:
                        break
                    admit = [self.waiting.popleft() for _ in range(min(len(self.waiting),
                                                                          self.max_batch - len(self.rows)))]
                self._admit_all([seq for seq in admit if not seq.cancelled])
                self._drop_finished()
                if self.rows:
                    self._guarded(list(self.rows), self._step)
                    self._drop_finished()
        for seq in [*self.rows, *self.waiting]:
            self._finish(seq, "error", error="the server is shutting down")

    def _guarded(self, seqs: list[Sequence], fn, *args) -> None:
        """A failure inside the model ends the sequences it touched with an error, not the server."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - reported to the clients, the engine goes on
            for seq in seqs:
                self._finish(seq, "error", error=f"{type(e).__name__}: {e}")

    def _admit_all(self, seqs: list[Sequence]) -> None:
        """Prefill `seqs` and give each a slot. Prompts of one length go through one batched forward (a burst of
        clients is then one weight read, not one per prompt), in groups of at most PREFILL_TOKENS tokens; echo
        requests (which want the prompt's own logits) and lone lengths go alone. A batched prefill that fails is
        retried prompt by prompt, so a request still fails only itself."""
        by_length: dict[int, list[Sequence]] = collections.defaultdict(list)
        for seq in seqs:
            if seq.params.echo:
                self._guarded([seq], self._admit, seq)
            else:
                by_length[len(seq.prompt_ids)].append(seq)
        for length, group in by_length.items():
            per_forward = max(1, PREFILL_TOKENS // max(1, length))
            for i in range(0, len(group), per_forward):
                part = group[i:i + per_forward]
                if len(part) == 1:
                    self._guarded(part, self._admit, part[0])
                    continue
                try:
                    self._admit_batch(part)
                except Exception:  # noqa: BLE001 - find the request at fault: each alone
                    for seq in part:
                        self._guarded([seq], self._admit, seq)

    def _seed(self, seq: Sequence) -> None:
        p = seq.params
        seq.generator = torch.Generator(device=self.device).manual_seed(
            p.seed if p.seed is not None else secrets.randbits(63))

    def _admit(self, seq: Sequence) -> None:
        p = seq.params
        self._seed(seq)
        want_prompt_lp = p.echo and p.logprobs is not None
        with self.autocast():
            logits, cache = prefill(self.model, seq.prompt_ids, len(seq.prompt_ids) + p.max_tokens,
                                    all_logits=want_prompt_lp)
        if p.echo:
            self._echo(seq, logits if want_prompt_lp else None)
        self._start(seq, logits[-1], cache, 0)

    def _admit_batch(self, seqs: list[Sequence]) -> None:
        """Prompts of one length prefilled in one forward; row i of its cache is seqs[i]'s."""
        capacity = max(len(s.prompt_ids) + s.params.max_tokens for s in seqs)
        with self.autocast():
            logits, cache = prefill_batch(self.model, [s.prompt_ids for s in seqs], capacity)
        self.batched_prefills += 1
        for i, seq in enumerate(seqs):
            self._seed(seq)
            self._guarded([seq], self._start, seq, logits[i], cache, i)

    def _start(self, seq: Sequence, logits: torch.Tensor, cache, index: int) -> None:
        """The first token from the prompt's last logits; an unfinished sequence takes a slot."""
        self._accept(seq, logits)
        if seq.finish_reason is None:
            self.batch.insert(cache, index)
            self.rows.append(seq)

    def _step(self) -> None:
        tokens = torch.tensor([s.out_ids[-1] for s in self.rows], device=self.device)
        with self.autocast():
            logits = decode_step(self.batch, tokens)
        self.steps += 1
        self.peak_rows = max(self.peak_rows, len(self.rows))
        logits = logits.float()
        # one device sync for every row's finiteness and every plain greedy row's token, not one per row
        finite = torch.isfinite(logits).all(dim=-1).tolist()
        plain = [_plain_greedy(s.params) for s in self.rows]
        picks = logits.argmax(dim=-1).tolist() if any(plain) else None
        for i, (seq, row) in enumerate(zip(self.rows, logits)):  # one row's failure ends that row only
            self._guarded([seq], self._accept, seq, row, finite[i], picks[i] if plain[i] else None)

    def _drop_finished(self) -> None:
        i = 0
        while i < len(self.rows):
            seq = self.rows[i]
            if seq.cancelled and seq.finish_reason is None:
                seq.finish_reason = "cancelled"  # nobody listens any more: no event
            if seq.finish_reason is None:
                i += 1
                continue
            moved = self.batch.remove(i)
            if moved is not None:
                self.rows[i] = self.rows[moved]
            self.rows.pop()

    # ------------------------------------------------------------------------------------ tokens and text
    def _accept(self, seq: Sequence, logits: torch.Tensor, finite: bool | None = None, tok: int | None = None) -> None:
        """Sample seq's next token from its logits (vocab,) (or take `tok`, the batch's argmax for a plain greedy
        row), update its text, emit what is final. `finite`: the batch already checked this row's logits."""
        p = seq.params
        logits = logits.float()
        if not (finite if finite is not None else bool(torch.isfinite(logits).all())):
            raise FloatingPointError("the model's logits for this sequence are not finite")  # a NaN is no token
        if tok is None:
            tok = self._sample(seq, logits)
        seq.out_ids.append(tok)
        info = []
        if p.logprobs is not None:  # reported under the model, before any sampling transform
            logprobs = torch.log_softmax(logits, dim=-1)
            info = [TokenInfo(self.tok.decode([tok]), float(logprobs[tok]),
                              _top(logprobs, p.logprobs, self.tok.decode) if p.logprobs else None)]
        finish = None
        ids = seq.out_ids
        if tok == self.tok.eos_id and not p.ignore_eos:
            finish, ids = "stop", ids[:-1]
        elif len(seq.out_ids) >= p.max_tokens or len(seq.prompt_ids) + len(seq.out_ids) >= self.max_model_len:
            finish = "length"
        self._detokenize(seq, ids, final=finish is not None)
        if p.stop:
            cut = self._find_stop(seq)
            if cut is not None:
                seq.text, finish = seq.text[:cut], "stop"
        self._emit_text(seq, info, finish)

    @staticmethod
    def _sample(seq: Sequence, logits: torch.Tensor) -> int:
        p = seq.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.prompt_ids + seq.out_ids)), device=logits.device)
            picked = logits[seen]
            logits = logits.clone()
            logits[seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
        top_p = p.top_p if p.top_p < 1.0 else None
        return int(sample_next(logits[None], p.temperature, p.top_k or None, top_p, seq.generator)[0])

    def _detokenize(self, seq: Sequence, ids: list[int], final: bool) -> None:
        """Append the text of the new tokens, decoding only a short window (vLLM's and TGI's scheme: the tokens
        before `read_at` give the context that decodes leading spaces and multi-byte characters right)."""
        before = self.tok.decode(ids[seq.prefix_at:seq.read_at])
        now = self.tok.decode(ids[seq.prefix_at:])
        if final or (len(now) > len(before) and not now.endswith("\ufffd")):
            seq.text += now[len(before):]
            seq.prefix_at, seq.read_at = seq.read_at, len(ids)

    def _find_stop(self, seq: Sequence) -> int | None:
        start = max(0, seq.sent - max(len(s) for s in seq.params.stop))
        hits = [i for i in (seq.text.find(s, start) for s in seq.params.stop) if i >= 0]
        return min(hits) if hits else None

    def _emit_text(self, seq: Sequence, info: list[TokenInfo], finish: str | None) -> None:
        end = len(seq.text)
        if finish is None:
            while end > seq.sent and seq.text[end - 1] == "\ufffd":  # an incomplete UTF-8 character so far
                end -= 1
            for s in seq.params.stop:  # hold back a tail that may still grow into a stop string
                for k in range(min(len(s) - 1, end - seq.sent), 0, -1):
                    if seq.text[end - k:end] == s[:k]:
                        end -= k
                        break
        delta, seq.sent = seq.text[seq.sent:end], max(seq.sent, end)
        if finish is not None:
            seq.finish_reason = finish
        if delta or info or finish is not None:
            seq.emit(Event(seq.index, delta, info, finish))

    def _echo(self, seq: Sequence, logits: torch.Tensor | None) -> None:
        """Emit the prompt itself first (OpenAI `echo`), with each prompt token's logprob when asked."""
        ids, info = seq.prompt_ids, []
        if logits is not None:
            lps = torch.log_softmax(logits.float(), dim=-1)
            n = seq.params.logprobs
            info = [TokenInfo(self.tok.decode([ids[0]]), None, None)]
            info += [TokenInfo(self.tok.decode([t]), float(lps[i, t]), _top(lps[i], n, self.tok.decode) if n else None)
                     for i, t in enumerate(ids[1:])]
        seq.emit(Event(seq.index, self.tok.decode(ids), info))

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        if seq.finish_reason is None:
            seq.finish_reason = reason
            seq.emit(Event(seq.index, "", [], reason, error))
