"""The README's two set-up commands stay true: CI runs the very test command the README gives."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _commands(text):
    return [line.strip() for line in re.findall(r"```(?:bash|sh)\n(.*?)```", text, re.S) for line in line.splitlines()]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_cmd = next(c for c in _commands(readme) if "pytest" in c)
    # CI invokes python through python3 -m; compare the steps, not the interpreter spelling.
    norm = lambda s: re.sub(r"\bpython3? -m ", "", s).replace("&&", "\n")
    steps = [s.strip() for s in norm(test_cmd).splitlines() if s.strip()]
    ci_norm = norm(ci)
    for step in steps:
        assert step in ci_norm, f"README test step not run by .ci/run: {step!r}"
