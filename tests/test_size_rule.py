"""One rule for sizes (store/sizes.py): a number without a unit is refused wherever a user gives a size (CLI
flags, a --config JSON, offload.Config, an environment variable), in one line naming the setting and the unit to
add. Before, `--cpu-budget 512` (or 512 in a --config JSON or offload.Config) was 512 bytes and failed after
set-up with "0 B of --cpu-budget is free", while `offload plan --gpu-mem 80` said "'80' has no unit"."""
import json

import pytest

import offload
from offload.cli import main
from offload.errors import InputError
from offload.store.sizes import parse_size


@pytest.mark.parametrize("value", ["512", 512, "1.5"])
def test_a_config_size_without_a_unit_is_refused_naming_the_field_and_unit(value):
    with pytest.raises(ValueError, match=rf"^offload.Config.cpu_budget {value}: add a unit, e.g. {value}GiB"):
        offload.Config(cpu_budget=value)
    for field in ("device_budget", "nvme_budget", "chunk_size", "persist_threshold", "activations_min_size",
                  "unit_min_bytes"):
        with pytest.raises(ValueError, match=rf"offload.Config.{field} {value}: add a unit"):
            offload.Config(**{field: value})
    assert offload.Config(cpu_budget="512MiB", persist_threshold=0, chunk_size="8192B").bytes_of("chunk_size") == 8192


def test_the_finetune_flags_and_its_config_json_follow_the_rule(tmp_path, capsys):
    from offload.finetune import FinetuneConfig
    from offload.finetune.job import runtime_config

    with pytest.raises(InputError, match=r"--cpu-budget 512: add a unit, e.g. 512GiB"):
        runtime_config(FinetuneConfig(cpu_budget="512"), "/tmp/x")
    (tmp_path / "c.json").write_text(json.dumps({"chunk_size": 65536}))
    with pytest.raises(InputError, match=r"chunk_size \(in --config\) 65536: add a unit"):
        runtime_config(FinetuneConfig(offload_config=str(tmp_path / "c.json")), "/tmp/x")
    assert main(["finetune", "--max-shard-size", "2048", "--output", str(tmp_path / "o")]) == 2
    assert "--max-shard-size 2048: add a unit" in capsys.readouterr().err


def test_the_other_commands_and_variables_follow_the_rule(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit):
        main(["plan", "--model", "llama-7b", "--gpu-mem", "80"])
    assert "80: add a unit, e.g. 80GiB" in capsys.readouterr().err
    assert main(["bench", "nvme", "--path", str(tmp_path), "--size", "512"]) == 2
    assert "--size 512: add a unit" in capsys.readouterr().err
    assert main(["export", str(tmp_path), str(tmp_path / "out"), "--max-shard-size", "100"]) == 2
    assert "--max-shard-size 100: add a unit" in capsys.readouterr().err
    from offload.store.host_pool import headroom_bytes

    monkeypatch.setenv("OFFLOAD_HOST_POOL_HEADROOM", "128")
    with pytest.raises(ValueError, match="OFFLOAD_HOST_POOL_HEADROOM='128'.*add a unit"):
        headroom_bytes()
    assert parse_size("0") == 0 and parse_size("8KiB") == 8192
