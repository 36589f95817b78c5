"""The commands and links in README.md and docs/*.md still work.

Convention (README.md, "Development"): a fenced code block whose info string is exactly `sh` holds
commands that run on a CPU in seconds. This test runs every line of every such block with `bash -c`, the
repository as working directory and the current interpreter's environment first on PATH (so `attnpool` is
this checkout's entry point); each must exit 0 within COMMAND_TIMEOUT_S. Comment lines and blank lines are
skipped, lines ending in a backslash are joined to the next, and the lines of one block run in order, so a
block may use what its earlier lines made. (Each block runs as a background job, tests/background.py, from the
session's start.) Blocks tagged `text`, `gpu`, `console`, `yaml`, `python` or
anything else are not run. One test per block, named by page and line.

It also checks that every relative link in these pages points to an existing file, and that every
`#anchor` of such a link names a heading of the page it points to.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import background
import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND_TIMEOUT_S = 60

FENCE = re.compile(r"^(`{3,})(.*)$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _rel(page):
    return page.relative_to(ROOT).as_posix()


def _blocks(page):
    """(info string, first line number of the body, body lines) of every fenced block of a page."""
    blocks = []
    lines = page.read_text().split("\n")
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, info = match.group(1), match.group(2).strip()
        body_start = i + 1
        j = body_start
        while j < len(lines) and not lines[j].startswith(fence):
            j += 1
        blocks.append((info, body_start + 1, lines[body_start:j]))
        i = j + 1
    return blocks


def _commands(first_line, body):
    """(line number, command) for each command of a block: comments and blanks skipped, `\\` joined."""
    commands = []
    pending, pending_line = [], None
    for offset, line in enumerate(body):
        number = first_line + offset
        if not pending:
            stripped = line.strip()
            if not stripped or stripped.startswith("#"):
                continue
            pending_line = number
        if line.rstrip().endswith("\\"):
            pending.append(line.rstrip()[:-1])
            continue
        pending.append(line)
        commands.append((pending_line, " ".join(part.strip() for part in pending)))
        pending, pending_line = [], None
    if pending:
        commands.append((pending_line, " ".join(part.strip() for part in pending)))
    return commands


def _sh_blocks():
    cases = []
    for page in PAGES:
        for info, first_line, body in _blocks(page):
            if info == "sh":
                commands = _commands(first_line, body)
                if commands:
                    cases.append(pytest.param(page, commands, id=f"{_rel(page)}:{first_line}"))
    return cases


SH_BLOCKS = _sh_blocks()


def _block_job(case):
    """A background job (tests/background.py) running the block's commands in order, each with `bash -c`."""
    page, commands = case.values

    def run_block(tmp):
        env = {"PATH": os.path.dirname(sys.executable) + os.pathsep + background.ENV.get("PATH", "")}
        for line, command in commands:
            where = f"{_rel(page)}:{line}"
            try:
                result = background.run(["bash", "-c", command], env=env, timeout=COMMAND_TIMEOUT_S)
            except subprocess.TimeoutExpired as exc:
                tail = (exc.stderr or b"")[-2000:]
                if isinstance(tail, bytes):
                    tail = tail.decode(errors="replace")
                pytest.fail(f"{where}: `{command}` ran past {COMMAND_TIMEOUT_S} s\nstderr tail:\n{tail}")
            if result.returncode != 0:
                tail = (result.stderr or result.stdout)[-2000:]
                pytest.fail(f"{where}: `{command}` exited {result.returncode}\nstderr tail:\n{tail}")

    return background.job(f"test_sh_block_runs[{case.id}]")(run_block)


BLOCK_RUNS = {case.id: _block_job(case) for case in SH_BLOCKS}


def test_docs_have_sh_blocks():
    assert SH_BLOCKS, "no ```sh blocks found in README.md or docs/*.md"


@pytest.mark.parametrize("page, commands", SH_BLOCKS)
def test_sh_block_runs(request, page, commands):
    BLOCK_RUNS[request.node.callspec.id].result()


def _anchor(heading):
    """GitHub's anchor of a heading: its text as shown (a link's text, not its target), lower case, punctuation but
    '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"\]\([^)]*\)", "]", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page):
    anchors = set()
    in_block = False
    for line in page.read_text().split("\n"):
        if FENCE.match(line):
            in_block = not in_block
            continue
        if not in_block and line.startswith("#"):
            anchors.add(_anchor(line.lstrip("#")))
    return anchors


def _links(page):
    links = []
    in_block = False
    for number, line in enumerate(page.read_text().split("\n"), 1):
        if FENCE.match(line):
            in_block = not in_block
            continue
        if in_block:
            continue
        for match in LINK.finditer(line):
            links.append((number, match.group(1)))
    return links


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve(page):
    broken = []
    for number, target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{_rel(page)}:{number}: {target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{_rel(page)}:{number}: {target} (no heading #{anchor})")
    assert not broken, "broken links:\n" + "\n".join(broken)
