"""`runs/demo/report.md`: the figures of every demo stage (memexrl/demo.py) in tables, with PNG plots.

The plots are copied into `OUT/report/` so that the report and its pictures move together.
"""

from __future__ import annotations

import datetime
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from common.atomic import write_text_atomic
from eval.compare import table

if TYPE_CHECKING:  # memexrl/demo.py calls write_report; nothing here imports it at run time
    from memexrl.demo import Demo


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:.1f} %"


def commit() -> str:
    """The git commit of the code that ran (or 'unknown' outside a git checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def copy_plots(run_dir: Path, where: Path, prefix: str) -> list[Path]:
    """Plot a run's metrics.jsonl and copy the PNGs into `where` as PREFIX-NAME.png."""
    from memexrl.plot import plot_run

    copied = []
    for png in plot_run(run_dir):
        target = where / f"{prefix}-{png.name}"
        shutil.copyfile(png, target)
        copied.append(target)
    return copied


def images(paths: list[Path], out: Path) -> str:
    return "".join(f"![{p.stem}]({p.relative_to(out)})\n" for p in paths)


def write_report(demo: Demo, where: Path, stages: tuple[str, ...]) -> Path:
    """Write OUT/report.md (plots in `where`) from the summaries of the done `stages`; return its path."""
    out, d = demo.out, demo.cfg.demo
    done = {stage: demo.done(stage) or {} for stage in stages}
    parts = [
        "# MemexRL demo report\n",
        f"{datetime.date.today().isoformat()}, commit {commit()}, model `{demo.cfg.model.name}`, "
        f"T = {demo.cfg.memory.threshold} tokens; config: `{out / 'config.yaml'}`.\n",
        "## Stages\n",
        table(["stage", "seconds"], [[s, _fmt(done[s].get("seconds"), 0)] for s in stages if s != "report"]),
    ]
    e = done["expert"]
    parts += [
        f"## 1. Memex expert demonstrations ({d.expert_split})\n",
        table(["games", "won (kept)", "success", "mean steps", "compress / episode", "read / episode",
               "segments / episode"],
              [[e.get("n_games"), f"{e.get('n_success')} ({e.get('kept', e.get('n_success'))})",
                _pct(e.get("success_rate")), _fmt(e.get("mean_steps"), 1),
                _fmt(e.get("compress_per_episode"), 2), _fmt(e.get("read_per_episode"), 2),
                _fmt(e.get("segments_per_episode"), 2)]]),
    ]
    s = done["sft"]
    parts += [
        "## 2. SFT warm start\n",
        table(["optimizer steps", "first loss", "last loss", "eval loss"],
              [[s.get("steps"), _fmt(s.get("first_loss")), _fmt(s.get("last_loss")), _fmt(s.get("eval_loss"))]]),
        images(copy_plots(demo.dir("sft"), where, "sft"), out),
    ]
    g = done["grpo"]
    parts += [
        "## 3. GRPO (segments, R = task − context − redundancy − format penalties)\n",
        "Per rollout step (means per trajectory): its segments are what GRPO trains on, each with the context "
        "it was generated from; the last columns count the segments per optimizer step and the share of trained "
        "tokens generated after a compression.\n",
        table(["step", "success", "reward", "peak W", "compress", "read", "segments", "segments / update",
               "tokens after 1st segment", "loss"],
              [[r.get("step"), _pct(r.get("success_rate")), _fmt(r.get("reward_mean")),
                _fmt(r.get("peak_working_tokens"), 0), _fmt(r.get("num_compress"), 2), _fmt(r.get("num_read"), 2),
                _fmt(r.get("num_segments"), 2), _fmt(r.get("segments_per_update"), 1),
                _pct(r.get("later_segment_token_share")), _fmt(r.get("loss"), 4)] for r in g.get("steps", [])]),
        images(copy_plots(demo.dir("grpo"), where, "grpo"), out),
    ]
    compare_png = demo.dir("eval") / "compare" / "compare.png"
    shown = []
    if compare_png.is_file():
        shown = [where / "alfworld-compare.png"]
        shutil.copyfile(compare_png, shown[0])
    parts += [
        f"## 4. ALFWorld evaluation ({d.eval_games} {d.eval_split} games, greedy)\n",
        table(["policy-agent", "success", "peak W", "compress (rejected)", "read (missed)", "segments", "reward"],
              [[name, _pct(r["success_rate"]), _fmt(r["peak_working_tokens_mean"], 0),
                f"{_fmt(r['num_compress_mean'], 2)} ({_fmt(r.get('num_compress_rejected_mean'), 2)})",
                f"{_fmt(r['num_read_mean'], 2)} ({_fmt(r.get('num_read_miss_mean'), 2)})",
                _fmt(r.get("num_segments_mean"), 2), _fmt(r["reward_mean"])]
               for name, r in done["eval"].get("results", {}).items()]),
        images(shown, out),
    ]
    parts += [
        "## 5. LongMemEval-V2, synthetic small haystack (local reader and judge)\n",
        table(["memory", "questions", "accuracy", "query latency mean (s)", "p95 (s)"],
              [[name, r["questions"], _pct(r["accuracy"]), _fmt(r["latency_mean_s"]), _fmt(r["latency_p95_s"])]
               for name, r in done["lme"].get("results", {}).items()]),
        "\nFigures at this scale (a 135M policy, a few steps) show that every stage runs and is measured; "
        "they are not the paper's results.\n",
    ]
    return write_text_atomic(out / "report.md", "\n".join(parts))
