"""`memexrl bench update`: the GRPO update's memory, with and without its two memory measures.

One micro-batch of `train.micro_batch_size` segments of `--segment-tokens` tokens (the first
quarter prompt, the rest trained) goes through `training/update.py`'s `update_policy` (log-probs
and entropy, the GRPO loss with KL and TIS, backward, clipping, an AdamW step), `--bench-steps`
times, with the config's policy (train.finetune, LoRA in configs/tiny-cpu.yaml; the base model, no
SFT checkpoint needed). Four variants (five with bfloat16), each in a fresh
process so that each starts from an untouched allocator:

- before: glibc's adaptive mmap threshold, the whole output layer at once (`head_chunk_size 0`);
- malloc 1 MiB: the threshold fixed at 1 MiB (common/malloc.py's first setting: the least memory, every
  activation a fresh mapping), the whole output layer;
- malloc: the threshold fixed at common/malloc.py's 16 MiB, the whole output layer;
- both: the threshold fixed and the output layer in slices of `train.head_chunk_size` positions
  (`batching.sequence_logprobs`): what `memexrl train` runs;
- both bf16: the same under `train.mixed_precision=bf16` (accelerate's bfloat16 autocast of the forward), on a CPU
  with native bfloat16 only (AVX-512 BF16 or AMX; modeling/load.cpu_has_native_bf16): its time ratio is what the
  setting buys a CPU run's update.

Each reports its peak resident memory (the child's `ru_maxrss`), the resident memory left after
the last step, and the seconds of its steps; the ratios are against "before". The token ids are
random: memory and time depend on the shapes alone.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, replace

from common.malloc import MMAP_THRESHOLD_BYTES

VARIANTS = {  # name: (glibc's fixed threshold in bytes or 0 (adaptive), head_chunk_size from the config or 0,
    # accelerate mixed precision)
    "before": (0, False, "no"),
    "malloc 1 MiB": (1 << 20, False, "no"),
    "malloc": (MMAP_THRESHOLD_BYTES, False, "no"),
    "both": (MMAP_THRESHOLD_BYTES, True, "no"),
    "both bf16": (MMAP_THRESHOLD_BYTES, True, "bf16"),  # only on a CPU with native bfloat16 (bench_update skips it elsewhere)
}


@dataclass
class UpdateRun:
    variant: str
    peak_gb: float
    after_gb: float
    seconds: float


def _rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def child(spec: dict) -> dict:
    """One variant in this (fresh) process: returns its peak and final RSS and the steps' seconds."""
    from common.malloc import return_freed_memory

    if spec["fix_malloc"]:
        return_freed_memory(spec["fix_malloc"])  # before torch allocates anything, as `memexrl` does
    import torch
    from accelerate import Accelerator

    torch.set_num_threads(1)
    torch.manual_seed(0)
    from common.config import load_config
    from training.batching import SegmentSample
    from training.policy import load_policy_for_grpo
    from training.trainer import make_optimizer
    from training.update import pad_id, update_policy

    cfg = load_config(spec["config"], spec["overrides"])
    chunk = cfg.train.head_chunk_size if spec["chunk_head"] else 0
    cfg = replace(cfg, model=replace(cfg.model, device="cpu"),
                  train=replace(cfg.train, init_checkpoint="", head_chunk_size=chunk))
    t = cfg.train
    acc = Accelerator(cpu=True, mixed_precision=spec["mixed_precision"])
    policy = load_policy_for_grpo(cfg)
    optimizer, scheduler = make_optimizer(policy, cfg)
    model, optimizer = acc.prepare(policy.model, optimizer)
    n, prompt = spec["tokens"], spec["tokens"] // 4
    samples = []
    for i in range(t.micro_batch_size):
        ids = torch.randint(100, len(policy.tokenizer) - 100, (n,)).tolist()
        lp = [0.0] * prompt + [-1.0] * (n - prompt)
        s = SegmentSample(ids, [0] * prompt + [1] * (n - prompt), lp, 1.0 if i % 2 else -1.0, 1.0 / (n - prompt), i)
        s.old_logprobs = s.ref_logprobs = lp[1:]
        samples.append(s)
    start = time.perf_counter()
    for _ in range(spec["steps"]):  # one optimizer step over the one micro-batch, as memexrl train's update
        update_policy(model=model, optimizer=optimizer, scheduler=scheduler, accelerator=acc, samples_per_update=[samples],
                      train=t, pad_token_id=pad_id(policy.tokenizer), params=policy.trainable_parameters())
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: KiB
    return {"peak_gb": peak, "after_gb": _rss_gb(), "seconds": seconds}


def bench_update(config: str | None, overrides: list[str], tokens: int, steps: int) -> list[UpdateRun]:
    """Run every variant in its own process, one after the other."""
    from eval.bench_trainer import DEFAULT_CONFIG
    from modeling.load import cpu_has_native_bf16

    runs = []
    for name, (fix_malloc, chunk_head, mixed_precision) in VARIANTS.items():
        if mixed_precision == "bf16" and not cpu_has_native_bf16():
            continue
        spec = {"config": config or DEFAULT_CONFIG, "overrides": overrides, "tokens": tokens, "steps": steps,
                "fix_malloc": fix_malloc, "chunk_head": chunk_head, "mixed_precision": mixed_precision}
        env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
        done = subprocess.run([sys.executable, "-m", "eval.bench_update", json.dumps(spec)], capture_output=True,
                              text=True, env={**env, "OMP_NUM_THREADS": "1"})
        if done.returncode != 0:
            from common.errors import MemexError

            raise MemexError(f"bench update: variant {name} failed (exit {done.returncode}): {done.stderr[-2000:]}")
        runs.append(UpdateRun(name, **json.loads(done.stdout.strip().splitlines()[-1])))
    return runs


def format_bench_update(runs: list[UpdateRun], tokens: int, batch: int) -> str:
    base = runs[0]
    lines = [f"GRPO update memory: one micro-batch of {batch} x {tokens} tokens, forward + backward + AdamW",
             "| variant | peak RSS GB | RSS after GB | seconds | peak vs before | time vs before |",
             "|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r.variant} | {r.peak_gb:.2f} | {r.after_gb:.2f} | {r.seconds:.1f} | "
                     f"{r.peak_gb / base.peak_gb:.2f}x | {r.seconds / base.seconds:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one variant of `memexrl bench update` (run by it)")
    parser.add_argument("spec", help="JSON: config, overrides, tokens, steps, fix_malloc (a threshold in bytes or 0), "
                        "chunk_head, mixed_precision")
    print(json.dumps(child(json.loads(parser.parse_args().spec))))
