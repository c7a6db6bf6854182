"""The pages under docs/ and the README: every relative link resolves, every anchor names a heading
of its page, the README stays a short front door that links every page, each page says first who
it is for, and what a deployment recipe copies from this repository matches the repository."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import REPO

README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, *DOCS, REPO / "include" / "jobs" / "README.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")
README_MAX_LINES = 250


def is_relative(target: str) -> bool:
    return not re.match(r"[a-z]+:", target)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: a link's text only, lowercase, punctuation dropped (letters,
    digits, `_`, `-` and spaces stay), spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().rstrip("#").strip())
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, outside fenced code; a repeated one gets -1, -2... as on
    GitHub."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        heading = re.match(r"#{1,6} (.+)$", line)
        if heading and not fenced:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def test_slugs_follow_githubs_rules():
    assert slug("Checkpoints: how much a lost VM costs") == "checkpoints-how-much-a-lost-vm-costs"
    assert slug("The VM stops itself (autostop)") == "the-vm-stops-itself-autostop"
    assert slug("`make run`") == "make-run"
    assert slug("One run, one spec") == "one-run-one-spec"


def links(page: Path) -> list[str]:
    """The link targets of a page, outside inline code (a pattern's `[a-z](...)` is no link)."""
    return LINK.findall(re.sub(r"`[^`\n]*`", "", page.read_text()))


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in links(page):
            if not is_relative(target) or target.startswith("#"):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                broken.append((page.relative_to(REPO), target))
    assert broken == []


def test_every_anchor_names_a_heading_of_its_page():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if not is_relative(target) or "#" not in target:
                continue
            path, anchor = target.split("#", 1)
            linked = page.parent / path if path else page
            if linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append((page.relative_to(REPO), target))
    assert broken == []


def test_the_readme_is_a_short_front_door():
    assert len(README.read_text().splitlines()) <= README_MAX_LINES


def test_every_docs_page_is_linked_from_the_readme():
    linked = {target.split("#")[0] for target in LINK.findall(README.read_text())}
    assert [f"docs/{page.name}" for page in DOCS if f"docs/{page.name}" not in linked] == []


def test_the_deploy_pages_are_linked_from_the_readme():
    linked = set(LINK.findall(README.read_text()))
    assert {f"docs/{page.name}" for page in (REPO / "docs").glob("deploy-*.md")} <= linked


def test_every_docs_page_says_first_who_it_is_for():
    """Right under its title, a page's first paragraph starts with "For: " and names its reader."""
    unsaid = []
    for page in DOCS:
        title, *rest = page.read_text().splitlines()
        first = next((line for line in rest if line.strip()), "")
        if not title.startswith("# ") or not first.startswith("For: "):
            unsaid.append(page.name)
    assert unsaid == []


def test_the_params_page_is_written_from_the_declarations():
    """docs/params.md is what `make params-page` writes now: no Param, default or pattern of the
    declarations is missing from it or stale in it."""
    from maxtext_sft.run import params_page

    assert (REPO / "docs" / "params.md").read_text() == params_page.render(), "run `make params-page`"
    for name in ("steps", "ssh_via_iap", "tpu_slice", "rehearsal_machine_type", "source_image_family"):
        assert f"| `{name}` |" in params_page.render()


def test_the_iam_section_lists_exactly_the_published_roles_permissions():
    import yaml

    role = yaml.safe_load((REPO / "include" / "iam" / "airflow-role.yaml").read_text())["includedPermissions"]
    page = (REPO / "docs" / "google-cloud.md").read_text()
    listed = page[page.index("<!-- role: include/iam/airflow-role.yaml -->"):page.index("<!-- end of role -->")]
    assert re.findall(r"`([a-z]+\.[A-Za-z]+\.[A-Za-z]+)`", listed) == role
