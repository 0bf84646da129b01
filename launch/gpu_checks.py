"""The checks of launch/gpu_check.py that prove the GPU path, not only its plumbing. Each gives one PASS/FAIL line.

(a) INT4 consistency: on tokens vLLM sampled after training, vLLM's log-probs against the trainer's (LoRA on
    the INT4 fake-quantised base): the mean absolute difference must stay under INT4_BOUND and under half of
    what the trainer's log-probs change when the base is the bf16 one instead of its INT4 fake-quant (the
    difference the fake-quant exists to remove; printed beside it).
(b) adapter sync: on the same tokens, vLLM's log-probs must be closer to the trainer's after the update than
    to the trainer's before it (the starting adapter, kept at the engine's start), by a factor of 2, and the
    update must have moved the trainer's log-probs at all: vLLM serves the new adapter, not the old one.
(c) peak memory: the device peak (nvidia-smi, every process) against the `--dry-run` budget of the same
    config on this GPU (memexrl/gpu_budget.py), within PEAK_MARGIN.
(d) per-rank devices (more than one GPU visible): two ranks (torchrun), each with its colocated engine
    (vLLM's external launcher); each rank's own GPU must hold its engine (launch/gpu_check_ranks.py).

On `--cpu-smoke` (a) and (b) run on the transformers engine, whose log-probs are the trained module's own:
the plumbing of the check, not INT4 kernels; (c) and (d) need a GPU and are reported as skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

INT4_BOUND = 0.05  # mean |vLLM - trainer| of sampled tokens' log-probs, nats (bf16 kernels on both sides)
SYNC_FACTOR = 2.0
PEAK_MARGIN = 1.15
PROBE_TEXT = ("You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a countertop 1 "
              "and a drawer 1. Your task is to: put a clean mug in the coffeemachine.")


def adapter_state(model) -> dict:
    """A copy of the LoRA adapter's weights (to compute the trainer's log-probs before the update later)."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def probe_tokens(engine, tokenizer, n: int = 4, max_new_tokens: int = 48) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt ids, sampled ids, engine log-probs) of `n` sampled completions of one prompt."""
    from common.engine import GenerationRequest

    prompt = tokenizer(PROBE_TEXT)["input_ids"]
    engine.reseed(12345)
    outs = engine.generate([GenerationRequest(f"probe{i}", prompt, max_new_tokens) for i in range(n)])
    return [(prompt, c.token_ids, c.logprobs) for c in outs if c.token_ids]


def trainer_logprobs(model, probes, device) -> list[list[float]]:
    """The module's log-probs of each probe's sampled tokens (the trainer's own code: batching.fill_logprobs)."""
    from training.batching import SegmentSample, fill_logprobs

    samples = [SegmentSample(prompt + ids, [0] * len(prompt) + [1] * len(ids), [0.0] * (len(prompt) + len(ids)),
                             0.0, 0.0, 0) for prompt, ids, _ in probes]
    model.eval()
    fill_logprobs(model, samples, 1, 0, device, "old_logprobs")
    return [s.old_logprobs[len(prompt) - 1:] for s, (prompt, _, _) in zip(samples, probes)]


def mean_abs(a: list[list[float]], b: list[list[float]]) -> float:
    pairs = [(x, y) for xs, ys in zip(a, b) for x, y in zip(xs, ys)]
    return sum(abs(x - y) for x, y in pairs) / max(len(pairs), 1)


def swapped_adapter(model, state: dict):
    """Context: the module computes with `state` as its adapter, then gets its own back."""
    import contextlib

    import torch

    @contextlib.contextmanager
    def swap():
        params = dict(model.named_parameters())
        current = {n: params[n].detach().clone() for n in state}
        with torch.no_grad():
            for n, v in state.items():
                params[n].copy_(v)
        try:
            yield
        finally:
            with torch.no_grad():
                for n, v in current.items():
                    params[n].copy_(v)

    return swap()


def bf16_base_logprobs(model_dir: str, probes, device, dtype) -> list[list[float]]:
    """Log-probs of the unquantised base (no adapter, no fake-quant) on the probes: the INT4 effect's yardstick."""
    import torch
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    try:
        return trainer_logprobs(base, probes, device)
    finally:
        del base
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def consistency_checks(engine, policy, start_adapter: dict, model_dir: str, device, dtype) -> list[dict]:
    """(a) and (b), after training: one row each {check, ok, note, values}."""
    probes = probe_tokens(engine, policy.tokenizer)
    if not probes:
        return [{"check": c, "ok": False, "note": "the engine sampled no token"} for c in ("int4", "sync")]
    engine_lp = [lp for _, _, lp in probes]
    model = policy.model
    new = trainer_logprobs(model, probes, device)
    with swapped_adapter(model, start_adapter):
        old = trainer_logprobs(model, probes, device)
    with policy.reference_context():  # adapter off: the INT4 fake-quant base alone
        int4_base = trainer_logprobs(model, probes, device)
    bf16_base = bf16_base_logprobs(model_dir, probes, device, dtype)
    diff, quant_effect = mean_abs(engine_lp, new), mean_abs(bf16_base, int4_base)
    to_old, moved = mean_abs(engine_lp, old), mean_abs(new, old)
    tokens = sum(len(ids) for _, ids, _ in probes)
    int4_ok = diff <= INT4_BOUND and diff <= quant_effect / 2
    sync_ok = moved > 0 and diff * SYNC_FACTOR <= to_old
    return [
        {"check": "int4", "ok": int4_ok, "values": {"engine_vs_trainer": diff, "bf16_vs_int4": quant_effect},
         "note": f"mean |engine - trainer| {diff:.4f} nats over {tokens} sampled tokens (bound {INT4_BOUND}); "
                 f"unquantised base vs its INT4 fake-quant {quant_effect:.4f} (must be >= 2x the former)"},
        {"check": "sync", "ok": sync_ok, "values": {"engine_vs_new": diff, "engine_vs_old": to_old, "update": moved},
         "note": f"engine vs trainer after the update {diff:.4f}, vs before it {to_old:.4f} (must be >= "
                 f"{SYNC_FACTOR:g}x); the update moved the trainer's log-probs by {moved:.4f}"},
    ]


def peak_check(cfg, device_peak_gib: float | None, gpu_gib: float | None) -> dict:
    """(c): the measured device peak against the dry-run's budget for this config and GPU."""
    from memexrl.plan import make_plan, model_numbers

    if device_peak_gib is None or gpu_gib is None:
        return {"check": "memory", "ok": None, "note": "skipped: no nvidia-smi / GPU"}
    plan = make_plan(cfg, 1, "gpu-check", numbers=model_numbers(cfg), gpu_gib=gpu_gib)
    planned = plan.budget.peak / 1024**3
    ok = device_peak_gib <= planned * PEAK_MARGIN
    return {"check": "memory", "ok": ok, "values": {"device_peak_gib": device_peak_gib, "planned_gib": planned},
            "note": f"device peak {device_peak_gib:.1f} GiB vs the dry-run's {planned:.1f} GiB (at most "
                    f"{PEAK_MARGIN:g}x), of {gpu_gib:.0f} GiB"}


def ranks_check(int4_dir: Path, workdir: Path, repo: Path, timeout: int = 300) -> dict:
    """(d): two ranks under torchrun, each with its colocated engine; each GPU must hold its own rank's engine."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return {"check": "ranks", "ok": None, "note": "skipped: one GPU visible"}
    out = workdir / "ranks"
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
           str(repo / "launch" / "gpu_check_ranks.py"), str(int4_dir), str(out)]
    done = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        return {"check": "ranks", "ok": False, "note": f"torchrun failed: {(done.stderr or done.stdout)[-300:]}"}
    rows = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    ok = all(r["used_gib"] >= 0.5 * r["expected_gib"] for r in rows) and rows[0]["device"] != rows[1]["device"]
    note = "; ".join(f"rank {r['rank']}: cuda:{r['device']} +{r['used_gib']:.1f} GiB (engine's share "
                     f"{r['expected_gib']:.1f})" for r in rows)
    return {"check": "ranks", "ok": ok, "values": rows, "note": note}


class GpuMemorySampler:
    """`nvidia-smi --query-gpu=memory.used -l 1` in the background: the device's peak, every process."""

    def __init__(self) -> None:
        self.peak_mib = 0
        self.proc = None
        gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip() or "0"
        if not shutil.which("nvidia-smi"):
            return
        cmd = ["nvidia-smi", f"--id={gpu}", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-l", "1"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.strip().isdigit():
                self.peak_mib = max(self.peak_mib, int(line.strip()))

    def stop(self) -> float | None:
        """Peak device memory used in GiB (None without nvidia-smi)."""
        if self.proc is None:
            return None
        time.sleep(1.2)  # one more sample
        self.proc.terminate()
        self.proc.wait(timeout=10)
        return self.peak_mib / 1024
