"""offload.Config: sizes, validation errors that name the field, and the DeepSpeed import."""
import json
import warnings

import pytest
import torch

from offload.config import Config, parse_size
from offload.store.sizes import format_bytes, parse_size as store_parse_size


def test_parse_size_units():
    assert parse_size("60GiB") == 60 * 1024**3
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("512 MiB") == 512 * 1024**2
    assert parse_size("4096B") == 4096 and parse_size("0") == parse_size(0) == 0
    assert store_parse_size(123, "capacity", counts=True) == 123  # internal byte counts
    assert format_bytes(3 * 1024**3) == "3.00 GiB"
    for bad in ("12 parsecs", "GiB", "-1", True, float("nan"), float("inf")):  # (NaN: "cannot convert float NaN")
        with pytest.raises(ValueError, match="device_budget"):
            parse_size(bad, "device_budget")


def test_nvme_budget_auto_is_accepted():
    """The docstring and `offload finetune --nvme-budget` say "auto"; Config refused it as not a size."""
    assert Config(nvme_budget="auto").bytes_of("nvme_budget") is None


def test_defaults_and_dtypes():
    cfg = Config()
    assert (cfg.params, cfg.optimizer, cfg.compute_dtype) == ("auto", "auto", "fp32")
    import torch

    assert Config(compute_dtype="bf16").torch_compute_dtype is torch.bfloat16
    assert Config(device_budget="1KiB").bytes_of("device_budget") == 1024
    assert Config().bytes_of("cpu_budget") is None


@pytest.mark.parametrize("fields, field", [
    (dict(params="gpu"), "params"),
    (dict(optimizer="disk"), "optimizer"),
    (dict(compute_dtype="fp8"), "compute_dtype"),
    (dict(params="nvme"), "nvme_path"),
    (dict(optimizer="nvme"), "nvme_path"),
    (dict(cpu_budget="lots"), "cpu_budget"),
    (dict(nvme_budget="x"), "nvme_budget"),
    (dict(chunk_size="4KiB"), "chunk_size"),  # below the smallest chunk: it was raised to 8 KiB silently
    (dict(unit_classes=("Block",), unit_min_bytes="1MiB"), "unit_min_bytes"),
    (dict(unit_classes=(3,)), "unit_classes"),
    (dict(compute_through_device_tier="1"), "compute_through_device_tier"),  # (it was an environment variable)
    (dict(collectives_at_world_size_1=1), "collectives_at_world_size_1"),
])
def test_invalid_fields_are_named(fields, field):
    with pytest.raises(ValueError, match=field):
        Config(**fields)


def test_unknown_field_is_named():
    with pytest.raises(TypeError, match="param_tier"):
        Config(param_tier="cpu")


DS = {
    "train_micro_batch_size_per_gpu": 4,
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "nvme", "nvme_path": "/mnt/nvme", "pin_memory": True, "buffer_count": 5},
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "stage3_param_persistence_threshold": 1000,
        "stage3_max_live_parameters": 1e9,
        "overlap_comm": True,
    },
}


def test_from_deepspeed_maps_and_reports_ignored(tmp_path):
    with pytest.warns(UserWarning, match="stage3_max_live_parameters"):
        cfg = Config.from_deepspeed(DS)
    assert (cfg.params, cfg.optimizer, cfg.nvme_path, cfg.compute_dtype) == ("nvme", "cpu", "/mnt/nvme", "bf16")
    assert cfg.persist_threshold == 2000  # 1000 bf16 elements
    assert "zero_optimization.overlap_comm" in cfg.deepspeed_ignored
    assert "zero_optimization.offload_param.buffer_count" in cfg.deepspeed_ignored
    # the training sections are the trainer's to apply (tests/test_deepspeed_json.py), not ignored
    assert "train_micro_batch_size_per_gpu" not in cfg.deepspeed_ignored
    assert "train_micro_batch_size_per_gpu" in cfg.deepspeed_training
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DS))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert Config.from_deepspeed(path, cpu_budget="1GiB").cpu_budget == "1GiB"
        section = Config.from_deepspeed(DS["zero_optimization"])  # the section alone
    assert section.compute_dtype == "fp32" and section.params == "nvme"
    # in the compute dtype the Config ends up with: it was the file's (bf16) under an fp32 override
    assert Config.from_deepspeed(DS, compute_dtype="fp32").persist_threshold == 4000
    plain = Config.from_deepspeed({"zero_optimization": {"stage": 3}})
    assert (plain.params, plain.optimizer, plain.deepspeed_ignored) == ("device", "device", ())


def test_from_deepspeed_fp16_takes_the_loss_scaler_in_the_loop():
    """fp16.enabled maps to compute_dtype "fp16"; DeepSpeed's engine-side loss-scale settings are offload.GradScaler's
    arguments here, so they are reported as ignored, not dropped silently."""
    ds = {"fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 2},
          "bf16": {"enabled": False}, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10}}
    with pytest.warns(UserWarning, match="fp16.initial_scale_power"):
        cfg = Config.from_deepspeed(ds)
    assert cfg.compute_dtype == "fp16" and cfg.persist_threshold == 20  # 10 fp16 elements
    assert {"fp16.initial_scale_power", "fp16.loss_scale_window", "fp16.hysteresis"} <= set(cfg.deepspeed_ignored)
    with pytest.warns(UserWarning, match="fp16.enabled=auto"):  # Hugging Face's placeholder: the Trainer decides
        assert Config.from_deepspeed({"fp16": {"enabled": "auto"}, "zero_optimization": {"stage": 3}}).compute_dtype \
            == "fp32"


@pytest.mark.parametrize("ds, key", [
    ({"zero_optimization": {"stage": 2}}, "stage"),
    ({"zero_optimization": {"stage": 3, "stage3_bogus": 1}}, "stage3_bogus"),
    ({"zero_optimization": {"offload_param": {"device": "tape"}}}, "offload_param.device"),
    ({"zero_optimization": {"offload_param": {"device": "cpu", "color": 1}}}, "offload_param.color"),
    ({"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "/a"},
                            "offload_optimizer": {"device": "nvme", "nvme_path": "/b"}}}, "nvme_path"),
    ({"zero_optimization": {"offload_param": {"device": "nvme"}}}, "nvme_path"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}, "both true"),
    ({"communication_data_type": "fp16"}, "communication_data_type"),
    ({"not_a_deepspeed_key": 1}, "not_a_deepspeed_key"),
])
def test_from_deepspeed_errors_name_the_key(ds, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        Config.from_deepspeed(ds)


def test_from_deepspeed_unreadable_path(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        Config.from_deepspeed(tmp_path / "missing.json")


def test_reduce_dtype_is_checked_and_imported_from_deepspeed():
    assert Config().reduce_dtype == "fp32"
    assert Config(reduce_dtype="bf16").torch_reduce_dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"offload\.Config\.reduce_dtype: 'fp16' is not supported"):
        Config(reduce_dtype="fp16")
    cfg = Config.from_deepspeed({"communication_data_type": "bf16", "zero_optimization": {"stage": 3}})
    assert cfg.reduce_dtype == "bf16" and cfg.deepspeed_ignored == ()
