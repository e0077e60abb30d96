"""The documentation: the site builds, the reference is current, and every command runs.

- `mkdocs build --strict` (broken links and pages missing from the nav fail it);
- docs/configuration-reference.md is what `recflow.config.reference` generates now;
- every fenced `bash` block of README.md and docs/getting-started.md runs, as a
  user would run it, in a fresh copy of the repository's layout (with
  `../shared/data` beside it); the `text` block after a command block is its
  output, copied from a real run: each of its lines must appear, in order, in
  what the block prints now (numbers may differ), and each `runs/...` path it
  shows must exist afterwards. A block preceded by `<!-- not run: why -->` is
  skipped (the install lines).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from recflow.config import reference

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "data"
RUN_PAGES = ["README.md", "docs/getting-started.md"]
NOT_RUN = re.compile(r"^<!-- not run: .+ -->$")


@dataclass
class Block:
    page: str
    line: int
    commands: str
    output: str | None  # the `text` block shown after it
    run: bool


def blocks(page: str) -> list[Block]:
    """The `bash` blocks of a page, each with the `text` block that follows it (if any)."""
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = lines.index("```", i + 1)
        body = "\n".join(lines[i + 1 : end])
        before = next((x for x in reversed(lines[:i]) if x.strip()), "")
        if fence.group(1) == "bash":
            found.append(Block(page, i + 1, body, None, not NOT_RUN.match(before)))
        elif fence.group(1) == "text" and found and found[-1].output is None and found[-1].run:
            found[-1].output = body
        i = end + 1
    return found


def test_every_command_block_is_run_or_says_why_not():
    for page in RUN_PAGES:
        text = (ROOT / page).read_text(encoding="utf-8")
        fences = re.findall(r"^```(\w*)\s*$", text, flags=re.M)[::2]  # opening fences
        assert set(fences) <= {"bash", "text", "yaml", "python"}, (page, fences)
        run = [b for b in blocks(page) if b.run]
        assert run, page


def shown(output: str) -> list[str]:
    """The lines a terminal ends up showing (a progress bar redraws with \\b and \\r)."""
    lines = []
    for line in output.splitlines():
        parts = [p for p in re.split(r"[\r\b]+", line) if p.strip()]
        if parts:
            lines.append(parts[-1].rstrip())
    return lines


def masked(line: str) -> str:
    """A line with its numbers (and times like 14ms, 950us) replaced by #."""
    line = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?(us|ms|s)?\b", "#", line)
    return " ".join(line.split())


def check_output(block: Block, actual: str, cwd: Path) -> None:
    expected = [line for line in block.output.splitlines() if line.strip()]
    have = [masked(line) for line in shown(actual)]
    at = 0
    for line in expected:
        want = masked(line)
        while at < len(have) and have[at] != want:
            at += 1
        assert at < len(have), (
            f"{block.page}:{block.line}: the shown output line {line!r} is not in what the "
            f"command prints now:\n{actual}"
        )
        at += 1
    for path in re.findall(r"(?<![\w/.])(runs/[\w./-]*\w)", block.output):
        assert (cwd / path).exists(), f"{block.page}:{block.line}: {path} does not exist"


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Path:
    """A fresh clone's layout: the repository's configs and examples, ../shared/data."""
    if not SHARED.is_dir():
        pytest.skip(f"no sample data at {SHARED}")
    base = tmp_path_factory.mktemp("clone")
    repo = base / "recflow"
    repo.mkdir()
    for name in ("configs", "examples"):
        (repo / name).symlink_to(ROOT / name)
    (base / "shared").mkdir()
    (base / "shared" / "data").symlink_to(SHARED)
    return repo


def run_block(block: Block, cwd: Path) -> str:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.commands],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, f"{block.page}:{block.line}: exit {done.returncode}\n{done.stderr}"
    assert done.stderr == "", f"{block.page}:{block.line}: stderr:\n{done.stderr}"
    return done.stdout


def test_command_blocks_run_and_show_real_output(sandbox):
    ran: dict[str, str] = {}  # a command block shown on two pages runs once
    for page in RUN_PAGES:
        for block in blocks(page):
            if not block.run:
                continue
            if block.commands not in ran:
                ran[block.commands] = run_block(block, sandbox)
            if block.output is not None:
                check_output(block, ran[block.commands], sandbox)


def test_output_check_fails_on_a_stale_path(tmp_path):
    """The check itself: a moved export (the old README's `export/1`) fails it."""
    (tmp_path / "runs" / "criteo" / "export" / "12").mkdir(parents=True)
    block = Block("README.md", 1, "", "model dir: runs/criteo   export: runs/criteo/export/1", True)
    printed = "model dir: runs/criteo   export: runs/criteo/export/12\n"
    with pytest.raises(AssertionError, match="runs/criteo/export/1 does not exist"):
        check_output(block, printed, tmp_path)
    block.output = "model dir: runs/criteo   export: runs/criteo/export/12"
    check_output(block, printed, tmp_path)
    block.output = "auc 0.7 logloss 0.4  step 12"
    with pytest.raises(AssertionError, match="is not in what the command prints now"):
        check_output(block, "auc 0.7 mse 0.4  step 12\n", tmp_path)


def test_configuration_reference_is_current():
    page = ROOT / "docs" / "configuration-reference.md"
    assert page.read_text(encoding="utf-8") == reference.render(), (
        "docs/configuration-reference.md is stale: run "
        "`python -m recflow.config.reference docs/configuration-reference.md`"
    )


def test_every_config_key_is_in_the_reference():
    """Every field of every section reached from `Config` has its row (with a description)."""
    import dataclasses
    import typing

    from recflow.config import schema

    text = reference.render()
    for cls in vars(schema).values():
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            continue
        if cls in (schema.NormalizerSpec, schema.OptimizerSpec):
            continue  # dispatchers, never instantiated
        for f in dataclasses.fields(cls):
            if f.init:
                assert re.search(rf"\| `[^`]*\b{f.name}` \|", text), (cls.__name__, f.name)
    assert typing.get_type_hints(schema.Config)  # the walk resolves every annotation


def test_a_field_without_a_description_fails_the_reference():
    @dataclasses_dataclass
    class Section:
        """A section.

        Attributes:
            known: has a description.
        """

        known: int = 1
        unknown: int = 2

    with pytest.raises(ValueError, match="Section.unknown: no description"):
        reference._Page().rows(Section, "section")


def dataclasses_dataclass(cls):
    import dataclasses

    return dataclasses.dataclass(frozen=True)(cls)


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if not re.match(r"^\w+://", link)]
    assert local, "the README links to the docs"
    for link in local:
        assert (ROOT / link).exists(), link


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 160


def test_mkdocs_build_strict(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "configuration-reference" / "index.html").exists()


def test_config_examples_in_the_docs_are_valid(tmp_path):
    """Every YAML block of the docs that is a whole config (`version: 1`) loads and validates."""
    from recflow.config import load_config

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    checked = 0
    for page in pages:
        for body in re.findall(r"^```yaml\n(.*?)^```$", page.read_text(encoding="utf-8"), re.M | re.S):
            if not body.startswith("version: 1"):
                continue
            path = tmp_path / "config.yaml"
            path.write_text(body, encoding="utf-8")
            load_config(str(path))
            checked += 1
    assert checked >= 2
