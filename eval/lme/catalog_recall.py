"""`memexrl lme catalog-recall`: how much planted evidence the catalog's first k entries reach (issue 27).

At a question the Memex controller sees its archive only as the catalog (memory/catalog.py: bm25 of the question
over each block's index, description and first `memory.catalog_rank_chars` characters, then archive order) and
reads up to `max_reads` blocks back; the reader gets what it read. Two things bound its evidence recall: whether
the archive holds the planted strings at all, and whether the catalog ranks the blocks holding them first. This
command measures both, without a model, on a `memexrl lme synth` set (its synth_evidence.json):

- `--archive DIR`: the stores an `eval lme --memory memex` run wrote (DIR/memory_state/GROUP/memex_store.sqlite);
- `--all-pages`: every page of every haystack trajectory archived whole (the reading env's pages, named as the
  reader-expert's "pages" archive names them, envs/lme_records.py `page_entry`): the archive a policy that copies
  every page would leave, i.e. the ceiling of catalog reads at this page size.

Per k: evidence recall (the share of questions whose every planted string is in the first k blocks: the
`evidence_recall` diagnostic of `eval lme`), string recall (the mean share of a question's strings) and the mean
characters of the k blocks (what the reader would get, before the question's prompt).
"""

from __future__ import annotations

from pathlib import Path

from common.errors import MemexError
from envs.lme_records import heading_of, page_entry, render_state
from envs.reading import ReadingEnv
from eval.lme.data import load_lme
from eval.lme.harness import evidence_strings, group_key
from eval.lme.memory.memex import BLOCKS, STORE_FILE, insert_task
from memory.catalog import catalog_indices
from memory.store import BlockWrite, ExperienceStore, InMemoryStore, SQLiteStore
from rewards.reading import evidence_found


def all_pages_archive(trajectories: list[dict], states_per_page: int, state_max_chars: int) -> InMemoryStore:
    """Every page of `trajectories` (as ReadingEnv pages them at insert) as one explicit block each."""
    store, taken = InMemoryStore(), set()  # one namespace, `-2` on a taken name: the memex controller's default
    for trajectory in trajectories:
        env = ReadingEnv(insert_task(trajectory, states_per_page, state_max_chars, 1, 1))
        env.reset()
        for page in env.pages:
            text, *_ = env.step("next")
            states = [k for _, k in page]
            headings = list(dict.fromkeys(heading_of(render_state(trajectory, k, state_max_chars)) or f"state {k}"
                                          for k in states))
            index, what = page_entry(text, headings, states[0], states[-1], taken)
            taken.add(index)
            store.write_many([BlockWrite(index, text, "explicit", f"- {index}: {what}")], step=len(store))
    return store


def first_k(store: ExperienceStore, question: str, strings: list[str], ks: list[int], rank_chars: int,
            whole: str) -> dict:
    """{k: (all strings found, share found, characters)} for the catalog's first k blocks; "archive": `whole`, the
    whole store's text."""
    ranked = catalog_indices(store, question, max(ks), rank_chars)
    out = {}
    for k in ks:
        text = "\n".join(store.read(i).content for i in ranked[:k])
        found = evidence_found(text, strings)
        out[k] = (all(found), sum(found) / len(found), len(text))
    found = evidence_found(whole, strings)
    out["archive"] = (all(found), sum(found) / len(found), len(whole))
    return out


def catalog_recall(data_root: str | Path, haystack: str, archive: str | Path | None, ks: list[int],
                   rank_chars: int, states_per_page: int = 2, state_max_chars: int = 2000) -> dict:
    """{"questions": n, "skipped": groups without an archive, "rows": {k: (evidence recall, string recall, chars)}}."""
    root = Path(data_root)
    strings = evidence_strings(root)
    if not strings:
        raise MemexError(f"{root} has no synth_evidence.json: catalog-recall needs a `memexrl lme synth` set")
    data = load_lme(root)
    rows: list[dict] = []
    skipped = []
    for n, (ids, questions) in enumerate(data.haystack_groups(haystack)):
        if archive is None:
            store: ExperienceStore = all_pages_archive([data.trajectories[t] for t in ids], states_per_page,
                                                       state_max_chars)
        else:
            path = Path(archive) / "memory_state" / group_key(n, questions) / STORE_FILE
            if not path.is_file():
                skipped.append(group_key(n, questions))
                continue
            store = SQLiteStore(path, BLOCKS)
        whole = "\n".join(store.read(i).content for i in store.indices())  # once a group, not once a question
        rows += [first_k(store, q.question, strings[q.id], ks, rank_chars, whole)
                 for q in questions if strings.get(q.id)]
        store.close()
    if not rows:
        raise MemexError(f"no question of {haystack!r} has an archive under {archive}/memory_state "
                         "(an `eval lme --memory memex` output directory)")
    mean = {k: tuple(sum(r[k][j] for r in rows) / len(rows) for j in range(3)) for k in [*ks, "archive"]}
    return {"questions": len(rows), "skipped": skipped, "rows": mean}


def catalog_recall_command(data_root: str, haystack: str, archive: str | None, ks: list[int], rank_chars: int,
                           states_per_page: int, state_max_chars: int) -> str:
    """The table `memexrl lme catalog-recall` prints."""
    result = catalog_recall(data_root, haystack, archive, ks, rank_chars, states_per_page, state_max_chars)
    what = archive or f"every page archived ({states_per_page} states a page)"
    lines = [f"catalog reads of {what}: {result['questions']} questions of {haystack!r}, bm25 over "
             f"{'whole blocks' if rank_chars == 0 else f'the first {rank_chars} characters'}"
             + (f"; no archive for {', '.join(result['skipped'])}" if result["skipped"] else ""),
             "| blocks read | evidence recall | string recall | characters |", "|---|---|---|---|"]
    for k, (every, share, chars) in result["rows"].items():
        label = "the whole archive" if k == "archive" else f"first {k}"
        lines.append(f"| {label} | {every:.2f} | {share:.2f} | {chars:,.0f} |")
    return "\n".join(lines)
