"""The code's `# See [Note: name] in docs/zero-runtime.md` comments name notes the document has, so a renamed or
removed note cannot leave a citation pointing nowhere."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CITATION = re.compile(r"# See \[Note: ([^\]]+)\] in docs/zero-runtime\.md")
NOTE = re.compile(r"^\*\*\[Note: ([^\]]+)\]\*\*", re.MULTILINE)


def test_every_citation_names_a_note_of_the_document():
    notes = set(NOTE.findall((REPO / "docs" / "zero-runtime.md").read_text()))
    cited = {(path.relative_to(REPO), name) for path in (REPO / "offload").rglob("*.py")
             for name in CITATION.findall(path.read_text())}
    assert cited, "no file cites a note"
    unknown = sorted(f"{path}: {name}" for path, name in cited if name not in notes)
    assert not unknown, f"citations of notes docs/zero-runtime.md does not have (it has {sorted(notes)}): {unknown}"
