"""The scripts as code: what every field of Args is, what the two scripts share, and how they answer --help and
bad input. These run in the test process itself (3 CPU devices, see conftest.py), plus one run per script as a
user starts it."""

import ast
import dataclasses
import functools
import os
import signal
import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
import tyro
from helpers import (
    CARTPOLE,
    MINIGRID_LSTM,
    POLICY_GRADIENT,
    SCRIPTS,
    check,
    load_script,
    run,
    run_dirs,
    script_env,
    script_parts,
    stop_actors,
)

# What the scripts do differently on purpose: their arguments and checks, the actor's rollout (what it records),
# the update and the optimiser; PQN's networks are a Q-network. Everything else they define under one name must stay
# identical.
DIFFERENT_ON_PURPOSE = {
    "Args",
    "check_args",
    "derive_config",
    "make_rollout",
    "make_update",
    "init_train_state",
}
Q_NETWORK = {"Networks", "make_networks", "Outputs", "forward"}


def definitions(path: str) -> dict[str, str]:
    """{name: source} of a script's top-level functions, classes and constants, and of each class's methods
    (as Class.method); a class's own entry then holds its source without those methods. The other top-level
    statements but the imports and the docstring (the hand-off to the supervisor, the __main__ block) are named by
    their order, "statement 1" on."""
    with open(path) as f:
        source = f.read()
    found = {}
    body = ast.parse(source).body
    named = ast.Import | ast.ImportFrom | ast.FunctionDef | ast.ClassDef | ast.Assign | ast.AnnAssign
    others = [node for node in body[1:] if not isinstance(node, named)]  # body[0]: the docstring
    for number, node in enumerate(others, start=1):
        found[f"statement {number}"] = ast.get_source_segment(source, node)
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            found[node.name] = ast.get_source_segment(source, node)
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        method = ast.get_source_segment(source, item)
                        found[f"{node.name}.{item.name}"] = method
                        found[node.name] = found[node.name].replace(method, "")
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            found[ast.get_source_segment(source, node).split("=")[0].strip()] = ast.get_source_segment(source, node)
    return found


def test_shared_code_is_identical_in_every_script():
    """Copy-and-modify must not turn into quiet divergence: whatever two scripts define under one name is the
    same text, except what they do differently on purpose."""
    ppo, impala, pqn = (definitions(SCRIPTS[algo]) for algo in ("ppo", "impala", "pqn"))
    for (name_a, a), (name_b, b), on_purpose in [
        (("ppo", ppo), ("impala", impala), DIFFERENT_ON_PURPOSE),
        (("ppo", ppo), ("pqn", pqn), DIFFERENT_ON_PURPOSE | Q_NETWORK),
        (("impala", impala), ("pqn", pqn), DIFFERENT_ON_PURPOSE | Q_NETWORK),
    ]:
        assert on_purpose <= set(a) & set(b)  # the lists name nothing that is gone
        shared = set(a) & set(b)
        assert len(shared) > 40, sorted(shared)
        drifted = sorted(name for name in shared - on_purpose if a[name] != b[name])
        assert not drifted, f"shared code differs between {name_a} and {name_b}: {drifted}"
    assert set(ppo) ^ set(impala) == {"gae", "vtrace_targets"}  # each algorithm's own targets
    # PQN has no policy distribution and no normalisation statistics (discrete actions only; Atari's frames, CartPole).
    policy = {"Categorical", "DiagonalGaussian", "Actor", "running_stats", "normalisation"}
    policy |= {
        f"{cls}.{method}"
        for cls in ("Categorical", "DiagonalGaussian")
        for method in ("sample", "log_prob_and_entropy")
    }
    assert set(ppo) - set(pqn) == {"gae", "Actor.__call__", *policy}
    assert set(pqn) - set(ppo) == {"q_lambda_returns", "exploration_rate"}


def test_scripts_are_written_for_reading(algo):
    """At most 1,535 lines, the algorithm (above the signpost) at most 800; one statement per line, no lambda bound to
    a name, no conditional expression inside another (or as an if's condition), no tuple of values assigned to a tuple
    of names, no noqa, no line over 120 characters (ruff, run by .ci/run, holds the rest: E701/E702 one statement per
    line, E731 lambdas)."""
    with open(SCRIPTS[algo]) as f:
        source = f.read()
    lines = source.splitlines()
    algorithm = next(n for n, line in enumerate(lines) if line.startswith("# The algorithm ends here"))
    found = [f"{len(lines)} lines: at most 1,535"] if len(lines) > 1535 else []
    found += [f"the algorithm has {algorithm} lines: at most 800"] if algorithm > 800 else []
    found += [f"line {n}: noqa" for n, line in enumerate(source.splitlines(), 1) if "noqa" in line]
    found += [f"line {n}: {len(line)} characters" for n, line in enumerate(source.splitlines(), 1) if len(line) > 120]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Lambda):
            found.append(f"line {node.lineno}: a lambda bound to a name")
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.targets[0], ast.Tuple)
            and isinstance(node.value, ast.Tuple)
        ):
            found.append(f"line {node.lineno}: a tuple assignment")
        if isinstance(node, ast.If | ast.While) and isinstance(node.test, ast.IfExp):
            found.append(f"line {node.lineno}: a conditional expression as a condition")
        if isinstance(node, ast.IfExp):
            inner = [
                n for part in (node.test, node.body, node.orelse) for n in ast.walk(part) if isinstance(n, ast.IfExp)
            ]
            if inner:
                found.append(f"line {node.lineno}: nested conditional expressions")
    assert not found, found


def test_every_field_is_algorithm_or_runtime(algo, tmp_path, monkeypatch):
    """Each field of Args says whether it is part of what the run computes (hashed into the run name, checked
    against a checkpoint on resume) or only of where it runs and how it logs; a new flag that says neither
    fails here. A runtime flag leaves the run name alone, an algorithm flag changes it."""
    script = load_script(algo)
    kinds = {field.name: getattr(field.type, "__metadata__", ()) for field in dataclasses.fields(script.Args)}
    unmarked = [name for name, kind in kinds.items() if kind not in {("algorithm",), ("runtime",)}]
    assert not unmarked, f"fields of Args that are neither Algorithm[...] nor Runtime[...]: {unmarked}"
    monkeypatch.chdir(tmp_path)

    def run_name(*flags):
        flags = ["--env-id", "CartPole-v1", "--compilation-cache-dir", "None", *map(str, flags)]
        args = tyro.cli(script.Args, args=flags)
        return script.start_up(args)[1]

    assert run_name() == run_name("--log-frequency", 5, "--learner-device-ids", 1, 2, "--local-num-envs", 64)
    assert run_name() != run_name("--learning-rate", 1e-3)
    assert run_name() != run_name("--local-num-envs", 32)  # the global number of environments is algorithm
    assert {name for run_dir in run_dirs(tmp_path) for name in os.listdir(run_dir)} == {"lock"}  # its owner, no more


def test_help_lists_every_flag(algo, capsys):
    with pytest.raises(SystemExit) as exit_status:
        tyro.cli(load_script(algo).Args, args=["--help"])
    assert exit_status.value.code == 0
    help_text = capsys.readouterr().out
    for field in dataclasses.fields(load_script(algo).Args):
        assert f"--{field.name.replace('_', '-')}" in help_text, field.name


BAD_INPUT = [
    (["--local-num-envs", 3, "--num-actor-threads", 1, "--learner-device-ids", 1, 2], "--local-num-envs"),
    (["--learner-device-ids", 0, 5], "--learner-device-ids"),
    (["--actor-device-ids", 7], "--actor-device-ids"),
    (["--env-id", "NoSuchGame-v5"], "--env-id"),
    (["--total-timesteps", 1000], "--total-timesteps"),
    (["--local-num-envs", 0], "--local-num-envs"),
    (["--num-minibatches", -1], "--num-minibatches"),
    (["--num-actor-threads", 0], "--num-actor-threads"),
    (["--run-name", "../elsewhere"], "--run-name"),
    (["--exp-name", "ablations/lr"], "--exp-name"),  # in the run's name and its model's file name
    (["--env-threads", -1], "--env-threads"),
    (["--max-grad-norm", -1], "--max-grad-norm"),  # a norm clipped to a negative bound: no training
    (["--lstm-size", -1], "--lstm-size"),
    (["--frame-stack", 1], "--frame-stack"),  # Atari's option, CartPole's run
    (["--env-id", "Breakout-v5", "--frame-stack", 0], "--frame-stack"),
    (["--env-id", "Taxi-v3"], "--env-id"),  # a discrete observation: nothing to encode it
    (["--env-id", "Highway-v0"], "--env-id"),  # a matrix of vehicles: neither a vector nor an image
    (["--num-levels", 200], "--num-levels"),  # Procgen's option, CartPole's run
    (["--env-id", "StarpilotEasy-v0", "--start-level", -1], "--start-level"),
    (["--env-id", "Snake-v1"], "--env-id"),  # Jumanji: a grid of floats in a dict, not MiniGrid's cell ids
    (["--env-id", "Go9x9-v1"], "--env-id"),  # a game of two players
    (["--env-id", "D1Basic-v1"], "--env-id"),  # ViZDoom: a vector of button values without bounds
    (["--mask-obs", 1, 4], "--mask-obs"),  # CartPole's components are 0 to 3
    (["--view-size", 3], "--view-size"),  # CartPole has no MiniGrid view
    (["--env-id", "MiniGrid-MemoryS9-v0", "--view-size", 4], "--view-size"),  # odd sizes only
    (["--layout-free-group-size", 3], "--layout-free-group-size"),  # 64 envs per thread: not whole pairs of groups
    (["--layout-free-group-size", -1], "--layout-free-group-size"),
    (["--env-id", "MiniGrid-Empty-5x5-v0", "--mask-obs", 1], "--mask-obs"),  # a dict, not a vector
    (["--seed", -1], "--seed"),
    (["--seed", 2**32], "--seed"),  # JAX's keys would take seed 0's
    (["--num-processes", 2, "--process-id", 1], "--num-processes"),  # without --distributed: two runs in one directory
    (["--process-id", 1], "--num-processes"),  # the same
    (["--distributed", "--num-processes", 2, "--process-id", 2], "--process-id"),  # ranks are 0 and 1
    (["--exp-name", "x" * 300], "--exp-name"),  # a directory name over 255 bytes: OSError once it is made
    (["--exp-name", "two\nlines"], "--exp-name"),
    (["--distributed", "--coordinator-address", "not a host"], "--coordinator-address"),  # JAX's IndexError
    (["--total-timesteps", 2_000_000_000_000], "--total-timesteps"),  # JAX's 32-bit step counts: OverflowError
    (["--learning-rate", "inf"], "--learning-rate"),  # accepted, then a traceback at update 1
]
NORM_OBS_ON_A_DICT = (["--env-id", "MiniGrid-Empty-5x5-v0", "--norm-obs", "True"], "--norm-obs")
# Continuous actions normalise observations by default: a dict of them (DMC's) needs --norm-obs False.
NORM_OBS_BY_DEFAULT_ON_A_DICT = (["--env-id", "CheetahRun-v1"], "--norm-obs")
ALGO_BAD_INPUT = {
    "ppo": [
        (["--num-steps", 10, "--num-minibatches", 3], "--num-minibatches"),
        (["--update-epochs", 0], "--update-epochs"),
        NORM_OBS_ON_A_DICT,
        NORM_OBS_BY_DEFAULT_ON_A_DICT,
        (["--critic-core"], "--critic-core"),  # without --lstm-size
        (["--clip-coef", -0.1], "--clip-coef"),
        (["--ent-coef", "nan"], "--ent-coef"),
        (["--adam-eps", -1], "--adam-eps"),
        (["--vf-coef", -1], "--vf-coef"),
    ],
    "impala": [
        (["--local-num-envs", 6, "--num-actor-threads", 1, "--num-minibatches", 4], "--num-minibatches"),
        (["--rmsprop-eps", 0], "--rmsprop-eps"),
        (["--ent-coef", "nan"], "--ent-coef"),
        (["--vf-coef", -1], "--vf-coef"),
        NORM_OBS_ON_A_DICT,
        NORM_OBS_BY_DEFAULT_ON_A_DICT,
    ],
    "pqn": [
        (["--env-id", "HalfCheetah-v4"], "--env-id"),  # continuous actions: no arg max
        (["--num-steps", 10, "--num-minibatches", 3], "--num-minibatches"),
        (["--q-lambda", 1.5], "--q-lambda"),
        (["--end-e", -0.1], "--end-e"),
        (["--exploration-fraction", 0], "--exploration-fraction"),
    ],
}


def test_bad_input_is_refused(algo, tmp_path, monkeypatch, capsys):
    """Every case: main() refuses it (ConfigError, which the script prints as one line, exit status 2) with a
    message that starts with the flag at fault, prints nothing and creates nothing. Checked in-process;
    test_bad_input_as_a_user_sees_it runs one case as a user does."""
    script = load_script(algo)
    monkeypatch.chdir(tmp_path)
    handlers = [(signum, signal.getsignal(signum)) for signum in (signal.SIGTERM, signal.SIGINT)]
    try:
        for flags, flag in BAD_INPUT + ALGO_BAD_INPUT[algo]:
            flags = ["--env-id", "CartPole-v1", "--compilation-cache-dir", "None", *map(str, flags)]
            with pytest.raises(script.ConfigError) as refused:
                script.main(tyro.cli(script.Args, args=flags))
            captured = capsys.readouterr()
            assert str(refused.value).startswith(f"{flag} ") and "\n" not in str(refused.value), (flags, refused)
            assert captured.out == captured.err == "" and os.listdir(tmp_path) == [], flags
    finally:
        for signum, handler in handlers:  # main() made its stop signals this process's: they are pytest's again
            signal.signal(signum, handler)


def test_bad_input_as_a_user_sees_it(algo, tmp_path):
    result = run(
        tmp_path, "--env-id", "CartPole-v1", "--learner-device-ids", 0, 5, num_devices=3, timeout=60, algo=algo
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == ["error: --learner-device-ids [5] do not exist: 3 devices here"]
    assert "Traceback" not in result.stderr + result.stdout and run_dirs(tmp_path) == []


def test_a_gpu_jax_cannot_see_is_refused(tmp_path):
    """On a machine with an NVIDIA GPU (here a stand-in nvidia-smi) and JAX's CPU build, the run stops before it
    creates anything, with one line saying how to fix it; JAX_PLATFORMS=cpu says the CPU is wanted, and it runs. The
    check is derive_config's, the same text in every script (test_shared_code_is_identical_in_every_script): PPO
    runs it."""
    with open(tmp_path / "nvidia-smi", "w") as f:
        f.write('#!/bin/sh\necho "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000)"\n')
    os.chmod(tmp_path / "nvidia-smi", 0o755)
    env = dict(script_env(), PATH=f"{tmp_path}:{os.environ['PATH']}")
    env.pop("JAX_PLATFORMS", None)
    flags = [*CARTPOLE, "--num-actor-threads", 1, "--total-timesteps", 2 * 128]
    refused = run(tmp_path, *flags, env=env, timeout=60)
    assert refused.returncode == 2 and refused.stdout == "", refused.stderr
    assert refused.stderr.strip().splitlines() == [
        "error: this machine has an NVIDIA GPU but JAX sees only the CPU: `bash setup.sh` installs JAX's CUDA "
        "build; JAX_PLATFORMS=cpu trains on the CPU"
    ]
    assert run_dirs(tmp_path) == []
    wanted = check(run(tmp_path, *flags, env=dict(env, JAX_PLATFORMS="cpu")))
    assert "devices: 1 cpu (cpu)" in wanted.stdout and "update 2/2" in wanted.stdout


def test_deterministic_gpu_ops_reach_the_compiler(tmp_path):
    """The same command twice on a GPU is the same run only with XLA's deterministic GPU ops, which the scripts set
    themselves (XLA_FLAGS, before the backend starts; a setting of the user's stays): every program compiled carries
    the option, on by default, off with --no-deterministic-gpu. XLA writes each program's options beside its dump.
    With the compilation cache on, XLA is not handed JAX's cache of GPU algorithms (timed by runs without the
    option, they would change a deterministic run's bits): the command alone sets them (performance.md)."""
    for cache, flags, deterministic in [(tmp_path / "cache", [], True), (None, ["--no-deterministic-gpu"], False)]:
        dump = tmp_path / f"dump_{deterministic}"
        env = script_env()
        # Without a setting of its own (a script's start_up run in this process would have left one).
        xla_flags = [flag for flag in env.get("XLA_FLAGS", "").split() if "deterministic" not in flag]
        env["XLA_FLAGS"] = " ".join([*xla_flags, f"--xla_dump_to={dump}"])
        flags += ["--no-resume", "--compilation-cache-dir", cache]  # every program compiled: a new cache, or none
        check(run(tmp_path, *CARTPOLE, "--total-timesteps", 256, *flags, env=env, shared_cache=False))
        options = [path.read_text() for path in dump.glob("*.debug_options")]
        assert len(options) >= 5  # the rollout, the update, the initialisation...
        assert all(("xla_gpu_deterministic_ops: true" in text) == deterministic for text in options)
        assert not any("autotune_cache_dir" in text for text in options)
    assert list((tmp_path / "cache").iterdir())  # the cache was on


def test_environment_threads_share_the_cpus(algo):
    """Each actor thread's EnvPool gets an equal share of the CPUs the process may use, pinned to them when their
    ids are consecutive; --env-threads sets the number instead (unpinned). EnvPool takes the settings."""
    script = load_script(algo)
    args = tyro.cli(script.Args, args=["--actor-device-ids", "0", "1"])  # 2 devices x 2 threads: 4 pools
    assert [script.env_threads(args, pool, list(range(16))) for pool in range(4)] == [
        dict(num_threads=4, thread_affinity_offset=offset) for offset in (0, 4, 8, 12)
    ]
    assert script.env_threads(args, 1, [0, 2, 4, 6, 8, 10, 12, 14]) == dict(num_threads=2, thread_affinity_offset=-1)
    assert script.env_threads(args, 3, [5, 6]) == dict(num_threads=1, thread_affinity_offset=6)  # fewer CPUs: shared
    assert script.env_threads(tyro.cli(script.Args, args=["--env-threads", "3"]), 0, list(range(16))) == dict(
        num_threads=3
    )
    envs = script.make_env(
        tyro.cli(script.Args, args=["--env-id", "CartPole-v1"]), 8, 0, **script.env_threads(args, 1, list(range(16)))
    )
    assert envs.config["num_threads"] == 4 and envs.config["thread_affinity_offset"] == 4


def flax_max_pool(x):  # the ResNet's before 2026-11-26: its gradient is XLA's select-and-scatter
    return nn.max_pool(x, window_shape=(3, 3), strides=(2, 2), padding="SAME")


def test_the_resnet_max_pool_is_flaxs_bit_for_bit_on_a_cpu():
    """The ResNet's max-pool (strided slices, no scatter in its gradient: fast with deterministic GPU ops) gives what
    flax's nn.max_pool gives, values and gradients, to the bit on a CPU: at ties too (the gradient goes to the first
    maximum), on the ResNet's three sizes (even and odd), so CPU runs are those before it replaced flax's."""
    script = load_script("ppo")
    rng = np.random.default_rng(0)

    @functools.partial(jax.jit, static_argnums=0)
    def gradient(pool, x, weights):
        return jax.grad(lambda x: jnp.sum(jnp.tanh(pool(x) * weights)))(x)

    for size, channels in [(84, 16), (42, 32), (21, 32)]:
        x = np.round(rng.normal(size=(3, size, size, channels)) * 2).astype(np.float32) / 2  # many ties
        weights = rng.normal(size=(3, (size + 1) // 2, (size + 1) // 2, channels)).astype(np.float32)
        ours, theirs = jax.jit(script.max_pool)(x), jax.jit(flax_max_pool)(x)
        assert ours.shape == theirs.shape and np.array_equal(ours, theirs)
        ours, theirs = gradient(script.max_pool, x, weights), gradient(flax_max_pool, x, weights)
        assert np.count_nonzero(theirs) and np.array_equal(ours, theirs)


@pytest.mark.parametrize("algo", POLICY_GRADIENT)
def test_the_gaussian_head_is_a_diagonal_normal(algo):
    script = load_script(algo)
    mean, log_std, action = np.array([[0.3, -1.0]]), np.array([[0.1, -0.5]]), np.array([[1.0, 0.0]])
    log_prob, entropy = script.DiagonalGaussian(mean, log_std).log_prob_and_entropy(action)
    assert float(log_prob[0]) == pytest.approx(scipy.stats.norm.logpdf(action, mean, np.exp(log_std)).sum(), rel=1e-6)
    assert float(entropy[0]) == pytest.approx(scipy.stats.norm.entropy(scale=np.exp(log_std)).sum(), rel=1e-6)
    samples = script.DiagonalGaussian(np.full((20000, 2), 0.5), np.full((20000, 2), -1.0)).sample(jax.random.key(0))
    assert np.mean(samples) == pytest.approx(0.5, abs=0.01) and np.std(samples) == pytest.approx(np.exp(-1.0), rel=0.02)


@pytest.mark.parametrize("algo", POLICY_GRADIENT)
def test_continuous_actions_are_stored_as_sampled(algo):
    """The actor clips a Gaussian's sample to the action bounds only on its way to the environment: the batch holds
    the sample itself (HalfCheetah's bounds are +-1; the initial policy's std is 1) and its log-probability under
    the policy that sampled it, the observations normalised by the statistics that came with the parameters."""
    script = load_script(algo)
    flags = "--env-id HalfCheetah-v4 --local-num-envs 4 --num-actor-threads 1 --num-steps 8 --total-timesteps 64"
    args, cfg, _, networks, state = script_parts(script, *flags.split())
    params = script.to_host(state.params)
    params["obs_stats"] = dict(mean=np.full(17, 0.5, np.float32), var=np.full(17, 4.0, np.float32), count=np.float32(9))
    actors = script.Actors(args, cfg, networks, 0, threading.Event())
    try:
        actors.publish(script.replicate(params, cfg), 1)
        (rollout,) = actors.collect()
    finally:
        stop_actors(actors)
    actions = rollout.batch["actions"]
    assert actions.shape == (8, 4, 6) and actions.dtype == np.float32 and np.abs(actions).max() > 1.5
    first_steps = np.zeros((8, 4), bool)  # HalfCheetah's episodes last 1,000 steps
    dist, _, _ = script.forward(
        networks, params, rollout.batch["obs"][:8], rollout.batch["core_states"][0], first_steps
    )
    log_prob, _ = dist.log_prob_and_entropy(actions)
    np.testing.assert_allclose(log_prob, rollout.batch["logprobs"], rtol=1e-5)


# Each script's own rollout (make_rollout), and each kind of observation, action and core the shared code handles.
GPU_LOOP_CASES = {
    "ppo": ["--env-id CartPole-v1", "--env-id HalfCheetah-v4"],  # categorical; Gaussian, clipped, MuJoCo's float64
    "impala": ["--env-id CartPole-v1 --lstm-size 8", MINIGRID_LSTM],  # a core; a dict observation bootstrapped from
    "pqn": ["--env-id CartPole-v1 --lstm-size 8"],
}


@pytest.mark.parametrize("algo, flags", [(algo, flags) for algo, cases in GPU_LOOP_CASES.items() for flags in cases])
def test_the_gpu_rollout_loop_collects_what_the_compiled_rollout_does(algo, flags):
    """On a CPU the rollout is one compiled program with EnvPool stepping inside it; on a GPU the actor thread's envs
    are split into pools that take turns between jitted calls of the same functions (compile_rollout says why). CI
    has no GPU: here all run on the CPU from the same seed, one pool of 4 compiled, and in a loop 1 pool of 4 and 2
    pools of 2, and must collect the same batches (a Gaussian's log-probabilities may round apart in the last bit:
    the policy is compiled into another program)."""
    script = load_script(algo)
    args, _, _, networks, state = script_parts(script, *flags.split(), "--num-steps", 16, "--num-minibatches", 4)
    batches = {}
    for platform, num_pools in [("cpu", 1), ("gpu", 1), ("gpu", 2)]:
        pools_ids = np.split(np.arange(4), num_pools)
        pools = [script.make_env(args, len(ids), int(ids[0])) for ids in pools_ids]
        handle, rollout = script.make_rollout(args, networks, pools, platform)
        states = [
            script.first_state(envs, handle, ids, 0, networks) for envs, ids in zip(pools, pools_ids, strict=True)
        ]
        batches[platform, num_pools] = []
        for _ in range(3):
            states, batch = rollout(jax.tree.map(lambda x: x.addressable_data(0), state.params), states)
            batches[platform, num_pools].append(jax.device_get(batch))
    for loop in [("gpu", 1), ("gpu", 2)]:
        for compiled, looped in zip(batches["cpu", 1], batches[loop], strict=True):
            assert jax.tree.structure(compiled) == jax.tree.structure(looped)
            for (path, x), y in zip(jax.tree.leaves_with_path(compiled), jax.tree.leaves(looped), strict=True):
                if path[0].key == "logprobs":
                    np.testing.assert_allclose(y, x, rtol=1e-6, atol=1e-6)
                else:
                    np.testing.assert_array_equal(y, x, err_msg=f"{loop} {jax.tree_util.keystr(path)}")
    if args.env_id == "CartPole-v1":  # episode ends and EnvPool's reset steps are among the steps compared
        assert all(batch["dones"].any() and not batch["valid"].all() for batch in batches["cpu", 1][1:])
