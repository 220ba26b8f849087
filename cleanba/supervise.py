"""Runs one process of a --distributed training run and turns the loss of another process into one line.

    python cleanba/supervise.py COMMAND...     (the scripts run themselves so with --distributed: see the top of each)

When another process of the run dies or stops answering, JAX stops this one: with gloo's error in a Python traceback
(a collective's connection broke) or, from its coordination service, with a C++ abort and stack trace (the coordinator
is gone, or a process missed its heartbeats for --heartbeat-timeout seconds). What the user needs at that point is
which process was lost, how far the run got and where it resumes from; this prints that as one line on stderr and
exits with status 75 (EX_TEMPFAIL: not this process's failure; the same command resumes from the checkpoint).
CLEANBA_VERBOSE=1 prints JAX's own messages before it. Everything else the command prints passes through unchanged,
and its exit status is this one's. SIGTERM and SIGINT are passed on to it (SLURM's preemption, Ctrl-C).

The command tells this process how far it got on stderr, in lines `cleanba-progress <json>` (RunDir.report): its rank,
every process's host and the run's directory once, then after each update the update and the last checkpoint's. The
line names the last checkpoint this process knows to be written: on a process other than 0, a checkpoint of the update
at which process 0 was lost may be newer (the resume takes the newest that is whole).
"""

import json
import os
import re
import signal
import subprocess
import sys

LOST_PROCESS = 75  # EX_TEMPFAIL (sysexits.h): a temporary failure, the same command may succeed
# JAX's messages when another process of the run is lost: gloo's, or its coordination service's.
LOST = re.compile(r"Gloo|(coordination|distributed) service")


def lost_process_line(run: dict, error: str) -> str:
    """The line for the loss that `error` (JAX's messages) reports, in a run that got as far as `run` says."""
    # The coordination service names a process that missed its heartbeats; the coordinator's loss is that of process 0;
    # gloo names an address, not a process: then any of the others.
    named = re.search(r"/task:(\d+)", error)
    others = [rank for rank in range(len(run["hosts"])) if rank != run["rank"]]
    lost = [int(named.group(1))] if named else [0] if "leader task" in error and run["rank"] else others
    who = " or ".join(f"{rank} (host {run['hosts'][rank]})" for rank in lost)
    checkpoint = f"the last checkpoint ({run['path']}/checkpoint.msgpack) is after update {run['written']}"
    resume = "run the same command, or requeue the SLURM job, to resume from it (CLEANBA_VERBOSE=1: JAX's error)"
    return f"error: lost process {who} after update {run['update']}; {checkpoint}: {resume}"


def supervise(command: list[str]) -> int:
    # PYTHONFAULTHANDLER: a crash of the interpreter (a segmentation fault) prints where each thread was.
    environment = dict(os.environ, CLEANBA_SUPERVISED="1", PYTHONFAULTHANDLER="1")
    child = subprocess.Popen(command, env=environment, stderr=subprocess.PIPE, text=True)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda signum, frame: child.send_signal(signum))
    run, held = {}, []  # what the command reported; its stderr from the first line of a failure on
    for line in child.stderr:
        if line.startswith("cleanba-progress "):
            progress = json.loads(line.split(" ", 1)[1])
            run.update(progress)
            # Process 0 writes the checkpoints. Another process knows one written once an update after it is done (the
            # processes take part in each update together), or when it resumed from it.
            if run["rank"] == 0 or progress["checkpoint"] < progress["update"] or "hosts" in progress:
                run["written"] = progress["checkpoint"]
        elif held or line.startswith("error in thread") or re.match(r"[EFW]\d{4} ", line):  # C++ logs: F1123 ...
            held.append(line)
        else:
            sys.stderr.write(line)
    code, error = child.wait(), "".join(held)
    if "update" not in run or not LOST.search(error):  # not a lost process, or before the run started: as it was
        sys.stderr.write(error)
        return code if code >= 0 else 128 - code
    if os.environ.get("CLEANBA_VERBOSE"):
        sys.stderr.write(error)
    print(lost_process_line(run, error), file=sys.stderr)
    return LOST_PROCESS


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print("usage: python cleanba/supervise.py COMMAND...", file=sys.stderr)
        sys.exit(2)
    sys.exit(supervise(sys.argv[1:]))
