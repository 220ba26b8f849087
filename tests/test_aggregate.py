"""cleanba/aggregate.py on Atari and Procgen grids, in seconds: runs made of event files, no training.

The grid test in tests/test_launch.py aggregates real CartPole runs, which have no normalised score; these cover the
Atari path (rliable's aggregates with stratified-bootstrap intervals, its plots, a partial grid) and Procgen's (train
and test returns normalised by the published constants).
"""

import csv
import json
import os
import re
import shutil
import subprocess
import sys

import envpool
import pytest
from helpers import REPO, load_module
from tensorboardX import SummaryWriter


def make_run(root, method, env_id, seed, returns, unseen_levels=()):
    run_dir = os.path.join(root, f"{env_id}__{method}__{seed}")
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(dict(args=dict(exp_name=method, env_id=env_id, seed=seed), script="cleanba_ppo.py"), f)
    writer = SummaryWriter(run_dir)
    for step, value in enumerate(returns):
        writer.add_scalar("charts/episodic_return", value, (step + 1) * 1000)
    for episode, value in enumerate(unseen_levels):  # as cleanba/evaluate.py --levels unseen logs them
        writer.add_scalar("eval/unseen_levels_episodic_return", value, episode)
    writer.close()


def aggregate(runs, out, *flags) -> subprocess.CompletedProcess:
    command = [sys.executable, os.path.join(REPO, "cleanba", "aggregate.py"), str(runs), "--out", str(out), *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_atari_aggregates_with_rliable(tmp_path):
    runs = tmp_path / "runs"
    # Breakout: random 1.7, human 30.5; Pong: -20.7, 14.6; Qbert: 163.9, 13455.0.
    finals = {"Breakout-v5": [30.5, 16.1, 1.7], "Pong-v5": [14.6, -3.05, -20.7], "Qbert-v5": [13455.0, 163.9]}
    for env_id, scores in finals.items():
        for seed, score in enumerate(scores, start=1):
            make_run(runs, "strong", env_id, seed, [0.0] * 9 + [score])
            make_run(runs, "weak", env_id, seed, [0.0] * 9 + [finals[env_id][-1]])
    out = tmp_path / "results"
    result = aggregate(runs, out, "--bootstrap", "50")
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


def test_procgen_train_and_test_returns_normalised(tmp_path):
    """Procgen's runs: the train score (the run's returns) and the test score (evaluate.py's episodes on unseen
    levels), normalised by the published R_min and R_max of the game and mode, per game and aggregated per method."""
    runs = tmp_path / "runs"
    # Starpilot easy: R_min 2.5, R_max 64; Coinrun easy: 5, 10; Bigfish hard: 0, 40.
    games = {"StarpilotEasy-v0": (64.0, 33.25), "CoinrunEasy-v0": (10.0, 7.5), "BigfishHard-v0": (40.0, 20.0)}
    for env_id, (train, test) in games.items():
        for seed in (1, 2):
            make_run(runs, "ppo", env_id, seed, [0.0] * 9 + [train], unseen_levels=[test - 1.0, test + 1.0])
    make_run(runs, "ppo", "Pong-v5", 1, [14.6])  # an Atari game beside them
    result = aggregate(runs, tmp_path / "results", "--bootstrap", "50", "--no-profiles")
    assert result.returncode == 0, result.stderr
    with open(tmp_path / "results" / "procgen.csv") as f:
        rows = {row["env_id"]: row for row in csv.DictReader(f)}
    assert set(rows) == set(games) and rows["CoinrunEasy-v0"]["seeds"] == "2"
    assert rows["CoinrunEasy-v0"]["train normalised"] == "1 ± 0" and rows["CoinrunEasy-v0"]["test return"] == "7.5 ± 0"
    assert [rows[env_id]["test normalised"] for env_id in games] == ["0.5 ± 0"] * 3
    with open(tmp_path / "results" / "procgen_aggregates.csv") as f:
        aggregates = {row["levels"]: row for row in csv.DictReader(f)}
    assert aggregates["train"]["mean normalised [95% CI]"].startswith("1 [")
    assert aggregates["unseen levels"]["iqm normalised [95% CI]"].startswith("0.5 [")
    assert aggregates["unseen levels"]["games"] == "3" and aggregates["unseen levels"]["runs"] == "6"
    with open(tmp_path / "results" / "scores.csv") as f:
        tests = {row["env_id"]: row["test_score"] for row in csv.DictReader(f) if row["seed"] == "1"}
    assert tests.pop("Pong-v5") == "" and {env_id: float(score) for env_id, score in tests.items()} == {
        env_id: test for env_id, (_, test) in games.items()
    }


def test_the_procgen_grid_and_its_constants_cover_the_16_games():
    """The Procgen grid (benchmark.sh): 16 games, easy mode, each with its normalisation constants, all EnvPool's."""
    constants = load_module(os.path.join(REPO, "cleanba", "aggregate.py")).PROCGEN_REFERENCE_SCORES
    with open(os.path.join(REPO, "benchmark.sh")) as f:
        grid = re.search(r'PROCGEN16="([^"]*)"', f.read()).group(1).split()
    assert len(grid) == len(constants) == 16 and set(grid) == {f"{game}Easy-v0" for game in constants}
    assert {f"{game}{mode}-v0" for game in constants for mode in ("Easy", "Hard")} <= set(envpool.list_all_envs())
    for easy, hard in constants.values():
        assert easy[0] < easy[1] and hard[0] < hard[1]


def make_real_run(root, name, returns, seed=1, exp_name="cleanba_ppo", **flags):
    """A run directory as cleanba_ppo.py writes it (every flag in config.json, the layout with the global env count),
    its name given (as --run-name gives it), with these episodic returns."""
    defaults = load_module(os.path.join(REPO, "cleanba", "cleanba_ppo.py")).DEFAULTS
    args = {**defaults, "exp_name": exp_name, "env_id": "CartPole-v1", "seed": seed, **flags}
    num_envs = args["local_num_envs"] * args["num_actor_threads"] * len(args["actor_device_ids"])
    run_dir = os.path.join(root, name)
    os.makedirs(run_dir)
    layout = dict(notation="a0-l0-d1", processes=1, actor_threads_per_device=args["num_actor_threads"])
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(dict(args=args, layout=dict(layout, num_envs=num_envs), script="cleanba_ppo.py"), f)
    writer = SummaryWriter(run_dir)
    for step, value in enumerate(returns):
        writer.add_scalar("charts/episodic_return", value, (step + 1) * 1000)
    writer.close()
    return run_dir


def games(out) -> list[dict]:
    with open(out / "games.csv") as f:
        return list(csv.DictReader(f))


def test_runs_of_one_name_in_other_configurations_are_never_pooled(tmp_path):
    """The quickstart's run (300k steps, 8 envs) and a launcher's run of the same exp name and seed (32k steps, 128
    envs): two rows, each named by the flags that differ, one seed each; never one row of 2 seeds. The second is
    named by --run-name: the configuration comes from config.json, not from the run name's hash."""
    runs = tmp_path / "runs"
    quickstart = dict(total_timesteps=300_000, local_num_envs=4, num_actor_threads=2)
    make_real_run(runs, "CartPole-v1__cleanba_ppo__1__0a1b2c3d", [500.0], **quickstart)
    make_real_run(runs, "launcher", [20.0], total_timesteps=32_000, local_num_envs=64, num_actor_threads=2)
    result = aggregate(runs, tmp_path / "results", "--no-profiles")
    assert result.returncode == 0, result.stderr
    rows = {row["method"]: row for row in games(tmp_path / "results")}
    assert set(rows) == {
        "cleanba_ppo [total_timesteps=300000, num_envs=8]",
        "cleanba_ppo [total_timesteps=32000, num_envs=128]",
    }, result.stdout
    assert [rows[method]["seeds"] for method in sorted(rows)] == ["1", "1"]
    assert rows["cleanba_ppo [total_timesteps=300000, num_envs=8]"]["final score (mean ± std)"] == "500.0 ± 0.0"
    with open(tmp_path / "results" / "scores.csv") as f:
        assert {row["method"] for row in csv.DictReader(f)} == set(rows)


def test_another_layout_of_one_configuration_is_one_configuration(tmp_path):
    """The global env count is the algorithm's, its split over threads the layout's; Runtime flags (logging,
    checkpoints) are nobody's configuration; a flag a run's config.json predates counts at its default."""
    runs = tmp_path / "runs"
    make_real_run(runs, "a", [100.0], seed=1, local_num_envs=8, num_actor_threads=1, log_frequency=1)
    make_real_run(runs, "b", [200.0], seed=2, local_num_envs=4, num_actor_threads=2, checkpoint_interval=5)
    with open(runs / "b" / "config.json") as f:
        config = json.load(f)
    del config["args"]["layout_free_group_size"]  # written before the flag existed: its default, 0
    with open(runs / "b" / "config.json", "w") as f:
        json.dump(config, f)
    result = aggregate(runs, tmp_path / "results", "--no-profiles")
    assert result.returncode == 0, result.stderr
    (row,) = games(tmp_path / "results")
    assert (row["method"], row["seeds"], row["final score (mean ± std)"]) == ("cleanba_ppo", "2", "150.0 ± 50.0")


def test_one_seed_run_twice_counts_once_and_is_named(tmp_path):
    """The same configuration and seed in two run directories (a rerun under --run-name): one seed, its runs'
    scores averaged, and stderr names both runs."""
    runs = tmp_path / "runs"
    first = make_real_run(runs, "CartPole-v1__cleanba_ppo__1__5e1f9a2b", [100.0])
    again = make_real_run(runs, "rerun", [200.0])
    make_real_run(runs, "seed2", [400.0], seed=2)
    result = aggregate(runs, tmp_path / "results", "--no-profiles")
    assert result.returncode == 0, result.stderr
    (row,) = games(tmp_path / "results")
    assert row["seeds"] == "2" and row["final score (mean ± std)"] == "275.0 ± 125.0"  # seed 1: 150; seed 2: 400
    (line,) = [line for line in result.stderr.splitlines() if "seed 1" in line]
    assert "2 runs" in line and first in line and again in line


def test_runs_left_out_are_named_with_why(tmp_path):
    """Each run not in the tables is named on stderr, one line each, with the reason; the others are reported."""
    runs = tmp_path / "runs"
    make_real_run(runs, "finished", [100.0])
    no_episodes = make_real_run(runs, "no-episode-yet", [])
    broken = runs / "broken-config"
    broken.mkdir()
    (broken / "config.json").write_text('{"args": {"exp_name"')
    no_events = runs / "no-events"
    no_events.mkdir()
    shutil.copy(runs / "finished" / "config.json", no_events)
    result = aggregate(runs, tmp_path / "results", "--no-profiles")
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("left out: ")]
    assert len(lines) == 3, result.stderr
    reasons = {line.split(": ")[1]: line for line in lines}
    assert "no finished episode" in reasons[no_episodes]
    assert "unreadable config.json" in reasons[str(broken)]
    assert "no event file" in reasons[str(no_events)]
    (row,) = games(tmp_path / "results")
    assert row["seeds"] == "1"
