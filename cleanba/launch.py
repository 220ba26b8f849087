"""Runs a grid of experiments (env ids x seeds) on this machine or on a SLURM cluster.

    # on this machine: at most 2 at a time, each with its own CPUs (and GPU, given --device-ids)
    .venv/bin/python cleanba/launch.py --env-ids CartPole-v1 Acrobot-v1 --seeds 1 2 3 --workers 2 -- \\
        .venv/bin/python cleanba/cleanba_ppo.py --total-timesteps 100000

    # on SLURM: renders cleanba.slurm_template into an array job and submits it (--dry-run prints it)
    .venv/bin/python cleanba/launch.py --slurm --env-ids Breakout-v5 Pong-v5 --seeds 1 2 3 --gpus-per-task 1 \\
        --cpus-per-task 10 -- .venv/bin/python cleanba/cleanba_impala.py

Each experiment runs the command after `--` with `--env-id ENV --seed SEED` appended. Locally, the
experiments share the machine in `--workers` slots: a slot owns a fixed share of the CPU cores (and of
`--device-ids`, exported as CUDA_VISIBLE_DEVICES; with more workers than GPUs, several share one GPU, each with
its share of its memory), the next experiment starts when one finishes, and failed experiments are listed at
the end (exit status 1); a stop signal (SIGTERM, Ctrl-C) is passed on to the experiments running, which checkpoint
and exit, and starts no more (exit status 128 + the signal). On SLURM, `--wait` waits for the array job
and does the same from the tasks' status files. A tool: the training scripts never import it.
"""

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATE = os.path.join(REPO, "cleanba.slurm_template")


def parse_args(argv):
    """The grid's flags and the command after `--`; exits 2 on bad input (--help: 0, with the usage)."""
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env-ids", nargs="+", required=True, help="environment ids of the grid")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1], help="seeds of the grid")
    parser.add_argument("--log-dir", default="launch_logs", help="where each experiment's output goes (one per grid)")
    local = parser.add_argument_group("this machine")
    local.add_argument("--workers", type=int, default=1, help="experiments running at once")
    local.add_argument(
        "--device-ids",
        nargs="*",
        default=[],
        help="GPU ids to share out: a slice per worker, or with more workers than GPUs, a GPU shared "
        "by several (each then gets its share of the GPU's memory)",
    )
    slurm = parser.add_argument_group("SLURM (--slurm)")
    slurm.add_argument("--slurm", action="store_true", help="submit an sbatch array job instead of running here")
    slurm.add_argument("--dry-run", action="store_true", help="print the rendered sbatch script, submit nothing")
    slurm.add_argument("--wait", action="store_true", help="wait for the job; report failed experiments")
    slurm.add_argument("--job-name", default="cleanba")
    slurm.add_argument("--nodes", type=int, default=1, help="nodes per experiment")
    slurm.add_argument("--ntasks-per-node", type=int, default=1, help="processes per node (use --distributed if > 1)")
    slurm.add_argument("--cpus-per-task", type=int, default=1)
    slurm.add_argument("--gpus-per-task", type=int, default=0)
    slurm.add_argument("--max-parallel", type=int, default=100, help="array tasks running at once")
    slurm.add_argument("--partition", default=None)
    slurm.add_argument("--time", default=None, help="time limit, e.g. 24:00:00")
    if "--" not in argv and not {"-h", "--help"} & set(argv):  # --help: argparse prints the usage, exits 0
        print("error: give the training command after `--` (e.g. -- python cleanba/cleanba_ppo.py)", file=sys.stderr)
        sys.exit(2)
    args = parser.parse_args(argv[:split])
    args.command = argv[split + 1 :]
    problems = []
    if not args.command:
        problems.append("the command after `--` is empty")
    for name in ["workers", "nodes", "ntasks_per_node", "cpus_per_task", "max_parallel"]:
        if getattr(args, name) <= 0:
            problems.append(f"--{name.replace('_', '-')} must be positive")
    if args.gpus_per_task < 0:
        problems.append("--gpus-per-task must be >= 0")
    for name in ["env_ids", "seeds", "device_ids"]:
        if len(set(getattr(args, name))) != len(getattr(args, name)):
            problems.append(f"--{name.replace('_', '-')} names one twice: {' '.join(map(str, getattr(args, name)))}")
    if not all(i.isdigit() or i.startswith(("GPU-", "MIG-")) for i in args.device_ids):  # as CUDA_VISIBLE_DEVICES
        problems.append(f"--device-ids takes GPU indices or UUIDs, got {' '.join(args.device_ids)}")
    if not args.job_name or "/" in args.job_name:
        problems.append(f"--job-name {args.job_name!r} must be a plain name: it names the job's files")
    if args.slurm and args.nodes * args.ntasks_per_node > 1 and "--distributed" not in args.command:
        problems.append(
            "--nodes x --ntasks-per-node > 1 runs one process per task: the command needs --distributed, "
            "or the tasks would be independent copies of the same run"
        )
    if problems:
        print(f"error: {problems[0]}", file=sys.stderr)
        sys.exit(2)
    return args


def experiments(args) -> list[tuple[str, int]]:
    return [(env_id, seed) for env_id in args.env_ids for seed in args.seeds]


def run_locally(args) -> list[tuple[str, int, int, str]]:
    """Runs every experiment in one of `workers` slots; returns (env id, seed, exit status, log) of each."""
    os.makedirs(args.log_dir, exist_ok=True)
    cores, gpus = sorted(os.sched_getaffinity(0)), args.device_ids
    slots = []
    for i in range(args.workers):
        slot_cores = cores[i :: args.workers] or cores  # more workers than cores: they share
        if len(gpus) >= args.workers:
            slot_gpus = gpus[i :: args.workers]
        else:  # more workers than GPUs: they share them round-robin, one GPU each
            slot_gpus = [gpus[i % len(gpus)]] if gpus else []
        slots.append((set(slot_cores), slot_gpus))
    pending, running, results = list(experiments(args)), {}, []
    stopped_by = []  # a stop signal to the launcher: passed on to the running experiments, none started after it
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda signum, frame: stopped_by.append(signum))
    while (pending or running) and not stopped_by:
        for slot, (slot_cores, devices) in enumerate(slots):
            if slot in running or not pending or stopped_by:
                continue
            env_id, seed = pending.pop(0)
            log_path = os.path.join(args.log_dir, f"{env_id}__{seed}.log")
            env = dict(os.environ)
            if devices:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
            sharing = sum(other == devices for _, other in slots) if devices else 1
            if sharing > 1:
                # JAX reserves 75% of a GPU's memory at start-up: experiments sharing a GPU each reserve their share
                # of 90% instead (the rest for CUDA's own allocations). A fraction the user set is kept.
                env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{int(90 / sharing) / 100:.2f}")
            command = [*args.command, "--env-id", env_id, "--seed", str(seed)]
            with open(log_path, "w") as log:
                proc = subprocess.Popen(
                    command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    preexec_fn=lambda cores=slot_cores: os.sched_setaffinity(0, cores),
                )
            running[slot] = (proc, env_id, seed, log_path)
            print(f"[slot {slot}] started {env_id} seed {seed}: {shlex.join(command)}", flush=True)
        for slot, (proc, env_id, seed, log_path) in list(running.items()):
            if proc.poll() is not None:
                del running[slot]
                results.append((env_id, seed, proc.returncode, log_path))
                print(f"[slot {slot}] {env_id} seed {seed} exited {proc.returncode}", flush=True)
        time.sleep(0.2)
    if stopped_by:  # each experiment checkpoints after its update and exits; the same grid command resumes them
        for proc, *_ in running.values():
            proc.send_signal(stopped_by[0])
        while any(proc.poll() is None for proc, *_ in running.values()):
            if len(stopped_by) > 1:  # a second signal: no waiting for the updates in progress
                for proc, *_ in running.values():
                    proc.kill()
            time.sleep(0.2)
        if results:  # those that ended before the signal
            report(results)
        name = signal.Signals(stopped_by[0]).name
        print(f"stopped by {name}: {len(running)} experiments stopped, {len(pending)} not started", flush=True)
        sys.exit(128 + stopped_by[0])
    return results


def report(results: list[tuple[str, int, int, str]]) -> bool:
    """Prints how many experiments succeeded, and each one that failed; whether any did."""
    failed = [r for r in results if r[2] != 0]
    print(f"{len(results) - len(failed)} of {len(results)} experiments succeeded", flush=True)
    for env_id, seed, status, log_path in failed:
        print(f"FAILED {env_id} seed {seed}: exit status {status}, see {log_path}", flush=True)
    return bool(failed)


def render(args) -> str:
    with open(TEMPLATE) as f:
        script = f.read()
    directives = [
        f"#SBATCH --gpus-per-task={args.gpus_per_task}" if args.gpus_per_task else "",
        f"#SBATCH --partition={args.partition}" if args.partition else "",
        f"#SBATCH --time={args.time}" if args.time else "",
    ]
    values = dict(
        job_name=args.job_name,
        last_task=len(experiments(args)) - 1,
        max_parallel=args.max_parallel,
        nodes=args.nodes,
        ntasks_per_node=args.ntasks_per_node,
        cpus_per_task=args.cpus_per_task,
        srun_gpus=f" --gpus-per-task={args.gpus_per_task}" if args.gpus_per_task else "",
        log_dir=os.path.abspath(args.log_dir),
        extra_directives="\n".join(d for d in directives if d),
        env_ids=" ".join(map(shlex.quote, args.env_ids)),
        seeds=" ".join(map(str, args.seeds)),
        workdir=shlex.quote(os.getcwd()),
        command=shlex.join(args.command),
    )
    for name, value in values.items():
        script = script.replace("{{" + name + "}}", str(value))
    return script


def submit(args) -> list[tuple[str, int, int, str]] | None:
    script = render(args)
    if args.dry_run:
        print(script)
        return None
    os.makedirs(args.log_dir, exist_ok=True)
    script_path = os.path.join(args.log_dir, f"{args.job_name}.sbatch")
    with open(script_path, "w") as f:
        f.write(script)
    result = subprocess.run(["sbatch", "--parsable", script_path], capture_output=True, text=True)
    job_id = result.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        print(f"error: sbatch failed: {result.stderr.strip()}", file=sys.stderr)
        sys.exit(1)
    print(f"submitted array job {job_id} ({len(experiments(args))} experiments), script {script_path}", flush=True)
    if not args.wait:
        return None
    # Until every task is in a final state (sbatch --wait polls at 2, 8, then 32-second intervals, which returned up to
    # half a minute after short jobs). All states: squeue's default leaves out a task being requeued (REQUEUED), which
    # is not over. A failed query (slurmctld busy) is asked again; a job gone from the queue is over.
    query = ["squeue", "--noheader", "--jobs", job_id, "--states", "all", "--format", "%T"]
    while (queue := subprocess.run(query, capture_output=True, text=True)).returncode or set(queue.stdout.split()) - {
        *"COMPLETED FAILED CANCELLED TIMEOUT NODE_FAIL OUT_OF_MEMORY BOOT_FAIL DEADLINE".split()
    }:
        time.sleep(1)
    results = []
    for task, (env_id, seed) in enumerate(experiments(args)):
        prefix = os.path.join(args.log_dir, f"{args.job_name}_{job_id}_{task}")
        status = -1  # no status file: the task never ran to its end (cancelled, node failure, time limit)
        if os.path.exists(f"{prefix}.status"):
            with open(f"{prefix}.status") as f:
                status = int(f.read().split()[-1])
        results.append((env_id, seed, status, f"{prefix}.out"))
    return results


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    results = submit(args) if args.slurm else run_locally(args)
    if results is None:
        return
    sys.exit(1 if report(results) else 0)


if __name__ == "__main__":
    main()
