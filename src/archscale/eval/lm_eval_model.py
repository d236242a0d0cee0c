"""The lm-evaluation-harness adapter: our model as an lm-eval `LM`, registered as "archscale" and "ArchScale".

    from archscale.eval.lm_eval_model import ArchScaleLM
    lm = ArchScaleLM(eval_model, batch_size=8, max_length=4096)      # or: lm_eval model "archscale",
    lm_eval.simple_evaluate(model=lm, tasks=[...])                     #     model_args "pretrained=RUN_DIR"

`archscale lm_eval ARGS...` runs lm-eval's own command line with this model registered. Model args (ArchScale's
form): pretrained=PATH (run dir, checkpoint, exported HF folder, quantized folder; `checkpoint=` is a synonym),
config=NAME (optional, e.g. sambay_d16: checked against the checkpoint), max_length=N, batch_size=N (or lm-eval's
--batch_size), device=cpu|cuda[:i] (or --device; default: cuda if there is one, else cpu), tokenizer=PATH,
precision=fp32|bf16 (dtype=float32|bfloat16 also accepted), add_bos_token=True|False, max_gen_toks=N (default 256).

Scoring conventions (those of lm-eval's HF model): a context's trailing whitespace moves to the continuation;
context + continuation are encoded together and split at the context's token count; an empty context is
replaced by the EOS token (our models have no BOS; documents are separated by EOS in training); inputs longer
than `max_length` keep their last `max_length` tokens. Sequences in a batch are right-padded, which is exact for
causal models (a position never sees later ones) and only the real positions are read.
`loglikelihood_rolling` predicts every token of the text exactly once, in windows of `max_length` tokens, the
first conditioned on EOS. `generate_until` follows lm-eval's HF model: lm-eval's own generation-kwargs
normalisation (`max_gen_toks` and its aliases, do_sample / temperature / top_k / top_p), the context left-truncated
to `max_length - max_gen_toks` tokens (an error when nothing fits), greedy or sampled decoding
(archscale.eval.decode), the text cut at each stop string. `add_bos_token=True` prepends the tokenizer's BOS to
every encoding (and conditions empty contexts on it), as lm-eval does for Llama-2 tokenizers. Default max_length:
the training length (ArchScale's harness used 4096; `archscale eval --protocol archscale` passes 4096).
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
              "dtype", "add_bos_token", "max_gen_toks")
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's HF model's default generation budget
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


def _positive_int_arg(kv: dict, key: str, default: int | None = None) -> int:
    """A --model_args number (lm-eval hands over "abc", 1.5 or True as they were typed): a positive integer or a
    one-line error naming the key."""
    from archscale.errors import UserError

    value = kv.get(key, default)
    if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, str) and value.isdigit())) \
            or int(value) < 1:
        raise UserError(f"--model_args {key}={value}: want a positive integer")
    return int(value)


@register_model("archscale", "ArchScale")
class ArchScaleLM(LM):
    # The value lm-eval's command line passes as `device` when the user gave no --device (set by
    # `archscale lm_eval`): treated as "not given", so the device defaults to what exists.
    cli_default_device: str | None = None
    active: "ArchScaleLM | None" = None  # the newest instance (RULER's synthetic tasks size prompts with its tokenizer)

    def __init__(self, eval_model=None, batch_size: int = 8, max_length: int | None = None, checkpoint=None,
                 device=None, tokenizer=None, precision: str = "fp32", pretrained=None, config: str | None = None,
                 add_bos_token: bool = False, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS):
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
        self.max_gen_toks = int(max_gen_toks)
        self.add_bos_token = bool(add_bos_token)
        if self.add_bos_token and getattr(self.tok, "bos_id", None) is None:
            from archscale.errors import UserError

            raise UserError("add_bos_token=True: this tokenizer has no beginning-of-sequence token")
        self._device = eval_model.device
        self.names = {str(x) for x in (pretrained, checkpoint, tokenizer) if x}  # how RULER tasks may name us
        ArchScaleLM.active = self

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
        bos = str(kv.get("add_bos_token", False)).lower()
        if bos not in ("true", "false"):
            raise UserError(f"--model_args add_bos_token={kv['add_bos_token']}: use True or False")
        return cls(pretrained=kv.get("pretrained") or kv.get("checkpoint"), tokenizer=kv.get("tokenizer"),
                   max_length=_positive_int_arg(kv, "max_length") if kv.get("max_length") is not None else None,
                   precision=PRECISIONS[precision], device=kv.get("device", extra.get("device")),
                   batch_size=int(batch), config=kv.get("config"), add_bos_token=bos == "true",
                   max_gen_toks=_positive_int_arg(kv, "max_gen_toks", DEFAULT_MAX_GEN_TOKS))

    # ------------------------------------------------------------------------------------------- helpers
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context (and the first rolling window) is conditioned on: BOS with add_bos_token, else
        EOS (our models have no BOS; documents are separated by EOS in training)."""
        return self.tok.bos_id if self.add_bos_token else self.tok.eos_id

    def tok_encode(self, text: str) -> list[int]:
        ids = self.tok.encode(text, eos=False)
        return [self.tok.bos_id] + ids if self.add_bos_token else ids

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            continuation = context[-n_spaces:] + continuation
            context = context[:-n_spaces]
        if not context:
            return [self.prefix_token_id], self.tok_encode(continuation)
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
        seq = [self.prefix_token_id] + ids
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

    def generation_settings(self, kwargs: dict | None) -> dict:
        """lm-eval's own normalisation (max_gen_toks > max_new_tokens > max_tokens aliases; do_sample=False means
        temperature 0) plus the HF model's checks: the context gets max_length - max_gen_toks tokens, which must
        be at least one."""
        from archscale.errors import UserError

        try:
            from lm_eval.models.utils import normalize_gen_kwargs
            g = dict(normalize_gen_kwargs(dict(kwargs or {}), self.max_gen_toks))
        except ImportError:  # pragma: no cover - without lm-eval nobody sends requests
            g = dict(kwargs or {})
        until = g.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_gen = int(g.pop("max_gen_toks", self.max_gen_toks))
        if max_gen >= self.max_length:
            raise UserError(f"generate_until: max_gen_toks {max_gen} leaves no room for a context within "
                            f"max_length {self.max_length} (lm-eval's HF model stops here too); raise max_length")
        sample = bool(g.get("do_sample")) and float(g.get("temperature", 1.0)) > 0.0
        top_k = g.get("top_k")
        top_p = g.get("top_p")
        sampling = {"temperature": float(g.get("temperature", 1.0)), "top_k": int(top_k) if top_k else None,
                    "top_p": float(top_p) if top_p is not None and float(top_p) < 1.0 else None} if sample else None
        return {"until": until, "max_gen_toks": max_gen, "sampling": sampling}

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Requests grouped by their generation settings (as lm-eval's HF model does), each context left-truncated
        to max_length - max_gen_toks tokens; greedy unless do_sample with a positive temperature, then sampled
        with temperature / top_k / top_p from torch's global generator (lm-eval's --seed seeds it)."""
        groups: dict[str, list[int]] = {}
        settings = []
        for i, req in enumerate(requests):
            g = self.generation_settings(req.args[1])
            settings.append(g)
            groups.setdefault(repr(sorted(g.items(), key=lambda kv: kv[0])), []).append(i)
        out: list[str | None] = [None] * len(requests)
        for idxs in groups.values():
            g = settings[idxs[0]]
            keep = self.max_length - g["max_gen_toks"]
            prompts = [(self.tok_encode(requests[i].args[0]) or [self.prefix_token_id])[-keep:] for i in idxs]
            with self.em.autocast():
                gens = greedy_batch(self.em.model, prompts, g["max_gen_toks"], self.eot_token_id,
                                    self.batch_size_per_gpu, sampling=g["sampling"])
            for i, ids in zip(idxs, gens):
                text = self.tok.decode(ids)
                for stop in g["until"]:
                    if stop:
                        text = text.split(stop)[0]
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out  # type: ignore[return-value]
