"""Every ```python block of docs/*.md and README.md runs (a few pages twice in the same folder).

A page's blocks run in order in one namespace (later blocks use what earlier ones built), in a fresh
temporary working directory, on the 8 virtual CPU devices, with no distribution set at the start. A
block that cannot run here (a cluster launch, a download) is preceded by `<!-- norun: reason -->`;
those are few, and each must give its reason. A page that names `s3://checkpoints/...` or
`gs://checkpoints/...` runs against the test session's local S3 and GCS servers.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from pathlib import Path

import keras
import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [*sorted((ROOT / "docs").glob("**/*.md")), ROOT / "README.md"]
FENCE = re.compile(r"^```python(?P<attrs>[^\n`]*)$")
NORUN = re.compile(r"^<!--\s*norun:\s*(?P<reason>\S.*?)\s*-->$")
MAX_NORUN = 4


@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    source: str
    norun: str | None  # the reason, for a block that is not run


def blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            start = i
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            previous = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
            marker = NORUN.match(previous.strip())
            source = "\n".join(lines[start + 1 : end]) + "\n"
            found.append(Block(page, start + 1, source, marker["reason"] if marker else None))
            i = end
        i += 1
    return found


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


RUNNABLE = [page for page in PAGES if any(b.norun is None for b in blocks(page))]


def test_norun_blocks_are_few_and_explained():
    norun = [b for page in PAGES for b in blocks(page) if b.norun is not None]
    assert len(norun) <= MAX_NORUN, [f"{_name(b.page)}:{b.line}" for b in norun]
    for block in norun:
        assert 'title="' in block.page.read_text().splitlines()[block.line - 1], (
            f"{_name(block.page)}:{block.line}: a no-run block needs a title"
        )


def test_pages_have_code():
    assert {"docs/quickstart.md", "docs/loading.md", "docs/format.md"} <= {
        _name(p) for p in RUNNABLE
    }


# The code column of the built site holds about 84 characters at a 1280 px window: a longer line
# is cut at the page's edge. These pages are kept within it (the others have tables of output).
CODE_WIDTH = 84
FITTED = ("docs/exporting.md", "docs/incremental.md", "docs/cli.md")


@pytest.mark.parametrize("name", FITTED)
def test_code_lines_fit_the_page(name):
    lines, inside, long = (ROOT / name).read_text().splitlines(), False, []
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            inside = not inside
        elif inside and len(line) > CODE_WIDTH:
            long.append(f"{name}:{number} ({len(line)} characters)")
    assert not long


def test_api_pages_have_one_title():
    """The page's title is its first object's heading (mkdocstrings, level 1), not a second
    `# keras_orbax.x` above the same name."""
    for page in sorted((ROOT / "docs" / "api").glob("*.md")):
        text = page.read_text()
        assert not text.startswith("#"), page.name
        assert text.startswith(":::") and "      heading_level: 1" in text.split("\n\n")[0]


BUCKET = "checkpoints"  # a page naming s3://checkpoints/... or gs://checkpoints/... gets both


def _use_object_stores(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Points the environment at the local S3 and GCS servers, each with a bucket `BUCKET`."""
    for kind in ("s3", "gcs"):
        store = request.getfixturevalue(f"{kind}_store")
        store.use(monkeypatch)
        store.new_bucket(BUCKET)


TEST_REFERENCE = re.compile(r"`(tests/test_\w+\.py)(?:::(\w+))?`|`::(\w+)`")


def test_reliability_cites_tests_that_exist():
    """Each guarantee on docs/reliability.md names a test file (and test) that exists: a renamed
    or deleted test leaves no guarantee standing on nothing."""
    text = (ROOT / "docs" / "reliability.md").read_text()
    missing, current, cited = [], "", 0
    for file, name, sibling in TEST_REFERENCE.findall(text):
        current = file or current
        source = (ROOT / current).read_text() if (ROOT / current).exists() else ""
        if not source:
            missing.append(current)
        elif (name or sibling) and f"def {name or sibling}(" not in source:
            missing.append(f"{current}::{name or sibling}")
        cited += 1
    assert cited >= 20 and not missing, missing


@pytest.mark.parametrize("page", RUNNABLE, ids=_name)
def test_page_runs(page, tmp_path, monkeypatch, distribution, request):
    source = page.read_text()
    if f"://{BUCKET}/" in source:
        _use_object_stores(request, monkeypatch)
    if "keras_hub" in source and importlib.util.find_spec("keras_hub") is None:
        if os.environ.get("KERAS_ORBAX_REQUIRE_HUB"):
            pytest.fail("keras-hub is not installed (KERAS_ORBAX_REQUIRE_HUB is set)")
        pytest.skip("keras-hub is not installed")
    monkeypatch.chdir(tmp_path)
    for _ in range(2 if _name(page) in RUN_TWICE else 1):  # again: in the folder it left
        distribution(None)
        keras.utils.clear_session()
        namespace: dict = {"__name__": "__docs__"}
        for block in blocks(page):
            if block.norun is not None:
                continue
            code = compile("\n" * block.line + block.source, f"{_name(page)}:{block.line}", "exec")
            exec(code, namespace)


# Pages a reader runs first and runs again: the second run, in the folder the first left, must
# pass too (each page's examples are written to; the other pages' second runs are cut for time).
RUN_TWICE = ("docs/quickstart.md", "docs/resuming.md", "docs/inspecting.md")


def test_the_benchmarks_page_is_a_summary_and_the_log_is_off_the_nav():
    """docs/benchmarks.md is what a user reads in two minutes; the dated engineering log it
    summarizes stays built (linked from it) but out of the site's navigation."""
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:", 1)[1]
    assert len(page.splitlines()) <= 200
    assert "(dev/benchmarks-log.md)" in page and (ROOT / "docs/dev/benchmarks-log.md").is_file()
    assert "benchmarks.md" in nav and "dev/" not in nav
