"""LoRA over an offloaded frozen base (offload/zero/units.py, trainable islands): PEFT's adapters inside frozen
blocks become units of their own, so the frozen blocks get no gradient, no optimizer state and are never written
back. Asserted: the adapters train as PEFT in memory does (fp32), the base's values are unchanged bit for bit and
the base moves no nvme write, the adapter directory PEFT writes from the wrapped model loads in PEFT and gives
the trained model's logits, and the Trainer integration trains a PEFT model as Trainer does."""
import os
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import offload  # noqa: E402
from offload.zero.units import trainable_islands  # noqa: E402

STEPS = 3


def base_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=500, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2))


def with_lora(model):
    torch.manual_seed(1)  # B is random too ("gaussian"), so the first step already moves every adapter
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights="gaussian"))


def batch():
    ids = torch.randint(0, 500, (4, 48), generator=torch.Generator().manual_seed(2))
    return ids


def train_steps(model, opt, after_each=lambda: None) -> list[float]:
    ids, losses = batch(), []
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        after_each()
    return losses


def train_in_memory():
    model = with_lora(base_model())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, train_steps(model, opt)


def test_islands_are_the_adapters_not_their_containers():
    model = with_lora(base_model())
    cfg = offload.Config()
    from offload.zero.units import choose_unit_modules

    names = [n for n, _ in trainable_islands(model, choose_unit_modules(model, cfg))]
    assert len(names) == 3 * 2 * 2  # 3 layers x (q, v) x (A, B)
    assert all(n.endswith((".lora_A.default", ".lora_B.default")) for n in names)  # the Linear PEFT calls
    assert trainable_islands(base_model(), []) == []  # nothing frozen: nothing to do
    half = torch.nn.Sequential(torch.nn.Linear(64, 64).requires_grad_(False), torch.nn.Linear(64, 4))
    assert trainable_islands(half, []) == []  # a block that freezes a part (16:1) keeps its units as they are


@pytest.mark.parametrize("home", ["nvme", "cpu"])
def test_lora_over_an_offloaded_base_trains_as_peft_in_memory(tmp_path, home):
    ref, ref_losses = train_in_memory()
    model = with_lora(base_model())
    base_before = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    cfg = offload.Config(params=home, optimizer=home, nvme_path=str(tmp_path),
                         cpu_budget="6MiB" if home == "nvme" else "32MiB",
                         device_budget="64MiB")
    with offload.init(cfg) as rt:
        rt.wrap(model)
        frozen = [u for u in rt.units if not u.layout.trainable]
        assert {u.name.rsplit(".", 1)[-1] for u in rt.units if u.layout.trainable} == {"default"}  # only adapters
        assert len(frozen) == 4  # the root and the 3 blocks
        opt = offload.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        written = []
        losses = train_steps(model, opt, lambda: (rt.quiesce(), written.append(rt.stats()["nvme_written_bytes"])))
        ids = batch()
        held = rt.full_state_dict(model)
        model.save_pretrained(tmp_path / "adapter")  # PEFT's own save, through the wrapped state_dict
        logits = model(input_ids=ids).logits.detach()
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-6)
    ref_sd = ref.state_dict()
    for name in ref_sd:
        if "lora_" in name:
            # within 1e-5, as the Trainer's fp32 check: 3 Adam steps at lr 1e-2 move 2 of 1024 elements of an
            # adapter by 4.6e-6 from torch's AdamW (their gradients are near zero, where Adam's step is a sign)
            torch.testing.assert_close(held[name], ref_sd[name], rtol=0, atol=1e-5)
            assert not torch.equal(held[name], base_before.get(name, torch.zeros(0)))
    assert all(torch.equal(held[k], v) for k, v in base_before.items() if k in held)  # the base, bit for bit
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if home == "nvme":  # a step writes the adapters' states at most (fp32 param, master, 2 moments, grad)
        assert written[-1] - written[-2] <= 20 * trainable

    fresh = PeftModel.from_pretrained(base_model(), tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids).logits, logits, rtol=0, atol=1e-5)


def test_the_trainer_trains_a_peft_model_as_trainer_does(tmp_path):
    from transformers import Trainer, TrainingArguments

    from offload.integrations.transformers import OffloadTrainer

    class Blocks(torch.utils.data.Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            ids = torch.randint(0, 500, (48,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    def args(out):
        return TrainingArguments(output_dir=str(out), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2,
                                 logging_steps=1, save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(),
                                 seed=0, dataloader_num_workers=0, max_grad_norm=1.0)

    ref = Trainer(model=with_lora(base_model()), args=args(tmp_path / "ref"), train_dataset=Blocks())
    ref.train()
    cfg = offload.Config(params="nvme", optimizer="nvme", nvme_path=str(tmp_path), cpu_budget="6MiB",
                         device_budget="64MiB")
    with OffloadTrainer(model=with_lora(base_model()), args=args(tmp_path / "run"), train_dataset=Blocks(),
                        offload_config=cfg) as trainer:
        trainer.train()
        trained = [u for u in trainer.offload_runtime.units if u.layout.trainable]
        assert trained and all(u.name.endswith(".default") for u in trained)

    def losses(t):
        return [h["loss"] for h in t.state.log_history if "loss" in h and "train_runtime" not in h]
    assert losses(trainer) == pytest.approx(losses(ref), rel=1e-5)
