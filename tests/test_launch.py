"""Launching grids and reading results: a real one-node SLURM cluster (Debian's slurm-wlm + munge,
started by the fixture), the local launcher, and the aggregation of the grid's logs."""

import contextlib
import csv
import glob
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import envpool
import numpy as np
import pytest
from helpers import (
    REPO,
    command,
    finished_run,
    load_checkpoint,
    load_module,
    made_once,
    read_events,
    read_scalars,
    run_dirs,
    run_processes,
    session_processes,
)

SHORT = "--local-num-envs 4 --num-actor-threads 1 --num-steps 32 --total-timesteps 2560 --log-frequency 2".split()


def short_ppo() -> list[str]:
    """The command of a short PPO run. It uses the tests' compilation cache (conftest.py), as every script the tests
    start does (set up by then): the grids' tasks compiled their programs cold otherwise, all at once."""
    return command("ppo", SHORT, shared_cache=True)


aggregate = load_module(os.path.join(REPO, "cleanba", "aggregate.py"))


def tool(name: str, cwd, *args: str, env=None, timeout=600) -> subprocess.CompletedProcess:
    """Runs cleanba/<name>.py in cwd with `args`: strings are split at spaces, lists (paths) taken as they are."""
    args = [word for arg in args for word in (arg.split() if isinstance(arg, str) else arg)]
    command = [sys.executable, os.path.join(REPO, "cleanba", f"{name}.py"), *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def local_grid(tmp_path_factory):
    """A grid with more experiments than workers, one of which fails: 3 envs and a bad env id, 1 seed, of PPO (CartPole
    and Acrobot find the programs the SLURM grid compiled, which runs first, in the tests' compilation cache)."""
    envs = "CartPole-v1 Acrobot-v1 MountainCar-v0 NoSuchGame-v5"

    def grid(cwd):
        return cwd, tool("launch", cwd, f"--env-ids {envs} --seeds 1 --workers 2 --", short_ppo())

    return made_once(tmp_path_factory, "grid", grid)


@pytest.mark.slurm
def test_slurm_array_grid(tmp_path, slurm):
    grid_flags = "--slurm --wait --env-ids CartPole-v1 Acrobot-v1 --seeds 1 2 --max-parallel 4 --log-dir logs --"
    grid = tool("launch", tmp_path, grid_flags, short_ppo(), env=slurm)
    assert grid.returncode == 0, grid.stdout + grid.stderr
    assert "4 of 4 experiments succeeded" in grid.stdout
    expected = [(env_id, seed) for env_id in ("CartPole-v1", "Acrobot-v1") for seed in ("1", "2")]
    names = [tuple(os.path.basename(d).split("__")[0:3:2]) for d in run_dirs(tmp_path)]
    assert sorted(names) == sorted(expected)
    job_id = re.search(r"submitted array job (\d+)", grid.stdout).group(1)
    for task, (env_id, seed) in enumerate(expected):  # the template's task -> (env, seed) mapping
        with open(tmp_path / "logs" / f"cleanba_{job_id}_{task}.status") as f:
            assert f.read().split() == [env_id, seed, "0"]
    for run_dir in run_dirs(tmp_path):  # each task trained to the end, where the template says
        assert [step for step, _ in read_scalars(run_dir)["stats/update"]][-1] == 2560
    assert len([f for f in os.listdir(tmp_path / "logs") if f.endswith(".out")]) == 4


@pytest.mark.slurm
def test_a_job_that_loses_a_process_is_requeued_and_resumes(tmp_path, slurm):
    """A 2-task --distributed job loses a task after a periodic checkpoint: SIGKILL to its processes (its supervisor
    and the script), as an OOM kill or a crash would. The other task reports the loss and exits 75, the template
    requeues the job, and the requeued job resumes from that checkpoint and finishes. From the checkpoint on, its
    records are those of the same command resumed on this machine from a copy of the checkpoint, bit for bit."""
    # 2 x 4 envs x 32 steps: 50 updates, a checkpoint every 25 (the loss must land between the two).
    flags = "--local-num-envs 4 --num-actor-threads 1 --num-steps 32 --update-epochs 1 --total-timesteps 12800 "
    flags = (flags + "--checkpoint-interval 25 --log-frequency 25").split()
    grid = "--slurm --wait --ntasks-per-node 2 --env-ids CartPole-v1 --seeds 3 --log-dir logs --".split()
    launch = [sys.executable, os.path.join(REPO, "cleanba", "launch.py"), *grid]
    launcher = subprocess.Popen(
        [*launch, *command("ppo", flags, shared_cache=True), "--distributed"],
        cwd=tmp_path,
        env=slurm,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    job_id = re.search(r"submitted array job (\d+)", launcher.stdout.readline()).group(1)
    checkpoint = os.path.join(str(tmp_path), "runs", "*", "checkpoint.msgpack")
    deadline = time.time() + 180
    while not glob.glob(checkpoint) or load_checkpoint(os.path.dirname(glob.glob(checkpoint)[0]))["update"] < 25:
        assert time.time() < deadline and launcher.poll() is None, launcher.communicate()[0]
        time.sleep(0.05)
    run_dir = os.path.dirname(glob.glob(checkpoint)[0])
    reference = tmp_path / "reference" / "runs" / os.path.basename(run_dir)
    shutil.copytree(run_dir, reference)  # the checkpoint after update 25 (the next comes 25 updates later)
    rank_1 = [pid for pid, environ in training_processes() if environ.get("SLURM_PROCID") == "1"]
    assert rank_1
    for pid in rank_1:
        os.kill(pid, signal.SIGKILL)
    # SLURM holds a requeued batch job back for two minutes (its BeginTime): once it is pending, let it start, but not
    # within the second its old credential was revoked (slurmd then refuses it: "Job credential revoked").
    state = ["squeue", "--noheader", "--jobs", job_id, "--format", "%T"]
    while subprocess.run(state, env=slurm, capture_output=True, text=True).stdout.strip() != "PENDING":
        assert time.time() < deadline and launcher.poll() is None, launcher.communicate()[0]
        time.sleep(0.2)
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={job_id}_0", "StartTime=now"], env=slurm, check=True)
    output = launcher.communicate(timeout=300)[0]
    assert launcher.returncode == 0 and "1 of 1 experiments succeeded" in output, output
    (log,) = glob.glob(str(tmp_path / "logs" / "*.out"))
    with open(log) as f:
        log = f.read()
    resumed = load_checkpoint(reference)["update"]
    lost = rf"^error: lost process 1 \(host \S+\) after update \d+; the last checkpoint \S+ is after update {resumed}:"
    assert re.search(lost, log, re.M), log
    assert f"checkpoint.msgpack after update {resumed} " in log, log  # "resuming from ..."
    finished = finished_run(tmp_path)
    # One JAX process per SLURM task, found through srun's environment.
    assert finished.config["layout"]["processes"] == 2
    records = finished.records
    assert [r["update"] for r in records] == list(range(1, 51))
    run_processes(tmp_path / "reference", *flags, "--env-id", "CartPole-v1", "--seed", 3)
    assert finished_run(tmp_path / "reference").records[resumed:] == records[resumed:]


def training_processes():
    """(pid, environment) of this machine's processes running a training script."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"cleanba_ppo.py" not in f.read():
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                pairs = [entry.split(b"=", 1) for entry in f.read().split(b"\0") if b"=" in entry]
        except OSError:  # it exited meanwhile
            continue
        found.append((int(pid), {key.decode(): value.decode(errors="replace") for key, value in pairs}))
    return found


@pytest.mark.slurm
def test_slurm_failed_task_is_reported(tmp_path, slurm):
    result = tool(
        "launch",
        tmp_path,
        "--slurm --wait --env-ids NoSuchGame-v5 --seeds 1 --log-dir logs --",
        short_ppo(),
        env=slurm,
        timeout=300,
    )
    assert result.returncode == 1
    assert "FAILED NoSuchGame-v5 seed 1: exit status 2" in result.stdout


def test_slurm_dry_run_renders_the_template(tmp_path):
    flags = "--slurm --dry-run --env-ids Breakout-v5 Pong-v5 --seeds 1 2 3 --gpus-per-task 1 --time 2:00:00"
    result = tool("launch", tmp_path, flags, "-- python cleanba/cleanba_ppo.py")
    assert result.returncode == 0 and "{{" not in result.stdout
    expected = [
        "#SBATCH --array=0-5%100",
        "#SBATCH --gpus-per-task=1",
        "#SBATCH --time=2:00:00",
        "#SBATCH --requeue",
        'srun --cpus-per-task=1 --gpus-per-task=1 python cleanba/cleanba_ppo.py --env-id "$ENV_ID" --seed "$SEED"',
        "ENV_IDS=(Breakout-v5 Pong-v5)",
    ]
    for line in expected:
        assert line in result.stdout
    assert not os.path.exists(tmp_path / "launch_logs")  # a dry run writes nothing
    two_tasks = tool("launch", tmp_path, "--slurm --dry-run --ntasks-per-node 2 --env-ids CartPole-v1 --", short_ppo())
    assert two_tasks.returncode == 2 and "--distributed" in two_tasks.stderr  # tasks of one run need it


LAUNCH_BAD_INPUT = [
    ("--seeds 1 1", "--seeds names one twice"),  # two runs in one run directory, writing one log
    ("--device-ids 0 0", "--device-ids names one twice"),
    ("--device-ids gpu0", "--device-ids takes GPU indices or UUIDs"),
    ("--slurm --dry-run --gpus-per-task -1", "--gpus-per-task must be >= 0"),
    ("--slurm --dry-run --job-name a/b", "--job-name 'a/b' must be a plain name"),
]


@pytest.mark.parametrize("flags, refusal", LAUNCH_BAD_INPUT)
def test_launcher_refuses_bad_input(tmp_path, flags, refusal):
    """One line naming the flag, exit status 2, nothing started or written."""
    result = tool("launch", tmp_path, f"--env-ids CartPole-v1 {flags} --", short_ppo())
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {refusal}"), result.stderr
    assert result.stdout == "" and os.listdir(tmp_path) == []


def test_a_stopped_launcher_stops_its_experiments(tmp_path):
    """SIGTERM to the local launcher (not to its process group: `kill PID`) reaches the experiments it runs: each
    checkpoints and exits as a stopped run does, none starts after it, and nothing is left running."""
    long_ppo = command("ppo", [*SHORT[:6], "--total-timesteps", "5000000"], shared_cache=True)
    grid = "--env-ids CartPole-v1 --seeds 1 2 3 --workers 2 --".split()
    launcher = subprocess.Popen(
        [sys.executable, os.path.join(REPO, "cleanba", "launch.py"), *grid, *long_ppo],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 180
        logs = []
        while sum(os.path.getsize(log) > 0 for log in logs) < 2:  # both experiments past their first update
            assert launcher.poll() is None and time.time() < deadline, "the two experiments did not get going"
            time.sleep(0.2)
            logs = glob.glob(str(tmp_path / "runs" / "*" / "updates.jsonl"))
        launcher.send_signal(signal.SIGTERM)
        output = launcher.communicate(timeout=120)[0]
        assert launcher.returncode == 128 + signal.SIGTERM, output
        assert output.splitlines()[-1] == "stopped by SIGTERM: 2 experiments stopped, 1 not started", output
        for seed in (1, 2):
            with open(tmp_path / "launch_logs" / f"CartPole-v1__{seed}.log") as f:
                assert f.read().splitlines()[-1].startswith("stopped by SIGTERM after update "), seed
        assert session_processes(launcher.pid) == []
    finally:  # a failure leaves nothing running beside the other tests
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)


def test_local_grid_bounds_concurrency_and_reports_failures(local_grid):
    cwd, result = local_grid
    assert result.returncode == 1, result.stdout + result.stderr
    assert "3 of 4 experiments succeeded" in result.stdout
    assert "FAILED NoSuchGame-v5 seed 1" in result.stdout
    # Each run's active period, from its own files: config.json is written at start, updates.jsonl to the end.
    periods = [(os.path.getmtime(f"{d}/config.json"), os.path.getmtime(f"{d}/updates.jsonl")) for d in run_dirs(cwd)]
    assert len(periods) == 3
    for start, _ in periods:
        assert sum(s <= start < e for s, e in periods) <= 2  # never more than --workers at once
    assert any(s1 < e2 and s2 < e1 for (s1, e1), (s2, e2) in itertools.combinations(periods, 2))  # but in parallel


@pytest.mark.parametrize("workers, gpus, fraction", [(4, "0 1", "0.45"), (3, "0", "0.30"), (2, "0 1", None)])
def test_local_launcher_shares_gpus_and_their_memory(tmp_path, workers, gpus, fraction):
    """Each experiment sees its GPU(s) through CUDA_VISIBLE_DEVICES; experiments sharing a GPU each reserve their
    share of its memory (JAX would reserve 75% each), and a fraction the user set is kept."""
    probe = [
        sys.executable,
        "-c",
        "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES'), os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION'))",
    ]
    flags = f"--env-ids A B C D --seeds 1 --workers {workers} --device-ids {gpus} --"
    assert tool("launch", tmp_path, flags, probe).returncode == 0
    seen = {}
    for env_id in "ABCD":
        with open(tmp_path / "launch_logs" / f"{env_id}__1.log") as f:
            devices, memory = f.read().split()
        seen[env_id] = devices, None if memory == "None" else memory
    expected_gpus = {"0 1": ["0", "1", "0", "1"], "0": ["0"] * 4}[gpus] if workers > len(gpus.split()) else None
    if expected_gpus:
        assert [seen[env_id][0] for env_id in "ABCD"] == expected_gpus  # round-robin while slots are free in order
    else:
        assert {seen[env_id][0] for env_id in "ABCD"} == {"0", "1"}
    assert {memory for _, memory in seen.values()} == {fraction}
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION="0.2")
    assert tool("launch", tmp_path, flags, probe, env=env).returncode == 0
    with open(tmp_path / "launch_logs" / "A__1.log") as f:
        assert f.read().split()[1] == "0.2"


@pytest.mark.parametrize("algo", ["pqn"], indirect=True)
def test_aggregate_grid_tables_and_plots(local_grid, one_thread_run, tmp_path):
    """The local grid's PPO runs and a PQN run (conftest.py's): each row names the script its run's config.json names,
    and each table row has its script's published reference."""
    cwd, _ = local_grid
    directories = [str(cwd / "runs"), os.path.dirname(one_thread_run.path)]
    result = tool("aggregate", tmp_path, directories, ["--out", str(tmp_path)], "--bootstrap 200")
    assert result.returncode == 0, result.stderr
    with open(tmp_path / "scores.csv") as f:
        rows = list(csv.DictReader(f))
    expected = [("cleanba_ppo.py", env_id) for env_id in ("Acrobot-v1", "CartPole-v1", "MountainCar-v0")]
    assert sorted((r["script"], r["env_id"]) for r in rows) == [*expected, ("cleanba_pqn.py", "CartPole-v1")]
    (ppo_cartpole,) = glob.glob(str(cwd / "runs" / "CartPole-v1__*"))
    cartpole_runs = {"cleanba_ppo.py": ppo_cartpole, "cleanba_pqn.py": one_thread_run.path}
    for script, run_dir in cartpole_runs.items():
        (cartpole,) = [float(r["score"]) for r in rows if r["env_id"] == "CartPole-v1" and r["script"] == script]
        assert 9 <= cartpole <= 500
        with open(tmp_path / "games.md") as f:
            (row,) = [line for line in f if "CartPole-v1" in line and f"| {script[: -len('.py')]} |" in line]
        score, minutes, published = [cell.strip() for cell in row.strip().strip("|").split("|")][4:]
        assert float(score.split(" ± ")[0]) == pytest.approx(cartpole, abs=0.05)
        # The run's wall-clock time, from its writer's start to its last return (a short run's may round to 0.0).
        events = read_events(run_dir)
        seconds = events.scalars["charts/episodic_return"][-1][2] - events.started
        assert float(minutes) == pytest.approx(seconds / 60, abs=0.051) and float(minutes) < 5
        assert published.startswith(f"{aggregate.PUBLISHED[script, 'CartPole-v1'][0]:g} ± ")
    # Raw returns of different games are not on one scale: without Atari games there is nothing to aggregate.
    assert "no Atari game to aggregate over" in result.stdout
    assert not os.path.exists(tmp_path / "aggregates.md")
    for name in ["curves_CartPole-v1.png", "curves_MountainCar-v0.png"]:
        with open(tmp_path / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_aggregates_and_their_confidence_intervals():
    hns = {"Pong-v5": [0.0, 0.1, 0.2], "Breakout-v5": [1.0, 1.2, 1.4], "Qbert-v5": [5.0, 5.0, 5.0]}
    point = aggregate.aggregates(hns)
    assert point["median"] == pytest.approx(1.2)  # of the game means 0.1, 1.2, 5.0
    assert point["mean"] == pytest.approx(6.3 / 3)
    assert point["iqm"] == pytest.approx(np.mean([0.2, 1.0, 1.2, 1.4, 5.0]))  # the middle half of 9 scores
    interval = aggregate.stratified_bootstrap(hns, repetitions=500)
    for name in ("median", "iqm", "mean"):
        low, high = interval[name]
        assert low <= point[name] <= high
    assert interval["mean"][0] < interval["mean"][1]
    assert interval["mean"][0] > (0.0 + 1.0 + 5.0) / 3  # every resample keeps every game (stratified)


def test_human_normalized_scores():
    assert aggregate.human_normalized("Breakout-v5", 30.5) == pytest.approx(1.0)
    assert aggregate.human_normalized("Breakout-v5", 1.7) == pytest.approx(0.0)
    for game, (random_score, human_score) in aggregate.ATARI_REFERENCE_SCORES.items():
        assert aggregate.human_normalized(f"{game}-v5", human_score) == pytest.approx(1.0)
        assert aggregate.human_normalized(f"{game}-v5", random_score) == pytest.approx(0.0, abs=1e-12)
    assert aggregate.human_normalized("CartPole-v1", 500.0) is None
    # The 57 games: all in EnvPool, and exactly benchmark.sh's Atari-57 grid.
    assert len(aggregate.ATARI_REFERENCE_SCORES) == 57
    atari = {f"{game}-v5" for game in aggregate.ATARI_REFERENCE_SCORES}
    assert atari <= set(envpool.list_all_envs())
    with open(os.path.join(REPO, "benchmark.sh")) as f:
        grid = re.search(r'ATARI57="([^"]*)"', f.read()).group(1).split()
    assert set(grid) == atari and len(grid) == 57


def test_bootstrap_intervals_contain_the_point_estimates_and_are_reproducible():
    rng = np.random.default_rng(3)
    scores = {f"game{i}": list(rng.normal(i, 1.0, size=3)) for i in range(10)}
    point, interval = aggregate.aggregates(scores), aggregate.stratified_bootstrap(scores, repetitions=500)
    for name in ("median", "mean", "iqm"):
        low, high = interval[name]
        assert low <= point[name] <= high and high - low > 0
    np.random.seed(1)  # NumPy's global generator, which rliable's own bootstrap draws from, has no say
    assert aggregate.stratified_bootstrap(scores, repetitions=500) == interval
    assert aggregate.stratified_bootstrap(scores, repetitions=500, seed=1) != interval
    assert aggregate.interquartile_mean([0, 1, 2, 3, 4, 5, 6, 100]) == pytest.approx(3.5)
