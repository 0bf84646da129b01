"""`memexrl bench sync`: the full-weight INT4 sync to vLLM (path B), whole-model copy vs streamed.

A random Qwen3-MoE with the 30B model's layer kind (untied head, top-k experts fused by transformers 5)
at `--sync-hidden` width, under INT4 fake-quant (group 128), is synced as `VLLMEngine.sync_weights`
does it, into buckets (`--sync-bucket-mib`, 16: smaller than the model, as the sync's 256 MiB buckets are
beside the 30B model) that are dropped when "sent" (no vLLM needed: what is measured is what the
trainer's process does), two ways:

- whole: the earlier sync: every weight copied to host memory first (a dict of the whole model), then
  re-quantised tensor by tensor into INT4 and bucketed;
- streamed: rollout/weights.py `checkpoint_tensors`: one weight at a time, quantised where it lives,
  only its INT4 result copied to host memory, bucket by bucket.

Both produce the same tensors (checked). Reported: seconds per million parameters (the quantisation
runs on this CPU, one thread, in both: on a GPU the streamed path quantises on the GPU, not measured
here), the host memory the sync holds at once (bytes of the host tensors alive, counted exactly), and
the projection of both to Qwen3-30B-A3B's 30.53B parameters.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

QWEN3_30B_PARAMS = 30_532_122_624
QWEN3_LARGEST_WEIGHT = 151936 * 2048 * 2  # bytes of its largest tensor, the bf16 embedding (or lm_head)
BUCKET_GIB = 0.25  # rollout/weights.py BUCKET_BYTES


@dataclass
class SyncRun:
    variant: str
    seconds: float
    params: int
    held_bytes: int  # most bytes of host tensors alive at once
    sent_bytes: int


class AliveBytes:
    """Bytes of the tracked tensors still referenced, and the most at any time (weak references: no copy kept)."""

    def __init__(self) -> None:
        self.alive: dict[int, int] = {}
        self.peak = 0

    def track(self, tensor):
        key = id(tensor)
        self.alive[key] = tensor.numel() * tensor.element_size()
        weakref.finalize(tensor, self.alive.pop, key, None)
        self.peak = max(self.peak, sum(self.alive.values()))
        return tensor


def model_for_bench(hidden: int, layers: int, experts: int, vocab: int = 32768):
    """A random Qwen3-MoE of the 30B model's kind, under INT4 fake-quant group 128 (trainable, path B)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from modeling.quantize import apply_fake_quant

    config = Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                            moe_intermediate_size=hidden // 2, num_hidden_layers=layers, num_attention_heads=8,
                            num_key_value_heads=2, head_dim=hidden // 8, num_experts=experts, num_experts_per_tok=4,
                            tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    apply_fake_quant(model, 128)
    return model


def _whole(model, layout, tracker: AliveBytes):
    """The earlier sync: a host copy of every weight first (held until the sync ends), then re-quantised."""
    import copy

    from rollout.weights import checkpoint_tensors

    host = copy.deepcopy(model)  # on a GPU run: the gather of every weight into host memory
    for tensor in host.state_dict().values():
        tracker.track(tensor)
    for name, tensor in checkpoint_tensors(host, layout):
        yield name, tracker.track(tensor)
    del host


def _streamed(model, layout, tracker: AliveBytes):
    from rollout.weights import checkpoint_tensors

    for name, tensor in checkpoint_tensors(model, layout):
        yield name, tracker.track(tensor)


def sync_once(variant: str, model, layout, bucket_bytes: int) -> tuple[SyncRun, dict]:
    from rollout.weights import buckets

    tracker, digest, sent = AliveBytes(), {}, 0
    source = _whole if variant == "whole" else _streamed
    t0 = time.perf_counter()
    for bucket in buckets(source(model, layout, tracker), bucket_bytes):
        for name, t in bucket:
            tracker.track(t)
            sent += t.numel() * t.element_size()
            digest[name] = (tuple(t.shape), float(t.float().sum()))
        del bucket, name, t  # sent: nothing of it stays referenced while the next one is built
    seconds = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    return SyncRun(variant, seconds, params, tracker.peak, sent), digest


def bench_sync(hidden: int = 1024, layers: int = 4, experts: int = 16, bucket_mib: int = 16,
               vocab: int = 32768) -> list[SyncRun]:
    import torch

    from common.errors import MemexError
    from modeling.quantize import Int4Layout, is_quant_target
    from rollout.weights import checkpoint_tensors

    torch.set_num_threads(1)
    model = model_for_bench(hidden, layers, experts, vocab)
    names = {n.removesuffix(".weight") for n, t in checkpoint_tensors(model)
             if n.endswith(".weight") and t.dim() == 2 and is_quant_target(n, t.shape, 128)}
    layout = Int4Layout(128, frozenset(names))
    runs, digests = [], []
    for variant in ("whole", "streamed"):
        run, digest = sync_once(variant, model, layout, bucket_mib * 2**20)
        runs.append(run)
        digests.append(digest)
    if digests[0] != digests[1]:
        raise MemexError("bench sync: the two syncs sent different tensors")
    return runs


def format_bench_sync(runs: list[SyncRun], bucket_mib: int) -> str:
    whole, streamed = runs
    gib = 1024**3
    lines = [f"full-weight INT4 sync of a random Qwen3-MoE ({whole.params / 1e6:.0f}M params, bf16, fake-quant group "
             f"128), {bucket_mib} MiB buckets, one CPU thread; {whole.sent_bytes / gib:.2f} GiB sent, identical tensors; "
             f"30B projections with the sync's 256 MiB buckets"]
    bound = BUCKET_GIB + QWEN3_LARGEST_WEIGHT / gib
    for r in runs:
        rate = r.params / 1e6 / r.seconds
        host = r.held_bytes / r.params * QWEN3_30B_PARAMS / gib if r.variant == "whole" else bound
        lines.append(f"  {r.variant:<9} {r.seconds:7.2f} s  {rate:6.1f} Mparam/s  host memory held at once "
                     f"{r.held_bytes / gib:6.3f} GiB ({r.held_bytes / r.params:.2f} bytes/param); for 30.53B params: "
                     f"~{QWEN3_30B_PARAMS / 1e6 / rate / 60:.0f} min of quantisation on one CPU thread, "
                     f"{'~' if r.variant == 'whole' else '<= '}{host:.1f} GiB of host memory per process")
    lines.append(f"  streamed / whole: time {streamed.seconds / whole.seconds:.2f}x, host memory held "
                 f"{streamed.held_bytes / whole.held_bytes:.3f}x (the streamed sync holds one bucket and one weight: "
                 f"its host memory does not grow with the model)")
    return "\n".join(lines)
