"""Run under `accelerate launch` with configs/accelerate/zero3-8gpu.yaml (tests/test_weight_sync.py): what the
vLLM engine's sync sends from a model whose parameters DeepSpeed ZeRO-3 has partitioned.

    python -m accelerate.commands.launch ... tests/zero3_sync_probe.py MODEL_DIR INT4_DIR OUT.safetensors
"""

import sys

import torch
from accelerate import Accelerator
from safetensors.torch import save_file

from memexrl.config import ModelConfig, TrainSection
from memexrl.models import load_policy
from memexrl.quantize import apply_fake_quant, int4_layout
from memexrl.trainer import configure_deepspeed
from rollout.vllm import checkpoint_state_dict


def main(model_dir: str, int4_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    acc = Accelerator()
    assert configure_deepspeed(acc, TrainSection(micro_batch_size=1)) == 3
    model = load_policy(ModelConfig(name=model_dir, device="cpu"), for_training=True)[0]
    apply_fake_quant(model, 32)  # path B: FakeQuant parametrizations over the trained latent weights
    model, _ = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    module = acc.unwrap_model(model)
    empty = [k for k, v in module.state_dict().items() if v.numel() == 0]
    assert empty, "ZeRO-3 left every parameter whole: nothing to gather"
    state = checkpoint_state_dict(module, int4_layout(int4_dir))
    if acc.is_main_process:
        save_file({k: v.contiguous() for k, v in state.items()}, out, metadata={"empty_before": str(len(empty))})


if __name__ == "__main__":
    main(*sys.argv[1:4])
