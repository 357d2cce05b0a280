"""Issue 45 item 6, a new user's first hour: the LoRA hint names every layer kind PEFT can target (GPT-2's c_attn is
a transformers Conv1D, and the hint listed Linear layers only: "['lm_head']"); `offload bench nvme --path` with a
typo is refused instead of created and benchmarked in; a trainer never closed still closes its runtime and removes
its swap directory when it is garbage or the process exits (the next run removed it as a dead run's)."""
import gc
import os
import subprocess
import sys
import textwrap

import pytest

from offload.cli import main

pytest.importorskip("transformers")


def test_the_lora_hint_lists_every_layer_kind_peft_can_target():
    from transformers import GPT2Config, GPT2LMHeadModel

    from offload.finetune.job import lora_targetable

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=16))
    names = lora_targetable(model)
    for kind in ("c_attn (Conv1D)", "c_fc (Conv1D)", "c_proj (Conv1D)", "lm_head (Linear)", "wte (Embedding)"):
        assert kind in names


def test_bench_nvme_refuses_a_path_that_does_not_exist(tmp_path, capsys):
    missing = tmp_path / "typo" / "swap"
    assert main(["bench", "nvme", "--path", str(missing), "--size", "1MiB"]) == 2
    err = capsys.readouterr().err
    assert f"--path {missing} does not exist" in err and err.count("\n") == 1
    assert not (tmp_path / "typo").exists()
    assert main(["bench", "all", "--path", str(missing)]) == 2 and not (tmp_path / "typo").exists()


def _swap_dirs(path):
    return os.listdir(path)  # hidden ones too (a lock folder left behind would show)


def test_a_trainer_never_closed_removes_its_swap_when_collected(tmp_path):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_trainer import Blocks, nvme_config, tiny_llama, training_args

    from offload.integrations.transformers import OffloadTrainer

    (tmp_path / "swap").mkdir()
    trainer = OffloadTrainer(model=tiny_llama(), args=training_args(tmp_path / "out", max_steps=1),
                             train_dataset=Blocks(), offload_config=nvme_config(tmp_path / "swap"))
    rt = trainer.offload_runtime
    assert _swap_dirs(tmp_path / "swap") and not rt.closed
    del trainer
    gc.collect()
    assert rt.closed and _swap_dirs(tmp_path / "swap") == []


def test_a_trainer_never_closed_removes_its_swap_at_exit(tmp_path):
    (tmp_path / "swap").mkdir()
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        from test_trainer import Blocks, nvme_config, tiny_llama, training_args
        from offload.integrations.transformers import OffloadTrainer
        keep = OffloadTrainer(model=tiny_llama(), args=training_args({str(tmp_path / "out")!r}, max_steps=1),
                              train_dataset=Blocks(), offload_config=nvme_config({str(tmp_path / "swap")!r}))
        keep.train()
        print("trained", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "trained" in proc.stdout, proc.stderr[-3000:]
    assert _swap_dirs(tmp_path / "swap") == []
