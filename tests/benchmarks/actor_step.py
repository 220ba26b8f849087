"""Where an actor step's time goes, on the device the script would use: one call, one JSON and one markdown table.

    .venv/bin/python tests/benchmarks/actor_step.py --out results/actor_step   # on a GPU machine
    .venv/bin/python tests/benchmarks/actor_step.py --out /tmp/actor_step --seconds 2 -- \\
        --local-num-envs 8 --num-steps 8

A script's defaults (IMPALA's by default, Breakout-v5, 2 actor threads x 64 envs), in this one process, with XLA's
deterministic GPU ops as the script sets them (--no-deterministic-gpu: off). Each part runs its actor threads
concurrently for --seconds, as the script's threads do, each with its own EnvPool (the script's thread share):

1. EnvPool alone: random actions, EnvPool's synchronous step;
2. the script's actor loop, one EnvPool per thread, timed phase by phase: the wait in EnvPool's recv, the `observe`
   call, the `act` call, the wait for the action on the host, EnvPool's send; then the same loop with `observe` and
   `act` fused into one jitted call per step;
3. both loops again while a learner thread runs the script's update on the actors' first batch without pause, as
   the Cleanba architecture does on a single device (the device then runs the learner's and the actors' programs);
   then with the learner's update dispatched one gradient step at a time, each waited for before the next, as a
   stand-in for an update split into per-minibatch programs (by_minibatch): how much of the actors' wait a shorter
   learner program would save;
4. the learner's update alone, as the script has it and by minibatch; one gradient step in parts (forward,
   gradient, with the optimiser, the network in bfloat16: gradient_step_parts); then the update with a part replaced
   (VARIANTS): the ResNet's max-pool by flax's nn.max_pool (XLA's select-and-scatter in its gradient, slow with
   deterministic GPU ops), or by one computed as a running maximum with its gradient written out; the categorical's
   log-probability taken by a mask instead of take_along_axis (a scatter in its gradient); the time of each, and
   whether it gives the same parameters bit for bit (on a CPU all do).

The first figures (docs/results/gpu/actor_step_impala_*_bfeecc9.md) came from this file's first version (commit
bfeecc9), when the script's ResNet had flax's max-pool and the variant was the strided one.
"""

import argparse
import dataclasses
import functools
import json
import os
import sys
import threading
import time

import envpool
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import tyro

WARMUP_STEPS = 3  # per thread, untimed: the first compiles the loop's calls
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import throughput  # noqa: E402


def pools_of(algo, args) -> list:
    cpus = sorted(os.sched_getaffinity(0))
    shares = [algo.env_threads(args, i, cpus) for i in range(args.num_actor_threads)]
    envs = args.local_num_envs
    return [algo.make_env(args, envs, i * envs, **share) for i, share in enumerate(shares)]


def policy_of(algo, args, networks, pools, platform: str):
    """The script's jitted `act` of its make_rollout (captured on its way to compile_rollout)."""
    captured = {}
    original = algo.compile_rollout

    def capture(args, act, bootstrap, pools, platform):
        captured["act"] = act
        return original(args, act, bootstrap, pools, platform)

    algo.compile_rollout = capture
    try:
        algo.make_rollout(args, networks, pools[:1], platform)
    finally:
        algo.compile_rollout = original
    return captured["act"]


def actor_loops(algo, args, networks, pools, params, device, seconds: float, fused: bool, learner=None) -> dict:
    """Each thread steps its pool as the script's loop does for --seconds; phase means in ms per step, steps/s."""
    act = policy_of(algo, args, networks, pools, device.platform)
    action_dtype = pools[0].spec.action_array_spec["action"].dtype
    observe = jax.jit(functools.partial(algo.observe, args))
    act_jit = jax.jit(act)

    @jax.jit
    def observe_and_act(params, env, outputs):
        env, record = algo.observe(args, env, env.handle, outputs)
        action, policy, core = act(params, env)
        return env._replace(core=core), {**record, **policy}, action

    phases = ["recv", "observe", "act", "action_wait", "send"]
    totals = [dict.fromkeys(phases, 0.0) for _ in pools]
    steps = [0] * len(pools)

    def receive(envs):
        obs, reward, terminated, truncated, info = envs.recv()
        info = {"reward": info["reward"]} if "reward" in info else {}
        return algo.to_float32((obs, reward, terminated, truncated, info))

    def work(i):
        envs = pools[i]
        ids = np.arange(i * args.local_num_envs, (i + 1) * args.local_num_envs)
        state = jax.device_put(algo.first_state(envs, np.zeros(1, np.uint8), ids, 0, networks), device)
        action, _, core = act_jit(params, state)
        state = state._replace(core=core)
        envs.send(np.asarray(action, action_dtype))
        deadline = None
        t = dict.fromkeys(phases, 0.0)  # the warm-up steps' (compilation), then the timed steps'
        while deadline is None or time.perf_counter() < deadline:
            if deadline is None and steps[i] == WARMUP_STEPS:
                deadline = time.perf_counter() + seconds
                t = totals[i]
                steps[i] = 0
            start = time.perf_counter()
            outputs = receive(envs)
            received = time.perf_counter()
            if fused:
                state, _, action = observe_and_act(params, state, outputs)
                observed = acted = time.perf_counter()
            else:
                state, _ = observe(state, state.handle, outputs)
                observed = time.perf_counter()
                action, _, core = act_jit(params, state)
                state = state._replace(core=core)
                acted = time.perf_counter()
            on_host = np.asarray(action, action_dtype)
            waited = time.perf_counter()
            envs.send(on_host)
            sent = time.perf_counter()
            for phase, a, b in zip(
                phases,
                [start, received, observed, acted, waited],
                [received, observed, acted, waited, sent],
                strict=True,
            ):
                t[phase] += b - a
            steps[i] += 1
        envs.recv()  # the step in flight

    updates = []
    stop = threading.Event()
    learner_thread = None
    if learner is not None:

        def learn():
            while not stop.is_set():
                start = time.perf_counter()
                learner()
                updates.append(time.perf_counter() - start)

        learner_thread = threading.Thread(target=learn)
        learner_thread.start()
        time.sleep(1.0)  # its update already compiled (timed alone before): it runs at full pace from here
        updates.clear()
    try:
        throughput.in_threads(work, len(pools))
    finally:
        stop.set()
        if learner_thread:
            learner_thread.join()
    total_steps = sum(steps)
    per_step = {phase: 1000 * sum(t[phase] for t in totals) / total_steps for phase in phases}
    # Each thread timed --seconds of steps after its warm-up; their windows overlap but for the warm-ups' spread.
    result = dict(sps=total_steps * args.local_num_envs / seconds, ms_per_step=per_step, steps=total_steps)
    if learner is not None:
        result.update(updates=len(updates), update_s=float(np.median(updates)) if updates else None)
    return result


def flax_max_pool(x):
    """The max-pool the scripts' ResNet had before 2026-11-26: flax's, whose gradient is XLA's select-and-scatter."""
    return nn.max_pool(x, window_shape=(3, 3), strides=(2, 2), padding="SAME")


@jax.custom_vjp
def running_max_pool(x):
    """The scripts' max-pool, the same values and gradient bits (on a CPU), computed otherwise: the maxima as a running
    comparison of the 9 windows (not a stack of them and its argmax), the gradient written out (not padded full-size
    arrays, one per window offset, added up). A reverse-mode derivative only (custom_vjp), as the update needs."""
    return running_max_pool_forward(x)[0]


def running_max_pool_forward(x):
    """The maxima, and which of a window's 9 offsets (3 x row + column) holds each one first (a NaN, as argmax's)."""
    padded = jnp.pad(x, [(0, 0), (x.shape[1] % 2, 1), (x.shape[2] % 2, 1), (0, 0)], constant_values=-jnp.inf)
    rows, columns = padded.shape[1] - 2, padded.shape[2] - 2
    windows = [padded[:, i : rows + i : 2, j : columns + j : 2] for i in range(3) for j in range(3)]
    maxima = windows[0]
    first = jnp.zeros(maxima.shape, jnp.int8)
    for offset, window in enumerate(windows):
        larger = (window > maxima) | (jnp.isnan(window) & ~jnp.isnan(maxima))  # strictly: a tie keeps the earlier
        maxima = jnp.where(larger, window, maxima)
        first = jnp.where(larger, jnp.int8(offset), first)
    return maxima, (first, x.shape)


def running_max_pool_backward(residuals, grad):
    """The padded input as 2 x 2 interleaved grids (row parity, column parity) one larger than the windows' grid:
    offset (i, j) of window (r, c) is on grid (i % 2, j % 2) at (r + i // 2, c + j // 2). Each grid adds its offsets
    in the order automatic differentiation of the scripts' 9 slices does (the last first): the same bits."""
    first, shape = residuals

    def on_grid(offset):
        i, j = divmod(offset, 3)
        chosen = jnp.where(first == offset, grad, 0.0)
        return jnp.pad(chosen, [(0, 0), (i // 2, 1 - i // 2), (j // 2, 1 - j // 2), (0, 0)])

    grids = [
        [on_grid(8) + on_grid(6) + on_grid(2) + on_grid(0), on_grid(7) + on_grid(1)],
        [on_grid(5) + on_grid(3), on_grid(4)],
    ]
    batch, rows, columns, channels = grad.shape
    interleaved = jnp.stack([jnp.stack(row_parity, axis=3) for row_parity in grids], axis=2)
    padded = interleaved.reshape(batch, 2 * rows + 2, 2 * columns + 2, channels)
    top, left = shape[1] % 2, shape[2] % 2  # the "SAME" padding before the input
    return (padded[:, top : top + shape[1], left : left + shape[2]],)


running_max_pool.defvjp(running_max_pool_forward, running_max_pool_backward)


def with_max_pool(replacement):  # a patch: returns what undoes it
    def patch(algo):
        original = algo.max_pool
        algo.max_pool = replacement
        return lambda: setattr(algo, "max_pool", original)

    return patch


def one_hot_log_prob_and_entropy(self, action):
    """The categorical's log-probability picked by a mask, not take_along_axis (whose gradient is a scatter)."""
    log_probs = jax.nn.log_softmax(self.logits)
    chosen = action[..., None] == jnp.arange(log_probs.shape[-1])
    return jnp.sum(jnp.where(chosen, log_probs, 0.0), axis=-1), -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)


def with_one_hot_log_prob(algo):  # returns what undoes it (PQN has no categorical: nothing to change)
    if not hasattr(algo, "Categorical"):
        return lambda: None
    original = algo.Categorical.log_prob_and_entropy
    algo.Categorical.log_prob_and_entropy = one_hot_log_prob_and_entropy
    return lambda: setattr(algo.Categorical, "log_prob_and_entropy", original)


# The learner's update with a part replaced: what each costs with deterministic GPU ops, and whether it gives the
# same bits (on a CPU all do).
VARIANTS = [
    ("flax max-pool", with_max_pool(flax_max_pool)),
    ("running max-pool, gradient written out", with_max_pool(running_max_pool)),
    ("one-hot log-probability", with_one_hot_log_prob),
]


GRADIENT_STEP_PARTS = ["forward", "gradient", "gradient_and_optimiser", "gradient_bfloat16_network"]

LOOPS = [  # name, observe and act fused, with which learner
    ("two calls", False, None),
    ("fused", True, None),
    ("two calls + learner", False, "update"),
    ("fused + learner", True, "update"),
    ("two calls + learner by minibatch", False, "by minibatch"),
]


class Learner:
    """A learner thread's work, as a callable: `calls` updates of the script's update built for `args` (or a variant
    put in `update_fn`), one after the other and each waited for, on a batch of the script's own actors."""

    def __init__(self, algo, args, networks, state, calls: int = 1):
        cfg = algo.derive_config(args)
        _, first = throughput.actor_alone(algo, args, cfg, networks, state.params, rollouts=2)
        self.batch = algo.collate(first, cfg)
        self.update_fn = algo.make_update(args, cfg, networks)
        self.state = state
        self.calls = calls

    def __call__(self):
        for _ in range(self.calls):
            new_state, losses, *_ = self.update_fn(self.state, self.batch, 1)
            jax.block_until_ready(losses)
            self.state = new_state


def minibatches_split_steps(args) -> bool:  # PPO's and PQN's minibatches split the steps (epochs), IMPALA's the envs
    return hasattr(args, "update_epochs")


def by_minibatch(algo, args, networks, state) -> Learner:
    """An update as one program per gradient step (M minibatches x epochs of them), a timing stand-in for the
    script's update split into per-minibatch programs (not its arithmetic): the update built for one minibatch's
    shape and one epoch, called once per gradient step. IMPALA's minibatches split the envs; PPO's and PQN's the
    steps (each piece then also computes its own, shorter, advantages or targets)."""
    minibatches = args.num_minibatches
    if minibatches_split_steps(args):
        small = dataclasses.replace(args, num_steps=args.num_steps // minibatches, update_epochs=1)
        return Learner(
            algo, dataclasses.replace(small, num_minibatches=1), networks, state, minibatches * args.update_epochs
        )
    if args.local_num_envs % minibatches:
        raise SystemExit(f"--local-num-envs {args.local_num_envs}: a multiple of --num-minibatches {minibatches}")
    small = dataclasses.replace(args, local_num_envs=args.local_num_envs // minibatches, num_minibatches=1)
    return Learner(algo, small, networks, state, minibatches)


def layers_in_bfloat16(call, args, kwargs, context):  # a flax interceptor: a Conv's or Dense's inputs in bfloat16
    if isinstance(context.module, (nn.Conv, nn.Dense)) and context.method_name == "__call__":
        args = [lower_precision(x) for x in args]
        kwargs = {name: lower_precision(x) for name, x in kwargs.items()}
    return call(*args, **kwargs)


def lower_precision(x):  # a float array in bfloat16; anything else as it is
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating):
        return x.astype(jnp.bfloat16)
    return x


def gradient_step_parts(algo, args, networks, state, batch, seconds: float) -> dict:
    """Where a gradient step's time goes, on one minibatch of the script's shape (from the first learner device's part
    of the batch): the networks' forward pass; the gradient of a loss through all their outputs (forward and
    backward: the script's losses add little to it); that and the optimiser's step; the gradient again with the network
    computing in bfloat16, its parameters and each layer's input cast (what a lower precision would buy: a speed flag's
    worth, not a default's). Median seconds per call."""
    local = jax.tree.map(lambda x: x[0], batch)  # (T or T + 1, envs, ...)
    envs = local["valid"].shape[1]
    steps = args.num_steps
    if minibatches_split_steps(args):
        steps //= args.num_minibatches
    else:
        envs //= args.num_minibatches
    obs = jax.tree.map(lambda x: x[:steps, :envs], local["obs"])
    core = local["core_states"][0, :envs]
    reset_after = jnp.zeros((steps, envs), bool)
    replica = jax.tree.map(lambda x: x.addressable_data(0)[0], state)

    def forward(params):
        return algo.forward(networks, params, obs, core, reset_after)

    def loss(params):
        outputs = jax.tree.leaves(forward(params))
        return sum(jnp.sum(jnp.square(x)) for x in outputs if jnp.issubdtype(x.dtype, jnp.floating))

    def step(train_state):
        return train_state.apply_gradients(grads=jax.grad(loss)(train_state.params))

    def bfloat16_network_loss(params):  # the parameters cast, and each layer's input: the network computes in bfloat16
        low = jax.tree.map(lower_precision, params)
        with nn.intercept_methods(layers_in_bfloat16):
            return loss(low)

    parts = dict(forward=forward, gradient=jax.grad(loss), gradient_bfloat16_network=jax.grad(bfloat16_network_loss))
    calls = {name: functools.partial(jax.jit(f), replica.params) for name, f in parts.items()}
    calls["gradient_and_optimiser"] = functools.partial(jax.jit(step), replica)
    report = dict(frames=steps * envs)
    for name, call in calls.items():

        def waited(call=call):
            jax.block_until_ready(call())

        report[name] = throughput.timed_calls(waited, seconds, 5)[1]
    return report


def markdown(report: dict) -> str:
    ops = "deterministic" if report["deterministic_gpu"] else "non-deterministic"
    lines = [
        f"{report['device']}, {report['cores']} CPU cores, JAX {report['jax']}, {report['date']}; {report['algo']} on "
        f"{report['env_id']}, {report['threads']} actor threads x {report['envs_per_thread']} envs, {ops} GPU ops; "
        f"XLA_FLAGS `{report['xla_flags']}`",
        "",
        f"EnvPool alone: **{report['env_alone_sps']:,.0f} steps/s**",
        "",
        "| loop | steps/s | / alone | ms: recv | observe | act | action wait | send | learner s/update |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, *_ in LOOPS:
        if name in report:
            r = report[name]
            ms = " | ".join(f"{r['ms_per_step'][p]:.2f}" for p in ["recv", "observe", "act", "action_wait", "send"])
            learner = f"{r['update_s']:.3f} ({r['updates']})" if r.get("update_s") else "-"
            lines.append(f"| {name} | {r['sps']:,.0f} | {r['sps'] / report['env_alone_sps']:.2f} | {ms} | {learner} |")
    for name in ["update", "update by minibatch", *[f"update, {variant}" for variant, _ in VARIANTS]]:
        if name in report:
            r = report[name]
            same = ""
            if "params_bitwise_equal" in r:
                same = f"; parameters bitwise equal: {r['params_bitwise_equal']} (max diff {r['max_abs_diff']:.3g})"
            first = "after one untimed call"
            if name in ("update", "update by minibatch"):
                first = "compiling"
            lines.append(f"\n{name}: {r['median_s']:.4f} s per update (the first, {first}: {r['first_s']:.1f} s){same}")
    if "gradient step" in report:
        r = report["gradient step"]
        ms = ", ".join(f"{name.replace('_', ' ')} {1000 * r[name]:.1f}" for name in GRADIENT_STEP_PARTS)
        lines.append(f"\na gradient step on a minibatch of {r['frames']:,} frames, ms: {ms}")
    return "\n".join(lines) + "\n"


def add_script_options(parser: argparse.ArgumentParser, default_algo: str):
    parser.add_argument("--algo", default=default_algo, choices=["ppo", "impala", "pqn"])
    parser.add_argument("--env-id", default="Breakout-v5")
    parser.add_argument("--no-deterministic-gpu", action="store_true")
    parser.add_argument("flags", nargs="*", help="after --: the script's flags")


def script_and_state(opts):
    """The script (--algo), its Args (its defaults, --env-id, the flags after --; synchronous), config, networks and
    first train state; XLA's deterministic GPU ops as the script sets them (off with --no-deterministic-gpu)."""
    xla_flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_deterministic_ops" not in xla_flags:  # as the scripts do: a setting of the user's stays
        deterministic = str(not opts.no_deterministic_gpu).lower()
        os.environ["XLA_FLAGS"] = f"{xla_flags} --xla_gpu_deterministic_ops={deterministic}".strip()
    algo = throughput.load_script(opts.algo)
    args = tyro.cli(algo.Args, args=["--env-id", opts.env_id, *opts.flags, "--total-timesteps", str(10**9)])
    args.concurrency = False
    try:  # the script's own checks, which also settle its automatic settings (observation normalisation)
        algo.check_args(args)
    except algo.ConfigError as refused:
        raise SystemExit(f"{opts.algo}: {refused}") from None
    cfg = algo.derive_config(args)
    spec = envpool.make_spec(args.env_id, **algo.env_options(args))
    networks = algo.make_networks(args, spec)
    state, _ = algo.init_train_state(args, cfg, networks, spec.observation_space)
    state, _ = algo.resume(cfg, state, None, "")
    return algo, args, cfg, networks, state


def deterministic_gpu() -> bool:  # what XLA was told (the flag, or a setting of the user's in XLA_FLAGS)
    return "xla_gpu_deterministic_ops=true" in os.environ.get("XLA_FLAGS", "")


def what_ran(device, opts, args) -> dict:  # a report's first fields: the machine, the date, the script and its ops
    return dict(
        device=device.device_kind,
        cores=len(os.sched_getaffinity(0)),
        jax=jax.__version__,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        algo=opts.algo,
        env_id=args.env_id,
        deterministic_gpu=deterministic_gpu(),
        xla_flags=os.environ.get("XLA_FLAGS", ""),  # as the script set them, with any of the user's
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="a directory for actor_step_<algo>_<det|nondet>.json and .md")
    parser.add_argument("--seconds", type=float, default=8.0, help="per part")
    add_script_options(parser, "impala")
    opts = parser.parse_args()
    algo, args, cfg, networks, state = script_and_state(opts)
    device = cfg.actor_devices[0]
    params = jax.device_put(jax.tree.map(lambda x: x.addressable_data(0)[0], state.params), device)
    report = dict(
        **what_ran(device, opts, args),
        threads=args.num_actor_threads,
        envs_per_thread=args.local_num_envs,
    )
    os.makedirs(opts.out, exist_ok=True)
    path = os.path.join(opts.out, f"actor_step_{opts.algo}_{'det' if report['deterministic_gpu'] else 'nondet'}.json")

    def save():
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
        with open(path.replace(".json", ".md"), "w") as f:
            f.write(markdown(report))

    report["env_alone_sps"] = throughput.env_ceiling(algo, args, args.num_actor_threads, opts.seconds)
    save()
    learner = Learner(algo, args, networks, state)
    first_s, update_s = throughput.timed_calls(learner, opts.seconds, 3)
    report["update"] = dict(first_s=first_s, median_s=update_s, steps=cfg.batch_size)
    save()
    report["gradient step"] = gradient_step_parts(algo, args, networks, state, learner.batch, opts.seconds)
    save()
    learner_by_minibatch = by_minibatch(algo, args, networks, state)
    first_s, update_s = throughput.timed_calls(learner_by_minibatch, opts.seconds, 3)
    report["update by minibatch"] = dict(first_s=first_s, median_s=update_s, steps=cfg.batch_size)
    save()
    learners = {None: None, "update": learner, "by minibatch": learner_by_minibatch}
    pools = pools_of(algo, args)
    for name, fused, with_learner in LOOPS:
        report[name] = actor_loops(
            algo, args, networks, pools, params, device, opts.seconds, fused, learners[with_learner]
        )
        save()
    # Each variant: the same update, its time, and whether its parameters are the same bits as the script's.
    script_update = learner.update_fn
    reference, *_ = script_update(state, learner.batch, 1)
    for name, patch in VARIANTS:
        restore = patch(algo)
        try:
            learner.update_fn = algo.make_update(args, cfg, networks)
            variant, *_ = learner.update_fn(state, learner.batch, 1)
            learner.state = state
            first_s, update_s = throughput.timed_calls(learner, opts.seconds, 3)
        finally:
            restore()
            learner.update_fn = script_update
        pairs = list(zip(jax.tree.leaves(reference.params), jax.tree.leaves(variant.params), strict=True))
        report[f"update, {name}"] = dict(
            first_s=first_s,
            median_s=update_s,
            params_bitwise_equal=all(np.array_equal(a, b) for a, b in pairs),
            max_abs_diff=max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in pairs),
        )
        save()
    print(markdown(report))


if __name__ == "__main__":
    main()
