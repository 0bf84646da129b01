"""The reading env (issue 27): tasks from a synthetic LME-V2 set, paging, the question in a fresh context with the
archive's catalog, and R_task = the share of the planted evidence that the blocks read after the question hold."""

import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from common.config import load_config  # noqa: E402
from common.errors import MemexError  # noqa: E402
from envs.data import read_games_file, resolve_game  # noqa: E402
from envs.reading import LAST_PAGE_NOTE, NO_MORE_STATES, QUESTION_HEADER, ReadingEnv  # noqa: E402
from eval.lme.synth import EVIDENCE_FILE, write_synthetic  # noqa: E402
from eval.lme.tasks import GAMES_FILE, reading_tasks, tasks_command  # noqa: E402
from memory.catalog import CATALOG_HEADER, shown_indices  # noqa: E402
from memory.parsing import render_tool_call as call  # noqa: E402
from rewards.memex import score_trajectories  # noqa: E402
from rewards.reading import evidence_found  # noqa: E402
from rollout.runner import make_renderer, open_envs, run_episodes  # noqa: E402
from rollout.scripted import ScriptedEngine  # noqa: E402


@pytest.fixture(scope="module")
def lme_set(tmp_path_factory):
    root = tmp_path_factory.mktemp("lme")
    write_synthetic(root, seed=3, n_trajectories_small=20, n_trajectories_medium=30, questions_per_type=1)
    return root


@pytest.fixture(scope="module")
def tasks_dir(lme_set, tmp_path_factory):
    out = tmp_path_factory.mktemp("tasks")
    summary = tasks_command(str(lme_set), str(out), distractors=2, states_per_page=2, state_max_chars=400,
                            max_reads=2, shortlist=12, seed=0, prefix="s3-")
    assert "7 reading tasks" in summary
    return out


def load(tasks_dir, question_type):
    (path,) = [p for p in tasks_dir.glob("*.json") if json.loads(p.read_text())["question_type"] == question_type]
    return path, json.loads(path.read_text())


def test_a_task_holds_its_evidence_among_distractors_in_timeline_order(lme_set):
    evidence = json.loads((lme_set / EVIDENCE_FILE).read_text())
    haystack = json.loads((lme_set / "haystacks/lme_v2_small.json").read_text())
    for task in reading_tasks(lme_set, 2, 2, 400, 2, 12, seed=0):
        ids = [t["id"] for t in task["trajectories"]]
        qid = task["id"]
        assert set(evidence[qid]["trajectories"]) <= set(ids) and len(ids) == len(evidence[qid]["trajectories"]) + 2
        assert ids == [t for t in haystack[qid] if t in ids]  # an edit still comes after the view it changes
        assert task["evidence"] == sorted({n[-1] for n in evidence[qid]["needles"]})


def test_pages_then_the_question_then_nothing_more(tasks_dir):
    path, task = load(tasks_dir, "static-environment")
    env = ReadingEnv(path)
    obs, info = env.reset()
    assert f"{len(task['trajectories'])} trajectories" in obs and task["question"] not in obs
    assert info["task"]["evidence"] == task["evidence"] and info["task"]["max_reads"] == 2
    pages = []
    while True:
        obs, _, terminated, _, info = env.step("next")
        assert not terminated
        if info.get("new_context"):
            break
        assert info["advances"] and task["question"] not in obs
        pages.append(obs)
    expected = sum(-(-len(t["states"]) // 2) for t in task["trajectories"])
    assert len(pages) == expected and pages[-1].endswith(LAST_PAGE_NOTE)
    assert sum(p.count("\nState ") + p.startswith("State ") for p in pages) == sum(len(t["states"])
                                                                                 for t in task["trajectories"])
    assert pages[0].startswith(f"Trajectory 1 of {len(task['trajectories'])}")
    assert obs.startswith(f"{QUESTION_HEADER} {task['question']}") and info["catalog"]["query"] == task["question"]
    assert env.step("next")[0] == NO_MORE_STATES and not env.step("look")[4]["advances"]


@pytest.mark.parametrize("content", ["{", json.dumps({"kind": "other"}), json.dumps({"kind": "memexrl-reading-task"})])
def test_a_broken_task_file_stops_with_one_message(tmp_path, content):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    with pytest.raises(MemexError, match="bad.json"):
        resolve_game(bad)
    (tmp_path / "games.txt").write_text("bad.json\n")
    with pytest.raises(MemexError, match="line 1"):
        read_games_file(tmp_path / "games.txt")


def test_the_games_file_names_tasks_relative_to_itself(tasks_dir, monkeypatch):
    monkeypatch.chdir("/")
    games = read_games_file(tasks_dir / GAMES_FILE)
    assert len(games) == 7 and all(g.is_file() and g.parent == tasks_dir for g in games)


def test_evidence_is_found_as_whole_words_only():
    assert evidence_found("Story Points 8; SKU SN-4922.", ["8", "SN-4922", "SN-49"]) == [True, True, False]
    assert evidence_found("812 chars", ["8"]) == [False]


def play(cfg, tok, game, script, workers=0):
    with open_envs(cfg, workers) as envs:
        (traj,) = run_episodes([("a", str(game))], ScriptedEngine(tok, {"a": script}), envs, make_renderer(tok, cfg), cfg)
    score_trajectories([traj], cfg.memory.threshold, cfg.reward)
    return traj


def compress(index, content, what):
    return call("CompressExperience", {"summary": f"Progress. Index map:\n- {index}: {what}",
                                       "db_blocks": [{"db_index": index, "db_content": content}]})


NEXT = call("execute_action", {"action": "next"})


@pytest.fixture(scope="module")
def cfg():
    return load_config(None, ["env.max_steps=80", "memory.threshold=100000"])


def test_what_is_read_after_the_question_is_the_reward(tasks_dir, cfg, smol_tokenizer):
    """The question's context holds only the question and the catalog; the blocks read after it are scored."""
    path, task = load(tasks_dir, "static-environment")
    pages = sum(-(-len(t["states"]) // 2) for t in task["trajectories"])
    facts = " ".join(f"value {n}" for n in task["evidence"])
    head = [NEXT] * pages + [compress("facts", facts, "the values seen"), compress("noise", "nothing", "other pages")]
    won = play(cfg, smol_tokenizer, path, head + [NEXT, call("ReadExperience", {"db_index": "facts"}),
                                                   call("finish", {})], workers=1)  # in an env worker process
    asked = won.task["question_step"]
    assert asked == pages + 2 and won.steps[asked].observation.startswith(QUESTION_HEADER)
    assert CATALOG_HEADER + "\n- facts: the values seen\n- noise: other pages" in won.steps[asked].observation
    system, question, *turns = won.segments[-1].messages  # the question's segment: no page survives into it
    assert won.segments[-1].first_step == asked + 1 and question["content"] == won.steps[asked].observation
    assert system["content"].startswith("You are a memory controller") and not any("State 0" in m["content"]
                                                                                for m in turns)
    assert len(won.segments) == 4  # reading, after each of the two compressions, the question
    assert won.reward["task"] == 1.0 and won.success and won.stats["num_redundant"] == 0

    wrong = play(cfg, smol_tokenizer, path, head + [NEXT, call("noise", {"state": "1"}),
                                                    call("ReadExperience", {"db_index": "noise"}), call("finish", {})])
    assert wrong.reward["task"] == 0.0 and not wrong.success
    misnamed = wrong.steps[asked + 1]  # a block's index used as the tool's name: told the call that reads it
    assert misnamed.format_error and misnamed.observation.startswith(
        "Format error: 'noise' is an archive index, not a tool; read it back with ReadExperience. Use exactly: "
        + call("ReadExperience", {"db_index": "noise"}))
    early = play(cfg, smol_tokenizer, path, [NEXT] * pages + [compress("facts", facts, "the values seen"),
                                                              call("ReadExperience", {"db_index": "facts"}),
                                                              call("finish", {})])  # never asked
    assert early.task.get("question_step") is None and early.reward["task"] == 0.0


def test_the_catalog_ranks_by_as_much_of_a_block_as_memory_catalog_rank_chars_says(tasks_dir, smol_tokenizer):
    """A whole-page block names what a question asks about past its head: with catalog_rank_chars 0 the catalog
    lists it first; with the default 200 its head does not match, and the catalog keeps the archive's order."""
    path, task = load(tasks_dir, "static-environment")
    pages = sum(-(-len(t["states"]) // 2) for t in task["trajectories"])
    page = "filler " * 40 + task["question"]  # the question's words from character 280 on
    script = [NEXT] * pages + [compress("head", "nothing here", "block one"), compress("page", page, "block two"),
                               NEXT, call("finish", {})]
    for rank_chars, order in ((200, "- head: block one\n- page: block two"),
                              (0, "- page: block two\n- head: block one")):
        cfg = load_config(None, ["env.max_steps=80", "memory.threshold=100000",
                                 f"memory.catalog_rank_chars={rank_chars}"])
        traj = play(cfg, smol_tokenizer, path, script)
        assert CATALOG_HEADER + "\n" + order in traj.steps[traj.task["question_step"]].observation
    with pytest.raises(MemexError, match="catalog_rank_chars must be >= 0"):
        load_config(None, ["memory.catalog_rank_chars=-1"])


def test_only_the_read_budget_reaches_the_reader(tasks_dir, cfg, smol_tokenizer):
    path, task = load(tasks_dir, "static-environment")
    pages = sum(-(-len(t["states"]) // 2) for t in task["trajectories"])
    blocks = [compress(f"b{k}", "nothing" if k < 2 else " ".join(task["evidence"]), f"block {k}") for k in range(3)]
    reads = [call("ReadExperience", {"db_index": i}) for i in ("b0", "b0", "b1", "b2")]  # b2 is the third block
    traj = play(cfg, smol_tokenizer, path, [NEXT] * pages + blocks + [NEXT, *reads, call("finish", {})])
    assert traj.stats["num_read"] == 4 and traj.reward["task"] == 0.0  # max_reads 2: b0 and b1 only


def test_train_env_selects_the_tasks(tasks_dir, alfworld_data):
    from training.state import MixedSampler, make_task_sampler

    games = str(tasks_dir / GAMES_FILE)
    reading = make_task_sampler(load_config(None, ["train.env=reading", f"train.reading_tasks={games}"]).train, "", 0)
    assert sorted(reading.next(7)) == sorted(str(g) for g in read_games_file(games))
    mixed = make_task_sampler(load_config(None, ["train.env=mixed", f"train.reading_tasks={games},{games}",
                                                 "train.reading_share=0.5", "train.num_games=4"]).train,
                              str(alfworld_data), 0)
    assert isinstance(mixed, MixedSampler) and len(mixed.reading.games) == 14 and len(mixed.alfworld.games) == 4
    with pytest.raises(MemexError, match="needs train.reading_tasks"):
        load_config(None, ["train.env=reading"])
    with pytest.raises(MemexError, match="reading_share"):
        load_config(None, ["train.env=mixed", f"train.reading_tasks={games}", "train.reading_share=1"])


@pytest.mark.slow
def test_grpo_trains_on_reading_tasks_unchanged(tasks_dir, tiny_eos_model, tmp_path, monkeypatch):
    """The trainer, pool, segmentation and GRPO run on the reading env as they do on ALFWorld (train.env)."""
    from memexrl.cli import main

    monkeypatch.setenv("WANDB_MODE", "disabled")
    run_dir = tmp_path / "run"
    settings = {"model.name": tiny_eos_model, "model.device": "cpu", "train.env": "reading",
                "train.reading_tasks": str(tasks_dir / GAMES_FILE), "train.finetune": "lora", "train.tasks_per_step": 1,
                "train.group_size": 4, "train.global_batch_size": 4, "train.micro_batch_size": 4, "train.steps": 1,
                "train.wandb": False, "train.output_dir": str(run_dir), "train.init_checkpoint": "",
                "env.max_steps": 3, "env.num_workers": 1, "rollout.max_new_tokens": 16, "memory.threshold": 200}
    assert main(["train", "--config", "configs/tiny-cpu.yaml", *[f"{k}={v}" for k, v in settings.items()]]) == 0
    (record,) = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rollouts = [json.loads(x) for x in (run_dir / "rollouts" / "step-1.jsonl").read_text().splitlines()]
    assert len(rollouts) == 4 and all(t["task_type"].startswith("reading/") and t["task"]["evidence"]
                                      for t in rollouts)
    assert all(t["reward"]["task"] == 0.0 for t in rollouts)  # a random model never gets to the question
    assert record["step"] == 1 and record["penalty_context"] > 0


def _reader_expert_wins(tasks_dir, tokenizer, archive: str, query: str = "evidence", min_won: int = 5,
                        anchor_cut: str = "chars") -> list:
    """The reader-expert's episodes on the fixture's tasks that brought every planted string to the reader, after
    checking what every one of them must show: accepted compressions, 1..max_reads hit reads, one page past T."""
    from sft.reader_expert import ReaderExpertEngine

    cfg = load_config(None, ["env.max_steps=60", "memory.threshold=1500", "rollout.max_new_tokens=400"])
    games = read_games_file(tasks_dir / GAMES_FILE)
    with open_envs(cfg, 1) as envs:
        trajs = run_episodes([(f"g{i}", str(g)) for i, g in enumerate(games)],
                             ReaderExpertEngine(tokenizer, archive=archive, query=query, anchor_cut=anchor_cut), envs,
                             make_renderer(tokenizer, cfg), cfg)
    score_trajectories(trajs, cfg.memory.threshold, cfg.reward)
    won = [t for t in trajs if t.success]
    assert len(won) >= min_won
    for t in won:
        s = t.stats
        assert s["num_compress"] >= 1 and s["num_compress_rejected"] == 0 and s["num_format_errors"] == 0
        assert 1 <= s["num_read"] <= t.task["max_reads"] and s["num_read_miss"] == 0 and t.end_reason == "finish"
        paging = max(step.working_tokens for step in t.steps[: t.task["question_step"]])
        assert paging <= cfg.memory.threshold + 400  # one page past the warning at most (reads may pass T)
    return won


def test_the_reader_expert_archives_the_evidence_and_reads_it_back(tasks_dir, smol_tokenizer):
    """The SFT warm start's demonstrations (sft/reader_expert.py): compress past 0.8 T, read what the question
    needs from the catalog; with 400-token turns it gets every planted string to the reader in most tasks."""
    _reader_expert_wins(tasks_dir, smol_tokenizer, "evidence")


def test_the_pages_reader_expert_archives_every_page_it_read_whole(tasks_dir, smol_tokenizer):
    """expert.reading_archive "pages": what is archived does not depend on the hidden evidence -- every page shown
    before the question is in the store verbatim, copied by anchor-mode blocks (no db_content written out) -- and
    the question still brings every planted string back in most tasks."""
    for t in _reader_expert_wins(tasks_dir, smol_tokenizer, "pages"):
        blocks, pages = _page_blocks_and_pages(t)
        assert blocks and all(set(b) == {"db_index", "start_anchor", "mid_anchor", "end_anchor"} for b in blocks)
        archived = "\n".join(t.experience.values())
        assert all(page in archived for page in pages if page.startswith(("State", "Trajectory")))


def _page_blocks_and_pages(t) -> tuple[list[dict], list[str]]:
    """The blocks a reader-expert episode archived before its question, and the pages it was shown."""
    from sft.reader_expert import page_text

    asked = t.task["question_step"]
    blocks = [b for s in t.steps[:asked] if s.tool == "CompressExperience" for b in s.arguments["db_blocks"]]
    return blocks, [page_text(s.observation) for s in t.steps[:asked] if s.tool == "execute_action"]


def test_line_cut_anchors_start_and_end_on_the_pages_own_boundaries(tasks_dir, smol_tokenizer):
    """expert.reading_anchor_cut "lines": an end anchor is the page's last whole lines (never the tail of a word of
    the line before, which a small policy memorises instead of copying) and a start anchor ends where a word does;
    the blocks are still accepted."""
    for t in _reader_expert_wins(tasks_dir, smol_tokenizer, "pages", anchor_cut="lines"):
        blocks, pages = _page_blocks_and_pages(t)
        assert blocks and all("db_content" not in b for b in blocks)
        for b in blocks:  # each block is one whole page (accepted: _reader_expert_wins), cut at its boundaries
            (page,) = [p for p in pages if p.startswith(b["start_anchor"]) and p.endswith(b["end_anchor"])]
            assert page.splitlines()[-len(b["end_anchor"].splitlines())].strip() == b["end_anchor"].splitlines()[0]
            assert page[len(b["start_anchor"]):][:1] in ("", " ", "\n")


PAGE_END = "(end of page)"


@pytest.fixture(scope="module")
def tasks_with_page_end(lme_set, tmp_path_factory):
    out = tmp_path_factory.mktemp("tasks-page-end")
    tasks_command(str(lme_set), str(out), distractors=2, states_per_page=2, state_max_chars=400, max_reads=2,
                  shortlist=12, seed=0, prefix="s3-", page_end=PAGE_END)
    return out


def test_a_page_end_line_closes_every_page_in_training_and_at_insert(tasks_with_page_end):
    from eval.lme.memory.memex import insert_task
    from sft.reader_expert import page_text

    path, task = load(tasks_with_page_end, "static-environment")
    env = ReadingEnv(path)
    env.reset()
    pages = [env.step("next")[0] for _ in env.pages]
    assert all(page_text(p).endswith("\n\n" + PAGE_END) for p in pages)
    assert pages[-1].endswith(PAGE_END + "\n\n" + LAST_PAGE_NOTE)  # the note comes after the page's end
    insert = ReadingEnv(insert_task(task["trajectories"][0], 2, 400, 1, 1, PAGE_END))
    insert.reset()
    assert insert.step("next")[0].endswith("\n\n" + PAGE_END)


def test_the_memex_controller_pages_as_its_training_tasks_did(tasks_with_page_end, tmp_path):
    """`eval lme --memory memex --config <a reading config>`: the controller takes the page format (page_end,
    states a page, the state cap) from the first task of train.reading_tasks, `--set` wins over it, and a config
    without reading tasks (the ALFWorld policy's) keeps the controller's defaults."""
    from eval.lme.memory.base import MemoryOptions
    from eval.lme.memory.memex import MemexMemory

    reading = load_config(None, ["train.env=reading", f"train.reading_tasks={tasks_with_page_end / GAMES_FILE}"])
    trained = MemexMemory(MemoryOptions(extra={"config": reading, "workdir": str(tmp_path / "a")}))
    assert (trained.page_end, trained.per_chunk, trained.max_chars) == (PAGE_END, 2, 400)
    # the list's first games file, as the trainer's pool reads it: blank items skipped
    listed = load_config(None, ["train.env=reading", f"train.reading_tasks= ,{tasks_with_page_end / GAMES_FILE},x"])
    from_list = MemexMemory(MemoryOptions(extra={"config": listed, "workdir": str(tmp_path / "d")}))
    assert from_list.page_end == PAGE_END
    overridden = MemexMemory(MemoryOptions(extra={"config": reading, "workdir": str(tmp_path / "b"), "page_end": ""}))
    assert (overridden.page_end, overridden.per_chunk) == ("", 2)
    alfworld = MemexMemory(MemoryOptions(extra={"config": load_config(None, []), "workdir": str(tmp_path / "c")}))
    assert (alfworld.page_end, alfworld.per_chunk, alfworld.max_chars) == ("", 2, 2000)


def test_last_line_anchors_end_at_the_constant_page_end(tasks_with_page_end, smol_tokenizer):
    """expert.reading_anchor_cut "last_line" on tasks with a page_end line: every page block's end anchor is that
    constant line (the tool's nearest-end rule makes it the page's own end), and each block is still one whole page."""
    for t in _reader_expert_wins(tasks_with_page_end, smol_tokenizer, "pages", anchor_cut="last_line"):
        blocks, pages = _page_blocks_and_pages(t)
        assert blocks and {b["end_anchor"] for b in blocks} == {PAGE_END}
        for b in blocks:
            (page,) = [p for p in pages if p.startswith(b["start_anchor"])]
            assert t.experience[b["db_index"]] == page


def test_the_catalog_reader_expert_reads_the_catalog_in_the_order_shown(tasks_dir, smol_tokenizer):
    """expert.reading_query "catalog": the question's reads do not depend on the hidden evidence either -- they are
    the catalog's first max_reads entries, in the order the question's observation lists them -- and they still
    bring every planted string back in half the tasks or more."""
    # 3 trajectories a task and 2 reads here (4 of the 7 tasks won): the first 2 of a catalog of ~12 pages
    for t in _reader_expert_wins(tasks_dir, smol_tokenizer, "pages", "catalog", min_won=3):
        asked = t.task["question_step"]
        shown = shown_indices(t.steps[asked].observation)
        assert len(shown) >= t.task["max_reads"]
        reads = [s.arguments["db_index"] for s in t.steps[asked + 1:] if s.tool == "ReadExperience"]
        assert reads == shown[: t.task["max_reads"]] and t.steps[-1].tool == "finish"


def test_an_index_is_described_by_its_own_index_map_line_only(tasks_dir, cfg, smol_tokenizer):
    """`pages` is not described by the line of `pages-2`, which it prefixes (memory/tools.py)."""
    path, task = load(tasks_dir, "static-environment")
    pages = sum(-(-len(t["states"]) // 2) for t in task["trajectories"])
    both = call("CompressExperience", {"summary": "Index map:\n- pages: the first pages\n- pages-2: the next pages",
                                       "db_blocks": [{"db_index": "pages", "db_content": "a"},
                                                     {"db_index": "pages-2", "db_content": "b"}]})
    traj = play(cfg, smol_tokenizer, path, [NEXT] * pages + [both, NEXT, call("finish", {})])
    question = traj.steps[traj.task["question_step"]].observation
    assert question.endswith(CATALOG_HEADER + "\n- pages: the first pages\n- pages-2: the next pages")
    assert shown_indices(question) == ["pages", "pages-2"]  # what the catalog-reading expert parses


def test_memexrl_expert_writes_reading_demonstrations_sft_can_take(tasks_dir, tmp_path, capsys):
    from memexrl.cli import main
    from sft.dataset import build_dataset

    out = tmp_path / "demos"
    assert main(["expert", "--reading-tasks", str(tasks_dir / GAMES_FILE), "--out", str(out), "--workers", "1",
                 "env.max_steps=60", "memory.threshold=1500", "rollout.max_new_tokens=400"]) == 0
    kept = read_games_file(out / GAMES_FILE)
    assert len(kept) >= 5 and all(g.parent == tasks_dir for g in kept)  # absolute paths of the tasks kept
    rows = build_dataset(str(out / "demos.jsonl"), 0.0, 4096)["train"]
    assert len(rows) > len(kept) and {r["task_type"].split("/")[0] for r in rows} == {"reading"}  # > 1 segment each
    assert main(["expert", "--out", str(tmp_path / "x")]) == 2
    assert "--reading-tasks" in capsys.readouterr().err
