"""`memexrl eval compare OUT DIR...`: one table and one chart across `eval alfworld` result directories.

Writes OUT/compare.md (a markdown table: agent, checkpoint, games, success, peak working tokens,
memory-tool use, redundant actions, format errors, episodes ending in an error loop, reward) and OUT/compare.png
(success per run as bars, and success against mean peak working tokens, the paper's two axes, with the
context-penalty threshold T of each run's saved config.yaml drawn as a dashed line: memex.md's goal is a peak at or
below T).
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from common.errors import MemexError
from common.jsonl import read_jsonl
from eval.alfworld import EPISODES_FILE, RESULT_FILE, error_loop_rate

COLUMNS = ("run", "agent", "checkpoint", "split", "games", "success %", "peak W (mean)", "peak W (max)",
           "compress/ep", "rejected/ep", "read/ep", "missed/ep", "segments/ep", "redundant/ep", "format err/ep",
           "error loop %", "reward")


def load_result(directory: str | Path) -> dict:
    path = Path(directory) / RESULT_FILE
    try:
        result = json.loads(path.read_text())
    except OSError:
        raise MemexError(f"no {RESULT_FILE} in {directory}: run `memexrl eval alfworld --out {directory}` first") from None
    except ValueError as e:
        raise MemexError(f"{path} is not valid JSON ({e}): re-run the evaluation") from None
    missing = [k for k in ("agent", "n_games", "success_rate", "peak_working_tokens_mean") if k not in result]
    if missing:
        raise MemexError(f"{path} has no {missing[0]!r}: not written by `memexrl eval alfworld`")
    episodes = Path(directory) / EPISODES_FILE
    if "error_loop_rate" not in result and episodes.exists():  # a result written before the metric existed
        try:
            records = [record for _, record in read_jsonl(episodes, "no episodes", "trajectory JSON lines")]
            result["error_loop_rate"] = error_loop_rate(records)
        except (MemexError, KeyError, TypeError):
            pass  # unreadable episodes: the column shows "-"
    return {"run": Path(directory).name, **result, "memory_threshold": saved_threshold(directory)}


def saved_threshold(directory: str | Path) -> int | None:
    """T (`memory.threshold`) of the config the evaluation saved beside its result; None if it has none."""
    try:
        config = yaml.safe_load((Path(directory) / "config.yaml").read_text()) or {}
        return int(config["memory"]["threshold"])
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError):
        return None  # an older or hand-made result directory: the chart has no T line


def row(result: dict) -> list[str]:
    checkpoint = Path(str(result.get("checkpoint", ""))).name or "-"
    return [result["run"], result["agent"], checkpoint, str(result.get("split", "")), str(result["n_games"]),
            f"{100 * result['success_rate']:.1f}", f"{result['peak_working_tokens_mean']:.0f}",
            str(result.get("peak_working_tokens_max", "-")),
            *(f"{result[k]:.2f}" if k in result else "-" for k in (
                "num_compress_mean", "num_compress_rejected_mean", "num_read_mean", "num_read_miss_mean",
                "num_segments_mean")),
            f"{result.get('num_redundant_mean', 0):.2f}",
            f"{result.get('num_format_errors_mean', 0):.2f}",
            f"{100 * result['error_loop_rate']:.1f}" if "error_loop_rate" in result else "-",
            f"{result.get('reward_mean', 0):.3f}"]


def table(header, rows) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in cells) + " |" for cells in rows]
    return "\n".join(lines) + "\n"


def markdown_table(results: list[dict]) -> str:
    return table(COLUMNS, [row(r) for r in results])


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["run"] for r in results]
    success = [100 * r["success_rate"] for r in results]
    peak = [r["peak_working_tokens_mean"] for r in results]
    fig, (bars, scatter) = plt.subplots(1, 2, figsize=(11, 4))
    bars.bar(names, success, color="tab:blue")
    bars.set_ylabel("success (%)")
    bars.set_ylim(0, 100)
    bars.set_title("success per run")
    bars.tick_params(axis="x", rotation=30)
    scatter.scatter(peak, success, color="tab:orange")
    for name, x, y in zip(names, peak, success):
        scatter.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    for threshold in sorted({r["memory_threshold"] for r in results} - {None}):
        scatter.axvline(threshold, color="tab:gray", linestyle="--", linewidth=1)
        scatter.annotate(f"T = {threshold}", (threshold, 95), textcoords="offset points", xytext=(4, 0), fontsize=8)
    scatter.set_xlabel("peak working tokens (mean per episode)")
    scatter.set_ylabel("success (%)")
    scatter.set_ylim(-2, 100)
    scatter.set_title("success vs context")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def compare(out: str | Path, directories: list[str | Path]) -> str:
    """Write OUT/compare.md and OUT/compare.png; return the table."""
    if not directories:
        raise MemexError("name at least one `eval alfworld` result directory to compare")
    results = [load_result(d) for d in directories]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(results)
    (out / "compare.md").write_text(table)
    plot(results, out / "compare.png")
    return table
