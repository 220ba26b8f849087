"""The same update in two processes, bit for bit or not: a script's update (its defaults, or the flags after --;
synchronous) on one batch of its own actors, --updates times, each timed; prints a hash of the batch and of the
parameters after each update, after a line naming the machine. Run it twice and compare: equal hashes, equal bits.

    .venv/bin/python tests/benchmarks/update_bits.py --algo ppo            # on a GPU machine
    .venv/bin/python tests/benchmarks/update_bits.py --algo impala -- --local-num-envs 8 --num-steps 32 \\
        --num-actor-threads 1                                                            # on a CPU

XLA's deterministic GPU ops as the script sets them (--no-deterministic-gpu: off); XLA_FLAGS of the user's stay, so
that XLA's algorithm choices can be recorded by one run (--xla_gpu_dump_autotune_results_to=FILE, without
determinism: timed) and reused by the next (--xla_gpu_load_autotune_results_from=FILE): docs/performance.md.
"""

import argparse
import hashlib
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import actor_step  # noqa: E402


def digest(tree) -> str:  # the first 16 hex digits of the SHA-256 of the leaves' bytes, in the tree's order
    sha = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        sha.update(np.asarray(jax.device_get(leaf)).tobytes())
    return sha.hexdigest()[:16]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=4, help="updates on the one batch (the first compiles)")
    actor_step.add_script_options(parser, "ppo")
    opts = parser.parse_args()
    algo, args, cfg, networks, state = actor_step.script_and_state(opts)
    ran = actor_step.what_ran(cfg.actor_devices[0], opts, args)
    ops = "deterministic" if ran["deterministic_gpu"] else "non-deterministic"
    machine = f"{ran['device']}, {ran['cores']} CPU cores, JAX {ran['jax']}, {ran['date']}"
    print(f"{machine}; {opts.algo} on {args.env_id}, {ops} GPU ops; XLA_FLAGS `{ran['xla_flags']}`", flush=True)
    learner = actor_step.Learner(algo, args, networks, state)
    print(f"batch {digest(learner.batch)}", flush=True)
    for update in range(opts.updates):
        start = time.perf_counter()
        learner()
        seconds = time.perf_counter() - start
        print(f"update {update}: {seconds:.3f} s params {digest(learner.state.params)}", flush=True)


if __name__ == "__main__":
    main()
