"""What the test files share: the algorithm parameter, the settings of every script the tests start, and the
training runs that several tests read (each made once per test session, helpers.made_once)."""

import os
import shutil

import jax
import pytest
from helpers import (
    ALGOS,
    CARTPOLE,
    CARTPOLE_LSTM,
    Run,
    check,
    finished_run,
    made_once,
    run,
    run_processes,
    script_env,
    trained,
)
from slurm_cluster import missing_tools, slurm_cluster

# The tests' own process checks bad input and --help in-process, on three CPU devices like the layouts the
# scripts run with in subprocesses (set before JAX starts its backend).
jax.config.update("jax_num_cpu_devices", 3)
# imageio-ffmpeg, which reads the videos back here, starts ffmpeg with a preexec_fn (keeping Ctrl-C from it) unless
# told not to: in this process, whose JAX has started, that runs JAX's fork hook and its deadlock warning.
os.environ["IMAGEIO_FFMPEG_NO_PREVENT_SIGINT"] = "1"


def pytest_collection_modifyitems(items):
    """The longest tests first: SLURM's (the requeue test takes ~3.5 minutes), then those marked slow. pytest-xdist
    hands tests out one at a time (--maxschedchunk 1, pyproject.toml) in this order, so no worker is left running a
    minutes-long test at the end while the others wait."""
    items.sort(key=lambda item: 0 if item.get_closest_marker("slurm") else 1 if item.get_closest_marker("slow") else 2)


@pytest.fixture(scope="session", autouse=True)
def shared_compilation_cache(tmp_path_factory):
    """Every script the tests start shares one persistent compilation cache (most compile the same programs),
    small programs included: helpers.run and helpers.start pass it on. pytest-xdist's workers share it too."""
    root = tmp_path_factory.getbasetemp()
    cache = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "compilation-cache"
    cache.mkdir(exist_ok=True)
    os.environ["CLEANBA_TEST_COMPILATION_CACHE"] = str(cache)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


@pytest.fixture(scope="session", params=ALGOS)
def algo(request) -> str:
    return request.param


# CartPole with 8 environments in all and 12 updates; each layout below splits the same global configuration.
CARTPOLE_8_ENVS = [*CARTPOLE, "--total-timesteps", 12 * 8 * 32]
SYNC_FLAGS = [*CARTPOLE_8_ENVS, "--no-concurrency", "--run-name", "sync", "--save-model"]


@pytest.fixture(scope="session")
def sync_run(algo, tmp_path_factory) -> Run:
    """2 actor threads x 4 envs, synchronous, named, with --save-model; PPO's with the default compilation cache (under
    runs/ in its directory, which sync_rerun reuses), the others' with the tests' shared one (cleanba_run compiles the
    same update). A copy of its directory as it ended is kept for sync_rerun."""

    def make(cwd):
        finished = trained(*SYNC_FLAGS, algo=algo, shared_cache=algo != "ppo")(cwd)
        shutil.copytree(cwd, cwd.parent / f"{cwd.name}-as-it-ended")
        return finished

    return made_once(tmp_path_factory, f"sync-{algo}", make)


@pytest.fixture(scope="session")
def sync_rerun(algo, sync_run, tmp_path_factory) -> tuple[str, Run]:
    """In a copy of the sync run's directory (its compilation cache included), the same command again (it finds the
    run finished), then with --no-resume (it starts over). Returns the first one's output and the second run."""

    def make(cwd):
        shutil.copytree(f"{os.path.dirname(os.path.dirname(sync_run.path))}-as-it-ended", cwd, dirs_exist_ok=True)
        again = check(run(cwd, *SYNC_FLAGS, algo=algo, shared_cache=False)).stdout
        return again, trained(*SYNC_FLAGS, "--no-resume", algo=algo, shared_cache=False)(cwd)

    return made_once(tmp_path_factory, f"sync-rerun-{algo}", make)


@pytest.fixture(scope="session")
def cleanba_run(algo, tmp_path_factory) -> Run:
    """The same with the Cleanba architecture, mirrored to W&B (offline)."""

    def make(cwd):
        env = dict(script_env(), WANDB_MODE="offline", WANDB_DIR=str(cwd), WANDB_SILENT="true")
        return trained(*CARTPOLE_8_ENVS, "--concurrency", "--track", env=env, algo=algo)(cwd)

    return made_once(tmp_path_factory, f"cleanba-{algo}", make)


@pytest.fixture(scope="session")
def cleanba_rerun(algo, tmp_path_factory) -> Run:
    """The Cleanba run's configuration again (not mirrored to W&B, a Runtime flag), in a directory of its own."""
    return made_once(tmp_path_factory, f"cleanba-rerun-{algo}", trained(*CARTPOLE_8_ENVS, "--concurrency", algo=algo))


@pytest.fixture(scope="session")
def one_thread_run(algo, tmp_path_factory) -> Run:
    """Synchronous, 1 actor thread x 8 envs."""
    flags = [*CARTPOLE_8_ENVS, "--no-concurrency", "--num-actor-threads", 1, "--local-num-envs", 8]
    return made_once(tmp_path_factory, f"one-thread-{algo}", trained(*flags, algo=algo))


@pytest.fixture(scope="session")
def two_learners_run(algo, tmp_path_factory) -> Run:
    """1 actor thread x 8 envs on device 0, the learner on devices 1 and 2."""
    flags = [*CARTPOLE_8_ENVS, "--no-concurrency", "--num-actor-threads", 1, "--local-num-envs", 8]
    flags += ["--actor-device-ids", 0, "--learner-device-ids", 1, 2]
    return made_once(tmp_path_factory, f"two-learners-{algo}", trained(*flags, num_devices=3, algo=algo))


@pytest.fixture(scope="session")
def two_processes_run(algo, tmp_path_factory) -> Run:
    """2 processes (--distributed on localhost) x 1 actor thread x 4 envs. IMPALA's has an LSTM (lstm_runs' CartPole
    below): each process's actors record their envs' core states, which the learner on both replays from."""
    configuration = LSTM_8_ENVS if algo == "impala" else [*CARTPOLE_8_ENVS, "--no-concurrency"]
    flags = [*configuration, "--num-actor-threads", 1, "--local-num-envs", 4]

    def make(cwd):
        return finished_run(cwd, run_processes(cwd, *flags, algo=algo)[0])

    return made_once(tmp_path_factory, f"two-processes-{algo}", make)


# Continuous control: HalfCheetah-v4 (observations and rewards normalised by default), 8 envs, 1 update, on three
# layouts: 2 actor threads x 4 envs, 1 thread x 8, and 1 thread x 8 with the learner on devices 1 and 2.
# One update: the layouts part from the second batch on (test_continuous_control_across_layouts says why).
HALFCHEETAH_8_ENVS = "--env-id HalfCheetah-v4 --num-steps 32 --num-minibatches 4 --total-timesteps 256".split()
CONTINUOUS_LAYOUTS = {
    "two_threads": (["--num-actor-threads", 2, "--local-num-envs", 4], 1),
    "one_thread": (["--num-actor-threads", 1, "--local-num-envs", 8], 1),
    "two_learners": (["--num-actor-threads", 1, "--local-num-envs", 8, "--learner-device-ids", 1, 2], 3),
}


@pytest.fixture(scope="session")
def continuous_runs(algo, tmp_path_factory) -> dict[str, Run]:
    runs = {}
    for name, (layout, num_devices) in CONTINUOUS_LAYOUTS.items():
        make = trained(*HALFCHEETAH_8_ENVS, "--no-concurrency", *layout, num_devices=num_devices, algo=algo)
        runs[name] = made_once(tmp_path_factory, f"continuous-{name}-{algo}", make)
    return runs


# CartPole with an LSTM (--lstm-size 8), 8 envs, 8 updates, on three layouts, and the first again.
LSTM_8_ENVS = [*CARTPOLE_LSTM, "--total-timesteps", 8 * 8 * 32, "--log-frequency", 1]
LSTM_LAYOUTS = {
    "two_threads": ["--num-actor-threads", 2, "--local-num-envs", 4],
    "one_thread": ["--num-actor-threads", 1, "--local-num-envs", 8],
    "two_learners": ["--num-actor-threads", 1, "--local-num-envs", 8, "--learner-device-ids", 1, 2],
    "two_threads_again": ["--num-actor-threads", 2, "--local-num-envs", 4],
}


@pytest.fixture(scope="session")
def lstm_runs(algo, tmp_path_factory) -> dict[str, Run]:
    runs = {}
    for name, layout in LSTM_LAYOUTS.items():
        make = trained(*LSTM_8_ENVS, *layout, num_devices=3, algo=algo)
        runs[name] = made_once(tmp_path_factory, f"lstm-{name}-{algo}", make)
    return runs


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-node SLURM cluster on this machine (tests/slurm_cluster.py) for a module's tests marked slurm."""
    if missing_tools():
        pytest.fail(
            f"the SLURM tests need {', '.join(missing_tools())}: apt-get install slurm-wlm munge "
            "(setup.sh does it when run as root); deselect them with -m 'not slurm'"
        )
    with slurm_cluster(str(tmp_path_factory.mktemp("slurm"))) as env:
        yield env
