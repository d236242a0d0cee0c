"""archscale's own `GPT` behind Hugging Face's `PreTrainedConfig` / `PreTrainedModel` interfaces.

Every architecture that Llama cannot express (Mamba, Samba, SambaY, differential attention, ...) is exported as a
folder whose `config.json` names these classes in `auto_map`; the folder's two small Python files only import
this module, so `transformers` runs archscale's model code itself (no second copy to drift):

    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)    # any process with archscale installed

Importing this module also registers the classes with the Auto classes (model type "archscale"), so after
`import archscale.export.hf_model` the folder loads without `trust_remote_code`.

Generation goes through `transformers`' own `generate` (greedy, sampling, logits processors, stopping criteria,
streamers) with archscale's `InferenceCache` as the cache: KV caches, sliding windows and Mamba states are
decoded exactly as `GPT.generate` decodes them, so greedy output equals ours. Left-padded batches are refused
(the model has no padding mask); generate one prompt at a time or in batches of equal-length prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers.configuration_utils import PretrainedConfig
from transformers.modeling_outputs import ModelOutput

from archscale.config import ModelConfig
from archscale.models.cache import InferenceCache
from archscale.models.model import GPT

MODEL_TYPE = "archscale"


class ArchScaleConfig(PretrainedConfig):
    """`archscale`: the full `ModelConfig` as a dict; the usual HF fields are derived from it."""

    model_type = MODEL_TYPE

    def __init__(self, archscale: dict | None = None, **kwargs):
        self.archscale = dict(archscale or {})
        if self.archscale:
            cfg = ModelConfig(**self.archscale)
            kwargs.setdefault("vocab_size", cfg.vocab_size)
            kwargs.setdefault("hidden_size", cfg.n_embd)
            kwargs.setdefault("num_hidden_layers", cfg.n_layer)
            kwargs.setdefault("num_attention_heads", cfg.n_head)
            kwargs.setdefault("max_position_embeddings", cfg.block_size)
            kwargs["tie_word_embeddings"] = cfg.tie_embeddings
        super().__init__(**kwargs)

    def model_config(self) -> ModelConfig:
        return ModelConfig(**self.archscale)


@dataclass
class ArchScaleCausalLMOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: InferenceCache | None = None  # `transformers` >= 5 carries the cache under this name


def _check_no_left_padding(attention_mask: torch.Tensor | None) -> None:
    """Right padding is harmless for a causal model (real positions never see it); left padding is not."""
    if attention_mask is None or bool(attention_mask.all()):
        return
    m = attention_mask.to(torch.int)
    if bool((m[:, 1:] > m[:, :-1]).any()):
        raise ValueError("archscale models have no padding mask: left-padded batches would change the results; "
                         "generate prompts one at a time or in batches of equal length")


class ArchScaleForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = ArchScaleConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _is_stateful = True  # recurrent states: no assisted decoding, no beam reordering
    _no_split_modules = ["Block"]
    _tied_weights_keys = {"model.lm_head.weight": "model.wte.weight"}  # used only when tie_word_embeddings

    def __init__(self, config: ArchScaleConfig):
        super().__init__(config)
        self.model = GPT(config.model_config())
        self.post_init()

    def _init_weights(self, module):  # GPT initialises itself; from_pretrained loads every weight
        pass

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:  # our InferenceCache, made in prepare_inputs_for_generation
        return False

    def get_input_embeddings(self):
        return self.model.wte

    def set_input_embeddings(self, value):
        self.model.wte = value

    def get_output_embeddings(self):
        return self.model.lm_head

    def _autocast(self, device: torch.device):
        """GPT keeps its residual stream in fp32; bf16/fp16 weights run under autocast, as in training."""
        dtype = self.model.wte.weight.dtype
        return torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype in (torch.bfloat16, torch.float16))

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                cache: InferenceCache | None = None, past_key_values: InferenceCache | None = None,
                use_cache: bool | None = None, labels: torch.LongTensor | None = None, logits_to_keep: int = 0,
                return_dict: bool | None = None, **kwargs) -> ArchScaleCausalLMOutput:
        """Logits for `input_ids`; with a cache, `input_ids` continue the cached sequence."""
        _check_no_left_padding(attention_mask)
        cache = cache if cache is not None else past_key_values
        if cache is not None and not isinstance(cache, InferenceCache):
            raise TypeError(f"archscale models decode with their own InferenceCache, not {type(cache).__name__}")
        if cache is None and use_cache and labels is None:
            cache = InferenceCache(capacity=input_ids.shape[1])
        with self._autocast(input_ids.device):
            # one kept position with a cache: the prefill GPT.generate does (YOCO's cross-decoder sees only it)
            logits = self.model(input_ids, cache=cache, last_only=cache is not None and logits_to_keep == 1)
        if logits_to_keep and logits.shape[1] > logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        logits = logits.float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        out = ArchScaleCausalLMOutput(loss=loss, logits=logits, cache=cache if use_cache is not False else None)
        return out if return_dict is not False else out.to_tuple()

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, cache: InferenceCache | None = None,
                                      past_key_values: InferenceCache | None = None,
                                      attention_mask: torch.Tensor | None = None, use_cache: bool | None = True,
                                      logits_to_keep: int | None = None, **kwargs) -> dict:
        """Feed only the tokens the cache has not consumed yet (all of them at the first step)."""
        cache = cache if cache is not None else past_key_values
        if cache is None and use_cache is not False:
            cache = InferenceCache(capacity=input_ids.shape[1] + 256)  # KV buffers grow if generation goes on
        start = cache.pos if cache is not None else 0
        inputs = {"input_ids": input_ids[:, start:], "attention_mask": attention_mask, "use_cache": use_cache,
                  "cache": cache}
        if logits_to_keep is not None:
            inputs["logits_to_keep"] = logits_to_keep
        return inputs

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, is_encoder_decoder=False,
                                            num_new_tokens=1):
        model_kwargs = super()._update_model_kwargs_for_generation(outputs, model_kwargs, is_encoder_decoder,
                                                                   num_new_tokens)
        cache = outputs.get("cache") if isinstance(outputs, dict) else None
        if cache is not None:
            model_kwargs["cache"] = cache
        return model_kwargs


def register_auto_classes() -> None:
    """Make `AutoConfig` / `AutoModelForCausalLM` know model type "archscale" (idempotent)."""
    AutoConfig.register(MODEL_TYPE, ArchScaleConfig, exist_ok=True)
    AutoModelForCausalLM.register(ArchScaleConfig, ArchScaleForCausalLM, exist_ok=True)


register_auto_classes()

# The two files written into an exported folder (named in its config.json `auto_map`). They only import archscale.
CONFIGURATION_FILE = "configuration_archscale.py"
MODELING_FILE = "modeling_archscale.py"
CONFIGURATION_SOURCE = ('"""archscale model config for transformers: the code lives in the installed archscale '
                        'package (pip install archscale[hf])."""\n'
                        "from archscale.export.hf_model import ArchScaleConfig\n\n__all__ = [\"ArchScaleConfig\"]\n")
MODELING_SOURCE = ('"""archscale model for transformers: the code lives in the installed archscale package '
                   '(pip install archscale[hf])."""\n'
                   "from archscale.export.hf_model import ArchScaleConfig, ArchScaleForCausalLM\n\n"
                   "__all__ = [\"ArchScaleConfig\", \"ArchScaleForCausalLM\"]\n")
AUTO_MAP = {"AutoConfig": "configuration_archscale.ArchScaleConfig",
            "AutoModelForCausalLM": "modeling_archscale.ArchScaleForCausalLM"}
