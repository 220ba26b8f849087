"""Cleanba IMPALA: single-file, distributed IMPALA (V-trace) with JAX + EnvPool.

The Cleanba architecture (Huang et al., 2023, "Cleanba: A Reproducible and Efficient Distributed
Reinforcement Learning Platform"): actor threads and the learner are joined by queues of size 1.

    iteration:  1        2        3        4
    actor:      p1->d1   p1->d2   p2->d3   p3->d4
    learner:             d1->p2   d2->p3   d3->p4

The actor skips fetching parameters at iteration 2, so from then on the learner at version v trains on
data of version v-1 while the actor already collects the next batch; V-trace (Espeholt et al., 2018)
corrects for that lag with the behaviour policy's log-probabilities recorded by the actor. The Cleanba
architecture is the default here; `--no-concurrency` is the synchronous variant (lag 0).

Reproducibility: every environment has a global index g over (process, actor device, actor thread, env);
it is seeded from (seed, g), actions are sampled with a key derived from (g, step), minibatches are a
function of (seed, update, g), and statistics are taken over the global minibatch. So the same
seed gives the same batches on 1 device or many, up to float reassociation in the learner's sums.

Usage: python cleanba/cleanba_impala.py --env-id CartPole-v1 --total-timesteps 500000
       python cleanba/cleanba_impala.py --actor-device-ids 0 --learner-device-ids 1 2 3 --local-num-envs 60
"""

import dataclasses
import functools
import hashlib
import json
import os
import queue
import signal
import sys
import threading
import time
import traceback
import warnings
from contextlib import contextmanager
from typing import NamedTuple

import envpool
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tyro
from flax.training.train_state import TrainState
from jax.experimental import multihost_utils
from tensorboardX import SummaryWriter

with warnings.catch_warnings():  # rlax imports tfp-nightly's JAX backend, which touches a deprecated jax.core name
    warnings.simplefilter("ignore", DeprecationWarning)
    import rlax

# EnvPool's classic-control specs declare float64 bounds; gymnasium warns while building the space,
# once per environment, about something that does not affect training.
warnings.filterwarnings("ignore", message=r".*Box (low|high)'s precision lowered", module="gymnasium")


@dataclasses.dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (part of the run name)"""
    seed: int = 1
    """seed of the experiment: environments, action sampling, initialisation and minibatches"""
    track: bool = False
    """mirror the TensorBoard logs to Weights & Biases (honours WANDB_MODE=offline)"""
    wandb_project_name: str = "cleanba"
    """the Weights & Biases project"""
    wandb_entity: str | None = None
    """the Weights & Biases entity (team); None uses your default"""
    save_model: bool = False
    """save the final parameters and the config to the run directory, then evaluate the saved model"""
    eval_episodes: int = 10
    """episodes played by the saved model when --save-model is set"""
    log_frequency: int = 10
    """log to TensorBoard and the console every this many updates"""
    run_name: str | None = None
    """directory under runs/; by default env id, exp name, seed and a hash of the algorithm's configuration,
    so that running the same command again (or a requeued SLURM job) finds the run and resumes it"""
    resume: bool = True
    """resume from runs/<run_name>/checkpoint.msgpack when it exists; --no-resume starts over"""
    checkpoint_interval: int = 100
    """write a checkpoint every this many updates (0: none by count; --checkpoint-minutes still applies)"""
    checkpoint_minutes: float = 15.0
    """also write a checkpoint when this many minutes have passed since the last one"""

    # Algorithm-specific arguments: the defaults are the paper's Atari settings
    env_id: str = "Breakout-v5"
    """an EnvPool environment id: Atari `*-v5` ids use the ResNet, vector observations (CartPole-v1) an MLP"""
    total_timesteps: int = 50_000_000
    """total environment steps over all environments (agent steps, not Atari frames)"""
    learning_rate: float = 6e-4
    """RMSProp's learning rate"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0 over the run"""
    local_num_envs: int = 64
    """environments per actor thread"""
    num_steps: int = 20
    """steps per environment in each rollout (the V-trace unroll length)"""
    gamma: float = 0.99
    """discount factor"""
    vtrace_lambda: float = 1.0
    """lambda of V-trace's truncated importance-weighted returns"""
    clip_rho_threshold: float = 1.0
    """V-trace's clipping of the importance ratios in the value targets (rho bar)"""
    clip_pg_rho_threshold: float = 1.0
    """V-trace's clipping of the importance ratios in the policy-gradient advantages"""
    num_minibatches: int = 4
    """minibatches per batch, split along the environment axis; one gradient step each"""
    ent_coef: float = 0.01
    """entropy bonus coefficient"""
    vf_coef: float = 0.5
    """value loss coefficient"""
    max_grad_norm: float = 40.0
    """global gradient-norm clipping threshold"""
    rmsprop_eps: float = 0.01
    """RMSProp's epsilon (inside the square root, as in the IMPALA paper's TensorFlow RMSProp)"""
    rmsprop_decay: float = 0.99
    """RMSProp's decay of the squared-gradient average"""
    concurrency: bool = True
    """Cleanba architecture (actor one policy version behind, overlapping the learner) instead of synchronous"""

    # Hardware layout: it never changes the algorithm, only where it runs
    actor_device_ids: list[int] = dataclasses.field(default_factory=lambda: [0])
    """local device ids that run the actors' inference"""
    learner_device_ids: list[int] = dataclasses.field(default_factory=lambda: [0])
    """local device ids of the data-parallel learner"""
    num_actor_threads: int = 2
    """actor threads per actor device, each with its own environment pool"""
    distributed: bool = False
    """run as one of several processes with jax.distributed (SLURM's environment is read automatically)"""
    coordinator_address: str | None = None
    """with --distributed outside SLURM: host:port of process 0 (or set JAX_COORDINATOR_ADDRESS)"""
    num_processes: int | None = None
    """with --distributed outside SLURM: the number of processes"""
    process_id: int | None = None
    """with --distributed outside SLURM: this process's rank"""
    heartbeat_timeout: int = 100
    """with --distributed: seconds after which the others give up on a process that died (they exit non-zero)"""


class Config(NamedTuple):
    """Values derived from Args and the hardware, computed and checked once, before anything starts."""

    world_size: int  # processes
    rank: int
    num_envs_per_process: int
    num_envs: int  # over all processes
    batch_size: int  # env steps per update, over all processes
    num_updates: int
    env_offset: int  # global index of this process's first environment
    actor_devices: list
    learner_devices: list  # global, over all processes, in rank order
    local_learner_devices: list


class ConfigError(ValueError):
    """Bad input: reported as one line and exit status 2, before anything is created."""


def check_args(args: Args):
    """Checks that need no devices: run before jax.distributed starts."""
    positive = ["total_timesteps", "local_num_envs", "num_steps", "num_minibatches", "num_actor_threads", "log_frequency", "eval_episodes", "heartbeat_timeout"]
    for name in positive:
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ["actor_device_ids", "learner_device_ids"]:
        ids = getattr(args, name)
        if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
            raise ConfigError(f"--{name.replace('_', '-')} must list distinct non-negative ids, got {ids}")
    if args.checkpoint_interval < 0 or not args.checkpoint_minutes > 0:
        raise ConfigError("--checkpoint-interval must be >= 0 and --checkpoint-minutes positive")
    if args.run_name is not None and (not args.run_name or "/" in args.run_name or args.run_name.startswith(".")):
        raise ConfigError(f"--run-name {args.run_name!r} must be a plain directory name")
    if not args.learning_rate > 0:
        raise ConfigError(f"--learning-rate must be positive, got {args.learning_rate}")
    if not (0 <= args.gamma <= 1 and 0 <= args.vtrace_lambda <= 1):
        raise ConfigError("--gamma and --vtrace-lambda must lie in [0, 1]")
    if args.env_id not in envpool.list_all_envs():
        raise ConfigError(f"--env-id {args.env_id!r} is not an EnvPool environment "
                          "(see envpool.list_all_envs())")
    if not hasattr(envpool.make_spec(args.env_id).action_space, "n"):
        raise ConfigError(f"--env-id {args.env_id!r} has a continuous action space; IMPALA here needs discrete actions")


def derive_config(args: Args) -> Config:
    """Checks that need the devices (after jax.distributed), and the derived sizes."""
    local_devices = jax.local_devices()
    for name in ["actor_device_ids", "learner_device_ids"]:
        missing = [i for i in getattr(args, name) if i >= len(local_devices)]
        if missing:
            raise ConfigError(f"--{name.replace('_', '-')} {missing} do not exist: this process has "
                              f"{len(local_devices)} devices (ids 0..{len(local_devices) - 1})")
    world_size, rank = jax.process_count(), jax.process_index()
    num_envs_per_process = args.local_num_envs * args.num_actor_threads * len(args.actor_device_ids)
    if num_envs_per_process % len(args.learner_device_ids):
        raise ConfigError(
            f"--local-num-envs {args.local_num_envs} x --num-actor-threads {args.num_actor_threads} x "
            f"{len(args.actor_device_ids)} actor devices = {num_envs_per_process} environments cannot be "
            f"split evenly over {len(args.learner_device_ids)} learner devices")
    envs_per_learner = num_envs_per_process // len(args.learner_device_ids)
    if envs_per_learner % args.num_minibatches:
        raise ConfigError(f"--num-minibatches {args.num_minibatches} must divide the {envs_per_learner} environments "
                          "of each learner device: minibatches split the environment axis")
    num_envs = num_envs_per_process * world_size
    batch_size = num_envs * args.num_steps
    if args.total_timesteps < batch_size:
        raise ConfigError(f"--total-timesteps {args.total_timesteps} is less than one update "
                          f"({num_envs} envs x {args.num_steps} steps = {batch_size})")
    learner_devices = [jax.local_devices(process_index=p)[i] for p in range(world_size)
                       for i in args.learner_device_ids]
    return Config(
        world_size=world_size,
        rank=rank,
        num_envs_per_process=num_envs_per_process,
        num_envs=num_envs,
        batch_size=batch_size,
        num_updates=args.total_timesteps // batch_size,
        env_offset=rank * num_envs_per_process,
        actor_devices=[local_devices[i] for i in args.actor_device_ids],
        learner_devices=learner_devices,
        local_learner_devices=[local_devices[i] for i in args.learner_device_ids],
    )


def env_seed(seed: int, env_index: int) -> int:
    """EnvPool seeds env i of a pool with (pool seed) + i, so a pool seeded with env_seed(seed, global index
    of its first env) gives env g the same seed whatever pool or process holds it. Each --seed gets its own
    block of 2^20 env seeds (EnvPool takes 31-bit seeds), so runs with seeds 1, 2, 3 share no environment."""
    return (seed * 2**20 + env_index) % 2**31


def make_env(env_id: str, num_envs: int, first_env_index: int, seed: int):
    if env_id.endswith("-v5"):  # Atari: the evaluation protocol of Machado et al. (2018)
        return envpool.make(
            env_id,
            env_type="gym",
            num_envs=num_envs,
            seed=env_seed(seed, first_env_index),
            episodic_life=False,  # no life-loss signal
            repeat_action_probability=0.25,  # sticky actions
            full_action_space=True,
            noop_max=1,  # no no-op starts: sticky actions are the source of stochasticity
            max_episode_steps=108_000 // 4,  # 108,000 frames at frame skip 4
            reward_clip=True,  # the unclipped reward is in info["reward"] for logging
        )
    return envpool.make(env_id, env_type="gym", num_envs=num_envs, seed=env_seed(seed, first_env_index))


class ResidualBlock(nn.Module):
    channels: int

    @nn.compact
    def __call__(self, x):
        inputs = x
        x = nn.relu(x)
        x = nn.Conv(self.channels, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.Conv(self.channels, kernel_size=(3, 3))(x)
        return x + inputs


class ResNet(nn.Module):
    """The IMPALA network (Espeholt et al., 2018): three conv stacks, then a 256-unit layer."""

    channels: tuple = (16, 32, 32)
    hidden: int = 256

    @nn.compact
    def __call__(self, x):
        x = jnp.transpose(x, (0, 2, 3, 1)).astype(jnp.float32) / 255.0  # EnvPool frames are NCHW uint8
        for channels in self.channels:
            x = nn.Conv(channels, kernel_size=(3, 3))(x)
            x = nn.max_pool(x, window_shape=(3, 3), strides=(2, 2), padding="SAME")
            x = ResidualBlock(channels)(x)
            x = ResidualBlock(channels)(x)
        x = nn.relu(x.reshape((x.shape[0], -1)))
        x = nn.relu(nn.Dense(self.hidden)(x))
        return x, x  # shared by the policy and the value heads


class MLP(nn.Module):
    """Two 64-unit tanh towers, one for the policy and one for the value, as in CleanRL's classic-control
    PPO: with returns in the hundreds, a shared torso's gradient is swamped by the value loss."""

    hidden: int = 64

    @nn.compact
    def __call__(self, x):
        def tower(x):
            for _ in range(2):
                x = nn.tanh(nn.Dense(self.hidden, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(x))
            return x

        x = x.astype(jnp.float32)
        return tower(x), tower(x)


class Actor(nn.Module):
    num_actions: int

    @nn.compact
    def __call__(self, hidden):
        return nn.Dense(self.num_actions, kernel_init=nn.initializers.orthogonal(0.01))(hidden)


class Critic(nn.Module):
    @nn.compact
    def __call__(self, hidden):
        return nn.Dense(1, kernel_init=nn.initializers.orthogonal(1.0))(hidden).squeeze(-1)


class Networks(NamedTuple):
    torso: nn.Module
    actor: nn.Module
    critic: nn.Module


def make_networks(observation_shape, num_actions) -> Networks:
    """The torso follows the observation: frames get the ResNet, vectors the MLP."""
    torso = ResNet() if len(observation_shape) == 3 else MLP()
    return Networks(torso, Actor(num_actions), Critic())


def forward(networks: Networks, params, obs):
    policy_hidden, value_hidden = networks.torso.apply(params["torso"], obs)
    return networks.actor.apply(params["actor"], policy_hidden), networks.critic.apply(params["critic"], value_hidden)


@contextmanager
def timer(timings: dict, name: str):
    """Adds the wall-clock time of the block to timings[name]."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


class StopRequested(Exception):
    """Raised in a thread blocked on a queue once another thread has asked everyone to stop."""


def queue_put(q: queue.Queue, item, stop: threading.Event):
    while not stop.is_set():
        try:
            return q.put(item, timeout=1.0)
        except queue.Full:
            pass
    raise StopRequested


def queue_get(q: queue.Queue, stop: threading.Event):
    while not stop.is_set():
        try:
            return q.get(timeout=1.0)
        except queue.Empty:
            pass
    raise StopRequested


def expected_data_version(update: int, first_update: int, concurrency: bool) -> int:
    """The version contract: the policy version that must have produced the batch of this update. The
    learner holds version `update` before training on it; with concurrency the actor reuses the first
    parameters for a second batch, so from then on it is one version behind."""
    return update - 1 if concurrency and update > first_update else update


def fault_injected(where: str, update: int) -> bool:
    """Test hook for tests/test_failures.py: CLEANBA_FAULT=<where>@<update>, where is `actor` (the first
    actor thread raises), `learner` (the learner raises), `nan` (the batch's rewards become NaN) or
    `checkpoint` (the process dies between writing that update's checkpoint and renaming it into place).
    Unset, it does nothing. When it fires it says so on stderr, for the tests to time what follows."""
    if os.environ.get("CLEANBA_FAULT") != f"{where}@{update}":
        return False
    print(f"CLEANBA_FAULT: {where} fault at update {update}", file=sys.stderr, flush=True)
    return True


def bottleneck(learner_wait: float, actor_wait: float) -> str:
    """The side that waits is not the bottleneck: the learner waits for data when the actors are slower."""
    if learner_wait > 2 * actor_wait + 1e-3:  # waits under a millisecond are noise
        return f"actors are the bottleneck (learner waited {learner_wait:.2f}s for data)"
    if actor_wait > 2 * learner_wait + 1e-3:
        return f"learner is the bottleneck (actors waited {actor_wait:.2f}s for parameters)"
    return "actors and learner balanced"


class Rollout(NamedTuple):
    """What an actor thread puts on its rollout queue: one update's data from its environments."""

    version: int  # the policy version that collected the data (checked against the version contract)
    env_ids: np.ndarray  # global indices of the thread's environments
    batch: dict  # host arrays, time-major: (num_steps, local_num_envs, ...)
    timings: dict


def make_policy(args: Args, networks: Networks, env_ids: np.ndarray):
    """The actor's jitted policy for the environments `env_ids`. It takes a learner replica's parameters (their
    device axis of size 1 is dropped inside the call, not by a dispatch per leaf) and a step counter that stays
    on the device, so the only per-step transfers are the observations in and the actions out."""
    action_key = jax.random.fold_in(jax.random.key(args.seed), 0)

    @jax.jit
    def policy(replica_params, obs, step):
        logits, _ = forward(networks, jax.tree.map(lambda x: x[0], replica_params), obs)
        # One key per (environment, step): the sampled actions do not depend on the layout.
        step_key = jax.random.fold_in(action_key, step)
        keys = jax.vmap(lambda g: jax.random.fold_in(step_key, g))(env_ids)
        action = jax.vmap(jax.random.categorical)(keys, logits)
        logprob = jax.nn.log_softmax(logits)[jnp.arange(action.shape[0]), action]
        return action, logprob, step + 1

    return policy


def rollout(args: Args, cfg: Config, networks: Networks, start_update: int, thread_id: int, device,
            first_env_index: int, params_queue: queue.Queue, rollout_queue: queue.Queue, stop: threading.Event):
    """One actor thread: its own EnvPool on the host, inference on `device`."""
    envs = make_env(args.env_id, args.local_num_envs, first_env_index, args.seed)
    env_ids = np.arange(first_env_index, first_env_index + args.local_num_envs)
    policy = make_policy(args, networks, env_ids)
    obs, _ = envs.reset()
    done = np.zeros(args.local_num_envs, dtype=bool)
    episode_return = np.zeros(args.local_num_envs, dtype=np.float32)
    episode_length = np.zeros(args.local_num_envs, dtype=np.int32)
    for update in range(start_update + 1, cfg.num_updates + 1):
        timings = {}
        if thread_id == 0 and fault_injected("actor", update):
            raise RuntimeError(f"CLEANBA_FAULT: injected actor failure at update {update}")
        # The second iteration reuses the first parameters, so that from then on the actor collects the
        # next batch while the learner trains on the previous one (Cleanba's version timeline).
        if not args.concurrency or update != start_update + 2:
            with timer(timings, "params_queue_get_time"):
                params, version = queue_get(params_queue, stop)  # the learner put them on this device
        shape = (args.num_steps, args.local_num_envs)
        batch = dict(
            # num_steps + 1 observations: the learner bootstraps from the value of the last one.
            obs=np.zeros((args.num_steps + 1, *obs.shape), dtype=obs.dtype),
            actions=np.zeros(shape, dtype=np.int32),
            rewards=np.zeros(shape, dtype=np.float32),
            terminations=np.zeros(shape, dtype=bool),
            dones=np.zeros(shape, dtype=bool),
            # EnvPool resets a finished env on the *next* step: that step's action is ignored, so the
            # transition out of a final observation is not real and is masked out of the loss.
            valid=np.zeros(shape, dtype=bool),
            episode_returns=np.zeros(shape, dtype=np.float32),
            episode_lengths=np.zeros(shape, dtype=np.int32),
        )
        logprobs = []  # the behaviour policy's, for V-trace's importance ratios; on the device until the end
        step = jax.device_put(np.int32((update - 1) * args.num_steps), device)
        for t in range(args.num_steps):
            with timer(timings, "inference_time"):
                action, logprob, step = policy(params, obs, step)
                action = np.asarray(action)  # the envs need it on the host
            with timer(timings, "env_step_time"):
                next_obs, reward, terminated, truncated, info = envs.step(action)
            logprobs.append(logprob)
            batch["obs"][t] = obs
            batch["valid"][t] = ~done
            done = terminated | truncated
            batch["actions"][t], batch["rewards"][t], batch["terminations"][t], batch["dones"][t] = (
                action, reward, terminated, done)
            episode_return += info.get("reward", reward)  # Atari: the unclipped reward
            episode_length += batch["valid"][t]  # EnvPool's reset step is not part of either episode
            batch["episode_returns"][t] = np.where(done, episode_return, 0.0)
            batch["episode_lengths"][t] = np.where(done, episode_length, 0)
            episode_return[done], episode_length[done] = 0.0, 0
            obs = next_obs
        batch["obs"][args.num_steps] = obs
        with timer(timings, "inference_time"):
            batch["logprobs"] = np.asarray(jnp.stack(logprobs))
        with timer(timings, "rollout_queue_put_time"):
            queue_put(rollout_queue, Rollout(version, env_ids, batch, timings), stop)


def batch_fingerprint(batch, env_ids):
    """A 32-bit checksum of what the actors collected (observations, actions, rewards, episode ends).

    Each environment's column gets a position-weighted checksum, tied to the env's global index and
    mixed (MurmurHash3's finaliser); the columns are then added mod 2^32 over envs and devices. Integer
    addition is exact and order-free, so the fingerprint does not depend on which device or process
    holds which env: runs with different layouts can be compared update by update.
    """

    def column_checksums(x, salt):  # (T, local_envs, ...) -> (local_envs,)
        x = jnp.moveaxis(x, 1, 0).reshape(x.shape[1], -1)
        x = jax.lax.bitcast_convert_type(x, jnp.uint32) if x.dtype == jnp.float32 else x.astype(jnp.uint32)
        weights = jax.random.bits(jax.random.key(salt), (x.shape[1],), jnp.uint32) | 1
        return jnp.sum(x * weights, axis=1, dtype=jnp.uint32)

    h = env_ids.astype(jnp.uint32) * jnp.uint32(0x9E3779B9)
    for salt, name in enumerate(["obs", "actions", "rewards", "dones"]):
        h = h * jnp.uint32(31) + column_checksums(batch[name], salt)
    for shift, multiplier in [(16, 0x85EBCA6B), (13, 0xC2B2AE35)]:
        h = (h ^ (h >> shift)) * jnp.uint32(multiplier)
    h = h ^ (h >> 16)
    return jax.lax.psum(jnp.sum(h, dtype=jnp.uint32), "devices")


def vtrace_targets(args: Args, values, rewards, terminations, valid, rhos):
    """V-trace (Espeholt et al., 2018) with rlax, for one environment's unroll; time-major inputs.

    values has num_steps + 1 entries: values[t + 1] is the value of the observation after step t. After a
    truncation that is the episode's final observation, so the truncated return bootstraps from it; a
    termination zeroes the discount. EnvPool resets a finished environment on the next step (its action
    ignored): that step is not a real transition, so its ratio is set to 0, which removes its TD error
    and stops the backward recursion there. No target crosses an episode boundary.
    """
    return rlax.vtrace_td_error_and_advantage(
        values[:-1], values[1:], rewards, args.gamma * (1.0 - terminations), rhos * valid,
        lambda_=args.vtrace_lambda, clip_rho_threshold=args.clip_rho_threshold,
        clip_pg_rho_threshold=args.clip_pg_rho_threshold)


def make_update(args: Args, cfg: Config, networks: Networks):
    """The learner's update, data-parallel over the learner devices (pmap axis "devices").

    Each device holds the whole rollout of a contiguous block of environments. Minibatches split the
    environment axis (V-trace needs whole unrolls): the global environments form groups of
    num_minibatches consecutive indices, and a permutation seeded from (seed, update, group) sends one
    env of each group to each minibatch. A device's block is made of whole groups, so every device
    contributes the same number of envs to every minibatch, and a minibatch's composition does not depend
    on the layout. Means are taken over the global minibatch (psum of sums and counts).
    """
    M = args.num_minibatches
    minibatch_key = jax.random.fold_in(jax.random.key(args.seed), 1)
    # XLA:CPU rewrites convolutions into the layout of its fast kernels only in a program's entry computation
    # (ConvCanonicalization; jax issue #12868), so inside a loop the ResNet's gradient convolutions run as naive
    # loops, ~10x slower. There, the minibatch loop is unrolled into the entry computation: the same
    # arithmetic, compiled longer. Elsewhere a loop compiles once and runs as fast.
    unroll = cfg.learner_devices[0].platform == "cpu" and isinstance(networks.torso, ResNet)

    def scan(f, carry, xs):  # lax.scan(unroll=True) still emits a loop when there is a single step
        if not unroll:
            return jax.lax.scan(f, carry, xs)
        outputs = []
        for x in xs:
            carry, output = f(carry, x)
            outputs.append(output)
        return carry, jax.tree.map(lambda *ys: jnp.stack(ys), *outputs)

    def impala_loss(params, mb, count):
        steps_plus_one, num_envs = mb["obs"].shape[:2]
        logits, values = forward(networks, params, mb["obs"].reshape(-1, *mb["obs"].shape[2:]))
        logits, values = logits.reshape(steps_plus_one, num_envs, -1)[:-1], values.reshape(steps_plus_one, num_envs)
        logprobs_all = jax.nn.log_softmax(logits)
        new_logprobs = jnp.take_along_axis(logprobs_all, mb["actions"][..., None], axis=-1)[..., 0]
        logratio = new_logprobs - mb["logprobs"]  # against the behaviour policy that collected the data
        rhos = jax.lax.stop_gradient(jnp.exp(logratio))
        vtrace = jax.vmap(functools.partial(vtrace_targets, args), in_axes=1, out_axes=1)(
            values, mb["rewards"], mb["terminations"], mb["valid"], rhos)
        pg_loss = -new_logprobs * jax.lax.stop_gradient(vtrace.pg_advantage)
        v_loss = 0.5 * jnp.square(vtrace.errors)  # the targets carry no gradient (stop_target_gradients)
        entropy = -jnp.sum(jnp.exp(logprobs_all) * logprobs_all, axis=-1)
        # Local sums over the global count: the psum of these gradients is the global mean's gradient.
        local_mean = lambda x: jnp.sum(x * mb["valid"]) / count  # noqa: E731
        pg_loss, v_loss, entropy = local_mean(pg_loss), local_mean(v_loss), local_mean(entropy)
        loss = pg_loss - args.ent_coef * entropy + args.vf_coef * v_loss
        approx_kl = local_mean(jnp.exp(logratio) - 1 - logratio)  # how far the learner is from the behaviour
        return loss, dict(loss=loss, policy_loss=pg_loss, value_loss=v_loss, entropy=entropy, approx_kl=approx_kl)

    def update(state: TrainState, batch, update_index):
        data = dict(obs=batch["obs"], actions=batch["actions"], logprobs=batch["logprobs"], rewards=batch["rewards"],
                    terminations=batch["terminations"].astype(jnp.float32), valid=batch["valid"].astype(jnp.float32))
        env_ids = batch["env_ids"]
        groups = env_ids.reshape(-1, M)[:, 0] // M  # global index of each group of M consecutive envs
        update_key = jax.random.fold_in(minibatch_key, update_index)
        order = jax.vmap(lambda group: jax.random.permutation(jax.random.fold_in(update_key, group), M))(groups)
        minibatch_envs = (jnp.arange(groups.shape[0])[:, None] * M + order).T  # (M, envs per minibatch)

        def minibatch(state, envs):
            mb = jax.tree.map(lambda x: x[:, envs], data)
            count = jnp.maximum(jax.lax.psum(jnp.sum(mb["valid"]), "devices"), 1.0)
            grads, metrics = jax.grad(impala_loss, has_aux=True)(state.params, mb, count)
            grads = jax.lax.psum(grads, "devices")
            metrics = jax.lax.psum(metrics, "devices")
            metrics["grad_norm"] = optax.tree.norm(grads)
            return state.apply_gradients(grads=grads), metrics

        state, metrics = scan(minibatch, state, minibatch_envs)
        metrics = jax.tree.map(jnp.mean, metrics)
        # Episodes that ended in this batch, over all devices and processes (unclipped returns).
        finished = batch["dones"].astype(jnp.float32) * batch["valid"]
        metrics["episodes"] = jax.lax.psum(jnp.sum(finished), "devices")
        metrics["episodic_return_sum"] = jax.lax.psum(jnp.sum(batch["episode_returns"] * finished), "devices")
        metrics["episodic_length_sum"] = jax.lax.psum(jnp.sum(batch["episode_lengths"] * finished), "devices")
        return state, metrics, batch_fingerprint(batch, env_ids)

    # The state is not donated: the actors keep using the parameters the learner just replaced.
    return jax.pmap(update, axis_name="devices", devices=cfg.learner_devices, in_axes=(0, 0, None))


def replicate(tree, cfg: Config):
    """A copy of the tree on every learner device (this process's values on its devices), placed as the
    update's outputs are, so that the update's first call compiles the only version it needs."""
    sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(cfg.learner_devices, ("devices",)),
                                          jax.sharding.PartitionSpec("devices"))
    num_local_learners = len(cfg.local_learner_devices)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(
        sharding, np.broadcast_to(np.asarray(x), (num_local_learners, *np.shape(x)))), tree)


def replica(tree):
    """The copy on this process's first learner device of a tree that pmap keeps on every learner device,
    with its leading device axis of size 1 (taking a shard costs no computation)."""
    return jax.tree.map(lambda x: x.addressable_data(0), tree)


def to_host(tree):
    """One replica of a tree that pmap keeps on every learner device, copied to the host in one transfer."""
    return jax.tree.map(lambda x: x[0], jax.device_get(replica(tree)))


def collate(rollouts: list[Rollout], num_local_learners: int) -> dict:
    """Joins the actor threads' batches along the env axis (global env order), then splits the envs into
    equal contiguous blocks, one per local learner device: (devices, time, envs/devices, ...)."""
    batch = {k: np.concatenate([r.batch[k] for r in rollouts], axis=1) for k in rollouts[0].batch}
    batch = {k: np.moveaxis(v.reshape(v.shape[0], num_local_learners, -1, *v.shape[2:]), 1, 0)
             for k, v in batch.items()}
    batch["env_ids"] = np.concatenate([r.env_ids for r in rollouts]).reshape(num_local_learners, -1)
    return batch


def evaluate(args: Args, networks: Networks, params, num_episodes: int) -> list[float]:
    """Plays num_episodes with the given parameters (actions sampled from the policy, seeded apart from
    training), returning the unclipped episodic returns."""
    envs = make_env(args.env_id, 1, first_env_index=2**20 - 1, seed=args.seed)  # an index no training env has
    policy = jax.jit(lambda p, o, k: jax.random.categorical(k, forward(networks, p, o)[0]))
    key = jax.random.fold_in(jax.random.key(args.seed), 2)
    obs, _ = envs.reset()
    returns, episode_return = [], 0.0
    for step in range(10**8):
        if len(returns) == num_episodes:
            break
        obs, reward, terminated, truncated, info = envs.step(np.asarray(policy(params, obs, jax.random.fold_in(key, step))))
        episode_return += float(info.get("reward", reward)[0])
        if terminated[0] or truncated[0]:
            returns.append(episode_return)
            episode_return = 0.0
    return returns


# Fields that say where and how a run is executed or logged, not what it computes: a run may resume
# with other values. The global number of environments is part of the algorithm; its split is not.
LAYOUT_AND_BOOKKEEPING = {
    "track", "wandb_project_name", "wandb_entity", "save_model", "eval_episodes", "log_frequency", "run_name",
    "resume", "checkpoint_interval", "checkpoint_minutes", "local_num_envs", "actor_device_ids",
    "learner_device_ids", "num_actor_threads", "distributed", "coordinator_address", "num_processes",
    "process_id", "heartbeat_timeout"}


def algorithm_config(args: Args, cfg: Config) -> dict:
    config = {k: v for k, v in dataclasses.asdict(args).items() if k not in LAYOUT_AND_BOOKKEEPING}
    return {**config, "num_envs": cfg.num_envs}


def default_run_name(args: Args, cfg: Config) -> str:
    digest = hashlib.sha1(json.dumps(algorithm_config(args, cfg), sort_keys=True).encode()).hexdigest()[:8]
    return f"{args.env_id}__{args.exp_name}__{args.seed}__{digest}"


def save_checkpoint(path: str, state: TrainState, update: int, args: Args, cfg: Config):
    """Write, flush to disk, then rename: a reader sees the previous checkpoint or this one, never a
    partial file, whatever interrupts the write."""
    data = flax.serialization.msgpack_serialize(dict(
        state=flax.serialization.to_state_dict(state), update=update,
        config=json.dumps(algorithm_config(args, cfg), sort_keys=True)))
    with open(f"{path}.tmp", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if fault_injected("checkpoint", update):
        os._exit(137)  # killed between the write and the rename
    os.replace(f"{path}.tmp", path)


def load_checkpoint(path: str, args: Args, cfg: Config) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        checkpoint = flax.serialization.msgpack_restore(f.read())
    saved, current = json.loads(checkpoint["config"]), algorithm_config(args, cfg)
    changed = [f"{k} (checkpoint {saved.get(k)!r}, now {current.get(k)!r})"
               for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
    if changed:
        raise ConfigError(f"--run-name {os.path.basename(os.path.dirname(path))} has a checkpoint of another "
                          f"configuration: {', '.join(changed)}; pass --no-resume to start it over")
    return checkpoint


def init_train_state(args: Args, cfg: Config, networks: Networks, observation_space):
    """The initial parameters (from --seed) and the optimiser, with its learning-rate schedule."""
    init_key = jax.random.fold_in(jax.random.key(args.seed), 3)
    torso_key, actor_key, critic_key = jax.random.split(init_key, 3)
    dummy_obs = np.zeros((1, *observation_space.shape), dtype=observation_space.dtype)
    torso_params = networks.torso.init(torso_key, dummy_obs)
    policy_hidden, value_hidden = networks.torso.apply(torso_params, dummy_obs)
    params = {"torso": torso_params, "actor": networks.actor.init(actor_key, policy_hidden),
              "critic": networks.critic.init(critic_key, value_hidden)}
    gradient_steps = cfg.num_updates * args.num_minibatches
    schedule = optax.linear_schedule(args.learning_rate, 0.0, gradient_steps) if args.anneal_lr else args.learning_rate
    tx = optax.chain(optax.clip_by_global_norm(args.max_grad_norm),
                     optax.rmsprop(schedule, decay=args.rmsprop_decay, eps=args.rmsprop_eps))
    return TrainState.create(apply_fn=None, params=params, tx=tx), schedule


def main(args: Args):
    try:
        check_args(args)
        if args.distributed:
            # The heartbeat timeout bounds how long the other processes wait when one of them dies. At the
            # end, the others wait in JAX's shutdown barrier while process 0 evaluates a saved model.
            jax.distributed.initialize(args.coordinator_address, args.num_processes, args.process_id,
                                       heartbeat_timeout_seconds=args.heartbeat_timeout,
                                       shutdown_timeout_seconds=3600)
        cfg = derive_config(args)
        run_name = args.run_name or default_run_name(args, cfg)
        run_dir = f"runs/{run_name}"
        checkpoint = load_checkpoint(f"{run_dir}/checkpoint.msgpack", args, cfg) if args.resume else None
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    # SIGTERM (SLURM preemption) or SIGINT (Ctrl-C), from here on: checkpoint after the update in progress
    # (the first one, if it comes during start-up), then exit.
    stop_signals = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda signum, frame: stop_signals.append(signum))
    is_main_process = cfg.rank == 0
    if not args.resume and is_main_process and os.path.exists(f"{run_dir}/checkpoint.msgpack"):
        os.remove(f"{run_dir}/checkpoint.msgpack")  # starting over: a later resume must not find the old run
    start_update = checkpoint["update"] if checkpoint else 0
    if start_update == cfg.num_updates:
        print(f"run {run_name} already finished {cfg.num_updates} updates; nothing to do "
              "(--no-resume starts it over, --run-name or --seed starts another)")
        return
    notation = (f"a{','.join(map(str, args.actor_device_ids))}-l{','.join(map(str, args.learner_device_ids))}"
                f"-d{cfg.world_size}")
    layout = dict(notation=notation, processes=cfg.world_size, actor_threads_per_device=args.num_actor_threads,
                  actor_devices=[str(d) for d in cfg.actor_devices],
                  learner_devices=[str(d) for d in cfg.learner_devices], platform=jax.default_backend(),
                  num_envs=cfg.num_envs, batch_size=cfg.batch_size, num_updates=cfg.num_updates)

    writer = updates_log = None
    if is_main_process:
        if args.track:
            import wandb

            wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
                       config=vars(args), name=run_name, save_code=True,
                       id=hashlib.sha1(run_name.encode()).hexdigest()[:16], resume="allow")
        # On a restart, purge_step hides what was logged after the checkpoint we resume from.
        writer = SummaryWriter(run_dir, purge_step=start_update * cfg.batch_size + 1 if os.path.isdir(run_dir) else None)
        writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" +
                        "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))
        writer.add_text("layout", json.dumps(layout))
        with open(f"{run_dir}/config.json", "w") as f:
            json.dump(dict(args=dataclasses.asdict(args), layout=layout), f, indent=2)
        # One line per update with the batch fingerprint and the losses at full precision, for
        # comparing runs after the fact (cleanba/compare_runs.py); a resumed run keeps what it resumes.
        kept = []
        if start_update and os.path.exists(f"{run_dir}/updates.jsonl"):
            with open(f"{run_dir}/updates.jsonl") as f:
                kept = [line for line in f if json.loads(line)["update"] <= start_update]
        updates_log = open(f"{run_dir}/updates.jsonl", "w", buffering=1)
        updates_log.writelines(kept)
        print(f"run {run_name}: {args.env_id}, {cfg.num_envs} envs x {args.num_steps} steps = "
              f"{cfg.batch_size} per update, {cfg.num_updates} updates; layout {notation} with "
              f"{args.num_actor_threads} actor threads per actor device", flush=True)
        if checkpoint:
            print(f"resuming from {run_dir}/checkpoint.msgpack after update {start_update} "
                  f"(global step {start_update * cfg.batch_size:,}); environments restart their episodes", flush=True)

    spec = envpool.make_spec(args.env_id)
    networks = make_networks(spec.observation_space.shape, spec.action_space.n)
    state, schedule = init_train_state(args, cfg, networks, spec.observation_space)
    if checkpoint:  # optimiser state and step count included, so the learning-rate schedule continues
        state = flax.serialization.from_state_dict(state, checkpoint["state"])
    if cfg.world_size > 1:  # every process resumes from process 0's checkpoint, shared filesystem or not
        state, start_update = multihost_utils.broadcast_one_to_all((state, start_update))
        state, start_update = jax.device_get(state), int(start_update)
    num_local_learners = len(cfg.local_learner_devices)
    state = replicate(state, cfg)
    update_fn = make_update(args, cfg, networks)
    any_process = jax.pmap(lambda flag: jax.lax.psum(flag, "devices"), axis_name="devices", devices=cfg.learner_devices)

    stop = threading.Event()
    failures = []  # (thread name, formatted traceback)

    def run_actor(*thread_args):
        try:
            rollout(*thread_args)
        except StopRequested:
            pass
        except BaseException:
            failures.append((threading.current_thread().name, traceback.format_exc()))
            stop.set()

    actors = []
    for device_index, device in enumerate(cfg.actor_devices):
        for thread_index in range(args.num_actor_threads):
            thread_id = device_index * args.num_actor_threads + thread_index
            first_env_index = cfg.env_offset + thread_id * args.local_num_envs
            params_queue, rollout_queue = queue.Queue(maxsize=1), queue.Queue(maxsize=1)
            thread = threading.Thread(
                target=run_actor, name=f"actor-{device_index}-{thread_index}", daemon=True,
                args=(args, cfg, networks, start_update, thread_id, device, first_env_index, params_queue,
                      rollout_queue, stop))
            actors.append((thread, device, params_queue, rollout_queue))

    def publish(replica_params, version):
        """Puts the parameters on each actor device once for all its threads (asynchronously; nothing to copy
        on the learner's own device)."""
        on_device = {device: jax.device_put(replica_params, device) for device in cfg.actor_devices}
        for _, device, params_queue, _ in actors:
            queue_put(params_queue, (on_device[device], version), stop)

    def write_checkpoint(update):
        save_checkpoint(f"{run_dir}/checkpoint.msgpack", to_host(state), update, args, cfg)
        return update, time.time()

    episodes_since_log = np.zeros(3)  # episodes, return sum, length sum: since the last log line
    start_time = time.time()
    update = last_checkpoint = start_update
    last_checkpoint_time = start_time
    try:
        for thread, *_ in actors:
            thread.start()
        publish(replica(state.params), start_update + 1)
        for update in range(start_update + 1, cfg.num_updates + 1):
            timings = {}
            with timer(timings, "rollout_queue_get_time"):
                rollouts = [queue_get(rollout_queue, stop) for *_, rollout_queue in actors]
            if fault_injected("learner", update):
                raise RuntimeError(f"CLEANBA_FAULT: injected learner failure at update {update}")
            data_version = expected_data_version(update, start_update + 1, args.concurrency)
            if {r.version for r in rollouts} != {data_version}:
                raise RuntimeError(f"version contract violated at update {update}: learner at version {update} got "
                                   f"data of versions {sorted({r.version for r in rollouts})}, expected {data_version}")
            batch = collate(rollouts, num_local_learners)
            if fault_injected("nan", update):
                batch["rewards"][:] = np.nan
            with timer(timings, "update_time"):
                new_state, metrics, fingerprint = update_fn(state, batch, update)
                metrics, fingerprint = to_host((metrics, fingerprint))
                metrics, fingerprint = jax.tree.map(float, metrics), f"{int(fingerprint):08x}"
            for name in ["loss", "policy_loss", "value_loss", "entropy", "approx_kl", "grad_norm"]:
                if not np.isfinite(value := metrics[name]):  # keep the last good state: never train on it
                    raise FloatingPointError(f"non-finite {name} ({value}) at update {update}; the last good "
                                             f"checkpoint is the one after update {last_checkpoint}")
            state = new_state
            if update < cfg.num_updates:
                publish(replica(state.params), update + 1)

            global_step = update * cfg.batch_size
            episodes_since_log += [metrics["episodes"], metrics["episodic_return_sum"], metrics["episodic_length_sum"]]
            if is_main_process:
                updates_log.write(json.dumps(dict(update=update, global_step=global_step, data_version=data_version,
                                                  fingerprint=fingerprint, **metrics)) + "\n")
            if is_main_process and (update % args.log_frequency == 0 or update == cfg.num_updates):
                elapsed = time.time() - start_time
                sps = int((update - start_update) * cfg.batch_size / elapsed)
                actor_timings = {k: np.mean([r.timings[k] for r in rollouts]) for k in rollouts[0].timings}
                episodes, return_sum, length_sum = episodes_since_log
                if episodes:
                    writer.add_scalar("charts/episodic_return", return_sum / episodes, global_step)
                    writer.add_scalar("charts/episodic_length", length_sum / episodes, global_step)
                writer.add_scalar("charts/SPS", sps, global_step)
                lr = schedule(int(to_host(state.step))) if args.anneal_lr else schedule  # restored step count
                writer.add_scalar("charts/learning_rate", float(lr), global_step)
                for name in ["policy_loss", "value_loss", "entropy", "approx_kl", "loss", "grad_norm"]:
                    writer.add_scalar(f"losses/{name}", metrics[name], global_step)
                writer.add_scalar("stats/actor_policy_version", data_version, global_step)
                writer.add_scalar("stats/learner_policy_version", update, global_step)
                writer.add_scalar("stats/update", update, global_step)
                for name, seconds in {**actor_timings, **timings}.items():
                    writer.add_scalar(f"stats/{name}", seconds, global_step)
                eta = elapsed / (update - start_update) * (cfg.num_updates - update)
                recent = f"{return_sum / episodes:.1f} ({int(episodes)} episodes)" if episodes else "n/a"
                episodes_since_log[:] = 0
                print(f"update {update}/{cfg.num_updates} | step {global_step:,} | SPS {sps:,} | "
                      f"return {recent} | ETA {eta / 60:.1f} min | "
                      f"{bottleneck(timings['rollout_queue_get_time'], actor_timings.get('params_queue_get_time', 0))}",
                      flush=True)

            stop_now = bool(stop_signals)
            if cfg.world_size > 1:  # all processes must leave after the same update, or a collective hangs
                stop_now = int(to_host(any_process(np.full(num_local_learners, stop_now, np.int32)))) > 0
            if stop_now:
                break
            if is_main_process and ((args.checkpoint_interval and update % args.checkpoint_interval == 0)
                                    or time.time() - last_checkpoint_time > 60 * args.checkpoint_minutes):
                last_checkpoint, last_checkpoint_time = write_checkpoint(update)
    except StopRequested:
        pass
    except BaseException:
        failures.append((threading.current_thread().name, traceback.format_exc()))
    stop.set()
    if not failures and is_main_process:  # first: the learner's state does not wait for the actors
        write_checkpoint(update)
    deadline = time.time() + 30
    for thread, *_ in actors:
        thread.join(timeout=max(0.0, deadline - time.time()))
    for name, trace in failures:
        print(f"error in thread {name}:\n{trace}", file=sys.stderr)
    preempted = not failures and update < cfg.num_updates
    if preempted and is_main_process:
        print(f"stopped by {signal.Signals(stop_signals[0]).name if stop_signals else 'another process'} after "
              f"update {update} (global step {update * cfg.batch_size:,}); checkpoint written to "
              f"{run_dir}/checkpoint.msgpack: run the same command to resume", flush=True)
    if is_main_process and args.save_model and not failures and not preempted:
        params = to_host(state.params)
        model_path = f"{run_dir}/{args.exp_name}.cleanba_model"
        with open(model_path, "wb") as f:
            f.write(flax.serialization.to_bytes(params))
        print(f"model saved to {model_path}", flush=True)
        with open(model_path, "rb") as f:
            loaded = flax.serialization.from_bytes(params, f.read())
        for episode, episode_return in enumerate(evaluate(args, networks, loaded, args.eval_episodes)):
            writer.add_scalar("eval/episodic_return", episode_return, episode)
            print(f"eval episode {episode}: return {episode_return}", flush=True)
    if is_main_process:
        writer.close()
        updates_log.close()
    if failures:
        if args.distributed:  # skip JAX's exit barrier, which would wait for processes stuck in a collective
            sys.stderr.flush()
            os._exit(1)
        sys.exit(1)
    if preempted:
        sys.exit(128 + (stop_signals[0] if stop_signals else signal.SIGTERM))
    if is_main_process and args.track:
        import wandb

        wandb.finish()


if __name__ == "__main__":
    main(tyro.cli(Args))
