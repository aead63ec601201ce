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


# A cited Markdown file: a name or relative path ending in .md, not inside a longer path or URL.
CITATION = re.compile(
    r"(?<![\w/.:-])((?:\.\./)*[\w.-]+(?:/[\w.-]+)*\.md)\b(?:,? ?§ ?(\d+(?:\.\d+)?))?"
)


def _cited(path: Path, text: str):
    """(line, cited name, cited section or None) of every Markdown file ``text`` cites. A quoted
    bare name in code (``"config_reference.md"``) is a path being built, not a citation."""
    for i, line in enumerate(text.splitlines(), 1):
        for m in CITATION.finditer(line):
            quoted = line[m.start() - 1 : m.start()] in "\"'" and line[m.end(1)] in "\"'"
            if not (path.suffix == ".py" and quoted and "/" not in m.group(1)):
                yield i, m.group(1), m.group(2)


def _resolve(path: Path, name: str) -> Path | None:
    """The repository file ``name`` means: relative to the citing file, else to the root."""
    for base in (path.parent, ROOT):
        target = (base / name).resolve()
        if target.is_relative_to(ROOT) and target.is_file():
            return target
    return None


def test_cited_files_and_sections_exist():
    """Every ``*.md`` that code, tests, configs or docs cite is a file of this repository (a
    user's checkout), and a cited ``§N`` / ``§N.M`` is a numbered heading of that file."""
    this = Path(__file__).resolve()  # its scanner examples are not citations
    sources = [p for p in (*SOURCES, *ROOT.glob("benchmarks/**/*.md")) if p.resolve() != this]
    missing, no_section = [], []
    for p in sources:
        for line, name, section in _cited(p, p.read_text()):
            where = f"{p.relative_to(ROOT)}:{line}"
            target = _resolve(p, name)
            if target is None:
                missing.append(f"{where}: {name}")
            elif section and not re.search(
                rf"^#+ {re.escape(section)}[.\s]", target.read_text(), re.MULTILINE
            ):
                no_section.append(f"{where}: {name} §{section}")
    assert not missing, f"cited files that are not in the repository: {missing}"
    assert not no_section, f"cited sections that are not headings of the file: {no_section}"


def test_citation_scan_sees_bare_names_paths_and_sections(tmp_path):
    """The scanner itself: what counts as a citation, and how it resolves."""
    here = ROOT / "tests" / "x.py"
    text = (
        "a (grpo.md §5) b docs/algorithms/grpo.md §10; ../docs/index.md, "
        'https://github.com/o/r/blob/main/README.md DOC = ROOT / "docs" / "config_reference.md"'
    )
    assert list(_cited(here, text)) == [
        (1, "grpo.md", "5"),
        (1, "docs/algorithms/grpo.md", "10"),
        (1, "../docs/index.md", None),
    ]
    assert _resolve(here, "grpo.md") is None  # a bare name resolves next to the citing file only
    assert _resolve(here, "docs/algorithms/grpo.md") == ROOT / "docs/algorithms/grpo.md"
    assert _resolve(here, "../docs/index.md") == ROOT / "docs/index.md"
    assert _resolve(ROOT / "docs/algorithms/grpo.md", "dpo.md") == ROOT / "docs/algorithms/dpo.md"
    outside = tmp_path / "grpo.md"  # an existing file outside the repository
    outside.write_text("# 1. x\n")
    assert _resolve(ROOT / "README.md", str(outside)) is None
