"""Runs a test script in a child process with the C++ extension disabled (the plain-torch fallback)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_without_extension(script: str, timeout: float = 120) -> None:
    """Run `script` with OFFLOAD_DISABLE_EXT=1; it must exit 0 and print 'ok'."""
    env = dict(os.environ, OFFLOAD_DISABLE_EXT="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=ROOT,
                         timeout=timeout)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr
