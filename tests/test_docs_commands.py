"""The docs run as written: every command and flag they show is one the scripts and tools take. A flag a program does
not accept, a value it refuses or a command that does not parse fails here, in seconds, without training.

Read: README.md and docs/**/*.md, except the generated flags page (tests/test_docs.py checks it against the scripts)
and the pages under docs/results/ (aggregate.py's output). In each, the fenced code blocks, with the files they
include as mkdocs does (`--8<-- "benchmark.sh:mujoco"`), and the inline code spans:

- A command, a line that runs one of the programs (`.venv/bin/python cleanba/cleanba_ppo.py --env-id ...`), is
  parsed as the program parses it, in this process: a training script's flags by tyro into its `Args`, then its
  start-up checks that need no devices (`check_args`); a tool's by its `parse_args`. launch.py's command after `--` is
  checked as each experiment runs it (with the grid's first env id and seed).
- A span that names a program without running it (`cleanba/evaluate.py runs/<run> --video`) is prose: its flags
  must be the program's.
- A span that starts with a flag (`--lstm-size 64`, `--resume / --no-resume`) names flags that some program has (or
  FOREIGN's, another program's); with a value, it must parse as the flags of some training script.

Placeholders are not checked: a command with `...` (the rest left to the reader) is skipped; in a span, ALL-CAPS
words, <...> and single letters (RUN_DIRS, N, <run>, `--process-id i`) leave only the flag names to check.
cleanba/record.py and supervise.py are not checked: the scripts start them, with arguments of their own.
"""

import contextlib
import dataclasses
import functools
import glob
import importlib
import io
import os
import re
import subprocess
import sys

import envpool
import pytest
import tyro
from helpers import ALGOS, REPO, load_script

SCRIPTS = {f"cleanba_{algo}.py": algo for algo in ALGOS}
TOOLS = ["launch.py", "evaluate.py", "aggregate.py", "compare_runs.py", "events.py"]
PAGES = ["README.md"] + sorted(
    os.path.relpath(path, REPO)
    for path in glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True)
    if not path.startswith(os.path.join(REPO, "docs", "results")) and not path.endswith("reference/flags.md")
)
# Flags of other programs, on the pages that name them.
FOREIGN = {
    "docs/guides/slurm.md": {"--requeue", "--signal"},  # sbatch's
    "docs/guides/failures.md": {"--requeue"},  # sbatch's
    "docs/performance.md": {"--configs", "--algos", "--runs", "--budget"},  # throughput.py's, gpu_check.py's
    "docs/guides/modifying.md": {  # flags added to copies of cleanba_ppo.py
        *"--clip-vloss --kl-coef-init --kl-target --lr-warmup-fraction --aux-coef".split()
    },
    "docs/notes/minigrid-memory.md": {  # the scratch copy's
        *"--head-hidden --head-depth --actor-gain --lstm-gain --num-actions --seq-len --clip-vloss".split()
    },
}
FENCE = re.compile(r"^( *)```(\w*)[^\n]*\n(.*?)^\1```", re.MULTILINE | re.DOTALL)
SHELL_FENCES = ("", "bash", "sh", "shell", "console")
SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
INCLUDE = re.compile(r'--8<-- "([^":]+)(?::(\w+))?"')
VARIABLE = re.compile(r"\$(?:\{(\w+)(?::-([^}]*))?\}|(\w+))")
ASSIGNMENT = re.compile(r"\w+=")
PLACEHOLDER = re.compile(r"\.\.\.|[A-Z][A-Z0-9_]*|[a-z]|.*<.*")


class Shell:
    """Just enough of bash to read the docs' commands and benchmark.sh: `\\`-newlines joined, comments dropped, quotes
    taken off, commands split at newlines and at ; & && | ||, variables expanded ($NAME, ${NAME}, ${NAME:-default}:
    those assigned before; "$@" is empty), a call of a one-line function (`launch() { $PYTHON cleanba/launch.py "$@";
    }`) replaced by its body."""

    def __init__(self):
        self.variables, self.functions = {}, {}

    def commands(self, text: str) -> list[tuple[int, list[str]]]:
        """[(the line a command starts on, counted from 1; its words)] of the text."""
        text = text.replace('"$@"', "")
        self.found, self.words, self.word, self.line, self.start = [], [], None, 1, 1
        quote, i = None, 0
        while i < len(text):
            char, after = text[i], text[i + 1 : i + 2]
            if char == "\n":
                self.line += 1
            if (quote == "'" and char != "'") or (quote == '"' and char not in '"\\$'):
                self.add(char)
            elif char in "'\"":
                quote = None if quote else char
                self.add("")
            elif char == "\\":
                if after == "\n":  # a line continued
                    self.line += 1
                else:
                    self.add(after)
                i += 1
            elif char == "$" and (match := VARIABLE.match(text, i)) and (value := self.value(match)) is not None:
                text = text[:i] + value.replace("\n", " ") + text[match.end() :]
                continue
            elif quote is None and char in " \t\n;&|":
                self.end_word()
                if char not in " \t":
                    self.end_command()
            elif quote is None and char == "#" and self.word is None:  # a comment, to the end of the line
                i = text.find("\n", i) - 1 if "\n" in text[i:] else len(text)
            else:
                self.add(char)
            i += 1
        self.end_word()
        self.end_command()
        return self.found

    def value(self, match: re.Match) -> str | None:
        """The variable's value, its default, or None (not assigned here: left as it is written)."""
        return self.variables.get(match.group(1) or match.group(3), match.group(2))

    def add(self, text: str):
        if self.word is None and not self.words:
            self.start = self.line
        self.word = (self.word or "") + text

    def end_word(self):
        if self.word is not None:
            self.words.append(self.word)
        self.word = None

    def end_command(self):
        words, self.words = self.words, []
        if not words:
            return
        if words[0].endswith("()"):  # name() { body; }: its body replaces a call
            self.functions[words[0][:-2]] = words[2:]
        elif words[0] in ("local", "export") or all(ASSIGNMENT.match(word) for word in words):
            for word in words:
                if ASSIGNMENT.match(word):
                    name, value = word.split("=", 1)
                    self.variables[name] = value
        else:
            self.found.append((self.start, self.functions.get(words[0], words[:1]) + words[1:]))


def find_program(words: list[str]) -> tuple[str | None, int]:
    """(The program the words run or name, its index), or (None, -1)."""
    for index, word in enumerate(words):
        name = os.path.basename(word)
        if name in SCRIPTS or (name in TOOLS and word in (name, f"cleanba/{name}")):
            return name, index
    return None, -1


def parse(name: str, argv: list[str]):
    """The program's arguments as it parses them; on bad input it exits (2) as the program does."""
    if name in SCRIPTS:
        return tyro.cli(load_script(SCRIPTS[name]).Args, prog=f"cleanba/{name}", args=argv)
    return importlib.import_module(name[: -len(".py")]).parse_args(argv)


@functools.cache
def parsed(name: str, argv: tuple[str, ...]) -> tuple[object, int, str]:
    """(The parsed arguments, or None if the program exited; its exit status; what it printed)."""
    output = io.StringIO()
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        try:
            return parse(name, list(argv)), 0, output.getvalue()
        except SystemExit as refused:
            return None, refused.code, output.getvalue()


def refusal(output: str) -> str:
    """The lines of a program's refusal that say what is wrong (argparse's `error:` line, tyro's box)."""
    lines = [line.strip(" │╭╮╰╯─-") for line in output.splitlines()]
    errors = [line for line in lines if "error:" in line]
    return " / ".join(errors or [line for line in lines if line and not line.startswith("For full helptext")])


@functools.cache
def flags_of(name: str) -> frozenset[str]:
    """The program's flags, as its --help lists them (argparse's and tyro's: `  --track, --no-track  help...`)."""
    _, status, output = parsed(name, ("--help",))
    assert status == 0, f"{name} --help exits {status}:\n{output}"
    flags = set()
    for line in output.splitlines():
        if match := re.match(r"  (-\S.*?)(  |$)", line):
            flags |= set(re.findall(r"--[a-z0-9][a-z0-9-]*", match.group(1)))
    return frozenset(flags)


def all_flags() -> set[str]:
    return set().union(*(flags_of(name) for name in [*SCRIPTS, *TOOLS]))


@functools.cache
def check_command(name: str, argv: tuple[str, ...]) -> str:
    """What is wrong with running the program with argv ("": nothing). `[--updates 10]`: an optional part, given."""
    args, status, output = parsed(name, tuple(word.removeprefix("[").removesuffix("]") for word in argv))
    if args is None:
        return "" if status == 0 else refusal(output) or f"exit {status}"
    if name in SCRIPTS:
        script = load_script(SCRIPTS[name])
        # --capture-video's check starts cleanba/record.py (~2 s), --upload-model's cleanba/share.py, which needs the
        # reader's token: tests/test_videos.py and tests/test_share.py run them.
        try:
            script.check_args(dataclasses.replace(args, capture_video=False, upload_model=False))
        except script.ConfigError as error:
            return f"error: {error}"
    if name == "launch.py":
        unknown = [env_id for env_id in args.env_ids if env_id not in envpool.list_all_envs()]
        if unknown:
            return f"--env-ids {' '.join(unknown)}: not EnvPool environments"
        inner, index = find_program(args.command)
        if inner:
            launched = (*args.command[index + 1 :], "--env-id", args.env_ids[0], "--seed", str(args.seeds[0]))
            return check_command(inner, launched)
    return ""


def check_flags(words: list[str], page: str) -> list[str]:
    """What is wrong with a span of flags: `--lstm-size 64 --critic-core`, `--resume / --no-resume`."""
    pieces, problems = [[]], []
    for word in words:
        if word == "/":
            pieces.append([])
        else:
            pieces[-1].append(word)
    for piece in pieces:
        # XLA's own flags (--xla_..., set in XLA_FLAGS) are not the scripts'.
        names = [word.split("=")[0] for word in piece if word.startswith("--") and not word.startswith("--xla_")]
        unknown = [name for name in names if name not in all_flags() | FOREIGN.get(page, set())]
        if unknown:
            problems.append(f"no script or tool has {' '.join(unknown)}")
            continue
        if len(piece) == 1 or any(PLACEHOLDER.fullmatch(word) for word in piece):
            continue  # a flag's name, or flags with placeholders: the names are checked
        # With values: some training script must take them (a tool's flags: their names are checked).
        outcomes = [parsed(name, tuple(piece)) for name in SCRIPTS if set(names) <= flags_of(name)]
        if outcomes and all(status for _, status, _ in outcomes):
            problems.append(refusal(outcomes[0][2]))
    return problems


# Steps per second of a training script on 2 CPU cores, by family, rounded down (Results' minutes; Breakout's PPO):
# what a command's --total-timesteps costs, to tell the commands that must say how long they take.
STEPS_PER_SECOND = {"classic control": 20_000, "MuJoCo": 5_000, "MiniGrid": 1_000, "pixels": 200}
CLASSIC_CONTROL = ("CartPole", "Acrobot", "MountainCar", "Pendulum")
MUJOCO = ("HalfCheetah", "Hopper", "Walker2d", "Ant", "Humanoid", "Swimmer", "Reacher", "InvertedPendulum")
DURATION = re.compile(r"\b\d[\d,.]*\s*(s|seconds?|min|minutes?|h|hours?)\b|\bseconds\b|\bminutes\b|\bhours\b")


def seconds_to_run(name: str, argv: tuple[str, ...]) -> float:
    """About how long a training command runs on 2 CPU cores (0 for a tool, or a command that does not parse)."""
    args, _, _ = parsed(name, argv)
    if name not in SCRIPTS or args is None:
        return 0.0
    family = "pixels"
    if args.env_id.startswith(CLASSIC_CONTROL):
        family = "classic control"
    elif args.env_id.startswith(MUJOCO):
        family = "MuJoCo"
    elif args.env_id.startswith("MiniGrid"):
        family = "MiniGrid"
    return args.total_timesteps / STEPS_PER_SECOND[family]


def check_words(words: list[str], page: str, span: bool) -> tuple[str | None, str]:
    """(The program the words are about, or None; what is wrong, or "")."""
    if span and words[0].startswith("--"):
        return "flags", "; ".join(check_flags(words, page))
    name, index = find_program(words)
    if name is None:
        return None, ""
    if index and os.path.basename(words[index - 1]) in ("python", "python3") and "/" not in words[index - 1]:
        return name, "a bare interpreter: in a fresh shell after the quickstart, `.venv/bin/python` runs it"
    if "..." in words:  # `python cleanba/cleanba_ppo.py ...`: a command left to the reader
        return None, ""
    if span and index == 0:  # named in prose: `cleanba/launch.py --device-ids 0 --workers 4`
        unknown = [word for word in words[1:] if word.startswith("--") and word.split("=")[0] not in flags_of(name)]
        return name, f"{' '.join(unknown)}: not a flag of {name}" if unknown else ""
    return name, check_command(name, tuple(words[index + 1 :]))


@functools.cache
def included_commands(path: str) -> list[tuple[int, list[str]]]:
    with open(os.path.join(REPO, path)) as f:
        return Shell().commands(f.read())


def included(path: str, section: str | None) -> list[tuple[int, list[str]]]:
    """The commands of an included file, or of its section (between `--8<-- [start:NAME]` and `[end:NAME]`), with
    their lines in the file: all of the file is read, for the variables and functions the section uses."""
    with open(os.path.join(REPO, path)) as f:
        lines = f.read().splitlines()
    first, last = 1, len(lines)
    if section:
        first = next(n for n, line in enumerate(lines, 1) if f"--8<-- [start:{section}]" in line)
        last = next(n for n, line in enumerate(lines, 1) if f"--8<-- [end:{section}]" in line)
    return [(line, words) for line, words in included_commands(path) if first <= line <= last]


def checked(page: str) -> list[tuple[str, str, str, str]]:
    """[(where, what, the program, what is wrong or "")] for every command, and span of flags, of a page that runs
    or names a program."""
    with open(os.path.join(REPO, page)) as f:
        text = f.read()
    results = []

    def check(where: str, words: list[str], span: bool):
        program, problem = check_words(words, page, span)
        if program:
            results.append((where, " ".join(words), program, problem))

    for fence in FENCE.finditer(text):
        first_line = text.count("\n", 0, fence.start()) + 1
        if fence.group(2) not in SHELL_FENCES:
            continue
        body = fence.group(3)
        # How long it takes, said in the block or in the 3 lines before it (a grid's own comment, in its file).
        told = DURATION.search("\n".join([*text[: fence.start()].splitlines()[-3:], body]))
        for include in INCLUDE.finditer(body):
            for line, words in included(include.group(1), include.group(2)):
                check(f"{include.group(1)}:{line} (in {page})", words, span=False)
        for line, words in Shell().commands(INCLUDE.sub("", body)):
            check(f"{page}:{first_line + line}", words, span=False)
            name, index = find_program(words)
            if name and not told and (seconds := seconds_to_run(name, tuple(words[index + 1 :]))) > 120:
                what = f"runs ~{seconds / 60:.0f} minutes on 2 CPU cores: say how long, or set --total-timesteps"
                results.append((f"{page}:{first_line + line}", " ".join(words), name, what))
    prose = FENCE.sub(lambda fence: "\n" * fence.group(0).count("\n"), text)  # line numbers kept
    for span in SPAN.finditer(prose):
        content = span.group(2).replace("\n", " ").strip()
        if content in ("--", "") or content.startswith("--8<--"):  # launch.py's separator, a snippet's marker
            continue
        line = prose.count("\n", 0, span.start()) + 1
        # Flags in prose are words, not shell (`--run-name <its directory's name>`).
        commands = [(0, content.split())] if content.startswith("--") else Shell().commands(content)
        for _, words in commands:
            check(f"{page}:{line}", words, span=True)
    return results


@pytest.mark.parametrize("page", PAGES)
def test_every_command_and_flag_on_the_page_is_one_the_programs_take(page):
    problems = [f"{where}: `{what}`: {problem}" for where, what, _, problem in checked(page) if problem]
    assert not problems, "\n" + "\n".join(problems)


def test_the_checks_find_the_quickstart_and_refuse_what_a_user_would_trip_on():
    quickstart = [what for _, what, program, _ in checked("README.md") if program == "cleanba_ppo.py"]
    assert any("--env-id CartPole-v1" in what for what in quickstart)
    assert check_command("cleanba_ppo.py", ("--norm-obs",))  # bool | None: tyro wants --norm-obs True|False
    assert check_command("cleanba_ppo.py", ("--env-id", "CartPole-v1", "--num-steps", "100", "--num-minibatches", "3"))
    assert check_command("launch.py", ("--env-ids", "Pong-v5", "--", "python", "cleanba/cleanba_pqn.py", "--lr", "1"))
    assert check_flags(["--no-norm-obs"], "docs/get-started.md")
    assert not check_flags(["--resume", "/", "--no-resume"], "docs/get-started.md")
    assert check_flags(["--vtrace-pg-rho-clip"], "docs/scripts/impala.md")
    assert check_flags(["--lstm-size", "sixty-four"], "docs/get-started.md")
    assert check_words(["python", "cleanba/cleanba_ppo.py", "--env-id", "CartPole-v1"], "README.md", span=False)[1]
    assert not check_words([".venv/bin/python", "cleanba/cleanba_ppo.py"], "README.md", span=False)[1]
    assert seconds_to_run("cleanba_ppo.py", ("--env-id", "Breakout-v5")) > 3600  # the default 50M steps
    assert seconds_to_run("cleanba_ppo.py", ("--env-id", "CartPole-v1", "--total-timesteps", "300000")) < 120


def test_every_tool_answers_help_with_its_usage():
    """As a user runs them (evaluate.py's in-process --help, in flags_of, spares a JAX import here)."""
    tools = {
        tool: subprocess.Popen(
            [sys.executable, os.path.join(REPO, "cleanba", tool), "--help"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for tool in TOOLS
        if tool != "evaluate.py"
    }
    for tool, process in tools.items():
        stdout, stderr = process.communicate(timeout=60)
        assert process.returncode == 0, f"{tool} --help exits {process.returncode}: {stderr}"
        assert stdout.startswith("usage: "), f"{tool} --help prints no usage: {stdout[:300]}"
