"""Where the fine-tune's text comes from: the user's file, or (by default) the Python standard library's
own source files, which every machine running this has, read at run time (nothing is downloaded and no
text is copied into this repository).

A data file is one of
  - plain text (any extension but .jsonl): one document;
  - JSONL (.jsonl): one JSON object per line with a "text" field (documents), or with "prompt" and
    "response" fields (pairs: the loss is taken on the response only).
Every problem is reported before training starts, naming the file (and line) and the fix.
"""
from __future__ import annotations

import dataclasses
import json
import sysconfig
from pathlib import Path

from ..errors import InputError


@dataclasses.dataclass(frozen=True)
class Example:
    """One training document, or a prompt/response pair (response set: the loss covers its tokens only)."""

    text: str
    response: str | None = None


class DataError(InputError):
    """A data file that cannot be trained on; the message names the file and the fix."""


STDLIB_CHARS = 6_000_000  # the default corpus: this many characters of the standard library's sources


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_corpus(max_chars: int = STDLIB_CHARS, show_progress: bool = False) -> list[Example]:
    """The standard library's .py files (tests and site-packages excluded), in sorted path order, until
    `max_chars` characters: the same text on every machine with the same Python version. show_progress: a bar
    of the characters read, where reading takes more than a couple of seconds (a cold page cache)."""
    from tqdm import tqdm

    root = stdlib_root()
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
    out, total = [], 0
    bar = tqdm(total=max_chars, desc="reading", unit="char", unit_scale=True, delay=2, disable=not show_progress,
               dynamic_ncols=True)
    for path in sorted(root.rglob("*.py")):
        if skip.intersection(path.relative_to(root).parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # an unreadable file is not worth failing the default run for
        if text.strip():
            out.append(Example(text))
            total += len(text)
            bar.update(min(len(text), max(0, max_chars - bar.n)))
        if total >= max_chars:
            break
    bar.close()
    if not out:
        raise DataError(f"no Python sources found under the standard library at {root}; pass --data FILE")
    return out


def read_data_file(path: str | Path) -> list[Example]:
    """Examples from a plain-text or JSONL file (module docstring), checked line by line."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"--data {p}: no such file; give a plain-text or .jsonl file")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"--data {p}: not UTF-8 (byte {exc.start}: {raw[exc.start:exc.start + 1]!r}); "
                        "convert it, e.g. iconv -f latin1 -t utf-8") from None
    if not text.strip():
        raise DataError(f"--data {p}: the file is empty; give a file with text to train on")
    if p.suffix.lower() != ".jsonl":
        return [Example(text)]
    return [_jsonl_example(p, number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]


def _jsonl_example(path: Path, number: int, line: str) -> Example:
    where = f"--data {path}, line {number}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: not valid JSON ({exc.msg}); each line must be one JSON object") from None
    if not isinstance(obj, dict):
        raise DataError(f"{where}: a JSON {type(obj).__name__}, expected an object with a \"text\" field or "
                        "\"prompt\" and \"response\" fields")
    if "prompt" in obj or "response" in obj:
        for field in ("prompt", "response"):
            if not isinstance(obj.get(field), str):
                raise DataError(f"{where}: a prompt/response pair needs a string \"{field}\" field")
        return Example(obj["prompt"], obj["response"])
    if not isinstance(obj.get("text"), str):
        raise DataError(f"{where}: no string \"text\" field (keys: {sorted(obj)}); give each line a \"text\" "
                        "field, or \"prompt\" and \"response\" fields")
    return Example(obj["text"])
