"""`offload bench nvme` runs end to end on a tiny file and writes the JSON the planner reads
(figures are not asserted: speeds live in benchmarks/RESULTS.md)."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from offload.cli import main


@pytest.mark.parametrize("with_fio", [False, True])
def test_bench_nvme_writes_json_and_cleans_up(tmp_path, capsys, with_fio):
    if with_fio and shutil.which("fio") is None:
        pytest.skip("fio is not installed")
    out = tmp_path / "nvme.json"
    bench_dir = tmp_path / "disk"
    bench_dir.mkdir()  # (a --path that does not exist is refused: tests/test_first_hour.py)
    argv = ["bench", "nvme", "--path", str(bench_dir), "--size", "8MiB", "--block-sizes", "1MiB,4MiB",
            "--queue-depths", "1,4", "--rounds", "1", "--json", str(out)]
    if not with_fio:
        argv.append("--no-fio")
    assert main(argv) == 0
    nv = json.loads(out.read_text())["nvme"]
    assert nv["read_gbps"] > 0 and nv["write_gbps"] > 0
    assert nv["read_gbps"] == max(r["engine_gbps"] for r in nv["sweep"] if r["op"] == "read")
    assert {(r["op"], r["block_size"], r["queue_depth"]) for r in nv["sweep"]} == {
        (op, bs, qd) for op in ("read", "write") for bs in (1 << 20, 4 << 20) for qd in (1, 4)}
    assert all(("fio_gbps" in r) == with_fio for r in nv["sweep"])
    if with_fio:
        assert nv["fio_read_gbps"] > 0 and nv["read_vs_fio_best"] > 0
    # the pure-Python baseline (aiofiles) ran every configuration too
    assert all(r["aiofiles_gbps"] > 0 for r in nv["sweep"])
    assert nv["aiofiles_read_gbps"] > 0 and nv["read_vs_aiofiles_geomean"] > 0
    assert os.listdir(bench_dir) == [], "the test file must be removed"
    assert "best read" in capsys.readouterr().out


def test_bench_nvme_refuses_size_not_multiple_of_block(tmp_path, capsys):
    assert main(["bench", "nvme", "--path", str(tmp_path), "--size", "5MiB", "--block-sizes", "4MiB", "--no-fio"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("offload bench: error: offload bench nvme: --size must be a multiple") and "\n" not in err
