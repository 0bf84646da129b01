"""`memexrl bench trainer`: our GRPO update path against TRL's `GRPOTrainer`, side by side.

What is compared: trained tokens per second of one GRPO training step, generation included,
on the same single-turn work: the same model weights (a fresh copy loaded per run), the same
chat-rendered ALFWorld-style prompts, G completions per prompt sampled at temperature 1, the
same reward function, full fine-tuning with a frozen reference model on both sides (k3 KL,
beta = train.kl_coef), AdamW with the same learning rate, betas, weight decay and gradient
clip, a constant schedule, one forward/backward pass over all prompts x G sequences and one
optimizer step per training step, on the CPU in float32.

- ours: the composition of training/trainer.py for single-turn work: `TransformersEngine`
  generates (a fresh engine per step, no KV cache kept across calls: there is no next turn),
  `grpo.group_advantages`, one `SegmentSample` per completion (prompt + completion ids, loss
  mask on the completion, the engine's log-probs), `grpo.token_weights` ('trajectory'
  aggregation), reference log-probs by `fill_logprobs` on the frozen copy, then
  `update_policy` under `accelerate.Accelerator(cpu=True)`. Old log-probs are the engine's
  (`recompute_old_logprobs=False`), as TRL with num_iterations=1 computes none either. Tie
  groups are trained with advantage 0, as TRL does (our multi-turn trainer drops them),
  so that both sides train the same tokens.
- TRL: `GRPOTrainer` with `loss_type='grpo'` (each sequence averaged over its tokens, then
  over sequences: our 'trajectory' aggregation), epsilon / epsilon_high = our clip_low /
  clip_high, the same entropy coefficient, no gradient checkpointing, no MoE router loss
  (ours has none), `per_device_train_batch_size` = prompts x G, one generation per step.

Why it is fair: both sides generate exactly C tokens per completion. The end-of-sequence
ids are suppressed while sampling (TRL: `min_new_tokens=C`; ours: the same ids masked at the
LM head during generation), so the work is identical and every completion token is trained;
trained tokens are counted exactly on each side (ours: the loss masks; TRL: the completion
ids its reward function receives, which are exactly the tokens of its completion mask) and
checked equal. The timed window is the training loop only, model loading excluded: ours from
the first generation to the last optimizer step, TRL from `on_train_begin` to `on_train_end`
(its optimizer and data loader are built before, as ours are). Runs alternate ours / TRL in
one process, the order swapped every round, so drift in the machine's load (a busy CPU)
hits both sides alike; medians of the runs are compared.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import statistics
import tempfile
import time
from dataclasses import dataclass, field, replace

import torch

from common.config import Config, load_config
from common.errors import MemexError
from training import grpo
from training.batching import SegmentSample, fill_logprobs

log = logging.getLogger(__name__)

DEFAULT_CONFIG = "configs/tiny-cpu.yaml"

# Short ALFWorld-style tasks (the first observation of a game), rendered with the chat template.
TASKS = [
    "You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a countertop 1, "
    "a fridge 1 and a sinkbasin 1. Your task is to: put a clean apple in fridge. What do you do next?",
    "You are in the middle of a room. Looking quickly around you, you see a countertop 1, a microwave 1 "
    "and a stoveburner 1. Your task is to: heat some egg and put it in countertop. What do you do next?",
    "You are in the middle of a room. Looking quickly around you, you see a bed 1, a desk 1 and a "
    "desklamp 1. Your task is to: examine the book with the desklamp. What do you do next?",
    "You are in the middle of a room. Looking quickly around you, you see a bed 1, a drawer 1 and a "
    "sidetable 1. Your task is to: put two cellphone in bed. What do you do next?",
]
ACTIONS = ("go to", "take", "open", "put", "heat", "clean", "examine", "use")


def reward(completions: list[str], completion_ids: list[list[int]]) -> list[float]:
    """A plain single-turn reward: action verbs named, plus the share of distinct tokens (breaks ties)."""
    return [sum(a in text.lower() for a in ACTIONS) + len(set(ids)) / max(len(ids), 1)
            for text, ids in zip(completions, completion_ids)]


@dataclass
class Run:
    side: str  # "ours" or "trl"
    tokens: int  # trained (completion) tokens over all steps
    seconds: float  # the training loop: generation + update, all steps

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@dataclass
class TrainerBench:
    settings: dict
    ours: list[Run] = field(default_factory=list)
    trl: list[Run] = field(default_factory=list)

    @property
    def ours_median(self) -> float:
        return statistics.median(r.tokens_per_s for r in self.ours)

    @property
    def trl_median(self) -> float:
        return statistics.median(r.tokens_per_s for r in self.trl)

    @property
    def ratio(self) -> float:
        """Our median trained tokens/s over TRL's (> 1: ours is faster)."""
        return self.ours_median / self.trl_median


def bench_config(config: str | None, overrides: list[str], prompts: int, group: int) -> Config:
    """The config both sides read their hyperparameters from: full fine-tuning from model.name, CPU."""
    cfg = load_config(config or DEFAULT_CONFIG, overrides)
    n = prompts * group
    train = replace(cfg.train, finetune="full", init_checkpoint="", lr_scheduler="constant", warmup_steps=0,
                    tasks_per_step=prompts, group_size=group, global_batch_size=n, micro_batch_size=n,
                    recompute_old_logprobs=False, gradient_checkpointing=False, mixed_precision="no")
    return replace(cfg, model=replace(cfg.model, device="cpu"), train=train)


def render_prompts(tokenizer, prompts: int) -> list[str]:
    """`prompts` task strings (cycling TASKS) rendered as a user turn with the generation prompt."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": TASKS[i % len(TASKS)]}],
                                          tokenize=False, add_generation_prompt=True) for i in range(prompts)]


def eos_ids(model, tokenizer) -> list[int]:
    """The ids TRL stops at: the tokenizer's eos and the generation config's."""
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    return list(dict.fromkeys([tokenizer.eos_token_id, *ids]))


@contextlib.contextmanager
def suppress_tokens(model, token_ids: list[int]):
    """Mask `token_ids` out of the LM head's logits while inside (what `min_new_tokens` does in TRL)."""
    def hook(_module, _inputs, logits):
        logits[..., token_ids] = float("-inf")
        return logits

    handle = model.get_output_embeddings().register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def run_ours(cfg: Config, prompt_texts: list[str], steps: int, completion_tokens: int, seed: int) -> Run:
    """`steps` GRPO steps of our trainer's composition on single-turn work; the loop is timed."""
    from accelerate import Accelerator

    from common.engine import GenerationRequest
    from rollout.hf_engine import TransformersEngine
    from training.policy import load_policy_for_grpo
    from training.trainer import make_optimizer
    from training.update import pad_id, update_policy

    t, group = cfg.train, cfg.train.group_size
    acc = Accelerator(cpu=True, mixed_precision="no")
    policy = load_policy_for_grpo(cfg)
    tokenizer = policy.tokenizer
    optimizer, scheduler = make_optimizer(policy, cfg)
    model, optimizer = acc.prepare(policy.model, optimizer)
    pad, suppressed = pad_id(tokenizer), eos_ids(policy.model, tokenizer)
    prompt_ids = [list(ids) for ids in tokenizer(prompt_texts)["input_ids"]]
    jobs = [(k, j) for k in range(len(prompt_ids)) for j in range(group)]
    groups = torch.tensor([k for k, _ in jobs])
    tokens = 0
    start = time.perf_counter()
    for step in range(steps):
        engine = TransformersEngine(policy.model, tokenizer, temperature=1.0, batch_size=len(jobs),
                                    seed=seed * 1_000_003 + step, reuse_cache=False)
        requests = [GenerationRequest(f"s{step}-t{k}-g{j}", prompt_ids[k], completion_tokens) for k, j in jobs]
        policy.model.eval()
        with torch.no_grad(), suppress_tokens(policy.model, suppressed):
            completions = engine.generate(requests)
        rewards = reward([c.text for c in completions], [c.token_ids for c in completions])
        advantages, _keep = grpo.group_advantages(torch.tensor(rewards), groups, t.adv_eps)
        samples = []
        for i, ((k, _), c) in enumerate(zip(jobs, completions)):
            p = prompt_ids[k]
            samples.append(SegmentSample(
                input_ids=p + list(c.token_ids), loss_mask=[0] * len(p) + [1] * len(c.token_ids),
                rollout_logprobs=[0.0] * len(p) + list(c.logprobs), advantage=float(advantages[i]),
                weight=0.0, trajectory=i,
            ))
        weights = grpo.token_weights(torch.tensor([s.trained_tokens for s in samples]),
                                     torch.tensor([s.trajectory for s in samples]), t.loss_agg)
        for s, w in zip(samples, weights.tolist()):
            s.weight = w
            s.old_logprobs = s.rollout_logprobs[1:]  # the engine's: TRL with num_iterations=1 recomputes none
        with policy.reference_context():
            fill_logprobs(policy.reference_module(), samples, t.micro_batch_size, pad, acc.device, "ref_logprobs",
                          t.head_chunk_size)
        update_policy(model=model, optimizer=optimizer, scheduler=scheduler, accelerator=acc, samples_per_update=[samples],
                      train=t, pad_token_id=pad, params=policy.trainable_parameters())
        tokens += sum(s.trained_tokens for s in samples)
    seconds = time.perf_counter() - start
    del policy, model, optimizer, scheduler, acc
    gc.collect()
    return Run("ours", tokens, seconds)


def run_trl(cfg: Config, prompt_texts: list[str], steps: int, completion_tokens: int, seed: int) -> Run:
    """`steps` steps of TRL's GRPOTrainer on the same work; its training loop is timed."""
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from modeling.load import load_policy
    from modeling.zoo import resolve_model_path

    t = cfg.train
    n = t.tasks_per_step * t.group_size
    model, tokenizer = load_policy(cfg.model, for_training=True)
    # TRL loads its reference model from the policy's path: point it at the local copy (offline).
    model.config._name_or_path = resolve_model_path(cfg.model.name, cfg.model.cache_dir)
    moe = hasattr(model.config.get_text_config(), "output_router_logits")
    trained: list[int] = []

    def bench_reward(completions, completion_ids, **_):
        trained.append(sum(len(ids) for ids in completion_ids))  # exactly the tokens of the completion mask
        return reward(completions, completion_ids)

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_train_end(self, args, state, control, **kwargs):
            self.seconds = time.perf_counter() - self.start

    clock = Clock()
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as out:
        args = GRPOConfig(
            output_dir=out, use_cpu=True, bf16=False, seed=seed, report_to=[], save_strategy="no",
            logging_steps=10**6, disable_tqdm=True, max_steps=steps,
            per_device_train_batch_size=n, gradient_accumulation_steps=1, num_generations=t.group_size,
            max_completion_length=completion_tokens, generation_kwargs={"min_new_tokens": completion_tokens},
            temperature=1.0, top_p=1.0, top_k=0, activation_checkpointing=False,
            beta=t.kl_coef, epsilon=t.clip_low, epsilon_high=t.clip_high, loss_type="grpo",
            entropy_coef=t.entropy_coef, scale_rewards="group", router_aux_loss_coef=0.0 if moe else None,
            learning_rate=t.learning_rate, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
            adam_beta2=t.adam_beta2, max_grad_norm=t.max_grad_norm, lr_scheduler_type="constant",
            optim="adamw_torch", dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=bench_reward, args=args, processing_class=tokenizer,
                              train_dataset=Dataset.from_dict({"prompt": prompt_texts}), callbacks=[clock])
        trainer.remove_callback(PrinterCallback)  # it prints the final metrics dict to stdout
        trainer.train()
    del trainer, model
    gc.collect()
    return Run("trl", sum(trained), clock.seconds)


def bench_trainer(config: str | None = None, overrides: list[str] | None = None, *, runs: int = 3,
                  steps: int = 2, prompts: int = 2, group: int = 4, completion_tokens: int = 32,
                  seed: int = 0) -> TrainerBench:
    """Alternate `runs` runs of each side (order swapped every round); each run trains `steps` steps."""
    if runs < 1 or steps < 1 or prompts < 1 or completion_tokens < 1:
        raise MemexError("bench trainer: --runs, --bench-steps, --prompts and --completion-tokens must be >= 1")
    if group < 2:
        raise MemexError("bench trainer: --group (G) must be >= 2: GRPO compares completions of one prompt")
    torch.set_num_threads(1)
    cfg = bench_config(config, overrides or [], prompts, group)
    from modeling.load import load_tokenizer

    prompt_texts = render_prompts(load_tokenizer(cfg.model), prompts)
    result = TrainerBench(settings={
        "model": cfg.model.name, "prompts": prompts, "group": group, "completion_tokens": completion_tokens,
        "steps": steps, "runs": runs, "threads": torch.get_num_threads(), "learning_rate": cfg.train.learning_rate,
    })
    sides = {"ours": (run_ours, result.ours), "trl": (run_trl, result.trl)}
    for r in range(runs):
        for side in (("ours", "trl") if r % 2 == 0 else ("trl", "ours")):
            fn, into = sides[side]
            run = fn(cfg, prompt_texts, steps, completion_tokens, seed + r)
            log.info("bench trainer run %d %s: %d tokens in %.1f s", r + 1, side, run.tokens, run.seconds)
            into.append(run)
    expected = steps * prompts * group * completion_tokens
    for run in result.ours + result.trl:
        if run.tokens != expected:
            raise MemexError(f"bench trainer: {run.side} trained {run.tokens} tokens, expected {expected} "
                             "(prompts x G x completion tokens x steps): the work differs")
    return result


def format_bench_trainer(r: TrainerBench) -> str:
    s = r.settings
    rows = [
        f"GRPO trainer bench: {s['model']}, {s['prompts']} prompts x G {s['group']}, {s['completion_tokens']} "
        f"completion tokens (eos suppressed), {s['steps']} steps/run, {s['runs']} runs each, full fine-tuning, "
        f"beta>0 reference, lr {s['learning_rate']:g}, CPU float32, {s['threads']} thread(s); tokens/s = trained "
        "completion tokens / (generation + update) seconds",
        f"{'run':<7} {'ours tok/s':>11} {'TRL tok/s':>10} {'ours s':>8} {'TRL s':>8} {'tokens':>7}",
    ]
    for i, (a, b) in enumerate(zip(r.ours, r.trl), 1):
        rows.append(f"{i:<7} {a.tokens_per_s:>11.1f} {b.tokens_per_s:>10.1f} {a.seconds:>8.1f} {b.seconds:>8.1f} "
                    f"{a.tokens:>7}")
    rows.append(f"{'median':<7} {r.ours_median:>11.1f} {r.trl_median:>10.1f}")
    rows.append(f"ours / TRL: {r.ratio:.2f}x trained tokens/s")
    return "\n".join(rows)
