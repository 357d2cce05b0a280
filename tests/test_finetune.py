"""`offload finetune` and offload.finetune.finetune: the README's main job.

Covered: the default run shortened (exit 0, loss falls, the output loads with transformers and gives the
runtime's logits), a model saved by transformers gives transformers' first-step loss (fp32: 1e-5 relative;
bf16: 2e-2 relative, the bf16 rounding of weights and activations), streaming load memory, torchrun with
2 ranks giving the 1-process losses, and every bad input named before training starts.
"""
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402

from offload.cli import main  # noqa: E402
from offload.finetune import FinetuneConfig, finetune  # noqa: E402
from offload.finetune.batches import IGNORE, Sampler, build_blocks, split_heldout  # noqa: E402
from offload.finetune.corpus import Example, read_data_file, stdlib_corpus  # noqa: E402
from offload.finetune.tokenizer import train_bpe  # noqa: E402
from offload.errors import InputError  # noqa: E402

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.txt"
    path.write_text("\n\n".join(e.text for e in stdlib_corpus(max_chars=200_000)))
    return path


def _save_tiny(path: Path, tokenizer, tie=True, **overrides) -> Path:
    torch.manual_seed(0)
    cfg = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tie)
    cfg.update(overrides)
    LlamaForCausalLM(LlamaConfig(**cfg)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, text_file) -> Path:
    """A 2-layer Llama saved by transformers (tied embedding), with a byte-level BPE of 400 tokens."""
    tok = train_bpe([Example(text_file.read_text()[:100_000])], 400)
    return _save_tiny(tmp_path_factory.mktemp("tiny"), tok)


def _first_batch(model_dir: Path, data: Path, cfg: FinetuneConfig):
    tok = AutoTokenizer.from_pretrained(model_dir)
    train, _ = split_heldout(build_blocks(read_data_file(data), tok, cfg.seq_len), cfg.eval_blocks)
    return train.take(Sampler(len(train), cfg.micro_batch, cfg.grad_accum, 1, cfg.seed).indices(0, 0, 0))


# ---- the default run, shortened ----------------------------------------------------------------
def test_default_run_shortened(tmp_path, capsys, monkeypatch):
    """The README's main command, 6 steps: exit 0, the loss falls, the summary is printed, and the output
    loads with transformers and gives the trained runtime model's logits (in the dtype it trained in: "auto",
    bf16 where the CPU has bf16 instructions, else fp32)."""
    import offload.finetune.job as job

    ids = torch.arange(64).view(2, 32) + 100
    captured = {}

    def on_trained(rt, model):
        with torch.no_grad():
            captured["logits"] = model(input_ids=ids).logits.float()

    real = job.finetune
    # the CLI's own run (it imports job.finetune when called), with a look at the model before it closes
    monkeypatch.setattr(job, "finetune",
                        lambda cfg, progress=None, **kw: real(cfg, progress, on_trained=on_trained, **kw))
    out = tmp_path / "out"
    rc = main(["finetune", "--steps", "6", "--eval-blocks", "8", "--output", str(out),
               "--json", str(tmp_path / "r.json")])
    said = capsys.readouterr()
    text = said.out
    assert rc == 0
    # the bar shows the paging every step does (in MB/s: GB/s rounded a slow CPU's 5 MB/s to "0.00")
    rates = [(int(r), int(w)) for r, w in re.findall(r"nvme MB/s=R (\d+) W (\d+)", said.err)]
    assert rates and all(r > 0 and w > 0 for r, w in rates), said.err[-2000:]
    r = json.loads((tmp_path / "r.json").read_text())
    losses = r["losses"]
    assert len(losses) == 6 and all(map(lambda x: x == x and abs(x) < 100, losses))
    assert losses[-1] < losses[0] - 0.3  # from ln(8192) = 9.0: falls fast at lr 1e-3
    assert r["eval_loss_after"] < r["eval_loss_before"] - 0.3
    assert 20e6 < r["n_params"] < 60e6  # "tens of millions"
    assert (r["params_tier"], r["optimizer_tier"]) == ("nvme", "nvme")
    assert r["bytes_moved"]["nvme read"] > 6 * r["n_params"] * 2  # every step pages the params in
    assert "held-out loss" in text and "peak host RSS" in text and "nvme read" in text
    # the figures the peers publish, per rank from rt.stats(): in the bar each step and in the summary
    assert re.search(r"TFLOPS=\d", said.err) and "model TFLOPS per rank (6 x params x tokens / s" in text
    assert r["model_tflops"] > 0 and r["mfu"] is None  # (a CPU: no known peak)
    from offload.compute_dtype import fast_compute_dtype

    assert r["compute_dtype"] == fast_compute_dtype(torch.device("cpu"))[0]  # the default: "auto"
    assert f"compute dtype   {r['compute_dtype']} (the CPU multiplies bf16 at " in text
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[r["compute_dtype"]]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=dtype)  # as the runtime computed
    tok = AutoTokenizer.from_pretrained(out)
    assert model.num_parameters() == r["n_params"] and len(tok) <= model.config.vocab_size
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    torch.testing.assert_close(logits, captured["logits"], rtol=0, atol=0.05)  # bf16 logits of size ~10


def test_output_gives_the_runtimes_logits(tmp_path, tiny_model, text_file):
    """The saved model, loaded by transformers, computes the trained runtime model's logits; a small
    --max-shard-size gives several files and an index."""
    captured = {}
    ids = torch.arange(2 * 24).view(2, 24) % 300

    def on_trained(rt, model):
        with torch.no_grad():
            captured["logits"] = model(input_ids=ids).logits.float()

    cfg = FinetuneConfig(model=str(tiny_model), data=str(text_file), steps=3, seq_len=64, compute_dtype="fp32",
                         output=str(tmp_path / "out"), max_shard_size="100KiB", cpu_budget="8MiB", save_every=2)
    r = finetune(cfg, on_trained=on_trained)
    assert AutoModelForCausalLM.from_pretrained(r.output / "checkpoint-2").num_parameters() > 0  # --save-every
    files = sorted(p.name for p in r.output.iterdir())
    assert "model.safetensors.index.json" in files and "model-00002-of-00005.safetensors" in files
    assert not any(f.startswith(".partial") for f in files)
    loaded = AutoModelForCausalLM.from_pretrained(r.output)
    assert loaded.config.tie_word_embeddings and loaded.dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, captured["logits"], rtol=1e-5, atol=1e-5)
    assert r.losses[-1] < r.losses[0]


def test_lora_run_writes_an_adapter_peft_loads_and_the_merged_model(tmp_path, tiny_model, text_file):
    """--lora-r: PEFT's adapters over the streamed base; OUTPUT is the adapter (PeftModel.from_pretrained over the
    base gives the trained runtime model's logits; so does OUTPUT/merged with transformers alone); only the
    adapters train; the base's files are untouched."""
    pytest.importorskip("peft")
    from peft import PeftModel

    captured = {}
    ids = torch.arange(2 * 24).view(2, 24) % 300

    def on_trained(rt, model):
        with torch.no_grad():
            captured["logits"] = model(input_ids=ids).logits.float()

    base_bytes = (tiny_model / "model.safetensors").read_bytes()
    cfg = FinetuneConfig(model=str(tiny_model), data=str(text_file), steps=3, seq_len=64, compute_dtype="fp32",
                         output=str(tmp_path / "out"), cpu_budget="8MiB", save_every=2, lr=1e-2, lora_r=4,
                         lora_targets="q_proj,v_proj,o_proj", lora_merge=True)
    r = finetune(cfg, on_trained=on_trained)
    # 2 layers x (q: 64->64, v: 64->32, o: 64->64) adapters of rank 4: A is 4 x in, B is out x 4
    assert r.trainable_params == 2 * 4 * ((64 + 64) + (64 + 32) + (64 + 64)) and r.n_params > 30 * r.trainable_params
    assert (r.output / "adapter_model.safetensors").is_file() and (r.output / "tokenizer.json").is_file()
    assert (r.output / "checkpoint-2" / "adapter_config.json").is_file()  # --save-every: adapters too
    assert not any(p.name.startswith(".partial") for p in r.output.iterdir())
    assert (tiny_model / "model.safetensors").read_bytes() == base_bytes
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), r.output)
    merged = AutoModelForCausalLM.from_pretrained(r.merged)
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=ids).logits, captured["logits"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(merged(input_ids=ids).logits, captured["logits"], rtol=1e-4, atol=1e-4)
        base = AutoModelForCausalLM.from_pretrained(tiny_model)(input_ids=ids).logits
    assert not torch.allclose(base, captured["logits"], atol=1e-3)  # the adapters did train


@pytest.mark.parametrize("shard", [2 << 30, 100 << 10], ids=["one-file", "sharded"])
def test_saved_weights_get_the_mode_of_the_other_files(tmp_path, tiny_model, shard):
    """safetensors creates its files 0600: the weights would be private while config.json and the tokenizer
    are readable by all (0666 less the umask), so another user could read the config but not the model."""
    import offload
    from offload.integrations.hf_model_dir import save_pretrained

    umask = os.umask(0)
    os.umask(umask)
    loaded = AutoModelForCausalLM.from_pretrained(tiny_model)
    with offload.init(offload.Config(params="cpu", optimizer="cpu", cpu_budget="64MiB")) as rt:
        model = rt.wrap(loaded)
        out = save_pretrained(rt, model, tmp_path / "out", AutoTokenizer.from_pretrained(tiny_model),
                              max_shard_bytes=shard)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    weights = [n for n in modes if n.endswith(".safetensors")]
    assert len(weights) == (1 if shard > 1 << 20 else 5) and "tokenizer.json" in modes, modes
    assert modes["config.json"] == 0o666 & ~umask
    assert all(modes[n] == modes["config.json"] for n in weights), modes


@pytest.mark.parametrize("dtype,rtol", [("fp32", 1e-5), ("bf16", 2e-2), ("fp16", 5e-3)])
def test_first_step_loss_matches_transformers(tmp_path, tiny_model, text_file, dtype, rtol):
    cfg = FinetuneConfig(model=str(tiny_model), data=str(text_file), steps=1, seq_len=64, compute_dtype=dtype,
                         output=str(tmp_path / "out"), cpu_budget="8MiB")
    r = finetune(cfg)
    batch = _first_batch(tiny_model, text_file, cfg)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        logits = ref(input_ids=batch.inputs).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE)
    assert r.losses[0] == pytest.approx(expected.item(), rel=rtol)


def test_update_in_backward_with_accumulation(tmp_path, tiny_model, text_file):
    """update_in_backward with --grad-accum 2: the job runs each step's first backward inside rt.accumulating(),
    so the mode arms from the second step; the first two losses are the default run's (the first update is
    exact), later ones differ by the clip coefficient's lag only."""
    seen = {}
    kw = dict(model=str(tiny_model), data=str(text_file), steps=4, seq_len=64, grad_accum=2, cpu_budget="8MiB")
    base = finetune(FinetuneConfig(output=str(tmp_path / "a"), **kw))
    early = finetune(FinetuneConfig(output=str(tmp_path / "b"), update_in_backward=True, **kw),
                     on_trained=lambda rt, model: seen.update(rt.stats()["last_step"]["clip"]))
    assert seen["in_backward"] > 0
    assert early.losses[:2] == base.losses[:2]
    assert early.losses == pytest.approx(base.losses, rel=1e-2)


def test_max_grad_norm_0_is_no_clipping(tmp_path, tiny_model, text_file):
    """--max-grad-norm 0 means no clipping (HF Trainer's and DeepSpeed's meaning): the losses are a run's whose
    limit no gradient reaches, bit for bit. It clipped every gradient to norm 0, so only the decay moved."""
    kw = dict(model=str(tiny_model), data=str(text_file), steps=3, seq_len=64, cpu_budget="8MiB")
    unclipped = finetune(FinetuneConfig(output=str(tmp_path / "a"), max_grad_norm=0, **kw))
    never_reached = finetune(FinetuneConfig(output=str(tmp_path / "b"), max_grad_norm=1e30, **kw))
    assert unclipped.losses == never_reached.losses and unclipped.losses[-1] < unclipped.losses[0]


def test_activations_offloaded_to_nvme_train_as_without(tmp_path, tiny_model, text_file):
    """--activations nvme with --grad-checkpointing: each block's input waits in the swap directory; the losses
    are those of the run without, bit for bit."""
    seen = {}
    kw = dict(model=str(tiny_model), data=str(text_file), steps=2, seq_len=64, cpu_budget="8MiB",
              grad_checkpointing=True)
    (tmp_path / "small.json").write_text('{"activations_min_size": "4KiB"}')  # this model's tensors are small
    base = finetune(FinetuneConfig(output=str(tmp_path / "a"), **kw))
    moved = finetune(FinetuneConfig(output=str(tmp_path / "b"), activations="nvme",
                                    offload_config=str(tmp_path / "small.json"), **kw),
                     on_trained=lambda rt, model: seen.update(rt.stats()["activations"]))
    assert moved.losses == base.losses
    assert seen["home"] == "nvme" and seen["moved_tensors"] > 0 and seen["in_store"] == 0


# ---- streaming load ----------------------------------------------------------------------------
def test_streaming_load_peak_rss(tmp_path):
    """A model of 327 MB fp32 (5x the 64 MiB cpu budget) streams in: RSS grows by at most the budget + 3
    units (fp32) + 32 MiB, which is well under the model's size. Measured with glibc's malloc in the runtime's
    "frugal" mode (OFFLOAD_MALLOC_TUNE, what a GPU run uses: freed unit-sized buffers go back to the OS), so
    the peak is the bytes the load holds: in the CPU default ("fast") glibc keeps freed blocks for reuse, and
    how much it keeps depends on the order frees land in (here: 61 MiB frugal, 82 with nvme writes slowed by
    injected delays; 126 MiB fast, and one fast run in the full suite reached 174, over the bound)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=768, intermediate_size=2048,
                                         num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                                         max_position_embeddings=128, tie_word_embeddings=False))
    expected = model.model.layers[0].mlp.up_proj.weight[0, :4].tolist()
    model_bytes = sum(p.numel() for p in model.parameters()) * 4
    model.save_pretrained(tmp_path / "big", max_shard_size="150MB")
    del model
    (tmp_path / "swap").mkdir()
    budget = 64 << 20
    proc = subprocess.run([sys.executable, str(TESTS / "finetune_rss_probe.py"), str(tmp_path / "big"),
                           str(tmp_path / "swap"), f"{budget}B"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OFFLOAD_MALLOC_TUNE="frugal"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["first"] == expected  # the values are the file's
    bound = budget + 3 * r["largest_unit_fp32"] + (32 << 20)
    assert bound < model_bytes / 1.8  # the bound is meaningful: holding the model whole would break it
    assert r["peak"] - r["rss0"] <= bound, r


# ---- ranks -------------------------------------------------------------------------------------
@pytest.mark.parametrize("lora", [[], ["--lora-r", "4", "--lora-targets", "q_proj,v_proj,o_proj"]],
                         ids=["full", "lora"])
def test_torchrun_two_ranks_same_losses(tmp_path, tiny_model, text_file, lora):
    common = ["--model", str(tiny_model), "--data", str(text_file), "--steps", "3", "--seq-len", "64",
              "--compute-dtype", "fp32", "--cpu-budget", "8MiB", "--eval-blocks", "4", *lora]
    assert main(["finetune", *common, "--micro-batch", "4", "--output", str(tmp_path / "one"),
                 "--json", str(tmp_path / "one.json")]) == 0
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "offload.cli", "finetune", *common, "--micro-batch", "2", "--output", str(tmp_path / "two"),
           "--json", str(tmp_path / "two.json")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert two["world_size"] == 2 and two["tokens_per_step"] == one["tokens_per_step"]
    # the same samples per step; the sum over ranks and the reduce change only the rounding
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert two["eval_loss_after"] == pytest.approx(one["eval_loss_after"], rel=1e-4)


# ---- settings ----------------------------------------------------------------------------------
def test_a_deepspeed_configs_training_settings_are_the_runs_or_refused(tmp_path):
    """--config ds.json with a micro-batch, accumulation, clipping or learning rate other than the run's: the run
    used its own (flags or defaults) and the file's were dropped without a word; then a differing one was refused,
    one per run (four runs before one trained). Now every differing value is named in one error, as Hugging Face's
    Trainer names them; equal ones and "auto" are accepted (filled with the flags' values)."""
    from offload.finetune.job import runtime_config

    zero = {"stage": 3, "offload_optimizer": {"device": "cpu"}}
    (tmp_path / "ds.json").write_text(json.dumps({
        "zero_optimization": zero, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 16,
        "gradient_clipping": 0.5, "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "betas": [0.9, 0.95]}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 2e-5, "warmup_num_steps": 10}}}))
    with pytest.raises(InputError) as info:
        runtime_config(FinetuneConfig(model="m", offload_config=str(tmp_path / "ds.json"), steps=100), "/tmp/x")
    said = str(info.value)
    for pair in ("train_micro_batch_size_per_gpu=8 vs --micro-batch=4", "gradient_accumulation_steps=16 vs "
                 "--grad-accum=1", "gradient_clipping=0.5 vs --max-grad-norm=1.0", "optimizer.params.lr=2e-05 vs "
                 "--lr=0.001", "optimizer.params.betas=[0.9, 0.95] vs --optim adamw's betas=[0.9, 0.999]",
                 "scheduler.params.warmup_max_lr=2e-05 vs --lr=0.001",
                 "scheduler.params.warmup_num_steps=10 vs --warmup-steps=5"):
        assert pair in said
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": zero, "train_micro_batch_size_per_gpu": 8,
                                                  "gradient_accumulation_steps": "auto",
                                                  "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "weight_decay": 0.0}},
                                                  "scheduler": {"type": "WarmupLR", "params": {
                                                      "warmup_num_steps": "auto", "warmup_type": "linear"}}}))
    c = runtime_config(FinetuneConfig(model="m", offload_config=str(tmp_path / "ds.json"), micro_batch=8, lr=2e-5,
                                      weight_decay=0.0, steps=40), "/tmp/x")
    assert c.deepspeed_training["gradient_accumulation_steps"] == 1  # "auto": the flag's
    assert c.deepspeed_training["scheduler"]["params"] == {"warmup_num_steps": 2, "warmup_type": "linear"}


def test_a_deepspeed_configs_schedule_is_the_runs(tmp_path, tiny_model, text_file):
    """Its scheduler section is what the run steps by (DeepSpeed's WarmupLR, its "auto" steps and peak from the
    flags), not the flags' warmup + cosine: the file's schedule was dropped before."""
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}, "scheduler": {
        "type": "WarmupLR", "params": {"warmup_num_steps": "auto", "warmup_type": "linear", "warmup_max_lr": "auto"}}}))
    finetune(FinetuneConfig(model=str(tiny_model), data=str(text_file), steps=3, warmup_steps=2, seq_len=64,
                            cpu_budget="8MiB", checkpoint_every=3, offload_config=str(tmp_path / "ds.json"),
                            output=str(tmp_path / "out")))
    manifest = json.loads(next((tmp_path / "out").glob("**/manifest.json")).read_text())
    sched = manifest["lr_schedulers"][0]
    assert (sched["kind"], sched["warmup_num_steps"], sched["warmup_max_lr"]) == ("WarmupLR", 2, 1e-3)
    assert sched["_last_lr"] == [1e-3]  # past the warmup: flat at the peak (the cosine would be decaying)
    assert manifest["extra"]["run"]["schedule"].startswith("WarmupLR(")


def test_runtime_settings_from_flags_config_file_and_defaults(tmp_path):
    from offload.finetune.job import runtime_config

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"bf16": {"enabled": False}, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "cpu"},
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}}))
    c = runtime_config(FinetuneConfig(model="m", offload_config=str(ds)), "/tmp/default-swap")
    assert (c.params, c.optimizer, c.nvme_path) == ("cpu", "nvme", str(tmp_path))  # from the file
    assert c.cpu_budget == "auto" and c.compute_dtype == "fp32"  # the fine-tune's default; the file's bf16: off
    c = runtime_config(FinetuneConfig(model="m", offload_config=str(ds), params="nvme", cpu_budget="1GiB"), "/x")
    assert (c.params, c.cpu_budget) == ("nvme", "1GiB")  # flags win
    c = runtime_config(FinetuneConfig(), "/tmp/default-swap")  # the built-in model: small budget, both on disk
    assert (c.params, c.optimizer, c.cpu_budget, c.nvme_path, c.compute_dtype) == (
        "nvme", "nvme", "256MiB", "/tmp/default-swap", "auto")
    ours = tmp_path / "offload.json"
    ours.write_text(json.dumps({"optimizer": "cpu", "chunk_size": "4MiB", "nosuch": 1}))
    with pytest.raises(ValueError, match=r"--config .*offload.json: unknown offload.Config fields \['nosuch'\]"):
        runtime_config(FinetuneConfig(offload_config=str(ours)), "/x")


# ---- data --------------------------------------------------------------------------------------
def test_pairs_take_the_loss_on_the_response_only(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    blocks = build_blocks([Example("question: 1+1?", " answer: 2")], tok, 32)
    prompt = tok("question: 1+1?", add_special_tokens=False)["input_ids"]
    response = tok(" answer: 2", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    labels = blocks.labels[0]
    # label i is the token at position i + 1: the first labelled one is the response's first token
    assert labels[:len(prompt) - 1].eq(IGNORE).all()
    assert labels[len(prompt) - 1:len(prompt) - 1 + len(response)].tolist() == response
    assert labels[len(prompt) - 1 + len(response):].eq(IGNORE).all()


def test_a_tokenizer_that_starts_sequences_with_bos_gets_it_before_each_document_and_prompt(tiny_model):
    """Text was tokenized without special tokens, so a Llama, Mistral or Gemma fine-tune never saw the BOS token
    it was pretrained with and sees at inference. Now each document and each prompt starts with it, where the
    tokenizer puts it in front of what it encodes; the built-in tokenizer (no BOS of its own) is unchanged."""
    from tokenizers.processors import TemplateProcessing

    plain = AutoTokenizer.from_pretrained(tiny_model)
    docs = [Example("first document"), Example("second one")]
    unchanged = build_blocks(docs, plain, 4)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.add_special_tokens({"bos_token": "<s>"})
    bos = tok.bos_token_id
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    stream = build_blocks(docs, tok, 4)
    first, second = (tok(e.text, add_special_tokens=False)["input_ids"] for e in docs)
    expect = [bos, *first, tok.eos_token_id, bos, *second, tok.eos_token_id]
    got = torch.cat([stream.inputs.reshape(-1), stream.labels[-1, -1:]]).tolist()
    assert got == expect[:len(got)] and got.count(bos) == 2
    assert torch.cat([unchanged.inputs.reshape(-1), unchanged.labels[-1, -1:]]).tolist() == \
        [t for t in expect if t != bos][:unchanged.inputs.numel() + 1]
    pair = build_blocks([Example("question: 1+1?", " answer: 2")], tok, 32)
    prompt = [bos] + tok("question: 1+1?", add_special_tokens=False)["input_ids"]
    assert pair.inputs[0, :len(prompt)].tolist() == prompt
    assert pair.labels[0, :len(prompt) - 1].eq(IGNORE).all() and pair.labels[0, len(prompt) - 1] != IGNORE


def test_sampler_global_batch_is_the_same_for_every_world_size():
    one = Sampler(50, micro_batch=4, grad_accum=2, world_size=1, seed=3)
    two = Sampler(50, micro_batch=2, grad_accum=2, world_size=2, seed=3)
    for step in range(20):  # crosses epochs (50 blocks, 8 per step)
        for micro in range(2):
            a = one.indices(step, micro, 0)
            b = torch.cat([two.indices(step, micro, r) for r in range(2)])
            assert torch.equal(a, b)
    seen = torch.cat([one.step_indices(s) for s in range(7)])[:50]  # the first epoch: each block once
    assert sorted(seen.tolist()) == list(range(50))


# ---- bad input: a clear error before training, naming the path or flag and the fix ----------------
def _fails(capsys, args, *needles):
    assert main(["finetune", *args]) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err
    return err


@pytest.mark.parametrize("args, says", [
    (["--seq-len", "0"], "--seq-len must be at least 1 (got 0)"),
    (["--lr", "-1"], "--lr must be positive (got -1.0)"),
    (["--weight-decay", "-3"], "--weight-decay must be 0 or more (got -3.0)"),
    (["--max-grad-norm", "-1"], "--max-grad-norm must be 0 (no clipping) or more (got -1.0)"),
    (["--lora-r", "8"], "--lora-r trains adapters over a pretrained base: give --model DIR"),
    (["--lora-alpha", "16"], "--lora-alpha and --lora-merge go with --lora-r R"),
])
def test_out_of_range_settings_are_one_line_not_a_traceback(capsys, args, says):
    """Raised by FinetuneConfig's own checks, which ran outside the CLI's error handling (a traceback, rc 1)."""
    err = _fails(capsys, args, says)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.fixture
def read_only_dir(tmp_path):
    """A read-only mount (a tmpfs mounted ro; skipped where mounting is not allowed)."""
    import subprocess

    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True).returncode:
        pytest.skip("mounting a read-only tmpfs is not allowed here")
    yield ro
    subprocess.run(["umount", str(ro)], capture_output=True)


def test_an_unwritable_output_is_found_before_training(tmp_path, capsys, read_only_dir):
    """Found after every step had run (OSError: read-only file system; the trained weights lost)."""
    _fails(capsys, ["--output", str(read_only_dir / "out"), "--steps", "1"], "--output", "cannot write in",
           "Read-only file system")
    taken = tmp_path / "a-file"
    taken.write_text("not a directory")
    _fails(capsys, ["--output", str(taken), "--steps", "1"], "--output", "is a file, not a directory")
    _fails(capsys, ["--output", str(taken / "out"), "--steps", "1"], "is a file, so the directory cannot be created")
    _fails(capsys, ["--checkpoint-dir", str(read_only_dir), "--steps", "1"], "--checkpoint-dir", "cannot write in")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_mid_run_removes_the_swap_and_says_how_to_resume(tmp_path, tiny_model, text_file, sig):
    """SIGTERM (timeout, Slurm preemption, docker stop) left the swap files behind; SIGINT printed a traceback."""
    swap = tmp_path / "swap"
    swap.mkdir()
    data = tmp_path / "small.txt"
    data.write_text(text_file.read_text()[:40_000])  # a quick start: the run is stopped after its first step
    cmd = [sys.executable, "-m", "offload.cli", "finetune", "--model", str(tiny_model), "--data", str(data),
           "--steps", "400", "--seq-len", "64", "--eval-blocks", "2", "--nvme-path", str(swap), "--compute-dtype", "fp32",
           "--cpu-budget", "8MiB", "--checkpoint-every", "1", "--keep-checkpoints", "1",
           "--output", str(tmp_path / "out")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "out" / "checkpoints" / "latest").exists():  # a step done and checkpointed
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        assert any(swap.glob("offload-*/*.swap"))  # the run is paging through its swap files now
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, err[-3000:]
    assert list(swap.iterdir()) == [], list(swap.iterdir())  # the run's directory and swap files are gone
    assert "Traceback" not in err, err[-3000:]
    assert re.search(rf"interrupted \({sig.name}\) after step \d+; resume with --resume .*checkpoints", err), err


def test_persistent_buffers_are_read_from_the_weights(tmp_path):
    """Only parameters were read: a persistent buffer in the files was listed as ignored and kept its initial
    value, which the save then wrote out in place of the model's."""
    from safetensors.torch import save_file

    from offload.integrations.hf_model_dir import HFModelDir

    class WithBuffer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.register_buffer("scale", torch.ones(4))  # persistent
            self.register_buffer("cache", torch.zeros(2), persistent=False)

    trained = WithBuffer()
    trained.scale.fill_(3.0)
    save_file({k: v.contiguous() for k, v in trained.state_dict().items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    fresh = WithBuffer()
    model_dir = HFModelDir(tmp_path)
    assert model_dir.check(fresh) == []  # nothing in the files goes unused
    assert model_dir.load_buffers(fresh) == ["scale"] and torch.equal(fresh.scale, torch.full((4,), 3.0))


def test_model_directory_errors(tmp_path, capsys, tiny_model, text_file):
    empty = tmp_path / "empty"
    empty.mkdir()
    data = ["--data", str(text_file), "--seq-len", "64", "--output", str(tmp_path / "out")]
    _fails(capsys, ["--model", str(empty), *data], str(empty), "no config.json", "save_pretrained")
    # shapes that do not match the config
    wrong = tmp_path / "wrong"
    shutil.copytree(tiny_model, wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (wrong / "config.json").write_text(json.dumps(cfg))
    _fails(capsys, ["--model", str(wrong), *data], "model.layers.0.mlp.up_proj.weight", "[128, 64]", "[96, 64]",
           "same model")
    # quantized weights (an FP8 release: the same names and shapes, scales beside them) were read as plain values
    fp8 = tmp_path / "fp8"
    shutil.copytree(tiny_model, fp8)
    cfg = json.loads((fp8 / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "fp8"}}))
    _fails(capsys, ["--model", str(fp8), *data], str(fp8), "quantization_config (quant_method 'fp8')",
           "give the model in bf16 or fp32")
    # a shard named in the index that is missing
    sharded = tmp_path / "sharded"
    tok = AutoTokenizer.from_pretrained(tiny_model)
    _save_tiny(sharded, tok)
    AutoModelForCausalLM.from_pretrained(tiny_model).save_pretrained(sharded, max_shard_size="100KB")
    (sharded / "model.safetensors").unlink(missing_ok=True)
    victim = sorted(sharded.glob("model-*.safetensors"))[1]
    victim.unlink()
    _fails(capsys, ["--model", str(sharded), *data], victim.name, "not in the directory")
    # a sequence length above the model's maximum (128)
    _fails(capsys, ["--model", str(tiny_model), *data, "--seq-len", "256"], "--seq-len 256", "128",
           "max_position_embeddings")
    # LoRA targets the model does not have: the flag, PEFT's words and the names it does have
    _fails(capsys, ["--model", str(tiny_model), *data, "--lora-r", "4", "--lora-targets", "query,value"],
           "--lora-targets query,value", "not found", "q_proj (Linear)", "down_proj (Linear)")
    assert not (tmp_path / "out").exists()


def test_data_file_errors(tmp_path, capsys, tiny_model):
    model = ["--model", str(tiny_model), "--output", str(tmp_path / "out")]
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    _fails(capsys, [*model, "--data", str(empty)], str(empty), "empty")
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\u00e9 ol\u00e9".encode("latin-1"))
    _fails(capsys, [*model, "--data", str(latin)], str(latin), "not UTF-8", "byte 3", "iconv")
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text('{"text": "a"}\n{"body": "b"}\n')
    _fails(capsys, [*model, "--data", str(jsonl)], f"{jsonl}, line 2", '"text"', "body")
    _fails(capsys, [*model, "--data", str(tmp_path / "nope.txt")], "nope.txt", "no such file")
    assert not (tmp_path / "out").exists()


def test_nvme_path_without_space(tmp_path, capsys, tiny_model, text_file, monkeypatch):
    from offload.zero import state_store

    real = shutil.disk_usage
    monkeypatch.setattr(state_store.shutil, "disk_usage",  # the drive reports 1 MiB free
                        lambda p: real(p)._replace(free=1 << 20))
    swap = tmp_path / "swap"
    swap.mkdir()
    _fails(capsys, ["--model", str(tiny_model), "--data", str(text_file), "--seq-len", "64", "--nvme-path", str(swap),
                    "--output", str(tmp_path / "out")], "--nvme-path", str(swap), "1.00 MiB", "free space")
    assert list(swap.iterdir()) == []
    _fails(capsys, ["--model", str(tiny_model), "--data", str(text_file), "--seq-len", "64", "--nvme-path", str(tmp_path / "missing"),
                    "--output", str(tmp_path / "out")], str(tmp_path / "missing"), "mkdir -p")


# ---- checkpoints -------------------------------------------------------------------------------
def test_resume_goes_on_exactly_and_exports(tmp_path, tiny_model, text_file):
    common = dict(model=str(tiny_model), data=str(text_file), steps=4, seq_len=64, compute_dtype="fp32",
                  cpu_budget="8MiB", eval_blocks=4)
    a = finetune(FinetuneConfig(**common, output=str(tmp_path / "a"), checkpoint_every=2, keep_checkpoints=2))
    ckpts = tmp_path / "a" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-2", "step-4"]
    b = finetune(FinetuneConfig(**common, output=str(tmp_path / "b"), resume=str(ckpts / "step-2")))
    assert b.first_step == 2 and b.losses == a.losses[2:]  # bit for bit
    # the newest checkpoint, exported, is the saved model
    assert main(["export", str(ckpts), str(tmp_path / "exported")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    for (n, p), (m, q) in zip(exported.named_parameters(), final.named_parameters()):
        assert n == m and torch.equal(p, q), n
    with pytest.raises(ValueError, match=r"--resume .*seq_len 64 -> 32"):
        finetune(FinetuneConfig(**{**common, "seq_len": 32}, output=str(tmp_path / "c"), resume=str(ckpts)))
    # the optimization settings too: the checkpoint's optimizer and schedule carry the old ones (a new --lr was
    # ignored while a new --warmup-steps took effect)
    for change, says in (({"lr": 2e-3}, "lr 0.001 -> 0.002"), ({"warmup_steps": 3}, "warmup_steps 1 -> 3")):
        with pytest.raises(ValueError, match=rf"--resume .*{re.escape(says)}"):
            finetune(FinetuneConfig(**{**common, **change}, output=str(tmp_path / "c"), resume=str(ckpts)))


def test_the_models_generation_config_is_kept(tmp_path, tiny_model, text_file):
    """The input's generation_config.json (a chat model's sampling defaults and extra end-of-sequence ids) was
    replaced in the output by defaults derived from config.json: the model was built from its config alone."""
    source = tmp_path / "chat-model"
    shutil.copytree(tiny_model, source)
    (source / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "eos_token_id": [2, 7], "bos_token_id": 1}))
    finetune(FinetuneConfig(model=str(source), data=str(text_file), steps=1, seq_len=64, cpu_budget="8MiB",
                            eval_blocks=4, output=str(tmp_path / "out")))
    written = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert (written["temperature"], written["top_p"], written["eos_token_id"]) == (0.6, 0.9, [2, 7]), written


def test_an_fp32_export_of_a_bf16_model_loads_as_fp32(tmp_path, tiny_model, text_file):
    """A model whose config.json says bfloat16, fine-tuned and exported in fp32: the export kept the source's
    "dtype", so transformers (dtype="auto") loaded the fp32 weights as bf16, rounding them."""
    source = tmp_path / "bf16-model"
    shutil.copytree(tiny_model, source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    finetune(FinetuneConfig(model=str(source), data=str(text_file), steps=1, seq_len=64, compute_dtype="fp32",
                            cpu_budget="8MiB", eval_blocks=4, output=str(tmp_path / "out"), checkpoint_every=1))
    assert main(["export", str(tmp_path / "out" / "checkpoints"), str(tmp_path / "exported")]) == 0
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["dtype"] == "float32"
    assert {p.dtype for p in AutoModelForCausalLM.from_pretrained(tmp_path / "exported").parameters()} == {torch.float32}


def test_a_lora_run_resumes_exactly(tmp_path, tiny_model, text_file):
    """The adapters' states checkpoint and resume bit for bit (the frozen base has none); other LoRA settings are
    another run."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    common = dict(model=str(tiny_model), data=str(text_file), steps=4, seq_len=64, compute_dtype="fp32",
                  cpu_budget="8MiB", eval_blocks=4, lora_r=4, lr=1e-2)
    a = finetune(FinetuneConfig(**common, output=str(tmp_path / "a"), checkpoint_every=2))
    ckpts = tmp_path / "a" / "checkpoints"
    b = finetune(FinetuneConfig(**common, output=str(tmp_path / "b"), resume=str(ckpts / "step-2")))
    assert b.first_step == 2 and b.losses == a.losses[2:]  # bit for bit
    trained_a, trained_b = (load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in "ab")
    assert trained_a.keys() == trained_b.keys() and all(torch.equal(trained_a[k], trained_b[k]) for k in trained_a)
    with pytest.raises(ValueError, match=r"--resume .*lora \[4, 8.0, 'q_proj,v_proj', 0.0\] -> \[4, 16.0"):
        finetune(FinetuneConfig(**common, lora_alpha=16, output=str(tmp_path / "c"), resume=str(ckpts)))
    with pytest.raises(ValueError, match=r"--resume .*does not fit this model"):  # other shapes: the manifest says
        finetune(FinetuneConfig(**{**common, "lora_r": 8}, output=str(tmp_path / "d"), resume=str(ckpts)))
    # export of a LoRA checkpoint wrote PEFT's wrapped names beside the base's config: neither transformers nor PEFT
    # loads that directory (and a longer run was told to do exactly that)
    with pytest.raises(ValueError, match=r"--resume .*To train on: resume it to its end and start a new run"):
        finetune(FinetuneConfig(**{**common, "steps": 6}, output=str(tmp_path / "e"), resume=str(ckpts)))
    from offload.checkpoint import CheckpointError
    from offload.checkpoint.export import export_checkpoint

    with pytest.raises(CheckpointError, match=r"a LoRA run's checkpoint \(PEFT's wrapped names, such as .*base_layer"):
        export_checkpoint(ckpts, tmp_path / "exported")
    assert not (tmp_path / "exported").exists()


def test_a_stop_signal_swallowed_by_a_finalizer_is_kept_for_the_next_step():
    """A signal that lands while a __del__ runs raises there, where Python swallows it and goes on: the run must
    still stop (the step callback raises it again from `pending`), not train to its end; and Python's "Exception
    ignored ... Traceback" report of it is not printed (a clean stop showed a traceback: seen in CI, with a
    regex object's __del__)."""
    import gc
    import signal

    from offload.finetune.cli import _restore_signals, _stop_on_signals

    class RaisesInDel:
        def __del__(self):
            signal.raise_signal(signal.SIGINT)  # the handler raises Terminated here, and Python swallows it

    before = signal.getsignal(signal.SIGINT)  # (a background shell's jobs start with SIGINT ignored)
    hook_before, reported = sys.unraisablehook, []
    sys.unraisablehook = reported.append  # what Python would print as "Exception ignored ... Traceback"
    pending = [0]
    previous = _stop_on_signals(pending)
    try:
        obj = RaisesInDel()
        del obj
        gc.collect()
        assert pending[0] == signal.SIGINT
    finally:
        _restore_signals(previous)
        restored, sys.unraisablehook = sys.unraisablehook, hook_before
    assert reported == []  # nothing reported: the stop is raised again at the next step
    assert signal.getsignal(signal.SIGINT) is before  # the handlers go back after the run
    assert restored == reported.append  # and the unraisable hook


def test_fp16_trains_through_the_loss_scaler_and_resumes_exactly(tmp_path, tiny_model, text_file):
    """--compute-dtype fp16: offload.GradScaler in the loop, its state in the checkpoint (a resumed run goes on with
    the same scale, bit for bit); --update-in-backward is refused with it, naming both flags."""
    common = dict(model=str(tiny_model), data=str(text_file), steps=4, seq_len=64, compute_dtype="fp16",
                  cpu_budget="8MiB", eval_blocks=4)
    a = finetune(FinetuneConfig(**common, output=str(tmp_path / "a"), checkpoint_every=2))
    assert all(math.isfinite(x) for x in a.losses) and a.eval_loss_after < a.eval_loss_before
    assert a.skipped_steps == 0
    ckpt = tmp_path / "a" / "checkpoints" / "step-2"
    scaler = json.loads((ckpt / "manifest.json").read_text())["extra"]["scaler"]
    assert scaler == {"scale": 2.0 ** 16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
                      "_growth_tracker": 2}  # two clean steps
    b = finetune(FinetuneConfig(**common, output=str(tmp_path / "b"), resume=str(ckpt)))
    assert b.first_step == 2 and b.losses == a.losses[2:]  # bit for bit
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "a")  # (the fp32 master, as after a bf16 run)
    assert all(torch.isfinite(p).all() for p in saved.parameters())
    with pytest.raises(ValueError, match=r"--update-in-backward with --compute-dtype fp16"):
        finetune(FinetuneConfig(**common, update_in_backward=True, output=str(tmp_path / "c")))


@pytest.mark.parametrize("built_in", [True, False], ids=["built-in", "model-dir"])
def test_every_phase_before_the_first_step_says_what_it_does(tmp_path, capsys, text_file, tiny_model, built_in):
    """Minutes of silence before the progress bar (the tokenizer's training, the weights' loading): each phase of
    the set-up now says what it does, one line each on rank 0, in order, before the first step's bar."""
    args = ["finetune", "--steps", "1", "--eval-blocks", "1", "--data", str(text_file), "--output",
            str(tmp_path / "out")]
    if not built_in:
        args += ["--model", str(tiny_model), "--seq-len", "64"]
    assert main(args) == 0
    said = capsys.readouterr()
    lines = [x[len("offload finetune: "):] for x in said.out.splitlines() if x.startswith("offload finetune: ")]
    size = text_file.stat().st_size
    expected = [f"reading {text_file} ("]
    if built_in:
        expected += [f"training a byte-level BPE tokenizer (vocabulary 8192) on 1 document, {size / 1e6:.1f}M "
                     "characters", "tokenizing 1 document", "initializing the built-in Llama's "]
    else:
        expected += ["tokenizing 1 document", f"loading the weights from {tiny_model} ("]
    expected += ["the held-out loss before training (1 block)",
                 "step 1 traces the order the units are used in (the plan the prefetch follows)"]
    at = 0  # (the first line names the model, the data and the output)
    for needle in expected:
        at = next((i for i in range(at + 1, len(lines)) if needle in lines[i]), None)
        assert at is not None, (needle, lines)
    assert len(lines) == len(expected) + 1, lines
    if not built_in:
        assert re.search(r"\(.* in 1 safetensors file\) and sharding them over 1 rank \(params \w+, optimizer \w+\)$",
                         lines[-3]), lines
    assert said.err.index("finetune:") >= 0 and "step/s" in said.err  # the step bar follows
