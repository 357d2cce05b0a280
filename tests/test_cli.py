"""The `offload` command and the extension loader: built here, and a clear fallback when it cannot be."""
import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

from offload import __version__, _ext
from offload._build_spec import build_spec

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "offload.cli", *args],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, **(env or {})}, timeout=300,
    )


def test_version():
    out = run_cli("--version")
    assert out.returncode == 0
    assert out.stdout.strip() == f"offload {__version__}"


@pytest.mark.parametrize("argv", [["--version"], ["--help"], [], ["plna"]], ids=["version", "help", "none", "typo"])
def test_help_version_and_a_typo_import_no_subcommand(argv):
    """They import no subcommand's module, so not torch (3 s of CPU before a word, measured); the top-level help
    still lists every subcommand with its line; a command imports its own module and not the others'."""
    code = ("import sys; from offload.cli import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            "print('IMPORTED', sorted(m for m in ('torch', 'offload.plan.cli', 'offload.bench.cli')\n"
            "                         if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert "IMPORTED []" in out.stdout, out.stdout + out.stderr
    if argv in (["--help"], []):
        listed = out.stdout + out.stderr
        assert all(name in listed for name in ("env", "bench", "finetune", "export", "plan")), listed
    if argv == ["plna"]:
        assert "invalid choice: 'plna'" in out.stderr, out.stderr


def test_a_command_builds_its_own_parser_only():
    from offload.cli import build_parser

    plan = dict(next(a for a in build_parser(only="plan")._actions if getattr(a, "choices", None)).choices)
    assert "--model" in plan["plan"].format_help()
    assert "--model" not in plan["finetune"].format_help()  # the others are their help line alone
    assert "--model" in dict(next(a for a in build_parser()._actions if getattr(a, "choices", None)).choices)[
        "finetune"].format_help()  # the whole parser (tests, docs) has every subcommand's flags


def test_env_reports_built_extension():
    out = run_cli("env", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["offload"] == __version__
    assert info["extension_built"] is True, info["extension_error"]
    assert info["cpu_isa_best"] in ("avx512", "avx2", "scalar")
    assert info["kernel_threads"] >= 1
    # what the budgets are sized against and how much may be page-locked (issue 21)
    from offload.store import format_bytes, host_memory

    assert info["host_memory"].startswith(format_bytes(host_memory()[0]) + " total")
    assert info["memlock_limit"] and info["numa_nodes"] >= 1


def test_env_reports_the_cuda_allocator_settings_and_finetune_prefers_expandable_segments():
    """`offload env` shows PYTORCH_CUDA_ALLOC_CONF; `offload finetune` (a process whose CUDA work is all ours) sets
    expandable_segments:True when the user set nothing, and leaves a user's setting alone."""
    from offload.device import EXPANDABLE_SEGMENTS, prefer_expandable_segments

    out = run_cli("env", "--json", env={"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"})
    assert json.loads(out.stdout)["cuda_alloc_conf"] == "max_split_size_mb:64"
    environ = {}
    assert prefer_expandable_segments(environ) and environ == {"PYTORCH_CUDA_ALLOC_CONF": EXPANDABLE_SEGMENTS}
    for theirs in ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}, {"PYTORCH_ALLOC_CONF": "backend:native"}):
        environ = dict(theirs)
        assert not prefer_expandable_segments(environ) and environ == theirs


def test_env_without_extension_says_why():
    out = run_cli("env", "--json", env={"OFFLOAD_DISABLE_EXT": "1"})
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["extension_built"] is False
    assert "OFFLOAD_DISABLE_EXT" in info["extension_error"]


def test_require_names_the_fix_when_missing():
    code = "from offload import _ext\ntry:\n    _ext.require()\nexcept RuntimeError as e:\n    print(e)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "OFFLOAD_DISABLE_EXT": "1"}, timeout=120)
    assert "not available" in out.stdout and "g++" in out.stdout


def test_missing_compiler_falls_back_instead_of_crashing(tmp_path):
    # A PATH without c++/g++ and a fresh build dir: loading must fail softly with the reason.
    code = "from offload import _ext\nprint(_ext.get() is None)\nprint(_ext.error())\n"
    env = {**os.environ, "OFFLOAD_BUILD_DIR": str(tmp_path / "build"), "CXX": "/nonexistent/c++",
           "PATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "True", out.stdout
    assert lines[1] and lines[1] != "None"
    # the build was attempted, so the user was told, and told it ended: why, and that the fallback runs
    assert re.search(r"offload: building the C\+\+ extension \(first use only; \d+ sources, about \d+-\d+ min on "
                     rf"\d+ cores at load [\d.]+\); cached in {re.escape(str(tmp_path / 'build'))}",
                     out.stderr), out.stderr
    failed = [line for line in out.stderr.splitlines() if "building the C++ extension failed after" in line]
    assert len(failed) == 1 and "plain-torch fallback" in failed[0], out.stderr
    assert re.search(r"failed after \d+ s: \S.{10,}; every kernel", failed[0]), failed[0]  # the cause, in that line


_TINY_MODULE = """#include <Python.h>
static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "offload_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit_offload_C(void) { return PyModule_Create(&def); }
"""


def test_a_build_is_announced_a_cached_load_is_not(tmp_path):
    """A compile prints one line before and one after; loading the cached build prints nothing. A one-file
    module (OFFLOAD_CSRC) keeps the real ninja build to a second or two."""
    csrc, build = tmp_path / "csrc", tmp_path / "build"
    csrc.mkdir()
    (csrc / "module.cpp").write_text(_TINY_MODULE)
    code = "from offload import _ext\nprint(_ext._load().__name__)\n"
    env = {"OFFLOAD_CSRC": str(csrc), "OFFLOAD_BUILD_DIR": str(build)}
    first = _in_child(code, **env)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == "offload_C"
    said = first.stderr.splitlines()
    start = next(i for i, line in enumerate(said)
                 if line.startswith("offload: building the C++ extension (first use only; 1 sources,"))
    assert said[start].endswith(f"; cached in {build}"), said[start]
    assert re.fullmatch(r"offload: \[1/1\] compiled module \(\d+ s\)", said[start + 1]), first.stderr  # progress
    assert re.fullmatch(r"offload: built the C\+\+ extension in \d+ s", said[start + 2]), first.stderr
    again = _in_child(code, **env)
    assert again.returncode == 0 and again.stdout.strip() == "offload_C", again.stderr
    assert "offload: build" not in again.stderr
    # a source newer than the build is compiled again by ninja, and announced again
    import time as _time

    hour_ago = _time.time() - 3600
    for f in build.iterdir():
        os.utime(f, (hour_ago, hour_ago))
    edited = _in_child(code, **env)
    assert edited.returncode == 0, edited.stderr
    assert "offload: building the C++ extension" in edited.stderr and "offload: built" in edited.stderr
    assert (build / "offload_C.so").stat().st_mtime > hour_ago + 60  # it really was rebuilt


def test_the_cached_real_extension_loads_without_a_build_line():
    import importlib.util

    if importlib.util.find_spec("offload._C") is not None:
        pytest.skip("the extension was built ahead of time (no JIT build)")
    _ext.require()  # builds here if the cache is stale, so the child only loads
    out = _in_child("import offload.ops as o; print(o.active_isa())")
    assert out.returncode == 0, out.stderr
    assert "offload: build" not in out.stderr


def test_kernel_threads_and_isa_controls():
    mod = _ext.require()
    before = mod.num_threads()
    try:
        mod.set_num_threads(3)
        assert mod.num_threads() == 3
        mod.set_num_threads(0)
        assert mod.num_threads() == mod.usable_cores()
        with pytest.raises(ValueError, match="n must be between"):
            mod.set_num_threads(-1)
    finally:
        mod.set_num_threads(before)
    with pytest.raises(ValueError, match="isa must be"):
        mod.set_isa("sse9")
    mod.set_isa("scalar")
    assert mod.active_isa() == "scalar"
    mod.set_isa("auto")
    assert mod.active_isa() == mod.best_isa()


def test_every_source_is_built_and_names_are_unique():
    spec = build_spec()
    names = [Path(s).name for s in spec.sources]
    assert len(names) == len(set(names))
    assert any(n == "module.cpp" for n in names)


def test_liburing_needs_its_header_and_its_library(tmp_path, monkeypatch):
    from offload._build_spec import include_dirs, liburing_found

    inc, lib, elsewhere = (tmp_path / n for n in ("include", "lib", "elsewhere"))
    for d in (inc, lib, elsewhere):
        d.mkdir()
    assert not liburing_found([str(inc)], [str(lib)])
    (inc / "liburing.h").write_text("/* liburing */\n")
    assert not liburing_found([str(inc)], [str(lib)])  # header only: linking -luring would fail
    (elsewhere / "liburing.so").write_bytes(b"")
    assert not liburing_found([str(inc)], [str(lib)])  # the library where the linker does not look
    (lib / "liburing.so").write_bytes(b"")
    assert liburing_found([str(inc)], [str(lib)])
    monkeypatch.setenv("CPATH", f"{inc}{os.pathsep}{elsewhere}")  # the compiler's own search path counts too
    assert include_dirs()[:2] == [str(inc), str(elsewhere)] and "/usr/include" in include_dirs()


def _in_child(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **env}, timeout=300)


def test_thread_and_isa_settings_from_the_environment():
    out = _in_child("import offload.ops as o; print(o.num_threads(), o.active_isa())",
                    OFFLOAD_NUM_THREADS="3", OFFLOAD_ISA="scalar")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3", "scalar"]


def test_bad_thread_setting_names_the_variable():
    out = _in_child("import offload.ops as o; o.num_threads()", OFFLOAD_NUM_THREADS="many")
    assert out.returncode != 0
    assert "OFFLOAD_NUM_THREADS must be a whole number" in out.stderr
    out = _in_child("import offload.ops as o; o.num_threads()", OFFLOAD_ISA="sse9")
    assert out.returncode != 0
    assert "OFFLOAD_ISA" in out.stderr and "isa must be" in out.stderr


def test_python_settings_change_the_kernels():
    import offload.ops as ops

    before = ops.num_threads()
    try:
        ops.set_num_threads(1)
        assert ops.num_threads() == 1
        ops.set_isa("avx2" if _ext.require().best_isa() != "scalar" else "scalar")
        assert ops.active_isa() in ("avx2", "scalar")
    finally:
        ops.set_num_threads(before)
        ops.set_isa("auto")
    assert ops.active_isa() == _ext.require().best_isa()


def test_bench_memcpy_adam_pcie_all_write_json_and_plot(tmp_path, capsys):
    """Small sizes: the figures are there and positive, the JSON describes the machine, the PNG is written;
    without a GPU the pcie bench says so in one line and exits 0."""
    import json as _json

    from offload.cli import main as cli_main

    out = tmp_path / "all.json"
    rc = cli_main(["bench", "all", "--sizes", "4MiB", "--rounds", "2", "--numel", "1e6", "--json", str(out),
                   "--plot", str(tmp_path / "all.png")])
    text = capsys.readouterr().out
    assert rc == 0
    r = _json.loads(out.read_text())
    assert r["memcpy"]["best_GBps"] > 0 and all(row["GBps"] > 0 for row in r["memcpy"]["rows"])
    assert r["adam"]["offload_params_per_s"] > 0 and r["adam"]["torch_fused_params_per_s"] > 0
    assert r["machine"]["ram_bytes"] > 0 and r["machine"]["cpus"] >= 1 and "filesystems" in r["machine"]
    assert (tmp_path / "all.png").stat().st_size > 1000
    import torch

    if not torch.cuda.is_available():
        assert "pcie: no CUDA device on this machine; nothing to measure" in text
        assert r["pcie"] == {"available": False, "reason": "no CUDA device"}
    assert "nvme: skipped" in text


def test_bench_plot_that_cannot_be_written_stops_before_measuring(tmp_path, capsys):
    """A --plot (or --json) that would fail after minutes of measurement is refused first, in one line."""
    from offload.cli import main as cli_main

    (tmp_path / "afile").write_text("")
    cases = [
        (["--plot", str(tmp_path / "afile" / "x.png")], "--plot", "cannot be written (Not a directory)"),
        (["--plot", str(tmp_path)], "--plot", "is a directory; give a file name"),
        (["--plot", str(tmp_path / "x.docx")], "--plot", "cannot write .docx images; end the name in .png"),
        (["--json", str(tmp_path / "no" / "r.json")], "--json", "cannot be written (No such file or directory)"),
    ]
    for extra, flag, why in cases:
        rc = cli_main(["bench", "all", "--sizes", "4MiB", "--rounds", "1", "--numel", "1e5", *extra])
        out, err = capsys.readouterr()
        assert rc == 2
        assert err.startswith(f"offload bench: error: {flag} {extra[1]}: ") and why in err, err
        assert len(err.splitlines()) == 1 and "; " in err
        assert out == ""  # no bench ran: each prints its figures
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # nothing left behind by the check


def test_bench_plot_without_matplotlib_says_so_before_measuring(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None\n"  # as if it were not installed
            "from offload.cli import main\n"
            f"sys.exit(main(['bench', 'memcpy', '--plot', {str(tmp_path / 'm.png')!r}]))\n")
    out = _in_child(code)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"offload bench: error: --plot {tmp_path / 'm.png'}: matplotlib cannot be imported")
    assert out.stderr.rstrip().endswith("pip install matplotlib, or drop --plot")
    assert out.stdout == ""


def test_unset_isa_takes_the_faster_path_for_adamw():
    """Without OFFLOAD_ISA an AVX-512 CPU times AdamW on AVX-512 and AVX2 at load and keeps the faster (a CPU
    that double-pumps 512-bit vectors runs AVX2 faster); every path gives the same bits."""
    code = ("import offload.ops as o; from offload import _ext; m = _ext.require(); "
            "print(m.best_isa(), o.active_isa(), '|', _ext.ISA_CHOICE['reason'])")
    env = {k: v for k, v in os.environ.items() if k != "OFFLOAD_ISA"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    best, active, _, reason = out.stdout.split(maxsplit=3)
    if best != "avx512":
        pytest.skip("no AVX-512 on this CPU: nothing to choose")
    assert active in ("avx512", "avx2")
    assert re.match(rf"{active}: AdamW timed at load, avx512 [0-9.]+ vs avx2 [0-9.]+ G params/s", reason), reason


def test_bench_nvme_on_two_paths_streams_both_at_once(tmp_path, capsys):
    """Two directories (here on one disk): the sweep runs on the first, then both are streamed at once; the
    plan reads the aggregate."""
    import json as _json

    from offload.cli import main as cli_main

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()  # (a --path that does not exist is refused)
    rc = cli_main(["bench", "nvme", "--path", str(a), "--path", str(b), "--size", "8MiB", "--block-sizes", "1MiB",
                   "--queue-depths", "4", "--rounds", "1", "--no-fio", "--json", str(tmp_path / "n.json")])
    text = capsys.readouterr().out
    assert rc == 0
    striped = _json.loads((tmp_path / "n.json").read_text())["nvme"]["striped"]
    assert striped["paths"] == [str(a), str(b)] and len(striped["read_alone_gbps"]) == 2
    assert striped["read_striped_gbps"] > 0 and striped["write_striped_gbps"] > 0
    assert "striped read:" in text
    assert not list(a.iterdir()) and not list(b.iterdir())  # test files removed
    from offload.bench.figures import bench_figures

    assert bench_figures(str(tmp_path / "n.json"), "--bench-json")["nvme_read_Bps"] == striped["read_striped_gbps"] * 1e9


def _tiny_csrc(tmp_path):
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / "module.cpp").write_text(_TINY_MODULE)
    return {"OFFLOAD_CSRC": str(csrc), "OFFLOAD_BUILD_DIR": str(tmp_path / "build")}


_LOAD = "from offload import _ext\nprint(_ext._load().__name__)\n"


def test_a_killed_builds_locks_hold_nothing_up(tmp_path):
    """A build killed mid-way (Ctrl-C, a timeout, the OOM killer) leaves torch's `lock` file behind, and its
    holder's flock dies with it: the next load builds at once, removing the file, instead of waiting on it
    (it waited up to 15 minutes before)."""
    import signal
    import time as _time

    env = _tiny_csrc(tmp_path)
    build = Path(env["OFFLOAD_BUILD_DIR"])
    build.mkdir()
    holder = subprocess.Popen(  # a builder of ours holding the flock, then killed with -9
        [sys.executable, "-c", "from pathlib import Path\nfrom offload import _ext\nimport time\n"
         f"with _ext._build_lock(Path({str(build)!r})):\n    print('held', flush=True)\n    time.sleep(600)\n"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, **env})
    try:
        assert holder.stdout.readline().strip() == "held"
        (build / "lock").write_text("")  # torch's lock, as a build killed mid-way leaves it
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    finally:
        holder.kill()
    t0 = _time.monotonic()
    out = _in_child(_LOAD, **env)
    assert out.returncode == 0 and out.stdout.strip() == "offload_C", out.stderr
    assert "removing" in out.stderr and "killed" in out.stderr, out.stderr
    assert "waiting" not in out.stderr
    assert not (build / "lock").exists()
    assert _time.monotonic() - t0 < 120  # one tiny compile, no wait


def test_a_second_first_build_waits_for_the_live_one_then_builds_nothing(tmp_path):
    """Two processes loading a cold cache: the second waits on the first's flock (saying so) and then finds the
    build current, so the extension is compiled once."""
    import fcntl

    env = _tiny_csrc(tmp_path)
    first = _in_child(_LOAD, **env)
    assert first.returncode == 0 and "offload: built the C++ extension" in first.stderr, first.stderr
    fd = os.open(Path(env["OFFLOAD_BUILD_DIR"]) / "offload_build.flock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a live builder (this process) holds it
    second = subprocess.Popen([sys.executable, "-c", _LOAD], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
    try:
        waiting = second.stderr.readline()
        assert "another process is building the extension" in waiting, waiting
        assert second.poll() is None  # still waiting while the holder lives
    finally:
        os.close(fd)  # the live build ends
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0 and out.strip() == "offload_C", err
    assert "offload: build" not in err  # nothing compiled again
