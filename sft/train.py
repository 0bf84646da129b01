"""`memexrl sft`: the SFT warm start with TRL's SFTTrainer (memex.md "Training").

Assistant-only loss on the segments of successful Memex demonstrations (sft/dataset.py),
LoRA through PEFT or full fine-tuning, packing off. Runs on the CPU (`use_cpu`; float32, or bfloat16
autocast with `sft.bf16` where the CPU has native bfloat16; the loss through the model's own output layer,
`sft.output_head`, sft/output_head.py) and,
unchanged, on GPUs under `accelerate launch` / DeepSpeed (`sft.deepspeed`). Writes the run
directory of design.md: config.yaml (resolved), metrics.jsonl, checkpoints/step-N (adapter or
full model in HF format, written to a temp dir and renamed), wandb/ (offline unless logged in).

Resumable (`memexrl sft --resume`): every `sft.save_steps` the HF Trainer also writes its own
checkpoint (weights, optimizer, scheduler, RNG; the newest one only) to RUN/trainer/checkpoint-N;
a resumed run continues from the newest complete one (its trainer_state.json is written last) with
the same data order and schedule, and metrics.jsonl keeps each step once. A SIGTERM or SIGUSR1 (a
preemption notice, common/preemption.py) stops the run at the end of its step with both checkpoints
written there: `RunStopped`, exit code 75, and `--resume` continues from that step.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

from common.config import Config
from common.errors import MemexError
from common.preemption import stop_at_step_end, stopped_with_resume_point
from common.seeding import seed_everything
from modeling.load import cpu_has_native_bf16, load_policy, resolve_device
from modeling.lora import lora_config
from sft.dataset import build_dataset
from sft.output_head import plain_head_trainer, use_plain_head
from training.log import import_wandb
from training.state import STATE_FILE, publish, staging_dir, trim_metrics

log = logging.getLogger(__name__)

TRAIN_COLUMNS = ("input_ids", "assistant_masks")


def save_checkpoint(model, tokenizer, run_dir: Path, step: int, extra: dict[str, Any] | None = None) -> Path:
    """Write RUN/checkpoints/step-N atomically: a temp dir, then one rename."""
    tmp = staging_dir(run_dir, step)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / STATE_FILE).write_text(json.dumps({"step": step, **(extra or {})}, indent=1))
    return publish(tmp, run_dir / "checkpoints" / f"step-{step}")


def _callbacks(run_dir: Path, save_steps: int, tokenizer, stop=None):
    """TrainerCallbacks: metrics.jsonl lines, and our atomic checkpoints every save_steps, at the end, and at the
    step where `stop` (a common.preemption.StopRequest) was requested: there the Trainer writes its resume point
    too and stops (the callback's `stopped_at` says at which step)."""
    from transformers import TrainerCallback

    class RunDirCallback(TrainerCallback):
        stopped_at = 0

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and state.is_world_process_zero:
                record = {"step": state.global_step, "epoch": state.epoch, **logs}
                if "learning_rate" in record:
                    record["lr"] = record["learning_rate"]
                with open(run_dir / "metrics.jsonl", "a") as f:
                    f.write(json.dumps(record) + "\n")

        def on_step_end(self, args, state, control, model=None, **kwargs):
            last = state.global_step >= state.max_steps
            if stop is not None and not last and stop.requested():
                control.should_save = control.should_training_stop = True  # the Trainer's resume point, here
                self.stopped_at = state.global_step
            if state.is_world_process_zero and (last or self.stopped_at or state.global_step % save_steps == 0):
                save_checkpoint(model, tokenizer, run_dir, state.global_step, {"epoch": state.epoch})

    return [RunDirCallback()]


def _wandb(enabled: bool, run_dir: Path) -> list[str]:
    return ["wandb"] if enabled and import_wandb(run_dir) is not None else []


def prepare_run_dir(cfg: Config, run_dir: Path) -> None:
    """A fresh run directory with the resolved config (an earlier run's files are replaced)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    shutil.rmtree(run_dir / "trainer", ignore_errors=True)  # an earlier run's resume points
    cfg.save(run_dir / "config.yaml")


def resume_point(run_dir: Path) -> Path:
    """The newest complete HF Trainer checkpoint of the run (RUN/trainer/checkpoint-N with its
    trainer_state.json, which the Trainer writes last), for `memexrl sft --resume`."""
    found = []
    for path in (run_dir / "trainer").glob("checkpoint-*"):
        match = re.fullmatch(r"checkpoint-(\d+)", path.name)
        if match and (path / "trainer_state.json").is_file():
            found.append((int(match.group(1)), path))
    if not found:
        raise MemexError(f"{run_dir} has no SFT checkpoint to resume (RUN/trainer/checkpoint-N, written every "
                         f"sft.save_steps): start the run without --resume")
    return max(found)[1]


def run_sft(cfg: Config, resume: bool = False) -> Path:
    """Train (from the newest resume point with `resume`), checkpoint and return the final checkpoint directory."""
    from trl import SFTConfig, SFTTrainer

    s = cfg.sft
    if not s.demos:
        raise MemexError("sft.demos is not set: point it at demos.jsonl from `memexrl expert --out DIR`")
    run_dir = Path(s.output_dir)
    if resume:
        start = resume_point(run_dir)
        trim_metrics(run_dir / "metrics.jsonl", int(start.name.split("-")[1]))
        log.info("resuming the SFT run %s from %s", run_dir, start)
    else:
        start = None
        prepare_run_dir(cfg, run_dir)
    on_cpu = resolve_device(cfg.model.device).type == "cpu"
    if on_cpu and s.bf16 and not cpu_has_native_bf16():  # before the data and the model are loaded
        raise MemexError("sft.bf16=true on the CPU needs native bfloat16 (AVX-512 BF16 or AMX), which this CPU "
                         "lacks (it would run slower than float32): set sft.bf16=false")
    seed_everything(cfg.seed)
    data = build_dataset(s.demos, s.validation_fraction, s.max_length, s.task_types)
    model, tokenizer = load_policy(cfg.model, for_training=True)
    peft_config = lora_config(model, s.lora_r, s.lora_alpha, s.lora_dropout, s.lora_target_modules) if s.lora else None
    has_val = "validation" in data
    args = SFTConfig(
        output_dir=str(run_dir / "trainer"),
        num_train_epochs=s.epochs,
        max_steps=s.max_steps,
        learning_rate=s.learning_rate,
        weight_decay=s.weight_decay,
        warmup_steps=s.warmup_ratio,  # a float in [0, 1) is a ratio of the total steps
        lr_scheduler_type="cosine",
        per_device_train_batch_size=s.per_device_batch_size,
        per_device_eval_batch_size=s.per_device_batch_size,
        gradient_accumulation_steps=s.gradient_accumulation_steps,
        gradient_checkpointing=s.gradient_checkpointing,
        logging_steps=s.logging_steps,
        save_strategy="steps",  # the Trainer's own resume point (RUN/trainer/); our callback writes the
        save_steps=s.save_steps,  # atomic checkpoints into RUN/checkpoints/
        save_total_limit=1,
        eval_strategy=("steps" if s.eval_steps else "no") if has_val else "no",
        eval_steps=s.eval_steps or None,
        max_length=s.max_length,
        packing=False,
        use_cpu=on_cpu,
        bf16=s.bf16,
        deepspeed=s.deepspeed or None,
        report_to=_wandb(s.wandb, run_dir),
        run_name=run_dir.name,
        seed=cfg.seed,
        dataloader_num_workers=0,
        disable_tqdm=False,
    )
    trainer_class = plain_head_trainer(SFTTrainer) if use_plain_head(s.output_head, model.device) else SFTTrainer
    with stop_at_step_end() as stop_request:
        callbacks = _callbacks(run_dir, s.save_steps, tokenizer, stop_request)
        trainer = trainer_class(
            model=model,
            args=args,
            train_dataset=data["train"].select_columns(list(TRAIN_COLUMNS)),
            eval_dataset=data["validation"].select_columns(list(TRAIN_COLUMNS)) if has_val else None,
            processing_class=tokenizer,
            peft_config=peft_config,
            callbacks=callbacks,
        )
        trainer.train(resume_from_checkpoint=str(start) if start else None)
    stopped_at = callbacks[0].stopped_at
    if has_val and not stopped_at:
        metrics = trainer.evaluate()
        with open(run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": trainer.state.global_step, **metrics}) + "\n")
    if "wandb" in args.report_to:  # close the run: a GRPO run in the same process (memexrl demo) opens its own
        import wandb

        wandb.finish()
    if stopped_at:
        resume_at = run_dir / "trainer" / f"checkpoint-{stopped_at}"
        raise stopped_with_resume_point("the SFT run", stopped_at, str(resume_at))
    final = run_dir / "checkpoints" / f"step-{trainer.state.global_step}"
    log.info("SFT done: %d steps, checkpoint %s", trainer.state.global_step, final)
    return final
