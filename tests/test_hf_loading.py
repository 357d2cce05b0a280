"""`from_pretrained` inside `offload.init` (offload/integrations/hf_loading.py): the model streams from its
safetensors into the store unit by unit (no rank holds it whole), gives exactly the saved weights, and
arguments that would change where or how weights load are refused by name. Outside a runtime from_pretrained
is transformers' own."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

import offload  # noqa: E402


def _save(path, tie=True, layers=2, hidden=64, vocab=300):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 16,
                                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                         tie_word_embeddings=tie))
    model.save_pretrained(path)
    return model.state_dict()


def _cfg(**kw):
    return offload.Config(**{"params": "cpu", "optimizer": "cpu", "cpu_budget": "64MiB", "device_budget": "64MiB", **kw})


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_saved_weights_stream_into_the_runtime(tmp_path, tie, dtype):
    saved = _save(tmp_path / "m", tie=tie)
    with offload.init(_cfg(compute_dtype=dtype, params="nvme", optimizer="nvme", nvme_path=str(tmp_path))) as rt:
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
        assert [u for u in rt.units] and all(p.device.type == "meta" for p in model.parameters())  # sharded
        assert not model.training  # eval mode, as transformers leaves it
        held = rt.full_state_dict(model)  # the fp32 master copies: the file's values, exactly
        assert all(torch.equal(held[k], v) for k, v in saved.items())
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
        ids = torch.arange(16).view(2, 8)
        with torch.no_grad():  # inputs on the runtime's compute device (the GPU where there is one), as with torch
            logits = model(input_ids=ids.to(rt.device)).logits.float().cpu()
        device = rt.device
    plain = LlamaForCausalLM.from_pretrained(tmp_path / "m")  # outside the runtime: transformers' own
    assert all(p.device.type == "cpu" for p in plain.parameters())
    with torch.no_grad():  # on the same device: a GPU's fp32 kernels differ from the CPU's by about 3e-4 here
        expected = plain.to(device)(input_ids=ids.to(device)).logits.cpu()
    tol = 1e-5 if dtype == "fp32" else 0.1  # bf16 weights and activations
    torch.testing.assert_close(logits, expected, rtol=0, atol=tol)


def test_arguments_that_change_loading_are_refused(tmp_path):
    _save(tmp_path / "m")
    with offload.init(_cfg()):
        with pytest.raises(ValueError, match=r"device_map='auto'.*not supported inside offload.init"):
            AutoModelForCausalLM.from_pretrained(tmp_path / "m", device_map="auto")
        with pytest.raises(ValueError, match=r"dtype=torch.float16.*Config.compute_dtype \(fp32\) decides"):
            AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float16)
        with pytest.raises(ValueError, match="LlamaForCausalLM.from_pretrained .*: no config.json"):
            LlamaForCausalLM.from_pretrained(tmp_path)
        # what example scripts pass, at transformers' own defaults, loads (the Auto classes copy revision into
        # adapter_kwargs; subfolder "" and dtype as a string are the defaults spelled out)
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype="float32", local_files_only=True,
                                                     revision="main", subfolder="", variant=None)
        assert model is not None
        from transformers import AutoModelForSequenceClassification

        with pytest.raises(ValueError, match="score.weight is missing.*a new head"):  # transformers would init it
            AutoModelForSequenceClassification.from_pretrained(tmp_path / "m", num_labels=3)


def test_the_generation_config_comes_with_the_model_and_goes_with_it(tmp_path):
    _save(tmp_path / "m")
    from transformers import GenerationConfig

    GenerationConfig(eos_token_id=[2, 7], temperature=0.3, do_sample=True).save_pretrained(tmp_path / "m")
    from offload.integrations.hf_model_dir import save_pretrained

    with offload.init(_cfg()) as rt:
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
        assert model.generation_config.eos_token_id == [2, 7] and model.generation_config.temperature == 0.3
        save_pretrained(rt, model, tmp_path / "out")
    again = GenerationConfig.from_pretrained(tmp_path / "out")
    assert again.eos_token_id == [2, 7] and again.temperature == 0.3


def test_loading_holds_about_the_budgets_not_the_model(tmp_path):
    """A 65M-parameter Llama (249 MiB in fp32) loads into a runtime of a 32 MiB cpu budget: the process's peak
    resident set grows by less than 112 MiB (the cpu budget, 32 MiB for the device tier's first blocks, one unit
    being read, the safetensors pages of one tensor, allocator slack), not by the model's size as an in-memory
    load does. With glibc keeping freed buffers ("fast") the bound is 160 MiB: its heap fragments by the order
    the load's buffers come and go, and that order follows timing (measured here 67-121 MiB, at 140 and at 249
    MiB of model alike; CI once 119; "frugal" 47-49, "pool" 83-85, the pool's cache included).
    The device budget is what a step of its largest unit (the embedding) needs, or wrap refuses it
    (placement.check_unit_working_set); a load gathers nothing, so it does not raise the bound."""
    _save(tmp_path / "m", tie=False, layers=24, hidden=512, vocab=8000)
    code = textwrap.dedent(f"""
        import offload
        from transformers import AutoModelForCausalLM
        def status(field):
            return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1]) * 1024
        cfg = offload.Config(params="nvme", optimizer="nvme", nvme_path={str(tmp_path)!r}, cpu_budget="32MiB",
                             device_budget="160MiB")
        with offload.init(cfg) as rt:
            before = status("VmRSS")
            model = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'm')!r})
            n = sum(p.numel() for p in model.parameters())
            print("GROWTH", status("VmHWM") - before, n * 4, flush=True)
    """)
    bound_mib = {"frugal": 112, "pool": 112, "fast": 160}  # a GPU run's malloc mode, the CPU default's, glibc's
    for mode, bound in bound_mib.items():
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, OFFLOAD_MALLOC_TUNE=mode, OMP_NUM_THREADS="1"))
        assert out.returncode == 0, out.stderr[-3000:]
        growth, model_bytes = map(int, next(x for x in out.stdout.splitlines() if x.startswith("GROWTH")).split()[1:])
        assert model_bytes > 240 << 20
        assert growth < bound << 20, (mode, growth >> 20)
