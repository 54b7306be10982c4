"""Rebuild ``python_reference.txt``, the bundled training corpus, from this Python's own documentation.

The text is the "pydoc topics" table that CPython ships in ``pydoc_data/topics.py``: the Python
Language Reference and Library Reference sections that ``help('TOPIC')`` prints (real English
prose with code examples, PSF License). It is shipped as a plain text file so that training needs
no download; this script only documents how it was made and lets anyone regenerate it::

    python -m recipes.data.build_corpus            # writes recipes/data/python_reference.txt
"""

from __future__ import annotations

import sys
from pathlib import Path

OUT = Path(__file__).with_name("python_reference.txt")
SEPARATOR = "\n\n"


def build() -> str:
    """All pydoc topics, sorted by name, each headed by its name, separated by blank lines."""
    from pydoc_data.topics import topics

    parts = [f"{name}\n{'=' * len(name)}\n\n{topics[name].strip()}\n" for name in sorted(topics)]
    return SEPARATOR.join(parts)


def main() -> None:
    text = build()
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT} ({len(text.encode('utf-8')) / 1e3:.0f} kB, Python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
