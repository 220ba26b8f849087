"""Shares a finished run's agent on the Hugging Face Hub: the training scripts' --upload-model starts it at the end of a
finished run, in a process of its own.

    python cleanba/share.py runs/<run_name> -- TRAINING COMMAND...   # the folder, then its upload
    python cleanba/share.py --check ARGS_JSON                         # exit 2 and one line if it could not upload

It writes runs/<run_name>/hub/, what another researcher needs to read, play and retrain the agent: the model
(--save-model's), config.json, the script that trained it, pyproject.toml and poetry.lock (the package versions),
updates.jsonl and the TensorBoard event files, a replay video of one episode (where the environment renders), and
README.md, the model card: the Hub's YAML metadata (library, tags, the environment, a model-index with the mean and
std of the return over --episodes evaluation episodes, played as cleanba/evaluate.py plays them) and the exact command.
Then it uploads the folder to <entity>/<name> (--hf-entity, or the token's user; --hf-repo-name, or
<env id>-<exp name>-seed<seed>, as CleanRL names its agents). If the Hub does not take it (no network, a refused
token, a quota), the run and the folder are kept: one line says what failed and the command that uploads the folder
later, and the status is 69 (EX_UNAVAILABLE). `cleanba/evaluate.py <entity>/<name>` plays a shared agent.

The Hub's rules: a repository name is 1 to 96 characters of letters, digits, '-', '_' and '.', neither starting nor
ending with '-' or '.', without '--' or '..'; a token with write access comes from `hf auth login` or HF_TOKEN.
A tool: the training scripts never import it.
"""

import argparse
import glob
import json
import os
import re
import shlex
import shutil
import sys

import huggingface_hub
import numpy as np
from evaluate import Recorder, evaluate, render_refusal, saved_params, write_video
from huggingface_hub.utils import HFValidationError, validate_repo_id

UPLOAD_FAILED = 69  # EX_UNAVAILABLE (sysexits.h), as the training scripts report it
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPISODES = 10  # evaluation episodes in the model card
EVALUATION_STEPS = 100_000  # at most: an environment without a time limit may never end an episode
VIDEO_FRAMES = 1_000  # the replay's length at most
ALGORITHMS = {"cleanba_ppo.py": "PPO", "cleanba_impala.py": "IMPALA", "cleanba_pqn.py": "PQN"}


def repository(args: dict) -> str:
    """<entity>/<name>, or the name alone (the token's user is asked at the upload): --hf-entity and --hf-repo-name,
    the name by default <env id>-<exp name>-seed<seed> with what the Hub does not allow in a name made '-'."""
    name = args.get("hf_repo_name")
    if not name:  # the env id's part cut short first, so that the seed stays in the name
        suffix = f"-{args['exp_name']}-seed{args['seed']}"
        env = re.sub(r"[-.]{2,}", "-", re.sub(r"[^A-Za-z0-9_.-]", "-", args["env_id"])).strip("-.")
        name = re.sub(r"[-.]{2,}", "-", env[: 96 - len(suffix)].rstrip("-.") + suffix)
    return f"{args['hf_entity']}/{name}" if args.get("hf_entity") else name


def refusal(args: dict) -> str | None:
    """Why --upload-model could not upload, known before the run starts: a repository name the Hub refuses, no token."""
    try:
        validate_repo_id(repository(args) if "/" in repository(args) else f"user/{repository(args)}")
    except HFValidationError as error:
        return f"--hf-entity / --hf-repo-name give {repository(args)!r}, which the Hub refuses: {error}"
    if not huggingface_hub.get_token():
        return "no Hugging Face token found: `.venv/bin/hf auth login`, or HF_TOKEN with a token that can write"
    return None


def model_card(args: dict, script: str, returns: list[float], command: str, video: bool) -> huggingface_hub.ModelCard:
    algorithm = ALGORITHMS.get(script, script)
    mean = f"{np.mean(returns):.2f} +/- {np.std(returns):.2f}"
    result = huggingface_hub.EvalResult(
        task_type="reinforcement-learning",
        dataset_type=args["env_id"],
        dataset_name=args["env_id"],
        metric_type="mean_reward",
        metric_value=mean,
    )
    data = huggingface_hub.ModelCardData(
        library_name="cleanba",
        tags=["reinforcement-learning", "deep-reinforcement-learning", "cleanba", algorithm, args["env_id"]],
        model_name=f"{algorithm} on {args['env_id']}",
        eval_results=[result],
    )
    body = [
        f"# {algorithm} on {args['env_id']}, trained with Cleanba's `{script}`",
        "",
        f"Mean return over {len(returns)} evaluation episodes: **{mean}** (`cleanba/evaluate.py`, the policy's",
        "actions sampled as the actors sample them).",
        "",
        "## Play it",
        "",
        "```bash",
        f".venv/bin/python cleanba/evaluate.py {args.get('hf_entity') or '<user>'}/{repository(args).split('/')[-1]}"
        " --episodes 10",
        "```",
        "",
        "## The command that trained it",
        "",
        "```bash",
        command,
        "```",
        "",
        "With the versions in `pyproject.toml` and `poetry.lock`, and the same seed, the same command gives the same",
        "run (Cleanba's reproducibility contract). `config.json` holds every argument and the layout; `updates.jsonl`",
        "and the event files, the training curves.",
    ]
    if video:
        body += ["", "## A replay", "", "`replay.mp4`: one episode of the agent."]
    return huggingface_hub.ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body) + "\n")


def make_folder(run_dir: str, command: str) -> tuple[str, dict]:
    """runs/<run>/hub/, made anew: (its path, the run's arguments)."""
    with open(os.path.join(run_dir, "config.json")) as f:
        config = json.load(f)
    args = config["args"]
    folder = os.path.join(run_dir, "hub")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    model = f"{args['exp_name']}.cleanba_model"
    for name in [model, "config.json", "updates.jsonl", *map(os.path.basename, glob.glob(f"{run_dir}/events.out.*"))]:
        shutil.copy(os.path.join(run_dir, name), folder)
    for path in [os.path.join(REPO, "cleanba", config["script"]), *glob.glob(f"{REPO}/pyproject.toml")]:
        shutil.copy(path, folder)
    if os.path.exists(os.path.join(REPO, "poetry.lock")):
        shutil.copy(os.path.join(REPO, "poetry.lock"), folder)
    params = saved_params(run_dir, args["exp_name"])
    returns = evaluate(run_dir, params, EPISODES, max_steps=EVALUATION_STEPS)
    if not returns:
        print(f"error: --upload-model: no episode ended in {EVALUATION_STEPS:,} evaluation steps", file=sys.stderr)
        sys.exit(1)
    video = render_refusal(args["env_id"], args.get("env_backend")) is None
    if video:
        frames, _ = Recorder(run_dir, max_frames=VIDEO_FRAMES).episode(params)
        write_video(os.path.join(folder, "replay.mp4"), frames)
    model_card(args, config["script"], returns, command, video).save(os.path.join(folder, "README.md"))
    return folder, args


def upload(folder: str, args: dict):
    """The folder to the Hub; anything the Hub or the network refuses is one line, exit 69, the folder kept."""
    repo_id = repository(args)
    files = sorted(os.listdir(folder))
    print(f"share.py: uploading {folder} ({len(files)} files: {', '.join(files)}) to the Hub repository {repo_id}")
    try:
        api = huggingface_hub.HfApi()
        if "/" not in repo_id:  # the token's user
            repo_id = f"{api.whoami()['name']}/{repo_id}"
        api.create_repo(repo_id, exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message="An agent trained with Cleanba")
    except Exception as error:  # the network, the token, a quota: whatever the Hub's client raises
        target = repo_id if "/" in repo_id else f"<your user>/{repo_id}"
        later = f"upload it later with: .venv/bin/hf upload {target} {shlex.quote(folder)} ."
        first_line = f"{type(error).__name__}: {error}".splitlines()[0]
        print(f"error: --upload-model: the Hub did not take {folder} ({first_line}); {later}", file=sys.stderr)
        sys.exit(UPLOAD_FAILED)
    print(f"share.py: uploaded to the Hub repository {repo_id}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", nargs="?", help="a finished run's directory, with the model of --save-model")
    parser.add_argument("command", nargs="*", help="the training command, after --")
    parser.add_argument("--check", metavar="ARGS_JSON", help="the training script's arguments, as JSON: check only")
    options = parser.parse_args()
    if options.check:
        if reason := refusal(json.loads(options.check)):
            print(reason, file=sys.stderr)
            sys.exit(2)
        return
    if not options.run_dir or not os.path.isfile(os.path.join(options.run_dir, "config.json")):
        parser.error("a run directory with config.json, or --check")
    folder, args = make_folder(options.run_dir, ".venv/bin/python " + shlex.join(options.command))
    upload(folder, args)


if __name__ == "__main__":
    main()
