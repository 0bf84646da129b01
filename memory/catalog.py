"""The catalog of the experience store: what a question phase shows of the archive (paper 4.3, the index map).

At a question (the reading env, envs/reading.py; the LME-V2 memory controller's query), the working context
is fresh: the agent sees the archive only through this list of `db_index: description` lines (the
description is the summary's index-map line that named the block when it was archived, memory/tools.py).
With more blocks than `shortlist`, the ones bm25 relates to the question come first (`ExperienceStore.suggest`,
as a 500-trajectory archive does not fit in a prompt), then the rest in the order they were archived. bm25 reads a
block's index, description and the first `rank_chars` characters of its content (`memory.catalog_rank_chars`;
0: all of it).
"""

from __future__ import annotations

import re

from memory.store import INDEX_PATTERN, SUGGEST_CONTENT_CHARS, ExperienceStore
from memory.tools import index_line_key

CATALOG_HEADER = "Archived blocks (db_index: what it holds):"
EMPTY_CATALOG = "(the archive is empty: nothing was archived)"
_LINE = re.compile(rf"^- ({INDEX_PATTERN.pattern}): ", re.MULTILINE)  # catalog_text's `- index: description` lines


def catalog_indices(store: ExperienceStore, query: str, shortlist: int,
                    rank_chars: int = SUGGEST_CONTENT_CHARS) -> list[str]:
    """At most `shortlist` indices: those bm25 relates to `query` first, then the others in archive order."""
    suggested = store.suggest(query, shortlist, content_chars=rank_chars)
    rest = [i for i in store.indices() if i not in suggested]
    return (suggested + rest)[:shortlist]


def what_it_holds(index: str, description: str) -> str:
    """The description without the `- index:` the index-map line it came from starts with."""
    text = index_line_key(index).sub("", description.strip(), count=1)
    return text or "archived block"


def render_catalog(store: ExperienceStore, shown: list[str]) -> str:
    """The catalog as the agent reads it: a header line, then one `- index: description` line for each of `shown`."""
    lines = [f"- {i}: {what_it_holds(i, store.read(i).description)}" for i in shown]
    return CATALOG_HEADER + "\n" + ("\n".join(lines) or EMPTY_CATALOG)


def catalog_text(store: ExperienceStore, query: str, shortlist: int, rank_chars: int = SUGGEST_CONTENT_CHARS) -> str:
    """The catalog of `query`: its `catalog_indices`, rendered."""
    return render_catalog(store, catalog_indices(store, query, shortlist, rank_chars))


def shown_indices(text: str) -> list[str]:
    """The indices a catalog in `text` (an observation holding catalog_text) lists, in the order shown."""
    return _LINE.findall(text.split(CATALOG_HEADER, 1)[1]) if CATALOG_HEADER in text else []
