"""cleanba/aggregate.py on an Atari grid, in seconds: runs made of event files, no training.

The grid test in tests/test_launch.py aggregates real CartPole runs, which have no human-normalised score; this one
covers the Atari path: rliable's aggregates with stratified-bootstrap intervals, its plots and a partial grid.
"""

import csv
import json
import os
import subprocess
import sys

import pytest
from tensorboardX import SummaryWriter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_run(root, method, env_id, seed, returns):
    run_dir = os.path.join(root, f"{env_id}__{method}__{seed}")
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(dict(args=dict(exp_name=method, env_id=env_id, seed=seed), script="cleanba_ppo.py"), f)
    writer = SummaryWriter(run_dir)
    for step, value in enumerate(returns):
        writer.add_scalar("charts/episodic_return", value, (step + 1) * 1000)
    writer.close()


def test_atari_aggregates_with_rliable(tmp_path):
    runs = tmp_path / "runs"
    # Breakout: random 1.7, human 30.5; Pong: -20.7, 14.6; Qbert: 163.9, 13455.0.
    finals = {"Breakout-v5": [30.5, 16.1, 1.7], "Pong-v5": [14.6, -3.05, -20.7], "Qbert-v5": [13455.0, 163.9]}
    for env_id, scores in finals.items():
        for seed, score in enumerate(scores, start=1):
            make_run(runs, "strong", env_id, seed, [0.0] * 9 + [score])
            make_run(runs, "weak", env_id, seed, [0.0] * 9 + [finals[env_id][-1]])
    out = tmp_path / "results"
    command = [sys.executable, os.path.join(REPO, "cleanba", "aggregate.py"), str(runs), "--out", str(out)]
    result = subprocess.run(
        [*command, "--bootstrap", "50"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    # Qbert has 2 seeds, the others 3: rliable's stratified bootstrap takes the first 2 of each, and says so.
    assert "aggregates over the first 2 runs of each game" in result.stdout
    with open(out / "aggregates.csv") as f:
        rows = {row["method"]: row for row in csv.DictReader(f)}
    assert set(rows) == {"strong", "weak"}
    assert rows["strong"]["games"] == "3" and rows["strong"]["runs"] == "6"  # the runs aggregated
    # strong's first two seeds: HNS 1.0 and 0.5 on Breakout and Pong, 1.0 and 0.0 on Qbert: game means 0.75, 0.75, 0.5.
    assert rows["strong"]["median HNS [95% CI]"].startswith("0.75 [")
    assert rows["strong"]["mean HNS [95% CI]"].startswith("0.6667 [")  # Qbert: 1.0 and 0.0
    assert abs(float(rows["weak"]["mean HNS [95% CI]"].split()[0])) < 1e-6  # the random scores (float32 events)
    for name in ("aggregates.png", "profiles.png", "curves_Pong-v5.png"):
        with open(out / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(out / "scores.csv") as f:
        hns = [float(row["hns"]) for row in csv.DictReader(f) if row["method"] == "strong" and row["seed"] == "1"]
    assert hns == pytest.approx([1.0, 1.0, 1.0])
