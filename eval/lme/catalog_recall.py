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

With `--archive`, the blocks the controller itself read at each question (DIR/work/GROUP/query_episodes.jsonl, its
`read` list) are a row too, and each question the reads miss is placed where its evidence was lost: a planted
string never archived, or archived and the controller read none of the blocks holding the strings, or read some.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

from common.errors import MemexError
from envs.lme_records import heading_of, page_entry, render_state
from envs.reading import ReadingEnv
from eval.lme.data import load_lme
from eval.lme.harness import evidence_strings, group_key
from eval.lme.memory.memex import BLOCKS, QUERY_EPISODES_FILE, STORE_FILE, insert_task
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


MISSES = ("a string never archived", "archived, none of it read", "archived, partly read", "never asked")


def found_in(text: str, strings: list[str]) -> tuple[bool, float, int]:
    """(every string found, the share found, characters) of `text`."""
    found = evidence_found(text, strings)
    return all(found), sum(found) / len(found), len(text)


def first_k(store: ExperienceStore, question: str, strings: list[str], ks: list[int], rank_chars: int,
            whole: str, read: list[str] | None = None, asked: bool = True) -> dict:
    """{k: (all strings found, share found, characters)} for the catalog's first k blocks; "archive": `whole`, the
    whole store's text; with `read` (the controller's reads), "reads": the same of those blocks and "miss": where
    the evidence was lost (one of MISSES; None when every string was read); `asked` False: the question has no
    query episode (the evaluation stopped before it), so `read` is empty, a "never asked" miss."""
    ranked = catalog_indices(store, question, max(ks), rank_chars)
    out: dict = {k: found_in("\n".join(store.read(i).content for i in ranked[:k]), strings) for k in ks}
    out["archive"] = found_in(whole, strings)
    if read is not None:
        blocks = [store.read(i) for i in read]
        out["reads"] = found_in("\n".join(b.content for b in blocks if b is not None), strings)
        out["distinct_reads"] = len(read)
        out["miss"] = (None if out["reads"][0] else MISSES[3] if not asked else MISSES[0] if not out["archive"][0]
                       else MISSES[1] if out["reads"][1] == 0 else MISSES[2])
    return out


def controller_reads(path: Path) -> dict[str, list[list[str]]] | None:
    """{question text: [the blocks read, one list per time it was asked]} from a query_episodes.jsonl; None if the
    file is not there (an archive saved without its work directory)."""
    if not path.is_file():
        return None
    reads: dict[str, list[list[str]]] = defaultdict(list)
    with path.open() as lines:
        for n, line in enumerate(lines, 1):
            try:
                episode = json.loads(line)
                reads[str(episode["question"])].append([str(i) for i in episode["read"]])
            except (ValueError, KeyError, TypeError) as e:
                raise MemexError(f"{path}:{n} is not a question episode ({e}): the file is damaged; run `eval lme` "
                                 "again or pass an --archive without its work/ directory") from None
    return reads


def catalog_recall(data_root: str | Path, haystack: str, archive: str | Path | None, ks: list[int],
                   rank_chars: int, states_per_page: int = 2, state_max_chars: int = 2000) -> dict:
    """{"questions": n, "skipped": groups without an archive, "rows": {k: (evidence recall, string recall, chars)}}."""
    root = Path(data_root)
    strings = evidence_strings(root)
    if not strings:
        raise MemexError(f"{root} has no synth_evidence.json: catalog-recall needs a `memexrl lme synth` set")
    data = load_lme(root)
    rows: list[dict] = []
    skipped, no_reads = [], []
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
        reads = None if archive is None else controller_reads(
            Path(archive) / "work" / group_key(n, questions) / QUERY_EPISODES_FILE)
        if archive is not None and reads is None:
            no_reads.append(group_key(n, questions))
        whole = "\n".join(store.read(i).content for i in store.indices())  # once a group, not once a question
        for q in questions:
            if strings.get(q.id):
                asked = reads is not None and bool(reads.get(q.question))
                read = None if reads is None else reads[q.question].pop(0) if asked else []
                rows.append(first_k(store, q.question, strings[q.id], ks, rank_chars, whole, read, asked))
        store.close()
    if not rows:
        raise MemexError(f"no question of {haystack!r} has an archive under {archive}/memory_state "
                         "(an `eval lme --memory memex` output directory)")
    with_reads = all("reads" in r for r in rows)
    mean = {k: tuple(sum(r[k][j] for r in rows) / len(rows) for j in range(3))
            for k in [*ks, "archive", *(["reads"] if with_reads else [])]}
    result = {"questions": len(rows), "skipped": skipped, "no_reads": no_reads, "rows": mean}
    if with_reads:
        result["distinct_reads"] = sum(r["distinct_reads"] for r in rows) / len(rows)
        result["misses"] = {m: c for m, c in Counter(r["miss"] for r in rows).items() if m is not None}
    return result


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
        label = {"archive": "the whole archive",
                 "reads": f"the controller's reads ({result.get('distinct_reads', 0):.2f} distinct a question)"}
        lines.append(f"| {label.get(k, f'first {k}')} | {every:.2f} | {share:.2f} | {chars:,.0f} |")
    if "misses" in result:
        lines.append("questions the controller's reads miss: " + (", ".join(
            f"{result['misses'].get(m, 0)} {m}" for m in MISSES) if result["misses"] else "none"))
    elif result.get("no_reads"):
        lines.append(f"no query episodes (work/GROUP/{QUERY_EPISODES_FILE}) for {', '.join(result['no_reads'])}: "
                     "the controller's reads are not shown")
    return "\n".join(lines)
