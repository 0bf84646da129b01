"""One rank of tests/test_distributed.py, started by `accelerate launch --num_processes N` (tests/ranks.py).

    rank_worker.py lockstep OUT_DIR [section.key=value ...]
        training.trainer.Trainer on the config, then this rank's segments (rank r holds 2 + 2r of them, so
        the ranks hold different numbers, as when their trajectories compressed a different number of
        times) through the trainer's own old / reference log-probs and one optimizer step; writes
        OUT_DIR/rank-R.json: the log-probs, the update's metrics, the INT4 fake-quant parametrizations.
    rank_worker.py sync OUT_DIR INT4_DIR [section.key=value ...]
        Trainer as above (full fine-tuning, fake-quant, ZeRO-3: weights partitioned), then what the vLLM
        engine's full-weight sync sends (rollout/weights.py `checkpoint_state_dict` against INT4_DIR's
        layout), into OUT_DIR/rank-R.safetensors, with the number of partitioned tensors in its metadata.
    rank_worker.py stop OUT_DIR
        the preemption notice (common/preemption.py) on rank 0 alone: every rank asks `requested()` before and
        after it; writes OUT_DIR/rank-R.json with both answers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from training.batching import SegmentSample


def segment_samples(rank: int, count: int, vocab: int = 1000) -> list[SegmentSample]:
    """`count` segments of different lengths for `rank`: an 8-token prompt, then trained tokens."""
    gen = torch.Generator().manual_seed(1000 + rank)
    samples = []
    for i in range(count):
        length = 16 + 6 * i + 3 * rank
        ids = torch.randint(3, vocab, (length,), generator=gen).tolist()
        trained = length - 8
        samples.append(SegmentSample(
            input_ids=ids, loss_mask=[0] * 8 + [1] * trained, rollout_logprobs=[0.0] * 8 + [-2.0] * trained,
            advantage=1.0 if (i + rank) % 2 else -1.0, weight=1.0 / (8 * trained), trajectory=i))
    return samples


def trainer_for(overrides: list[str]):
    from common.config import load_config
    from training.trainer import Trainer

    torch.set_num_threads(1)
    return Trainer(load_config("configs/tiny-cpu.yaml", overrides))


def fake_quant_count(module) -> int:
    from modeling.quantize import FakeQuant

    return sum(isinstance(m, FakeQuant) for m in module.modules())


def lockstep(out_dir: Path, overrides: list[str]) -> None:
    trainer = trainer_for(overrides)
    acc = trainer.accelerator
    rank = acc.process_index
    samples = segment_samples(rank, 2 + 2 * rank)
    trainer.cfg.train.old_logprobs_from_update = False  # the separate old pass, whose lockstep this checks
    trainer.fill_logprobs([samples], {})
    metrics: dict = {}
    trainer.update([samples], metrics)
    record = {"rank": rank, "world": acc.num_processes, "zero_stage": trainer.zero_stage,
              "fake_quant": fake_quant_count(acc.unwrap_model(trainer.model)),
              "old": [s.old_logprobs for s in samples], "ref": [s.ref_logprobs for s in samples],
              "metrics": metrics}
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(record))


def sync(out_dir: Path, int4_dir: str, overrides: list[str]) -> None:
    from safetensors.torch import save_file

    from modeling.quantize import int4_layout
    from rollout.weights import checkpoint_state_dict

    trainer = trainer_for(overrides)
    module = trainer.accelerator.unwrap_model(trainer.model)
    empty = sum(p.numel() == 0 for p in module.parameters())
    state = checkpoint_state_dict(module, int4_layout(int4_dir))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / f"rank-{trainer.accelerator.process_index}"
                                                                  ".safetensors"),
              metadata={"partitioned": str(empty), "fake_quant": str(fake_quant_count(module))})


def stop(out_dir: Path) -> None:
    import os
    import signal

    from accelerate import Accelerator

    from common.preemption import stop_at_step_end

    acc = Accelerator(cpu=True)
    with stop_at_step_end() as request:
        before = request.requested()
        if acc.process_index == 0:
            os.kill(os.getpid(), signal.SIGUSR1)
        after = request.requested()
    (out_dir / f"rank-{acc.process_index}.json").write_text(json.dumps({"before": before, "after": after}))


if __name__ == "__main__":
    from common.collectives import end_process_group

    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "lockstep":
        lockstep(out, sys.argv[3:])
    elif mode == "sync":
        sync(out, sys.argv[3], sys.argv[4:])
    elif mode == "stop":
        stop(out)
    else:
        raise SystemExit(f"unknown mode {mode!r}: lockstep, sync or stop")
    end_process_group()  # as memexrl.cli does: exiting with a live process group can abort (common/collectives.py)
