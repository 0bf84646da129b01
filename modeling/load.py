"""Loading the policy: devices, dtypes, the tokenizer, the model (optionally 4-bit), adapters.

Model names and the cache they are built into (``smollm2-135m``, ``tiny-qwen3-moe``, HF ids,
local directories) are `modeling.zoo`; this module loads what `resolve_model_path`
gives. ``model.name`` may also be a PEFT adapter directory (a LoRA checkpoint): its base model
is loaded first and the adapter put on it.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from common.config import ModelConfig
from common.errors import MemexError
from modeling.zoo import (
    LOAD_HINT,
    hub_offline,
    hub_reachable,
    resolve_model_path,
    sync_generation_config,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"


# --------------------------------------------------------------------------------------------
# Devices, dtypes, loading


def resolve_device(device: str) -> torch.device:
    """``auto`` -> cuda if available else cpu; ``cpu``; ``cuda`` or ``cuda:N`` (checked); ``mps``."""
    name = (device or "auto").strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "mps":
        if not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
            raise MemexError("model.device=mps but MPS is not available; use model.device=auto or cpu")
        return torch.device("mps")
    match = re.fullmatch(r"cuda(?::(\d+))?", name)
    if match is None:
        raise MemexError(f"unknown model.device {device!r}; use 'auto', 'cpu' or 'cuda[:N]'")
    if not torch.cuda.is_available():
        raise MemexError(
            f"model.device={device} but CUDA is not available here; use model.device=auto or cpu"
        )
    index = int(match.group(1) or 0)
    if index >= torch.cuda.device_count():
        raise MemexError(
            f"model.device={device} but only {torch.cuda.device_count()} CUDA device(s) are visible; "
            f"use cuda:0..cuda:{torch.cuda.device_count() - 1}"
        )
    return torch.device("cuda", index)


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: str) -> torch.dtype:
    """``float32``/``bfloat16``/``float16`` (or fp32/bf16/fp16) -> the torch dtype."""
    key = (dtype or "float32").strip().lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise MemexError(f"unknown model.dtype {dtype!r}; use float32, bfloat16 or float16")
    return _DTYPES[key]


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 matmuls natively (AVX-512 BF16 or AMX, through oneDNN).

    Where it does, bfloat16 autocast trains ~1.4x faster than float32 (docs/benchmarks.md, SFT row); where it
    does not (AVX2 only), oneDNN emulates bfloat16 and it runs several times slower than float32.
    """
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        return False


def _reason(exc: BaseException, limit: int = 300) -> str:
    """An exception message on one line (whitespace collapsed, cut at ``limit`` characters)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _loadable(path: str, name: str) -> str:
    """Check ``path`` before ``from_pretrained`` and return what to load from.

    A local directory must hold config.json. An HF id is returned as is when the Hub is
    reachable; when it is offline or unreachable the id's HF cache snapshot is returned instead
    (no network at all: transformers would otherwise retry for minutes), or a `MemexError`.
    """
    local = Path(path).expanduser()
    if local.exists():
        if not (local / "config.json").is_file() and not (local / ADAPTER_CONFIG).is_file():
            raise MemexError(
                f"model {name!r}: {local} is not a model directory (no config.json); {LOAD_HINT}"
            )
        return str(local)
    if not hub_offline() and hub_reachable():
        return path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, local_files_only=True)
    except Exception as exc:
        raise MemexError(
            f"could not load model {name!r}: the Hugging Face Hub is not reachable and {path} is not in "
            f"the HF cache; download it where the Hub is reachable, or {LOAD_HINT}"
        ) from exc


def _load_tokenizer_from(path: str, name: str) -> PreTrainedTokenizerBase:
    """AutoTokenizer at ``path`` with a pad token (eos if missing) and left padding."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(_loadable(path, name))
    except MemexError:
        raise
    except Exception as exc:
        raise MemexError(
            f"could not load the tokenizer of model {name!r}: {_reason(exc)}; {LOAD_HINT}"
        ) from exc
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            logger.warning("tokenizer of %s has neither pad nor eos token; batches cannot be padded", name)
        else:
            tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The policy's tokenizer: pad token set (to eos if missing), left padding for generation."""
    return _load_tokenizer_from(resolve_model_path(cfg.name, cfg.cache_dir), cfg.name)


def adapter_base(path: str | Path) -> str | None:
    """The base model of a PEFT adapter directory (a LoRA checkpoint), or None for other paths."""
    config = Path(path).expanduser() / ADAPTER_CONFIG
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text())["base_model_name_or_path"]
    except (json.JSONDecodeError, KeyError) as exc:
        raise MemexError(
            f"{config} is not a PEFT adapter config ({_reason(exc)}); re-save the checkpoint"
        ) from exc


def _load_adapter(
    cfg: ModelConfig, base: str, for_training: bool
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Base model + LoRA adapter: trainable PeftModel for training, merged weights for inference."""
    from peft import PeftModel

    model, tokenizer = load_policy(replace(cfg, name=base), for_training=for_training)
    try:
        model = PeftModel.from_pretrained(model, cfg.name, is_trainable=for_training)
    except Exception as exc:
        raise MemexError(f"could not load the adapter {cfg.name!r} on {base!r}: {_reason(exc)}") from exc
    if not for_training:
        model = model.merge_and_unload()
        model.eval()
    if (Path(cfg.name).expanduser() / "tokenizer_config.json").is_file():
        tokenizer = _load_tokenizer_from(cfg.name, cfg.name)
    return model, tokenizer


QUANTIZATIONS = ("none", "4bit")
"""What ``load_policy(quantization=...)`` takes: full-precision weights, or a 4-bit NF4 base (QLoRA)."""


def _check_quantization(quantization: str) -> None:
    if quantization not in QUANTIZATIONS:
        raise MemexError(
            f"unknown quantization {quantization!r}; use one of {', '.join(repr(q) for q in QUANTIZATIONS)}"
        )


def _four_bit_config(compute_dtype: torch.dtype) -> Any:
    """transformers' `BitsAndBytesConfig` for an NF4 base with double quantisation (QLoRA)."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise MemexError(
            "4-bit loading (quantization='4bit', train.finetune=qlora) needs bitsandbytes: "
            "`pip install bitsandbytes` (or install memexrl's [gpu] extra)"
        ) from exc
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
    )


def load_policy(
    cfg: ModelConfig, *, for_training: bool = False, quantization: str = "none"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the policy model and its tokenizer.

    The model has ``cfg.dtype`` weights on ``cfg.device`` ('auto': cuda if available, else
    cpu), is in eval mode unless ``for_training``, and its generation config stops at the
    tokenizer's eos and pads with its pad token. ``cfg.name`` may be a PEFT adapter directory
    (a LoRA checkpoint): its base model is loaded first, then the adapter (trainable for
    training, merged into the weights otherwise).

    ``quantization="4bit"`` loads the base through bitsandbytes as NF4 with double
    quantisation, computing in ``cfg.dtype`` (QLoRA): the ``nn.Linear`` layers become
    ``bitsandbytes.nn.Linear4bit`` (embeddings, norms, the LM head and non-Linear weights such
    as fused MoE experts stay in ``cfg.dtype``). For training the model is also prepared by
    ``peft.prepare_model_for_kbit_training`` (all weights frozen, ready for a LoRA adapter).
    An adapter directory cannot be loaded 4-bit: merge it into a full checkpoint first.
    Failures, including an unknown ``quantization`` or missing bitsandbytes, raise `MemexError`.
    """
    from transformers import AutoModelForCausalLM

    _check_quantization(quantization)
    base = adapter_base(cfg.name)
    if base is not None:
        if quantization != "none":
            raise MemexError(
                f"model {cfg.name!r} is a LoRA adapter on {base!r}, and a 4-bit base cannot take a merged "
                "adapter: merge the adapter into a full checkpoint first (load it without quantization and "
                "save it), or fine-tune with lora or full instead of qlora"
            )
        return _load_adapter(cfg, base, for_training)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype)
    path = resolve_model_path(cfg.name, cfg.cache_dir)
    source = _loadable(path, cfg.name)
    kwargs: dict[str, Any] = {"dtype": dtype}
    if quantization == "4bit":
        kwargs.update(quantization_config=_four_bit_config(dtype), device_map=str(device))
    start = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except Exception as exc:
        raise MemexError(f"could not load model {cfg.name!r}: {_reason(exc)}; {LOAD_HINT}") from exc
    tokenizer = _load_tokenizer_from(source, cfg.name)
    if quantization == "none":
        model.to(device)  # a 4-bit model is placed by device_map and cannot be moved
    elif for_training:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model.train(for_training)
    sync_generation_config(model, tokenizer)
    embeddings = model.get_input_embeddings()
    if embeddings is not None and len(tokenizer) > embeddings.num_embeddings:
        logger.warning(
            "tokenizer of %s has %d tokens but the model embeds only %d; is it the model's own tokenizer?",
            cfg.name,
            len(tokenizer),
            embeddings.num_embeddings,
        )
    logger.info(
        "loaded %s (%s, %.1fM params, %s%s on %s) in %.1f s",
        cfg.name,
        path,
        model.num_parameters() / 1e6,
        dtype,
        ", 4-bit NF4" if quantization == "4bit" else "",
        device,
        time.perf_counter() - start,
    )
    return model, tokenizer


def supports_tools_in_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    """True if the tokenizer's chat template references ``tools`` (so tools can be passed to it)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        templates = [t for t in template.values() if isinstance(t, str)]
    elif isinstance(template, str):
        templates = [template]
    else:
        templates = []
    return any(re.search(r"\btools\b", t) for t in templates)
