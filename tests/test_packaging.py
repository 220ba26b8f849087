"""The install path (DESIGN.md §10): one lock for CPU and GPU machines and Pythons 3.11 to 3.14, whose CUDA
builds of JAX are the same version as its jaxlib, and setup.sh's choice of the build from the NVIDIA driver."""

import os
import subprocess
import tomllib

import pytest
from helpers import REPO

with open(os.path.join(REPO, "poetry.lock"), "rb") as f:
    LOCK = tomllib.load(f)


def locked(name: str) -> list[str]:
    return [package["version"] for package in LOCK["package"] if package["name"] == name]


def test_the_cuda_builds_are_jaxlibs_version():
    """A CUDA plugin or PJRT package of another version than jaxlib's makes JAX fall back to the CPU (Stoix's issue
    #159): every one in the lock must be jaxlib's, and the extras must ask for them."""
    assert len(jaxlib := locked("jaxlib")) == 1 and locked("jax") == jaxlib
    for cuda in ("12", "13"):
        for part in ("plugin", "pjrt"):
            assert locked(f"jax-cuda{cuda}-{part}") == jaxlib, f"jax-cuda{cuda}-{part}"
        assert LOCK["extras"][f"cuda{cuda}"] == ["jax"]
    jax = next(package for package in LOCK["package"] if package["name"] == "jax")
    assert jax["dependencies"]["jax-cuda12-plugin"]["markers"] == 'extra == "cuda12"'
    assert LOCK["metadata"]["python-versions"] == ">=3.11,<3.15"


def fake_nvidia_smi(directory, driver: str):
    """An `nvidia-smi` that reports one GPU with the given driver version."""
    path = os.path.join(directory, "nvidia-smi")
    with open(path, "w") as f:
        f.write(
            f'#!/bin/sh\ncase "$*" in *query-gpu*) echo {driver} ;; *) echo "GPU 0: NVIDIA H100 80GB HBM3" ;; esac\n'
        )
    os.chmod(path, 0o755)


@pytest.mark.parametrize(
    "driver, override, build",
    [
        (None, None, "CPU build"),
        ("575.57.08", None, "CUDA 12 build"),
        ("580.65.06", None, "CUDA 13 build"),
        ("470.256.02", None, "CPU build"),
        ("580.65.06", "12", "CUDA 12 build"),
        ("580.65.06", "none", "CPU build"),
    ],
)
def test_setup_picks_jaxs_build_from_the_driver(tmp_path, driver, override, build):
    if driver:
        fake_nvidia_smi(tmp_path, driver)
    env = {k: v for k, v in os.environ.items() if k != "CLEANBA_CUDA"}
    env["PATH"] = f"{tmp_path}:{env['PATH']}"
    if override:
        env["CLEANBA_CUDA"] = override
    result = subprocess.run(["bash", "setup.sh", "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert f"JAX's {build} (NVIDIA driver: {driver or 'none'};" in result.stdout
    bad = subprocess.run(
        ["bash", "setup.sh", "--dry-run"], cwd=REPO, env=dict(env, CLEANBA_CUDA="11"), text=True, capture_output=True
    )
    assert bad.returncode == 2 and "CLEANBA_CUDA must be 12, 13 or none" in bad.stderr
