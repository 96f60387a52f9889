"""Check the built book page by page, as the toc lists it: `check_book.py _build/html`.

Relative links and #anchors resolve; images have alt text, are valid PNG/SVG/JPEG files and sit
in numbered figures that a page refers to; stored outputs show no Python warning, C++ stack
frame or traceback; prose has no unrendered `$...$` (pseudo-maths there only warns). Chromium
screenshots every page (--screenshots DIR) and loads every image. One line per problem.
"""

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

# A C++ stack frame, not a one-line error that names a C++ exception type (c10::...Error)
BAD_OUTPUT = re.compile(r"\b\w*Warning: |frame #\d+|\bc10d?::(?:\w+::)+\w+\(|Exception raised from"
                        r"|Traceback \(most recent call last\)")
UNRENDERED_MATH = re.compile(r"(?<![\\\w$])\$\$?(?=\S)[^$\n]*?(?<=\S)\$\$?(?!\w)")
_P = "[∂ᵀ·√∑⁻⁰¹²³⁴⁵⁶⁷⁸⁹₀₁₂₃₄₅₆₇₈₉]"  # Unicode pseudo-maths; nearby ones make one match
PSEUDO_MATH = re.compile(rf".{{0,25}}{_P}(?:.{{0,30}}{_P})*.{{0,20}}", re.S)
CODE_TAGS = {"pre", "code", "script", "style", "kbd", "samp", "tt", "textarea"}
VOID_TAGS = set("area base br col embed hr img input link meta source track wbr".split())
MAGIC = {".png": b"\x89PNG\r\n\x1a\n", ".jpg": b"\xff\xd8\xff", ".jpeg": b"\xff\xd8\xff"}
BROWSER = shutil.which("chromium") or shutil.which("chromium-browser") or ""


class Page(HTMLParser):
    """One page, parsed once: ids, links (href, src), images (attributes, inside a figure?),
    figures ([id, numbered?]), the text of each stored output, and the prose (article text
    outside code, maths and outputs); ``stack`` holds (tag, kind) of the open elements."""

    def __init__(self, path: Path):
        super().__init__(convert_charrefs=True)
        self.stack, self.ids, self.refs, self.imgs, self.figures = [], set(), [], [], []
        self.outputs, self.prose, self.math, self.mathjax = [], [], False, ""
        self.feed(path.read_text(encoding="utf-8"))

    def handle_starttag(self, tag, attrs):
        a = {k: v or "" for k, v in attrs}
        cls = a.get("class", "").split()
        self.ids.update(v for k, v in a.items() if k in ("id", "name") and v)
        self.refs += [a[k] for k in ("href", "src") if a.get(k)]
        if tag == "script" and "mathjax" in a.get("src", "").lower():
            self.mathjax = a["src"]
        self.math |= "math" in cls
        if tag == "img":
            self.imgs.append((a, "figure" in {kind for _, kind in self.stack}))
        elif tag == "figure":
            self.figures.append([a.get("id", ""), False])
        elif tag == "span" and "caption-number" in cls and self.figures:
            self.figures[-1][1] = True
        if "cell_output" in cls:
            self.outputs.append("")
        kind = ("output" if "cell_output" in cls else "code" if tag in CODE_TAGS or "math" in cls
                else tag if tag in ("article", "figure") else "")
        if tag not in VOID_TAGS:
            self.stack.append((tag, kind))

    def handle_endtag(self, tag):  # closes whatever was left open inside it, too
        tags = [t for t, _ in self.stack]
        if tag in tags:
            del self.stack[len(tags) - 1 - tags[::-1].index(tag):]

    def handle_data(self, data):
        kinds = {kind for _, kind in self.stack}
        if "output" in kinds:
            self.outputs[-1] += data
        elif "article" in kinds and "code" not in kinds:
            self.prose.append(data)


def toc_pages(toc: Path) -> list[str]:
    """The files of the toc in order, root first, without suffix."""
    return re.findall(r"^\s*(?:- )?(?:root|file):\s*(\S+)\s*$", toc.read_text(), re.M)


def valid_image(path: Path) -> bool:
    head, suffix = path.read_bytes()[:4096], path.suffix.lower()
    return b"<svg" in head if suffix == ".svg" else head.startswith(MAGIC.get(suffix, b"?!"))


def check_page(root: Path, path: Path, load) -> tuple[list[str], list[str], list[Path]]:
    """Problems and warnings of one page, and the image files it shows."""
    page, probs, warns, images = load(path), [], [], []
    for ref in page.refs:
        url = urlsplit(ref)
        if url.scheme or ref.startswith("//") or ref == "#":
            continue
        target = (path.parent / unquote(url.path)).resolve() if url.path else path
        target = target / "index.html" if target.is_dir() else target
        if root not in target.parents:
            probs.append(f"link {ref!r} points outside the built book")
        elif not target.is_file():
            probs.append(f"link {ref!r}: no file {target.relative_to(root)}")
        elif url.fragment and target.suffix == ".html" and unquote(url.fragment) not in load(
                target).ids:
            probs.append(f"link {ref!r}: no anchor #{url.fragment} in {target.name}")
    probs += [f"figure {i or '(no id)'} has no number" for i, numbered in page.figures
              if not numbered]
    for attrs, in_figure in page.imgs:
        src, alt = attrs.get("src", ""), attrs.get("alt", "").strip()
        if not alt or alt == src or Path(alt).suffix.lower() in (".png", ".svg", ".jpg", ".jpeg"):
            probs.append(f"image {src[:60]!r} has no alt text")
        if urlsplit(src).scheme:
            continue
        file = (path.parent / unquote(urlsplit(src).path)).resolve()
        if not file.is_file() or not valid_image(file):
            probs.append(f"image {src!r} is missing or not a valid PNG/SVG/JPEG")
            continue
        images.append(file)
        if file.parent == root / "_images" and not in_figure:
            probs.append(f"image {file.name[:16]}... is not in a numbered figure")
    probs += [f"stored output shows {line.strip()[:110]!r}" for text in page.outputs
              for line in text.splitlines() if BAD_OUTPUT.search(line)]
    prose = "".join(page.prose)
    probs += [f"unrendered maths {m.group(0)[:60]!r}" for m in UNRENDERED_MATH.finditer(prose)]
    if page.math and not page.mathjax:
        probs.append("maths on the page but no MathJax script")
    elif page.math and urlsplit(page.mathjax).scheme:  # a CDN: no maths without the network
        probs.append(f"MathJax comes from {urlsplit(page.mathjax).netloc}, not with the book")
    warns += [f"pseudo-maths {' '.join(m.group(0).split())!r}" for m in PSEUDO_MATH.finditer(prose)]
    return probs, warns, images


def chromium(args: list[str]) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:  # a profile each, so runs in parallel
        return subprocess.run([BROWSER, "--headless", "--disable-gpu", "--no-sandbox",
                               f"--user-data-dir={profile}", *args],
                              capture_output=True, text=True, timeout=120)


def screenshot(page: Path, out: Path) -> str | None:
    chromium([f"--screenshot={out}", "--window-size=1280,2000", "--hide-scrollbars", page.as_uri()])
    ok = out.is_file() and out.stat().st_size > 2000 and valid_image(out)
    return None if ok else f"no screenshot of {page.name} in {out}"


def image_sizes(images: list[Path]) -> list[str]:
    """Load every image in Chromium; those that decode to nothing come back as problems."""
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "images.html"
        tags = "".join(f'<img src="{p.as_uri()}">' for p in images)
        probe.write_text(f"<html><body>{tags}<script>window.onload = () => {{ for (const i of "
                         "document.images) if (!i.naturalWidth || !i.naturalHeight) "
                         "document.body.append('ZERO ' + i.src + ' '); "
                         "document.body.append('DONE'); };</script></body></html>")
        dom = chromium(["--dump-dom", "--virtual-time-budget=10000", probe.as_uri()]).stdout
    if "DONE" not in dom:
        return ["the image probe page did not finish loading in Chromium"]
    return [f"image {unquote(m)} has no natural size in Chromium"
            for m in re.findall(r"ZERO file://(\S+)", dom)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("html", type=Path, help="the built book, e.g. _build/html")
    p.add_argument("--toc", type=Path, default=Path(__file__).resolve().parents[1] / "_toc.yml")
    p.add_argument("--screenshots", type=Path, help="write a screenshot of every page here")
    p.add_argument("--no-browser", action="store_true", help="skip the Chromium checks")
    args = p.parse_args(argv)
    t0, root, parsed = time.monotonic(), args.html.resolve(), {}
    load = lambda path: parsed.get(path) or parsed.setdefault(path, Page(path))  # noqa: E731
    pages = {name: root / f"{name}.html" for name in toc_pages(args.toc)}
    problems, warnings, images, done = [], [], [], ""
    for name, path in pages.items():
        if not path.is_file():
            problems.append(f"{name}: in the toc but not built")
            continue
        probs, warns, imgs = check_page(root, path, load)
        problems += [f"{name}: {x}" for x in dict.fromkeys(probs)]
        warnings += [f"{name}: warning: {x}" for x in dict.fromkeys(warns)]
        images += imgs
    links = [r for page in list(parsed.values()) for r in page.refs if "#" in r]
    problems += [f"{name}: figure {fig} is never referred to" for name, path in pages.items()
                 if path in parsed for fig, _ in parsed[path].figures
                 if fig and sum(r.endswith(f"#{fig}") for r in links) < 2]
    if args.no_browser:
        print("check_book: --no-browser: no screenshots, images not loaded in Chromium")
    elif not BROWSER:
        problems.append("chromium not found: apt-get install chromium, or pass --no-browser")
    else:
        out = args.screenshots or Path(tempfile.mkdtemp(prefix="book-screenshots-"))
        out.mkdir(parents=True, exist_ok=True)
        built = [(path, out / f"{name.replace('/', '__')}.png") for name, path in pages.items()
                 if path.is_file()]
        with ThreadPoolExecutor(max_workers=3) as pool:
            problems += [x for x in pool.map(lambda job: screenshot(*job), built) if x]
        problems += image_sizes(sorted(set(images)))
        done = f", {len(built)} screenshots in {out}"
    print("".join(f"{line}\n" for line in warnings + problems), end="")
    print(f"check_book: {len(pages)} pages, {len(set(images))} images, {len(problems)} problems,"
          f" {len(warnings)} warnings{done} ({time.monotonic() - t0:.0f} s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
