"""What each task of the chaos soak's SLURM job runs (tests/soak.py --slurm): the training command, with the fault the
soak chose for this attempt on process 0, its output and exit status kept per attempt and rank for the soak's checks.

    srun ... python tests/soak_task.py <soak's attempts dir> python cleanba/cleanba_ppo.py [flags] --distributed

A requeued job keeps the environment it was submitted with, so each attempt's fault is read from attempt.json, which
the soak writes before it lets the attempt start: {"name": ..., "rank_0_fault": tests/with_fault.py's fault or null,
"file_limit": bytes or null}. Writes <name>.rank<R>.{pid,out,err,status}; exits with the command's status (128 + N
for a signal N), as srun and the sbatch template would see the command's own.
"""

import json
import os
import resource
import signal
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    attempts, command = sys.argv[1], sys.argv[2:]
    rank = int(os.environ["SLURM_PROCID"])
    with open(os.path.join(attempts, "attempt.json")) as f:
        attempt = json.load(f)
    prefix = os.path.join(attempts, f"{attempt['name']}.rank{rank}")
    env = dict(os.environ, PYTHONUNBUFFERED="1", CLEANBA_SOAK_ATTEMPT=attempt["name"])
    limit = None
    if rank == 0 and attempt["rank_0_fault"]:  # with_fault.py runs the script's main() itself (no supervisor)
        command.insert(1, os.path.join(HERE, "with_fault.py"))
        env["CLEANBA_FAULT"] = attempt["rank_0_fault"]
    if rank == 0 and attempt["file_limit"]:
        limit = attempt["file_limit"]
    with open(f"{prefix}.pid", "w") as f:
        f.write(str(os.getpid()))
    with open(f"{prefix}.out", "w") as out, open(f"{prefix}.err", "w") as err:
        child = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            preexec_fn=(lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))) if limit else None,
        )
        for signum in (signal.SIGTERM, signal.SIGINT):  # passed on, as the supervisor does (SLURM may signal all)
            signal.signal(signum, lambda signum, frame: child.send_signal(signum))
        code = child.wait()
    status = 128 - code if code < 0 else code
    with open(f"{prefix}.status.tmp", "w") as f:
        f.write(str(code))
    os.replace(f"{prefix}.status.tmp", f"{prefix}.status")
    sys.exit(status)


if __name__ == "__main__":
    main()
