"""Every number a chapter's prose quotes is one the executed chapter glued: each name that a
`{glue:text}` or `{glue:figure}` of the prose uses (its own or another chapter's, `nb::name`) is
among the names the chapter's stored outputs hold, so no summary that a chapter glues can drop
a key its prose still quotes."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "notebooks").glob("*.ipynb")) + [ROOT / "book" / "records.ipynb"]
# {glue:text}`name:.2f`, {glue:text}`other.ipynb::name`, ```{glue:figure} name
QUOTED = re.compile(r"\{glue(?::text)?\}`(?:([\w.]+\.ipynb)::)?([A-Za-z_][\w]*)"
                    r"|\{glue:figure\}\s+(?:([\w.]+\.ipynb)::)?([A-Za-z_][\w]*)")


def glued(path: Path) -> set[str]:
    """The names the stored outputs of ``path`` glued."""
    cells = json.loads(path.read_text())["cells"]
    return {o["metadata"]["scrapbook"]["name"] for c in cells for o in c.get("outputs", [])
            if "scrapbook" in o.get("metadata", {})}


def quoted(path: Path) -> list[tuple[str, str]]:
    """(notebook, name) of every glue reference in the prose of ``path``."""
    text = "".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"]
                   if c["cell_type"] == "markdown")
    out = []
    for m in QUOTED.finditer(text):
        other, name = (m.group(1), m.group(2)) if m.group(2) else (m.group(3), m.group(4))
        out.append((other or path.name, name))
    return out


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_name_the_prose_quotes_is_glued_by_the_chapter(path):
    missing = [f"{nb}::{name}" for nb, name in quoted(path)
               if name not in glued(path if nb == path.name else path.parent / nb)]
    assert not missing, f"{path.name} quotes names its chapter does not glue: {missing}"


def test_the_check_finds_a_quoted_name_that_is_not_glued(tmp_path):
    nb = {"cells": [{"cell_type": "markdown", "source": ["{glue:text}`gone:.1f` and ",
                                                         "{glue:text}`kept`"]},
                    {"cell_type": "code", "source": [], "outputs": [
                        {"metadata": {"scrapbook": {"name": "kept"}}}]}]}
    path = tmp_path / "chapter.ipynb"
    path.write_text(json.dumps(nb))
    assert quoted(path) == [("chapter.ipynb", "gone"), ("chapter.ipynb", "kept")]
    assert glued(path) == {"kept"}
