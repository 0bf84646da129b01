"""The SFT loss through the model's own output layer where TRL's fused one is slow (`sft.output_head`).

TRL's SFTTrainer patches the model with a fused output layer (`trl.trainer.utils.add_fused_lm_head`): the
log-probs, entropy and top-1 flag of the labelled positions are computed in (tokens x vocabulary) tiles
without materialising the logits. On a GPU the tiles are folded by Triton kernels; on a CPU by a dozen torch
ops a tile, and the backward recomputes every tile and accumulates its gradient GEMMs in float32. Measured
on the demo's SFT (SmolLM2-135M, full fine-tuning, bfloat16 autocast, ~1,100-token segments, 2 threads, AMD
EPYC with AVX-512 BF16; cProfile of `memexrl sft`): the fused layer's forward and backward took 3.4 s of a
segment's 7.9 s, 43 % of the step, for a layer that holds ~21 % of the model's matmul FLOPs. The model's own
layer in its place: 4 such steps 67.6 -> 57.4 s (1.18x), the same losses; LoRA in float32 on one thread 1.55x
(docs/benchmarks.md, "Two CPU levers").

`PlainHeadSFTTrainer` is TRL's trainer with `compute_loss` through the model's own forward: the full logits
of the segment and transformers' causal-LM loss (the same token-sum over `num_items_in_batch`, so the same
loss and gradients as TRL's up to rounding), and the same two metrics TRL logs (`entropy` and
`mean_token_accuracy` over the labelled positions, computed without gradient). It holds the segment's
logits at once: (tokens x 49K) floats for SmolLM2, ~0.2 GB at 1,100 tokens, ~0.8 GB at 4,096.
"""

from __future__ import annotations

import torch

from training import grpo


def use_plain_head(choice: str, device: torch.device) -> bool:
    """sft.output_head resolved: 'auto' is the model's own output layer on a CPU, TRL's fused one elsewhere."""
    return choice == "plain" or (choice == "auto" and device.type == "cpu")


def label_statistics(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(labelled positions, summed entropy, correct top-1 predictions) of next-token `logits` (B, L, V) against
    `labels` (B, L), where -100 marks an unlabelled position (the causal shift is applied here)."""
    with torch.no_grad():
        targets = labels[:, 1:]
        mask = targets != -100
        logp_all = logits[:, :-1][mask].float().log_softmax(-1)  # (n, V)
        correct = logp_all.argmax(-1) == targets[mask]
        return mask.sum(), grpo.entropy(logp_all).sum(), correct.sum()


def plain_head_trainer(sft_trainer_class: type) -> type:
    """A subclass of TRL's `SFTTrainer` (passed in, so that this module does not import TRL) whose loss runs
    through the model's own output layer (module docstring)."""

    class PlainHeadSFTTrainer(sft_trainer_class):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            mode = "train" if self.model.training else "eval"
            outputs = model(**{**inputs, "use_cache": False}, num_items_in_batch=num_items_in_batch)
            loss = outputs.loss
            if self.args.average_tokens_across_devices and num_items_in_batch is not None:
                loss = loss * (self.accelerator.num_processes // self.get_tp_size())  # as TRL's: DDP averages ranks
            valid, entropy, correct = (self.accelerator.gather_for_metrics(x).sum()
                                       for x in label_statistics(outputs.logits, inputs["labels"]))
            metrics = self._metrics[mode]
            metrics["entropy"].append((entropy / valid).item() if valid > 0 else 0.0)
            metrics["mean_token_accuracy"].append((correct / valid).item() if valid > 0 else 0.0)
            if mode == "train":
                tokens = self.accelerator.gather_for_metrics(inputs["attention_mask"].sum()).sum().item()
                self._total_train_tokens += tokens // self._tp_size
            metrics["num_tokens"] = [self._total_train_tokens]
            return (loss, outputs) if return_outputs else loss

    return PlainHeadSFTTrainer
