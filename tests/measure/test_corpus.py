"""The Jane Austen corpus read from the Debian package r-cran-janeaustenr, and user text files.
Tests that read the corpus take the `austen` fixture (tests/conftest.py): without the package they skip."""

from __future__ import annotations

import pytest

from enginesmith.core.errors import UserError
from enginesmith.models import corpus


def test_novels(austen):
    assert corpus.novels() == ["emma", "mansfieldpark", "northangerabbey", "persuasion",
                               "prideprejudice", "sensesensibility"]


def test_pride_and_prejudice(austen):
    text = corpus.austen_text("prideprejudice")
    assert text.startswith("PRIDE AND PREJUDICE\n\nBy Jane Austen\n\n\n\nChapter 1\n\n\n"
                           "It is a truth universally acknowledged, that a single man in possession\n"
                           "of a good fortune, must be in want of a wife.\n\nHowever")
    assert text.endswith("her into Derbyshire, had been the means of uniting them.")
    lines = corpus.austen_lines("prideprejudice")
    assert len(lines) == 13030 and text == "\n".join(lines)
    assert 680_000 < len(text) < 690_000
    assert all(isinstance(line, str) and "\n" not in line for line in lines)


def test_every_novel_reads(austen):
    for name in corpus.novels():
        assert len(corpus.austen_text(name)) > 400_000, name
    assert "Emma Woodhouse, handsome, clever, and rich" in corpus.austen_text("emma").replace("\n", " ")


def test_unknown_novel(austen):
    with pytest.raises(UserError, match="unknown novel") as err:
        corpus.austen_text("ulysses")
    assert "prideprejudice" in err.value.fix


def test_missing_package(monkeypatch, tmp_path):
    for var in ("ENGINESMITH_JANEAUSTENR", "R_LIBS", "R_LIBS_SITE", "R_LIBS_USER"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(corpus, "_LIB_DIRS", (str(tmp_path),))
    corpus._index.cache_clear()
    corpus.austen_lines.cache_clear()
    try:
        with pytest.raises(UserError, match="r-cran-janeaustenr") as err:
            corpus.austen_text()
        assert err.value.fix.startswith("apt-get install -y --no-install-recommends r-cran-janeaustenr")
        with pytest.raises(UserError):
            corpus.load_text(None)
    finally:
        corpus._index.cache_clear()
        corpus.austen_lines.cache_clear()


def test_load_text_file(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("Ünïcode text\nsecond line\n", encoding="utf-8")
    assert corpus.load_text(f) == "Ünïcode text\nsecond line\n"
    assert corpus.load_text(str(f)) == "Ünïcode text\nsecond line\n"


def test_load_text_falls_back_to_corpus(austen):
    assert corpus.load_text(None, novel="persuasion") == corpus.austen_text("persuasion")


@pytest.mark.parametrize("content", [None, b"", b" \n\t\n", b"\xff\xfe bad", "dir"])
def test_load_text_bad_files(tmp_path, content):
    f = tmp_path / "x.txt"
    if content == "dir":
        f.mkdir()
    elif content is not None:
        f.write_bytes(content)
    with pytest.raises(UserError) as err:
        corpus.load_text(f)
    assert err.value.fix
