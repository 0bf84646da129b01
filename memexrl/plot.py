"""`memexrl plot RUN_DIR`: PNG curves of a run's metrics, to look at a run without wandb.

Reads RUN_DIR/metrics.jsonl of the run directory of design.md ("Run directory"), one JSON object
a line as written by GRPO training (`memexrl train`) or by the SFT callbacks (`memexrl sft`), and
writes RUN_DIR/plots/<name>.png, one figure per entry of FIGURES whose keys occur in the file.
Each metric is drawn from the lines that carry it (SFT eval and summary lines share a step with
the train lines); missing, None and NaN values are skipped.
"""

from __future__ import annotations

import math
from pathlib import Path

from common.errors import MemexError
from common.jsonl import read_jsonl

# (file name, title, metric keys drawn in one axes)
FIGURES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("success.png", "Success rate", ("success_rate",)),
    ("reward.png", "Reward and penalties", ("reward_mean", "penalty_context", "penalty_redundancy", "penalty_format")),
    ("context.png", "Peak working context (tokens)", ("peak_working_tokens",)),
    ("memory.png", "Memory tool calls", ("num_compress", "num_read")),
    ("kl.png", "KL to reference (kl) and to the rollout policy (approx_kl)", ("kl", "approx_kl")),
    ("clip.png", "Clip fractions", ("clip_frac", "tis_clip_frac")),
    ("loss.png", "Loss", ("loss", "eval_loss")),
    ("entropy.png", "Entropy", ("entropy",)),
    ("lr.png", "Learning rate", ("lr",)),
    ("grad_norm.png", "Gradient norm", ("grad_norm",)),
    ("time.png", "Time per step (s)", ("rollout_s", "train_s")),
    ("tied_groups.png", "Groups whose rewards all tie (dropped)", ("zero_std_group_frac",)),
)


def _number(value) -> float | None:
    """The value as a finite float, or None (None, NaN, bools, strings...)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl that have a numeric step."""
    missing = "no metrics.jsonl in the run directory (run `memexrl train` or `memexrl sft` first)"
    records = []
    for n, item in read_jsonl(path, missing, "each line must be one JSON object"):
        if not isinstance(item, dict):
            raise MemexError(f"{path} line {n}: expected a JSON object, got {type(item).__name__}")
        if _number(item.get("step")) is not None:
            records.append(item)
    if not records:
        raise MemexError(f"{path}: no records with a numeric \"step\"; is this a memexrl run's metrics.jsonl?")
    return records


def series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the records where `key` holds a finite number."""
    points = [(float(r["step"]), v) for r in records if (v := _number(r.get(key))) is not None]
    return [s for s, _ in points], [v for _, v in points]


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write RUN_DIR/plots/*.png from RUN_DIR/metrics.jsonl; return the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run_dir)
    if not run.is_dir():
        raise MemexError(f"run directory not found: {run} (pass the output dir of `memexrl train` or `sft`)")
    records = read_metrics(run / "metrics.jsonl")
    out = run / "plots"
    written = []
    for name, title, keys in FIGURES:
        lines = [(key, *series(records, key)) for key in keys]
        lines = [line for line in lines if line[1]]
        if not lines:
            continue
        out.mkdir(exist_ok=True)
        fig, ax = plt.subplots(figsize=(7, 4))
        for key, steps, values in lines:
            ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=key)
        ax.set(title=f"{title}: {run.name}", xlabel="step")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written.append(out / name)
    return written
