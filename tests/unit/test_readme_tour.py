"""The README's file tour names every folder of the code once, and only folders that exist.

A newcomer reads the tour to find where a thing sits; a folder added, moved or removed
without its row makes the tour lie, so this test fails until the README follows.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE_ROOTS = ("elastic_rt", "agents")
OTHER_FOLDERS = ("tests", "scripts")


def _tour_rows() -> list[str]:
    text = (ROOT / "README.md").read_text()
    tour = text.split("## File tour", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in tour.splitlines():
        match = re.match(r"\| `([^`]+)/` \|", line)
        if match:
            rows.append(match.group(1))
    return rows


def _code_folders() -> set[str]:
    packages = {str(init.parent.relative_to(ROOT)) for root in CODE_ROOTS
                for init in (ROOT / root).rglob("__init__.py")}
    return packages | set(OTHER_FOLDERS)


def test_every_folder_of_the_code_has_one_row_in_the_readme_tour() -> None:
    rows = _tour_rows()
    assert len(rows) == len(set(rows)), "a folder has two rows"
    missing = sorted(_code_folders() - set(rows))
    assert not missing, f"folders without a row in README.md's file tour: {missing}"


def test_every_row_of_the_readme_tour_is_a_folder_that_exists() -> None:
    gone = sorted(row for row in _tour_rows() if not (ROOT / row).is_dir())
    assert not gone, f"README.md's file tour names folders that do not exist: {gone}"
