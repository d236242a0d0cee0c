"""The lm-evaluation-harness adapter: our model as an lm-eval `LM`, registered as "archscale" and "ArchScale".

    from archscale.eval.lm_eval_model import ArchScaleLM
    lm = ArchScaleLM(eval_model, batch_size=8, max_length=4096)      # or: lm_eval model "archscale",
    lm_eval.simple_evaluate(model=lm, tasks=[...])                     #     model_args "pretrained=RUN_DIR"

`archscale lm_eval ARGS...` runs lm-eval's own command line with this model registered. Model args (ArchScale's
form): pretrained=PATH (run dir, checkpoint, exported HF folder, quantized folder; `checkpoint=` is a synonym),
config=NAME (optional, e.g. sambay_d16: checked against the checkpoint), max_length=N, batch_size=N (or lm-eval's
--batch_size), device=cpu|cuda[:i] (or --device; default: cuda if there is one, else cpu), tokenizer=PATH,
precision=fp32|bf16 (dtype=float32|bfloat16 also accepted).

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

import re

import torch
import torch.nn.functional as F

try:
    import lm_eval.models  # noqa: F401  (lm-eval fills its registry lazily only while it is empty: do it first)
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError:  # pragma: no cover - exercised only without the `eval` extra
    LM = object

    def register_model(*names):
        return lambda cls: cls

from archscale.eval.decode import greedy_batch


MODEL_ARGS = ("pretrained", "checkpoint", "config", "max_length", "batch_size", "device", "tokenizer", "precision",
              "dtype")
PRECISIONS = {"fp32": "fp32", "float32": "fp32", "auto": "fp32", "bf16": "bf16", "bfloat16": "bf16"}


def _check_config_name(name: str, cfg) -> None:
    """ArchScale's `config=sambay_d16` names the architecture and depth; it must be what the checkpoint holds."""
    from archscale.errors import UserError

    m = re.fullmatch(r"([a-z0-9]+)_d(\d+)", str(name))
    if not m:
        raise UserError(f"--model_args config={name}: expected '<arch>_d<depth>', e.g. sambay_d16")
    if (m[1], int(m[2])) != (cfg.arch, cfg.n_layer):
        raise UserError(f"--model_args config={name} conflicts with the checkpoint, which holds "
                        f"{cfg.arch}_d{cfg.n_layer}; drop config= (it is read from the checkpoint)")


@register_model("archscale", "ArchScale")
class ArchScaleLM(LM):
    # The value lm-eval's command line passes as `device` when the user gave no --device (set by
    # `archscale lm_eval`): treated as "not given", so the device defaults to what exists.
    cli_default_device: str | None = None

    def __init__(self, eval_model=None, batch_size: int = 8, max_length: int | None = None, checkpoint=None,
                 device=None, tokenizer=None, precision: str = "fp32", pretrained=None, config: str | None = None):
        super().__init__()
        if eval_model is None:
            from archscale.eval.loading import load_eval_model
            from archscale.errors import UserError

            checkpoint = checkpoint or pretrained
            if checkpoint is None:
                raise UserError("the archscale lm-eval model needs --model_args pretrained=PATH "
                                "(a run dir, checkpoint, or exported folder)")
            if device and str(device).startswith("cuda") and not torch.cuda.is_available():
                raise UserError(f"device {device}: no CUDA device here; use device=cpu or leave it out")
            eval_model = load_eval_model(checkpoint, device=device, tokenizer=tokenizer, precision=precision)
        if config is not None:
            _check_config_name(config, eval_model.model.config)
        self.em = eval_model
        self.tok = eval_model.tokenizer
        self.batch_size_per_gpu = int(batch_size)
        self.max_length = int(max_length or eval_model.train_len)
        self._device = eval_model.device

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        from lm_eval.utils import simple_parse_args_string
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        """model_args (dict) + lm-eval's own --batch_size / --device: model_args win, no keyword collides."""
        from archscale.errors import UserError

        kv = dict(arg_dict or {})
        unknown = sorted(set(kv) - set(MODEL_ARGS))
        if unknown:
            raise UserError(f"--model_args: unknown key(s) {', '.join(unknown)} for the archscale model; "
                            f"accepted: {', '.join(MODEL_ARGS)}")
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        if extra.get("device") is not None and extra["device"] == cls.cli_default_device:
            extra.pop("device")  # lm-eval's default, not the user's choice
        batch = kv.get("batch_size", extra.get("batch_size", 8))
        if not str(batch).isdigit() or int(batch) < 1:
            raise UserError(f"batch_size={batch}: the archscale model needs a positive integer (no 'auto')")
        precision = str(kv.get("precision", kv.get("dtype", "fp32"))).lower()
        if precision not in PRECISIONS:
            raise UserError(f"--model_args precision={precision}: use fp32 or bf16")
        return cls(pretrained=kv.get("pretrained") or kv.get("checkpoint"), tokenizer=kv.get("tokenizer"),
                   max_length=int(kv["max_length"]) if kv.get("max_length") else None,
                   precision=PRECISIONS[precision], device=kv.get("device", extra.get("device")),
                   batch_size=int(batch), config=kv.get("config"))

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
