"""Dense retrieval for the LME-V2 modules: embedders, an embedding index, and a pooled memory base.

lme-v2.md "Baselines": RAG and AgentRunbook-R retrieve by dense embeddings (cosine similarity of
unit-norm vectors). The paper's modules embed with Qwen3-Embedding-8B served over an
OpenAI-compatible endpoint, queries prefixed with an instruction (`Instruct: ...\\nQuery:...`,
from the public `agentrunbook_r.py`); here `options.embedder` is either

- a sentence-transformers name (default: the offline all-MiniLM-L6-v2 of eval/embeddings.py; no
  query instruction; note that it reads only the first 256 word pieces of a text), or
- an `http(s)://` URL of an OpenAI-compatible embeddings endpoint, through the `openai` client;
  `options.extra`: `embedding_model` (default the paper's Qwen/Qwen3-Embedding-8B),
  `embedding_query_instruction` (default the paper's), the key is `MemoryOptions.api_key`
  (`--api-key`, else $OPENAI_API_KEY).

`EmbeddingIndex` holds payloads and their vectors; texts are queued at `add` and embedded in
batches (when enough are queued, and at `flush`), and dropped once embedded: only payloads and
vectors are saved. `PooledMemory` is the base of the modules built from such pools.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from common.errors import MemexError
from eval.embeddings import embed, top_k
from eval.lme import endpoint

from .base import Memory, MemoryOptions
from .slices import Hit, simplify, truncate_middle

PAPER_EMBEDDING_MODEL = "Qwen/Qwen3-Embedding-8B"
PAPER_QUERY_INSTRUCTION = ("Given a question about past agent trajectories, retrieve relevant memory entries that "
                           "help answer it.")


def _empty() -> np.ndarray:
    return np.zeros((0, 0), dtype=np.float32)


class Embedder:
    """Unit-norm float32 embeddings of documents and queries, from a local model or an endpoint."""

    def __init__(self, spec: str, model: str = "", query_instruction: str = "", batch: int = 64,
                 max_chars: int = 40000, api_key: str = ""):
        self.spec, self.batch, self.max_chars = spec, batch, max_chars
        self.remote = spec.startswith(("http://", "https://"))
        self.model = (model or PAPER_EMBEDDING_MODEL) if self.remote else ""
        self.query_instruction = (query_instruction or PAPER_QUERY_INSTRUCTION) if self.remote else ""
        self.api_key = api_key
        self._client = None

    @property
    def name(self) -> str:
        """What the vectors depend on (a saved memory must be loaded with the same)."""
        return f"{self.spec}#{self.model}" if self.remote else self.spec

    def _embed_remote(self, texts: list[str]) -> np.ndarray:
        if self._client is None:
            self._client = endpoint.client(self.spec, self.api_key, read_timeout_s=120.0)
        reply = endpoint.call(f"embedding endpoint (model {self.model})", self.spec,
                              lambda: self._client.embeddings.create(model=self.model, input=texts))
        vectors = np.asarray([d.embedding for d in reply.data], dtype=np.float32)
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        return vectors / np.where(norms == 0, 1.0, norms)

    def _embed(self, texts: list[str]) -> np.ndarray:
        texts = [truncate_middle(t, self.max_chars) or " " for t in texts]
        parts = [self._embed_remote(texts[i:i + self.batch]) if self.remote else embed(texts[i:i + self.batch], self.spec)
                 for i in range(0, len(texts), self.batch)]
        return np.vstack(parts).astype(np.float32) if parts else _empty()

    def documents(self, texts: list[str]) -> np.ndarray:
        return self._embed(texts)

    def queries(self, texts: list[str]) -> np.ndarray:
        if self.query_instruction:
            texts = [f"Instruct: {self.query_instruction}\nQuery:{t.strip()}" for t in texts]
        return self._embed(texts)


def make_embedder(options: MemoryOptions) -> Embedder:
    x = options.extra
    return Embedder(options.embedder, x.get("embedding_model", ""), x.get("embedding_query_instruction", ""),
                    options.embed_batch, options.slice_text_chars, options.api_key)


class EmbeddingIndex:
    """Payloads (JSON-able dicts with an `id`) and their vectors; texts wait in a queue until embedded."""

    def __init__(self, embedder: Embedder, queue_limit: int = 256):
        self.embedder, self.queue_limit = embedder, queue_limit
        self.payloads: list[dict] = []
        self.vectors = _empty()
        self._pending: list[str] = []

    def __len__(self) -> int:
        return len(self.payloads)

    def add(self, text: str, payload: dict) -> None:
        self._pending.append(text)
        self.payloads.append(payload)
        if len(self._pending) >= self.queue_limit:
            self.flush()

    def flush(self) -> None:
        """Embed the queued texts (in the embedder's batches)."""
        if not self._pending:
            return
        new = self.embedder.documents(self._pending)
        self._pending = []
        self.vectors = new if self.vectors.size == 0 else np.vstack([self.vectors, new])

    def search(self, vector: np.ndarray, k: int, query: str = "") -> list[Hit]:
        """The `k` entries most similar to a unit-norm query vector, best first."""
        self.flush()
        if not self.payloads or vector.size == 0:
            return []
        rows = top_k(vector, self.vectors, k)
        scores = self.vectors[rows] @ vector
        return [Hit(rank, float(s), self.payloads[i], query) for rank, (i, s) in enumerate(zip(rows, scores), 1)]

    def restore(self, payloads: list, vectors: np.ndarray) -> None:
        if not isinstance(payloads, list) or not all(isinstance(p, dict) and "id" in p for p in payloads):
            raise ValueError("pool payloads must be a list of objects with an id")
        vectors = np.asarray(vectors, dtype=np.float32)
        if len(payloads) != (vectors.shape[0] if vectors.size else 0) or (vectors.size and vectors.ndim != 2):
            raise ValueError(f"{len(payloads)} pool entries but vectors of shape {vectors.shape}")
        self.payloads, self.vectors, self._pending = list(payloads), vectors if vectors.size else _empty(), []


class PooledMemory(Memory):
    """A memory of embedding pools (`pool_names`) over the inserted trajectories.

    `self.trajectories` keeps each trajectory's stored form (slices.simplify) when the module renders
    states at query time (`keeps_trajectories`); `self.ids` lists the inserted ids in order.
    """

    pool_names: ClassVar[tuple[str, ...]] = ()
    keeps_trajectories: ClassVar[bool] = True

    def __init__(self, options: MemoryOptions):
        super().__init__(options)
        self.embedder = make_embedder(options)
        self.pools = {name: EmbeddingIndex(self.embedder) for name in self.pool_names}
        self.trajectories: dict[str, dict] = {}
        self.ids: list[str] = []

    def warm_up(self) -> None:
        """The embedding model loaded (or the endpoint reached) before the first timed query."""
        self.embedder.queries(["warm-up"])

    def add_trajectory(self, trajectory: dict) -> dict:
        """The stored form of a new trajectory (kept when `keeps_trajectories`); a repeated id is an error."""
        traj = simplify(trajectory)
        if traj["id"] in self.trajectories or traj["id"] in self.ids:
            raise MemexError(f"trajectory {traj['id']} inserted twice; a haystack lists each trajectory once")
        self.ids.append(traj["id"])
        if self.keeps_trajectories:
            self.trajectories[traj["id"]] = traj
        return traj

    def flush(self) -> None:
        for pool in self.pools.values():
            pool.flush()

    def embed_queries(self, texts: list[str]) -> dict[str, np.ndarray]:
        """Query text -> its vector, for the distinct non-empty texts, in one embedding call."""
        distinct = list(dict.fromkeys(t for t in texts if t.strip()))
        return dict(zip(distinct, self.embedder.queries(distinct))) if distinct else {}

    def build_signature(self) -> dict:
        return {"embedder": self.embedder.name, "slice_radius": self.options.slice_radius,
                "slice_text_chars": self.options.slice_text_chars}

    def state_dict(self) -> dict:
        return {"ids": self.ids, "trajectories": list(self.trajectories.values()),
                "pools": {name: pool.payloads for name, pool in self.pools.items()}}

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: pool.vectors for name, pool in self.pools.items()}

    def restore(self, state: dict, arrays: dict[str, np.ndarray]) -> None:
        self.ids = [str(i) for i in state["ids"]]
        self.trajectories = {t["id"]: t for t in state["trajectories"]}
        for name, pool in self.pools.items():
            pool.restore(state["pools"][name], arrays.get(name, _empty()))
        missing = {p["tid"] for pool in self.pools.values() for p in pool.payloads} - set(self.trajectories)
        if self.keeps_trajectories and missing:
            raise ValueError(f"pool entries of trajectories not saved: {sorted(missing)[:3]}")
