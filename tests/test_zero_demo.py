"""`offload demo`: the README's main command trains through offload.init with states on disk."""
import re

from offload.cli import main


def test_demo_trains_with_states_on_disk(capsys, tmp_path):
    rc = main(["demo", "--steps", "4", "--dim", "32", "--layers", "2", "--seq", "16", "--batch", "4",
               "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    steps = re.findall(r"step +(\d+)/4 +loss +([0-9.]+) +grad-norm +[0-9.]+ +time +[0-9.]+ s", out)
    assert [int(s) for s, _ in steps] == [1, 2, 3, 4]
    assert "params on nvme, optimizer on nvme" in out
    read = re.search(r"nvme -> host \(read\) +([0-9.]+) (\w+)", out)
    assert read and float(read.group(1)) > 0
    assert re.search(r"peak RSS +[0-9.]+ (MiB|GiB)", out)
    assert list(tmp_path.iterdir()) == []  # swap files removed on exit
