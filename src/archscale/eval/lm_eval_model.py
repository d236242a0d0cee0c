"""The lm-evaluation-harness adapter: our model as an lm-eval `LM`, registered under the name "archscale".

    from archscale.eval.lm_eval_model import ArchScaleLM
    lm = ArchScaleLM(eval_model, batch_size=8, max_length=4096)      # or: lm_eval model "archscale",
    lm_eval.simple_evaluate(model=lm, tasks=[...])                     #     model_args "checkpoint=RUN_DIR"

Scoring conventions (those of lm-eval's HF model): a context's trailing whitespace moves to the continuation;
context + continuation are encoded together and split at the context's token count; an empty context is
replaced by the EOS token (our models have no BOS; documents are separated by EOS in training); inputs longer
than `max_length` keep their last `max_length` tokens. Sequences in a batch are right-padded, which is exact for
causal models (a position never sees later ones) and only the real positions are read.
`loglikelihood_rolling` predicts every token of the text exactly once, in windows of `max_length` tokens, the
first conditioned on EOS. `generate_until` decodes greedily (archscale.eval.decode) up to `max_gen_toks` and cuts
the text at the first stop string.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError:  # pragma: no cover - exercised only without the `eval` extra
    LM = object

    def register_model(*names):
        return lambda cls: cls

from archscale.eval.decode import greedy_batch


@register_model("archscale")
class ArchScaleLM(LM):
    def __init__(self, eval_model=None, batch_size: int = 8, max_length: int | None = None, checkpoint=None,
                 device=None, tokenizer=None, precision: str = "fp32"):
        super().__init__()
        if eval_model is None:
            from archscale.eval.loading import load_eval_model
            if checkpoint is None:
                raise ValueError("ArchScaleLM needs an EvalModel or checkpoint=RUN_DIR")
            eval_model = load_eval_model(checkpoint, device=device, tokenizer=tokenizer, precision=precision)
        self.em = eval_model
        self.tok = eval_model.tokenizer
        self.batch_size_per_gpu = int(batch_size)
        self.max_length = int(max_length or eval_model.train_len)
        self._device = eval_model.device

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        """lm-eval's `model_args`: checkpoint=RUN_DIR[,tokenizer=PATH,max_length=N,precision=bf16,batch_size=N]."""
        kv = dict(x.split("=", 1) for x in arg_string.split(",") if x)
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        batch = kv.get("batch_size", extra.get("batch_size", 8))
        return cls(checkpoint=kv.get("checkpoint") or kv.get("pretrained"), tokenizer=kv.get("tokenizer"),
                   max_length=int(kv["max_length"]) if "max_length" in kv else None,
                   precision=kv.get("precision", "fp32"), device=kv.get("device", extra.get("device")),
                   batch_size=int(batch) if str(batch).isdigit() else 8)

    # ------------------------------------------------------------------------------------------- helpers
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    def tok_encode(self, text: str) -> list[int]:
        return self.tok.encode(text, eos=False)

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            continuation = context[-n_spaces:] + continuation
            context = context[:-n_spaces]
        if not context:
            return [self.eot_token_id], self.tok_encode(continuation)
        whole = self.tok_encode(context + continuation)
        n_ctx = len(self.tok_encode(context))
        return whole[:n_ctx], whole[n_ctx:]

    @torch.no_grad()
    def score_tokens(self, items: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """For (tokens, n): sum of log p(tokens[-n:] | earlier tokens) and whether each was the argmax.
        The model reads tokens[:-1], truncated on the left to max_length."""
        results: list[tuple[float, bool] | None] = [None] * len(items)
        order = sorted(range(len(items)), key=lambda i: -len(items[i][0]))
        for s in range(0, len(order), self.batch_size_per_gpu):
            chunk = order[s:s + self.batch_size_per_gpu]
            inputs, targets = [], []
            for i in chunk:
                toks, n = items[i]
                if n < 1 or n > len(toks) - 1:
                    raise ValueError(f"cannot score {n} of {len(toks)} tokens")
                inp = toks[:-1][-self.max_length:]
                if n > len(inp):
                    raise ValueError(f"continuation of {n} tokens is longer than max_length {self.max_length}")
                inputs.append(inp)
                targets.append(toks[-n:])
            width = max(len(x) for x in inputs)
            batch = torch.zeros(len(chunk), width, dtype=torch.long)
            for r, inp in enumerate(inputs):
                batch[r, :len(inp)] = torch.tensor(inp)
            with self.em.autocast():
                logits = self.em.model(batch.to(self._device))
            logp = F.log_softmax(logits.float(), dim=-1)
            for r, i in enumerate(chunk):
                n, L = len(targets[r]), len(inputs[r])
                lp = logp[r, L - n:L]
                tgt = torch.tensor(targets[r], device=lp.device)
                total = float(lp.gather(-1, tgt[:, None]).sum())
                greedy = bool((lp.argmax(-1) == tgt).all())
                results[i] = (total, greedy)
        return results  # type: ignore[return-value]

    # ------------------------------------------------------------------------------------------- lm-eval API
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        items = []
        for req in requests:
            context, continuation = req.args
            ctx, cont = self._encode_pair(context, continuation)
            items.append((ctx + cont, len(cont)))
        out = self.score_tokens(items)
        for req, res in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return out

    def rolling_windows(self, ids: list[int]) -> list[tuple[list[int], int]]:
        """(tokens, n_scored) windows predicting every id once, the first conditioned on EOS."""
        seq = [self.eot_token_id] + ids
        items, done = [], 0  # seq[1..done] scored
        while done < len(ids):
            end = min(done + self.max_length, len(ids))  # score seq[done+1 .. end]
            begin = max(0, end - self.max_length)  # the model reads seq[begin:end]
            items.append((seq[begin:end + 1], end - done))
            done = end
        return items

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in requests:
            (text,) = req.args[:1]
            windows = self.rolling_windows(self.tok_encode(text))
            total = sum(lp for lp, _ in self.score_tokens(windows)) if windows else 0.0
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        prompts, settings = [], []
        for req in requests:
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            if isinstance(until, str):
                until = [until]
            max_gen = int(kwargs.get("max_gen_toks", 256))
            ids = self.tok_encode(context) or [self.eot_token_id]
            keep = max(1, self.max_length - max_gen)
            prompts.append(ids[-keep:])
            settings.append((until, max_gen))
        out: list[str | None] = [None] * len(requests)
        by_len: dict[int, list[int]] = {}
        for i, (_, max_gen) in enumerate(settings):
            by_len.setdefault(max_gen, []).append(i)
        for max_gen, idxs in by_len.items():
            with self.em.autocast():
                gens = greedy_batch(self.em.model, [prompts[i] for i in idxs], max_gen, self.eot_token_id,
                                    self.batch_size_per_gpu)
            for i, g in zip(idxs, gens):
                text = self.tok.decode(g)
                for stop in settings[i][0]:
                    if stop and stop in text:
                        text = text[:text.index(stop)]
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out  # type: ignore[return-value]
