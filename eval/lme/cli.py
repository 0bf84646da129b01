"""The LME-V2 commands of `memexrl` (design.md "CLI"): `lme synth|tasks|score|lafs|catalog-recall` and `eval lme`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common.argtypes import non_negative_int, positive_int
from common.errors import MemexError

API_KEY_HELP = "key of the OpenAI-compatible endpoints (default: $OPENAI_API_KEY; never written anywhere)"


def _chat(spec: str | None, model: str, sampling: dict | None, max_new_tokens: int, api_key: str = ""):
    from eval.lme.llm import make_chat

    return make_chat(spec, model, sampling, max_new_tokens, api_key) if spec else None


def cmd_lme_synth(args: argparse.Namespace) -> None:
    from eval.lme.synth import synth_command

    print(synth_command(args.out, args.seed, args.small, args.medium, args.per_type))


def cmd_lme_tasks(args: argparse.Namespace) -> None:
    from eval.lme.tasks import tasks_command

    print(tasks_command(args.data, args.out, args.distractors, args.states_per_page, args.state_max_chars,
                        args.max_reads, args.shortlist, args.seed, args.prefix, args.page_end))


def cmd_lme_score(args: argparse.Namespace) -> None:
    from eval.lme.llm import JUDGE_SAMPLING
    from eval.lme.scoring import score_command

    judge = _chat(args.judge, args.judge_model, JUDGE_SAMPLING, 256, args.api_key)
    print(score_command(args.eval_function, args.answer, args.prediction, judge, question=args.question))


def cmd_lme_lafs(args: argparse.Namespace) -> None:
    from eval.lme.lafs import lafs_command

    print(lafs_command(args.tier, args.point or [], args.result_dirs))


def cmd_lme_catalog_recall(args: argparse.Namespace) -> None:
    from eval.lme.catalog_recall import catalog_recall_command

    if (args.archive is None) == (not args.all_pages):
        raise MemexError("lme catalog-recall: give --archive DIR (an `eval lme --memory memex` output) or --all-pages")
    print(catalog_recall_command(args.data, args.haystack, args.archive, args.k or [1, 2, 3, 5], args.rank_chars,
                                 args.states_per_page, args.state_max_chars))


def module_settings(items: list[str], where: str) -> dict:
    """{key: value} of memory-module settings given as `key=value` items; a value that reads as JSON
    (numbers, booleans, lists) is parsed, any other is kept as text."""
    settings: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise MemexError(f"{where} {item!r}: use key=value")
        try:
            settings[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            settings[key.strip()] = value
    return settings


def memory_options(args: argparse.Namespace, reader, config):
    """MemoryOptions from the flags: the notes/controller LLM (default: the reader), the embedder, the
    memex controller's checkpoint and `config` (loaded from --config and the overrides by the caller, before the
    reader), `--set key=value` module settings."""
    from eval.lme.memory.base import MemoryOptions

    llm = _chat(args.memory_llm, args.memory_llm_model, {"temperature": 0.0, "max_tokens": 1024, "thinking": False},
                args.local_max_new_tokens, args.api_key) if args.memory_llm else reader
    extra = module_settings(args.set or [], "--set")
    if args.memory == "memex":
        extra.setdefault("config", config)
        extra.setdefault("checkpoint", args.checkpoint or extra["config"].eval.checkpoint)
    options = MemoryOptions(root=Path(args.data), llm=llm, controller=llm, extra=extra, api_key=args.api_key)
    if args.embedder:
        options.embedder = args.embedder
    return options


def cmd_eval_lme(args: argparse.Namespace) -> None:
    from common.config import load_config
    from eval.lme.data import load_lme
    from eval.lme.harness import LMERun, run_lme_eval
    from eval.lme.llm import JUDGE_SAMPLING, READER_SAMPLING, LocalChat
    from eval.lme.memory.base import memory_class
    from eval.lme.reader import ContextCounter

    memory_class(args.memory)  # bad input stops here, before any model loads
    load_lme(args.data).haystack(args.haystack)
    config = load_config(args.config, list(args.overrides)) if args.memory == "memex" else None  # a bad config too
    local = args.reader.startswith("local")
    max_new = args.reader_max_tokens or (args.local_max_new_tokens if local else READER_SAMPLING["max_tokens"])
    reader = _chat(args.reader, args.reader_model, {**READER_SAMPLING, "max_tokens": max_new}, max_new, args.api_key)
    judge = _chat(args.judge, args.judge_model, JUDGE_SAMPLING, 256, args.api_key)
    counter = None
    if isinstance(reader, LocalChat):
        counter = ContextCounter.text_only(reader.tokenizer)
    else:
        counter = ContextCounter.load(args.reader_tokenizer or reader.model)
    out = Path(args.out or f"runs/lme-{args.memory}-{Path(args.haystack).stem}")
    args.out = str(out)
    run = LMERun(Path(args.data), args.haystack, args.memory, out, reader, judge, counter,
                 args.max_context_tokens, args.questions, memory_options(args, reader, config))
    result = run_lme_eval(run)
    q, overall = result["memory_query"], result["overall"]
    print(f"LME-V2 {args.haystack} / {args.memory}: accuracy {100 * (overall['overall_full_set'] or 0):.1f}% "
          f"of {overall['count_all_questions']} questions; query latency mean {q['avg_seconds'] or 0:.3f} s "
          f"(p95 {q['p95_seconds'] or 0:.3f} s); written to {out}")


def add_lme_commands(sub, eval_sub) -> None:
    """Register `lme ...` under `sub` and `eval lme` under `eval_sub` (memexrl/cli.py)."""
    lme = sub.add_parser("lme", help="LongMemEval-V2: synthetic data, scoring, LAFS")
    lme_sub = lme.add_subparsers(dest="lme_command", required=True)
    syn = lme_sub.add_parser("synth", help="a small LME-V2 data set in the real schema")
    syn.add_argument("--out", required=True, help="new dataset root")
    syn.add_argument("--seed", type=non_negative_int, default=0)
    syn.add_argument("--small", type=positive_int, default=24, help="trajectories in the small haystack")
    syn.add_argument("--medium", type=positive_int, default=60, help="trajectories in the medium haystack")
    syn.add_argument("--per-type", type=positive_int, default=3, help="questions per question type")
    syn.set_defaults(func=cmd_lme_synth)
    tsk = lme_sub.add_parser("tasks", help="reading tasks for training the memory controller (one per question)")
    tsk.add_argument("--data", required=True, help="a `memexrl lme synth` set (its synth_evidence.json is needed)")
    tsk.add_argument("--out", required=True, help="directory for the task files and their games.txt")
    tsk.add_argument("--distractors", type=non_negative_int, default=2, help="other trajectories a task")
    tsk.add_argument("--states-per-page", type=positive_int, default=2, help="states each execute_action shows")
    tsk.add_argument("--state-max-chars", type=positive_int, default=2000, help="cap on a state's AXTree text")
    tsk.add_argument("--max-reads", type=positive_int, default=3, help="blocks read after the question")
    tsk.add_argument("--shortlist", type=positive_int, default=12, help="catalog lines shown with the question")
    tsk.add_argument("--seed", type=non_negative_int, default=0, help="which distractors")
    tsk.add_argument("--prefix", default="", help="before each task id (e.g. s1- for the set of seed 1)")
    tsk.add_argument("--page-end", default="", help="a line closing every page, e.g. '(end of page)' (an anchor "
                     "block's end anchor can name it; `eval lme --memory memex` shows the line of its config's train.reading_tasks)")
    tsk.set_defaults(func=cmd_lme_tasks)
    sco = lme_sub.add_parser("score", help="score one prediction with an eval_function spec: prints 1 or 0")
    sco.add_argument("--eval-function", required=True, help="e.g. 'norm_phrase_set_match|separators=;'")
    sco.add_argument("--answer", required=True, help="the gold answer")
    sco.add_argument("--prediction", required=True, help="the reader's reply (its last \\boxed{} is scored)")
    sco.add_argument("--question", default="", help="the question (LLM-judged specs)")
    sco.add_argument("--judge", default=None, help="judge LLM for llm_* specs: URL, local or local:PATH")
    sco.add_argument("--judge-model", default="", help="model name at the judge URL")
    sco.add_argument("--api-key", default="", help=API_KEY_HELP)
    sco.set_defaults(func=cmd_lme_score)
    laf = lme_sub.add_parser("lafs", help="latency-aware score (LAFS) with the reference points")
    laf.add_argument("result_dirs", nargs="*", help="`eval lme` output directories (their accuracy and latency)")
    laf.add_argument("--tier", choices=["small", "medium"], default=None)
    laf.add_argument("--point", action="append", help="ACC_PERCENT,LATENCY_S (repeatable)")
    laf.set_defaults(func=cmd_lme_lafs)
    cat = lme_sub.add_parser("catalog-recall", help="evidence the memex catalog's first k blocks and the "
                             "controller's own reads reach (no model)")
    cat.add_argument("--data", required=True, help="a `memexrl lme synth` set (its synth_evidence.json is needed)")
    cat.add_argument("--haystack", default="small", help="small, medium or a haystack JSON file")
    cat.add_argument("--archive", default=None, help="an `eval lme --memory memex` output directory")
    cat.add_argument("--all-pages", action="store_true", help="instead: every page archived whole (the ceiling)")
    cat.add_argument("--k", type=positive_int, action="append", help="blocks read (repeatable; default 1 2 3 5)")
    cat.add_argument("--rank-chars", type=non_negative_int, default=200,
                     help="memory.catalog_rank_chars: characters of a block bm25 reads (0: all)")
    cat.add_argument("--states-per-page", type=positive_int, default=2, help="--all-pages: states a page")
    cat.add_argument("--state-max-chars", type=positive_int, default=2000, help="--all-pages: cap on a state's text")
    cat.set_defaults(func=cmd_lme_catalog_recall)

    ev = eval_sub.add_parser("lme", help="LME-V2 accuracy and query latency of a memory module")
    ev.add_argument("--data", required=True, help="dataset root (the real layout; `memexrl lme synth` makes one)")
    ev.add_argument("--haystack", required=True, help="small, medium or a haystack JSON file")
    ev.add_argument("--memory", required=True, help="none, rag, rag_notes, agentrunbook_r, m2 or memex")
    ev.add_argument("--reader", default="local", help="OpenAI-compatible URL, local (SmolLM2) or local:PATH")
    ev.add_argument("--reader-model", default="", help="model name at the reader URL (default: the server's)")
    ev.add_argument("--reader-tokenizer", default="", help="tokenizer for the 200K budget (default: reader model)")
    ev.add_argument("--reader-max-tokens", type=non_negative_int, default=0, help="answer tokens (default: 20000; local 128)")
    ev.add_argument("--local-max-new-tokens", type=positive_int, default=128, help="generation cap of local LLMs")
    ev.add_argument("--judge", default=None, help="judge LLM for the llm_* eval functions: URL, local, local:PATH")
    ev.add_argument("--judge-model", default="")
    ev.add_argument("--api-key", default="", help=API_KEY_HELP)
    ev.add_argument("--memory-llm", default=None, help="LLM writing notes/events/controller (default: the reader)")
    ev.add_argument("--memory-llm-model", default="")
    ev.add_argument("--embedder", default="", help="sentence-transformers name/path or embeddings URL")
    ev.add_argument("--checkpoint", default=None, help="memex: the controller policy (checkpoint, run dir, model)")
    ev.add_argument("--config", default=None, help="memex: the policy's memexrl YAML config")
    ev.add_argument("--set", action="append", help="module setting key=value (e.g. max_reads=3)")
    ev.add_argument("--questions", type=non_negative_int, default=0, help="only the first N questions")
    ev.add_argument("--max-context-tokens", type=positive_int, default=200_000, help="reader memory budget")
    ev.add_argument("--out", default=None, help="output directory (default runs/lme-MEMORY-HAYSTACK)")
    ev.add_argument("overrides", nargs="*", help="memex: config overrides, section.key=value")
    ev.set_defaults(func=cmd_eval_lme)
