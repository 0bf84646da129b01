"""`rag` and `rag_notes`: the paper's "RAG query -> slice" and "RAG query -> slice + notes" baselines.

lme-v2.md "Baselines": one radius-1 slice per state (states i-1..i+1; embedded text `State k` +
AXTree, capped), dense embeddings, the top 6 slices for the question; with notes, one procedure
note and one hint note per trajectory from an LLM, the top 3 of each. The public `rag.py` (one
class, `enable_notes` switching the notes on) fixes the rest:

- the question itself is the query for every pool (no rewriting); the question image is unused;
- context order: the notes item first (when notes are on), then the slices: the section title,
  and per slice a text item and the centre state's screenshot (slices.render_slices).

Cost: inserting embeds every state's slice (one embedding per state; batched); `rag_notes` adds
one LLM call per trajectory (a second when the reply needs repair). A query embeds the question
once and searches the pools.
"""

from __future__ import annotations

from .base import register
from .index import PooledMemory
from .notes import note_entry, render_notes, write_notes
from .slices import render_slices, slice_entries


@register
class RagMemory(PooledMemory):
    """Slices retrieved with the question (lme-v2.md "RAG query -> slice")."""

    name = "rag"
    notes = False
    pool_names = ("slices",)

    def insert(self, trajectory: dict) -> None:
        traj = self.add_trajectory(trajectory)
        for text, payload in slice_entries(traj, self.options.slice_radius, self.options.slice_text_chars):
            self.pools["slices"].add(text, payload)
        if self.notes:
            procedure, hint = write_notes(self.options.llm, traj, self.options.root, self.options.extra)
            self.pools["procedures"].add(*note_entry(traj, "procedure", procedure))
            self.pools["hints"].add(*note_entry(traj, "hint", hint))

    def query(self, question: str, question_image: str | None = None) -> list[dict]:
        self.flush()
        vector = self.embed_queries([question]).get(question)
        if vector is None:  # an empty question retrieves nothing
            return []
        items = []
        if self.notes:
            k = self.options.note_top_k
            items += render_notes(question, self.pools["procedures"].search(vector, k, question),
                                  self.pools["hints"].search(vector, k, question))
        hits = self.pools["slices"].search(vector, self.options.slice_top_k, question)
        return items + render_slices(self.trajectories, hits, self.options.root)


@register
class RagNotesMemory(RagMemory):
    """Slices plus LLM-written procedure and hint notes (lme-v2.md "RAG query -> slice + notes")."""

    name = "rag_notes"
    notes = True
    pool_names = ("slices", "procedures", "hints")
