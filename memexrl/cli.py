"""`memexrl ...`: the command line (design.md "CLI").

Exit code 0 on success, 2 on bad input: user errors (`MemexError`) are printed on one line.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from common.argtypes import non_negative_int, positive_int
from common.collectives import end_process_group
from common.errors import MemexError
from common.malloc import return_freed_memory
from common.preemption import EXIT_CODE as PREEMPTED_EXIT_CODE
from common.preemption import RunStopped
from envs.data import DEFAULT_DEST
from eval.lme.cli import add_lme_commands

log = logging.getLogger("memexrl")


# --- data ---------------------------------------------------------------------------------------
def cmd_data(args: argparse.Namespace) -> None:
    from envs.data import prepare_alfworld

    root = prepare_alfworld(args.dest, args.archive)
    print(f"ALFWorld data ready. Use: export ALFWORLD_DATA={root}")


# --- replay -------------------------------------------------------------------------------------
def read_script(path: str | Path) -> list[str]:
    """A replay script: JSONL, one {"assistant": "<raw text>"} per turn."""
    from common.jsonl import read_jsonl

    turns = []
    shape = 'each line must be {"assistant": "..."}'
    for n, item in read_jsonl(path, "script not found (pass a JSONL file, one assistant turn a line)", shape):
        if not isinstance(item, dict) or not isinstance(item.get("assistant"), str):
            raise MemexError(f"{path} line {n}: expected an object with a string field \"assistant\"")
        turns.append(item["assistant"])
    if not turns:
        raise MemexError(f"{path} has no turns: write one {{\"assistant\": \"...\"}} object per line")
    return turns


def replay(game: str, turns: list[str], cfg, tokenizer) -> dict:
    """Play one episode with a scripted policy; return the trajectory JSON (with token ids)."""
    from rewards import score_trajectory
    from rollout.runner import make_renderer, open_envs, run_episodes
    from rollout.scripted import ScriptedEngine

    engine = ScriptedEngine(tokenizer, {"replay": turns})
    with open_envs(cfg, num_workers=0) as envs:
        (traj,) = run_episodes([("replay", game)], engine, envs, make_renderer(tokenizer, cfg), cfg)
    score_trajectory(traj, cfg.memory.threshold, cfg.reward)
    return traj.to_json()


def cmd_replay(args: argparse.Namespace) -> None:
    from common.config import load_config
    from envs.data import resolve_game
    from modeling.load import load_tokenizer

    if args.env != "alfworld":
        raise MemexError(f"unknown env {args.env!r}; available: alfworld")
    cfg = load_config(args.config, args.overrides)
    if args.out and not Path(args.out).parent.is_dir():  # fail now, not after the episode
        raise MemexError(f"--out {args.out}: the directory {Path(args.out).parent} does not exist; create it first")
    game = resolve_game(args.game, cfg.env.data_dir)
    turns = read_script(args.script)
    out = replay(str(game), turns, cfg, load_tokenizer(cfg.model))
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
        log.info("trajectory written to %s", args.out)
    else:
        print(text)


# --- expert -------------------------------------------------------------------------------------
def cmd_expert(args: argparse.Namespace) -> None:
    from common.config import load_config
    from envs.data import GAMES_FILE
    from sft.demos import DEMOS_FILE, check_request, make_demonstrations, summary_text, write_demonstrations

    cfg = load_config(args.config, args.overrides)
    if args.reading_tasks:
        from sft.demos import make_reading_demonstrations

        out = check_request(cfg, None, 1, args.out)
        kept, report = make_reading_demonstrations(cfg, args.reading_tasks, args.workers)
    else:
        if args.split is None or args.games is None:
            raise MemexError("memexrl expert needs --split and --games (ALFWorld), or --reading-tasks FILE")
        out = check_request(cfg, args.split, args.games, args.out)
        kept, report = make_demonstrations(cfg, args.split, args.games, args.workers, order=args.order,
                                           task_types=args.task_types, need_memory=args.need_memory)
    write_demonstrations(out, kept, report, cfg.model.name, cfg.env.data_dir)
    print(summary_text(report))
    print(f"{len(kept)} demonstrations written to {out / DEMOS_FILE}, their games to {out / GAMES_FILE}")


# --- sft ----------------------------------------------------------------------------------------
def cmd_sft(args: argparse.Namespace) -> None:
    from common.config import load_config
    from sft.check import post_sft_check
    from sft.train import run_sft

    cfg = load_config(args.config, args.overrides)
    if cfg.sft.check_games > 0:  # fail now, not after training, when the check's games are missing
        from envs.data import list_games

        list_games(cfg.sft.check_split, cfg.env.data_dir)
    checkpoint = run_sft(cfg, resume=args.resume)
    print(f"SFT checkpoint: {checkpoint}")
    if cfg.sft.check_games > 0:
        report = post_sft_check(cfg, checkpoint, cfg.sft.output_dir)
        print(
            f"post-SFT check on {report['episodes']} {report['split']} games: "
            f"{100 * report['well_formed_call_rate']:.1f}% of {report['steps']} steps with a well-formed tool call, "
            f"success {100 * report['success_rate']:.0f}%, compress {report['compress_per_episode']:.2f} "
            f"and read {report['read_per_episode']:.2f} per episode"
        )


# --- train --------------------------------------------------------------------------------------
def cmd_train(args: argparse.Namespace) -> None:
    from common.config import load_config

    cfg = load_config(args.config, args.overrides)
    cfg.check_training()
    if args.dry_run:
        from memexrl.plan import dry_run

        text, fits = dry_run(cfg, args.num_processes, args.accelerate_config, args.params, gpu_gib=args.gpu_memory_gib)
        print(text)
        if fits is False and not args.force:
            raise MemexError("the plan does not fit the GPU memory (above: what would); --force to plan past it")
        return
    from accelerate import PartialState

    from memexrl.plot import plot_run
    from training.trainer import train

    resume = args.resume_from or ("latest" if args.resume else None)
    if resume and args.overwrite:
        raise MemexError("--overwrite starts the run over and --resume continues it: give one of them")
    checkpoint = train(cfg, resume=resume, overwrite=args.overwrite)
    if PartialState().is_main_process:
        for path in plot_run(cfg.train.output_dir):
            print(f"plot {path}")
    print(f"GRPO run {cfg.train.output_dir}: last checkpoint {checkpoint}")


# --- eval ---------------------------------------------------------------------------------------
EVAL_FLAGS = {"checkpoint": "eval.checkpoint", "split": "eval.split", "games": "eval.games", "agent": "eval.agent",
              "task_types": "eval.task_types", "games_file": "eval.games_file", "samples": "eval.samples_per_game",
              "out": "eval.output_dir"}


def cmd_eval_alfworld(args: argparse.Namespace) -> None:
    from common.config import load_config
    from eval.alfworld import evaluate, summary_line

    flags = [f"{key}={getattr(args, name)}" for name, key in EVAL_FLAGS.items() if getattr(args, name) is not None]
    result = evaluate(load_config(args.config, [*args.overrides, *flags]))
    print(summary_line(result))


def cmd_eval_compare(args: argparse.Namespace) -> None:
    from eval.compare import compare

    print(compare(args.out, args.dirs), end="")
    print(f"written: {Path(args.out) / 'compare.md'}, {Path(args.out) / 'compare.png'}")


# --- bench --------------------------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace) -> None:
    from eval import bench

    print(bench.run(args.what, args))


# --- quantize -----------------------------------------------------------------------------------
def cmd_quantize(args: argparse.Namespace) -> None:
    from modeling.quantize import quantize_checkpoint

    result = quantize_checkpoint(args.model, args.out, args.group_size, experts_only=args.experts_only)
    print(f"INT4 W4A16 checkpoint (pack-quantized, group {args.group_size}): {result.out_dir}")
    n_quantized, n_kept = len(result.quantized), len(result.ignored)
    print(f"{n_quantized} weight tensors quantised; {n_kept} modules left in full precision")


# --- plot ---------------------------------------------------------------------------------------
def cmd_plot(args: argparse.Namespace) -> None:
    from memexrl.plot import plot_run

    written = plot_run(args.run_dir)
    if not written:
        print(f"no known metrics to plot in {Path(args.run_dir) / 'metrics.jsonl'}")
    for path in written:
        print(path)


# --- demo ---------------------------------------------------------------------------------------
def cmd_demo(args: argparse.Namespace) -> None:
    from common.config import load_config
    from memexrl.demo import QUICK_OVERRIDES, run_demo

    overrides = [*(QUICK_OVERRIDES if args.quick else []), *args.overrides]
    if args.out:
        overrides.append(f"demo.output_dir={args.out}")
    cfg = load_config(args.config, overrides)
    report = run_demo(cfg, restart=args.restart)
    print(f"demo done: {report}")


# --- parser -------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memexrl", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    data = sub.add_parser("data", help="prepare data sets")
    data_sub = data.add_subparsers(dest="dataset", required=True)
    alf = data_sub.add_parser("alfworld", help="unpack (or download) the ALFWorld games")
    alf.add_argument("--dest", default=DEFAULT_DEST, help=f"where to put the data (default: {DEFAULT_DEST})")
    alf.add_argument("--archive", default=None, help="archive to unpack (default: $ALFWORLD_ARCHIVE, else download)")
    alf.set_defaults(func=cmd_data)

    rep = sub.add_parser("replay", help="run one episode with a scripted policy, print its trajectory JSON")
    rep.add_argument("--env", default="alfworld", help="environment (alfworld)")
    rep.add_argument("--game", required=True, help="game dir, game.tw-pddl path, or SPLIT:INDEX")
    rep.add_argument("--script", required=True, help='JSONL, one {"assistant": "<raw text>"} per turn')
    rep.add_argument("--config", default=None, help="YAML config (default: built-in defaults)")
    rep.add_argument("--out", default=None, help="write the trajectory JSON here instead of stdout")
    rep.add_argument("overrides", nargs="*", help="config overrides, section.key=value")
    rep.set_defaults(func=cmd_replay)

    exp = sub.add_parser("expert", help="Memex expert demonstrations (trajectory JSON lines) for SFT")
    exp.add_argument("--split", default=None, help="train, valid_seen, valid_unseen or valid")
    exp.add_argument("--games", type=int, default=None, help="play the first N games of the split")
    exp.add_argument("--reading-tasks", default="",
                     help="instead: the reader-expert on the reading tasks this games file lists (`memexrl lme tasks`)")
    exp.add_argument("--out", required=True, help="directory for demos.jsonl and report.json")
    exp.add_argument("--config", default=None, help="YAML config (default: built-in defaults)")
    exp.add_argument("--workers", type=non_negative_int, default=None, help="env worker processes (default: env.num_workers)")
    exp.add_argument("--order", choices=["sorted", "mixed"], default="mixed",
                     help="sorted: the split's sorted order (grouped by task type); mixed: task types in turn")
    exp.add_argument("--task-types", default="",
                     help="comma-separated task types to play ('' = all), e.g. those of train.task_types")
    exp.add_argument("--need-memory", action="store_true",
                     help="keep only the wins that needed memory: >= 1 accepted compression and >= 1 read, every "
                          "read a hit (a memory-needed game set for train.games_file / eval.games_file)")
    exp.add_argument("overrides", nargs="*", help="config overrides, section.key=value")
    exp.set_defaults(func=cmd_expert)

    sft = sub.add_parser("sft", help="SFT warm start on Memex demonstrations (TRL), then a quick check")
    sft.add_argument("--config", required=True, help="YAML config (e.g. configs/tiny-cpu.yaml)")
    sft.add_argument("--resume", action="store_true",
                     help="continue the run in sft.output_dir from its newest checkpoint (written every sft.save_steps)")
    sft.add_argument("overrides", nargs="*", help="config overrides, section.key=value (e.g. sft.demos=...)")
    sft.set_defaults(func=cmd_sft)

    tra = sub.add_parser("train", help="GRPO with segments and Memex rewards (from the SFT checkpoint)")
    tra.add_argument("--config", required=True, help="YAML config (e.g. configs/tiny-cpu.yaml)")
    tra.add_argument("--resume", action="store_true",
                     help="continue the run in train.output_dir from its newest checkpoint")
    tra.add_argument("--resume-from", default=None, metavar="DIR",
                     help="continue from this checkpoint (RUN/checkpoints/step-N) instead")
    tra.add_argument("--overwrite", action="store_true",
                     help="train.output_dir holds a run: delete its checkpoints, metrics, rollouts and plots, start over")
    tra.add_argument("--dry-run", action="store_true",
                     help="print the resolved plan (processes, batches, memory per process) without loading the model")
    tra.add_argument("--num-processes", type=positive_int, default=None, metavar="N",
                     help="--dry-run: training processes (default: launcher env, --accelerate-config, else 1)")
    tra.add_argument("--accelerate-config", default=None, metavar="YAML",
                     help="--dry-run: accelerate config to plan for (processes, DeepSpeed ZeRO stage)")
    tra.add_argument("--params", type=positive_int, default=None, metavar="N",
                     help="--dry-run: parameter count when the model's config.json is not available offline")
    tra.add_argument("--gpu-memory-gib", type=float, default=None, metavar="GIB",
                     help="--dry-run: memory of one GPU to check the plan against (default: the visible GPU's)")
    tra.add_argument("--force", action="store_true",
                     help="--dry-run: exit 0 even when the plan does not fit the GPU memory")
    tra.add_argument("overrides", nargs="*", help="config overrides, section.key=value")
    tra.set_defaults(func=cmd_train)

    eva = sub.add_parser("eval", help="evaluate a policy (ALFWorld), a memory module (LME-V2), compare runs")
    eva_sub = eva.add_subparsers(dest="benchmark", required=True)
    alf_eval = eva_sub.add_parser("alfworld", help="success and context use on ALFWorld games (eval_alfworld.json)")
    alf_eval.add_argument("--config", default=None, help="YAML config (its eval section; default: built-in defaults)")
    alf_eval.add_argument("--checkpoint", default=None, help="checkpoint dir, run dir or model name (eval.checkpoint)")
    alf_eval.add_argument("--split", default=None, help="train, valid_seen, valid_unseen or valid (eval.split)")
    alf_eval.add_argument("--games", type=non_negative_int, default=None, help="N games stratified by task type (eval.games)")
    alf_eval.add_argument("--task-types", default=None, help="comma-separated task types only (eval.task_types)")
    alf_eval.add_argument("--games-file", default=None,
                          help="play the games this file lists, e.g. DIR/games.txt of `memexrl expert` (eval.games_file)")
    alf_eval.add_argument("--agent", default=None, help="memex, full, truncate, summary or m2 (eval.agent)")
    alf_eval.add_argument("--samples", type=positive_int, default=None,
                          help="episodes per game, sampled at eval.temperature > 0 (eval.samples_per_game)")
    alf_eval.add_argument("--out", default=None, help="output directory (eval.output_dir)")
    alf_eval.add_argument("overrides", nargs="*", help="config overrides, section.key=value")
    alf_eval.set_defaults(func=cmd_eval_alfworld)
    cmp_eval = eva_sub.add_parser("compare", help="a markdown table and a PNG chart across eval result directories")
    cmp_eval.add_argument("out", help="directory for compare.md and compare.png")
    cmp_eval.add_argument("dirs", nargs="+", help="`eval alfworld` output directories")
    cmp_eval.set_defaults(func=cmd_eval_compare)
    add_lme_commands(sub, eva_sub)

    ben = sub.add_parser("bench", help="benchmarks that print side-by-side ratios")
    ben.add_argument("what", choices=["env", "store", "rollout", "trainer", "sft", "update", "sync", "step"],
                     help="what to measure")
    ben.add_argument("--split", default="valid_seen", help="games for env/rollout benches")
    ben.add_argument("--vllm-python", default="", metavar="PYTHON",
                     help="bench rollout: also roll out through a vllm serve from this Python (.venv-vllm/bin/python)")
    ben.add_argument("--games", type=positive_int, default=4, help="games for env/rollout benches")
    ben.add_argument("--steps", type=positive_int, default=200, help="env steps per worker count (bench env)")
    ben.add_argument("--blocks", type=positive_int, default=2000, help="blocks written (bench store)")
    ben.add_argument("--config", default=None, help="YAML config (bench rollout, step; trainer, sft, update: "
                                                    "configs/tiny-cpu.yaml)")
    ben.add_argument("--baseline", default="default", metavar="SETTINGS",
                     help="bench step: the 'before' step's overrides: default (the settings before the speed levers), "
                          "none (no before step) or section.key=value,...")
    ben.add_argument("--out", default="runs/bench-step", help="bench step: the run directories of its steps and "
                                                              "bench-step.json")
    ben.add_argument("--runs", type=positive_int, default=3, help="timed runs of each side (bench trainer, sft)")
    ben.add_argument("--bench-steps", type=positive_int, default=2, help="GRPO steps per run (bench trainer, update)")
    ben.add_argument("--prompts", type=positive_int, default=2, help="prompts per step (bench trainer)")
    ben.add_argument("--group", type=positive_int, default=4, help="G, completions per prompt (bench trainer)")
    ben.add_argument("--completion-tokens", type=positive_int, default=32, help="tokens per completion (bench trainer)")
    ben.add_argument("--segment-tokens", type=positive_int, default=2000, help="tokens per segment (bench update, sft)")
    ben.add_argument("--sync-hidden", type=positive_int, default=1024, help="hidden size of the synced model (bench sync)")
    ben.add_argument("--sync-layers", type=positive_int, default=4, help="decoder layers of the synced model (bench sync)")
    ben.add_argument("--sync-experts", type=positive_int, default=16, help="experts per layer of the synced model (bench sync)")
    ben.add_argument("--sync-bucket-mib", type=positive_int, default=16, help="bucket size in MiB (bench sync)")
    ben.add_argument("overrides", nargs="*", help="config overrides, section.key=value (bench trainer, update, step)")
    ben.set_defaults(func=cmd_bench)

    plo = sub.add_parser("plot", help="PNG curves of a run's metrics.jsonl, written to RUN_DIR/plots/")
    plo.add_argument("run_dir", help="run directory holding metrics.jsonl (e.g. runs/sft)")
    plo.set_defaults(func=cmd_plot)

    dem = sub.add_parser("demo", help="the whole pipeline at small scale, resumable: expert, SFT, GRPO, evals, report")
    dem.add_argument("--config", default="configs/demo.yaml", help="YAML config (its demo section sizes the stages)")
    dem.add_argument("--out", default=None, help="output directory (demo.output_dir, default runs/demo)")
    dem.add_argument("--quick", action="store_true", help="the smallest sizes that still show memory (QUICK_OVERRIDES)")
    dem.add_argument("--restart", action="store_true", help="remove the output directory and start over")
    dem.add_argument("overrides", nargs="*", help="config overrides, section.key=value")
    dem.set_defaults(func=cmd_demo)

    qua = sub.add_parser("quantize", help="INT4 W4A16 (RTN, symmetric, grouped) checkpoint that vLLM loads")
    qua.add_argument("--model", required=True, help="HF checkpoint directory (config.json + *.safetensors)")
    qua.add_argument("--out", required=True, help="new directory for the quantised checkpoint")
    qua.add_argument("--group-size", type=positive_int, default=128, help="input columns per scale (default: 128)")
    qua.add_argument("--experts-only", action="store_true",
                     help="quantise only the routed MoE experts, as slime's converter does")
    qua.set_defaults(func=cmd_quantize)
    return parser


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """argparse, with config overrides taken wherever they stand: `--out X a.b=1 --samples 3 c.d=2` gives
    overrides [a.b=1, c.d=2] in that order (plain argparse ends the positional list at the first option after it
    and rejects the rest). Anything else left over is argparse's usual error."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any(item.startswith("-") or "=" not in item for item in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    return_freed_memory()  # before any tensor: CPU runs would otherwise grow step by step (common/malloc.py)
    parser = build_parser()
    args = parse_command_line(parser, argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        args.func(args)
        end_process_group()
    except MemexError as exc:
        print(f"memexrl: error: {exc}", file=sys.stderr)
        return 2
    except RunStopped as exc:  # a preemption notice: the resume point is written (common/preemption.py)
        end_process_group()  # every rank stopped at the same step
        print(f"memexrl: {exc}", file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    except KeyboardInterrupt:
        print("memexrl: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
