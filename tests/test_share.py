"""Sharing an agent (--upload-model, cleanba/share.py) and playing a shared one (cleanba/evaluate.py), without a
network: the Hub's client runs offline (HF_HUB_OFFLINE), with a token that is never sent, so the upload fails as it
would without a network, and everything up to it is checked."""

import json
import os
import re

import huggingface_hub
import pytest
from helpers import only_run, run, script_env
from test_training import printed_returns, run_evaluate

# The original Cleanba's benchmark command (--actor-device-ids 0 --learner-device-ids 1 ... --track --save-model
# --upload-model --hf-entity cleanrl --env-id <game> --seed 1), with this project's script, on CartPole at a small size.
ORIGINAL = "--actor-device-ids 0 --learner-device-ids 1 --track --save-model --upload-model --hf-entity cleanrl"
ORIGINAL = [*ORIGINAL.split(), "--env-id", "CartPole-v1", "--seed", 1]
SMALL = ["--local-num-envs", 4, "--num-steps", 32, "--total-timesteps", 10 * 256]
SHARED_FILES = {"README.md", "cleanba_ppo.cleanba_model", "cleanba_ppo.py", "config.json", "poetry.lock"}
SHARED_FILES |= {"pyproject.toml", "replay.mp4", "updates.jsonl"}


def offline(tmp_path, token: str | None = "hf_not_a_real_token") -> dict:
    """The Hub's client offline, its own files under tmp_path (no token of the machine's), W&B offline."""
    env = dict(script_env(num_devices=2), HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), WANDB_MODE="offline")
    env.pop("HF_TOKEN", None)
    return {**env, "HF_TOKEN": token} if token else env


def test_the_original_cleanbas_command_shares_a_finished_run(tmp_path):
    """The run finishes and saves its model; the folder holds the model, its card, the script, the package versions,
    the logs and a replay; the card's metadata is the Hub's (ModelCard) and names the environment, the algorithm and
    the evaluation's result; the upload fails in one line, exit 69, naming the command that uploads the folder later;
    evaluate.py plays the folder as it plays the run directory."""
    result = run(tmp_path, *ORIGINAL, *SMALL, env=offline(tmp_path))
    assert result.returncode == 69, result.stdout[-2000:] + result.stderr[-3000:]
    run_dir = only_run(tmp_path)
    folder = os.path.join(run_dir, "hub")
    with open(os.path.join(run_dir, "updates.jsonl")) as f:
        assert [json.loads(line)["update"] for line in f] == list(range(1, 11))  # finished
    repo_id = "cleanrl/CartPole-v1-cleanba_ppo-seed1"
    assert re.search(
        f"^share.py: uploading {re.escape(folder[len(str(tmp_path)) + 1 :])} .* {repo_id}$", result.stdout, re.M
    )
    [error] = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert error.endswith(f"upload it later with: .venv/bin/hf upload {repo_id} {folder[len(str(tmp_path)) + 1 :]} .")
    assert "Traceback" not in result.stderr
    files = set(os.listdir(folder))
    assert SHARED_FILES <= files and any(name.startswith("events.out.tfevents") for name in files), files

    card = huggingface_hub.ModelCard.load(os.path.join(folder, "README.md"))
    assert card.data.library_name == "cleanba" and {"reinforcement-learning", "PPO", "CartPole-v1"} <= set(
        card.data.tags
    )
    [evaluation] = card.data.eval_results
    assert evaluation.task_type == "reinforcement-learning" and evaluation.dataset_name == "CartPole-v1"
    assert "--upload-model --hf-entity cleanrl" in card.text and "cleanba/cleanba_ppo.py" in card.text

    played = [run_evaluate(path, "--episodes", 3, cwd=tmp_path) for path in (run_dir, folder)]
    assert all(result.returncode == 0 for result in played), played[1].stderr
    assert printed_returns(played[0].stdout) == printed_returns(played[1].stdout)  # the same agent, the same episodes
    mean, std = map(float, evaluation.metric_value.split(" +/- "))
    assert 9 <= mean <= 500 and std >= 0

    again = run(tmp_path, *ORIGINAL, *SMALL, env=offline(tmp_path))  # a finished run's command shares it again
    assert again.returncode == 69 and "already finished" in again.stdout and "share.py: uploading" in again.stdout

    with open(os.path.join(folder, "cleanba_ppo.py"), "a") as f:  # the folder of another version of the script
        f.write("# changed\n")
    refused = run_evaluate(folder, cwd=tmp_path)
    assert refused.returncode == 2 and "trained by another version of cleanba/cleanba_ppo.py" in refused.stderr


@pytest.mark.parametrize(
    "flags, token, refusal",
    [
        (["--hf-repo-name", "my agent"], "hf_not_a_real_token", "which the Hub refuses"),
        (["--hf-entity", "cleanrl"], None, "no Hugging Face token found"),
    ],
)
def test_upload_model_is_refused_before_the_run_starts(tmp_path, flags, token, refusal):
    """A repository name the Hub would refuse, or no token: one line naming --upload-model, exit 2, nothing made."""
    result = run(tmp_path, "--env-id", "CartPole-v1", "--upload-model", *flags, env=offline(tmp_path, token))
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: --upload-model: ") and refusal in result.stderr
    assert not os.path.exists(tmp_path / "runs")


def test_a_shared_agent_the_hub_does_not_give_is_one_line(tmp_path):
    """A Hub id evaluate.py cannot download (offline here): one line and exit 69, never a traceback; a mistyped run
    directory is not taken for a Hub id."""
    result = run_evaluate("cleanrl/CartPole-v1-cleanba_ppo-seed1", cwd=tmp_path, env=offline(tmp_path))
    assert result.returncode == 69 and result.stderr.count("\n") == 1, result.stderr
    assert "the Hub did not give it" in result.stderr
    mistyped = run_evaluate("runs/CartPole-v1__typo", cwd=tmp_path, env=offline(tmp_path))  # a path, not a Hub id
    assert mistyped.returncode == 2 and "holds no config.json" in mistyped.stderr
