"""The code corpus (eval/code_corpus.py): read from the pinned sdist in the cache folder, never downloaded by the
loader; a missing or altered tarball is refused naming how to fetch it."""

from __future__ import annotations

import pytest

from trtllm_kivi.eval import code_corpus


def test_missing_and_altered_sdists_are_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("TRTLLM_KIVI_HOME", str(tmp_path))
    assert code_corpus.sdist_path() == tmp_path / "corpora" / code_corpus.SDIST
    with pytest.raises(FileNotFoundError, match=r"python -m trtllm_kivi.eval.code_corpus"):
        code_corpus.load_code_corpus()
    code_corpus.sdist_path().parent.mkdir(parents=True)
    code_corpus.sdist_path().write_bytes(b"not the sdist")
    with pytest.raises(ValueError, match=f"expected {code_corpus.SHA256}"):
        code_corpus.load_code_corpus()


def test_the_real_sdist_when_fetched():
    if not code_corpus.sdist_path().is_file():
        pytest.skip(f"code corpus not fetched: python -m trtllm_kivi.eval.code_corpus ({code_corpus.PIN})")
    text = code_corpus.load_code_corpus()
    assert text.startswith("# file: more_itertools/more.py\n") and "# file: more_itertools/recipes.py\n" in text
    assert "def chunked(" in text and len(text) > 150_000
    assert code_corpus.describe()["license"].startswith("MIT")
