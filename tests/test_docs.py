"""The docs against the code: the flags reference is what the scripts say, and the README stays a short shop window.

Fast (no JAX import, no training): the scripts are read with `ast` by docs/gen_flags.py. The site itself is built
with `mkdocs build --strict` by .ci/run, which fails on a broken link, anchor or included file.
"""

import html
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REGENERATE = ".venv/bin/python docs/gen_flags.py"


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_flags", os.path.join(REPO, "docs", "gen_flags.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen_flags = load_generator()


def page_rows(script_name: str) -> dict[str, str]:
    """{flag: its table row} of one script's section of the committed flags page."""
    with open(gen_flags.PAGE) as f:
        text = f.read()
    heading = f"## {script_name}: `{gen_flags.SCRIPTS[script_name]}`"
    assert heading in text, f"the flags page has no section '{heading}': run {REGENERATE}"
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\| `(--[a-z0-9-]+)[^`]*` \|", line)
        if match:
            rows[match.group(1)] = line
    return rows


@pytest.mark.parametrize("script_name", list(gen_flags.SCRIPTS))
def test_every_flag_of_the_script_is_in_the_reference_as_it_is_in_the_script(script_name):
    flags = gen_flags.read_flags(gen_flags.SCRIPTS[script_name])
    assert len(flags) > 20, "docs/gen_flags.py found too few fields in Args: has the class changed shape?"
    for flag in flags:
        assert flag.kind in ("algorithm", "runtime"), f"{flag.flag} is marked neither Algorithm nor Runtime"
        assert flag.help, f"{flag.flag} has no comment: the comment is its --help and its line in the reference"
    expected = {flag.flag.split(" /")[0]: gen_flags.row(flag) for flag in flags}
    documented = page_rows(script_name)
    missing = sorted(set(expected) - set(documented))
    stale = sorted(set(documented) - set(expected))
    changed = sorted(name for name in set(expected) & set(documented) if expected[name] != documented[name])
    assert not (missing or stale or changed), (
        f"docs/reference/flags.md disagrees with {gen_flags.SCRIPTS[script_name]}: missing {missing}, "
        f"no longer in the script {stale}, changed {changed}; run {REGENERATE}"
    )


def test_the_flags_page_is_exactly_what_the_generator_writes():
    with open(gen_flags.PAGE) as f:
        assert f.read() == gen_flags.render(), f"docs/reference/flags.md is stale: run {REGENERATE}"


def test_the_readme_is_short_and_starts_with_the_two_set_up_commands():
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    assert len(readme.splitlines()) <= 200
    commands = [line for line in readme.splitlines() if line.startswith("bash ") or line.startswith(".venv/bin/")]
    assert commands[0].startswith("bash setup.sh && .venv/bin/python cleanba/cleanba_ppo.py --env-id CartPole-v1")
    assert commands[1] == "bash setup.sh && .venv/bin/python -m pytest"


def test_ci_builds_the_docs_strictly():
    with open(os.path.join(REPO, ".ci", "run")) as f:
        assert ".venv/bin/mkdocs build --strict" in f.read()


def test_every_page_is_in_the_navigation_and_every_included_file_exists():
    """mkdocs --strict checks this too; here it fails in the suite, in milliseconds, with the file's name."""
    with open(os.path.join(REPO, "mkdocs.yml")) as f:
        config = f.read()
    docs = os.path.join(REPO, "docs")
    for directory, _, files in os.walk(docs):
        for name in files:
            path = os.path.relpath(os.path.join(directory, name), docs)
            if name.endswith(".md") and not path.startswith("results"):
                assert f": {path}" in config, f"docs/{path} is not in mkdocs.yml's nav"
                with open(os.path.join(directory, name)) as page:
                    for included in re.findall(r'--8<-- "([^":]+)', page.read()):
                        assert os.path.exists(os.path.join(REPO, included)), f"docs/{path} includes {included}"


def test_the_split_update_patch_applies_to_the_code_as_it_is():
    """The Performance page has a GPU session run `git apply docs/notes/split-update.patch`, then gpu-check's
    impala-split. After a change near its lines: `git apply --3way` it, settle the conflicts, and save `git diff`."""
    patch = os.path.join("docs", "notes", "split-update.patch")
    check = subprocess.run(["git", "apply", "--check", patch], cwd=REPO, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


# The pages a newcomer reads first, and the widest tables.
RENDERED = "/ get-started/ scripts/ppo/ reference/flags/ reference/exit-statuses/ results/ performance/".split()
# Run in the page once it has loaded (Material's scripts included): every table or code block that a reader would
# have to scroll sideways (Material puts a table in a box that scrolls; a code block scrolls itself).
MEASURE = """<script>
window.addEventListener("load", () => {
  const boxes = [...document.querySelectorAll(".md-typeset__scrollwrap, .md-content pre > code")];
  const wide = boxes.filter((box) => box.scrollWidth > box.clientWidth + 1).map((box) => box.textContent.slice(0, 80));
  document.body.setAttribute("data-too-wide", JSON.stringify(wide));
});
</script>"""


@pytest.mark.skipif(not shutil.which("chromium"), reason="needs Debian's chromium (.ci/run installs it)")
def test_the_first_pages_fit_a_1280_pixel_window(tmp_path):
    """What a reader sees in a browser 1,280 pixels wide: no table or code block that must be scrolled sideways, so
    nothing is cut off or hidden behind a scroll bar (a stylesheet that kept code from wrapping did both)."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    mkdocs = os.path.join(os.path.dirname(sys.executable), "mkdocs")
    subprocess.run([mkdocs, "build", "-q", "-d", str(tmp_path)], cwd=REPO, env=env, check=True, capture_output=True)
    for page in RENDERED:
        path = tmp_path / page.strip("/") / "index.html"
        path.write_text(path.read_text().replace("</body>", MEASURE + "</body>"))
        browser = [*"chromium --headless --no-sandbox --disable-gpu --no-first-run".split(), "--window-size=1280,900"]
        browser += ["--disable-background-networking", "--virtual-time-budget=5000", "--dump-dom", path.as_uri()]
        dom = subprocess.run(browser, capture_output=True, text=True, timeout=60).stdout
        measured = re.search(r'data-too-wide="([^"]*)"', dom)
        assert measured, f"{page or 'index'}: the page did not load in chromium"
        assert html.unescape(measured.group(1)) == "[]", f"{page or 'index'}: {html.unescape(measured.group(1))}"


def test_no_page_links_a_file_the_site_leaves_out(tmp_path):
    """mkdocs 1.6 logs a link to a file that exclude_docs leaves out at INFO, whatever mkdocs.yml's validation says,
    so --strict passes and the built site 404s on it: the build's own log must not report one."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    mkdocs = os.path.join(os.path.dirname(sys.executable), "mkdocs")
    build = subprocess.run(
        [mkdocs, "build", "--strict", "-d", str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert build.returncode == 0, build.stderr[-3000:]
    excluded = [line for line in build.stderr.splitlines() if "which is excluded from the built site" in line]
    assert not excluded, "\n".join(excluded)
