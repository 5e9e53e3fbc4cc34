"""The write-up site builder (nbs/_site/build.py): it builds, its verifier catches broken pages, README is in sync."""
import importlib.util
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

ROOT = Path(__file__).resolve().parents[1]


def _load_builder():
    spec = importlib.util.spec_from_file_location("nanoserve_site_build", ROOT / "nbs" / "_site" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


build = _load_builder()


def _nb(*cells):
    nb = new_notebook(cells=list(cells))
    nb.metadata = {"kernelspec": {"display_name": "python3", "language": "python", "name": "python3"}}
    return nb


def test_real_site_builds(tmp_path):
    out = tmp_path / "site"
    problems = build.build_site(out, verbose=False)
    assert problems == [], "site build reported problems:\n" + "\n".join(problems)
    assert (out / "index.html").is_file()
    for nb in build.find_notebooks():
        page = out / nb.relative_to(build.NBS).with_suffix(".html")
        assert page.is_file(), f"no page for {nb.name}"
        assert "<h1" in page.read_text(encoding="utf-8")


def test_verifier_reports_broken_pages(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "ok.png").write_bytes(b"\x89PNG")
    (tmp_path / "other.html").write_text('<html><body><h1 id="top">Other</h1></body></html>')
    (tmp_path / "index.html").write_text(
        '<html><body><h1 id="t">Title</h1>'
        '<a href="other.html">fine</a> <a href="other.html#top">fine anchor</a> <img src="img/ok.png">'
        '<a href="https://example.org/x">external</a> <img src="data:image/png;base64,AAAA">'
        '<a href="missing.html">bad</a> <img src="img/nope.png"> <a href="other.html#nope">bad anchor</a>'
        '<a href="#nowhere">bad local anchor</a> <a href="../outside.html">outside</a>'
        '</body></html>')
    (tmp_path / "untitled.html").write_text("<html><body><p>no title</p></body></html>")
    problems = build.verify_site(tmp_path, ["index.html", "untitled.html", "gone.html"])
    text = "\n".join(problems)
    for needle in ("missing.html", "img/nope.png", "other.html#nope", "#nowhere", "../outside.html",
                   "untitled.html: page has no <h1>", "gone.html: page was not written"):
        assert needle in text, f"verifier did not report {needle!r}; it said:\n{text}"
    assert not any(s in text for s in ("'other.html'", "ok.png", "example.org", "data:")), text
    assert len(problems) == 7, text


def _mini_repo(tmp_path, extra_index_md=""):
    "A tiny repository: nbs/index.ipynb, nbs/01_x.ipynb, nbs/_skip.ipynb, figures/a.png."
    nbs = tmp_path / "nbs"
    nbs.mkdir()
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "a.png").write_bytes(b"\x89PNG fake")
    (tmp_path / "settings.ini").write_text("[DEFAULT]\ntitle = mini\n")
    index = _nb(
        new_markdown_cell("# Mini\n\n> summary\n\n- skip_showdoc: true"),
        new_markdown_cell("See [chapter one](01_x.ipynb), [its section](01_x.ipynb#the-section) and "
                          "![a figure](../figures/a.png) and ![same](figures/a.png)." + extra_index_md),
        new_code_cell("#| hide\nsecret = 1"),
    )
    ch = _nb(
        new_markdown_cell("# Chapter one\n\n> what it does"),
        new_markdown_cell("## The section\n\nBack to [the index](index.ipynb)."),
        new_code_cell("#| export\n# NBVAL_SKIP\ndef f(): return 1", outputs=[]),
        new_code_cell("#| echo: false\nprint('shown output')",
                      outputs=[new_output("stream", name="stdout", text="shown output\n")]),
        new_code_cell("#| hide\nimport os"),
    )
    nbformat.write(index, nbs / "index.ipynb")
    nbformat.write(ch, nbs / "01_x.ipynb")
    nbformat.write(_nb(new_markdown_cell("# Skipped")), nbs / "_skip.ipynb")
    return nbs


def test_links_images_and_directives(tmp_path):
    nbs = _mini_repo(tmp_path)
    out = tmp_path / "site"
    problems = build.build_site(out, nbs=nbs, verbose=False)
    assert problems == [], "\n".join(problems)
    assert sorted(p.name for p in out.glob("*.html")) == ["01_x.html", "index.html"]
    assert (out / "figures" / "a.png").read_bytes() == b"\x89PNG fake"
    index = (out / "index.html").read_text(encoding="utf-8")
    assert 'href="01_x.html"' in index and 'href="01_x.html#the-section"' in index
    assert 'src="figures/a.png"' in index and "../figures/a.png" not in index
    assert "secret" not in index and "skip_showdoc" not in index
    assert ">Chapter one</a>" in index                      # sidebar lists chapters by title
    ch = (out / "01_x.html").read_text(encoding="utf-8")
    assert "#|" not in ch and "NBVAL_SKIP" not in ch and "import os" not in ch
    assert "shown output" in ch and "print(" not in ch         # echo: false keeps only the output
    assert 'href="index.html"' in ch


def test_build_reports_broken_notebook_link(tmp_path):
    nbs = _mini_repo(tmp_path, extra_index_md=" Also [a chapter that is not there](02_missing.ipynb).")
    problems = build.build_site(tmp_path / "site", nbs=nbs, verbose=False)
    assert any("02_missing.ipynb" in p and p.startswith("index.html") for p in problems), problems


def test_committed_error_output_is_a_problem():
    err = new_output("error", ename="ValueError", evalue="boom", traceback=[])
    nb = _nb(new_markdown_cell("# T"), new_code_cell("raise ValueError('boom')", outputs=[err]))
    _, problems = build.process_notebook(nb, "t.html")
    assert problems and "ValueError: boom" in problems[0]
    ok = _nb(new_markdown_cell("# T"), new_code_cell("#| error: true\nraise ValueError('boom')", outputs=[err]))
    assert build.process_notebook(ok, "t.html")[1] == []


def test_readme_in_sync():
    assert build.readme_in_sync(), (
        "README.md is out of date with nbs/index.ipynb. Regenerate it with:\n"
        "    .venv/bin/python nbs/_site/build.py --readme")


def test_readme_links_point_into_repo():
    text = build.readme_markdown()
    assert "](nbs/00_block_manager.ipynb)" in text or "00_block_manager" not in text
    assert "](00_" not in text and "](01_" not in text


def test_refuses_to_clobber_a_foreign_folder(tmp_path):
    (tmp_path / "keep.txt").write_text("precious")
    problems = build.build_site(tmp_path, verbose=False)
    assert problems and "refusing" in problems[0]
    assert (tmp_path / "keep.txt").read_text() == "precious"


def _png_output():
    return new_output("display_data", data={"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"})


def test_every_image_needs_a_real_alt_text(tmp_path):
    nbs = _mini_repo(tmp_path, extra_index_md=" Bare ![](../figures/a.png), named ![a.png](../figures/a.png).")
    ch = nbformat.read(nbs / "01_x.ipynb", as_version=4)
    ch.cells += [new_code_cell("plot()", outputs=[_png_output()]),
                 new_code_cell("#| fig-alt: Throughput against batch size, one line per backend\nplot()",
                               outputs=[_png_output()])]
    nbformat.write(ch, nbs / "01_x.ipynb")
    problems = build.build_site(tmp_path / "site", nbs=nbs, verbose=False)
    text = "\n".join(problems)
    assert len(problems) == 3, text
    assert "index.html: image 'figures/a.png' has no alt text" in text
    assert "only its file name as alt text ('a.png'" in text
    assert "nbs/01_x.ipynb, code cell 5 has no alt text" in text and "fig-alt" in text   # the cell without one
    page = (tmp_path / "site" / "01_x.html").read_text(encoding="utf-8")
    assert 'alt="Throughput against batch size, one line per backend"' in page
    assert 'alt="" data-ns-source="nbs/01_x.ipynb, code cell 5"' in page and build.NO_ALT not in page


def test_alt_text_check_on_a_page(tmp_path):
    (tmp_path / "a.html").write_text(
        '<html><body><h1>A</h1><img src="x.png" alt="A bar chart of the decode step per batch size">'
        f'<img src="data:image/png;base64,AAAA" alt="{build.NO_ALT}"><img src="y.png" alt=" ">'
        '<img src="plots/kv_waste.png" alt="kv waste"><img src="z.png"></body></html>')
    text = "\n".join(build.check_alt_text(tmp_path))
    assert "x.png" not in text and text.count("has no alt text") == 3 and "'kv waste'" in text, text


def test_figure_alt_directive():
    assert build.figure_alt("#| fig-alt: The KV Cache, by block\nplot()") == "The KV Cache, by block"
    assert build.figure_alt('#| fig-cap: "A caption"\nplot()') == "A caption"
    assert build.figure_alt("#| fig-cap: cap\n#| fig-alt: alt\n") == "alt"
    assert build.figure_alt("plot()") is None


def test_pages_carry_the_course_styles(tmp_path):
    "Code blocks spaced and shaded, wide blocks scroll instead of wrapping, tables never break a word."
    nbs = _mini_repo(tmp_path)
    assert build.build_site(tmp_path / "site", nbs=nbs, verbose=False) == []
    page = (tmp_path / "site" / "01_x.html").read_text(encoding="utf-8")
    ours = page.index(build.CSS.strip()[:40])
    assert ours > page.index("jp-OutputArea-output pre")        # after nbconvert's rules, so ours win
    css = " ".join(build.CSS.split())
    for rule in ("white-space: pre; word-break: normal", "overflow-x: auto", "table-layout: auto",
                 "overflow-wrap: normal", ".jp-CodeCell .jp-InputArea-editor { background"):
        assert rule in css, rule
    assert "break-all" not in css
