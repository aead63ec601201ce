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
    from jaxrl.config.sections.schedule import ScheduleConfig

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


# -- quoted figures have one source (docs/figures.yaml) -----------------------------------------
FIGURES = ROOT / "docs" / "figures.yaml"


def _recorded(root: Path, source: dict) -> float:
    """A figure recorded in a JSON file (``json``: path, ``key``: dotted), in GiB when the key
    counts bytes (``*_bytes``), rounded as docs quote it (2 decimals)."""
    import json

    value = json.loads((root / source["json"]).read_text())
    for part in source["key"].split("."):
        value = value[part]
    return round(value / 2**30, 2) if source["key"].endswith("_bytes") else value


def _stale_figures(figures: dict, root: Path) -> list[str]:
    """What disagrees with ``figures``: each figure's value equals its recorded source (a JSON
    key), or, formatted into its source's text, appears in that file; formatted into every
    quote's text it appears in the quoting file (line breaks read as spaces)."""
    stale = []
    for name, figure in figures.items():
        value = figure["value"]
        if not figure.get("quotes"):
            stale.append(f"{name}: a figure nobody quotes does not belong here")
        texts = [*figure.get("quotes", ())]
        if "json" in figure["source"]:
            recorded = _recorded(root, figure["source"])
            if recorded != value:
                stale.append(f"{name}: {figure['source']['json']} records {recorded}, not {value}")
        else:
            texts.insert(0, figure["source"])
        for where in texts:
            text = " ".join(where["text"].format(value=value).split())
            body = " ".join((root / where["file"]).read_text().split())
            if text not in body:
                stale.append(f"{name}: {where['file']} lacks {text!r}")
    return stale


def test_quoted_figures_match_their_source():
    """Each figure docs/figures.yaml lists appears, with its value, in its single source (the
    benchmark table or the plan it comes from) and in every file that quotes it: a figure
    changed in one place and not in the others fails here, naming the file and the text."""
    import yaml

    figures = yaml.safe_load(FIGURES.read_text())
    assert len(figures) >= 10, "docs/figures.yaml lost its figures"
    stale = _stale_figures(figures, ROOT)
    assert not stale, "quoted figures that disagree with docs/figures.yaml:\n" + "\n".join(stale)


def test_figure_check_reports_a_quote_that_moved(tmp_path):
    """The check itself: a source and a quote that agree pass; a quote whose number differs
    from the value (or a source that changed) is reported with its file."""
    (tmp_path / "a.md").write_text("| data=1 | scanned | block | 28.31 |\n")
    (tmp_path / "b.md").write_text("cuts the temporaries to 28\nGiB of temporaries.\n")
    (tmp_path / "c.md").write_text("only 26 GiB of temporaries\n")
    figure = {
        "value": 28.31,
        "source": {"file": "a.md", "text": "| scanned | block | {value} |"},
        "quotes": [{"file": "b.md", "text": "{value:.0f} GiB of temporaries"}],
    }
    assert _stale_figures({"t": figure}, tmp_path) == []
    figure["quotes"].append({"file": "c.md", "text": "{value:.0f} GiB of temporaries"})
    assert _stale_figures({"t": figure}, tmp_path) == ["t: c.md lacks '28 GiB of temporaries'"]
    figure["value"] = 26.15
    assert [m.split(" lacks")[0] for m in _stale_figures({"t": figure}, tmp_path)] == [
        "t: a.md",
        "t: b.md",
    ]
    (tmp_path / "plan.json").write_text('{"plan": {"total_bytes": 48117744072}}')
    recorded = {"value": 44.81, "source": {"json": "plan.json", "key": "plan.total_bytes"}}
    recorded["quotes"] = [{"file": "d.md", "text": "{value:.1f} GiB: fits"}]
    (tmp_path / "d.md").write_text("44.8 GiB: fits a 95 GB chip")
    assert _stale_figures({"p": recorded}, tmp_path) == []
    recorded["value"] = 38.06
    assert _stale_figures({"p": recorded}, tmp_path)[0] == "p: plan.json records 44.81, not 38.06"
