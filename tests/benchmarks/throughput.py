"""Throughput benchmark: how fast the training scripts run, against the limits measured in the same run.

    .venv/bin/python tests/benchmarks/throughput.py                  # this platform's configurations
    .venv/bin/python tests/benchmarks/throughput.py --configs cartpole --algos ppo --out cartpole.json
    .venv/bin/python tests/benchmarks/throughput.py --parts ppo --out parts.json -- --env-id Breakout-v5  # one part

For each configuration (an environment and a batch shape) and each script, it measures:

- env ceiling: EnvPool alone, the same environments in the same actor threads (and EnvPool threads), random actions;
- compute ceiling: the script's own jitted actor inference (every call of a rollout, every actor thread)
  and learner update, on a batch of the same shape, each timed alone after compilation; the sum of the two
  is the compute time of one batch where actor and learner share a device (on CPU they always share the
  cores); with devices of their own the slower one bounds it. Their compile time is reported too;
- actor alone: the script's actor threads collecting rollouts with nobody training (env + inference);
- training: the script itself, run as a user runs it (a subprocess), in both architectures (synchronous,
  Cleanba) and in each layout (actor and learner on one device; on two where there are two, simulated on
  CPU): steady-state steps/s from the update timestamps after the first updates (compilation), the
  fraction of the time the learner waited for data and the actors waited for parameters, and the peak
  resident memory of the process. Short runs are repeated, interleaved, and the median run reported:
  timings on a shared machine vary by tens of percent from one minute to the next.

With --parts ALGO, only the ceilings and the actor alone of that script with the flags after --, as JSON.

It prints the figures with the ratios training / env ceiling, training / compute ceiling and training /
the smaller of the two; on a CPU, where environments and compute share the cores, also training / the rate
they would reach taking turns (1 / (1/env + 1/compute)). It writes everything as JSON. A measurement, not
a test: it asserts nothing.
"""

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time

# The training subprocesses need the GPU's memory: this process takes only what it uses (JAX would otherwise
# reserve most of it up front). A setting of your own is kept.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import envpool  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import tyro  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "cleanba"))
from events import read_scalars  # noqa: E402

# Each configuration: the environment, each script's flags (the batch shape), training updates to run and
# log frequency, how many times each training run is repeated (interleaved; the median is reported), and the
# platforms it is meant for (the paper's Atari batch would take hours per update on a CPU). Actor and
# learner device ids are added per layout.
CONFIGS = {
    "cartpole": dict(  # the README's CartPole batches, with the default 2 actor threads
        ppo=["--env-id", "CartPole-v1", "--local-num-envs", "8", "--num-steps", "128"],
        impala=["--env-id", "CartPole-v1", "--local-num-envs", "16", "--num-steps", "20"],
        pqn=[*"--env-id CartPole-v1 --local-num-envs 8 --num-steps 64 --num-minibatches 4 --update-epochs 4".split()],
        updates=dict(ppo=100, impala=400, pqn=200),
        log_frequency=dict(ppo=10, impala=10, pqn=10),
        repeats=3,
        platforms=("cpu", "gpu"),
    ),
    "halfcheetah": dict(  # the README's MuJoCo batches (Gaussian policy, normalisation), one actor thread
        ppo=[
            *"--env-id HalfCheetah-v4 --local-num-envs 8 --num-actor-threads 1 --num-steps 256".split(),
            *"--num-minibatches 32 --update-epochs 10 --learning-rate 3e-4 --clip-coef 0.2 --ent-coef 0".split(),
        ],
        impala=[
            *"--env-id HalfCheetah-v4 --local-num-envs 16 --num-actor-threads 1 --num-steps 32".split(),
            *"--num-minibatches 16 --learning-rate 6e-4 --rmsprop-eps 1e-5 --max-grad-norm 0.5 --ent-coef 0".split(),
        ],
        updates=dict(ppo=30, impala=150),
        log_frequency=dict(ppo=2, impala=10),
        repeats=3,
        platforms=("cpu", "gpu"),
    ),
    "breakout": dict(  # the default ResNet and hyperparameters on a small batch
        ppo=["--env-id", "Breakout-v5", "--local-num-envs", "8", "--num-actor-threads", "1", "--num-steps", "32"],
        impala=["--env-id", "Breakout-v5", "--local-num-envs", "8", "--num-actor-threads", "1", "--num-steps", "20"],
        # PQN: 4 minibatches, not its default 32 (on a CPU the ResNet's minibatch loops are unrolled: see make_update).
        pqn=[
            *"--env-id Breakout-v5 --local-num-envs 8 --num-actor-threads 1 --num-steps 32 --num-minibatches 4".split()
        ],
        updates=dict(ppo=5, impala=12, pqn=8),
        log_frequency=dict(ppo=1, impala=1, pqn=1),
        repeats=1,
        platforms=("cpu", "gpu"),
    ),
    "atari": dict(  # the papers' defaults: 2 actor threads x 64 envs, 128 steps (PPO), 20 (IMPALA) or 32 (PQN)
        ppo=["--env-id", "Breakout-v5"],
        impala=["--env-id", "Breakout-v5"],
        pqn=["--env-id", "Breakout-v5"],
        updates=dict(ppo=12, impala=60, pqn=40),
        log_frequency=dict(ppo=1, impala=2, pqn=2),
        repeats=1,
        platforms=("gpu",),
    ),
}
WARMUP_UPDATES = 2  # compilation happens in the first update; with Cleanba, the second's data is ready early


def load_script(algo: str):
    path = os.path.join(REPO, "cleanba", f"cleanba_{algo}.py")
    spec = importlib.util.spec_from_file_location(f"cleanba_{algo}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed_calls(fn, min_seconds: float, min_calls: int) -> tuple[float, float]:
    """(seconds of the first call, median seconds of the calls after it); fn must wait for its result."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    times, deadline = [], time.perf_counter() + min_seconds
    while len(times) < min_calls or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return first, float(np.median(times))


def in_threads(work, num_threads: int) -> float:
    """Runs work(i) in num_threads threads released together; returns the wall-clock seconds."""
    barrier = threading.Barrier(num_threads + 1)
    errors = []

    def run(i):
        barrier.wait()
        try:
            work(i)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(num_threads)]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start


def env_ceiling(algo, args, num_threads: int, seconds: float) -> float:
    """Steps/s of EnvPool alone: the actor threads' pools, with the script's thread settings, stepped concurrently
    with random actions."""
    cpus = sorted(os.sched_getaffinity(0))
    threads = [algo.env_threads(args, i, cpus) for i in range(num_threads)]
    pools = [
        algo.make_env(args, args.local_num_envs, i * args.local_num_envs, **threads[i]) for i in range(num_threads)
    ]
    for pool in pools:
        pool.reset()
    rng, space = np.random.default_rng(0), pools[0].action_space
    shape = (256, args.local_num_envs, *space.shape)
    actions = (
        rng.integers(0, space.n, shape, np.int32) if hasattr(space, "n") else rng.uniform(space.low, space.high, shape)
    )
    steps = [0] * num_threads

    def work(i):
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            pools[i].step(actions[steps[i] % len(actions)])
            steps[i] += 1

    elapsed = in_threads(work, num_threads)
    return sum(steps) * args.local_num_envs / elapsed


def actor_alone(algo, args, cfg, networks, replica_params, rollouts: int):
    """The script's actor threads collecting `rollouts` rollouts each, fed the same parameters and nobody
    training. Returns (steps/s after the first rollout, the first rollouts)."""
    actors = algo.Actors(args, cfg, networks, 0, threading.Event())
    try:
        actors.publish(replica_params, 1)
        first = actors.collect()  # kept; the later ones are dropped (on a GPU they would fill its memory)
        start = time.perf_counter()
        actors.publish(replica_params, 2)
        for update in range(2, rollouts + 1):
            actors.collect()
            actors.publish(replica_params, update + 1)
        elapsed = time.perf_counter() - start
    finally:
        actors.stop.set()
        for thread, *_ in actors.threads:
            thread.join(timeout=30)
    if actors.failures:
        raise RuntimeError(actors.failures[0])
    steps = (rollouts - 1) * len(actors.threads) * args.local_num_envs * args.num_steps
    return steps / elapsed, first


def measure_parts(algo_name: str, flags: list[str], seconds: float) -> dict:
    """The env ceiling, the actor alone, and the isolated inference and learner costs of one configuration,
    on device 0 with one process."""
    algo = load_script(algo_name)
    # Synchronous, so that the actor-alone run takes parameters at every update.
    args = tyro.cli(algo.Args, args=[*flags, "--total-timesteps", str(10**9), "--no-concurrency"])
    algo.check_args(args)
    cfg = algo.derive_config(args)
    spec = envpool.make_spec(args.env_id, **algo.env_options(args))
    networks = algo.make_networks(args, spec)
    state, _ = algo.init_train_state(args, cfg, networks, spec.observation_space)
    state, _ = algo.resume(cfg, state, None, "")  # a fresh state, on the learner devices
    replica_params = state.params  # on the learner devices, as Actors.publish takes them
    num_threads = args.num_actor_threads

    env_sps = env_ceiling(algo, args, num_threads, seconds)
    actor_sps, first_rollouts = actor_alone(algo, args, cfg, networks, replica_params, rollouts=6)

    # Inference: the policy's forward pass and sampling on one thread's observations as a jitted call of its own, its
    # actions brought to the host: the actor's per-step work before its rollout became one program (the yardstick
    # the figures before and after that change share). PPO and PQN also evaluate the last observation once per rollout.
    params = jax.tree.map(lambda x: x[0], replica_params)
    first_step = jax.tree.map(lambda x: x[:1], first_rollouts[0].batch)  # a sequence of one step: (1, envs, ...)

    @jax.jit
    def act(params, obs, core_state, reset_after, key):
        output = algo.forward(networks, params, obs, core_state, reset_after)[0]
        if algo_name == "pqn":  # Q-values: epsilon-greedy's work is their arg max (its coin flips are negligible)
            return output[0].argmax(axis=-1)
        return jax.tree.map(lambda x: x[0], output).sample(key)

    inputs = first_step["obs"], first_step["core_states"][0], ~first_step["valid"], jax.random.key(0)
    policy_first, policy_call = timed_calls(lambda: np.asarray(act(params, *inputs)), seconds / 2, 20)
    calls_per_rollout = args.num_steps + (1 if algo_name in ("ppo", "pqn") else 0)
    inference_seconds = policy_call * calls_per_rollout * num_threads

    # The learner's update on the actors' first batch, each new state replacing the last as in the script.
    update_fn = algo.make_update(args, cfg, networks)
    batch = algo.collate(first_rollouts, cfg)
    states = [state]

    def update():
        new_state, losses, *_ = update_fn(states[0], batch, 1)
        jax.block_until_ready(losses)
        states[0] = new_state

    update_first, update_seconds = timed_calls(update, seconds, 3)
    batch_size = cfg.batch_size
    return dict(
        batch_size=batch_size,
        env_sps=env_sps,
        actor_alone_sps=actor_sps,
        inference_seconds=inference_seconds,
        update_seconds=update_seconds,
        compile_seconds=(update_first - update_seconds) + (policy_first - policy_call),
        compute_sps_shared=batch_size / (inference_seconds + update_seconds),
        compute_sps_split=batch_size / max(inference_seconds, update_seconds),
    )


def run_training(
    algo_name: str,
    flags: list[str],
    updates: int,
    log_frequency: int,
    batch_size: int,
    concurrency: bool,
    learner_device: int,
    num_devices: int,
    timeout: float,
) -> dict:
    """Trains with the script in a subprocess; steady-state figures from its TensorBoard events."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if jax.default_backend() == "cpu" and num_devices > 1:  # simulated devices, as in the tests
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={num_devices}".strip()
    command = [
        sys.executable,
        os.path.join(REPO, "cleanba", f"cleanba_{algo_name}.py"),
        *flags,
        "--total-timesteps",
        str(updates * batch_size),
        "--log-frequency",
        str(log_frequency),
        "--actor-device-ids",
        "0",
        "--learner-device-ids",
        str(learner_device),
        "--run-name",
        "benchmark",
        "--no-resume",
        "--checkpoint-interval",
        "0",
        "--concurrency" if concurrency else "--no-concurrency",
    ]
    with tempfile.TemporaryDirectory() as cwd:
        with open(os.path.join(cwd, "output.txt"), "w") as output:
            proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT)
            deadline, peak_rss_kb = time.time() + timeout, 0
            while proc.poll() is None:
                # The process's own high-water mark (getrusage's maxrss would include this process's memory:
                # Linux carries it across the fork and exec).
                peak_rss_kb = max(peak_rss_kb, memory_high_water_mark_kb(proc.pid))
                if time.time() > deadline:
                    proc.kill()
                time.sleep(0.2)
        if proc.returncode != 0:
            with open(os.path.join(cwd, "output.txt")) as f:
                raise RuntimeError(f"{' '.join(command)} exited {proc.returncode}:\n{f.read()[-3000:]}")
        scalars = read_scalars(os.path.join(cwd, "runs", "benchmark"), wall_time=True)
    points = [(update, wall) for _, update, wall in scalars["stats/update"] if update >= WARMUP_UPDATES]
    (first_update, first_wall), (last_update, last_wall) = points[0], points[-1]
    seconds_per_update = (last_wall - first_wall) / (last_update - first_update)

    def mean_wait(tag):
        """Waits logged in the measured span, as a fraction of an update's time. The first point is left out:
        with the Cleanba architecture the actors' wait logged at update u is for the learner's update u-2."""
        waits = [value for step, value, _ in scalars.get(tag, []) if step > (first_update + 1) * batch_size]
        return float(np.mean(waits)) / seconds_per_update if waits else 0.0

    return dict(
        sps=batch_size / seconds_per_update,
        measured_updates=last_update - first_update,
        learner_wait=mean_wait("stats/rollout_queue_get_time"),
        actor_wait=mean_wait("stats/params_queue_get_time"),
        peak_rss_mb=peak_rss_kb / 1024,
    )


def memory_high_water_mark_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):  # exited meanwhile
        return 0


def measure_training(
    config_name: str, algo: str, parts: dict, layouts: list, backend: str, num_devices: int, timeout: float
) -> list[dict]:
    """Both architectures in each layout; each run repeated as the configuration says, interleaved so that a
    slow spell of the machine hits both, and the median run kept."""
    config, results = CONFIGS[config_name], []
    for layout, learner_device in layouts:
        # With a device each, the slower of inference and update bounds the compute; sharing one (or the CPU's
        # cores) they add up.
        shared = backend == "cpu" or learner_device == 0
        compute_sps = parts["compute_sps_shared"] if shared else parts["compute_sps_split"]
        runs = {"sync": [], "cleanba": []}
        for _ in range(config["repeats"]):
            for architecture, training_runs in runs.items():
                training_runs.append(
                    run_training(
                        algo,
                        config[algo],
                        config["updates"][algo],
                        config["log_frequency"][algo],
                        parts["batch_size"],
                        architecture == "cleanba",
                        learner_device,
                        num_devices,
                        timeout,
                    )
                )
        for architecture, training_runs in runs.items():
            training = sorted(training_runs, key=lambda run: run["sps"])[len(training_runs) // 2]
            sps = training["sps"]
            # On a CPU, env stepping and compute share the cores: the rate if they took turns.
            turns_sps = 1 / (1 / parts["env_sps"] + 1 / compute_sps) if backend == "cpu" else None
            results.append(
                dict(
                    config=config_name,
                    algo=algo,
                    layout=layout,
                    architecture=architecture,
                    **parts,
                    **training,
                    sps_runs=[run["sps"] for run in training_runs],
                    compute_sps=compute_sps,
                    turns_sps=turns_sps,
                    train_over_env=sps / parts["env_sps"],
                    train_over_compute=sps / compute_sps,
                    train_over_ceiling=sps / min(parts["env_sps"], compute_sps),
                    train_over_turns=sps / turns_sps if turns_sps else None,
                )
            )
            print(f"  {layout} {architecture:7s} {describe(results[-1])}", flush=True)
    return results


def describe(r: dict) -> str:
    runs = f" (runs {min(r['sps_runs']):,.0f}-{max(r['sps_runs']):,.0f})" if len(r["sps_runs"]) > 1 else ""
    return (
        f"{r['sps']:,.1f} steps/s{runs} = {r['train_over_ceiling']:.0%} of the smaller ceiling | learner "
        f"waited {r['learner_wait']:.0%}, actors {r['actor_wait']:.0%} | peak RSS {r['peak_rss_mb']:,.0f} MB"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=list(CONFIGS),
        help="configurations to measure (default: those meant for this platform)",
    )
    parser.add_argument("--algos", nargs="+", choices=["ppo", "impala", "pqn"], default=["ppo", "impala", "pqn"])
    parser.add_argument("--seconds", type=float, default=3.0, help="minimum duration of each isolated timing")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds allowed to each training run")
    parser.add_argument("--out", default="throughput.json", help="where to write the figures as JSON")
    parser.add_argument("--parts", metavar="ALGO", choices=["ppo", "impala", "pqn"], help="only measure_parts")
    parser.add_argument("flags", nargs="*", help="after --, with --parts: the script's flags")
    args = parser.parse_args()
    if args.parts:  # one script's parts, in a process of its own (gpu_check.py's ceilings)
        with open(args.out, "w") as f:
            json.dump(measure_parts(args.parts, args.flags, args.seconds), f, indent=2)
        return

    backend = "gpu" if jax.default_backend() in ("gpu", "cuda", "rocm") else jax.default_backend()
    configs = args.configs or [name for name, config in CONFIGS.items() if backend in config["platforms"]]
    # A second device for the split layout: simulated on CPU (the training subprocess gets its own).
    num_devices = 2 if backend == "cpu" else len(jax.local_devices())
    layouts = [("a0-l0", 0)] + ([("a0-l1", 1)] if num_devices > 1 else [])
    machine = dict(
        platform=backend,
        device=jax.devices()[0].device_kind,
        cpus=os.cpu_count(),
        processor=platform.processor() or platform.machine(),
        jax=jax.__version__,
        date=time.strftime("%Y-%m-%d"),
    )
    print(f"machine: {machine}", flush=True)
    results = []
    for config_name in configs:
        for algo in [algo for algo in args.algos if algo in CONFIGS[config_name]]:  # PQN: no continuous actions
            print(f"\n[{config_name} / {algo}] {' '.join(CONFIGS[config_name][algo])}", flush=True)
            parts = measure_parts(algo, CONFIGS[config_name][algo], args.seconds)
            print(
                f"  env {parts['env_sps']:,.0f} steps/s | actor alone {parts['actor_alone_sps']:,.0f} steps/s | "
                f"inference {parts['inference_seconds'] * 1e3:,.1f} ms + update {parts['update_seconds'] * 1e3:,.1f} "
                f"ms per batch of {parts['batch_size']} | compile {parts['compile_seconds']:.1f} s",
                flush=True,
            )
            results += measure_training(config_name, algo, parts, layouts, backend, num_devices, args.timeout)
    with open(args.out, "w") as f:
        json.dump(dict(machine=machine, results=results), f, indent=2)

    print(
        f"\n{machine['device']} ({machine['platform']}), {machine['cpus']} CPUs, jax {machine['jax']}, "
        f"{machine['date']}; figures in {args.out}"
    )
    header = (
        "config",
        "algo",
        "layout",
        "arch",
        "train SPS (runs)",
        "env SPS",
        "compute SPS",
        "train/env",
        "train/compute",
        "train/min",
        "train/turns",
        "learner wait",
        "actor wait",
        "compile s",
        "peak RSS MB",
    )
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for r in results:
        runs = f" ({min(r['sps_runs']):,.0f}-{max(r['sps_runs']):,.0f})" if len(r["sps_runs"]) > 1 else ""
        turns = f"{r['train_over_turns']:.2f}" if r["train_over_turns"] else "-"
        print(
            f"| {r['config']} | {r['algo']} | {r['layout']} | {r['architecture']} | {r['sps']:,.0f}{runs} | "
            f"{r['env_sps']:,.0f} | {r['compute_sps']:,.0f} | {r['train_over_env']:.2f} | "
            f"{r['train_over_compute']:.2f} | {r['train_over_ceiling']:.2f} | {turns} | {r['learner_wait']:.0%} | "
            f"{r['actor_wait']:.0%} | {r['compile_seconds']:.1f} | {r['peak_rss_mb']:,.0f} |"
        )


if __name__ == "__main__":
    main()
