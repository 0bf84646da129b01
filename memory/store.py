"""The Memex experience store D: index -> content (memex.md, "Working context and the experience store").

An index is 1-64 characters of ``[A-Za-z0-9_-]`` chosen by the agent; ``CompressExperience`` writes
blocks and ``ReadExperience`` reads them back verbatim. Beyond the paper, every write keeps metadata
(agent step, explicit/anchor mode, sha256, a version chain) and the store has two backends behind one
interface:

- :class:`InMemoryStore`: a per-episode dict, as in the authors' release; the training default.
- :class:`SQLiteStore`: a file (WAL, ``synchronous=FULL``) that survives the process, with several
  namespaces per file (e.g. one memory per LongMemEval haystack).

Shared logic (validation, versioning, the bm25 ``suggest`` fallback) lives in :class:`ExperienceStore`;
a backend only supplies a handful of storage primitives.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import hashlib
import logging
import os
import re
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import MemexError

INDEX_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
MODES = ("explicit", "anchor")
SUGGEST_CONTENT_CHARS = 200


def is_valid_index(index: object) -> bool:
    """True when ``index`` is a str of 1-64 characters of [A-Za-z0-9_-] (memex.md)."""
    return isinstance(index, str) and INDEX_PATTERN.fullmatch(index) is not None


@dataclass(frozen=True)
class Block:
    """One stored version of an experience block."""

    index: str
    content: str
    step: int  # agent step at which it was written
    mode: str  # "explicit" | "anchor" (memex.md, CompressExperience block modes)
    sha256: str  # hex sha256 of content (utf-8)
    version: int  # 1 for the first write of this index, then 2, 3, ...
    supersedes: int | None  # the version it replaced (None for the first write)
    description: str = ""  # short description (e.g. the summary line mentioning it); used by suggest()


@dataclass(frozen=True)
class BlockWrite:
    """One block to write (the resolved content of a CompressExperience db_block)."""

    index: str
    content: str
    mode: str = "explicit"
    description: str = ""


def _validate(blocks: list[BlockWrite], step: int) -> None:
    """Raise MemexError for anything memex.md rejects in one CompressExperience call."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise MemexError(f"step must be a non-negative int (the agent step), got {step!r}")
    seen: set[str] = set()
    for block in blocks:
        if not isinstance(block, BlockWrite):
            raise MemexError(f"write_many takes BlockWrite objects, got {type(block).__name__}")
        if not is_valid_index(block.index):
            raise MemexError(
                f"invalid experience index {block.index!r}: use 1-64 characters of letters, digits, '_' or '-'"
            )
        if block.index in seen:
            raise MemexError(
                f"index {block.index!r} appears twice in one write; give each block its own index"
            )
        seen.add(block.index)
        if not isinstance(block.content, str):
            raise MemexError(
                f"content of block {block.index!r} must be a str, got {type(block.content).__name__}"
            )
        if block.mode not in MODES:
            raise MemexError(
                f"mode of block {block.index!r} must be 'explicit' or 'anchor', got {block.mode!r}"
            )
        if not isinstance(block.description, str):
            raise MemexError(f"description of block {block.index!r} must be a str")


# --- suggest(): bm25 over index words + description + the start of the content -------------------------

_WORD = re.compile(r"[a-z0-9]+")
_CAMEL = re.compile(r"(?<=[a-z])(?=[A-Z])")


def _bm25s():
    """bm25s, its logger quietened: bm25s sets it to DEBUG at import, a line for every index it builds."""
    import bm25s

    logging.getLogger("bm25s").setLevel(logging.WARNING)
    return bm25s


@functools.cache
def _stopwords() -> frozenset[str]:
    _bm25s()
    from bm25s.stopwords import STOPWORDS_EN

    return frozenset(STOPWORDS_EN)


def _tokenize(text: str, stopwords: frozenset[str]) -> list[str]:
    """Lower-cased words; '_', '-' and camelCase split words; a light plural strip ("apples" -> "apple")."""
    tokens = []
    for word in _WORD.findall(_CAMEL.sub(" ", text).lower()):
        if word in stopwords:
            continue
        if len(word) > 4 and word.endswith("ies"):
            word = word[:-3] + "y"
        elif len(word) > 3 and word.endswith("s") and not word.endswith("ss"):
            word = word[:-1]
        tokens.append(word)
    return tokens


def _suggest_text(block: Block, content_chars: int) -> str:
    content = block.content[:content_chars] if content_chars > 0 else block.content
    return f"{block.index} {block.description} {content}"


class ExperienceStore(abc.ABC):
    """The experience store D (memex.md): validation, versioning and suggest over backend primitives.

    Reads always return the newest version of an index; rewriting an index adds a version that
    supersedes the previous one, and :meth:`history` keeps them all.
    """

    _suggest_cache: tuple[tuple[Any, ...], Any, list[str]] | None = None

    # --- backend primitives ----------------------------------------------------------------------------
    @abc.abstractmethod
    def _latest(self, index: str) -> Block | None:
        """The newest version of ``index``, or None."""

    @abc.abstractmethod
    def _versions(self, index: str) -> list[Block]:
        """All versions of ``index``, oldest first."""

    @abc.abstractmethod
    def _current(self) -> list[Block]:
        """The newest version of every index, in order of first write."""

    @abc.abstractmethod
    def _insert(self, blocks: list[Block]) -> None:
        """Store new versions (called inside :meth:`_transaction`)."""

    @abc.abstractmethod
    def indices(self) -> list[str]:
        """Current indices in order of first write."""

    def _transaction(self) -> contextlib.AbstractContextManager[None]:
        """All-or-nothing scope for one :meth:`write_many` (nothing to do for a dict)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def close(self) -> None:
        """Release resources; the store must not be used afterwards."""

    # --- the interface ---------------------------------------------------------------------------------
    def write_many(self, blocks: list[BlockWrite], *, step: int) -> list[Block]:
        """Write the blocks of one CompressExperience call atomically: all or nothing.

        Every block is validated first (invalid index, an index repeated within the call, a bad mode
        -> MemexError, and nothing is written), as memex.md lists for CompressExperience.
        """
        blocks = list(blocks)
        _validate(blocks, step)
        if not blocks:
            return []
        with self._transaction():
            written = []
            for w in blocks:
                previous = self._latest(w.index)
                version = 1 if previous is None else previous.version + 1
                written.append(
                    Block(
                        index=w.index,
                        content=w.content,
                        step=step,
                        mode=w.mode,
                        sha256=hashlib.sha256(w.content.encode("utf-8")).hexdigest(),
                        version=version,
                        supersedes=None if previous is None else previous.version,
                        description=w.description,
                    )
                )
            self._insert(written)
        return written

    def write(
        self, index: str, content: str, *, step: int, mode: str = "explicit", description: str = ""
    ) -> Block:
        """Write one block (``write_many`` of one)."""
        return self.write_many([BlockWrite(index, content, mode, description)], step=step)[0]

    def read(self, index: str) -> Block | None:
        """The newest version of ``index`` (what ReadExperience returns), or None on a miss."""
        return self._latest(index) if is_valid_index(index) else None

    def history(self, index: str) -> list[Block]:
        """All versions of ``index``, oldest first ([] when it was never written)."""
        return self._versions(index) if is_valid_index(index) else []

    def as_dict(self) -> dict[str, str]:
        """{index: newest content} in order of first write (the trajectory JSON's ``experience``)."""
        return {b.index: b.content for b in self._current()}

    def suggest(self, query: str, k: int = 3, content_chars: int = SUGGEST_CONTENT_CHARS) -> list[str]:
        """Up to ``k`` existing indices related to ``query``, best first: the fallback for a ReadExperience miss.

        Exact index reads come first; when they miss, a semantic search over the store keeps the
        evidence reachable (seed notes, section 9.3: "exact read first, then semantic search"). bm25
        (bm25s) scores "index words + description + first `content_chars` characters of content" (0: all of
        it; the catalog's ranking, memory/catalog.py, may read more than the fallback's 200) of the current
        blocks; only indices scoring > 0 are returned, so [] for an empty store or an unrelated query.
        """
        if k <= 0:
            return []
        current = self._current()
        if not current:
            return []
        key = (content_chars, *((b.index, b.version) for b in current))
        if self._suggest_cache is None or self._suggest_cache[0] != key:
            retriever = _bm25s().BM25()
            stop = _stopwords()
            # An empty document gets a placeholder token so that bm25s sees no empty corpus.
            docs = [_tokenize(_suggest_text(b, content_chars), stop) or ["\x00"] for b in current]
            retriever.index(docs, show_progress=False)
            self._suggest_cache = (key, retriever, [b.index for b in current])
        _, retriever, order = self._suggest_cache
        tokens = [t for t in _tokenize(query, _stopwords()) if t in retriever.vocab_dict]
        if not tokens:
            return []
        scores = retriever.get_scores(tokens)
        ranked = sorted(range(len(order)), key=lambda i: (-float(scores[i]), i))
        return [order[i] for i in ranked[:k] if scores[i] > 0]

    def __len__(self) -> int:
        return len(self.indices())

    def __contains__(self, index: object) -> bool:
        return isinstance(index, str) and self.read(index) is not None

    def __enter__(self) -> ExperienceStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InMemoryStore(ExperienceStore):
    """A per-episode dict of version lists, as the release keeps D; the training default."""

    def __init__(self) -> None:
        self._blocks: dict[str, list[Block]] = {}  # insertion order = order of first write

    def _latest(self, index: str) -> Block | None:
        versions = self._blocks.get(index)
        return versions[-1] if versions else None

    def _versions(self, index: str) -> list[Block]:
        return list(self._blocks.get(index, ()))

    def _current(self) -> list[Block]:
        return [versions[-1] for versions in self._blocks.values()]

    def _insert(self, blocks: list[Block]) -> None:
        for block in blocks:
            self._blocks.setdefault(block.index, []).append(block)

    def indices(self) -> list[str]:
        return list(self._blocks)

    def close(self) -> None:
        """Nothing to release: the blocks live as long as the object."""


_SCHEMA = """
CREATE TABLE IF NOT EXISTS memex_blocks (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    namespace TEXT NOT NULL,
    "index" TEXT NOT NULL,
    version INTEGER NOT NULL,
    content TEXT NOT NULL,
    step INTEGER NOT NULL,
    mode TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    supersedes INTEGER,
    description TEXT NOT NULL DEFAULT '',
    created_at REAL NOT NULL,
    UNIQUE (namespace, "index", version)
)
"""
_COLUMNS = (
    "id", "namespace", "index", "version", "content", "step", "mode", "sha256", "supersedes",
    "description", "created_at",
)  # fmt: skip
_BLOCK_FIELDS = '"index", content, step, mode, sha256, version, supersedes, description'


class SQLiteStore(ExperienceStore):
    """A file-backed store: one table of block versions, WAL journal, ``synchronous=FULL``.

    A write returns only after its transaction is on disk, so a crash (even SIGKILL) loses no
    reported write. Reopening the same path gives the same blocks; several namespaces may share
    one file. Only plain SQL values are stored (no pickles).
    """

    def __init__(self, path: str | os.PathLike[str], namespace: str = "default") -> None:
        if not isinstance(namespace, str) or not namespace:
            raise MemexError(f"namespace must be a non-empty string, got {namespace!r}")
        self.path = str(path)
        self.namespace = namespace
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        if self.path != ":memory:":
            parent = Path(self.path).resolve().parent
            if not parent.is_dir():
                raise MemexError(
                    f"cannot create the experience store {self.path}: directory {parent} does not exist; "
                    "create it first or choose another path"
                )
        try:
            conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as err:
            raise MemexError(f"cannot open the experience store {self.path} ({err}); check the path") from err
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute(_SCHEMA)
            columns = tuple(row[1] for row in conn.execute("PRAGMA table_info(memex_blocks)"))
        except sqlite3.DatabaseError as err:
            conn.close()
            raise MemexError(
                f"{self.path} is not a usable SQLite experience store ({err}); "
                "pass the path of a new file or of a store written by SQLiteStore"
            ) from err
        if columns != _COLUMNS:
            conn.close()
            raise MemexError(
                f"{self.path} has a table memex_blocks with columns {columns}, not an experience store's "
                f"{_COLUMNS}; use another file"
            )
        self._conn = conn

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise MemexError(f"the experience store {self.path} is closed; open a new SQLiteStore")
        return self._conn

    def _select(self, where: str, args: tuple[Any, ...]) -> list[Block]:
        with self._lock:
            rows = self._db().execute(f"SELECT {_BLOCK_FIELDS} FROM memex_blocks b WHERE {where}", args)
            return [Block(*row) for row in rows.fetchall()]

    def _latest(self, index: str) -> Block | None:
        rows = self._select(
            'namespace = ? AND "index" = ? ORDER BY version DESC LIMIT 1', (self.namespace, index)
        )
        return rows[0] if rows else None

    def _versions(self, index: str) -> list[Block]:
        return self._select('namespace = ? AND "index" = ? ORDER BY version', (self.namespace, index))

    def _current(self) -> list[Block]:
        # Newest version of each index, ordered by the row id of its first version.
        return self._select(
            "namespace = ? AND version = (SELECT MAX(version) FROM memex_blocks m WHERE m.namespace = b.namespace"
            ' AND m."index" = b."index") ORDER BY (SELECT id FROM memex_blocks f WHERE f.namespace = b.namespace'
            ' AND f."index" = b."index" AND f.version = 1)',
            (self.namespace,),
        )

    def indices(self) -> list[str]:
        with self._lock:
            rows = self._db().execute(
                'SELECT "index" FROM memex_blocks WHERE namespace = ? AND version = 1 ORDER BY id',
                (self.namespace,),
            )
            return [row[0] for row in rows.fetchall()]

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        # BEGIN IMMEDIATE takes the write lock before versions are read, so two writers never
        # compute the same version number.
        with self._lock:
            conn = self._db()
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def _insert(self, blocks: list[Block]) -> None:
        now = time.time()
        self._db().executemany(
            'INSERT INTO memex_blocks (namespace, "index", version, content, step, mode, sha256, supersedes,'
            " description, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                (self.namespace, b.index, b.version, b.content, b.step, b.mode, b.sha256, b.supersedes,
                 b.description, now)
                for b in blocks
            ],
        )  # fmt: skip

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def open_store(backend: str, path: str = "", namespace: str = "default") -> ExperienceStore:
    """Make a store by name: ``"memory"`` (per episode) or ``"sqlite"`` (needs ``path``)."""
    if backend == "memory":
        return InMemoryStore()
    if backend == "sqlite":
        if not path:
            raise MemexError("the sqlite experience store needs a path, e.g. path='runs/memory.db'")
        return SQLiteStore(path, namespace)
    raise MemexError(f"unknown experience store backend {backend!r}; use 'memory' or 'sqlite'")
