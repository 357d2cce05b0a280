"""Training a mixture-of-experts model through offload, as tests/test_moe.py compares it with plain PyTorch: run in
the test's process (1 rank) or under torchrun (`python moe_worker.py MODEL_DIR OUT.pt [lora]`: every rank trains on
its own data, so the routers choose differently on each; rank 0 saves what it saw)."""
import sys

import torch
import torch.distributed as dist

STEPS, BATCH, SEQ = 3, 2, 12


def data(vocab: int, world: int) -> torch.Tensor:
    """[steps, world, batch, seq]: each rank's tokens, different on each."""
    return torch.randint(0, vocab, (STEPS, world, BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], init_lora_weights="gaussian")


def offload_train(model_dir: str, world: int = 1, rank: int = 0, lora: bool = False) -> dict:
    """Stream the model in (from_pretrained, or load_peft_model for LoRA) and train STEPS steps of AdamW on the
    model's own loss (cross-entropy + router_aux_loss_coef x the load-balancing loss)."""
    from transformers import AutoModelForCausalLM

    import offload
    from offload.integrations.lora import load_peft_model

    cfg = offload.Config(params="cpu", optimizer="cpu", cpu_budget="64MiB", device_budget="64MiB")
    with offload.init(cfg) as rt:
        model = load_peft_model(model_dir, lora_config()) if lora else AutoModelForCausalLM.from_pretrained(model_dir)
        model.train()
        trains = {n for n, p in model.named_parameters() if p.requires_grad}  # (a unit that trains holds frozen ones)
        start = {n: v.clone() for n, v in rt.iter_full_params(model, trainable_only=True) if n in trains}
        ids = data(model.config.vocab_size, world)
        opt = offload.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for step in ids:
            out = model(input_ids=step[rank].to(rt.device), labels=step[rank].to(rt.device))
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            seen = out.loss.detach().cpu()
            if world > 1:
                dist.all_reduce(seen)
            losses.append(seen.item() / world)
        trained = {n: v.clone() for n, v in rt.iter_full_params(model, trainable_only=True) if n in trains}
    return {"losses": losses, "start": start, "trained": trained}


def reference_train(model_dir: str, world: int = 1, lora: bool = False, start: dict | None = None) -> dict:
    """Plain PyTorch and transformers: the mean over ranks of each rank's loss (what averaging the gradients over
    ranks trains on); LoRA adapters start from `start` (the offloaded run's initial values)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if lora:
        model = get_peft_model(model, lora_config())
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.requires_grad:
                    p.copy_(start[name])
    model.train()
    ids = data(model.config.vocab_size, world)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses, outs = [], []
    for step in ids:
        outs = [model(input_ids=step[r], labels=step[r]) for r in range(world)]
        loss = sum(o.loss for o in outs) / world
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return {"losses": losses, "trained": trained, "last_outputs": outs}


if __name__ == "__main__":
    dist.init_process_group("gloo")
    for lora in (False, True):  # both runs in one launch: two ranks' imports cost more than a tiny run
        seen = offload_train(sys.argv[1], dist.get_world_size(), dist.get_rank(), lora=lora)
        if dist.get_rank() == 0:
            torch.save(seen, f"{sys.argv[2]}.{'lora' if lora else 'full'}.pt")
    dist.destroy_process_group()
