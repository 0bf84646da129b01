"""MemexRL: training LLM agents that manage their own memory (Memex(RL), arXiv 2603.04257)."""

__version__ = "0.1.0"
