"""LoRA over an offloaded frozen base (offload/zero/units/discover.py, trainable islands): PEFT's adapters inside frozen
blocks become units of their own, so the frozen blocks get no gradient, no optimizer state and are never written
back. Asserted: the adapters train as PEFT in memory does (fp32), the base's values are unchanged bit for bit and
the base moves no nvme write, the adapter directory PEFT writes from the wrapped model loads in PEFT and gives
the trained model's logits, and the Trainer integration trains a PEFT model as Trainer does."""

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import offload  # noqa: E402
from offload.zero.units.discover import trainable_islands  # noqa: E402

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
    from offload.zero.units.discover import choose_unit_modules

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


def test_lora_on_the_embeddings_trains_as_peft(tmp_path):
    """PEFT's embedding adapters are ParameterDicts the LoRA layer reads (never calls): as units of their own
    (trainable islands, kept gathered) their hooks never ran, so they were never re-gathered after a step and the
    forward kept the first values: the losses left PEFT's from step 2 (6.07 against 5.98). They stay in their
    layer's unit now, and the losses are PEFT's, with offload.AdamW over the in-memory model as the reference."""
    def with_embedding_lora(model):
        torch.manual_seed(1)
        return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "embed_tokens"],
                                                init_lora_weights="gaussian"))

    ref = with_embedding_lora(base_model())
    ref_losses = train_steps(ref, offload.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2))
    model = with_embedding_lora(base_model())
    with offload.init(offload.Config(params="cpu", optimizer="cpu", cpu_budget="32MiB", device_budget="64MiB")) as rt:
        rt.wrap(model)
        assert not any("lora_embedding" in u.name for u in rt.units)  # read by the layer, not called: no unit
        losses = train_steps(model, offload.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
        held = rt.full_state_dict(model)
    assert losses == ref_losses
    ref_sd = ref.state_dict()
    assert all(torch.equal(held[k], ref_sd[k]) for k in ref_sd if "lora_embedding" in k)


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
        trainer.save_model(tmp_path / "saved")  # as Trainer does for a PEFT model: the adapter directory
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "saved").iterdir()}
    loaded = PeftModel.from_pretrained(base_model(), tmp_path / "saved")
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=batch()).logits, ref.model(input_ids=batch()).logits,
                                   rtol=0, atol=1e-4)

    def losses(t):
        return [h["loss"] for h in t.state.log_history if "loss" in h and "train_runtime" not in h]
    assert losses(trainer) == pytest.approx(losses(ref), rel=1e-5)


# ---- PEFT applied to placeholders: a base streamed from its files, adapters initialized as PEFT does -------------
def lora_config(**kw):
    return LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], **kw)


def test_a_peft_model_over_a_streamed_base_starts_as_the_base_and_trains_as_peft_in_memory(tmp_path):
    """load_peft_model: the base streams from safetensors under PEFT's names, the adapters start as PEFT's own init
    (B zero: the model's logits are the base's; A kaiming-uniform); trained, the adapters follow PEFT in memory
    started from the same values; save_adapter writes what PeftModel.from_pretrained loads, merged_params what
    PEFT's merge_and_unload gives."""
    from offload.integrations.lora import load_peft_model, merged_params, save_adapter

    base_model().save_pretrained(tmp_path / "base")
    ids = batch()
    with torch.no_grad():
        base_logits = base_model()(input_ids=ids).logits
    cfg = offload.Config(params="nvme", optimizer="nvme", nvme_path=str(tmp_path), cpu_budget="6MiB",
                         device_budget="64MiB")
    with offload.init(cfg) as rt:
        model = load_peft_model(tmp_path / "base", lora_config())
        start = dict(rt.iter_full_params(model, trainable_only=True))
        assert len(start) == 3 * 2 * 2 and {n for n, p in model.named_parameters() if p.requires_grad} == set(start)
        for name, value in start.items():
            if ".lora_B." in name:
                assert not value.any(), name  # PEFT's rule: a new adapter changes nothing
            else:  # nn.Linear's kaiming_uniform(a=sqrt(5)): uniform within 1/sqrt(fan_in)
                assert value.std() > 0.2 / 128 ** 0.5 and value.abs().max() <= 1 / 128 ** 0.5, name
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, base_logits, rtol=0, atol=1e-5)
        opt = offload.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses = train_steps(model, opt)
        trained = dict(rt.iter_full_params(model, trainable_only=True))
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        save_adapter(rt, model, tmp_path / "adapter")
        merged = {n: v.clone() for n, v in merged_params(rt, model)}

    ref = with_lora(base_model())
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.requires_grad:
                p.copy_(start[name])
    ref_losses = train_steps(ref, torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2))
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-6)
    ref_sd = ref.state_dict()
    for name, value in trained.items():
        torch.testing.assert_close(value, ref_sd[name], rtol=0, atol=1e-5)  # as the wrapped-model test above

    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["README.md", "adapter_config.json",
                                                                        "adapter_model.safetensors"]
    loaded = PeftModel.from_pretrained(base_model(), tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, logits, rtol=0, atol=1e-5)
    unloaded = loaded.merge_and_unload().state_dict()
    assert set(merged) == set(unloaded), (set(merged) ^ set(unloaded))
    for name, value in merged.items():
        torch.testing.assert_close(value, unloaded[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("kw, says", [
    (dict(init_lora_weights="pissa"), "init_lora_weights='pissa'"),
    (dict(use_dora=True), "DoRA"),
])
def test_peft_inits_that_read_the_base_are_refused_on_placeholders(tmp_path, kw, says):
    with offload.init(offload.Config(nvme_path=str(tmp_path), cpu_budget="16MiB", device_budget="64MiB")) as rt:
        model = get_peft_model(LlamaForCausalLM(base_model().config), lora_config(**kw))  # placeholders
        with pytest.raises(ValueError, match=says) as err:
            rt.wrap(model)
    assert "outside the block" in str(err.value)


def test_adapters_added_after_the_model_is_sharded_are_refused_with_the_fix(tmp_path):
    """get_peft_model on a sharded model (rt.wrap, or from_pretrained inside the block, shards it): the adapters are
    no unit's; the next forward (or rt.wrap) says so, naming them and the order that works."""
    base_model().save_pretrained(tmp_path / "base")
    cfg = offload.Config(nvme_path=str(tmp_path), cpu_budget="16MiB", device_budget="64MiB")
    with offload.init(cfg) as rt:
        model = get_peft_model(LlamaForCausalLM.from_pretrained(tmp_path / "base"), lora_config())  # streamed: sharded
        with pytest.raises(RuntimeError, match=r"does not manage \(base_model\.model\.model\.layers\.0\.self_attn"
                                               r"\.q_proj\.lora_A\.default\.weight.*\(12 in all\)") as err:
            model(input_ids=batch())
        assert "load_peft_model" in str(err.value)
        with pytest.raises(RuntimeError, match="does not manage"):
            rt.wrap(model)
    with offload.init(cfg) as rt:
        rt.stop_capturing()  # modules built from now on are plain torch ones: PEFT's adapters are real tensors
        plain = rt.wrap(base_model())
        with pytest.raises(RuntimeError, match=r"does not manage .*get_peft_model"):
            get_peft_model(plain, lora_config())(input_ids=batch())


def test_the_trainer_takes_a_peft_model_streamed_inside_the_block(tmp_path):
    """The big-model path: the base never in memory whole (load_peft_model inside offload.init), OffloadTrainer
    using the runtime open around it; it trains the adapters, and save_model writes the adapter directory."""
    from transformers import TrainingArguments

    from offload.integrations.lora import load_peft_model
    from offload.integrations.transformers import OffloadTrainer

    base_model().save_pretrained(tmp_path / "base")
    data = [{"input_ids": ids, "labels": ids} for ids in batch().repeat(4, 1)]
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=6, per_device_train_batch_size=4,
                             learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[],
                             use_cpu=not torch.cuda.is_available(), seed=0, dataloader_num_workers=0)
    cfg = offload.Config(params="nvme", optimizer="nvme", nvme_path=str(tmp_path), cpu_budget="6MiB",
                         device_budget="64MiB")
    with offload.init(cfg) as rt:
        model = load_peft_model(tmp_path / "base", lora_config())
        trainer = OffloadTrainer(model=model, args=args, train_dataset=data)
        trainer.train()
        assert trainer.offload_runtime is rt
        trainer.save_model(tmp_path / "saved")
        with torch.no_grad():
            logits = model(input_ids=batch()).logits
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    assert len(losses) == 6 and losses[-1] < losses[0]  # the same batch again and again: it must fall
    loaded = PeftModel.from_pretrained(base_model(), tmp_path / "saved")
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=batch()).logits, logits, rtol=0, atol=1e-5)
