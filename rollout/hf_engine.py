"""The transformers engine: batched sampling with a KV cache kept per episode across turns.

Why a per-episode cache: on a CPU, SmolLM2-135M generates ~40 tokens/s at batch 16 with a
445-token prompt; re-prefilling a context that grows every turn would dominate rollout time.
Each episode keeps the keys/values of every token it has already processed; a turn prefills
only the new tokens (the observation), unless the context was rewritten (a compression starts
a new segment: the cached ids are no longer a prefix, so the cache is dropped).

Batching rows with different cached and new lengths: row i is laid out as
    [pad * (C - c_i) | cached_i (c_i) | pad * (N - n_i) | new_i (n_i) | generated ...]
with C = max c_i and N = max n_i. Pads are masked out of attention, and position ids are the
row's own positions, so each row computes exactly what it would alone.

Log-probs are the model's raw log-probs (temperature 1, before top-k/top-p) of the sampled
tokens, the quantity the trainer recomputes (vLLM's default `raw_logprobs` reports the same).

`dtype` (rollout.dtype): generate with a copy of the model in another dtype, e.g. bfloat16 on a
CPU with AVX-512 BF16 while the trainer updates float32 weights (measured in `memexrl bench
rollout`). `sync_weights` copies the trained weights into it after each update; the trainer's
recomputed log-probs and the TIS ratio correct for the engine's rounding, as they do for vLLM's.
A LoRA policy's copy is a plain model with each adapter merged into its base weight (W + s B A,
recomputed at every sync) instead of running PEFT's adapter modules at every token: the demo's GRPO
rollouts took 113 s against 148 s on the same tokens (bfloat16, 2 cores with AMX; docs/benchmarks.md
"`make demo`'s levers", and the `bf16 lora` rows of `memexrl bench rollout`). A bfloat16 copy on a CPU with native bfloat16
computes its linears from weights prepacked for oneDNN (rollout/packed_linear.py), repacked at
every sync.
"""

from __future__ import annotations

import copy
import inspect

import torch

from common.engine import Completion, Engine, GenerationRequest
from rollout.kv_buffer import KV, buffer_cache, padded_buffer_cache
from rollout.packed_linear import can_pack, pack_linears, repack

# KV (rollout/kv_buffer.py): per layer keys, values, each (1, H, L, D) for one episode


def _cache_to_tensors(cache) -> KV:
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))  # transformers < 4.56


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, generator) -> torch.Tensor:
    """Sample one token per row from (B, V) logits: greedy when temperature == 0."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    scores = logits / temperature  # (B, V)
    if top_k > 0:
        kth = torch.topk(scores, min(top_k, scores.size(-1)), dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True, dim=-1)
        probs = sorted_scores.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs > top_p  # keep the smallest prefix with mass >= top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, sorted_scores)
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def lora_layers(model) -> dict:
    """{module name in the base model: PEFT LoRA layer} of a PeftModel whose adapters can be merged into a plain
    copy; {} for any other model, and for one with parametrized weights (fake-quant, modeling/quantize.py), whose
    copy keeps the adapters as they are."""
    from torch.nn.utils import parametrize

    if not hasattr(model, "get_base_model") or any(parametrize.is_parametrized(m) for m in model.modules()):
        return {}
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.get_base_model().named_modules() if isinstance(m, LoraLayer)}


def rollout_copy(model, dtype: torch.dtype, merge_lora: bool = True, pack_batch: int = 0):
    """A frozen copy of `model` in `dtype` for generation: a LoRA policy's adapters merged into its weights
    (`lora_layers`; merge_lora=False keeps them, as `memexrl bench rollout` compares); otherwise the module as it
    is (adapters and fake-quant parametrizations included). pack_batch > 0: bfloat16 linears prepacked for oneDNN
    for batches of about that many rows, where the CPU computes bfloat16 natively (rollout/packed_linear.py)."""
    clone = copy.deepcopy(model)
    if merge_lora and lora_layers(model):
        clone = clone.merge_and_unload()  # merged in the trained dtype, then cast
    clone = clone.to(dtype).eval()
    clone.requires_grad_(False)
    if pack_batch > 0 and can_pack(clone, dtype):
        pack_linears(clone, pack_batch)
    return clone


@torch.no_grad()
def copy_weights(source, target) -> None:
    """The values of `source`'s parameters and buffers into `target`'s, cast to its dtype: the same structure, or
    (a `rollout_copy` with merged adapters) each LoRA layer's base weight plus its active adapters' delta."""
    layers = lora_layers(source) if not lora_layers(target) else {}
    if not layers:
        for dst, src in zip(target.state_dict(keep_vars=True).values(), source.state_dict(keep_vars=True).values()):
            dst.copy_(src)
        return
    into = target.state_dict(keep_vars=True)
    for name, layer in layers.items():
        delta = sum(layer.get_delta_weight(a) for a in layer.active_adapters if a in layer.lora_A)
        into[f"{name}.weight"].copy_(layer.get_base_layer().weight + delta)
    merged = {f"{name}.base_layer.weight" for name in layers}
    for name, value in source.get_base_model().state_dict(keep_vars=True).items():
        if "lora_" not in name and name not in merged:
            into[name.replace(".base_layer.", ".")].copy_(value)


class TransformersEngine(Engine):
    """Batched generation with a transformers causal LM and per-episode KV caches."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        batch_size: int = 16,
        seed: int = 0,
        reuse_cache: bool = True,
        preallocate_cache: bool = True,
        dtype: torch.dtype | None = None,
        merge_lora: bool = True,
        pack_weights: bool = True,
    ):
        self.source = model  # the trained module
        same = dtype in (None, next(model.parameters()).dtype)
        self.model = model if same else rollout_copy(model, dtype, merge_lora, batch_size if pack_weights else 0)
        self.tokenizer = tokenizer
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.batch_size = batch_size
        self.reuse_cache = reuse_cache
        self.preallocate_cache = preallocate_cache  # False: transformers' DynamicCache (grows by torch.cat)
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.eos_ids = {tokenizer.eos_token_id}
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self._cache: dict[str, tuple[list[int], KV]] = {}
        # transformers >= 5.2x names the cache argument `cache` (older: `past_key_values`).
        # A PeftModel's forward takes **kwargs: look at the model it wraps.
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        params = inspect.signature(base.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self.prefill_tokens = 0  # tokens actually run through the model as prompt (for benches)
        self.generated_tokens = 0
        self.engine_steps = 0  # forward passes (a prefill, then one per generated position of the batch)

    def reseed(self, seed: int) -> None:
        self.generator.manual_seed(seed)

    def sync_weights(self, model: object = None) -> None:
        """Generate with `model`'s weights from now on: the module itself, or copied into the engine's own copy
        in its dtype. Cached keys are stale either way."""
        if model is not None:
            if self.model is self.source:
                self.model = model
            self.source = model
        if self.model is not self.source:
            copy_weights(self.source, self.model)
            repack(self.model)
        self._cache.clear()

    def release(self, episode_id: str) -> None:
        self._cache.pop(episode_id, None)

    def counters(self) -> dict[str, float]:
        return {"generated_tokens": float(self.generated_tokens), "prompt_tokens": float(self.prefill_tokens),
                "engine_steps": float(self.engine_steps)}

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        """Completions in the order of `requests`; batches hold prompts of similar length (less padding)."""
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids))
        out: list[Completion | None] = [None] * len(requests)
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            for i, completion in zip(batch, self._generate_batch([requests[i] for i in batch])):
                out[i] = completion
        return out  # type: ignore[return-value]

    def _take_reusable(self, req: GenerationRequest) -> tuple[int, KV | None]:
        """The episode's cached prefix, handed over (removed from the store: the turn stores a new one)."""
        cached = self._cache.pop(req.episode_id, None) if self.reuse_cache else None
        if cached is None:
            return 0, None
        ids, kv = cached
        if len(ids) < len(req.prompt_ids) and req.prompt_ids[: len(ids)] == ids:
            return len(ids), kv
        return 0, None  # context rewritten (new segment): start over

    @torch.no_grad()
    def _generate_batch(self, requests: list[GenerationRequest]) -> list[Completion]:
        reuse = [self._take_reusable(r) for r in requests]
        cached_len = [c for c, _ in reuse]
        new = [r.prompt_ids[c:] for r, c in zip(requests, cached_len)]
        B, C, N = len(requests), max(cached_len), max(len(n) for n in new)
        dev = self.device

        input_ids = torch.full((B, N), self.pad_id, dtype=torch.long, device=dev)
        attention = torch.zeros((B, C + N), dtype=torch.long, device=dev)
        positions = torch.zeros((B, N), dtype=torch.long, device=dev)
        for i, (c, ids) in enumerate(zip(cached_len, new)):
            n = len(ids)
            input_ids[i, N - n :] = torch.tensor(ids, device=dev)
            attention[i, C - c : C] = 1
            attention[i, C + N - n :] = 1
            positions[i, N - n :] = torch.arange(c, c + n, device=dev)
        self.prefill_tokens += sum(len(n) for n in new)

        limits = [r.max_new_tokens for r in requests]
        # one buffer per layer for the whole turn (rollout/kv_buffer.py): no copy of the cache per token
        capacity = C + N + max(0, *limits)
        if self.preallocate_cache:
            past = padded_buffer_cache(capacity, [kv for _, kv in reuse], cached_len) if C else buffer_cache(capacity)
        else:
            from transformers import DynamicCache

            prefix = self._batch_cache(reuse, C) if C > 0 else None
            past = DynamicCache(ddp_cache_data=prefix) if prefix else DynamicCache()
        del reuse  # the old caches are in `past` now: the store keeps none of them
        generated: list[list[int]] = [[] for _ in range(B)]
        logprobs: list[list[float]] = [[] for _ in range(B)]
        finished = [lim <= 0 for lim in limits]
        next_pos = torch.tensor([c + len(n) for c, n in zip(cached_len, new)], device=dev)
        step_ids, step_pos = input_ids, positions
        while not all(finished):
            result = self.model(
                input_ids=step_ids,
                attention_mask=attention,
                position_ids=step_pos,
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_arg: past},
            )
            self.engine_steps += 1
            past = result["cache"] if "cache" in result else result["past_key_values"]
            logits = result.logits[:, -1, :].float()  # (B, V)
            tokens = sample_next(logits, self.temperature, self.top_p, self.top_k, self.generator)
            token_logprobs = logits.log_softmax(dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
            for i in range(B):
                if finished[i]:
                    continue
                tok = int(tokens[i])
                generated[i].append(tok)
                logprobs[i].append(float(token_logprobs[i]))
                if tok in self.eos_ids or len(generated[i]) >= limits[i]:
                    finished[i] = True
            if all(finished):
                break
            # Feed each live row its token; finished rows get a masked pad.
            live = torch.tensor([not f for f in finished], dtype=torch.long, device=dev)
            step_ids = torch.where(live.bool(), tokens, torch.full_like(tokens, self.pad_id))[:, None]
            step_pos = next_pos[:, None].clone()
            next_pos = next_pos + live
            attention = torch.cat([attention, live[:, None]], dim=1)
        self.generated_tokens += sum(len(g) for g in generated)

        completions = []
        # the cache holds this turn's prompt only if the model ran (a request with no tokens left skips it)
        kv = _cache_to_tensors(past) if any(limit > 0 for limit in limits) else None
        for i, req in enumerate(requests):
            ids = generated[i]
            if kv is not None and self.reuse_cache:
                keep = attention[i].bool()
                # The cache holds the prompt and every generated token but the last (never fed).
                self._cache[req.episode_id] = (
                    list(req.prompt_ids) + ids[:-1],
                    [(k[i : i + 1, :, keep[: k.size(2)]], v[i : i + 1, :, keep[: v.size(2)]]) for k, v in kv],
                )
            reason = "stop" if ids and ids[-1] in self.eos_ids else "length"
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            completions.append(Completion(text=text, token_ids=ids, logprobs=logprobs[i], finish_reason=reason))
        return completions

    def _batch_cache(self, reuse: list[tuple[int, KV | None]], C: int) -> KV:
        """Left-pad each row's cached keys/values to C and stack the rows: [(keys, values)] per layer."""
        template = next(kv for _, kv in reuse if kv is not None)

        def left_pad(t: torch.Tensor, length: int) -> torch.Tensor:  # (1, H, length, D) -> (1, H, C, D)
            return torch.cat([t.new_zeros(1, t.shape[1], C - length, t.shape[3]), t], dim=2)

        layers = []
        for li, (k0, v0) in enumerate(template):
            ks = [left_pad(kv[li][0] if kv else k0[:, :, :0], c) for c, kv in reuse]
            vs = [left_pad(kv[li][1] if kv else v0[:, :, :0], c) for c, kv in reuse]
            layers.append((torch.cat(ks, dim=0), torch.cat(vs, dim=0)))  # (B, H, C, D)
        return layers
