"""The compute device's memory in the first step of a Llama whose embedding and LM head dominate (run as a subprocess
by test_zero_memory.py, so the host pool's window covers only this run). On a CPU the device is host memory: what
autograd and the reduce allocate there (the gathered units, their full-size gradients, the reduce's copies) is the
host pool's (offload.device.take_peak_allocated), what a GPU's max_memory_allocated says of the same tensors.
argv: swap dir, cpu budget, device budget, vocab, hidden. Prints one JSON line: the step's peak on the device, and
the largest unit's working set as offload.plan.memory.unit_working_set_bytes estimates it.

    OFFLOAD_MALLOC_TUNE=pool python tests/first_step_probe.py /tmp/swap 64MiB 96MiB 32000 256
"""
import json
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import offload
from offload.device_memory import take_peak_allocated
from offload.plan.memory import unit_working_set_bytes

SEQ = 16


def main():
    nvme_dir, cpu_budget, device_budget, vocab, hidden = sys.argv[1:4] + [int(x) for x in sys.argv[4:6]]
    torch.set_num_threads(1)
    cfg = offload.Config(params="nvme", optimizer="nvme", nvme_path=nvme_dir, cpu_budget=cpu_budget,
                         device_budget=device_budget, compute_dtype="bf16", optimizer_states="adamw8bit")
    with offload.init(cfg) as rt:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                             num_hidden_layers=2, num_attention_heads=hidden // 64,
                                             num_key_value_heads=hidden // 128, tie_word_embeddings=False))
        opt = offload.AdamW8bit(model.parameters(), lr=1e-5)
        ids = torch.randint(0, vocab, (1, SEQ), generator=torch.Generator().manual_seed(1))
        rt.quiesce()
        take_peak_allocated(rt.device)  # the window starts with the step
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        rt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        rt.quiesce()
        peak = take_peak_allocated(rt.device)
        always_gathered = [u for u in rt.units if u.name == "" or u.persistent]  # (runtime.gathered_bound's)
        largest = max((u for u in rt.units if u not in always_gathered), key=lambda u: u.layout.padded_numel)
        always = sum(u.nbytes_full for u in always_gathered)
        working_set = always + unit_working_set_bytes(largest.layout.padded_numel, 2, 1,
                                                      ahead=rt.schedule.gather_ahead and rt.config.pipeline)
        print(json.dumps({"step_device_peak": peak, "working_set": working_set, "unit_bytes": largest.nbytes_full,
                          "loss": loss.item(), "logits_bytes": SEQ * vocab * 4}))


if __name__ == "__main__":
    main()
