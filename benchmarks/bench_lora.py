"""LoRA over an offloaded frozen base: nvme bytes written and read per step, with the adapters as units of their own
(trainable islands, the default) or folded into their frozen blocks (--no-islands: what the runtime did before:
gradients, optimizer states and write-backs for the whole block).

    PYTHONPATH=. python benchmarks/bench_lora.py [--no-islands]

A transformers Llama (4 layers, d 256, vocab 2000) with PEFT LoRA r=8 on q_proj and v_proj, params and optimizer
on nvme, a 12 MiB cpu budget (the states do not fit: they page); 3 steps, the last one's bytes printed.
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import offload
from offload.zero import units


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-islands", action="store_true", help="fold the adapters into their blocks (the old way)")
    p.add_argument("--no-pipeline", action="store_true", help="Config(pipeline=False): no read-ahead or overlap")
    args = p.parse_args()
    if args.no_islands:
        units.trainable_islands = lambda root, chosen: []
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=2000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2))
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(0, 2000, (2, 64), generator=torch.Generator().manual_seed(2))
    cfg = offload.Config(params="nvme", optimizer="nvme", nvme_path=tempfile.mkdtemp(), cpu_budget="12MiB",
                         device_budget="64MiB", pipeline=not args.no_pipeline)
    with offload.init(cfg) as rt:
        rt.wrap(model)
        opt = offload.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-3)
        marks = []
        for _ in range(3):
            t0 = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            rt.quiesce()
            s = rt.stats()
            marks.append((s["nvme_written_bytes"], s["nvme_read_bytes"], time.perf_counter() - t0))
        trainable = sum(q.numel() for q in model.parameters() if q.requires_grad)
        frozen = sum(q.numel() for q in model.parameters() if not q.requires_grad)
        trained_units = sum(u.layout.trainable for u in rt.units)
    print(f"{'folded' if args.no_islands else 'islands'}: {trainable} trainable / {frozen} frozen params, "
          f"{trained_units} of {len(rt.units)} units train; last step: nvme written {marks[2][0] - marks[1][0]} B, "
          f"read {marks[2][1] - marks[1][1]} B, {marks[2][2]:.3f} s")


if __name__ == "__main__":
    main()
