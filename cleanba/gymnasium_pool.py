"""Steps an actor thread's Gymnasium environments: the training scripts' GymnasiumPool starts one per pool.

    python cleanba/gymnasium_pool.py FD SETTINGS     (FD: this end of a socket pair; SETTINGS: JSON, see `serve`)

The training process sends calls on the socket, ("reset", None), ("step", actions) or ("render", None), and this
process answers each as EnvPool's pool would: the observations, or (observations, rewards, terminations,
truncations) for a step, in env order; render: a frame per env. Its envs are split among worker processes, one per
CPU it is given (pinned there, as EnvPool's threads are), each holding its share in Gymnasium's SyncVectorEnv, whose
next-step autoreset is EnvPool's. Env i gets seed + i at the first reset; later resets go on with each env's random
numbers, as EnvPool's do. An environment's error is answered in one line (a ChildProcessError naming the call and
where it was raised). It ignores SIGINT and SIGTERM, as its workers do: the training process stops, then closes the
socket, which ends them all. A tool: the training scripts never import it (nor JAX: it starts in a fraction of a
second).
"""

import atexit
import contextlib
import functools
import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import traceback

import gymnasium
import numpy as np


def worker(env_id: str, num_envs: int, cpu: int, connection, options: dict, inherited: list):
    """A worker process: its share of the envs answers this process's calls until the pipe closes."""
    for other in inherited:  # the pool's other connections, copied by the fork: their ends must close with the pool
        other.close()
    if cpu >= 0:
        os.sched_setaffinity(0, [cpu])
    envs = gymnasium.vector.SyncVectorEnv([functools.partial(gymnasium.make, env_id, **options)] * num_envs)
    connection.send(envs.single_action_space)
    with contextlib.suppress(EOFError, ConnectionError):  # the pool has ended
        while True:
            method, kwargs = connection.recv()
            try:
                answer = getattr(envs, method)(**kwargs)
            except Exception as error:  # whatever the environment raises
                where = traceback.extract_tb(error.__traceback__)[-1]
                raised = f"{method} raised {type(error).__name__} ({where.filename}:{where.lineno})"
                answer = ChildProcessError(f"--env-id {env_id}: {raised}: {error}".splitlines()[0])
            connection.send(answer)


def concatenated(parts: list):  # the workers' observations (arrays, or dicts of them) as one batch of envs
    if isinstance(parts[0], dict):
        return {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}
    return np.concatenate(parts)


def combined(method: str, answers: list):  # the workers' answers as one pool's answer
    if errors := [answer for answer in answers if isinstance(answer, ChildProcessError)]:
        return errors[0]
    if method == "reset":
        return concatenated([obs for obs, _ in answers])
    if method == "step":  # (obs, rewards, terminations, truncations): not Gymnasium's infos
        return tuple(concatenated([answer[output] for answer in answers]) for output in range(4))
    if method == "render":
        return [frame for frames in answers for frame in frames]
    return answers[0]  # at the start: the action space (every worker's is the same)


def serve(training, env_id: str, num_envs: int, seed: int, num_threads=1, thread_affinity_offset=-1, **options):
    """Answers the training process's calls on `training` (a connection) with `num_threads` workers."""
    shares = np.array_split(np.arange(num_envs), min(num_threads, num_envs))
    first_reset = [dict(seed=seed + int(share[0])) for share in shares]
    context = multiprocessing.get_context("fork")  # (this process has one thread)
    workers = []
    connections = []
    for index, share in enumerate(shares):
        cpu = thread_affinity_offset + index if thread_affinity_offset >= 0 else -1
        ours, theirs = context.Pipe()
        inherited = [training, *connections, ours]
        workers.append(context.Process(target=worker, args=(env_id, len(share), cpu, theirs, options, inherited)))
        workers[-1].start()
        atexit.register(workers[-1].kill)  # however this process ends, even one stuck in its environment
        theirs.close()  # the worker's end now: its death ends the pipe
        connections.append(ours)

    def gather() -> list:  # each worker's answer, in order
        try:
            return [connection.recv() for connection in connections]
        except (EOFError, ConnectionError):  # killed, or its environment crashed the interpreter
            return [ChildProcessError(f"--env-id {env_id}: a worker process of its environments died")]

    training.send(combined("start", gather()))
    with contextlib.suppress(EOFError, ConnectionError):  # the training process closed the socket, or ended
        while True:
            method, actions = training.recv()
            calls = [{}] * len(shares)  # (render's)
            if method == "reset":
                calls = first_reset
                first_reset = [{}] * len(shares)  # a later reset goes on with each env's random numbers
            if method == "step":
                calls = [dict(actions=actions[share]) for share in shares]
            for connection, kwargs in zip(connections, calls, strict=True):
                connection.send((method, kwargs))
            training.send(combined(method, gather()))


if __name__ == "__main__":
    for signum in (signal.SIGINT, signal.SIGTERM):  # the training process's to handle: it then ends this one
        signal.signal(signum, signal.SIG_IGN)
    if os.getcwd() not in sys.path:  # a module:Env-v0 id's module, as the scripts import it
        sys.path.append(os.getcwd())
    serve(multiprocessing.connection.Connection(int(sys.argv[1])), **json.loads(sys.argv[2]))
