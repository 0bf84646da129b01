"""Two training processes on the CPU (gloo) under DeepSpeed ZeRO-2, ZeRO-3 and ZeRO-3 with the optimizer states
offloaded (configs/accelerate/zero3-offload-8gpu.yaml): what an 8-GPU launch relies on.

Each test launches real ranks (tests/ranks.py, tests/rank_worker.py) and checks them against one plain
process computing the same thing:
- ranks holding different numbers of segments (2 and 4) get their old / reference log-probs and take an
  optimizer step together: ZeRO-3's forwards are collectives, so without the padding forwards of
  `lockstep_micro_batches` the rank with fewer segments waits forever (the launch times out);
- the log-probs are those of one process, and the step's gradient norm that of the two ranks' average;
- under ZeRO-3 the weights are partitioned when the model is loaded, and INT4 fake-quant still covers
  every weight it covers in one process (the forward really uses the INT4 weights);
- the full-weight sync to vLLM gathers the ZeRO-3 shards into exactly the INT4 checkpoint, on every rank;
- the trainer itself runs a GRPO step on 2 ranks (full fine-tuning, fake-quant, ZeRO-3).
"""

from __future__ import annotations

import json

import pytest
import torch
from rank_worker import fake_quant_count, segment_samples
from ranks import launch_ranks
from safetensors import safe_open
from safetensors.torch import load_file

from common.config import load_config
from modeling.quantize import quantize_checkpoint
from training.batching import fill_logprobs
from training.policy import load_policy_for_grpo

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.slow

FAKE_QUANT = 32  # divides the tiny Qwen3-MoE's hidden size 64


def overrides(model: str, run_dir, **extra) -> list[str]:
    base = {"model.name": model, "model.device": "cpu", "train.finetune": "full", "train.init_checkpoint": "",
            "train.output_dir": str(run_dir), "train.tasks_per_step": 2, "train.group_size": 4,
            "train.global_batch_size": 8, "train.micro_batch_size": 1, "train.num_games": 2, "train.wandb": False,
            "train.recompute_old_logprobs": True, "train.kl_coef": 0.001, "train.learning_rate": 1e-4,
            "train.max_grad_norm": 1.0}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def single_process(args: list[str]):
    """What one plain process computes on both ranks' segments: log-probs per rank, the averaged step's grad norm."""
    from accelerate import Accelerator

    from common.seeding import seed_everything
    from training.trainer import make_optimizer
    from training.update import pad_id, update_policy

    torch.set_num_threads(1)
    cfg = load_config("configs/tiny-cpu.yaml", args)
    seed_everything(cfg.seed)  # as the trainer does before building the policy: the same LoRA initialisation
    policy = load_policy_for_grpo(cfg)
    pad, per_rank = pad_id(policy.tokenizer), []
    for rank in range(2):
        samples = segment_samples(rank, 2 + 2 * rank)
        fill_logprobs(policy.model, samples, 1, pad, "cpu", "old_logprobs")
        with policy.reference_context():
            fill_logprobs(policy.reference_module(), samples, 1, pad, "cpu", "ref_logprobs")
        per_rank.append(samples)
    every = [s for samples in per_rank for s in samples]
    for s in every:
        s.weight /= 2  # DeepSpeed averages the ranks' gradients
    acc = Accelerator(cpu=True)
    optimizer, scheduler = make_optimizer(policy, cfg)
    metrics = update_policy(model=policy.model, optimizer=optimizer, scheduler=scheduler, accelerator=acc,
                            samples_per_update=[every], train=cfg.train, pad_token_id=pad,
                            params=policy.trainable_parameters())
    return per_rank, metrics, fake_quant_count(policy.model)


@pytest.mark.parametrize("config,finetune,fake_quant", [
    ("zero2-8gpu.yaml", "full", 0), ("zero3-8gpu.yaml", "full", FAKE_QUANT), ("zero3-offload-8gpu.yaml", "full", 0),
    ("zero3-8gpu.yaml", "lora", FAKE_QUANT)])  # the last: paper-8gpu.sh MODE=lora on 80 GB GPUs
def test_ranks_with_unequal_segment_counts_step_together(config, finetune, fake_quant, tiny_eos_model, tmp_path,
                                                         alfworld_data):
    args = overrides(tiny_eos_model, tmp_path / "run", **{"train.fake_quant_group_size": fake_quant,
                                                          "train.finetune": finetune})
    launch_ranks(config, 2, ["tests/rank_worker.py", "lockstep", str(tmp_path), *args],
                 ALFWORLD_DATA=str(alfworld_data))
    records = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    stage = 3 if "zero3" in config else 2  # zero3-offload: the 8 x 80 GB config, optimizer states in host memory
    assert [(r["world"], r["zero_stage"]) for r in records] == [(2, stage), (2, stage)]
    assert [len(r["old"]) for r in records] == [2, 4]  # different segment counts, and both ranks finished

    expected, plain, plain_fake_quant = single_process(args)
    for r in records:
        for got, want in zip(r["old"], expected[r["rank"]]):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want.old_logprobs), rtol=1e-4, atol=1e-5)
        for got, want in zip(r["ref"], expected[r["rank"]]):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want.ref_logprobs), rtol=1e-4, atol=1e-5)
        assert r["metrics"]["num_updates"] == 1
        assert r["metrics"]["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-4)  # padding passes add nothing
    assert records[0]["fake_quant"] == records[1]["fake_quant"] == plain_fake_quant
    if fake_quant:  # the forward used the INT4 weights (LoRA: the frozen base replaced by them, no parametrization)
        assert plain_fake_quant == (12 if finetune == "full" else 0)  # q, k, v, o and the fused experts' 2, 2 layers
        unquantised = single_process(overrides(tiny_eos_model, tmp_path / "u", **{
            "train.fake_quant_group_size": 0, "train.finetune": finetune}))
        assert not torch.allclose(torch.tensor(records[0]["old"][0]),
                                  torch.tensor(unquantised[0][0][0].old_logprobs), atol=1e-3)


def test_full_weight_sync_gathers_zero3_shards_on_every_rank(tiny_eos_model, tmp_path, alfworld_data):
    """Path B: every rank sends the INT4 checkpoint of the (here untrained) weights, gathered from the shards."""
    int4 = quantize_checkpoint(tiny_eos_model, tmp_path / "int4", FAKE_QUANT).out_dir
    args = overrides(tiny_eos_model, tmp_path / "run", **{"train.fake_quant_group_size": FAKE_QUANT})
    launch_ranks("zero3-8gpu.yaml", 2, ["tests/rank_worker.py", "sync", str(tmp_path), str(int4), *args],
                 ALFWORLD_DATA=str(alfworld_data))
    expected = {}
    for shard in sorted(int4.glob("*.safetensors")):
        expected.update(load_file(str(shard)))
    for rank in range(2):
        path = tmp_path / f"rank-{rank}.safetensors"
        with safe_open(str(path), "pt") as f:
            assert int(f.metadata()["partitioned"]) > 0  # the weights really were sharded
            assert int(f.metadata()["fake_quant"]) == 12
        sent = load_file(str(path))
        assert sent.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(sent[name], tensor), (rank, name)


def test_trainer_runs_a_grpo_step_on_two_zero3_ranks(tiny_eos_model, tmp_path, alfworld_data):
    run_dir = tmp_path / "run"
    args = overrides(tiny_eos_model, run_dir, **{
        "train.fake_quant_group_size": FAKE_QUANT, "train.steps": 1, "train.save_steps": 1, "env.max_steps": 3,
        "env.num_workers": 1, "rollout.max_new_tokens": 24, "memory.threshold": 200, "train.max_episode_steps": 0,
        "train.num_games": 4})
    launch_ranks("zero3-8gpu.yaml", 2, ["-m", "memexrl.cli", "train", "--config", "configs/tiny-cpu.yaml", *args],
                 ALFWORLD_DATA=str(alfworld_data))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]
    assert records[0]["num_updates"] == 1
    assert (run_dir / "checkpoints" / "step-1" / "model.safetensors").is_file()


def test_a_preemption_notice_to_one_rank_stops_every_rank(tmp_path):
    """SIGUSR1 to rank 0 alone: after the all-reduce both ranks see the request, so all stop at the same step."""
    launch_ranks("zero2-8gpu.yaml", 2, ["tests/rank_worker.py", "stop", str(tmp_path)])
    answers = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert answers == [{"before": False, "after": True}] * 2
