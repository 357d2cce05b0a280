"""A DeepSpeed JSON's training sections (optimizer, scheduler, gradient_clipping, batch sizes) honoured as Hugging
Face's Trainer honours them with DeepSpeed (offload/integrations/deepspeed.py): "auto" filled from
TrainingArguments (or `offload finetune`'s flags), explicit values applied, a value that differs refused with every
such pair named at once. Before, Config.from_deepspeed dropped them under a warning about buckets and prefetch:
an explicit lr was replaced by TrainingArguments' without a word, and DeepSpeed's WarmupLR became Trainer's
linear decay."""
import json
import math
import os
import re
import sys
import warnings

import pytest
import torch

import offload
from offload.integrations.deepspeed import DeepSpeedSchedule

ZERO = {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
HF_AUTO = {  # Hugging Face's ZeRO-3 example JSON, its training part
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "gradient_clipping": "auto", "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto", "zero_optimization": ZERO}


def from_deepspeed(ds, **overrides):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = offload.Config.from_deepspeed(ds, **overrides)
    return cfg, " ".join(str(w.message) for w in caught)


def test_from_deepspeed_keeps_the_training_sections_and_says_what_it_ignores():
    cfg, said = from_deepspeed({**HF_AUTO, "steps_per_print": 10,
                                "zero_optimization": {**ZERO, "overlap_comm": True}})
    assert set(cfg.deepspeed_training) == {"optimizer", "scheduler", "gradient_clipping", "train_batch_size",
                                           "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}
    assert "optimizer" not in cfg.deepspeed_ignored and "scheduler" not in cfg.deepspeed_ignored
    # the warning names each ignored key with its reason, and the kept ones as the trainer's, not "buckets"
    assert re.search(r"zero_optimization.overlap_comm \(offload plans buckets", said)
    assert re.search(r"steps_per_print \(DeepSpeed engine settings", said)
    assert re.search(r"gradient_accumulation_steps, gradient_clipping, optimizer, scheduler, train_batch_size, "
                     r"train_micro_batch_size_per_gpu are kept for OffloadTrainer", said)
    for ds, says in (({"optimizer": {"type": "Lamb"}}, "optimizer.type='Lamb'"),
                     ({"optimizer": {"type": "Adam", "params": {"amsgrad": True}}}, "optimizer.params.amsgrad=True"),
                     ({"optimizer": {"type": "AdamW", "params": {"momentum": 0.9}}}, "optimizer.params.momentum"),
                     ({"scheduler": {"type": "OneCycle"}}, "scheduler.type='OneCycle'"),
                     ({"scheduler": {"type": "WarmupLR", "params": {"cos_min_ratio": 0.1}}},
                      "scheduler.params.cos_min_ratio is not a parameter of WarmupLR"),
                     ({"gradient_clipping": "one"}, "gradient_clipping='one' is not a number")):
        with pytest.raises(ValueError, match=re.escape(says)):
            offload.Config.from_deepspeed({**ds, "zero_optimization": ZERO})


def _rates(kind, steps, lr=1.0, **params):
    """The learning rate of each of `steps` optimizer steps under DeepSpeedSchedule, stepped as a trainer steps it."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = DeepSpeedSchedule(opt, kind, **params)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_deepspeeds_schedules_step_as_its_engine_steps_them():
    """DeepSpeed's formulas (deepspeed/runtime/lr_schedules.py), in its order: built at iteration -1 (WarmupLR:
    warmup_min_lr; WarmupCosineLR: 0), one iteration on after each optimizer step."""
    log4 = math.log(4)
    assert _rates("WarmupLR", 6, warmup_min_lr=0.1, warmup_max_lr=1.0, warmup_num_steps=4) == pytest.approx(
        [0.1, 0.1, 0.1 + 0.9 * math.log(2) / log4, 0.1 + 0.9 * math.log(3) / log4, 1.0, 1.0])
    assert _rates("WarmupLR", 4, warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear") == pytest.approx(
        [0.0, 0.0, 0.25, 0.5])
    # decay: (total - it) / (total - warmup) after the warmup
    assert _rates("WarmupDecayLR", 8, total_num_steps=6, warmup_max_lr=2.0, warmup_num_steps=2,
                  warmup_type="linear") == pytest.approx([0, 0, 1.0, 2.0, 1.5, 1.0, 0.5, 0.0])
    # cosine: of the optimizer's own lr, from warmup_min_ratio up, down to cos_min_ratio
    got = _rates("WarmupCosineLR", 7, lr=2.0, total_num_steps=6, warmup_num_steps=2, warmup_type="linear",
                 warmup_min_ratio=0.5, cos_min_ratio=0.1)
    cos = [2.0 * (0.1 + 0.9 * (1 + math.cos(math.pi * min(1.0, k / 4))) / 2) for k in (1, 2, 3, 4)]
    assert got == pytest.approx([0.0, 1.0, 1.5, *cos])


pytest.importorskip("transformers")
from transformers import TrainerCallback  # noqa: E402

from offload.integrations.transformers import OffloadTrainer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_trainer import Blocks, tiny_llama, training_args  # noqa: E402


def test_a_trainer_refuses_every_deepspeed_value_that_differs_at_once(tmp_path):
    """As HfTrainerDeepSpeedConfig: each explicit value against its TrainingArguments setting, all in one error,
    before the model is sharded."""
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.9, 0.95], "eps": "auto",
                                                    "weight_decay": 0.5}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 3e-5, "total_num_steps": 100,
                                                            "warmup_num_steps": "auto"}},
          "gradient_clipping": 0.5, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
          "zero_optimization": ZERO}
    cfg, _ = from_deepspeed(ds, cpu_budget="64MiB", device_budget="64MiB")
    model = tiny_llama()
    with pytest.raises(ValueError) as info:
        OffloadTrainer(model=model, args=training_args(tmp_path), train_dataset=Blocks(), offload_config=cfg)
    said = str(info.value)
    for pair in ("optimizer.params.lr=3e-05 vs learning_rate=0.001",
                 "optimizer.params.betas=[0.9, 0.95] vs [adam_beta1, adam_beta2]=[0.9, 0.999]",
                 "scheduler.params.warmup_max_lr=3e-05 vs learning_rate=0.001",
                 "scheduler.params.total_num_steps=100 vs the run's steps (max_steps or the epochs')=6",
                 "train_micro_batch_size_per_gpu=8 vs per_device_train_batch_size=4"):
        assert pair in said
    assert "gradient_clipping" not in said and "weight_decay" not in said  # equal: 0.5 and 0.5, accumulation 2
    assert said.count("\n") == 0 and not any(hasattr(p, "_offload_unit") for p in model.parameters())


def test_a_trainer_runs_the_deepspeed_optimizer_and_schedule(tmp_path):
    """Hugging Face's all-"auto" JSON: DeepSpeed's WarmupLR (warmup_min_lr 0, log warmup over warmup_steps, then
    flat), not Trainer's linear decay, and DeepSpeed's optimizer (weight decay on every parameter)."""
    cfg, said = from_deepspeed(HF_AUTO, cpu_budget="64MiB", device_budget="64MiB")
    rates = []

    class Record(TrainerCallback):
        def on_step_begin(self, args, state, control, optimizer=None, **kw):
            rates.append(optimizer.param_groups[0]["lr"])

    with pytest.warns(UserWarning, match=r"the schedule is DeepSpeed's WarmupLR\(warmup_min_lr=0, warmup_max_lr="
                                         r"0.001, warmup_num_steps=4\) .*not lr_scheduler_type='linear'"):
        trainer = OffloadTrainer(model=tiny_llama(), args=training_args(tmp_path, warmup_steps=4),
                                 train_dataset=Blocks(), offload_config=cfg, callbacks=[Record()])
    with trainer:
        start = trainer.offload_runtime.full_state_dict(trainer.model)
        trainer.train()
        groups = trainer.optimizer.param_groups
        assert len(groups) == 1 and groups[0]["weight_decay"] == 0.5  # every parameter decays, norms too
        assert len(groups[0]["params"]) == len(list(trainer.model.parameters()))
        log4 = math.log(4)
        assert rates == pytest.approx([0.0, 0.0, 1e-3 * math.log(2) / log4, 1e-3 * math.log(3) / log4, 1e-3, 1e-3])
        assert trainer.offload_runtime.full_state_dict(trainer.model).keys() == start.keys()
