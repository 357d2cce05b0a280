"""Nothing hidden: every OFFLOAD_* environment variable is read through offload/env.py's table, and
docs/environment.md shows that table as it is."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from offload import env

REPO = Path(__file__).resolve().parent.parent
NAME = re.compile(r"(?<![A-Za-z0-9_])OFFLOAD_[A-Z0-9_]+")  # not _DS_OFFLOAD_IGNORED


def _sources() -> list[Path]:
    return [p for p in sorted((REPO / "offload").rglob("*.py")) if p != REPO / "offload" / "env.py"] + \
        [REPO / "setup.py", REPO / "tests" / "cuda_common.py"]


def _literal_names(path: Path) -> list[tuple[int, str]]:
    """String constants that are exactly an OFFLOAD_* name: how a read (os.environ.get, getenv, a subscript, a
    constant handed to one) names its variable. Messages that mention a name ("OFFLOAD_DEBUG=1 shows ...") are
    longer than the name and pass."""
    tree = ast.parse(path.read_text(), str(path))
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value)]


def test_no_offload_variable_is_read_outside_the_table():
    found = [f"{p.relative_to(REPO)}:{line}: {name}" for p in _sources() for line, name in _literal_names(p)]
    assert not found, "read these through offload/env.py (add the variable to its table): " + "; ".join(found)


def test_the_check_finds_a_read_that_goes_around_the_table(tmp_path):
    sneaky = tmp_path / "sneaky.py"
    sneaky.write_text('import os\nx = os.environ.get("OFFLOAD_SOMETHING", "1")\nmsg = "OFFLOAD_DEBUG=1 shows it"\n')
    assert _literal_names(sneaky) == [(2, "OFFLOAD_SOMETHING")]


def test_the_table_is_complete_and_each_variable_is_described():
    names = [v.name for v in env.VARIABLES]
    assert len(names) == len(set(names)), names
    for v in env.VARIABLES:
        assert NAME.fullmatch(v.name), v
        assert v.audience in ("user", "build", "tests"), v
        assert v.kind and v.default and v.read_by and v.changes, v
    # every name the package's code or messages mention is in the table (a message naming a removed variable
    # would send a user to a switch that does nothing)
    mentioned = {m for p in _sources() for m in NAME.findall(p.read_text())}
    mentioned -= {"OFFLOAD_HAVE_LIBURING", "OFFLOAD_STATE"}  # a C++ define; a Python constant (a directory name)
    assert mentioned <= set(names), sorted(mentioned - set(names))


def test_docs_show_the_table_as_it_is():
    docs = (REPO / "docs" / "environment.md").read_text()
    assert env.markdown_table() in docs, "docs/environment.md is stale: paste the output of python -m offload.env"
    for v in env.VARIABLES:
        assert f"`{v.name}`" in docs


def test_python_m_offload_env_prints_the_table():
    out = subprocess.run([sys.executable, "-m", "offload.env"], capture_output=True, text=True, check=True,
                         cwd=REPO).stdout
    assert out == env.markdown_table()


@pytest.mark.parametrize("value, on", [(None, False), ("", False), ("0", False), ("1", True), (" 1 ", True),
                                       ("yes", True)])
def test_a_flag_is_on_when_set_to_anything_but_empty_or_zero(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(env.DEBUG.name, raising=False)
    else:
        monkeypatch.setenv(env.DEBUG.name, value)
    assert env.DEBUG.on() is on


def test_an_unset_or_blank_variable_reads_as_its_fallback(monkeypatch):
    monkeypatch.delenv(env.NUMA_NODE.name, raising=False)
    assert env.NUMA_NODE.get() == "auto"
    monkeypatch.setenv(env.NUMA_NODE.name, "  ")
    assert env.NUMA_NODE.get() == "auto"
    monkeypatch.setenv(env.NUMA_NODE.name, " 1 ")
    assert env.NUMA_NODE.get() == "1"


def test_env_imports_neither_torch_nor_the_rest_of_offload():
    """setup.py reads OFFLOAD_BUILD_EXT through it before torch may be installed."""
    code = ("import sys; import offload.env; "
            "assert 'torch' not in sys.modules, 'torch'; "
            # the package's face and its version (offload/version.py: a constant) come with it, nothing else
            "assert sorted(m for m in sys.modules if m.startswith('offload')) == "
            "['offload', 'offload.env', 'offload.version']")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
