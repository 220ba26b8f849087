"""cleanba/compare_runs.py on run directories written here (config.json as the scripts write it, updates.jsonl), in
seconds: it compares layouts of one configuration, and refuses two configurations in one line (exit status 2)
unless told to compare them anyway."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from helpers import ALGOS, REPO, load_script

RECORDS = [dict(update=u, fingerprint=7 * u, losses=dict(loss=1.0 / u, value_loss=2.0 / u)) for u in (1, 2, 3)]


def make_run(path, algo="ppo", records=RECORDS, layout=None, **flags) -> str:
    args = {**load_script(algo).DEFAULTS, "env_id": "CartPole-v1", **flags}
    num_envs = args["local_num_envs"] * args["num_actor_threads"] * len(args["actor_device_ids"])
    layout = {
        "notation": "a0-l0-d1",
        "actor_threads_per_device": args["num_actor_threads"],
        "processes": 1,
        **(layout or {}),
    }
    config = dict(args=args, layout=dict(platform="cpu", num_envs=num_envs, **layout), script=f"cleanba_{algo}.py")
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(path, "updates.jsonl"), "w") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)
    return str(path)


def compare_runs(*args) -> subprocess.CompletedProcess:
    command = [sys.executable, os.path.join(REPO, "cleanba", "compare_runs.py"), *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_two_configurations_are_refused_in_one_line(tmp_path):
    """300k steps on 8 envs against 32k steps on 128: not two layouts of one run. One line naming the flags that
    differ, exit status 2, nothing compared."""
    a = make_run(tmp_path / "a", total_timesteps=300_000, local_num_envs=4, num_actor_threads=2)
    b = make_run(tmp_path / "b", total_timesteps=32_000, local_num_envs=64, num_actor_threads=2)
    result = compare_runs(a, b)
    assert result.returncode == 2 and result.stdout == "" and result.stderr.count("\n") == 1, result
    assert "total_timesteps 300000 vs 32000, num_envs 8 vs 128" in result.stderr
    assert "--different-configs" in result.stderr


def test_another_script_or_seed_is_another_configuration(tmp_path):
    ppo, pqn = make_run(tmp_path / "ppo"), make_run(tmp_path / "pqn", algo="pqn")
    result = compare_runs(ppo, pqn)
    assert result.returncode == 2 and "script cleanba_ppo.py vs cleanba_pqn.py" in result.stderr, result.stderr
    result = compare_runs(ppo, make_run(tmp_path / "seed2", seed=2))
    assert result.returncode == 2 and "seed 1 vs 2" in result.stderr, result.stderr


def test_different_configs_compares_them_anyway_and_says_so(tmp_path):
    """--different-configs: the comparison of two settings (the Cleanba architecture against the synchronous one),
    headed by the flags that differ."""
    a = make_run(tmp_path / "cleanba", concurrency=True)
    b = make_run(tmp_path / "sync", concurrency=False, records=[{**r, "fingerprint": 1} for r in RECORDS])
    result = compare_runs(a, b, "--different-configs")
    assert result.returncode == 1, result.stderr
    assert "different configurations: concurrency True vs False" in result.stdout
    assert "first differ at update 1" in result.stdout


def test_another_layout_of_one_configuration_is_compared(tmp_path):
    """What it is for: the global env count split otherwise, other devices, another exp name and run name, other
    logging: one configuration, compared, SAME."""
    a = make_run(tmp_path / "a", local_num_envs=8, num_actor_threads=1, exp_name="one_thread")
    layout = dict(notation="a0-l1,2-d1")
    b = make_run(tmp_path / "b", layout=layout, local_num_envs=4, learner_device_ids=[1, 2], run_name="b", track=True)
    result = compare_runs(a, b)
    assert result.returncode == 0 and "SAME" in result.stdout and "different" not in result.stdout, result


@pytest.mark.parametrize("algo", ALGOS)
def test_the_algorithm_flags_are_the_scripts(algo):
    """compare_runs.py reads each script's Algorithm fields and their defaults from its source (no JAX): the same as
    the script's algorithm_config takes (exp_name's default aside: the script's name), and a config.json at the
    defaults gives them back, with the global env count."""
    from compare_runs import NO_DEFAULT, algorithm_config, script_fields

    script = load_script(algo)
    fields = dataclasses.fields(script.Args)
    algorithm = {f.name: script.DEFAULTS[f.name] for f in fields if "algorithm" in f.type.__metadata__}
    found, runtime = script_fields(f"cleanba_{algo}.py")
    found = dict(found)  # a copy: script_fields caches its answer
    assert list(found) == list(algorithm) and found.pop("exp_name") is NO_DEFAULT
    assert found == {name: value for name, value in algorithm.items() if name != "exp_name"}
    assert runtime == {f.name for f in fields if "runtime" in f.type.__metadata__}
    config = dict(args=script.DEFAULTS, layout=dict(num_envs=128), script=f"cleanba_{algo}.py")
    assert algorithm_config(config) == {"script": f"cleanba_{algo}.py", **algorithm, "num_envs": 128}
