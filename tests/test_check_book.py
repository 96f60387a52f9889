"""tools/check_book.py on a tiny hand-written book: a clean page passes, each fault is named."""

import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("check_book", ROOT / "tools" / "check_book.py")
check_book = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_book)

PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 64
GOOD = """<html><head><script src="_static/mathjax/tex-chtml.js"></script></head><body>
<article class="bd-article"><section id="top"><h1>Chapter</h1>
<p>Inline <span class="math notranslate nohighlight">\\(x^2\\)</span>, costs in <code>$HOME</code>;
see <a class="reference internal" href="#fig-a">Fig. 1</a> and
<a href="other.html#sec">there</a>.</p>
<div class="cell_output docutils container"><pre>loss 0.25</pre>
<figure id="fig-a"><img alt="Loss against epoch." src="_images/a.png" />
<figcaption><p><span class="caption-number">Fig. 1 </span>Loss.<a href="#fig-a">#</a></p>
</figcaption></figure></div></section></article></body></html>"""


def write_book(tmp_path: Path, page: str) -> Path:
    html = tmp_path / "html"
    (html / "_images").mkdir(parents=True)
    (html / "_images" / "a.png").write_bytes(PNG)
    (html / "_images" / "broken.png").write_bytes(b"not a png")
    (html / "_static" / "mathjax").mkdir(parents=True)
    (html / "_static" / "mathjax" / "tex-chtml.js").write_text("// MathJax, served with the book")
    (html / "index.html").write_text(page)
    (html / "other.html").write_text('<html><body><p id="sec">other</p></body></html>')
    (tmp_path / "_toc.yml").write_text("format: jb-book\nroot: index\nchapters:\n"
                                       "  - file: other\n")
    return html


def run(tmp_path: Path, page: str, capsys) -> tuple[int, str]:
    html = write_book(tmp_path, page)
    rc = check_book.main([str(html), "--toc", str(tmp_path / "_toc.yml"), "--no-browser"])
    return rc, capsys.readouterr().out


def test_a_clean_book_passes(tmp_path, capsys):
    rc, out = run(tmp_path, GOOD, capsys)
    assert rc == 0, out
    assert "--no-browser" in out and "0 problems" in out


@pytest.mark.parametrize("old, new, problem", [
    ('href="other.html#sec"', 'href="other.html#nowhere"', "no anchor #nowhere"),
    ('href="other.html#sec"', 'href="gone.html"', "no file gone.html"),
    ('alt="Loss against epoch."', 'alt="_images/a.png"', "has no alt text"),
    ('src="_images/a.png"', 'src="_images/broken.png"', "not a valid PNG"),
    ('<span class="caption-number">Fig. 1 </span>', "", "has no number"),
    ('href="#fig-a">Fig. 1</a>', 'href="#top">Fig. 1</a>', "figure fig-a is never referred to"),
    ("loss 0.25", "x.py:3: UserWarning: slow", "stored output shows"),
    ("loss 0.25", "frame #0: c10::Error::Error()", "stored output shows"),
    ("loss 0.25", "Traceback (most recent call last):", "stored output shows"),
    ("loss 0.25", "c10d::ProcessGroupNCCL::Watchdog::runLoop() + 0x17b1", "stored output shows"),
    ("Inline <span", "Inline $a + b$ and <span", "unrendered maths '$a + b$'"),
    ('src="_static/mathjax/tex-chtml.js"', 'src="https://cdn.example/mathjax/tex.js"',
     "MathJax comes from cdn.example, not with the book"),
    ('<script src="_static/mathjax/tex-chtml.js"></script>', "", "no MathJax script"),
])
def test_each_fault_is_reported(tmp_path, capsys, old, new, problem):
    assert old in GOOD
    rc, out = run(tmp_path, GOOD.replace(old, new), capsys)
    assert rc == 1 and problem in out, out


def test_a_one_line_error_naming_a_cxx_exception_is_fine(tmp_path, capsys):
    rc, out = run(tmp_path, GOOD.replace("loss 0.25", "rank 0 failed: c10::DistBackendError: "
                                         "timeout"), capsys)
    assert rc == 0, out


def test_pseudo_maths_only_warns(tmp_path, capsys):
    rc, out = run(tmp_path, GOOD.replace("Inline", "Weight decay 5·10⁻⁴, inline"), capsys)
    assert rc == 0 and "warning: pseudo-maths" in out, out


def test_an_image_outside_a_figure_is_reported(tmp_path, capsys):
    page = GOOD.replace("</div></section>", '<img alt="x" src="_images/a.png"/></div></section>')
    rc, out = run(tmp_path, page, capsys)
    assert rc == 1 and "is not in a numbered figure" in out, out


@pytest.mark.skipif(not shutil.which("chromium"), reason="needs Debian's chromium")
def test_screenshots_in_chromium(tmp_path, capsys):
    html = write_book(tmp_path, GOOD)
    shots = tmp_path / "shots"
    rc = check_book.main([str(html), "--toc", str(tmp_path / "_toc.yml"),
                          "--screenshots", str(shots)])
    out = capsys.readouterr().out
    # the fake PNG has no pixels: Chromium cannot decode it, and says so
    assert rc == 1 and "a.png has no natural size" in out, out
    assert sorted(p.name for p in shots.iterdir()) == ["index.png", "other.png"]

