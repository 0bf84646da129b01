"""The run's `accelerate.Accelerator` and its DeepSpeed settings (memex.md "Training"; training/trainer.py uses them).

One process, several processes on GPUs, or DeepSpeed ZeRO ranks on a CPU (gloo): `make_accelerator` picks the
backend, `configure_deepspeed` fills the DeepSpeed config's batch and clipping values from the train section.
"""

from __future__ import annotations

import os

import torch

from common.config import Config
from common.errors import MemexError


def deepspeed_launched() -> bool:
    """True under `accelerate launch` with a DeepSpeed config (accelerate's own environment flag)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def make_accelerator(cfg: Config):
    """The run's `accelerate.Accelerator`.

    DeepSpeed also runs on the CPU, on the gloo backend, but accelerate drops it when asked for
    cpu=True and finds no backend of its own without a GPU (it would then report one process).
    So a DeepSpeed launch without CUDA names gloo: `accelerate launch --num_processes 2` with a
    ZeRO config then runs two real ranks on a CPU (tests/test_distributed.py).
    """
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    handlers = []
    if deepspeed_launched() and not torch.cuda.is_available():
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    cpu = (cfg.model.device == "cpu" or not torch.cuda.is_available()) and not deepspeed_launched()
    return Accelerator(cpu=cpu, mixed_precision=cfg.train.mixed_precision, kwargs_handlers=handlers)


def configure_deepspeed(acc, t) -> int:
    """Fill the DeepSpeed config from the train section before `prepare`; return the ZeRO stage (-1: no DeepSpeed).

    train_micro_batch_size_per_gpu = train.micro_batch_size (there is no dataloader for accelerate
    to read it from), gradient_clipping = train.max_grad_norm (DeepSpeed clips at its step), and
    gradient_accumulation_steps = 1: the number of micro-batches per optimizer step varies, so
    update.py marks each step's boundary itself and DeepSpeed must neither count micro-steps nor
    divide the loss by their number. A number in the file that disagrees stops the run.
    """
    plugin = acc.state.deepspeed_plugin
    if plugin is None:
        return -1
    ds = plugin.deepspeed_config
    wanted = {"train_micro_batch_size_per_gpu": ("train.micro_batch_size", t.micro_batch_size),
              "gradient_clipping": ("train.max_grad_norm", t.max_grad_norm),
              "gradient_accumulation_steps": ("1 (memexrl marks the step boundaries)", 1)}
    for key, (source, value) in wanted.items():
        current = ds.get(key, "auto")
        if current == "auto":
            ds[key] = value
        elif float(current) != float(value):
            raise MemexError(f"the DeepSpeed config sets {key}={current}, but it must equal {source} = {value}: "
                             f"set it to \"auto\" in the DeepSpeed JSON")
    return int(plugin.zero_stage)
