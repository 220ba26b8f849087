"""Plays episodes with the model a run saved (--save-model): the policy's actions sampled as the actors sample them
(PQN's: epsilon-greedy at the run's final --end-e).

    python cleanba/evaluate.py runs/<run_name> [--episodes 10] [--seed 1]

The run's config.json names its script and arguments: this tool loads the script as a module, rebuilds its
networks, reads the model (the normalisation statistics included) and plays on an environment whose global index
no training environment has, with the actors' own rollout program (a Gaussian's sample clipped to the action
bounds on its way to the environment; a recurrent policy's state carried through each episode). It prints each
episode's return (unclipped, for Atari) and their mean, and logs them to the run's TensorBoard events as
eval/episodic_return. A tool: the training scripts never import it.
"""

import argparse
import dataclasses
import glob
import importlib.util
import json
import os
import sys

import envpool
import flax.serialization
import jax
import numpy as np
from tensorboardX import SummaryWriter

EVAL_ENV_INDEX = 2**20 - 1  # a global env index of the run's seed block that no training run reaches


def load_script(name: str):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
    spec = importlib.util.spec_from_file_location(name[: -len(".py")], path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def evaluate(run_dir: str, episodes: int, seed: int | None = None) -> list[float]:
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
    networks = script.make_networks(args, envpool.make_spec(args.env_id, **script.env_options(args)))
    envs = script.make_env(args, 1, EVAL_ENV_INDEX)
    handle, rollout = script.make_rollout(args, networks, envs, np.array([EVAL_ENV_INDEX]), jax.default_backend())
    with open(os.path.join(run_dir, f"{args.exp_name}.cleanba_model"), "rb") as f:
        params = flax.serialization.msgpack_restore(f.read())
    params = jax.tree.map(lambda x: np.asarray(x)[None], params)  # the device axis the actors' rollout takes
    env, returns = script.first_state(envs, handle, step=0, core_size=args.lstm_size), []
    while len(returns) < episodes:  # the returns of the episodes that ended in each rollout, in order
        env, batch = rollout(params, env)
        batch = jax.device_get(batch)
        returns += batch["episode_returns"][batch["dones"] & batch["valid"]].tolist()
    return returns[:episodes]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a run directory with config.json and the model saved by --save-model")
    parser.add_argument("--episodes", type=int, default=10, help="episodes to play")
    parser.add_argument("--seed", type=int, default=None, help="another seed than the run's (environments, actions)")
    args = parser.parse_args()
    if args.episodes <= 0:
        parser.error("--episodes must be positive")
    if not glob.glob(os.path.join(args.run_dir, "*.cleanba_model")):
        print(f"error: {args.run_dir} holds no model (train with --save-model)", file=sys.stderr)
        sys.exit(2)
    returns = evaluate(args.run_dir, args.episodes, args.seed)
    with SummaryWriter(args.run_dir) as writer:
        for episode, episode_return in enumerate(returns):
            writer.add_scalar("eval/episodic_return", episode_return, episode)
            print(f"eval episode {episode}: return {episode_return}")
    print(f"mean return over {len(returns)} episodes: {np.mean(returns):.2f} ± {np.std(returns):.2f}")


if __name__ == "__main__":
    main()
