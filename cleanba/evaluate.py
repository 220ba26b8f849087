"""Plays episodes with the model a run saved (--save-model), or without one (or with a newer checkpoint) its newest
intact checkpoint's parameters: the policy's actions sampled as the actors sample them (PQN's: epsilon-greedy at the
run's final --end-e); with --video, records them.

    python cleanba/evaluate.py runs/<run_name> [--episodes 10] [--seed 1] [--levels unseen] [--video] [--gif]
    python cleanba/evaluate.py <entity>/<name>          # an agent shared on the Hugging Face Hub (--upload-model)

The run's config.json names its script and arguments: this tool loads the script as a module, rebuilds its
networks, reads the parameters (the normalisation statistics included) and plays on an environment whose global index
no training environment has, with the actors' own rollout program (a Gaussian's sample clipped to the action
bounds on its way to the environment; a recurrent policy's state carried through each episode). It prints each
episode's return (unclipped, for Atari) and their mean, and logs them to the run's TensorBoard events as
eval/episodic_return. With --video, each episode is also written to runs/<run_name>/videos/ as an MP4 (--gif: a GIF),
its return in the file name: the frames EnvPool renders, at the environment's own size, from the reset to the
episode's last step (length + 1 frames). Procgen: --levels unseen plays levels the run never trained on (those after
its --start-level + --num-levels), logged as eval/unseen_levels_episodic_return. A tool: the training scripts never
import it.
"""

import argparse
import contextlib
import ctypes
import ctypes.util
import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import sys
import warnings

# EnvPool's MuJoCo finds OpenGL only in a library loaded before EnvPool is: Mesa's EGL (Debian's libegl1 and
# libegl-mesa0, which setup.sh installs as root) renders on the CPU where there is no GPU.
with contextlib.suppress(OSError):
    ctypes.CDLL("libEGL.so.1", mode=ctypes.RTLD_GLOBAL)

import envpool
import flax.serialization
import gymnasium
import huggingface_hub
import imageio.v2 as imageio
import jax
import numpy as np
from tensorboardX import SummaryWriter

# imageio-ffmpeg starts ffmpeg with a fork, which JAX warns of: the child runs ffmpeg at once, never JAX.
warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
EVAL_ENV_INDEX = 2**20 - 1  # a global env index of the run's seed block that no training run reaches
# EnvPool's families that render without a display (tried: CartPole, Breakout, MiniGrid, HalfCheetah).
RENDERING_FAMILIES = ("envpool.classic_control", "envpool.atari", "envpool.minigrid", "envpool.mujoco.gym")
FRAMES_PER_SECOND = 30
UNSEEN_LEVELS = 1_000_000  # --levels unseen: this many levels after the training levels (Procgen's seeds have 31 bits)


def render_refusal(env_id: str, backend: str | None = None) -> str | None:
    """Why `env_id` cannot be rendered on this machine, or None: by EnvPool (MuJoCo without EGL would stop the process)
    or, for an id EnvPool lacks (or --env-backend gymnasium), by Gymnasium as render_mode="rgb_array" frames."""
    if backend == "gymnasium" or env_id not in envpool.registration.registry.specs:
        return gymnasium_render_refusal(env_id)
    family = envpool.registration.registry.specs[env_id][0]
    if family not in RENDERING_FAMILIES:
        return f"{env_id}: recording is supported for {', '.join(RENDERING_FAMILIES)} ids, not {family}"
    if family.startswith("envpool.mujoco") and not ctypes.util.find_library("EGL"):
        return f"{env_id}: MuJoCo renders through EGL: install Debian's libegl1 and libegl-mesa0 (setup.sh as root)"
    return None


def gymnasium_render_refusal(env_id: str) -> str | None:
    if os.getcwd() not in sys.path:  # a module:Env-v0 id's module, as the scripts import it
        sys.path.append(os.getcwd())
    try:
        env = gymnasium.make(env_id, render_mode="rgb_array")
        env.reset(seed=0)
        frame = env.render()
    except Exception as error:  # whatever the environment's code raises
        return f"{env_id}: Gymnasium cannot render it (render_mode='rgb_array'): {type(error).__name__}: {error}"
    if not (isinstance(frame, np.ndarray) and frame.ndim == 3 and frame.dtype == np.uint8):
        return f"{env_id}: its render() gives no RGB frame (height x width x 3, uint8) with render_mode='rgb_array'"
    return None


def load_script(name: str):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
    spec = importlib.util.spec_from_file_location(name[: -len(".py")], path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_run(run_dir: str, seed: int | None = None, levels: str = "train"):
    """(The run's script as a module, its arguments, its networks) from its config.json; `levels` unseen: Procgen's
    levels after those the run trained on."""
    with open(os.path.join(run_dir, "config.json")) as f:
        config = json.load(f)
    script = load_script(
        config.get("script", "cleanba_ppo.py" if "update_epochs" in config["args"] else "cleanba_impala.py")
    )
    fields = {field.name for field in dataclasses.fields(script.Args)}
    args = script.Args(**{k: v for k, v in config["args"].items() if k in fields})
    if seed is not None:
        args.seed = seed
    if hasattr(args, "end_e"):  # Q-learning (PQN) plays epsilon-greedily at its final exploration rate, not its first
        args.start_e = args.end_e
    args.layout_free_group_size = 0  # one environment: nothing to split into groups
    if levels == "unseen":
        args.start_level += args.num_levels
        args.num_levels = UNSEEN_LEVELS
    try:  # a Gymnasium id's module must be importable here (a shared agent's is the author's: bring it)
        spec = script.env_spec(args)
    except Exception as error:  # whatever the environment's code raises
        print(
            f"error: {run_dir}: --env-id {args.env_id}: cannot make it: {type(error).__name__}: {error}",
            file=sys.stderr,
        )
        sys.exit(2)
    networks = script.make_networks(args, spec)
    return script, args, networks


def checkpoints_newest_first(run_dir: str) -> list[str]:
    """The run's checkpoints: checkpoint.msgpack, then the older copies checkpoint.N.msgpack (--keep-checkpoints)."""
    ages = {}
    for name in os.listdir(run_dir):
        if match := re.fullmatch(r"checkpoint(\.(\d+))?\.msgpack", name):
            ages[name] = int(match.group(2) or 0)
    return [os.path.join(run_dir, name) for name in sorted(ages, key=ages.get)]


def saved_params(run_dir: str, exp_name: str):
    """The parameters of the model --save-model wrote at the run's end; else, or if a checkpoint is newer (a run
    started over with --no-resume keeps its old model until it saves one), of the newest intact checkpoint, as a
    resume would read them. Nothing to play: exit 2."""
    model = os.path.join(run_dir, f"{exp_name}.cleanba_model")
    checkpoints = checkpoints_newest_first(run_dir)
    if os.path.exists(model) and not (checkpoints and os.path.getmtime(checkpoints[0]) > os.path.getmtime(model)):
        with open(model, "rb") as f:
            params = flax.serialization.msgpack_restore(f.read())
        if finite(params):
            return on_actor_axis(params)
        print(f"{model} holds non-finite values (saved before the scripts checked their state): passed over")
    for path in checkpoints:
        with open(path, "rb") as f:
            digest, _, contents = f.read().partition(b"\n")  # the SHA-256 of the rest, then the msgpack
        if hashlib.sha256(contents).hexdigest().encode() != digest:
            print(f"{path} is cut short or changed (its SHA-256 checksum does not match): passed over")
            continue
        checkpoint = flax.serialization.msgpack_restore(contents)
        if not finite(checkpoint["state"]["params"]):
            print(f"{path} holds non-finite values: passed over")
            continue
        print(f"playing {path}, the parameters after update {checkpoint['update']} (no newer model of --save-model)")
        return on_actor_axis(checkpoint["state"]["params"])
    print(f"error: {run_dir} holds no model (--save-model) and no intact checkpoint to play", file=sys.stderr)
    sys.exit(2)


def finite(params) -> bool:  # no NaN or infinity: the agent a run trained (nothing else is ever saved)
    return all(np.all(np.isfinite(x)) for x in jax.tree.leaves(params))


def on_actor_axis(params):  # the device axis the actors' rollout takes
    return jax.tree.map(lambda x: np.asarray(x)[None], params)


def evaluate(run_dir: str, params, episodes: int, seed: int | None = None, levels: str = "train", max_steps=None):
    """The returns of `episodes` episodes, fewer if `max_steps` steps end first (an environment with no time limit)."""
    script, args, networks = load_run(run_dir, seed, levels)
    if levels == "unseen":
        print(f"unseen levels: {args.start_level} to {args.start_level + args.num_levels - 1}")
    envs = script.make_env(args, 1, EVAL_ENV_INDEX)
    handle, rollout = script.make_rollout(args, networks, [envs], jax.default_backend())
    states = [script.first_state(envs, handle, np.array([EVAL_ENV_INDEX]), 0, networks)]
    returns = []
    steps = 0
    while len(returns) < episodes and (max_steps is None or steps < max_steps):  # each rollout's episodes, in order
        states, batch = rollout(params, states)
        steps += args.num_steps
        batch = jax.device_get(batch)
        returns += batch["episode_returns"][batch["dones"] & batch["valid"]].tolist()
    return returns[:episodes]


class Recorder:
    """Plays and records episodes of a run's policy, one environment step per rollout (EnvPool renders the state
    between steps); the program is compiled once, the parameters can change between episodes."""

    def __init__(self, run_dir: str, seed: int | None = None, max_frames: int | None = None):
        self.script, self.args, networks = load_run(run_dir, seed)
        if refusal := render_refusal(self.args.env_id, self.args.env_backend):
            raise RuntimeError(refusal)
        self.args.num_steps = 1
        self.max_frames = max_frames  # an episode longer than this is cut (its video ends there)
        self.envs = self.script.make_env(self.args, 1, EVAL_ENV_INDEX, render_mode="rgb_array")
        handle, self.rollout = self.script.make_rollout(self.args, networks, [self.envs], jax.default_backend())
        self.networks = networks
        self.states = [self.script.first_state(self.envs, handle, np.array([EVAL_ENV_INDEX]), 0, networks)]
        self.frames = [self.envs.render()[0]]

    def episode(self, params) -> tuple[list[np.ndarray], float]:
        """(The frames of the next episode, from its reset to its last step; its return)."""
        while True:
            self.states, batch = self.rollout(params, self.states)
            batch = jax.device_get(batch)
            if not batch["valid"][0, 0]:  # EnvPool's reset step: a new episode's first frame
                self.frames = [self.envs.render()[0]]
                continue
            self.frames.append(self.envs.render()[0])
            if batch["dones"][0, 0]:
                return self.frames, float(batch["episode_returns"][0, 0])
            if self.max_frames and len(self.frames) >= self.max_frames:  # cut: the next episode starts afresh
                frames = self.frames
                [env] = self.states
                step = int(jax.device_get(env.step))
                self.states = [
                    self.script.first_state(self.envs, env.handle, np.array([EVAL_ENV_INDEX]), step, self.networks)
                ]
                self.frames = [self.envs.render()[0]]
                return frames, float("nan")


def write_video(path: str, frames: list[np.ndarray]):
    """An MP4 (H.264, imageio-ffmpeg's own ffmpeg) or, for a .gif path, an endlessly looping GIF for documentation:
    a GIF stores every pixel of every frame: a long episode keeps every second frame, a large one half its size."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if path.endswith(".gif"):
        step = 2 if len(frames) > 100 else 1
        scale = 2 if frames[0].shape[1] > 320 else 1
        small = [frame[::scale, ::scale] for frame in frames[::step]]
        imageio.mimwrite(path, small, duration=1000 * step / FRAMES_PER_SECOND, loop=0)
        return
    # macro_block_size 1: frames at their own size, padded to even sizes (H.264's pixel format needs them; EnvPool's
    # frames are, a Gymnasium environment's may not be).
    height, width = frames[0].shape[:2]
    even = [np.pad(frame, ((0, height % 2), (0, width % 2), (0, 0))) for frame in frames]
    imageio.mimwrite(path, even, fps=FRAMES_PER_SECOND, macro_block_size=1)


def parse_args(argv=None):
    """The flags, checked (what needs no run directory); exits 2 on bad input."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "run_dir",
        help="a run directory (config.json, and the model of --save-model or a checkpoint), the folder --upload-model "
        "writes, or a Hugging Face Hub repository id <entity>/<name> of one",
    )
    parser.add_argument("--episodes", type=int, default=10, help="episodes to play")
    parser.add_argument("--seed", type=int, default=None, help="another seed than the run's (environments, actions)")
    parser.add_argument(
        "--levels",
        choices=["train", "unseen"],
        default="train",
        help="Procgen: the run's training levels, or levels it never saw (after --start-level + --num-levels)",
    )
    parser.add_argument("--video", action="store_true", help="record each episode to <run_dir>/videos/ as an MP4")
    parser.add_argument("--gif", action="store_true", help="with --video: small GIFs instead of MP4s (for docs)")
    parser.add_argument(
        "--max-steps", type=int, default=None, help="with --video: cut each video after this many steps"
    )
    args = parser.parse_args(argv)
    if args.episodes <= 0:
        parser.error("--episodes must be positive")
    if (args.gif or args.max_steps) and not args.video:
        parser.error("--gif and --max-steps shape videos: add --video")
    if args.max_steps is not None and args.max_steps <= 0:
        parser.error("--max-steps must be positive")
    if args.levels == "unseen" and args.video:
        parser.error("--levels unseen plays Procgen, which EnvPool does not render: no --video")
    return args


def shared_folder(source: str) -> str:
    """A run directory, or the folder of an agent shared with --upload-model: a Hub repository id (its card, config,
    model and script downloaded to runs/hub-downloads/<entity>__<name>/, a path no dotted module name reaches: a
    module of the download is never imported) or that folder on disk, whose script must be this checkout's (its
    weights fit that script's networks). Exit 2 (69: the Hub did not give it) and one line otherwise."""
    first = source.split("/")[0]
    hub_id = re.fullmatch(r"[\w.-]+/[\w.-]+", source) and first not in ("runs", ".", "..") and not os.path.exists(first)
    if hub_id:
        local = os.path.join("runs", "hub-downloads", source.replace("/", "__"))
        shared = ["README.md", "config.json", "*.cleanba_model", "cleanba_*.py"]
        try:
            huggingface_hub.snapshot_download(source, local_dir=local, allow_patterns=shared)
        except Exception as error:  # not found, offline, refused: whatever the Hub's client raises
            first_line = f"{type(error).__name__}: {error}".splitlines()[0]
            print(f"error: {source} is no directory here, and the Hub did not give it ({first_line})", file=sys.stderr)
            sys.exit(69)
        source = local
    card = os.path.join(source, "README.md")
    if os.path.isfile(card) and os.path.isfile(os.path.join(source, "config.json")):
        with open(os.path.join(source, "config.json")) as f:
            script = json.load(f)["script"]
        library = huggingface_hub.ModelCard.load(card).data.library_name
        shared = os.path.join(source, script)
        ours = os.path.join(os.path.dirname(os.path.abspath(__file__)), script)
        if library != "cleanba" or not os.path.isfile(shared):
            print(f"error: {source}: its model card names no agent of Cleanba's scripts", file=sys.stderr)
            sys.exit(2)
        with open(shared, "rb") as f, open(ours, "rb") as g:
            if f.read() != g.read():
                fix = f"play it with the version of {script} in the folder (its commit), or train it again"
                print(f"error: {source} was trained by another version of cleanba/{script}: {fix}", file=sys.stderr)
                sys.exit(2)
    return source


def main():
    args = parse_args()
    args.run_dir = shared_folder(args.run_dir)
    if not os.path.isfile(os.path.join(args.run_dir, "config.json")):
        print(f"error: {args.run_dir} holds no config.json: not a run directory of the scripts", file=sys.stderr)
        sys.exit(2)
    with open(os.path.join(args.run_dir, "config.json")) as f:
        run_args = json.load(f)["args"]
    if args.levels == "unseen" and not run_args.get("num_levels"):
        trained_on = f"{run_args['env_id']} with --num-levels {run_args.get('num_levels', 0)}, every level"
        print(f"error: --levels unseen: the run trained on {trained_on}: none is unseen", file=sys.stderr)
        sys.exit(2)
    if args.video and (refusal := render_refusal(run_args["env_id"], run_args.get("env_backend"))):
        print(f"error: --video: {refusal}", file=sys.stderr)
        sys.exit(2)
    params = saved_params(args.run_dir, run_args["exp_name"])
    if args.video:
        returns = record(args.run_dir, params, args.episodes, args.seed, "gif" if args.gif else "mp4", args.max_steps)
    else:
        returns = evaluate(args.run_dir, params, args.episodes, args.seed, args.levels)
    tag = "eval/unseen_levels_episodic_return" if args.levels == "unseen" else "eval/episodic_return"
    levels = " on unseen levels" if args.levels == "unseen" else ""
    with SummaryWriter(args.run_dir) as writer:
        for episode, episode_return in enumerate(returns):
            if np.isfinite(episode_return):  # an episode cut by --max-steps has no return
                writer.add_scalar(tag, episode_return, episode)
            print(f"eval episode {episode}{levels}: return {episode_return}")
    finished = [r for r in returns if np.isfinite(r)]
    if finished:
        mean = f"{np.mean(finished):.2f} ± {np.std(finished):.2f}"
        print(f"mean return over {len(finished)} episodes{levels}: {mean}")


def record(run_dir: str, params, episodes: int, seed: int | None, extension: str, max_steps: int | None) -> list[float]:
    """Plays `episodes` episodes with the saved parameters, writes each to run_dir/videos/; returns their returns (NaN
    for an episode cut at max_steps)."""
    recorder = Recorder(run_dir, seed, max_frames=max_steps and max_steps + 1)
    returns = []
    for episode in range(episodes):
        frames, episode_return = recorder.episode(params)
        outcome = f"return{episode_return:g}" if np.isfinite(episode_return) else f"cut{len(frames) - 1}steps"
        name = f"eval-seed{recorder.args.seed}-episode{episode}-{outcome}.{extension}"
        write_video(os.path.join(run_dir, "videos", name), frames)
        print(f"wrote {os.path.join(run_dir, 'videos', name)} ({len(frames)} frames)")
        returns.append(episode_return)
    return returns


if __name__ == "__main__":
    main()
