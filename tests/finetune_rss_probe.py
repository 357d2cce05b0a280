"""Peak host RSS while a model streams from safetensors into the store (run as a subprocess by
test_finetune.py so the peak covers only this run). Prints one JSON line."""
import json
import sys

import psutil
import torch

import offload
from offload.integrations.hf_model_dir import HFModelDir
from offload.zero.host_memory import peak_rss_bytes
from offload.zero.units.materialize import values_from_weights


def main():
    model_dir, nvme_dir, cpu_budget = sys.argv[1:4]
    probed = sys.argv[4] if len(sys.argv) > 4 else "model.layers.0.mlp.up_proj.weight"  # its first row's first 4
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    source = HFModelDir(model_dir)
    config = source.config()
    with torch.device("meta"):  # warm-up: imports and class set-up every run pays, before the baseline
        AutoModelForCausalLM.from_config(config)
    rss0 = psutil.Process().memory_info().rss
    try:  # restart the peak (VmHWM) at the baseline
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    cfg = offload.Config(params="nvme", optimizer="nvme", nvme_path=nvme_dir, cpu_budget=cpu_budget)
    with offload.init(cfg) as rt:
        with values_from_weights():  # as offload finetune builds it: the files give every value
            model = AutoModelForCausalLM.from_config(config)
        rt.wrap(model, weights=source.weights(model))
        peak = peak_rss_bytes()
        largest_unit = max(u.layout.padded_numel for u in rt.units) * 4
        n = sum(p.numel() for p in model.parameters())
        first = rt.full_state_dict(model)[probed].flatten()[:4].tolist()
    print(json.dumps({"rss0": rss0, "peak": peak, "params": n, "largest_unit_fp32": largest_unit, "first": first}))


if __name__ == "__main__":
    main()
