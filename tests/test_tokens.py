"""Token-in / token-out: segment ids, loss masks and log-probs line up with the text, for the
scripted engine and for SmolLM2 sampling through the transformers engine on a real game."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import copy
import json

import pytest
import torch

from common.config import load_config
from common.engine import GenerationRequest
from envs.data import resolve_game
from envs.inline import InlineEnvs
from memory.prompts import system_prompt
from rollout.episode import MEMEX_TOOLS
from rollout.hf_engine import TransformersEngine
from rollout.runner import make_renderer, run_episodes
from rollout.scripted import ScriptedEngine

torch.set_num_threads(1)


def spans(mask):
    """Maximal runs of equal mask values: [(value, start, stop), ...]."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def check_alignment(traj, renderer):
    """Each trained span decodes to one assistant turn; the rest is template + observations."""
    texts = [s.assistant for s in traj.steps]
    n = 0
    for seg in traj.segments:
        assert len(seg.completion_ids) == len(seg.loss_mask) == len(seg.logprobs)
        for value, start, stop in spans(seg.loss_mask):
            piece = renderer.decode(seg.completion_ids[start:stop])
            if value == 1:
                assert piece.replace(renderer.eos_text, "") == texts[n]
                n += 1
            else:
                assert all(lp == 0.0 for lp in seg.logprobs[start:stop])
    assert n == len(texts)


def test_scripted_segments_decode_to_the_exact_context(alfworld_data, smol_tokenizer):
    cfg = load_config(None, [f"env.data_dir={alfworld_data}", "memory.threshold=400"])
    renderer = make_renderer(smol_tokenizer, cfg)
    look = '<tool_call>{"name": "execute_action", "arguments": {"action": "look"}}</tool_call>'
    compress = ('<tool_call>{"name": "CompressExperience", "arguments": {"summary": "room: overview", '
                '"db_blocks": [{"db_index": "room", "db_content": "a room"}]}}</tool_call>')
    read = '<tool_call>{"name": "ReadExperience", "arguments": {"db_index": "room"}}</tool_call>'
    game = str(resolve_game("valid_seen:0", alfworld_data))
    engine = ScriptedEngine(smol_tokenizer, {"e": ["I look. " + look, compress, read]})
    with InlineEnvs() as envs:
        (traj,) = run_episodes([("e", game)], engine, envs, renderer, cfg)
    check_alignment(traj, renderer)
    first, second = traj.segments
    # Segment 2 starts from [system, task, summary] rendered by the chat template.
    prompt = renderer.decode(second.prompt_ids)
    assert prompt.endswith("<|im_start|>assistant\n") and "=== SUMMARY OF YOUR PREVIOUS CONTEXT ===" in prompt
    system = system_prompt(MEMEX_TOOLS, 400, schemas_in_text=True)
    assert renderer.decode(first.prompt_ids).startswith(f"<|im_start|>system\n{system}<|im_end|>")
    assert "Your task is to:" in renderer.decode(first.prompt_ids)
    # Each segment's messages render (chat template) to exactly the text of its token ids.
    assert renderer.decode(first.prompt_ids + first.completion_ids) + "\n" == renderer.render(first.messages, False)
    assert renderer.decode(second.prompt_ids + second.completion_ids) == renderer.render(second.messages, True)
    assert [m["role"] for m in second.messages] == ["system", "user", "user", "assistant", "tool"]
    # The observation tokens decode to the observation text exactly as the step records it.
    whole = renderer.decode(first.completion_ids)
    assert traj.steps[0].observation in whole


@pytest.mark.slow
def test_smollm2_plays_real_steps_with_aligned_tokens_and_logprobs(alfworld_data, smol_policy):
    model, tokenizer = smol_policy
    cfg = load_config(None, [f"env.data_dir={alfworld_data}", "env.max_steps=3", "rollout.max_new_tokens=48",
                             "memory.threshold=2000", "rollout.temperature=1.0"])
    renderer = make_renderer(tokenizer, cfg)
    engine = TransformersEngine(model, tokenizer, temperature=1.0, batch_size=2, seed=0)
    games = [str(resolve_game(spec, alfworld_data)) for spec in ("valid_seen:0", "valid_unseen:0")]
    with InlineEnvs() as envs:
        trajs = run_episodes([("a", games[0]), ("b", games[1])], engine, envs, renderer, cfg)
    for traj in trajs:
        assert traj.stats["num_steps"] == 3 and traj.end_reason in ("step_limit", "finish", "env_done")
        check_alignment(traj, renderer)
        seg = traj.segments[-1]
        ids = torch.tensor([seg.prompt_ids + seg.completion_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(seg.prompt_ids) - 1 : -1].float()  # (T, V)
        recomputed = logits.log_softmax(-1).gather(-1, torch.tensor(seg.completion_ids)[:, None]).squeeze(-1)
        mask = torch.tensor(seg.loss_mask, dtype=torch.bool)
        assert torch.allclose(recomputed[mask], torch.tensor(seg.logprobs)[mask], atol=1e-3)
    # The KV cache made each turn prefill only its new tokens: every context token is run through
    # the model once, plus at most the re-fed last sampled token of each turn. Without the cache every
    # turn would prefill its whole context again.
    total = sum(len(s.prompt_ids) + len(s.completion_ids) for t in trajs for s in t.segments)
    turns = sum(t.stats["num_steps"] for t in trajs)
    assert engine.prefill_tokens <= total - engine.generated_tokens + turns


@pytest.mark.slow
def test_batched_cached_greedy_equals_generate(smol_policy):
    model, tokenizer = smol_policy
    engine = TransformersEngine(model, tokenizer, temperature=0, batch_size=4)

    def chat(text):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False)
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]

    def reference(ids, n):
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False)
        return out[0, len(ids):].tolist()

    p1, p2 = chat("What is the capital of France?"), chat("Name three colours of the rainbow, please.")
    first = engine.generate([GenerationRequest("a", p1, 12), GenerationRequest("b", p2, 12)])
    follow = tokenizer("\n<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n",
                       add_special_tokens=False)["input_ids"]
    p1b = p1 + first[0].token_ids + follow
    second = engine.generate([GenerationRequest("a", p1b, 12), GenerationRequest("c", p2, 12)])
    for ids, completion in [(p1, first[0]), (p2, first[1]), (p1b, second[0]), (p2, second[1])]:
        assert completion.token_ids == reference(ids, 12)[: len(completion.token_ids)]
    assert json.dumps(first[0].text)  # decodes to text
    # transformers' own growing cache gives the same tokens and log-probs as our per-turn buffers
    grown = TransformersEngine(model, tokenizer, temperature=0, batch_size=4, preallocate_cache=False)
    again = grown.generate([GenerationRequest("a", p1, 12), GenerationRequest("b", p2, 12)])
    again += grown.generate([GenerationRequest("a", p1b, 12), GenerationRequest("c", p2, 12)])
    for ours, theirs in zip(first + second, again):
        assert ours.token_ids == theirs.token_ids
        assert ours.logprobs == pytest.approx(theirs.logprobs, abs=1e-5)


def test_buffer_cache_layer_equals_a_growing_cache_and_grows_past_its_capacity():
    from transformers.cache_utils import DynamicLayer

    from rollout.kv_buffer import buffer_cache, padded_buffer_cache

    torch.manual_seed(0)
    prefix = [(torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4))]
    rows = [[(prefix[0][0][b : b + 1], prefix[0][1][b : b + 1])] for b in range(2)]
    ours, theirs = padded_buffer_cache(8, rows, [5, 5]), DynamicLayer()
    theirs.update(*prefix[0])
    for n in (3, 1, 1, 4):  # 5 + 3 + 1 = 9 > 8 already: the buffer grows, twice the size
        k, v = torch.randn(2, 3, n, 4), torch.randn(2, 3, n, 4)
        got, want = ours.layers[0].update(k, v), theirs.update(k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert ours.get_seq_length() == 14 and ours.layers[0]._keys.shape[2] >= 14
    empty = buffer_cache(6)  # no prefix: layers appear as the model writes them
    empty.update(torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4), 0)
    assert empty.get_seq_length() == 2 and empty.layers[0]._keys.shape[2] == 6


def test_padded_buffer_cache_left_pads_each_row_and_takes_the_rows_over():
    from rollout.kv_buffer import padded_buffer_cache

    torch.manual_seed(0)
    long_row = [(torch.randn(1, 3, 5, 4), torch.randn(1, 3, 5, 4)) for _ in range(2)]  # two layers
    short_row = [(torch.randn(1, 3, 2, 4), torch.randn(1, 3, 2, 4)) for _ in range(2)]
    want = [[t.clone() for t in layer] for layer in long_row], [[t.clone() for t in layer] for layer in short_row]
    cache = padded_buffer_cache(9, [short_row, None, long_row], [2, 0, 5])
    for li, layer in enumerate(cache.layers):
        assert layer.keys.shape == (3, 3, 5, 4) and layer._keys.shape[2] == 9  # prefix 5, room for 4 more
        assert torch.equal(layer.keys[2], want[0][li][0][0]) and torch.equal(layer.values[2], want[0][li][1][0])
        assert torch.equal(layer.keys[0, :, 3:], want[1][li][0][0]) and not layer.keys[0, :, :3].any()
        assert not layer.keys[1].any() and not layer.values[1].any()  # a row without a cache: all padding
    assert long_row == [None, None] and short_row == [None, None]  # copied in, then released
    cache.layers[0].update(torch.ones(3, 3, 1, 4), torch.ones(3, 3, 1, 4))
    assert cache.layers[0].keys.shape[2] == 6


# A compact template in Qwen's shape: tool schemas rendered by the template from `tools=`,
# tool observations sent as a user turn wrapped in <tool_response>.
QWEN_STYLE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}<|im_start|>user\n{{ message.content }}<|im_end|>\n"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content }}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_template_with_tools_renders_schemas_and_tool_responses(alfworld_data, smol_tokenizer):
    import copy

    tokenizer = copy.deepcopy(smol_tokenizer)
    tokenizer.chat_template = QWEN_STYLE_TEMPLATE
    cfg = load_config(None, [f"env.data_dir={alfworld_data}"])
    renderer = make_renderer(tokenizer, cfg)
    assert renderer.template_has_tools
    look = '<tool_call>{"name": "execute_action", "arguments": {"action": "look"}}</tool_call>'
    engine = ScriptedEngine(tokenizer, {"e": [look, look]})
    with InlineEnvs() as envs:
        (traj,) = run_episodes([("e", str(resolve_game("valid_seen:0", alfworld_data)))], engine, envs, renderer, cfg)
    check_alignment(traj, renderer)
    seg = traj.segments[0]
    prompt = renderer.decode(seg.prompt_ids)
    assert '"name": "CompressExperience"' in prompt and "Tools (name" not in prompt  # the template's rendering
    body = renderer.decode(seg.completion_ids)
    assert "<|im_start|>user\n<tool_response>\nYou are in the middle of a room" in body
    assert traj.steps[-1].working_tokens == len(seg.prompt_ids) + len(seg.completion_ids) - traj_header(renderer, seg)


def traj_header(renderer, seg):
    """Tokens of [system, task] without the generation prompt: the part W does not count."""
    gen = renderer.encode("<|im_start|>assistant\n")
    return len(seg.prompt_ids) - len(gen)


def test_a_bf16_engine_generates_from_its_copy_and_follows_every_sync(smol_policy):
    """rollout.dtype=bfloat16: a bf16 copy of the float32 policy generates what a bf16 model generates, and an
    update of the trained weights reaches the copy at sync_weights (the in-process engine shares nothing else)."""
    model, tokenizer = smol_policy
    engine = TransformersEngine(model, tokenizer, temperature=0, batch_size=2, dtype=torch.bfloat16)
    assert engine.model is not model and next(engine.model.parameters()).dtype == torch.bfloat16
    assert next(model.parameters()).dtype == torch.float32  # the trained module is untouched
    ids = tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    (got,) = engine.generate([GenerationRequest("a", ids, 8)])
    reference = copy.deepcopy(model).to(torch.bfloat16)
    expected = reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    assert got.token_ids == expected[: len(got.token_ids)]
    head = model.get_output_embeddings().weight
    original = head.detach().clone()
    try:
        with torch.no_grad():
            head.mul_(-1.0)  # an "update" the copy must see
        engine.sync_weights(model)
        mirrored = engine.model.get_output_embeddings().weight
        assert torch.equal(mirrored, head.detach().to(torch.bfloat16))
        (after,) = engine.generate([GenerationRequest("b", ids, 8)])
        assert after.token_ids != got.token_ids
    finally:
        with torch.no_grad():
            head.copy_(original)


def test_a_lora_policys_rollout_copy_merges_the_adapters_and_follows_every_sync(smol_policy):
    """A LoRA policy generating in another dtype: the engine's copy is a plain model whose weights are W + s B A
    (no adapter modules to run per token), computes what the adapter model computes, and follows the trained
    adapter at each sync_weights."""
    from peft import get_peft_model

    from modeling.lora import lora_config

    model, tokenizer = smol_policy
    policy = get_peft_model(copy.deepcopy(model), lora_config(model, 8, 16, 0.0, "auto"))
    torch.manual_seed(0)

    def train_adapter():  # stand-in for an optimizer step: every lora_B leaves zero
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn_like(p) * 0.02)

    train_adapter()
    engine = TransformersEngine(policy, tokenizer, temperature=0, batch_size=2, dtype=torch.float64)
    assert not any("lora" in name for name, _ in engine.model.named_parameters())
    ids = torch.tensor([tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]])

    def same_function():
        with torch.no_grad():
            want = policy(input_ids=ids).logits.double()
            got = engine.model(input_ids=ids).logits
        return torch.allclose(got, want, atol=2e-3, rtol=0)

    assert same_function()
    train_adapter()  # the copy is stale until the sync
    assert not same_function()
    engine.sync_weights(policy)
    assert same_function()
    assert engine.model.get_output_embeddings().weight.dtype == torch.float64  # the engine's dtype, not the policy's
