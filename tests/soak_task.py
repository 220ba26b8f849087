"""What each task of the chaos soak's SLURM job runs (tests/soak.py --slurm): the training command, with the fault the
soak chose for this attempt on process 0, its output and exit status kept per attempt and rank for the soak's checks.

    srun ... python tests/soak_task.py <soak's attempts dir> python cleanba/cleanba_ppo.py [flags] --distributed

A requeued job keeps the environment it was submitted with, so each attempt's fault is read from attempt.json, which
the soak writes before it lets the attempt start: {"name": ..., "rank_0_fault": tests/with_fault.py's fault or null,
"file_limit": bytes or null}. Writes <name>.rank<R>.{out,err} as the command prints them (through pipes: a file-size
limit applies to the command's checkpoints, not to these) and <name>.rank<R>.status, the command's return code as
Popen gives it (-N for a signal N); exits as the command did (128 + N for a signal), as srun and the template see it.
The command's processes carry CLEANBA_SOAK_ATTEMPT=<attempts dir>/<name>, by which the soak finds them.
"""

import json
import os
import signal
import subprocess
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))


def with_file_size_limit(command: list[str], limit: int) -> list[str]:
    """The command under util-linux's prlimit: no file it writes may grow beyond `limit` bytes (EFBIG, errno 27, as
    Python ignores SIGXFSZ). Not a preexec_fn, which runs JAX's fork hook (and its warning) in a parent that has it."""
    return ["prlimit", f"--fsize={limit}", *command]


def copy_lines(stream, path: str):  # line by line, flushed: the soak reads the file while the command runs
    with open(path, "w") as f:
        for line in stream:
            f.write(line)
            f.flush()


def main():
    attempts, command = os.path.abspath(sys.argv[1]), sys.argv[2:]
    rank = int(os.environ["SLURM_PROCID"])
    with open(os.path.join(attempts, "attempt.json")) as f:
        attempt = json.load(f)
    prefix = os.path.join(attempts, f"{attempt['name']}.rank{rank}")
    env = dict(os.environ, PYTHONUNBUFFERED="1", CLEANBA_SOAK_ATTEMPT=prefix[: -len(f".rank{rank}")])
    env.pop("CLEANBA_FAULT", None)
    if rank == 0 and attempt["rank_0_fault"]:  # with_fault.py runs the script's main() itself (no supervisor)
        command.insert(1, os.path.join(HERE, "with_fault.py"))
        env["CLEANBA_FAULT"] = attempt["rank_0_fault"]
    if rank == 0 and attempt["file_limit"]:
        command = with_file_size_limit(command, attempt["file_limit"])
    started = []  # the command, once started: SIGTERM and SIGINT are passed on to it, as the supervisor does

    def pass_on(signum, frame):
        for child in started:
            child.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, pass_on)
    child = subprocess.Popen(
        command,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    started.append(child)
    copies = [
        threading.Thread(target=copy_lines, args=(child.stdout, f"{prefix}.out")),
        threading.Thread(target=copy_lines, args=(child.stderr, f"{prefix}.err")),
    ]
    for copy in copies:
        copy.start()
    return_code = child.wait()
    for copy in copies:
        copy.join()
    with open(f"{prefix}.status.tmp", "w") as f:
        f.write(str(return_code))
    os.replace(f"{prefix}.status.tmp", f"{prefix}.status")
    sys.exit(128 - return_code if return_code < 0 else return_code)


if __name__ == "__main__":
    main()
