"""A real one-node SLURM cluster on localhost for tests: Debian's slurm-wlm and munge, daemons started by
hand (no systemd), state in a temporary directory. Needs root and `apt-get install slurm-wlm munge`
(setup.sh does it where it can)."""

import contextlib
import fcntl
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time

SLURM_CONF = """\
ClusterName=cleanba-test
SlurmctldHost={host}
SlurmUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
FirstJobId={first_job_id}
# Declare more CPUs than the machine has so that a 2-task job and an array fit at once.
SlurmdParameters=config_overrides
NodeName={host} CPUs={cpus} RealMemory=4000 State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def missing_tools() -> list[str]:
    return [
        tool
        for tool in ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "sinfo", "scontrol", "scancel")
        if shutil.which(tool) is None
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def munge_answers() -> bool:
    return subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0


def wait_until(condition, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return
        time.sleep(0.5)
    raise TimeoutError(f"SLURM test cluster: {what} after {timeout}s")


@contextlib.contextmanager
def slurm_cluster(root: str, cpus: int = 4):
    """Starts munged, slurmctld and slurmd; yields the environment (SLURM_CONF) for client commands."""
    root = os.path.abspath(root)
    for sub in ("state", "spool"):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    host = socket.gethostname()
    conf = os.path.join(root, "slurm.conf")
    env = dict(os.environ, SLURM_CONF=conf)

    # munged in its usual place (/run/munge): slurm's auth/munge plugin finds it there. One that is
    # already running (an earlier cluster on this machine) is reused. Test workers that set up their clusters
    # at the same moment take turns: a second munged started beside the first refuses the socket and exits 1.
    with open(os.path.join(tempfile.gettempdir(), "cleanba-test-munged.lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # Each cluster's job ids start 64 after the last one's (modulo 4096): jax.distributed derives a job's
        # coordinator port from its id (id % 4096 + 61440), so clusters running at once must not reuse ids.
        lock.seek(0)
        clusters = len(lock.read())
        lock.write("x")
        lock.flush()
        settings = dict(ctld_port=free_port(), d_port=free_port(), first_job_id=1 + 64 * (clusters % 64))
        with open(conf, "w") as f:
            f.write(SLURM_CONF.format(host=host, root=root, cpus=cpus, **settings))
        if not munge_answers():
            munge = pwd.getpwnam("munge")
            os.makedirs("/run/munge", exist_ok=True)
            os.chown("/run/munge", munge.pw_uid, munge.pw_gid)
            subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True)
            wait_until(munge_answers, 30, "munged not answering")
    daemons = []
    try:
        for daemon in ("slurmctld", "slurmd"):
            daemons.append(
                subprocess.Popen(
                    [daemon, "-D", "-f", conf], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            )
        wait_until(
            lambda: (
                "idle" in subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout
            ),
            60,
            "node not idle",
        )
        yield env
    finally:
        subprocess.run(["scontrol", "shutdown"], env=env, capture_output=True, timeout=30)
        for daemon in daemons:
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
