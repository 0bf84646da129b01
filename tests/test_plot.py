"""`memexrl plot`: PNG curves from a run's metrics.jsonl (GRPO and SFT shapes), and bad run dirs."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import json
import math

import pytest

from common.errors import MemexError
from memexrl.cli import main
from memexrl.plot import plot_run, read_metrics, series

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def grpo_step(step):
    return {
        "step": step, "success_rate": 0.1 * step, "reward_mean": 0.2 * step, "penalty_context": -0.01,
        "penalty_redundancy": -0.02, "penalty_format": 0.0, "peak_working_tokens": 900 + step,
        "num_compress": 1.5, "num_read": 0.5, "num_segments": 2, "loss": 0.3 / step, "kl": 0.001 * step,
        "clip_frac": 0.02, "tis_clip_frac": 0.0, "zero_std_group_frac": 0.5, "grad_norm": 1.2, "lr": 1e-6, "rollout_s": 30.0, "train_s": 12.0,
    }


def write_metrics(run_dir, records):
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def assert_png(path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image as mpimg

    assert path.read_bytes()[:8] == PNG_MAGIC, path
    height, width = mpimg.imread(path).shape[:2]
    assert height >= 200 and width >= 300, (path, height, width)


def test_grpo_run_writes_its_figures_only(tmp_path):
    run = write_metrics(tmp_path / "grpo", [grpo_step(s) for s in (1, 2, 3)])
    written = plot_run(run)
    names = {p.name for p in written}
    assert names == {"success.png", "reward.png", "context.png", "memory.png", "kl.png", "clip.png",
                     "loss.png", "lr.png", "grad_norm.png", "time.png", "tied_groups.png"}
    assert all(p.parent == run / "plots" for p in written)
    for path in written:
        assert_png(path)
    # no entropy in these records: no entropy figure, and nothing else lands in plots/
    assert {p.name for p in (run / "plots").iterdir()} == names


def test_sft_run_plots_loss_with_eval_and_summary_lines(tmp_path):
    records = [
        {"step": 2, "epoch": 0.1, "loss": 1.5, "grad_norm": 0.5, "learning_rate": 1e-4, "lr": 1e-4},
        {"step": 4, "epoch": 0.2, "loss": 1.3, "grad_norm": 0.4, "learning_rate": 2e-4, "lr": 2e-4},
        {"step": 4, "epoch": 0.2, "eval_loss": 1.1, "eval_runtime": 8.0},
        {"step": 4, "epoch": 0.2, "train_runtime": 100.0, "train_loss": 1.4},
    ]
    run = write_metrics(tmp_path / "sft", records)
    written = plot_run(run)
    assert {p.name for p in written} == {"loss.png", "lr.png", "grad_norm.png"}
    for path in written:
        assert_png(path)
    metrics = read_metrics(run / "metrics.jsonl")
    assert series(metrics, "loss") == ([2.0, 4.0], [1.5, 1.3])
    assert series(metrics, "eval_loss") == ([4.0], [1.1])


def test_none_nan_and_stepless_lines_are_skipped(tmp_path):
    records = [{"step": 1, "kl": None}, {"step": 2, "kl": math.nan}, {"step": 3, "kl": 0.5},
               {"kl": 9.0}, {"step": "x", "kl": 9.0}, ""]
    run = write_metrics(tmp_path / "run", records)
    assert "NaN" in (run / "metrics.jsonl").read_text()  # json writes and reads NaN
    assert series(read_metrics(run / "metrics.jsonl"), "kl") == ([3.0], [0.5])
    assert [p.name for p in plot_run(run)] == ["kl.png"]


def test_library_errors_say_what_to_fix(tmp_path):
    with pytest.raises(MemexError, match="run directory not found"):
        plot_run(tmp_path / "nowhere")
    with pytest.raises(MemexError, match="memexrl train"):
        plot_run(tmp_path)
    write_metrics(tmp_path, [{"epoch": 1.0, "loss": 1.0}])
    with pytest.raises(MemexError, match="numeric \"step\""):
        plot_run(tmp_path)
    write_metrics(tmp_path, ["[1, 2]"])
    with pytest.raises(MemexError, match="line 1: expected a JSON object"):
        plot_run(tmp_path)


def test_cli_plot_prints_written_files(tmp_path, capsys):
    run = write_metrics(tmp_path / "grpo", [grpo_step(1), grpo_step(2)])
    assert main(["plot", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 11 and str(run / "plots" / "kl.png") in out


def assert_cli_error(capsys, argv, *fragments):
    assert main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("memexrl: error:")]
    assert len(lines) == 1 and all(f in lines[0] for f in fragments), lines


def test_cli_bad_run_dirs_exit_2_with_one_line(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert_cli_error(capsys, ["plot", str(missing)], str(missing))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_cli_error(capsys, ["plot", str(empty)], str(empty / "metrics.jsonl"), "memexrl train")
    broken = write_metrics(tmp_path / "broken", [grpo_step(1), "{not json"])
    assert_cli_error(capsys, ["plot", str(broken)], str(broken / "metrics.jsonl"), "line 2")
    assert not (broken / "plots").exists()
