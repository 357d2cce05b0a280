"""The runtime refuses at wrap a device budget that `offload plan` refuses for the units' working set, with one line
naming the setting and the figure needed, and runs one the plan accepts: both size the largest unit's working set
with offload.plan.memory.unit_working_set_bytes (issue 42: the first step ran to 18.6 GiB against a device budget
of 3 GiB that `offload plan` had said was 12.2 GiB short)."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import offload
from offload.cli import build_parser
from offload.plan.cli import plan_from_args
from offload.plan.memory import Workload, tier_bytes, PLACEMENTS, unit_working_set_bytes
from offload.plan.model_spec import model_from

VOCAB, HIDDEN = 32000, 256  # the embedding and the LM head (15.6 MiB each in bf16) are the largest units


def _config() -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=704, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


def _plan_fits(config_json: str, gpu_mem: str) -> bool:
    args = build_parser(only="plan").parse_args(["plan", "--model", config_json, "--gpus", "1", "--gpu", "cpu", "--gpu-mem", gpu_mem,
                              "--cpu-mem", "8GiB", "--seq-len", "16", "--micro-batch", "1",
                              "--optimizer-states", "adamw"])
    return plan_from_args(args)["chosen"] is not None


def _runtime(device_budget: str) -> offload.Config:
    return offload.Config(params="cpu", optimizer="cpu", cpu_budget="512MiB", device_budget=device_budget,
                          compute_dtype="bf16")


def test_the_plan_counts_the_units_working_set_with_the_runtimes_function(tmp_path):
    _config().save_pretrained(tmp_path)
    m = model_from(str(tmp_path / "config.json"))
    assert m.largest_unit_params == VOCAB * HIDDEN
    gathered = tier_bytes(m, Workload(seq_len=16), 1, PLACEMENTS[0])["device"]["gathered"]
    assert gathered == unit_working_set_bytes(VOCAB * HIDDEN, 2, 1, ahead=True)


def test_a_device_budget_the_plan_refuses_is_refused_at_wrap_and_one_it_accepts_runs(tmp_path):
    _config().save_pretrained(tmp_path)
    config_json = str(tmp_path / "config.json")
    assert not _plan_fits(config_json, "40MiB")
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config())
    with offload.init(_runtime("40MiB")) as rt:
        with pytest.raises(MemoryError, match=r"^offload.Config.device_budget \(offload plan --gpu-mem\): unit \d+ "
                                              r"\(model.embed_tokens, Embedding\) needs 78.\d\d MiB .* give "
                                              r"device_budget >= 78.\d\d MiB, or cut smaller units"):
            rt.wrap(model)

    assert _plan_fits(config_json, "1GiB")
    model = LlamaForCausalLM(_config())
    with offload.init(_runtime("1GiB")) as rt:
        rt.wrap(model)
        opt = offload.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        rt.clip_grad_norm_(1.0)
        opt.step()
        assert torch.isfinite(loss)
