"""The docs in the repository: a config reference that cannot drift, and no reference to files a
user who clones the repository does not have."""

from __future__ import annotations

import re
from pathlib import Path

from jaxrl.config import reference

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [
    *ROOT.glob("jaxrl/**/*.py"),
    *ROOT.glob("tests/**/*.py"),
    *ROOT.glob("benchmarks/**/*.py"),
    *ROOT.glob("docs/**/*.md"),
    *ROOT.glob("configs/*.yaml"),
    *ROOT.glob("notebooks/*.ipynb"),
    ROOT / "README.md",
]


def test_config_reference_is_current():
    on_disk = reference.DOC_PATH.read_text() if reference.DOC_PATH.is_file() else ""
    assert on_disk == reference.render(), (
        "docs/config_reference.md is stale: run `python -m jaxrl.config.reference --write`"
    )


def test_every_config_field_is_documented():
    for prefix, cls, skip in reference.sections():
        comments = reference.field_comments(cls)
        for line in reference._table(cls, prefix, skip)[2:]:
            key = line.split("`")[1]
            assert comments.get(key.removeprefix(prefix)), f"{key} has no comment in {cls.__name__}"


def test_field_comments_read_the_source():
    from jaxrl.config.run import ScheduleConfig

    comments = reference.field_comments(ScheduleConfig)
    assert comments["max_tokens"] == "token budget of one micro-batch row (T)"
    # a continuation comment line belongs to the field above it
    assert comments["micro_batch_buckets"].endswith("() = powers of two")


def test_no_reference_outside_the_repository():
    this = Path(__file__).resolve()
    outside = "shared"  # the folder beside the repository, which users do not have
    pattern = re.compile(rf"\.\./{outside}|{outside}/(specs|DESIGN)|DESIGN\.md|\bspecs?/\w+\.md")
    bad = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in SOURCES
        if p.resolve() != this
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not bad, f"references to files users do not have: {bad}"


def test_referenced_docs_exist():
    refs = {
        (p.relative_to(ROOT), m)
        for p in SOURCES
        for m in re.findall(r"docs/[\w/.-]+\.md", p.read_text())
    }
    missing = sorted(f"{p}: {m}" for p, m in refs if not (ROOT / m).is_file())
    assert not missing, missing
