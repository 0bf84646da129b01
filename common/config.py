"""Configuration: nested dataclasses loaded from YAML with `section.key=value` overrides.

`Config` composes the sections of common/sections.py, where every number the paper or the
authors' release fixes is a named default, with the source in its help text (memex.md); it
validates them together. The resolved config is saved with every run.
Unknown keys and ill-typed values are rejected with a message that names the key and the
fix (the TRL/HF way, design.md "Conventions").
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from common.errors import MemexError
from common.sections import (  # noqa: F401  (re-exported: `from common.config import ModelConfig` etc.)
    AGENT_NAMES,
    DemoSection,
    EnvConfig,
    EvalSection,
    ExpertConfig,
    MemoryConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    SFTSection,
    TrainSection,
    _help,
)


@dataclass
class Config:
    seed: int = _help("One seed for Python, numpy and torch.", 0)
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    expert: ExpertConfig = field(default_factory=ExpertConfig)
    sft: SFTSection = field(default_factory=SFTSection)
    train: TrainSection = field(default_factory=TrainSection)
    eval: EvalSection = field(default_factory=EvalSection)
    demo: DemoSection = field(default_factory=DemoSection)

    @property
    def engine_dtype(self) -> str:
        """The dtype rollouts and evaluations generate in: rollout.dtype, or model.dtype when it is auto."""
        return self.model.dtype if self.rollout.dtype == "auto" else self.rollout.dtype

    def check_training(self) -> None:
        """The checks only `memexrl train` needs (its dry run too), not every command: `eval` generates in
        rollout.dtype and computes no PPO ratio."""
        if self.rollout.dtype not in ("auto", self.model.dtype) and not self.train.recompute_old_logprobs:
            raise MemexError(f"bad config: rollout.dtype={self.rollout.dtype} generates in another precision than "
                             "model.dtype: set train.recompute_old_logprobs=true (the PPO ratio needs the trainer's "
                             "own log-probs)")

    def __post_init__(self) -> None:
        for message in _number_problems(self):
            raise MemexError(f"bad config: {message}")
        checks = [
            (self.memory.threshold > 0, "memory.threshold must be > 0"),
            (0 < self.memory.warn_ratio <= 1, "memory.warn_ratio must be in (0, 1]"),
            (self.memory.summary_max_tokens > 0, "memory.summary_max_tokens must be > 0"),
            (self.memory.summary_cap_mode in ("tokens", "chars"), "memory.summary_cap_mode must be 'tokens' or 'chars'"),
            (self.memory.anchor_scope in ("context", "observations"),
             "memory.anchor_scope must be 'context' or 'observations'"),
            (self.memory.backend in ("memory", "sqlite"), "memory.backend must be 'memory' or 'sqlite'"),
            (self.memory.catalog_rank_chars >= 0, "memory.catalog_rank_chars must be >= 0 (0: a block's whole content)"),
            (self.model.thinking in ("auto", "always", "never"), "model.thinking must be auto, always or never"),
            (self.env.max_steps > 0, "env.max_steps must be > 0"),
            (self.env.num_workers > 0, "env.num_workers must be > 0"),
            (self.rollout.engine in ("transformers", "scripted", "vllm"), "rollout.engine must be transformers, scripted or vllm"),
            (self.rollout.observation_role in ("tool", "user"), "rollout.observation_role must be 'tool' or 'user'"),
            (self.rollout.max_new_tokens > 0, "rollout.max_new_tokens must be > 0"),
            (self.rollout.max_context_tokens > 0, "rollout.max_context_tokens must be > 0"),
            (self.rollout.batch_size > 0, "rollout.batch_size must be > 0"),
            (self.rollout.dtype in ("auto", "float32", "bfloat16", "float16"),
             "rollout.dtype must be auto, float32, bfloat16 or float16"),
            (0 < self.rollout.top_p <= 1, "rollout.top_p must be in (0, 1]"),
            (self.env.step_timeout_s > 0, "env.step_timeout_s must be > 0"),
            (self.train.learning_rate > 0, "train.learning_rate must be > 0"),
            (self.train.lora_r > 0, "train.lora_r must be > 0"),
            (self.rollout.temperature >= 0, "rollout.temperature must be >= 0"),
            (self.rollout.vllm_request_timeout_s > 0, "rollout.vllm_request_timeout_s must be > 0"),
            (self.eval.agent in AGENT_NAMES, f"eval.agent must be one of {', '.join(AGENT_NAMES)}"),
            (self.eval.games >= 0, "eval.games must be >= 0"),
            (self.eval.truncate_turns > 0, "eval.truncate_turns must be > 0"),
            (self.eval.insights_top_k > 0, "eval.insights_top_k must be > 0"),
            (self.eval.temperature >= 0, "eval.temperature must be >= 0"),
            (self.eval.samples_per_game >= 1, "eval.samples_per_game must be >= 1"),
            (self.eval.samples_per_game == 1 or self.eval.temperature > 0,
             "eval.samples_per_game > 1 needs eval.temperature > 0: greedy samples of one game are the same episode"),
            (0 <= self.expert.detour_rate < 1, "expert.detour_rate must be in [0, 1)"),
            (self.expert.max_detours >= 0, "expert.max_detours must be >= 0"),
            (0 <= self.expert.rejected_compress_rate < 1, "expert.rejected_compress_rate must be in [0, 1)"),
            (self.demo.expert_games > 0 and self.demo.eval_games > 0, "demo.expert_games and demo.eval_games must be > 0"),
            (self.demo.eval_max_steps >= 0, "demo.eval_max_steps must be >= 0 (0 = env.max_steps)"),
            (self.demo.precision in ("auto", "bfloat16", "float32"), "demo.precision must be auto, bfloat16 or float32"),
            (self.sft.output_head in ("auto", "fused", "plain"), "sft.output_head must be auto, fused or plain"),
            (self.expert.max_turn_tokens >= 0, "expert.max_turn_tokens must be >= 0 (0 = rollout.max_new_tokens)"),
            (self.expert.seen_evidence in ("anchor", "facts"), "expert.seen_evidence must be 'anchor' or 'facts'"),
            (self.expert.reading_archive in ("evidence", "pages"),
             "expert.reading_archive must be 'evidence' or 'pages'"),
            (self.expert.reading_query in ("evidence", "catalog"),
             "expert.reading_query must be 'evidence' or 'catalog'"),
            (self.expert.reading_anchor_cut in ("chars", "lines", "last_line"),
             "expert.reading_anchor_cut must be 'chars', 'lines' or 'last_line'"),
            (self.expert.anchor_end in ("words", "sentence"), "expert.anchor_end must be 'words' or 'sentence'"),
            (0 <= self.sft.validation_fraction < 1, "sft.validation_fraction must be in [0, 1)"),
            (self.sft.per_device_batch_size > 0, "sft.per_device_batch_size must be > 0"),
            (self.sft.gradient_accumulation_steps > 0, "sft.gradient_accumulation_steps must be > 0"),
            (self.train.group_size >= 2, "train.group_size (G) must be >= 2: GRPO compares rollouts of one game"),
            (self.train.tasks_per_step > 0, "train.tasks_per_step must be > 0"),
            (self.train.micro_batch_size > 0, "train.micro_batch_size must be > 0"),
            (self.train.batch_unit in ("trajectories", "segments"), "train.batch_unit must be trajectories or segments"),
            (self.train.global_batch_size > 0
             and (self.train.batch_unit == "segments"
                  or (self.train.tasks_per_step * self.train.group_size) % self.train.global_batch_size == 0),
             f"train.global_batch_size ({self.train.global_batch_size}) must divide the rollout batch "
             f"tasks_per_step x group_size = {self.train.tasks_per_step * self.train.group_size}"),
            (self.train.advantage_norm in ("group", "batch"), "train.advantage_norm must be 'group' or 'batch'"),
            (self.train.tied_groups in ("drop", "resample"), "train.tied_groups must be 'drop' or 'resample'"),
            (self.train.tied_on in ("return", "task"), "train.tied_on must be 'return' or 'task'"),
            (self.train.loss_agg in ("trajectory", "segment", "token"),
             "train.loss_agg must be 'trajectory', 'segment' or 'token'"),
            (self.train.finetune in ("full", "lora", "qlora"), "train.finetune must be full, lora or qlora"),
            (self.train.lr_scheduler in ("constant", "cosine"), "train.lr_scheduler must be constant or cosine"),
            (self.train.mixed_precision in ("no", "bf16", "fp16"), "train.mixed_precision must be no, bf16 or fp16"),
            (self.train.steps > 0 and self.train.save_steps > 0, "train.steps and train.save_steps must be > 0"),
            (self.train.env in ("alfworld", "reading", "mixed"), "train.env must be alfworld, reading or mixed"),
            (self.train.env == "alfworld" or self.train.reading_tasks,
             f"train.env={self.train.env} needs train.reading_tasks: the games.txt that `memexrl lme tasks --out DIR` "
             "writes"),
            (self.train.env != "mixed" or 0 < self.train.reading_share < 1,
             "train.reading_share must be in (0, 1) with train.env=mixed"),
            (not (self.train.fake_quant_group_size and self.train.finetune == "qlora"),
             "train.fake_quant_group_size needs finetune lora or full: a qlora base is already 4-bit (NF4)"),
        ]
        for ok, message in checks:
            if not ok:
                raise MemexError(f"bad config: {message}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


NEGATIVE_MEANS = {"sft.max_steps": "-1: run all epochs (TRL's convention)",
                  "rollout.vllm_cpu_reserved_cores": "-1: vLLM's own default (one core kept for its scheduler)"}


def _number_problems(cfg: Config) -> list[str]:
    """Every number of every section must be finite and >= 0 (0 is each one's "off" or "all"; only
    NEGATIVE_MEANS's settings give -1 a meaning); `Config.__post_init__` then asks for > 0 where 0 means nothing."""
    problems = []
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for f in dataclasses.fields(values) if dataclasses.is_dataclass(values) else ():
            value, key = getattr(values, f.name), f"{section.name}.{f.name}"
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if not math.isfinite(value):
                problems.append(f"{key} must be a finite number, got {value}")
            elif value < 0 and not (key in NEGATIVE_MEANS and value == -1):
                problems.append(f"{key} must be >= 0, got {value}")
    if isinstance(cfg.seed, int) and cfg.seed < 0:
        problems.append(f"seed must be >= 0, got {cfg.seed}")
    return problems


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """Check/convert one YAML value to the field's type; raise MemexError naming the key."""
    hint = annotation
    if isinstance(hint, str):
        hint = {"int": int, "float": float, "bool": bool, "str": str}.get(hint, hint)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        hint = args[0]
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # PyYAML reads 5e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    else:
        return value
    raise MemexError(f"bad config: {key} must be {getattr(hint, '__name__', hint)}, got {value!r}")


def _build(cls: type, data: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f" in section '{prefix[:-1]}'" if prefix else ""
        raise MemexError(
            f"bad config: unknown key {prefix}{unknown[0]}{where}; valid keys: {', '.join(sorted(fields))}"
        )
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise MemexError(f"bad config: {prefix}{name} must be a mapping of keys")
            kwargs[name] = _build(hint, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, hint, f"{prefix}{name}")
    return cls(**kwargs)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b=value` overrides (values parsed as YAML scalars) to a nested dict."""
    for item in overrides:
        if "=" not in item:
            raise MemexError(f"bad override {item!r}: write it as section.key=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise MemexError(f"bad override {item!r}: {part} is not a section")
        node[parts[-1]] = value
    return data


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None, cls: type = Config) -> Any:
    """Load a YAML config (or the defaults when path is None) and apply overrides."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise MemexError(f"config file not found: {p}; pass an existing YAML file (see configs/)")
        try:
            data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as exc:
            raise MemexError(f"config {p} is not valid YAML: {str(exc).splitlines()[0]}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise MemexError(f"config {p} cannot be read as a YAML text file ({exc}); pass the YAML config") from None
        if not isinstance(data, dict):
            raise MemexError(f"config {p} must be a mapping of sections (model:, env:, ...)")
    data = apply_overrides(data, overrides or [])
    return _build(cls, data, "")
