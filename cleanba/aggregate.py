"""Reads the TensorBoard logs of a grid of runs and reports scores, aggregates and plots.

    python cleanba/aggregate.py runs/ --out results/

For every run under the given directories (a run is a directory with config.json and event files):
the final score is the mean `charts/episodic_return` over the last --last-fraction of its logged points.
Runs are grouped by method and environment (with --mask-obs, e.g. CartPole-v1-mask1-3: another task). A method is
the runs' --exp-name and their configuration: the script and its algorithm flags (the fields its Args marks
Algorithm[...], read from config.json, with the global number of environments: what the run name's hash covers,
--run-name or not; the seed aside). Runs of one --exp-name never pool other configurations: each configuration is a
method of its own, named by the flags that tell them apart, e.g. `ppo [total_timesteps=300000, num_envs=8]` and
`ppo [total_timesteps=32000, num_envs=128]`, in every table and plot.

The seeds column counts distinct seeds: runs of one seed and one configuration are the same experiment run again,
so their scores are averaged into that seed's (said on stderr), never counted as more seeds. A run left out (no
finished episode yet, config.json or its event files unreadable or missing) is named on stderr with the reason, one
line each. Written to --out:

- scores.csv: one row per run: method, script, env id, seed, steps, final score, human-normalised score (HNS), the
  test score on unseen levels (Procgen, below) and the run directory
- games.md / games.csv: per method and environment, the final score's mean +- std over seeds, its steps and
  wall-clock time, and the published reference score of the same algorithm where there is one (PUBLISHED below)
- aggregates.md / aggregates.csv, aggregates.png: per method, median, mean and IQM of the HNS over its Atari
  games with 95% stratified-bootstrap confidence intervals (rliable's method and plots: Agarwal et al., 2021, "Deep
  RL at the Edge of the Statistical Precipice"; seeded, so the same runs give the same intervals). Only normalised
  scores are aggregated: raw returns of different games are not on one scale, so other environments are reported
  game by game and left out.
- profiles.png (--no-profiles: none): rliable's performance profiles of the HNS, per method, with 95% intervals.
  rliable needs as many runs of every game: a game with more seeds than a method's fewest is cut to that many.
- curves_<env>.png: mean +- 95% CI over seeds against environment steps and against wall-clock time
- procgen.md / procgen.csv and procgen_aggregates.md / .csv (with Procgen runs): per method and game, the train
  score (the training run's) and the test score (`eval/unseen_levels_episodic_return`, the mean over the episodes
  cleanba/evaluate.py --levels unseen played), raw and normalised by Procgen's published minimum and maximum returns
  (PROCGEN_REFERENCE_SCORES); then per method, median, mean and IQM of the normalised train and test scores over its
  games, with 95% stratified-bootstrap intervals

Partial grids (missing seeds or games, unfinished runs) are reported as they are. A tool: the training
scripts never import it.
"""

import argparse
import csv
import glob
import json
import os
import sys
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_runs import NOT_SET, algorithm_config, flag_value  # noqa: E402
from events import read_events  # noqa: E402

# Random and human reference scores of the 57 Atari games, as used for human-normalised scores since
# Mnih et al. (2015), "Human-level control through deep reinforcement learning", with the games added by
# Wang et al. (2016) and Badia et al. (2020, Agent57): (random, human).
ATARI_REFERENCE_SCORES = {
    "Alien": (227.8, 7127.7),
    "Amidar": (5.8, 1719.5),
    "Assault": (222.4, 742.0),
    "Asterix": (210.0, 8503.3),
    "Asteroids": (719.1, 47388.7),
    "Atlantis": (12850.0, 29028.1),
    "BankHeist": (14.2, 753.1),
    "BattleZone": (2360.0, 37187.5),
    "BeamRider": (363.9, 16926.5),
    "Berzerk": (123.7, 2630.4),
    "Bowling": (23.1, 160.7),
    "Boxing": (0.1, 12.1),
    "Breakout": (1.7, 30.5),
    "Centipede": (2090.9, 12017.0),
    "ChopperCommand": (811.0, 7387.8),
    "CrazyClimber": (10780.5, 35829.4),
    "Defender": (2874.5, 18688.9),
    "DemonAttack": (152.1, 1971.0),
    "DoubleDunk": (-18.6, -16.4),
    "Enduro": (0.0, 860.5),
    "FishingDerby": (-91.7, -38.7),
    "Freeway": (0.0, 29.6),
    "Frostbite": (65.2, 4334.7),
    "Gopher": (257.6, 2412.5),
    "Gravitar": (173.0, 3351.4),
    "Hero": (1027.0, 30826.4),
    "IceHockey": (-11.2, 0.9),
    "Jamesbond": (29.0, 302.8),
    "Kangaroo": (52.0, 3035.0),
    "Krull": (1598.0, 2665.5),
    "KungFuMaster": (258.5, 22736.3),
    "MontezumaRevenge": (0.0, 4753.3),
    "MsPacman": (307.3, 6951.6),
    "NameThisGame": (2292.3, 8049.0),
    "Phoenix": (761.4, 7242.6),
    "Pitfall": (-229.4, 6463.7),
    "Pong": (-20.7, 14.6),
    "PrivateEye": (24.9, 69571.3),
    "Qbert": (163.9, 13455.0),
    "Riverraid": (1338.5, 17118.0),
    "RoadRunner": (11.5, 7845.0),
    "Robotank": (2.2, 11.9),
    "Seaquest": (68.4, 42054.7),
    "Skiing": (-17098.1, -4336.9),
    "Solaris": (1236.3, 12326.7),
    "SpaceInvaders": (148.0, 1668.7),
    "StarGunner": (664.0, 10250.0),
    "Surround": (-10.0, 6.5),
    "Tennis": (-23.8, -8.3),
    "TimePilot": (3568.0, 5229.2),
    "Tutankham": (11.4, 167.6),
    "UpNDown": (533.4, 11693.2),
    "Venture": (0.0, 1187.5),
    "VideoPinball": (16256.9, 17667.9),
    "WizardOfWor": (563.5, 4756.5),
    "YarsRevenge": (3092.9, 54576.9),
    "Zaxxon": (32.5, 9173.3),
}

# Procgen's normalisation constants, per game: (R_min, R_max) in easy mode, then in hard mode, from Cobbe et al.
# (2020), "Leveraging Procedural Generation to Benchmark Reinforcement Learning" (arXiv 1912.01588), appendix:
# normalised = (return - R_min) / (R_max - R_min), R_max being about the best return an agent can reach.
PROCGEN_REFERENCE_SCORES = {
    "Bigfish": ((1.0, 40.0), (0.0, 40.0)),
    "Bossfight": ((0.5, 13.0), (0.5, 13.0)),
    "Caveflyer": ((3.5, 12.0), (2.0, 13.4)),
    "Chaser": ((0.5, 13.0), (0.5, 14.2)),
    "Climber": ((2.0, 12.6), (1.0, 12.6)),
    "Coinrun": ((5.0, 10.0), (5.0, 10.0)),
    "Dodgeball": ((1.5, 19.0), (1.5, 19.0)),
    "Fruitbot": ((-1.5, 32.4), (-0.5, 27.2)),
    "Heist": ((3.5, 10.0), (2.0, 10.0)),
    "Jumper": ((3.0, 10.0), (1.0, 10.0)),
    "Leaper": ((3.0, 10.0), (1.5, 10.0)),
    "Maze": ((5.0, 10.0), (4.0, 10.0)),
    "Miner": ((1.5, 13.0), (1.5, 20.0)),
    "Ninja": ((3.5, 10.0), (2.0, 10.0)),
    "Plunder": ((4.5, 30.0), (3.0, 30.0)),
    "Starpilot": ((2.5, 64.0), (1.5, 35.0)),
}
UNSEEN_LEVELS_TAG = "eval/unseen_levels_episodic_return"  # cleanba/evaluate.py --levels unseen


# Published final scores to compare with, per (script, env): CleanRL's (mean +- std over seeds of the mean episodic
# return at the end of training), from its benchmark pages (docs.cleanrl.dev/rl-algorithms/ppo/ and .../pqn/): ppo.py
# and pqn.py on classic control (500k steps), ppo_continuous_action.py on MuJoCo v4 (1M steps, benchmark tag pr-424).
PUBLISHED = {
    ("cleanba_ppo.py", "CartPole-v1"): (490.04, 6.12, "CleanRL ppo.py, 500k steps"),
    ("cleanba_ppo.py", "Acrobot-v1"): (-86.36, 1.32, "CleanRL ppo.py, 500k steps"),
    ("cleanba_ppo.py", "HalfCheetah-v4"): (1442.64, 46.03, "CleanRL ppo_continuous_action.py, 1M steps"),
    ("cleanba_ppo.py", "Hopper-v4"): (2382.86, 271.74, "CleanRL ppo_continuous_action.py, 1M steps"),
    ("cleanba_ppo.py", "Walker2d-v4"): (2287.95, 571.78, "CleanRL ppo_continuous_action.py, 1M steps"),
    ("cleanba_ppo.py", "InvertedPendulum-v4"): (963.09, 22.20, "CleanRL ppo_continuous_action.py, 1M steps"),
    ("cleanba_pqn.py", "CartPole-v1"): (495.13, 6.89, "CleanRL pqn.py, 500k steps"),
    ("cleanba_pqn.py", "Acrobot-v1"): (-95.63, 5.73, "CleanRL pqn.py, 500k steps"),
    # CartPole with its velocities hidden (--mask-obs 1 3): the SB3 zoo's ppo_lstm on CartPoleNoVel-v1 (its benchmark).
    ("cleanba_ppo.py", "CartPole-v1-mask1-3"): (500.0, 0.0, "SB3 zoo ppo_lstm, CartPoleNoVel-v1, 100k steps"),
}


def game_name(env_id: str) -> str:
    return env_id.rsplit("-", 1)[0]


def human_normalized(env_id: str, score: float) -> float | None:
    """(score - random) / (human - random) for the 57 Atari games; None for other environments."""
    reference = ATARI_REFERENCE_SCORES.get(game_name(env_id))
    if reference is None:
        return None
    random_score, human_score = reference
    return (score - random_score) / (human_score - random_score)


def procgen_normalized(env_id: str, score: float | None) -> float | None:
    """(score - R_min) / (R_max - R_min) for Procgen's <Game>Easy-v0 and <Game>Hard-v0; None for other ids."""
    for mode, suffix in enumerate(("Easy-v0", "Hard-v0")):
        game = env_id[: -len(suffix)]
        if env_id.endswith(suffix) and game in PROCGEN_REFERENCE_SCORES and score is not None:
            low, high = PROCGEN_REFERENCE_SCORES[game][mode]
            return (score - low) / (high - low)
    return None


AGGREGATES = ("median", "iqm", "mean")


def score_matrix(scores_by_game: dict[str, list[float]]) -> np.ndarray:
    """rliable's layout, (runs, games). Its stratified bootstrap needs as many runs of every game: a game with more
    seeds than the fewest keeps its first ones (main says when it drops any)."""
    runs = min(len(scores) for scores in scores_by_game.values())
    return np.array([list(scores)[:runs] for scores in scores_by_game.values()], dtype=float).T


def aggregate_metrics(matrix: np.ndarray) -> np.ndarray:
    """Median and mean over games of the per-game mean score, IQM over all (run, game) scores: rliable's metrics."""
    from rliable import metrics

    return np.array([metrics.aggregate_median(matrix), metrics.aggregate_iqm(matrix), metrics.aggregate_mean(matrix)])


def interquartile_mean(scores) -> float:
    """Mean of the middle 50% of the scores (the lowest and highest 25% dropped, rounded down)."""
    from rliable import metrics

    return float(metrics.aggregate_iqm(np.asarray(scores, dtype=float)))


def aggregates(scores_by_game: dict[str, list[float]]) -> dict[str, float]:
    """{median, iqm, mean} of the scores, game by game (see aggregate_metrics)."""
    values = aggregate_metrics(score_matrix(scores_by_game))
    return {name: float(value) for name, value in zip(AGGREGATES, values, strict=True)}


def bootstrap_intervals(matrix: np.ndarray, statistic, repetitions: int, confidence=0.95, seed=0) -> np.ndarray:
    """(2, K): the lower and upper percentile bounds of `statistic` (K values of a (runs, games) matrix) over
    stratified resamples, rliable's method: each game's runs redrawn with replacement, so every resample keeps every
    game. Written here because rliable's resampling draws from NumPy's global generator, whatever seed it is given:
    with this one the same runs give the same intervals."""
    rng = np.random.default_rng(seed)
    runs, games = matrix.shape
    every_game = np.arange(games)
    resampled = [statistic(matrix[rng.integers(0, runs, size=(runs, games)), every_game]) for _ in range(repetitions)]
    tail = 100 * (1 - confidence) / 2
    return np.percentile(np.array(resampled), [tail, 100 - tail], axis=0)


def stratified_bootstrap(scores_by_game: dict[str, list[float]], repetitions=2000, confidence=0.95, seed=0):
    """{aggregate: (low, high)}: the percentile intervals of the aggregates over stratified resamples."""
    low, high = bootstrap_intervals(score_matrix(scores_by_game), aggregate_metrics, repetitions, confidence, seed)
    return {name: (float(low[i]), float(high[i])) for i, name in enumerate(AGGREGATES)}


NOTES = {"left out": 0, "run twice": 0}  # what stderr said, counted in the last line


def left_out(run_dir: str, why: str):
    NOTES["left out"] += 1
    print(f"left out: {run_dir}: {why}", file=sys.stderr)


def load_runs(directories: list[str]) -> list[dict]:
    """The runs with finished episodes under the directories; each run left out is named on stderr with why."""
    runs, seen = [], set()
    for directory in directories:
        configs = sorted(glob.glob(os.path.join(directory, "**", "config.json"), recursive=True))
        for config_path in configs:
            run_dir = os.path.dirname(config_path)
            if os.path.realpath(run_dir) in seen:  # a directory given twice (runs/ and runs/<run>): one run
                continue
            seen.add(os.path.realpath(run_dir))
            try:
                with open(config_path) as f:
                    config = json.load(f)
                args = config["args"]
                method, env_id, seed = args["exp_name"], args["env_id"], args["seed"]
                algorithm = algorithm_config(config)
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
                left_out(run_dir, f"unreadable config.json ({type(error).__name__}: {error})")
                continue
            if not glob.glob(os.path.join(run_dir, "events.out.tfevents.*")):
                left_out(run_dir, "no event file (the run wrote none yet)")
                continue
            try:
                events = read_events(run_dir)
            except Exception as error:  # a damaged file: whatever TensorBoard's reader raises
                left_out(run_dir, f"unreadable event files ({type(error).__name__}: {error})")
                continue
            curve = events.scalars.get("charts/episodic_return", [])
            if not curve:
                left_out(run_dir, "no finished episode (no charts/episodic_return in its event files)")
                continue
            unseen = [value for _, value, _ in events.scalars.get(UNSEEN_LEVELS_TAG, [])]
            if args.get("mask_obs"):  # another task: the same environment with components of its observation hidden
                env_id = f"{env_id}-mask{'-'.join(map(str, args['mask_obs']))}"
            # What tells the runs of one method and environment apart: every algorithm flag but those in the row's
            # own key (the method, the environment) and the seed, which the rows pool.
            config = {k: v for k, v in algorithm.items() if k not in ("exp_name", "env_id", "mask_obs", "seed")}
            runs.append(
                dict(
                    run_dir=run_dir,
                    method=method,
                    exp_name=method,
                    script=algorithm["script"],
                    config=config,
                    env_id=env_id,
                    seed=seed,
                    curve=curve,
                    started=events.started,
                    test_score=float(np.mean(unseen)) if unseen else None,
                )
            )
        known = {os.path.dirname(path) for path in configs}
        for path in sorted(glob.glob(os.path.join(directory, "**", "events.out.tfevents.*"), recursive=True)):
            if os.path.dirname(path) not in known:
                known.add(os.path.dirname(path))
                left_out(os.path.dirname(path), "event files without a config.json (not a run directory)")
    label_configurations(runs)
    return runs


def label_configurations(runs: list[dict]):
    """Sets each run's method to its --exp-name, followed, where runs of that name have several configurations, by
    the flags that tell its configuration apart: `ppo [total_timesteps=300000, num_envs=8]`. Between scripts, the
    script and the flags both have (each script's own flags would make labels of a whole Args)."""
    by_name = defaultdict(dict)
    for run in runs:
        by_name[run["exp_name"]][json.dumps(run["config"], sort_keys=True)] = run["config"]
    for name, configs in by_name.items():
        if len(configs) == 1:
            continue
        configs = list(configs.values())
        flags = dict.fromkeys(k for config in configs for k in config)  # the scripts' order
        differing = [k for k in flags if len({json.dumps(c.get(k, NOT_SET), sort_keys=True) for c in configs}) > 1]
        shared = [k for k in differing if all(k in config for config in configs)]
        labels = [[f"{k}={flag_value(c[k])}" for k in shared] for c in configs]
        if "script" not in shared or len({json.dumps(label) for label in labels}) < len(configs):
            labels = [[f"{k}={flag_value(c[k])}" for k in differing if k in c] for c in configs]
        label_of = {json.dumps(c, sort_keys=True): label for c, label in zip(configs, labels, strict=True)}
        for run in runs:
            if run["exp_name"] == name:
                run["method"] = f"{name} [{', '.join(label_of[json.dumps(run['config'], sort_keys=True)])}]"


def seed_scores(runs: list[dict]) -> list[dict]:
    """One entry per (method, environment, seed): its runs' scores averaged. Runs of one seed and one configuration
    are the same experiment run again (a copy, a --run-name rerun): one seed, said on stderr."""
    by_seed = defaultdict(list)
    for run in runs:
        by_seed[run["method"], run["env_id"], run["seed"]].append(run)
    entries = []
    for (method, env_id, seed), group in sorted(by_seed.items()):
        if len(group) > 1:
            NOTES["run twice"] += 1
            print(
                f"duplicate: {method} on {env_id}, seed {seed}: {len(group)} runs of one configuration and seed "
                f"({', '.join(r['run_dir'] for r in group)}): one seed, their scores averaged",
                file=sys.stderr,
            )
        tests = [r["test_score"] for r in group if r["test_score"] is not None]
        score = float(np.mean([r["score"] for r in group]))
        entries.append(
            dict(
                method=method,
                env_id=env_id,
                seed=seed,
                runs=group,
                score=score,
                hns=human_normalized(env_id, score),
                test_score=float(np.mean(tests)) if tests else None,
            )
        )
    return entries


def final_score(curve, last_fraction: float) -> float:
    count = max(1, int(round(len(curve) * last_fraction)))
    return float(np.mean([value for _, value, _ in curve[-count:]]))


def mean_and_interval(curves: list[np.ndarray]):
    """Mean and a 95% normal-approximation interval over seeds, point by point."""
    stacked = np.stack(curves)
    mean = stacked.mean(axis=0)
    half_width = 1.96 * stacked.std(axis=0, ddof=1) / np.sqrt(len(curves)) if len(curves) > 1 else 0 * mean
    return mean, mean - half_width, mean + half_width


def plot_curves(runs: list[dict], env_id: str, path: str):
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for method in sorted({r["method"] for r in runs}):
        curves = [r["curve"] for r in runs if r["method"] == method]
        seeds = [r["seed"] for r in runs if r["method"] == method]
        for axis, x_of in ((by_step, lambda c: [p[0] for p in c]), (by_time, lambda c: [p[2] - c[0][2] for p in c])):
            xs = [np.asarray(x_of(c), dtype=float) for c in curves]
            grid = np.linspace(max(x[0] for x in xs), min(x[-1] for x in xs), 100)  # where every seed has data
            by_seed = defaultdict(list)  # a seed run twice is one seed: its runs' curves averaged
            for x, c, seed in zip(xs, curves, seeds, strict=True):
                by_seed[json.dumps(seed)].append(np.interp(grid, x, [p[1] for p in c]))
            ys = [np.mean(same_seed, axis=0) for same_seed in by_seed.values()]
            mean, low, high = mean_and_interval(ys)
            axis.plot(grid, mean, label=f"{method} ({len(ys)} seeds)")
            axis.fill_between(grid, low, high, alpha=0.2)
    by_step.set_xlabel("environment steps")
    by_step.xaxis.set_major_formatter(matplotlib.ticker.EngFormatter(sep=""))  # 500k, 1M: no overlapping labels
    by_time.set_xlabel("wall-clock seconds")
    for axis in (by_step, by_time):
        axis.set_ylabel("episodic return")
        axis.grid(alpha=0.3)
    by_step.legend()
    fig.suptitle(env_id)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_aggregates(summary: dict, path: str, label: str):
    """rliable's interval plot: per method, each aggregate's point estimate and 95% interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from rliable import plot_utils

    points = {method: np.array([s["point"][name] for name in AGGREGATES]) for method, s in summary.items()}
    intervals = {method: np.array([s["interval"][name] for name in AGGREGATES]).T for method, s in summary.items()}
    fig, _ = plot_utils.plot_interval_estimates(
        points,
        intervals,
        metric_names=["Median", "IQM", "Mean"],
        algorithms=sorted(summary),
        xlabel=label,
        row_height=0.6,
        xlabel_y_coordinate=-0.45 / (0.6 * len(summary)),  # 0.45 inch below the axes, below the tick labels
    )
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def plot_profiles(by_method: dict, path: str, label: str, repetitions: int):
    """rliable's performance profiles: the fraction of runs scoring above tau, for every tau, with 95% intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from rliable import library, plot_utils

    matrices = {method: score_matrix(scores) for method, scores in sorted(by_method.items())}
    top = max(float(np.max(matrix)) for matrix in matrices.values())
    thresholds = np.linspace(0.0, max(top, 1e-9), 81)

    def profile_of(matrix):  # the fraction of the (run, game) scores above each threshold
        return library.score_distributions(matrix, thresholds)

    profiles = {method: profile_of(matrix) for method, matrix in matrices.items()}
    intervals = {method: bootstrap_intervals(matrix, profile_of, repetitions) for method, matrix in matrices.items()}
    fig, axis = plt.subplots(figsize=(7, 4.5))
    plot_utils.plot_performance_profiles(
        profiles,
        thresholds,
        performance_profile_cis=intervals,
        xlabel=f"{label} (τ)",
        ax=axis,
    )
    axis.legend(loc="upper right")  # the lines are labelled with the methods
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def interval_cells(point: dict, interval: dict) -> list[str]:  # "point [low, high]" of the median, IQM and mean
    return [f"{point[n]:.4g} [{interval[n][0]:.4g}, {interval[n][1]:.4g}]" for n in ("median", "iqm", "mean")]


def mean_and_std(values: list[float]) -> str:
    return f"{np.mean(values):.3g} ± {np.std(values):.3g}" if values else "—"


def report_procgen(runs: list[dict], out: str, repetitions: int):
    """procgen.{md,csv}: per method and game, the train and test (unseen levels) returns (of each seed), raw and
    normalised;
    procgen_aggregates.{md,csv}: per method, the aggregates of the normalised train and test scores over its games."""
    groups = defaultdict(list)
    for run in runs:
        groups[run["method"], run["env_id"]].append(run)
    normalised = {
        "train": defaultdict(lambda: defaultdict(list)),
        "unseen levels": defaultdict(lambda: defaultdict(list)),
    }
    rows = []
    for (method, env_id), group in sorted(groups.items()):
        train = [run["score"] for run in group]
        test = [run["test_score"] for run in group if run["test_score"] is not None]
        normalised["train"][method][env_id] = [procgen_normalized(env_id, score) for score in train]
        if test:
            normalised["unseen levels"][method][env_id] = [procgen_normalized(env_id, score) for score in test]
        cells = [train, normalised["train"][method][env_id], test, normalised["unseen levels"][method].get(env_id)]
        rows.append([method, env_id, len(group), *[mean_and_std(values or []) for values in cells]])
    header = ["method", "env_id", "seeds", "train return", "train normalised", "test return", "test normalised"]
    write_table(os.path.join(out, "procgen"), header, rows)
    aggregate_rows = []
    for split, by_method in normalised.items():
        for method, scores in sorted(by_method.items()):
            point, interval = aggregates(scores), stratified_bootstrap(scores, repetitions)
            aggregate_rows.append(
                [method, split, len(scores), score_matrix(scores).size, *interval_cells(point, interval)]
            )
    header = [
        "method",
        "levels",
        "games",
        "runs",
        *[f"{name} normalised [95% CI]" for name in ("median", "iqm", "mean")],
    ]
    write_table(os.path.join(out, "procgen_aggregates"), header, aggregate_rows)
    for name in ("procgen.md", "procgen_aggregates.md"):
        with open(os.path.join(out, name)) as f:
            print(f.read())


def write_table(path_stem: str, header: list[str], rows: list[list]):
    with open(f"{path_stem}.csv", "w", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    with open(f"{path_stem}.md", "w") as f:
        f.write("| " + " | ".join(header) + " |\n|" + "---|" * len(header) + "\n")
        for row in rows:
            f.write("| " + " | ".join(f"{x:.4g}" if isinstance(x, float) else str(x) for x in row) + " |\n")


def parse_args(argv=None):
    """The flags, checked (what needs no run); exits 2 on bad input."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", help="directories holding runs (searched recursively)")
    parser.add_argument("--out", default="results", help="output directory")
    parser.add_argument("--last-fraction", type=float, default=0.1, help="final score: mean of the last logged points")
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples")
    parser.add_argument(
        "--profiles", action=argparse.BooleanOptionalAction, default=True, help="performance profiles (profiles.png)"
    )
    args = parser.parse_args(argv)
    if not 0 < args.last_fraction <= 1 or args.bootstrap <= 0:
        print("error: --last-fraction must lie in (0, 1] and --bootstrap be positive", file=sys.stderr)
        sys.exit(2)
    return args


def main():
    args = parse_args()
    runs = load_runs(args.run_dirs)
    if not runs:
        print(f"error: no runs with episodic returns under {' '.join(args.run_dirs)}", file=sys.stderr)
        sys.exit(2)
    os.makedirs(args.out, exist_ok=True)

    rows = []
    for run in runs:
        run["score"] = final_score(run["curve"], args.last_fraction)
        run["hns"] = human_normalized(run["env_id"], run["score"])
        hns = "" if run["hns"] is None else run["hns"]
        test_score = "" if run["test_score"] is None else run["test_score"]
        rows.append([run["method"], run["script"], run["env_id"], run["seed"], run["curve"][-1][0], run["score"], hns])
        rows[-1] += [test_score, run["run_dir"]]
    header = ["method", "script", "env_id", "seed", "steps", "score", "hns", "test_score", "run"]
    write_table(os.path.join(args.out, "scores"), header, rows)
    seeds = seed_scores(runs)  # what the tables below count and aggregate: one entry per seed

    groups = defaultdict(list)
    for entry in seeds:
        groups[entry["method"], entry["env_id"]].append(entry)
    game_rows = []
    for (method, env_id), group in sorted(groups.items()):
        scores = [entry["score"] for entry in group]
        every_run = [run for entry in group for run in entry["runs"]]
        minutes = [(r["curve"][-1][2] - r["started"]) / 60 for r in every_run]
        (script,) = {r["script"] for r in every_run}  # the script is part of the method's configuration
        published = PUBLISHED.get((script, env_id))
        steps = f"{np.median([r['curve'][-1][0] for r in every_run]):,.0f}"
        digits = 3 if abs(np.mean(scores)) < 10 else 1  # returns within [0, 1] (MiniGrid's) need more than one digit
        game_rows.append(
            [
                method,
                env_id,
                len(group),
                steps,
                f"{np.mean(scores):.{digits}f} ± {np.std(scores):.{digits}f}",
                f"{np.mean(minutes):.1f}",
                f"{published[0]:g} ± {published[1]:g} ({published[2]})" if published else "—",
            ]
        )
    header = ["method", "env_id", "seeds", "steps", "final score (mean ± std)", "minutes per run", "published"]
    write_table(os.path.join(args.out, "games"), header, game_rows)
    for env_id in sorted({run["env_id"] for run in runs}):
        plot_curves(
            [run for run in runs if run["env_id"] == env_id], env_id, os.path.join(args.out, f"curves_{env_id}.png")
        )

    procgen = [entry for entry in seeds if procgen_normalized(entry["env_id"], entry["score"]) is not None]
    if procgen:
        report_procgen(procgen, args.out, args.bootstrap)
    by_method = defaultdict(lambda: defaultdict(list))  # human-normalised scores of the Atari games only, per seed
    for entry in seeds:
        if entry["hns"] is not None:
            by_method[entry["method"]][entry["env_id"]].append(entry["hns"])
    with open(os.path.join(args.out, "games.md")) as f:
        print(f.read())
    notes = [f"{n} {'runs' if n > 1 else 'run'} left out" for n in [NOTES["left out"]] if n]
    notes += [f"{n} {'seeds' if n > 1 else 'seed'} run more than once" for n in [NOTES["run twice"]] if n]
    notes = f" ({', '.join(notes)}: named on stderr)" if notes else ""
    if not by_method:
        return print(f"{len(runs)} runs{notes}, no Atari game to aggregate over; tables and plots in {args.out}/")
    for method, scores in sorted(by_method.items()):
        fewest = min(map(len, scores.values()))
        if any(len(s) > fewest for s in scores.values()):  # rliable's bootstrap needs as many runs of every game
            print(f"{method}: aggregates over the first {fewest} runs of each game (some games have more)")
    summary = {
        method: dict(point=aggregates(scores), interval=stratified_bootstrap(scores, args.bootstrap))
        for method, scores in sorted(by_method.items())
    }

    write_table(
        os.path.join(args.out, "aggregates"),
        ["method", "games", "runs", *[f"{name} HNS [95% CI]" for name in ("median", "iqm", "mean")]],
        [
            [m, len(by_method[m]), score_matrix(by_method[m]).size, *interval_cells(s["point"], s["interval"])]
            for m, s in summary.items()
        ],
    )
    plot_aggregates(summary, os.path.join(args.out, "aggregates.png"), "Human-normalised score")
    if args.profiles:
        plot_profiles(by_method, os.path.join(args.out, "profiles.png"), "Human-normalised score", args.bootstrap)
    with open(os.path.join(args.out, "aggregates.md")) as f:
        print(f.read())
    environments = len({r["env_id"] for r in runs})
    print(f"{len(runs)} runs{notes}, {environments} environments; tables and plots in {args.out}/")


if __name__ == "__main__":
    main()
