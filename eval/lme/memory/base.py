"""The LME-V2 memory API, its options, the registry, and the `none` baseline (lme-v2.md "Memory API").

A memory module gets every haystack trajectory through `insert(trajectory)` (the dict of its
`trajectories.jsonl` line, in haystack order) and answers `query(question, question_image)` with
the reader's memory context: a list of items `{"type": "text" | "image", "value": str}`, text
non-empty, an image value an existing file path. A built memory can be saved to a directory and
loaded back, so that a haystack is inserted once and reused; saved memories are JSON plus numpy
`.npz` arrays only (never pickle), and a missing or broken one is a `MemexError` that says to
rebuild it.

Modules register under their CLI name (`@register`); `make_memory(name, options)` imports the
module files first, so registration happens without the caller importing them:

| name | file | lme-v2.md |
|---|---|---|
| `none` | here | "no retrieval" baseline: an empty context |
| `rag`, `rag_notes` | rag.py | "RAG query -> slice" and "... -> slice + notes" |
| `agentrunbook_r` | agentrunbook_r.py | "AgentRunbook-R" |
| `m2` | m2.py | M² insight bank (m2.md) |
| `memex` | memex.py | this project's memory |
"""

from __future__ import annotations

import importlib
import json
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from common.errors import MemexError
from eval.embeddings import DEFAULT_EMBEDDER
from eval.lme.llm import ChatLLM
from eval.m2_insights import TOP_K as M2_TOP_K

log = logging.getLogger(__name__)

SAVE_FORMAT = "memexrl-lme-memory/1"
STATE_FILE, ARRAYS_FILE = "memory.json", "arrays.npz"

# CLI name -> the module file (under eval/lme/memory/) that registers it.
MODULE_FILES = {"none": "base", "rag": "rag", "rag_notes": "rag", "agentrunbook_r": "agentrunbook_r",
                "m2": "m2", "memex": "memex"}
OPTIONAL_FILES = {"memex"}  # may not exist yet: the registry works without it


@dataclass
class MemoryOptions:
    """What a memory module is built with; every default is the paper's (lme-v2.md "Baselines", the
    public configs `evaluation/memory_configs/*.json`)."""

    root: Path | None = None  # the dataset root: screenshots resolve against it (lme-v2.md "Data layout")
    embedder: str = DEFAULT_EMBEDDER  # a sentence-transformers name, or an OpenAI-compatible http(s):// URL
    llm: ChatLLM | None = None  # writes notes, events and M² insights at insert (None: rule-based fallbacks)
    controller: ChatLLM | None = None  # AgentRunbook-R's query-bundle writer; None: the `llm`
    slice_radius: int = 1  # a slice is states i-1..i+1 around each state i
    slice_top_k: int = 6  # RAG: slices per query; AgentRunbook-R: slices per raw-state query
    note_top_k: int = 3  # notes per type (procedure, hint)
    event_top_k: int = 6  # AgentRunbook-R state-transition events
    max_raw_queries: int = 5  # AgentRunbook-R raw-state queries per question
    merge_budget: int = 6  # AgentRunbook-R slice merge budget (see agentrunbook_r.merge_slice_hits)
    merge_per_query_cap: int = 2  # ... and its per-query cap when there are more than 3 queries
    insight_top_k: int = M2_TOP_K  # m2.md: 5 insights beat 3 or 7
    slice_text_chars: int = 40000  # cap on a slice's embedded text (the real module's pre-token cap)
    embed_batch: int = 64  # texts per embedding call
    extra: dict[str, Any] = field(default_factory=dict)  # module-specific settings (each module lists its own)
    api_key: str = field(default="", repr=False)  # of the embeddings endpoint ("": $OPENAI_API_KEY); never saved

    def __post_init__(self) -> None:
        if self.controller is None:
            self.controller = self.llm
        if self.root is not None:
            self.root = Path(self.root)
        counts = {k: getattr(self, k) for k in ("slice_top_k", "note_top_k", "event_top_k", "max_raw_queries",
                                                "merge_budget", "merge_per_query_cap", "insight_top_k",
                                                "slice_text_chars", "embed_batch")}
        bad = [f"{k}={v}" for k, v in counts.items() if v < 1]
        if self.slice_radius < 0:
            bad.append(f"slice_radius={self.slice_radius}")
        if bad:
            raise MemexError(f"memory options must be positive (slice_radius >= 0): {', '.join(bad)}")


def text_item(value: str) -> dict:
    """A text context item."""
    return {"type": "text", "value": value}


def image_item(path: str | Path | None) -> dict | None:
    """An image context item, or None when there is no such file (the API wants existing paths)."""
    return {"type": "image", "value": str(path)} if path and Path(path).is_file() else None


class Memory(ABC):
    """A memory module: insert every haystack trajectory, then answer queries with context items.

    Subclasses implement `insert` and `query`; to be saved they describe their built state with
    `state_dict()` (JSON-able) and `arrays()` (numpy arrays) and take it back in `restore()`.
    `build_signature()` names the options that shaped the saved state: a memory loaded with other
    values there must be rebuilt (query-side knobs such as top-k may change freely).
    """

    name: ClassVar[str] = ""

    def __init__(self, options: MemoryOptions):
        self.options = options

    @abstractmethod
    def insert(self, trajectory: dict) -> None:
        """Index one full haystack trajectory (a `trajectories.jsonl` dict)."""

    @abstractmethod
    def query(self, question: str, question_image: str | None = None) -> list[dict]:
        """The memory context for a question: `[{"type": "text" | "image", "value": str}]`."""

    def flush(self) -> None:
        """Finish work that `insert` queued (embeddings). The harness calls it after the last insert so
        that the measured query latency (lme-v2.md "Scoring": `query()` alone) does not include it;
        `query` and `save` call it too."""
        return None

    def warm_up(self) -> None:
        """Load what `query` needs (a model, an engine, a server) before the first timed query: the harness calls it
        after the memory is built or loaded, so that a loaded memory's first query latency is not its model's
        start-up (nothing by default)."""
        return None

    def close(self) -> None:
        """Release clients and models (nothing by default)."""
        return None

    def build_signature(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {}

    def arrays(self) -> dict[str, np.ndarray]:
        return {}

    def restore(self, state: dict, arrays: dict[str, np.ndarray]) -> None:
        """Take back what `state_dict` and `arrays` gave (raise KeyError/ValueError/TypeError if broken)."""
        return None

    def save(self, directory: str | Path) -> None:
        """`memory.json` (name, build signature, state) and `arrays.npz`, in `directory`."""
        self.flush()
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        payload = {"format": SAVE_FORMAT, "memory": self.name, "build": self.build_signature(),
                   "state": self.state_dict()}
        (path / STATE_FILE).write_text(json.dumps(payload, ensure_ascii=False) + "\n")
        arrays = self.arrays()
        if arrays:
            np.savez(path / ARRAYS_FILE, **arrays)
        elif (path / ARRAYS_FILE).exists():
            (path / ARRAYS_FILE).unlink()

    @classmethod
    def load(cls, directory: str | Path, options: MemoryOptions) -> Memory:
        """A memory saved by `save`, built again with `options` (which must match its build signature)."""
        path = Path(directory)
        rebuild = f"rebuild it (insert the haystack again) or point to a memory saved by `{cls.name}`"
        try:
            payload = json.loads((path / STATE_FILE).read_text())
            if payload.get("format") != SAVE_FORMAT or payload.get("memory") != cls.name:
                raise ValueError(f"it holds {payload.get('memory')!r} in format {payload.get('format')!r}")
            memory = cls(options)
            if payload.get("build", {}) != memory.build_signature():
                raise MemexError(f"the memory saved in {path} was built with {payload.get('build')}, not "
                                 f"{memory.build_signature()}: {rebuild}")
            arrays: dict[str, np.ndarray] = {}
            if (path / ARRAYS_FILE).exists():
                with np.load(path / ARRAYS_FILE, allow_pickle=False) as npz:
                    arrays = {k: npz[k] for k in npz.files}
            memory.restore(payload["state"], arrays)
            return memory
        except MemexError:
            raise
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise MemexError(f"no usable `{cls.name}` memory in {path} ({type(exc).__name__}: {exc}); "
                             f"{rebuild}") from None


MEMORIES: dict[str, type[Memory]] = {}


def register(cls: type[Memory]) -> type[Memory]:
    """Class decorator: make a memory module available under its `name`."""
    if not cls.name:
        raise TypeError(f"{cls.__name__} needs a non-empty `name`")
    MEMORIES[cls.name] = cls
    return cls


def _import_module(module: str) -> None:
    full = f"eval.lme.memory.{module}"
    try:
        importlib.import_module(full)
    except ModuleNotFoundError as exc:
        if exc.name != full or module not in OPTIONAL_FILES:
            raise


def memory_names() -> list[str]:
    """The registered module names (importing every module file first)."""
    for module in sorted(set(MODULE_FILES.values())):
        _import_module(module)
    return sorted(MEMORIES)


def memory_class(name: str) -> type[Memory]:
    """The class registered as `name` (importing only its own module file when it is a known name)."""
    if name in MODULE_FILES:
        _import_module(MODULE_FILES[name])
    if name not in MEMORIES:
        raise MemexError(f"unknown memory module {name!r}: choose one of {', '.join(memory_names())}")
    return MEMORIES[name]


def make_memory(name: str, options: MemoryOptions | None = None) -> Memory:
    """A new, empty memory of module `name`."""
    return memory_class(name)(options or MemoryOptions())


def load_memory(name: str, directory: str | Path, options: MemoryOptions | None = None) -> Memory:
    """The memory of module `name` saved in `directory`."""
    return memory_class(name).load(directory, options or MemoryOptions())


@register
class NoRetrievalMemory(Memory):
    """lme-v2.md "no retrieval": nothing is kept and the context is empty (the real no_retrieval.py
    returns `[]`), so the reader answers from the question alone."""

    name = "none"

    def insert(self, trajectory: dict) -> None:
        return None

    def query(self, question: str, question_image: str | None = None) -> list[dict]:
        return []
