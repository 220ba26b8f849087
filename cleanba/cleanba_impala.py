"""Cleanba IMPALA: single-file, distributed IMPALA (V-trace) with JAX + EnvPool.

The Cleanba architecture (Huang et al., 2023): actor threads and the learner are joined by queues of size 1.

    iteration:  1        2        3        4
    actor:      p1->d1   p1->d2   p2->d3   p3->d4
    learner:             d1->p2   d2->p3   d3->p4

The actor skips fetching parameters at iteration 2, so from then on the learner at version v trains on data of
version v-1 while the actor already collects the next batch; V-trace (Espeholt et al., 2018) corrects for that lag
with the behaviour policy's log-probabilities recorded by the actor. `--no-concurrency` is the synchronous variant.
Every environment has a global index g, and everything random is keyed by g, never by the device or thread that
holds it: the same seed gives the same batches on 1 device or many (continuous actions part in the last bits from
update 2), and the same losses up to float reassociation; bit for bit with --layout-free-group-size.
"""

import atexit
import contextlib
import dataclasses
import fcntl
import functools
import gc
import hashlib
import importlib
import json
import multiprocessing.connection
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import warnings
from typing import Annotated, Literal, NamedTuple, TypeVar

# --distributed: hand over to cleanba/supervise.py (it runs this script as its child) before the slow imports below.
if __name__ == "__main__" and "--distributed" in sys.argv[1:] and not os.environ.get("CLEANBA_SUPERVISED"):
    supervisor = os.path.join(os.path.dirname(os.path.abspath(__file__)), "supervise.py")
    if os.path.exists(supervisor):
        os.execv(sys.executable, [sys.executable, supervisor, *sys.orig_argv])  # interpreter flags included

import envpool
import flax
import flax.linen as nn
import gymnasium
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tyro
from flax.training.train_state import TrainState
from jax.experimental import multihost_utils
from tensorboardX import SummaryWriter

# EnvPool's classic-control specs declare float64 bounds: gymnasium warns, once per env, of nothing that matters.
warnings.filterwarnings("ignore", message=r".*Box (low|high)'s precision lowered", module="gymnasium")
gc.freeze()  # the imports' objects live to the end: the garbage collector's full passes, and exit's, skip them

T = TypeVar("T")
# Each field of Args says what it is (tests/test_scripts.py fails on a field that does not):
Algorithm = Annotated[T, "algorithm"]  # what the run computes: in the run name's hash, checked on resume
Runtime = Annotated[T, "runtime"]  # where the run executes and how it logs: a run may resume with another value


@dataclasses.dataclass
class Args:
    exp_name: Algorithm[str] = os.path.basename(__file__)[: -len(".py")]  # this experiment's name (in the run name)
    seed: Algorithm[int] = 1  # seed of the experiment: environments, action sampling, initialisation and minibatches
    # The algorithm's defaults are the paper's Atari settings.
    env_id: Algorithm[str] = "Breakout-v5"  # EnvPool's (Atari *-v5, HalfCheetah-v4, ...) or Gymnasium's (module:Env-v0)
    env_backend: Algorithm[Literal["envpool", "gymnasium"] | None] = None  # None: EnvPool if it has the id
    total_timesteps: Algorithm[int] = 50_000_000  # environment steps over all environments (not Atari frames)
    learning_rate: Algorithm[float] = 6e-4  # RMSProp's learning rate
    anneal_lr: Algorithm[bool] = True  # anneal the learning rate linearly to 0 over the run
    local_num_envs: Runtime[int] = 64  # environments per actor thread (their total is the algorithm's, their split not)
    num_steps: Algorithm[int] = 20  # steps per environment in each rollout (the V-trace unroll length)
    gamma: Algorithm[float] = 0.99  # discount factor
    frame_stack: Algorithm[int] = 4  # Atari: frames per observation (EnvPool's stack_num); 1 hides motion (--lstm-size)
    num_levels: Algorithm[int] = 0  # Procgen: the levels trained on (200: the generalisation protocol's); 0: all
    start_level: Algorithm[int] = 0  # Procgen: the first of them (cleanba/evaluate.py --levels unseen plays others)
    lstm_size: Algorithm[int] = 0  # units of an LSTM core after the torso: a memory for partial observability; 0: none
    critic_core: Algorithm[bool] = False  # --lstm-size: an LSTM of the value tower's own (else one of both towers)
    mask_obs: Algorithm[list[int]] = dataclasses.field(default_factory=list)  # vector components hidden (zeroed)
    view_size: Algorithm[int] = 0  # MiniGrid: the agent sees the NxN cells ahead (3: the references' view); 0: all 7x7
    norm_obs: Algorithm[bool | None] = None  # normalise observations by running mean and std; None: if continuous
    norm_reward: Algorithm[bool | None] = None  # divide rewards by a discounted return's std; None: if continuous
    vtrace_lambda: Algorithm[float] = 1.0  # lambda of V-trace's truncated importance-weighted returns
    clip_rho_threshold: Algorithm[float] = 1.0  # V-trace's clipping of the importance ratios in the value targets
    clip_pg_rho_threshold: Algorithm[float] = 1.0  # V-trace's clipping of the ratios in the policy-gradient advantages
    num_minibatches: Algorithm[int] = 4  # minibatches per batch, split along the env axis; one gradient step each
    ent_coef: Algorithm[float] = 0.01  # entropy bonus coefficient
    vf_coef: Algorithm[float] = 0.5  # value loss coefficient
    max_grad_norm: Algorithm[float] = 40.0  # global gradient-norm clipping threshold
    rmsprop_eps: Algorithm[float] = 0.01  # RMSProp's epsilon (inside the square root, as TensorFlow's in the paper)
    rmsprop_decay: Algorithm[float] = 0.99  # RMSProp's decay of the squared-gradient average
    concurrency: Algorithm[bool] = True  # Cleanba's architecture (actors a version behind, overlapping the learner)
    # Bit for bit the same run on any layout giving each actor thread and learner device 2+ groups (slower); 0: off.
    layout_free_group_size: Algorithm[int] = 0  # envs per group computed with fixed shapes, sums added in a fixed order
    # How the run records itself: logs, checkpoints, compilation cache.
    track: Runtime[bool] = False  # mirror the TensorBoard logs to Weights & Biases (honours WANDB_MODE=offline)
    wandb_project_name: Runtime[str] = "cleanba"  # the Weights & Biases project
    wandb_entity: Runtime[str | None] = None  # the Weights & Biases entity (team); None uses your default
    save_model: Runtime[bool] = False  # save the final parameters in the run directory (for cleanba/evaluate.py)
    upload_model: Runtime[bool] = False  # share the finished run's agent on the Hugging Face Hub (cleanba/share.py)
    hf_entity: Runtime[str | None] = None  # --upload-model: the Hub user or organisation; None: the token's user
    hf_repo_name: Runtime[str | None] = None  # --upload-model: the repository; None: <env id>-<exp name>-seed<seed>
    capture_video: Runtime[bool] = False  # record the agent at each checkpoint: videos/, TensorBoard (record.py)
    log_frequency: Runtime[int] = 10  # log to TensorBoard and the console every this many updates
    run_name: Runtime[str | None] = None  # under runs/; default: env id, exp name, seed, config hash (a rerun resumes)
    resume: Runtime[bool] = True  # resume from runs/<run_name>/checkpoint.msgpack if it exists; --no-resume: start over
    checkpoint_interval: Runtime[int] = 100  # checkpoint every this many updates (0: by --checkpoint-minutes only)
    checkpoint_minutes: Runtime[float] = 15.0  # also write a checkpoint this many minutes after the last one
    keep_checkpoints: Runtime[int] = 2  # the newest kept; a resume falls back to an older one if the newest is unusable
    compilation_cache_dir: Runtime[str | None] = "runs/.compilation_cache"  # resumed runs skip compiling (None: off)
    # The layout: where the run executes, not which algorithm (bit for bit: --layout-free-group-size).
    actor_device_ids: Runtime[list[int]] = dataclasses.field(default_factory=lambda: [0])  # the actors' inference
    learner_device_ids: Runtime[list[int]] = dataclasses.field(default_factory=lambda: [0])  # data-parallel learner
    num_actor_threads: Runtime[int] = 2  # actor threads per actor device, each with its own environment pool
    distributed: Runtime[bool] = False  # one of several processes of jax.distributed (SLURM's environment is read)
    coordinator_address: Runtime[str | None] = None  # --distributed outside SLURM: process 0's host:port
    num_processes: Runtime[int | None] = None  # --distributed outside SLURM: the number of processes
    process_id: Runtime[int | None] = None  # --distributed outside SLURM: this process's rank
    heartbeat_timeout: Runtime[int] = 25  # --distributed: seconds before the others give up on a silent process
    env_threads: Runtime[int] = 0  # EnvPool threads per actor thread; 0: a pinned, equal share of this process's CPUs
    env_pools: Runtime[int] = 1  # EnvPools per actor thread, taking turns (more were slower on an H100: performance.md)
    deterministic_gpu: Runtime[bool] = True  # XLA's deterministic GPU ops: the same command, the same run (off: faster)


class Config(NamedTuple):
    world_size: int  # processes
    rank: int
    num_envs: int  # over all processes
    batch_size: int  # env steps per update, over all processes
    num_updates: int
    env_offset: int  # global index of this process's first environment
    actor_devices: list
    learner_devices: list  # global, over all processes, in rank order
    local_learner_devices: list


# ---------------------------------------------------------------------------------------------------------------------
# Environments
# The run's random streams, fixed numbers every result depends on: keys folded from --seed, then with indices free of
# the layout: actions (step, global env), minibatches (update, epoch or group, global env), initialisation (core: 3).
ACTIONS = 0
MINIBATCHES = 1
INITIALISATION = 3


def env_options(args: Args) -> dict:
    """EnvPool's options for --env-id, its spec's and its pools'; Atari: Machado et al.'s (2018) evaluation protocol."""
    if args.num_levels or args.start_level:  # Procgen's levels (other ids have none: check_args)
        return dict(num_levels=args.num_levels, start_level=args.start_level)
    if not args.env_id.endswith("-v5"):
        return {}
    # No life-loss signal; sticky actions (the only randomness: no no-op starts); 18 actions; 108,000-frame episodes.
    protocol = dict(episodic_life=False, repeat_action_probability=0.25, noop_max=1, full_action_space=True)
    return dict(protocol, max_episode_steps=108_000 // 4, reward_clip=True, stack_num=args.frame_stack)


def make_env(args: Args, num_envs: int, first_env_index: int, **threads):
    # EnvPool seeds env i of a pool with (pool seed) + i, so env g gets the same seed wherever it runs; each --seed
    # has its own block of 2^20 envs (EnvPool's seeds have 31 bits), so runs with seeds 1, 2, 3 share no env.
    seed = (args.seed * 2**20 + first_env_index) % 2**31
    if gymnasium_backend(args):
        return GymnasiumPool(args.env_id, num_envs, seed, **threads)
    return envpool.make(args.env_id, env_type="gym", num_envs=num_envs, seed=seed, **env_options(args), **threads)


# ---------------------------------------------------------------------------------------------------------------------
# Networks
def max_pool(x):  # nn.max_pool(x, (3, 3), (2, 2), "SAME") without select-and-scatter (slow with deterministic GPU ops)
    x = jnp.pad(x, [(0, 0), (x.shape[1] % 2, 1), (x.shape[2] % 2, 1), (0, 0)], constant_values=-jnp.inf)  # as "SAME"
    windows = [x[:, i : x.shape[1] - 2 + i : 2, j : x.shape[2] - 2 + j : 2] for i in range(3) for j in range(3)]
    # The gradient goes to each window's first maximum, as select-and-scatter's does: the same bits on a CPU.
    return jax.lax.select_n(jnp.argmax(jnp.stack(windows), axis=0), *windows)


class ResNet(nn.Module):
    """The IMPALA network (Espeholt et al., 2018): three conv stacks of two residual blocks, then a 256-unit layer."""

    q_network: bool = False  # PQN's: LayerNorm after each stack and before the last activation

    @nn.compact
    def __call__(self, x):
        if x.shape[1] < x.shape[-1]:  # EnvPool's frames are channels first (NCHW); Gymnasium's are often last
            x = jnp.transpose(x, (0, 2, 3, 1))
        x = x.astype(jnp.float32) / 255.0
        for channels in (16, 32, 32):
            x = nn.Conv(channels, kernel_size=(3, 3))(x)
            x = max_pool(x)
            for _ in range(2):  # a residual block
                block = nn.Conv(channels, kernel_size=(3, 3))(nn.relu(x))
                x = x + nn.Conv(channels, kernel_size=(3, 3))(nn.relu(block))
            x = nn.LayerNorm()(x) if self.q_network else x
        x = nn.Dense(256)(nn.relu(x.reshape((x.shape[0], -1))))
        x = nn.relu(nn.LayerNorm()(x) if self.q_network else x)
        return x, x  # shared by the policy and the value heads


class MLP(nn.Module):
    """Two 64-unit tanh towers (policy, value) as CleanRL's classic-control PPO (a shared torso's gradient is swamped by
    the value loss); PQN's Q-network: one 128-unit tower, LayerNorm, ReLU. A dict (MiniGrid's), key by key: a grid by
    the MiniGrid authors' small CNN (rl-starter-files) on one-hot cell ids, a discrete value one-hot, a vector as is."""

    discrete_sizes: tuple = (0,)  # per key of the observation (sorted): n of a Discrete(n) value, 0 for an array
    q_network: bool = False  # PQN's tower (README, "PQN": tanh and 64 units fall short on CartPole)
    masked: tuple = ()  # --mask-obs: components of a vector observation the agent does not see
    view_size: int = 0  # --view-size: the cells of MiniGrid's grid the agent sees, one-hot and flattened (no CNN)
    cell_ids: bool = True  # a dict's uint8 grids: MiniGrid's cell ids (EnvPool's), else images (channels last)

    @nn.compact
    def __call__(self, obs):
        def tower(x):
            for _ in range(2):
                x = nn.Dense(128 if self.q_network else 64, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(x)
                x = nn.relu(nn.LayerNorm()(x)) if self.q_network else nn.tanh(x)
            return x

        parts = [x for _, x in sorted(obs.items())] if isinstance(obs, dict) else [obs]
        features = []
        for x, n in zip(parts, self.discrete_sizes, strict=True):
            if n:
                features.append(jax.nn.one_hot(x, n))
            elif x.ndim == 4 and self.view_size:  # EnvPool's 7x7 view: the agent at [x, y] = (3, 6), facing y = 0
                x = x[:, 3 - self.view_size // 2 : 4 + self.view_size // 2, 7 - self.view_size :]
                features.append(jax.nn.one_hot(x, 11).reshape(x.shape[0], -1))
            elif x.ndim == 4:  # MiniGrid's cells: ids (object type, colour, state; all below 11), categories: one-hot
                x = jax.nn.one_hot(x, 11).reshape(*x.shape[:3], -1) if self.cell_ids else x / 255.0
                padding = "VALID" if self.cell_ids else "SAME"  # (an image of any size keeps some features)
                x = nn.relu(nn.Conv(16, (2, 2), padding=padding)(x))
                x = nn.max_pool(x, (2, 2), strides=(2, 2))
                for channels in (32, 64):
                    x = nn.relu(nn.Conv(channels, (2, 2), padding=padding)(x))
                features.append(x.reshape(x.shape[0], -1))
            else:
                features.append(x / 255.0 if x.dtype == jnp.uint8 else x.astype(jnp.float32))
        x = jnp.concatenate(features, axis=-1)
        if self.masked:  # a partially observed task (e.g. CartPole without its velocities: a memory test)
            x = x.at[..., list(self.masked)].set(0.0)
        return (tower(x),) * 2 if self.q_network else (tower(x), tower(x))


class LSTMCore(nn.Module):
    """The memory: LSTMs over each env's sequence (time-major) of the torso's towers, one LSTM over all of them or one
    per tower; their state (envs, 2, width), cell and hidden, is zeroed after each flagged step."""

    size: int
    cores: int = 1  # 2: the policy's and the value's towers each have their own (--critic-core)

    @property
    def width(self) -> int:  # each core's state side by side
        return self.cores * self.size

    @nn.compact
    def __call__(self, state, towers: tuple, reset_after) -> tuple[tuple, jax.Array]:
        def step(cell, carry, inputs):
            x, reset = inputs
            carry, y = cell(carry, x)
            return jax.tree.map(lambda part: jnp.where(reset[:, None], 0.0, part), carry), y

        scan = nn.scan(step, variable_broadcast="params", split_rngs={"params": False})
        inputs = [jnp.concatenate(towers, axis=-1)] if self.cores == 1 else towers
        outputs = []
        states = []
        for i, x in enumerate(inputs):
            own = state[..., i * self.size : (i + 1) * self.size]
            (c, h), y = scan(nn.OptimizedLSTMCell(self.size), (own[:, 0], own[:, 1]), (x, reset_after))
            outputs.append(y)
            states.append(jnp.stack([c, h], axis=1))
        outputs = outputs * len(towers) if self.cores == 1 else outputs  # one memory: every tower's head reads it
        return tuple(outputs), jnp.concatenate(states, axis=-1)


class Categorical(NamedTuple):
    logits: jax.Array

    def sample(self, key):
        return jax.random.categorical(key, self.logits)

    def log_prob_and_entropy(self, action):
        log_probs = jax.nn.log_softmax(self.logits)
        log_prob = jnp.take_along_axis(log_probs, action[..., None], axis=-1)[..., 0]
        return log_prob, -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)


class DiagonalGaussian(NamedTuple):
    mean: jax.Array
    log_std: jax.Array

    def sample(self, key):
        return self.mean + jnp.exp(self.log_std) * jax.random.normal(key, self.mean.shape)

    def log_prob_and_entropy(self, action):
        z = (action - self.mean) / jnp.exp(self.log_std)
        log_prob = jnp.sum(-0.5 * jnp.square(z) - self.log_std - 0.5 * jnp.log(2 * jnp.pi), axis=-1)
        return log_prob, jnp.sum(self.log_std + 0.5 * jnp.log(2 * jnp.pi * jnp.e), axis=-1)


class Actor(nn.Module):
    """The policy: a categorical over discrete actions, or a diagonal Gaussian with a state-independent log std."""

    num_actions: int
    continuous: bool = False

    @nn.compact
    def __call__(self, hidden):
        out = nn.Dense(self.num_actions, kernel_init=nn.initializers.orthogonal(0.01))(hidden)
        if not self.continuous:
            return Categorical(out)
        log_std = self.param("log_std", nn.initializers.zeros, out.shape[-1:])
        return DiagonalGaussian(out, jnp.broadcast_to(log_std, out.shape))


class Networks(NamedTuple):
    torso: nn.Module
    core: nn.Module | None  # --lstm-size's LSTM, or none
    actor: nn.Module
    critic: nn.Module  # the value: a linear layer
    convolutional: bool  # frames, or a grid of cells (MiniGrid's): the CPU update unrolls its loops


def make_networks(args: Args, spec) -> Networks:
    """The torso follows the observation space (frames: the ResNet, vectors and dicts: the MLP), the policy the
    action space (discrete: a categorical, continuous: a diagonal Gaussian); --lstm-size puts an LSTM between them."""
    space = spec.observation_space
    parts = dict(sorted(space.spaces.items())) if isinstance(space, gymnasium.spaces.Dict) else {"": space}
    # A dict's discrete values (Discrete(n): shape ()) are one-hot encoded; n of MultiBinary is a shape.
    discrete_sizes = tuple(getattr(part, "n", 0) if part.shape == () else 0 for part in parts.values())
    frames = len(space.shape or ()) == 3
    cells = dict(view_size=args.view_size, cell_ids=not gymnasium_backend(args))  # (MiniGrid's, or images)
    torso = ResNet() if frames else MLP(discrete_sizes, masked=tuple(args.mask_obs), **cells)
    continuous = not hasattr(spec.action_space, "n")
    core = LSTMCore(args.lstm_size, cores=1 + args.critic_core) if args.lstm_size else None
    actor = Actor(spec.action_space.shape[0] if continuous else spec.action_space.n, continuous)
    critic = nn.Dense(1, kernel_init=nn.initializers.orthogonal(1.0))
    convolutional = any(len(part.shape or ()) == 3 for part in parts.values()) and not args.view_size
    return Networks(torso, core, actor, critic, convolutional)


class Outputs(NamedTuple):
    dist: Categorical | DiagonalGaussian  # the policy
    value: jax.Array  # (time, envs)
    core_state: jax.Array  # after the sequence: (envs, 2, core width)


def forward(networks: Networks, params, obs, core_state, reset_after) -> Outputs:
    """The networks' outputs for observations (time, envs, ...). A core runs each env's sequence from `core_state`
    (envs, 2, size), zeroed after the steps `reset_after` flags (EnvPool's reset steps). --norm-obs: by
    params["obs_stats"] (the learner's, not gradients'), clipped to +-10 as in CleanRL's MuJoCo wrappers."""
    if "obs_stats" in params:
        stats = jax.lax.stop_gradient(params["obs_stats"])
        obs = jnp.clip((obs - stats["mean"]) / jnp.sqrt(stats["var"] + 1e-8), -10.0, 10.0)
    time, envs = reset_after.shape

    def merge(x):  # (time, envs, ...) -> (time * envs, ...)
        return x.reshape(time * envs, *x.shape[2:])

    def split(x):  # (time * envs, ...) -> (time, envs, ...)
        return x.reshape(time, envs, *x.shape[1:])

    towers = networks.torso.apply(params["torso"], jax.tree.map(merge, obs))
    if networks.core:  # the memory of both towers (the ResNet's two are one)
        towers, core_state = networks.core.apply(params["core"], core_state, jax.tree.map(split, towers), reset_after)
        towers = jax.tree.map(merge, towers)
    policy_hidden, value_hidden = towers
    dist = jax.tree.map(split, networks.actor.apply(params["actor"], policy_hidden))
    return Outputs(dist, split(networks.critic.apply(params["critic"], value_hidden)[:, 0]), core_state)


# ---------------------------------------------------------------------------------------------------------------------
# The rollout. Each actor thread (Actors, below the signpost) makes its EnvPools (make_env), their first_state, and its
# rollout (make_rollout -> compile_rollout: act -> the envs' step -> observe, num_steps times, then bootstrap); per
# update it calls rollout(params, states) and puts a Rollout on its queue; collate puts the threads' batches together.
class Rollout(NamedTuple):
    version: int  # the policy version that collected the data (checked against the version contract)
    env_ids: np.ndarray  # global indices of the thread's environments
    batch: dict  # on the actor's device, time-major: (num_steps, local_num_envs, ...)
    timings: dict


class EnvState(NamedTuple):
    """What an actor thread carries from one env step to the next (and across rollouts), on its actor device."""

    handle: jax.Array  # EnvPool's state handle, threaded through its XLA operations to order them
    obs: jax.Array
    done: jax.Array  # the last step ended an episode: EnvPool resets the env on this step and ignores its action
    episode_return: jax.Array  # unclipped (Atari's info["reward"]), for logging
    episode_length: jax.Array
    discounted_return: jax.Array  # --norm-reward's statistic, each env's own
    step: jax.Array  # the actor's step counter: actions are sampled with a key of (step, global env index)
    ids: jax.Array  # the envs' global indices
    core: jax.Array  # the policy's core state before this step (envs, 2, --lstm-size), what the learner replays from


def to_float32(tree):  # EnvPool's float64 (MuJoCo) as JAX computes without x64
    return jax.tree.map(lambda x: x.astype(np.float32) if x.dtype == np.float64 else x, tree)


def first_state(envs, handle, ids: np.ndarray, step: int, networks: Networks) -> EnvState:
    """A pool's just-reset envs (global indices `ids`), in host arrays: actions keyed from `step` on, a zero core."""
    obs, _ = envs.reset()
    zeros = np.zeros(len(ids), np.float32)
    core = np.zeros((len(ids), 2, networks.core.width if networks.core else 0), np.float32)
    episodes = zeros, zeros.astype(np.int32), zeros  # return, length, discounted return
    return EnvState(handle, to_float32(obs), zeros > 0, *episodes, np.int32(step), ids, core)


def observe(args: Args, env: EnvState, handle, outputs) -> tuple[EnvState, dict]:
    """An env step's outputs: the envs' next state, and what the batch records of the step."""
    next_obs, reward, terminated, truncated, info = outputs
    done = terminated | truncated
    valid = ~env.done  # the step out of a final observation is not a transition
    episode_return = env.episode_return + info.get("reward", reward)  # Atari: the unclipped reward
    episode_length = env.episode_length + valid  # EnvPool's reset step is not part of either episode
    discounted_return = env.discounted_return * args.gamma + reward
    record = dict(obs=env.obs, rewards=reward, terminations=terminated, dones=done, valid=valid)
    record.update(episode_returns=jnp.where(done, episode_return, 0.0), discounted_returns=discounted_return)
    record.update(episode_lengths=jnp.where(done, episode_length, 0))
    sums = [jnp.where(done, 0, x) for x in (episode_return, episode_length, discounted_return)]  # ended: start over
    return EnvState(handle, next_obs, done, *sums, env.step + 1, env.ids, env.core), record


def compile_rollout(args: Args, act, bootstrap, pools: list, platform: str):
    """(EnvPool's handle, an actor thread's rollout (params, its pools' states) -> (their next states, the batch)):
    num_steps of `act`, the envs' step and `observe`, then `bootstrap`. On a CPU with one pool, one jitted program (a
    scan of EnvPool's XLA step, wrong on a GPU once: docs/notes/compiled-rollout.md); else the pools step in turns."""
    act = jax.jit(act)
    observe_step = jax.jit(functools.partial(observe, args))
    bootstrap = jax.jit(bootstrap)
    stack = jax.jit(jnp.stack)  # a field's steps in one call: jnp.stack alone dispatches each step's array (slow)
    action_dtype = pools[0].action_space.dtype
    if platform == "cpu" and len(pools) == 1 and hasattr(pools[0], "xla"):  # (a Gymnasium pool steps in turns)
        action_dtype = pools[0].spec.action_array_spec["action"].dtype  # its XLA step's
        with jax.enable_x64(True):  # MuJoCo takes and gives float64, which JAX traces with x64 on only
            handle, _, _, xla_step = pools[0].xla()

        def step(params, env: EnvState, _=None):
            action, policy, core = act(params, env)
            with jax.enable_x64(True):
                handle, outputs = to_float32(xla_step(env.handle, action.astype(action_dtype)))
            env, record = observe_step(env._replace(core=core), handle, outputs)
            return env, {**policy, **record}

        def scanned(replica_params, states: list[EnvState]):
            params = jax.tree.map(lambda x: x[0], replica_params)
            env, batch = jax.lax.scan(functools.partial(step, params), states[0], length=args.num_steps)
            return [env], bootstrap(params, env, batch)

        return handle, jax.jit(scanned)

    def in_turns(replica_params, states: list[EnvState]):
        params = jax.tree.map(lambda x: x[0], replica_params)
        states = list(states)
        records = [[] for _ in pools]

        def act_and_send(pool: int):  # the pool's envs start their step, its core moves on; what the batch records
            action, policy, core = act(params, states[pool])
            pools[pool].send(np.asarray(action, action_dtype))
            states[pool] = states[pool]._replace(core=core)
            return policy

        acting = [act_and_send(pool) for pool in range(len(pools))]
        for t in range(args.num_steps):
            for pool, envs in enumerate(pools):
                obs, reward, terminated, truncated, info = envs.recv()  # EnvPool's Python API
                info = {"reward": info["reward"]} if "reward" in info else {}  # Atari's unclipped reward, for logging
                outputs = to_float32((obs, reward, terminated, truncated, info))  # as its XLA operation gives them
                states[pool], record = observe_step(states[pool], states[pool].handle, outputs)
                records[pool].append({**acting[pool], **record})
                if t + 1 < args.num_steps:
                    acting[pool] = act_and_send(pool)
        stacked = [jax.tree.map(lambda *step: stack(step), *steps) for steps in records]
        batches = [bootstrap(params, env, batch) for env, batch in zip(states, stacked, strict=True)]
        return states, jax.tree.map(lambda *pool: jnp.concatenate(pool, axis=1), *batches)

    return np.zeros(1, np.uint8), in_turns  # a handle that orders nothing: EnvPool's Python API runs in order


def split_groups(x, group_size: int, axis: int):
    """(..., envs, ...) -> (groups, ..., group_size, ...): the envs along `axis` in groups, groups first."""
    x = x.reshape(*x.shape[:axis], x.shape[axis] // group_size, group_size, *x.shape[axis + 1 :])
    return jnp.moveaxis(x, axis, 0)


def in_groups(group_size: int, f, *arrays, axis: int = 0):
    """f(*arrays) on each group of `group_size` envs (along `axis`) in turn, the outputs put back together: each group
    is computed with the same shapes whatever the number of envs, so it rounds the same (--layout-free-group-size)."""
    if not group_size:
        return f(*arrays)

    def merge(x):  # (groups, ..., group_size, ...) -> (..., envs, ...)
        x = jnp.moveaxis(x, 0, axis)
        return x.reshape(*x.shape[:axis], x.shape[axis] * x.shape[axis + 1], *x.shape[axis + 2 :])

    groups = jax.tree.map(functools.partial(split_groups, group_size=group_size, axis=axis), arrays)
    return jax.tree.map(merge, jax.lax.map(lambda group: f(*group), groups))


def make_rollout(args: Args, networks: Networks, pools: list, platform: str):
    """(EnvPool's handle, the actor's rollout) for an actor thread's EnvPools, on an actor device of `platform`."""
    action_key = jax.random.fold_in(jax.random.key(args.seed), ACTIONS)
    space = pools[0].action_space

    def act(params, env: EnvState):  # (the envs' actions, what the batch records of the policy, the next core state)
        # One key per (environment, step): the sampled actions do not depend on the layout.
        step_key = jax.random.fold_in(action_key, env.step)

        def act_on(obs, core, done, ids):  # a group of envs (all of them without --layout-free-group-size)
            obs = jax.tree.map(lambda x: x[None], obs)  # a sequence of one step
            outputs = forward(networks, params, obs, core, done[None])
            dist = jax.tree.map(lambda x: x[0], outputs.dist)
            action = jax.vmap(lambda dist, g: dist.sample(jax.random.fold_in(step_key, g)))(dist, ids)
            # The behaviour policy's log-probabilities: V-trace's importance ratios are against them.
            policy = dict(actions=action, logprobs=dist.log_prob_and_entropy(action)[0], core_states=core)
            # The sample is what is stored (a Gaussian's log-probability is of it); the envs get it within bounds.
            to_envs = action if hasattr(space, "n") else jnp.clip(action, space.low, space.high)
            return to_envs, policy, outputs.core_state

        return in_groups(args.layout_free_group_size, act_on, env.obs, env.core, env.done, env.ids)

    def bootstrap(params, env: EnvState, batch):  # num_steps + 1 observations: the learner bootstraps from the last one
        return {**batch, "obs": jax.tree.map(lambda x, last: jnp.concatenate([x, last[None]]), batch["obs"], env.obs)}

    return compile_rollout(args, act, bootstrap, pools, platform)


# ---------------------------------------------------------------------------------------------------------------------
# The learner: targets, loss and update
def global_sum(group_size: int, f, *arrays):
    """The sum over all learner devices of f(*arrays), a sum over envs (axis 1, time-major). By default psum adds each
    device's f; with --layout-free-group-size, f runs on each group of envs in turn, and the groups' sums are gathered
    and added in global env order: the same float operations on any layout whose devices hold whole groups."""
    if not group_size:
        return jax.lax.psum(f(*arrays), "devices")
    groups = jax.tree.map(functools.partial(split_groups, group_size=group_size, axis=1), arrays)
    sums = jax.lax.map(lambda group: f(*group), groups)
    return jax.tree.map(lambda x: jnp.sum(jax.lax.all_gather(x, "devices", tiled=True), axis=0), sums)


def weighted_sum(x, valid):  # over time and envs, the two leading axes (time-major): what global_sum adds up
    return jnp.sum(x * valid, axis=(0, 1))


def running_stats(stats: dict, x, valid, group_size: int):
    """Running mean and variance (Chan et al.) updated with the valid x (T, envs, ...) of all envs: layout-free."""
    valid = valid.reshape(valid.shape + (1,) * (x.ndim - 2)).astype(jnp.float32)
    count = jax.lax.psum(jnp.sum(valid), "devices")  # a count: exact in any order
    mean = global_sum(group_size, weighted_sum, x, valid) / count  # group size 0: psum of each device's sum
    var = global_sum(group_size, weighted_sum, jnp.square(x - mean), valid) / count
    delta = mean - stats["mean"]
    total = stats["count"] + count
    m2 = stats["var"] * stats["count"] + var * count + jnp.square(delta) * stats["count"] * count / total
    return dict(mean=stats["mean"] + delta * count / total, var=m2 / total, count=total)


def normalisation(params: dict, batch: dict, group_size: int):
    """(Rewards, with --norm-reward / std of a discounted return clipped to +-10; the statistics after this batch)"""
    rewards = batch["rewards"]
    stats = {}
    if "return_stats" in params:
        returns = batch["discounted_returns"]
        stats["return_stats"] = running_stats(params["return_stats"], returns, batch["valid"], group_size)
        rewards = jnp.clip(rewards / jnp.sqrt(stats["return_stats"]["var"] + 1e-8), -10.0, 10.0)
    if "obs_stats" in params:  # the observations acted on (not the final ones, which the reset steps hold)
        obs = batch["obs"][: batch["valid"].shape[0]]
        stats["obs_stats"] = running_stats(params["obs_stats"], obs, batch["valid"], group_size)
    return rewards, stats


def episode_sums(batch, group_size: int):
    """Count, return sum and length sum of the episodes that ended in the batch, over all devices and processes."""

    def sums(dones, valid, returns, lengths):
        ended = dones.astype(jnp.float32) * valid
        return jnp.stack([jnp.sum(x * ended) for x in (1.0, returns, lengths)])

    ended = [batch[name] for name in ("dones", "valid", "episode_returns", "episode_lengths")]
    return global_sum(group_size, sums, *ended)  # group size 0: psum of each device's sums


def vtrace_targets(args: Args, values, rewards, terminations, valid, rhos):
    """V-trace (Espeholt et al., 2018) on one env's unroll: (v_s - V(x_s), the policy gradient's advantages).
    values[t + 1]: after a truncation, the final observation's; a reset step's ratio 0 stops the recursion."""
    discounts = args.gamma * (1.0 - terminations)
    rhos = rhos * valid
    vtrace_lambdas = jnp.full_like(rhos, args.vtrace_lambda)  # float32, as is 1 - lambda below
    deltas = jnp.minimum(args.clip_rho_threshold, rhos) * (rewards + discounts * values[1:] - values[:-1])

    def backward(later_error, step):  # v_s - V(x_s) = delta_s + gamma_s c_s (v_{s+1} - V(x_{s+1}))
        delta, discount, trace = step
        error = delta + discount * trace * later_error
        return error, error

    traces = jnp.minimum(1.0, rhos) * vtrace_lambdas  # c_s
    errors = jax.lax.scan(backward, 0.0, (deltas, discounts, traces), reverse=True)[1]
    errors = jax.lax.stop_gradient(errors + values[:-1]) - values[:-1]  # the targets v_s carry no gradient
    # The policy gradient's Q estimate bootstraps from lambda v_{s+1} + (1 - lambda) V(x_{s+1}), the last from V(x_T).
    bootstraps = vtrace_lambdas[:-1] * (errors[1:] + values[1:-1]) + (1 - vtrace_lambdas[:-1]) * values[1:-1]
    bootstraps = jnp.concatenate([bootstraps, values[-1:]])
    pg_advantages = jnp.minimum(args.clip_pg_rho_threshold, rhos) * (rewards + discounts * bootstraps - values[:-1])
    return errors, pg_advantages


def make_update(args: Args, cfg: Config, networks: Networks):
    """The learner's update, data-parallel over the learner devices (pmap axis "devices"). Minibatches split the envs
    (V-trace needs whole unrolls): a permutation seeded by (seed, update, group) sends one env of each group of M
    consecutive envs to each minibatch, whatever device holds it (a device holds whole groups); means are global."""
    M = args.num_minibatches
    G = args.layout_free_group_size
    minibatch_key = jax.random.fold_in(jax.random.key(args.seed), MINIBATCHES)
    # jax#12868: XLA:CPU runs a loop's gradient convolutions 3-10x slower; on a CPU no loop is left (True leaves one).
    unroll = 2**31 - 1 if cfg.learner_devices[0].platform == "cpu" and networks.convolutional else 1

    def impala_loss(params, mb, count):  # mb: (T, envs, ...), and T + 1 observations
        # Each env's unroll replayed from its recorded core state (IMPALA's and moolib's way), the bootstrap step too.
        reset_after = jnp.concatenate([mb["valid"] == 0, jnp.zeros_like(mb["valid"][:1], bool)])
        outputs = forward(networks, params, mb["obs"], mb["core_states"][0], reset_after)
        new_logprobs, entropy = jax.tree.map(lambda x: x[:-1], outputs.dist).log_prob_and_entropy(mb["actions"])
        logratio = new_logprobs - mb["logprobs"]  # against the behaviour policy that collected the data
        rhos = jax.lax.stop_gradient(jnp.exp(logratio))
        targets = jax.vmap(functools.partial(vtrace_targets, args), in_axes=1, out_axes=1)
        errors, pg_advantages = targets(outputs.value, mb["rewards"], mb["terminations"], mb["valid"], rhos)
        pg_loss = -new_logprobs * jax.lax.stop_gradient(pg_advantages)
        v_loss = 0.5 * jnp.square(errors)  # the targets carry no gradient
        # Local sums over the global count: the global sum of these gradients is the global mean's gradient.
        pg_loss = weighted_sum(pg_loss, mb["valid"]) / count
        v_loss = weighted_sum(v_loss, mb["valid"]) / count
        entropy = weighted_sum(entropy, mb["valid"]) / count
        loss = pg_loss - args.ent_coef * entropy + args.vf_coef * v_loss
        approx_kl = weighted_sum(rhos - 1 - logratio, mb["valid"]) / count  # how far the learner is from the behaviour
        # Logged: parts of global means, added up over devices and groups; other values (a coefficient), averaged.
        means = dict(loss=loss, policy_loss=pg_loss, value_loss=v_loss, entropy=entropy, approx_kl=approx_kl)
        return loss, (means, {})

    def update(state: TrainState, batch, update_index):
        rewards, stats = normalisation(state.params, batch, G)
        data = dict(obs=batch["obs"], actions=batch["actions"], logprobs=batch["logprobs"], rewards=rewards)
        data.update(terminations=batch["terminations"], valid=batch["valid"], core_states=batch["core_states"])
        env_ids = batch["env_ids"]
        groups = env_ids.reshape(-1, M)[:, 0] // M  # global index of each group of M envs
        update_key = jax.random.fold_in(minibatch_key, update_index)
        order = jax.vmap(lambda group: jax.random.permutation(jax.random.fold_in(update_key, group), M))(groups)
        minibatch_envs = (jnp.arange(groups.shape[0])[:, None] * M + order).T  # (M, envs per minibatch)
        pieces = jax.lax.psum(1, "devices") * (env_ids.shape[0] // G if G else 1)  # global_sum adds: devices or groups

        def minibatch(state, envs):
            mb = jax.tree.map(lambda x: x[:, envs], data)  # (T, local envs, ...) -> (T, envs of the minibatch, ...)
            count = jnp.maximum(jax.lax.psum(jnp.sum(mb["valid"]), "devices"), 1.0)
            gradient = functools.partial(jax.grad(impala_loss, has_aux=True), state.params, count=count)
            grads, (losses, values) = global_sum(G, gradient, mb)  # G = 0: psum of the devices' gradients
            losses.update(jax.tree.map(lambda x: x / pieces, values))
            losses["grad_norm"] = optax.tree.norm(grads)
            return state.apply_gradients(grads=grads), losses

        state, losses = jax.lax.scan(minibatch, state, minibatch_envs, unroll=unroll)
        # params also hold the normalisation statistics: no gradient reaches them, so each update puts in its batch's.
        state = state.replace(params={**state.params, **stats})
        return state, jax.tree.map(jnp.mean, losses), episode_sums(batch, G), batch_fingerprint(batch, env_ids)

    # The state is not donated: the actors keep using the parameters the learner just replaced.
    return jax.pmap(checked(update), axis_name="devices", devices=cfg.learner_devices, in_axes=(0, 0, None))


def init_train_state(args: Args, cfg: Config, networks: Networks, observation_space) -> tuple[TrainState, object]:
    """(Parameters from --seed and the optimiser's state, on the default device; the learning rate or its schedule)"""
    dummy_obs = jax.tree.map(lambda x: np.zeros_like(x)[None], observation_space.sample())  # one, with a batch axis
    gradient_steps = cfg.num_updates * args.num_minibatches
    schedule = optax.linear_schedule(args.learning_rate, 0.0, gradient_steps) if args.anneal_lr else args.learning_rate
    rmsprop = optax.rmsprop(schedule, decay=args.rmsprop_decay, eps=args.rmsprop_eps)
    tx = optax.chain(optax.clip_by_global_norm(args.max_grad_norm), rmsprop)

    def no_statistics(shape):  # running mean 0 and variance 1, of (almost) no samples
        return dict(mean=np.zeros(shape, np.float32), var=np.ones(shape, np.float32), count=np.float32(1e-4))

    @jax.jit  # one program, which the compilation cache keeps: op by op, a ResNet's took ~9 s of each start on a CPU
    def initial_state(seed_key):
        initialisation_key = jax.random.fold_in(seed_key, INITIALISATION)
        torso_key, actor_key, critic_key = jax.random.split(initialisation_key, 3)
        params = dict(torso=networks.torso.init(torso_key, dummy_obs))
        policy_hidden, value_hidden = networks.torso.apply(params["torso"], dummy_obs)
        if networks.core:  # a stream of its own (the other keys are those of a run without a core); it feeds both heads
            core_key = jax.random.fold_in(initialisation_key, 3)
            state = np.zeros((1, 2, networks.core.width), np.float32)
            towers = (np.zeros((1, *policy_hidden.shape), np.float32), np.zeros((1, *value_hidden.shape), np.float32))
            params["core"] = networks.core.init(core_key, state, towers, np.zeros((1, 1), bool))
            policy_hidden = value_hidden = np.zeros((1, networks.core.size), np.float32)
        params["actor"] = networks.actor.init(actor_key, policy_hidden)
        params["critic"] = networks.critic.init(critic_key, value_hidden)
        if args.norm_obs:
            params["obs_stats"] = no_statistics(observation_space.shape)
        if args.norm_reward:
            params["return_stats"] = no_statistics(())
        return TrainState.create(apply_fn=None, params=params, tx=tx)

    return initial_state(jax.random.key(args.seed)), schedule


# ---------------------------------------------------------------------------------------------------------------------
# The main loop: the actors' batches in, an update, the new parameters out
def collate(rollouts: list[Rollout], cfg: Config) -> dict:
    """The actor threads' batches in global env order, a block per learner device: (devices, T, envs, ...). Device to
    device, never through the host: put together on the first local learner device, then a block sent to each."""
    batches = jax.device_put([rollout.batch for rollout in rollouts], cfg.local_learner_devices[0])
    batch = in_blocks(batches, len(cfg.local_learner_devices))
    batch["env_ids"] = np.concatenate([r.env_ids for r in rollouts]).reshape(len(cfg.local_learner_devices), -1)
    return on_learner_devices(batch, cfg)


@functools.partial(jax.jit, static_argnums=1)
def in_blocks(batches: list[dict], devices: int) -> dict:  # one program: an operation per array is 3x slower on a CPU
    batch = jax.tree.map(lambda *threads: jnp.concatenate(threads, axis=1), *batches)

    def split(x):  # (T, envs, ...) -> (devices, T, envs / devices, ...); no -1: states of size 0 without a core
        return jnp.moveaxis(x.reshape(x.shape[0], devices, x.shape[1] // devices, *x.shape[2:]), 1, 0)

    return jax.tree.map(split, batch)


def learn(update_fn, state: TrainState, batch: dict, update: int, last_checkpoint: int):
    """One update: (new state, its updates.jsonl record). A non-finite loss or state stops the run, never saved."""
    new_state, *results = update_fn(state, batch, update)
    losses, episodes, fingerprint, finite = jax.tree.map(lambda x: x.tolist(), to_host(results))
    last = f"the last good checkpoint is the one after update {last_checkpoint}" if last_checkpoint else "no checkpoint"
    for name, value in sorted(losses.items(), key=lambda item: item[0] != "loss"):  # the total loss first
        if not np.isfinite(value):
            raise FloatingPointError(f"non-finite {name} ({value}) at update {update}; {last}")
    if not finite:  # finite losses, and yet a step too large for float32 (a learning rate of 1e39, say)
        where = non_finite(flax.serialization.to_state_dict(to_host(new_state))) or "another process's state"
        raise FloatingPointError(f"non-finite values after update {update}: {where}; {last}")
    return new_state, dict(fingerprint=f"{fingerprint:08x}", losses=losses, episodes=episodes)


def main(args: Args):
    signals = StopSignals()  # SIGTERM (preemption), SIGINT (Ctrl-C): a checkpoint after the update, then exit
    cfg, run_name, checkpoint, lock = start_up(args)  # the run directory's lock, held until main returns
    spec = env_spec(args)
    networks = make_networks(args, spec)
    state, schedule = init_train_state(args, cfg, networks, spec.observation_space)
    state, start_update = resume(cfg, state, checkpoint, run_name)
    if start_update == cfg.num_updates:
        print(f"run {run_name} already finished {cfg.num_updates} updates; nothing to train ({RESUME_WAYS_OUT})")
        if args.save_model and cfg.rank == 0:  # its model, if the first run could not write it; --upload-model: shared
            save_model(args, f"runs/{run_name}", state.params, start_update)
            share(args, f"runs/{run_name}")
        return
    run_dir = RunDir(args, cfg, run_name, start_update, schedule, checkpoint)
    update_fn = make_update(args, cfg, networks)
    actors = Actors(args, cfg, networks, start_update, signals.stop)

    update = start_update
    with actors.stopping_all_on_failure():
        actors.publish(state.params, start_update + 1)
        for update in range(start_update + 1, cfg.num_updates + 1):
            timings = {}
            with timer(timings, "rollout_queue_get_time"):
                rollouts = actors.collect()
            # The version contract (see top): data of version `update`, or with concurrency of the one before.
            data_version = update - 1 if args.concurrency and update > start_update + 1 else update
            if (versions := sorted({rollout.version for rollout in rollouts})) != [data_version]:
                raise RuntimeError(f"version contract violated at update {update}: data of versions {versions}")
            batch = collate(rollouts, cfg)
            with timer(timings, "update_time"):
                state, record = learn(update_fn, state, batch, update, run_dir.last_checkpoint)
            if update < cfg.num_updates:
                actors.publish(state.params, update + 1)
            run_dir.log(update, data_version, record, timings, rollouts, state)
            if signals.after_update(cfg):
                break
            run_dir.checkpoint(state, update, if_due=True)
            run_dir.report(update=update, checkpoint=run_dir.last_checkpoint)
    finish(args, cfg, actors, run_dir, signals, state, update)


# =====================================================================================================================
# The algorithm ends here. Below: start-up checks, the actor threads and their queues, checkpoints, stop signals and
# failures, the run directory and its logs, fingerprints.
# =====================================================================================================================
class ConfigError(ValueError):
    """Bad input: reported as one line and exit status 2, before anything is created."""


DEFAULTS = dataclasses.asdict(Args())
RESUME_WAYS_OUT = "--no-resume starts the run over, another --run-name starts another"
RUN_DIR_IN_USE = 73  # EX_CANTCREAT (sysexits.h): another copy of the command owns the run directory
WRITE_FAILED = 74  # EX_IOERR (sysexits.h): an input/output error
TOOLS = os.path.dirname(os.path.abspath(__file__))  # cleanba/: record.py, share.py and gymnasium_pool.py run from it


def check_args(args: Args):
    """Checks that need no devices (run before jax.distributed starts); settles the automatic settings."""
    positive = "total_timesteps local_num_envs num_steps num_minibatches num_actor_threads log_frequency rmsprop_eps"
    positive += " env_pools keep_checkpoints heartbeat_timeout learning_rate checkpoint_minutes max_grad_norm"
    for name in positive.split():
        if not getattr(args, name) > 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    at_least_0 = "checkpoint_interval env_threads lstm_size layout_free_group_size num_levels start_level"
    at_least_0 += " ent_coef vf_coef"
    for name in at_least_0.split():
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    for name in ["actor_device_ids", "learner_device_ids"]:
        if not (ids := getattr(args, name)) or min(ids) < 0 or len(set(ids)) != len(ids):
            raise ConfigError(f"--{name.replace('_', '-')} must list distinct non-negative ids, got {ids}")
    for field in dataclasses.fields(Args):  # an infinite or NaN coefficient trains on nothing but non-finite losses
        if "algorithm" in field.type.__metadata__ and isinstance(value := getattr(args, field.name), float):
            if not abs(value) <= np.finfo(np.float32).max:  # (NaN too)
                raise ConfigError(f"--{field.name.replace('_', '-')} must be a finite float32 number, got {value}")
    if not 0 <= args.seed < 2**32:  # JAX's keys hold 32 bits of it: 2**32 would be seed 0's run again
        raise ConfigError(f"--seed {args.seed} must lie in [0, 2**32)")
    if not args.distributed and (args.num_processes is not None or args.process_id is not None):
        raise ConfigError("--num-processes and --process-id start a --distributed run's processes: add --distributed")
    if args.num_processes is not None and not 0 <= (args.process_id or 0) < args.num_processes:
        raise ConfigError(f"--process-id {args.process_id} must lie in [0, --num-processes {args.num_processes})")
    if args.coordinator_address is not None:  # JAX takes host:port (anything else: a traceback from inside it)
        host, _, port = args.coordinator_address.rpartition(":")
        if not host or re.search(r"\s", host) or not port.isdigit() or not 0 < int(port) < 2**16:
            raise ConfigError(f"--coordinator-address {args.coordinator_address!r} must be host:port (port 1 to 65535)")
    for flag, name in [("--run-name", args.run_name), ("--exp-name", args.exp_name)]:  # a directory, the model's file
        plain = name is None or (0 < len(name.encode()) <= 100 and name.isprintable() and name[0] != ".")
        if not plain or "/" in (name or ""):
            raise ConfigError(f"{flag} {name!r} must be a plain name: 1 to 100 printable bytes, no '/' or leading '.'")
    if not (0 <= args.gamma <= 1 and 0 <= args.vtrace_lambda <= 1):
        raise ConfigError("--gamma and --vtrace-lambda must lie in [0, 1]")
    if args.env_backend == "envpool" and args.env_id not in envpool.list_all_envs():
        raise ConfigError(f"--env-id {args.env_id!r} is not an EnvPool environment (see envpool.list_all_envs())")
    if args.critic_core and not args.lstm_size:
        raise ConfigError("--critic-core gives the value tower an LSTM of its own: it needs --lstm-size")
    if (args.num_levels or args.start_level) and not args.env_id.endswith(("Easy-v0", "Hard-v0")):  # Procgen's ids
        raise ConfigError(f"--num-levels and --start-level choose Procgen's levels; --env-id {args.env_id} has none")
    if args.frame_stack != Args.frame_stack and (args.frame_stack < 1 or not args.env_id.endswith("-v5")):
        raise ConfigError(f"--frame-stack {args.frame_stack}: a positive number of frames, for Atari (-v5) ids only")
    try:  # EnvPool imports a family's module with its first spec (Procgen needs Qt 5), Gymnasium a module:Env's
        spec = env_spec(args)
    except Exception as error:  # whatever the environment's code raises
        first_line = f"{type(error).__name__}: {error}".splitlines()[0]
        raise ConfigError(f"--env-id {args.env_id}: cannot make it: {first_line}") from None
    space = spec.observation_space  # what the networks can encode, and the flags that apply to it
    parts = dict(sorted(space.spaces.items())) if isinstance(space, gymnasium.spaces.Dict) else {"": space}
    for part in parts.values():
        rank = len(part.shape or ())
        discrete = hasattr(part, "n") and part.shape == () and part is not space  # a dict's discrete value
        channels = min(part.shape[0], part.shape[-1]) if rank == 3 else 0  # first (EnvPool's) or last (Gymnasium's)
        frames = rank == 3 and part is space and part.dtype == np.uint8 and channels < part.shape[1]
        grid = rank == 3 and part is not space and part.dtype == np.uint8  # a dict's cell ids (MiniGrid's), or image
        if not (rank == 1 or discrete or frames or grid):
            what = "vectors, uint8 frames or images and dicts of vectors, discrete values and uint8 grids or images"
            raise ConfigError(f"--env-id {args.env_id}: the networks encode {what}, not {part}")
    if args.mask_obs and (len(space.shape or ()) != 1 or not all(0 <= i < space.shape[0] for i in args.mask_obs)):
        raise ConfigError(f"--mask-obs {args.mask_obs}: components 0 to n - 1 of a vector observation; here {space}")
    grids = [part.shape for part in parts.values() if len(part.shape or ()) == 3 and part is not space]
    if args.view_size and (grids != [(7, 7, 3)] or args.view_size not in (3, 5, 7)):
        raise ConfigError(f"--view-size {args.view_size} with --env-id {args.env_id}: MiniGrid only, 3, 5 or 7 cells")
    if not gymnasium_backend(args) and getattr(spec.config, "max_num_players", 1) > 1:
        raise ConfigError(f"--env-id {args.env_id}: a game of several players; the scripts train one agent")
    actions = spec.action_space
    # A Gaussian's sample: one vector of floats, clipped to finite bounds (ViZDoom's button vector has none).
    vector = isinstance(actions, gymnasium.spaces.Box) and len(actions.shape) == 1 and actions.dtype.kind == "f"
    continuous = vector and bool(np.all(np.abs(np.concatenate([actions.low, actions.high])) < 1e30))
    if not (isinstance(actions, gymnasium.spaces.Discrete) and actions.start == 0) and not continuous:
        what = "discrete actions or a bounded vector"
        raise ConfigError(f"--env-id {args.env_id}: the policy acts with {what}, not {actions}")
    if args.upload_model:  # cleanba/share.py checks the repository's name and finds a token before the run starts
        command = [sys.executable, f"{TOOLS}/share.py", "--check", json.dumps(dataclasses.asdict(args))]
        check = subprocess.run(command, capture_output=True, text=True)
        if check.returncode:
            raise ConfigError(f"--upload-model: {check.stderr.strip()}")
        args.save_model = True  # the model it shares
    if args.capture_video:  # cleanba/record.py knows what it can render here, with the backend the run uses
        recorder = [sys.executable, f"{TOOLS}/record.py", "--check", args.env_id, str(args.env_backend)]
        check = subprocess.run(recorder, capture_output=True, text=True)
        if check.returncode not in (0, -signal.SIGTERM):  # SIGTERM: the run's group got it, and the run stops
            raise ConfigError(f"--capture-video: {check.stderr.strip()}")
    args.norm_obs = continuous if args.norm_obs is None else args.norm_obs
    args.norm_reward = continuous if args.norm_reward is None else args.norm_reward
    if args.norm_obs and isinstance(spec.observation_space, gymnasium.spaces.Dict):
        raise ConfigError("--norm-obs normalises vectors, not dicts (continuous actions turn it on: --norm-obs False)")


def derive_config(args: Args) -> Config:
    """Checks that need the devices (after jax.distributed), and the derived sizes."""
    # A GPU that JAX cannot use (its CPU build, or a CUDA plugin of another version) must not go unnoticed.
    if jax.default_backend() == "cpu" and os.environ.get("JAX_PLATFORMS") != "cpu" and shutil.which("nvidia-smi"):
        if "GPU" in subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout:
            fix = "`bash setup.sh` installs JAX's CUDA build; JAX_PLATFORMS=cpu trains on the CPU"
            raise ConfigError(f"this machine has an NVIDIA GPU but JAX sees only the CPU: {fix}")
    local_devices = jax.local_devices()
    for name in ["actor_device_ids", "learner_device_ids"]:
        if missing := [i for i in getattr(args, name) if i >= len(local_devices)]:
            raise ConfigError(f"--{name.replace('_', '-')} {missing} do not exist: {len(local_devices)} devices here")
    world_size = jax.process_count()
    envs_per_process = args.local_num_envs * args.num_actor_threads * len(args.actor_device_ids)
    if envs_per_process % len(args.learner_device_ids):
        envs = f"{args.local_num_envs} x {args.num_actor_threads} threads x {len(args.actor_device_ids)} actor devices"
        raise ConfigError(f"--local-num-envs {envs} do not split over {len(args.learner_device_ids)} learner devices")
    if (envs_per_learner := envs_per_process // len(args.learner_device_ids)) % args.num_minibatches:
        envs = f"the {envs_per_learner} environments of each learner device: minibatches split the env axis"
        raise ConfigError(f"--num-minibatches {args.num_minibatches} must divide {envs}")
    # Two groups or more per actor thread and learner device: XLA inlines a loop of one, which then rounds otherwise.
    group = args.layout_free_group_size
    if group and (args.local_num_envs % (2 * group) or envs_per_learner // args.num_minibatches % (2 * group)):
        envs = f"--local-num-envs {args.local_num_envs} and each learner device's environments in a minibatch"
        need = f"two groups or more in each actor thread and learner device: {envs} must be multiples of {2 * group}"
        raise ConfigError(f"--layout-free-group-size {group}: {need}")
    smallest_pool = 2 * group or 1  # layout-free: 2 groups or more
    if args.local_num_envs % (args.env_pools * smallest_pool):
        need = f"--local-num-envs {args.local_num_envs} must be a multiple of {args.env_pools * smallest_pool}"
        raise ConfigError(f"--env-pools {args.env_pools}: {need} (pools of {smallest_pool} envs or a multiple)")
    num_envs = envs_per_process * world_size
    batch_size = num_envs * args.num_steps
    if args.total_timesteps < batch_size:
        raise ConfigError(f"--total-timesteps {args.total_timesteps} is less than one update ({batch_size} steps)")
    learners = [jax.local_devices(process_index=p)[i] for p in range(world_size) for i in args.learner_device_ids]
    actors = [local_devices[i] for i in args.actor_device_ids]
    local_learners = [local_devices[i] for i in args.learner_device_ids]
    num_updates = args.total_timesteps // batch_size
    # JAX counts these in 32 bits: the optimiser's gradient steps, and each environment's steps (its actions' keys)
    if max(num_updates * args.num_minibatches, num_updates * args.num_steps) >= 2**31:
        raise ConfigError(f"--total-timesteps {args.total_timesteps}: {num_updates:,} updates overflow JAX's int32")
    offset = jax.process_index() * envs_per_process
    rank = jax.process_index()
    return Config(world_size, rank, num_envs, batch_size, num_updates, offset, actors, learners, local_learners)


def algorithm_config(args: Args, cfg: Config) -> dict:
    config = {f.name: getattr(args, f.name) for f in dataclasses.fields(Args) if "algorithm" in f.type.__metadata__}
    return {**config, "num_envs": cfg.num_envs}


def start_up(args: Args) -> tuple[Config, str, dict | None]:
    """Checks the arguments, joins the other processes, reads the checkpoint. Bad input: one line, exit 2."""
    # Read by XLA when its backend starts (jax.distributed or the first device below); a setting of the user's stays.
    xla_flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_deterministic_ops" not in xla_flags:
        os.environ["XLA_FLAGS"] = f"{xla_flags} --xla_gpu_deterministic_ops={str(args.deterministic_gpu).lower()}"
    check_args(args)
    if args.compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache_dir)
        jax.config.update("jax_persistent_cache_enable_xla_caches", "none")  # not XLA's GPU algorithms: they set bits
    if args.distributed:
        # The others give up on a dead process after the heartbeat timeout; at the end, they wait for process 0.
        timeouts = dict(heartbeat_timeout_seconds=args.heartbeat_timeout, shutdown_timeout_seconds=3600)
        jax.config.update("jax_enable_preemption_service", False)  # its SIGTERM handler would replace StopSignals'
        jax.distributed.initialize(args.coordinator_address, args.num_processes, args.process_id, **timeouts)
    cfg = derive_config(args)
    config = algorithm_config(args, cfg)
    # The name's hash covers the values that differ from their defaults: a new field at its default renames nothing.
    named = {k: v for k, v in config.items() if k not in DEFAULTS or v != DEFAULTS[k]}
    digest = hashlib.sha1(json.dumps(named, sort_keys=True).encode()).hexdigest()[:8]
    run_name = args.run_name or f"{args.env_id.replace('/', '-')}__{args.exp_name}__{args.seed}__{digest}"
    lock = own(f"runs/{run_name}", cfg)  # before anything there is read or written
    paths = saved_checkpoints(f"runs/{run_name}")  # whatever --keep-checkpoints says now
    checkpoint = read_checkpoint(paths, run_name, config) if args.resume and paths else None
    for path in paths if not args.resume and cfg.rank == 0 else []:
        os.remove(path)  # starting over: a later resume must not find the old run
    return cfg, run_name, checkpoint, lock


def own(run_dir: str, cfg: Config):
    """The run directory's lock: process 0, which alone writes there, holds it to its end (the operating system drops
    it, after a SIGKILL too). A second copy of the command, started while it runs, is refused before it reads a file."""
    lock = None
    owned = True
    if cfg.rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        lock = open(f"{run_dir}/lock", "a+")  # (not "w": a refused copy leaves the holder's line as it is)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owned = False
        except OSError as error:  # (Lustre without its flock mount option: ENOSYS)
            raise ConfigError(f"--run-name {run_dir}: its filesystem cannot lock a file ({error})") from None
    if cfg.world_size > 1:  # a copy's processes all stop when its process 0 is refused
        owned = bool(multihost_utils.broadcast_one_to_all(np.int32(owned)))
    if not owned:
        holder = "its process 0 was refused"
        if lock:
            lock.seek(0)
            holder = lock.read().strip() or "starting"
        ways_out = "wait for it to end or stop it; another --run-name starts another run"
        print(f"error: {run_dir} is in use by another copy of this command ({holder}): {ways_out}", file=sys.stderr)
        sys.exit(RUN_DIR_IN_USE)  # nothing written
    if lock:
        lock.truncate(0)
        lock.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
        lock.flush()
    return lock


def checkpoint_paths(run_dir: str, keep: int) -> list[str]:  # the newest first
    return [f"{run_dir}/checkpoint.msgpack", *[f"{run_dir}/checkpoint.{age}.msgpack" for age in range(1, keep)]]


def saved_checkpoints(run_dir: str) -> list[str]:  # every checkpoint there, the newest first, however many are kept
    names = os.listdir(run_dir) if os.path.isdir(run_dir) else []  # (another process's, on a disk of its own)
    ages = [re.fullmatch(r"checkpoint\.(\d+)\.msgpack", name) for name in names]
    oldest = max([int(age[1]) for age in ages if age], default=0)
    return [path for path in checkpoint_paths(run_dir, oldest + 1) if os.path.exists(path)]


def read_checkpoint(paths: list[str], run_name: str, config: dict) -> dict:
    """The newest checkpoint whose checksum holds (not cut short, no bit changed), if it is of this configuration (a
    field the checkpoint predates counts at its default). Those passed over are named in one line; none: bad input."""
    unusable = []
    for path in paths:
        with open(path, "rb") as f:
            digest, _, contents = f.read().partition(b"\n")  # the SHA-256 of the rest, then the msgpack
        if hashlib.sha256(contents).hexdigest().encode() != digest:
            unusable.append(f"{path} is cut short or changed (its SHA-256 checksum does not match)")
            continue
        checkpoint = flax.serialization.msgpack_restore(contents)
        if not (where := non_finite(checkpoint["state"])):  # (written before the scripts checked their state)
            break
        unusable.append(f"{path} holds non-finite values: {where}")
    else:
        raise ConfigError(f"--run-name {run_name}: {'; '.join(unusable)}; {RESUME_WAYS_OUT}")
    if unusable and jax.process_index() == 0:
        print(f"{'; '.join(unusable)}: renamed *.unusable, resuming from {path}, the newest usable checkpoint")
    saved = json.loads(checkpoint["config"])
    before = {name: saved.get(name, DEFAULTS.get(name)) for name in config}
    changed = [f"{name} ({before[name]!r}, now {value!r})" for name, value in config.items() if before[name] != value]
    changed += [f"{name} ({saved[name]!r}, now no such field)" for name in sorted(saved.keys() - config.keys())]
    if changed:
        changed = f"a checkpoint of another configuration: {', '.join(changed)}"
        raise ConfigError(f"--run-name {run_name} has {changed}; pass --no-resume to start it over")
    return {**checkpoint, "path": path, "passed_over": paths[: len(unusable)]}


def non_finite(state: dict) -> str:
    counts = []
    for name, x in flax.traverse_util.flatten_dict(state, sep="/").items():
        if bad := np.size(x) - np.count_nonzero(np.isfinite(x)):
            counts.append(f"{name} ({bad} of {np.size(x)} values)")
    if len(counts) > 3:
        counts[3:] = [f"{len(counts) - 3} more"]
    return ", ".join(counts)


def resume(cfg: Config, state: TrainState, checkpoint: dict | None, run_name: str) -> tuple[TrainState, int]:
    """(The state on the learner devices, the update it follows): the checkpoint's, optimiser state and step count
    included (the learning-rate schedule continues), if its networks and optimiser have the same parts and shapes."""
    start_update = 0
    if checkpoint:
        saved = flax.traverse_util.flatten_dict(checkpoint["state"])
        fresh = flax.traverse_util.flatten_dict(flax.serialization.to_state_dict(state))
        if saved.keys() != fresh.keys() or any(np.shape(saved[k]) != np.shape(fresh[k]) for k in fresh):
            refusal = f"its checkpoint holds other networks or optimiser state; {RESUME_WAYS_OUT}"
            raise ConfigError(f"--run-name {run_name}: {refusal}")
        state = flax.serialization.from_state_dict(state, checkpoint["state"])
        start_update = checkpoint["update"]
    if cfg.world_size > 1:  # every process resumes from process 0's checkpoint, shared filesystem or not
        state, start_update = jax.device_get(multihost_utils.broadcast_one_to_all((state, start_update)))
    for path in checkpoint["passed_over"] if checkpoint and cfg.rank == 0 else []:  # every process has read them
        os.replace(path, f"{path}.unusable")  # set aside: the next checkpoint must not move them back as usable
    return replicate(state, cfg), int(start_update)


def gymnasium_backend(args: Args) -> bool:  # --env-backend, or by default EnvPool wherever it has the id
    return args.env_backend == "gymnasium" or (args.env_backend is None and args.env_id not in envpool.list_all_envs())


def env_spec(args: Args):
    """One environment's observation and action spaces: EnvPool's spec, or a Gymnasium environment made and reset
    (a module:Env-v0 id imports its module from the working directory too, after the installed packages)."""
    if not gymnasium_backend(args):
        return envpool.make_spec(args.env_id, **env_options(args))
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    env = gymnasium.make(args.env_id)
    env.reset(seed=0)  # an environment that cannot reset is refused before the run starts
    env.close()
    return env


def env_threads(args: Args, pool: int, cpus: list[int]) -> dict:
    """EnvPool's threads for actor thread `pool`: --env-threads, or an equal share of `cpus` (the process's; EnvPool
    would start one per core of the machine in each pool), pinned when consecutive (its thread i: CPU offset + i)."""
    if args.env_threads:
        return dict(num_threads=args.env_threads)
    share = max(1, len(cpus) // (len(args.actor_device_ids) * args.num_actor_threads))
    first = pool * share % len(cpus)
    consecutive = cpus[first : first + share] == list(range(cpus[first], cpus[first] + share))
    return dict(num_threads=share, thread_affinity_offset=cpus[first] if consecutive else -1)


class GymnasiumPool:
    """An actor thread's Gymnasium environments with EnvPool's reset, send, recv (without its infos) and render,
    stepped by cleanba/gymnasium_pool.py in a process of its own (none inherits our threads) and its workers."""

    def __init__(self, env_id: str, num_envs: int, seed: int, **threads_and_options):
        self.env_id = env_id
        ours, theirs = socket.socketpair()
        settings = dict(env_id=env_id, num_envs=num_envs, seed=seed, **threads_and_options)
        command = [sys.executable, f"{TOOLS}/gymnasium_pool.py", str(theirs.fileno()), json.dumps(settings)]
        pool = subprocess.Popen(command, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        atexit.register(pool.kill)  # (it ignores SIGTERM, and ends once this process closes the socket)
        theirs.close()
        self.connection = multiprocessing.connection.Connection(ours.detach())
        self.action_space = self.answer()

    def answer(self):  # the pool's answer to the last call; an environment's error is raised here
        try:
            answer = self.connection.recv()
        except (EOFError, ConnectionError):  # killed, or its environment crashed the interpreter
            raise ChildProcessError(f"--env-id {self.env_id}: the process of its environments died") from None
        if isinstance(answer, ChildProcessError):
            raise answer
        return answer

    def reset(self):
        self.connection.send(("reset", None))
        return self.answer(), {}

    def send(self, actions: np.ndarray):
        self.connection.send(("step", actions))

    def recv(self):
        return *self.answer(), {}

    def render(self) -> list:  # each env's frame (render_mode="rgb_array")
        self.connection.send(("render", None))
        return self.answer()


@contextlib.contextmanager
def timer(timings: dict, name: str):  # adds the block's wall-clock time to timings[name]
    start = time.perf_counter()
    yield
    timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


class StopRequested(Exception):
    """Raised in a thread blocked on a queue once another thread has asked everyone to stop."""


class Actors:
    """The actor threads, each with its own EnvPool, inference on its actor device, a params and a rollout queue."""

    def __init__(self, args: Args, cfg: Config, networks: Networks, start_update: int, stop: threading.Event):
        self.args = args
        self.cfg = cfg
        self.networks = networks
        self.start_update = start_update
        self.stop = stop
        self.failures = []  # what each thread that raised prints: its traceback, or a line for non-finite numbers
        self.threads = []  # (thread, its device, its params queue, its rollout queue)
        for device_index, device in enumerate(cfg.actor_devices):
            for thread_index in range(args.num_actor_threads):
                queues = queue.Queue(maxsize=1), queue.Queue(maxsize=1)  # parameters in, rollouts out
                thread_id = device_index * args.num_actor_threads + thread_index
                name = f"actor-{device_index}-{thread_index}"
                thread = threading.Thread(target=self.run, args=(thread_id, device, *queues), name=name, daemon=True)
                self.threads.append((thread, device, *queues))
                thread.start()  # it waits for the first parameters

    @contextlib.contextmanager
    def stopping_all_on_failure(self):  # a thread's exception (the learner's too) is recorded and stops every thread
        try:
            yield
        except StopRequested:
            pass
        except (FloatingPointError, ChildProcessError) as error:  # a non-finite number, an environment's error
            self.failures.append(f"error: {error}")
            self.stop.set()
        except BaseException:
            self.failures.append(f"error in thread {threading.current_thread().name}:\n{traceback.format_exc()}")
            self.stop.set()

    def run(self, thread_id: int, device, params_queue: queue.Queue, rollout_queue: queue.Queue):
        with self.stopping_all_on_failure():
            args = self.args
            env_ids = self.cfg.env_offset + thread_id * args.local_num_envs + np.arange(args.local_num_envs)  # global
            threads = env_threads(args, thread_id, sorted(os.sched_getaffinity(0)))  # the thread's cores, for each pool
            pools_ids = np.split(env_ids, args.env_pools)
            pools = [make_env(args, len(ids), int(ids[0]), **threads) for ids in pools_ids]
            handle, rollout = make_rollout(args, self.networks, pools, device.platform)
            step = self.start_update * args.num_steps  # actions keyed from the step the run resumes at
            states = [first_state(envs, handle, pools_ids[i], step, self.networks) for i, envs in enumerate(pools)]
            states = jax.device_put(states, device)
            for update in range(self.start_update + 1, self.cfg.num_updates + 1):
                timings = {}
                # Update 2 reuses the first parameters: from then on the actor collects as the learner trains (see top).
                if not args.concurrency or update != self.start_update + 2:
                    with timer(timings, "params_queue_get_time"):
                        params, version = self.blocking(params_queue.get)  # the learner put them on this device
                with timer(timings, "rollout_time"):
                    states, batch = rollout(params, states)
                    batch = jax.block_until_ready(batch)  # (the rollout's time; it stays on the device)
                with timer(timings, "rollout_queue_put_time"):
                    self.blocking(rollout_queue.put, Rollout(version, env_ids, batch, timings))

    def publish(self, params, version: int):  # the first learner device's replica, once per actor device
        replica_params = jax.tree.map(lambda x: x.addressable_data(0), params)  # (on the learner's: nothing to copy)
        on_device = {device: jax.device_put(replica_params, device) for device in self.cfg.actor_devices}
        for _, device, params_queue, _ in self.threads:
            self.blocking(params_queue.put, (on_device[device], version))

    def collect(self) -> list[Rollout]:
        return [self.blocking(rollout_queue.get) for *_, rollout_queue in self.threads]

    def blocking(self, queue_operation, *item):  # a queue's put or get, retried until it succeeds or the run stops
        while not self.stop.is_set():
            with contextlib.suppress(queue.Full, queue.Empty):
                return queue_operation(*item, timeout=1.0)
        raise StopRequested


def batch_fingerprint(batch, env_ids):
    """A 32-bit checksum of the batch's exact fields (observations, actions, rewards, episode ends): per env a position-
    weighted, mixed (MurmurHash3's finaliser) checksum, added mod 2^32 over envs: exact, order-free, so layout-free."""

    h = env_ids.astype(jnp.uint32) * jnp.uint32(0x9E3779B9)
    # Not the core states: floats each actor layout rounds its own way (the losses, replayed from them, are compared).
    for salt, x in enumerate(jax.tree.leaves([batch[name] for name in ["obs", "actions", "rewards", "dones"]])):
        x = jnp.moveaxis(x, 1, 0).reshape(x.shape[1], -1)  # (T, local_envs, ...) -> (local_envs, the rest)
        x = jax.lax.bitcast_convert_type(x, jnp.uint32) if x.dtype == jnp.float32 else x.astype(jnp.uint32)
        weights = jax.random.bits(jax.random.key(salt), (x.shape[1],), jnp.uint32) | 1
        h = h * jnp.uint32(31) + jnp.sum(x * weights, axis=1, dtype=jnp.uint32)
    for shift, multiplier in [(16, 0x85EBCA6B), (13, 0xC2B2AE35)]:
        h = (h ^ (h >> shift)) * jnp.uint32(multiplier)
    h = h ^ (h >> 16)
    return jax.lax.psum(jnp.sum(h, dtype=jnp.uint32), "devices")


def checked(update):
    """The update, and whether the state it returns (parameters, optimiser state) is finite: one reduction more."""

    def update_and_check(*inputs):
        state, *results = update(*inputs)
        leaves = jax.tree.leaves((state.params, state.opt_state))
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves]))
        return state, *results, jax.lax.pmin(finite.astype(jnp.int32), "devices")  # every process stops, or none

    return update_and_check


def replicate(tree, cfg: Config):
    """The tree on every learner device, placed as the update's outputs are (its first call compiles the only one)."""
    copies = len(cfg.local_learner_devices)  # one per local learner device, assembled into the global arrays
    return on_learner_devices(jax.tree.map(lambda x: np.broadcast_to(x, (copies, *np.shape(x))), tree), cfg)


def on_learner_devices(local, cfg: Config):  # (local learner devices, ...) arrays: row d on device d, as pmap takes it
    mesh = jax.sharding.Mesh(cfg.learner_devices, ("devices",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("devices"))
    return jax.make_array_from_process_local_data(sharding, local)


def to_host(tree):  # one replica of a tree that pmap keeps on every learner device, copied to the host in one transfer
    return jax.tree.map(lambda x: x[0], jax.device_get(jax.tree.map(lambda x: x.addressable_data(0), tree)))


class StopSignals:
    """SIGTERM (SLURM's preemption) and SIGINT (Ctrl-C), from main's start. After an update the run stops with a
    checkpoint, every process after the same one. Before the first, nothing to save: `stop` (see Actors) ends it."""

    def __init__(self):
        self.received = []
        self.updates_done = 0
        self.stop = threading.Event()  # set by a thread's failure too
        self.any_process = None  # the collective below, made when the learner devices are known
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self.receive)

    def receive(self, signum, frame):
        self.received.append(signum)
        if not self.updates_done:
            self.stop.set()

    def after_update(self, cfg: Config) -> bool:
        self.updates_done += 1
        if self.any_process is None:  # all processes stop after the same update, or one would wait in a collective
            self.any_process = jax.pmap(lambda x: jax.lax.psum(x, "devices"), "devices", devices=cfg.learner_devices)
        stop = np.full(len(cfg.local_learner_devices), bool(self.received), np.int32)
        return bool(to_host(self.any_process(stop)))


class RunDir:
    """What process 0 writes to runs/<run_name>/: TensorBoard events (mirrored to W&B by --track), config.json,
    updates.jsonl (per update: version, fingerprint, losses; for compare_runs.py), checkpoints, model; console lines."""

    def __init__(self, args: Args, cfg: Config, run_name: str, start_update: int, schedule, checkpoint):
        self.args = args
        self.cfg = cfg
        self.schedule = schedule
        self.path = f"runs/{run_name}"
        self.active = cfg.rank == 0
        self.start_update = start_update
        self.last_checkpoint = self.last_logged = start_update
        self.start_time = self.last_checkpoint_time = time.time()
        self.recent = []  # the records of the updates since the last log line
        self.wandb = None
        self.recorder = None  # --capture-video's process
        if args.distributed:  # for cleanba/supervise.py: this process's rank, every process's host, the run's directory
            name = np.frombuffer(os.uname().nodename.encode()[:64].ljust(64), np.uint8)
            hosts = [bytes(host).decode().strip() for host in multihost_utils.process_allgather(name)]
            self.report(rank=cfg.rank, hosts=hosts, path=self.path, update=start_update, checkpoint=start_update)
        if not self.active:
            return
        threading.excepthook = self.stop_on_failed_write  # TensorBoard's writer thread
        if args.track:  # the run's W&B id follows from its name: a resumed run resumes its W&B run
            self.wandb = importlib.import_module("wandb")
            run_id = hashlib.sha1(run_name.encode()).hexdigest()[:16]
            project = dict(project=args.wandb_project_name, entity=args.wandb_entity, config=vars(args))
            self.wandb.init(**project, name=run_name, id=run_id, resume="allow", sync_tensorboard=True, save_code=True)
        # Resumed, the run hides what was logged after its checkpoint; started (over, with --no-resume), all before.
        self.writer = SummaryWriter(self.path, purge_step=start_update * cfg.batch_size + 1 if start_update else 0)
        table = "".join(f"|{k}|{v}|\n" for k, v in vars(args).items())
        self.writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
        # config.json: the arguments, the script, the layout in the a/l/d notation (actor, learner devices; processes)
        actors = ",".join(map(str, args.actor_device_ids))
        learners = ",".join(map(str, args.learner_device_ids))
        notation = f"a{actors}-l{learners}-d{cfg.world_size}"
        layout = dict(notation=notation, processes=cfg.world_size, actor_threads_per_device=args.num_actor_threads)
        layout.update(platform=jax.default_backend(), num_envs=cfg.num_envs, batch_size=cfg.batch_size)
        layout.update(num_updates=cfg.num_updates, actor_devices=[str(d) for d in cfg.actor_devices])
        layout.update(learner_devices=[str(d) for d in cfg.learner_devices])
        config = dict(args=dataclasses.asdict(args), layout=layout, script=os.path.basename(__file__))
        write_whole(f"{self.path}/config.json", json.dumps(config, indent=2).encode(), start_update)
        kept = journal(f"{self.path}/updates.jsonl", start_update)
        write_whole(f"{self.path}/updates.jsonl", "".join(kept).encode(), start_update)  # healed, or not at all
        with writing(f"{self.path}/updates.jsonl", start_update):
            self.updates = open(f"{self.path}/updates.jsonl", "a", buffering=1)
        if args.capture_video:  # a process of its own records the checkpoints: the training path stays as it is
            command = [sys.executable, f"{TOOLS}/record.py", self.path, str(os.getpid())]
            on_cpu = dict(os.environ, JAX_PLATFORMS="cpu")  # it steps one env: a GPU's memory stays the learner's
            self.recorder = subprocess.Popen(command, env=on_cpu, stdin=subprocess.DEVNULL)
        batch = f"{cfg.num_envs} envs x {args.num_steps} steps = {cfg.batch_size} per update, {cfg.num_updates} updates"
        print(f"run {run_name}: {args.env_id}, {batch}; layout {notation}, actor threads: {args.num_actor_threads}")
        used = {*cfg.actor_devices, *cfg.local_learner_devices}  # the platform, so that a CPU run is never a surprise
        print(f"devices: {len(used)} {jax.default_backend()} ({', '.join(sorted({d.device_kind for d in used}))})")
        if start_update:
            resumed = f"after update {start_update} (global step {start_update * cfg.batch_size:,})"
            print(f"resuming from {checkpoint['path']} {resumed}; environments restart their episodes")

    def stop_on_failed_write(self, failure):  # threading.excepthook: a thread of ours reports its own failures
        if issubclass(failure.exc_type, OSError) and type(failure.thread).__module__.startswith("tensorboardX"):
            with writing(f"{self.path}/events.out.tfevents.*", self.last_logged):
                raise failure.exc_value  # (TensorBoard's writer thread could not write)
        threading.__excepthook__(failure)

    def report(self, **progress):  # --distributed: how far this process got, for cleanba/supervise.py
        if self.args.distributed:
            print(f"cleanba-progress {json.dumps(progress)}", file=sys.stderr)

    def log(self, update: int, data_version: int, record: dict, timings: dict, rollouts: list, state: TrainState):
        """updates.jsonl gets every update; TensorBoard and the console every --log-frequency updates, the losses as
        their mean over the updates since the last log line and the episodes that ended since then."""
        if not self.active:
            return
        step = update * self.cfg.batch_size
        record = dict(update=update, global_step=step, data_version=data_version, **record)
        with writing(f"{self.path}/updates.jsonl", update):
            self.updates.write(json.dumps(record) + "\n")
        self.last_logged = update
        self.recent.append(record)
        if update % self.args.log_frequency and update != self.cfg.num_updates:
            return
        elapsed = time.time() - self.start_time
        sps = int((update - self.start_update) * self.cfg.batch_size / elapsed)
        learning_rate = self.schedule(int(to_host(state.step))) if callable(self.schedule) else self.schedule
        scalars = {"charts/SPS": sps, "charts/learning_rate": float(learning_rate), "stats/update": update}
        episodes, returns, lengths = np.sum([r["episodes"] for r in self.recent], axis=0)  # of the episodes that ended
        if episodes:
            scalars.update({"charts/episodic_return": returns / episodes, "charts/episodic_length": lengths / episodes})
        scalars.update({"stats/actor_policy_version": data_version, "stats/learner_policy_version": update})
        for name in record["losses"]:
            scalars[f"losses/{name}"] = np.mean([r["losses"][name] for r in self.recent])
        for name in rollouts[0].timings:  # the actor threads' mean
            scalars[f"stats/{name}"] = np.mean([rollout.timings[name] for rollout in rollouts])
        scalars.update({f"stats/{name}": seconds for name, seconds in timings.items()})
        with writing(f"{self.path}/events.out.tfevents.*", update):
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, step)
        self.recent = []
        eta = elapsed / (update - self.start_update) * (self.cfg.num_updates - update)
        recent = f"{returns / episodes:.1f} ({int(episodes)} episodes)" if episodes else "n/a"
        actor_wait = scalars.get("stats/params_queue_get_time", 0)  # the side that waits more is the faster one
        waits = f"waits: learner {timings['rollout_queue_get_time']:.2f}s, actors {actor_wait:.2f}s"
        progress = f"update {update}/{self.cfg.num_updates} | step {step:,} | SPS {sps:,} | return {recent}"
        print(f"{progress} | ETA {eta / 60:.1f} min | {waits}")

    def checkpoint(self, state: TrainState, update: int, if_due: bool = False):
        """When due, and when the run stops: written whole and flushed with its checksum, the --keep-checkpoints older
        copied back a place (checkpoint.msgpack is never missing), then renamed in, the logs it covers on disk first."""
        interval = self.args.checkpoint_interval
        elapsed = time.time() - self.last_checkpoint_time
        due = (interval and update % interval == 0) or elapsed > 60 * self.args.checkpoint_minutes
        if (if_due and not due) or update == self.last_checkpoint:  # (the last update's is written once)
            return
        self.last_checkpoint = update
        self.last_checkpoint_time = time.time()
        if not self.active:
            return
        with writing(f"{self.path}/updates.jsonl", update):  # a resume finds every update up to the checkpoint's
            self.updates.flush()
            os.fsync(self.updates.fileno())
        with writing(f"{self.path}/events.out.tfevents.*", update):  # and its points: closing writes out its queue
            self.writer.close()
            self.writer = SummaryWriter(self.path, filename_suffix=f".{update:09d}")  # a file of theirs, in name order
        config = json.dumps(algorithm_config(self.args, self.cfg), sort_keys=True)
        checkpoint = dict(state=flax.serialization.to_state_dict(to_host(state)), update=update, config=config)
        contents = flax.serialization.msgpack_serialize(checkpoint)
        paths = checkpoint_paths(self.path, self.args.keep_checkpoints)
        with writing(f"{paths[0]}.tmp", update):  # the checkpoints written before stay as they are
            with open(f"{paths[0]}.tmp", "wb") as f:
                f.write(hashlib.sha256(contents).hexdigest().encode() + b"\n" + contents)
                f.flush()
                os.fsync(f.fileno())
            for older, newer in reversed(list(zip(paths[1:], paths[:-1], strict=True))):
                if os.path.exists(newer):  # copied, not linked: a bit that flips in one is not flipped in the other
                    shutil.copyfile(newer, f"{older}.tmp")
                    os.replace(f"{older}.tmp", older)
        os.replace(f"{paths[0]}.tmp", paths[0])

    def close(self, finished: bool):
        if self.recorder and not finished:
            self.recorder.terminate()
        if self.recorder:  # a finished run's last checkpoint gets recorded (then W&B syncs it), in 10 minutes at most
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.recorder.wait(timeout=600)
            self.recorder.kill()
        if self.active:
            with writing(f"{self.path}/events.out.tfevents.*", self.last_logged):
                self.writer.close()
            with writing(f"{self.path}/updates.jsonl", self.last_logged):
                self.updates.close()
        if finished and self.wandb:
            self.wandb.finish()


def journal(path: str, start_update: int) -> list[str]:
    """updates.jsonl's records of the updates the checkpoint covers, each once and in order; what else it held (records
    after it, which the run redoes, repeated or cut short) and what it lacks are said in a line each."""
    lines = []
    with contextlib.suppress(FileNotFoundError), open(path, errors="replace") as f:
        lines = f.readlines()
    records = {}
    for line in lines:
        with contextlib.suppress(ValueError, KeyError, TypeError):  # a line cut short: not JSON, or no newline
            if line.endswith("\n") and 0 < (update := json.loads(line)["update"]) <= start_update:
                records[update] = line
    if start_update and (dropped := len(lines) - len(records)):  # (starting over, all the old run's lines go)
        print(f"{path}: dropped {dropped} of {len(lines)} lines (after update {start_update}, repeated or cut short)")
    if missing := [update for update in range(1, start_update + 1) if update not in records]:
        first_last = f"the first {missing[0]}, the last {missing[-1]}"
        print(f"{path} lacks the records of {len(missing)} of the updates its checkpoint covers ({first_last})")
    return [records[update] for update in sorted(records)]


@contextlib.contextmanager
def writing(path: str, update: int):
    """A write that fails (a full disk, a quota) stops the run at once, in one line, exit status 74: the checkpoints
    written before are intact, and updates.jsonl is healed when the run resumes (see journal)."""
    try:
        yield
    except OSError as error:
        kept = "the checkpoints written before are intact: run the same command to resume"
        print(f"error: writing {path} after update {update} failed ({error}); {kept}", file=sys.stderr, flush=True)
        os._exit(WRITE_FAILED)


def write_whole(path: str, contents: bytes, update: int):  # a kill or a full disk never cuts it short
    with writing(f"{path}.tmp", update):
        with open(f"{path}.tmp", "wb") as f:
            f.write(contents)
            f.flush()
            os.fsync(f.fileno())
        os.replace(f"{path}.tmp", path)


def save_model(args: Args, run_path: str, params, update: int):  # for cleanba/evaluate.py
    path = f"{run_path}/{args.exp_name}.cleanba_model"
    write_whole(path, flax.serialization.to_bytes(to_host(params)), update)  # normalisation statistics included
    print(f"model saved to {path} (evaluate: cleanba/evaluate.py {run_path})")


def share(args: Args, run_path: str):  # --upload-model: cleanba/share.py makes the agent's folder and uploads it
    if args.upload_model:
        sharer = [sys.executable, f"{TOOLS}/share.py", run_path, "--", *sys.argv]
        if failed := subprocess.run(sharer, stdin=subprocess.DEVNULL).returncode:
            sys.exit(failed)  # share.py said what failed (69: the Hub did not take it, and how to upload it later)


def finish(args: Args, cfg: Config, actors: Actors, run_dir: RunDir, signals, state: TrainState, update: int):
    """Stops every thread and exits: 1 after a failure (its traceback once), 128 + signal after a stop signal."""
    actors.stop.set()
    if signals.received and not signals.updates_done:  # nothing to save: exit at once (compiling may fail: no error)
        run_dir.close(finished=False)
        stopped = f"stopped by {signal.Signals(signals.received[0]).name} during start-up"
        if cfg.rank == 0:  # flushed: os._exit does not
            print(f"{stopped}, before update {run_dir.start_update + 1}: nothing new to save", flush=True)
        os._exit(128 + signals.received[0])
    failed = bool(actors.failures)
    if not failed:  # first: the learner's state does not wait for the actors
        run_dir.checkpoint(state, update)
    deadline = time.time() + 30
    for thread, *_ in actors.threads:
        thread.join(timeout=max(0.0, deadline - time.time()))
    for failure in actors.failures:
        print(failure, file=sys.stderr)
    preempted = not failed and update < cfg.num_updates
    signum = signals.received[0] if signals.received else signal.SIGTERM  # 128 + it; another process's stop: SIGTERM
    if preempted and cfg.rank == 0:
        by = signal.Signals(signum).name if signals.received else "another process"
        resume = f"checkpoint written to {run_dir.path}/checkpoint.msgpack: run the same command to resume"
        print(f"stopped by {by} after update {update} (global step {update * cfg.batch_size:,}); {resume}")
    if cfg.rank == 0 and args.save_model and not failed and not preempted:
        save_model(args, run_dir.path, state.params, update)
    run_dir.close(finished=not failed and not preempted)
    if cfg.rank == 0 and not failed and not preempted:
        share(args, run_dir.path)
    if failed and args.distributed:  # (stderr is line-buffered: the tracebacks are out)
        os._exit(1)  # skips JAX's exit barrier, which would wait for processes stuck in a collective
    if failed or preempted:
        sys.exit(1 if failed else 128 + signum)


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)  # progress lines reach log files (SLURM's) as they are printed
    try:
        main(tyro.cli(Args))
    except ConfigError as error:  # bad input: one line naming the flag or file at fault, exit status 2, nothing written
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
