"""Mixture-of-experts models end to end (issue 45): per-expert checkpoints, as transformers' own save_pretrained and
the Hub write them, stream into the installed transformers' fused-experts layout (offload/integrations/
checkpoint_layout.py, through transformers' conversion mapping), train as plain PyTorch does on 1 and 2 ranks with
routers that choose differently on each rank, load-balancing loss included, under LoRA too, and the fine-tune's
output loads back in transformers."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

import transformers  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

import offload  # noqa: E402

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
import moe_worker  # noqa: E402
import rank_launch  # noqa: E402

# tiny configs of every MoE family of the installed transformers tested here; keys a family does not know are
# ignored by its config
_TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
             shared_expert_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
             n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4,
             qk_nope_head_dim=4, v_head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
             output_router_logits=True, router_aux_loss_coef=0.1)
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss", "phimoe", "granitemoe"]


def save_moe(path: Path, family: str, **overrides) -> Path:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **{**_TINY, **overrides})).save_pretrained(path)
    return path


@pytest.mark.parametrize("family", FAMILIES)
def test_a_per_expert_checkpoint_streams_into_the_models_layout(tmp_path, family):
    """transformers 5 fuses a layer's experts into one parameter and saves them one tensor per expert: the files
    were refused ("the files hold one tensor per expert"); now from_pretrained inside offload.init holds exactly what
    transformers' own from_pretrained builds."""
    save_moe(tmp_path / "m", family)
    expected = AutoModelForCausalLM.from_pretrained(tmp_path / "m").state_dict()
    with offload.init(offload.Config(params="cpu", optimizer="cpu", cpu_budget="64MiB")) as rt:
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
        held = rt.full_state_dict(model)
    assert set(held) == set(expected)
    assert all(torch.equal(held[k], v) for k, v in expected.items())


def test_mixtral_files_are_per_expert_and_the_model_fused(tmp_path):
    """What the test above covers: the files' names are not the model's (else it proves nothing)."""
    from offload.integrations.hf_model_dir import HFModelDir

    save_moe(tmp_path / "m", "mixtral")
    files = HFModelDir(tmp_path / "m").entries
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in files
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "m"))
    assert tuple(model.model.layers[0].mlp.experts.gate_up_proj.shape) == (4, 96, 32)
    assert HFModelDir(tmp_path / "m").check(model) == []  # every file tensor is used


def test_a_checkpoint_whose_experts_do_not_fit_the_config_names_them(tmp_path):
    from offload.integrations.hf_model_dir import HFModelDir, ModelDirError

    save_moe(tmp_path / "m", "qwen2_moe")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2_moe", **{**_TINY,
                                                                                 "moe_intermediate_size": 8}))
    with pytest.raises(ModelDirError, match=r"model.layers.0.mlp.experts.down_proj \(built from "
                                            r"model.layers.0.mlp.experts.0.down_proj.weight and 3 more\) has shape "
                                            r"\[4, 32, 16\] but the config gives \[4, 32, 8\]"):
        HFModelDir(tmp_path / "m").check(model)


def _assert_trains_as_reference(run, ref, rtol):
    assert run["losses"] == pytest.approx(ref["losses"], rel=rtol)
    assert set(run["trained"]) == set(ref["trained"])
    for name, value in ref["trained"].items():
        torch.testing.assert_close(run["trained"][name], value, rtol=rtol, atol=rtol, msg=name)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_one_rank_trains_as_plain_pytorch_with_the_load_balancing_loss(tmp_path, family):
    save_moe(tmp_path / "m", family)
    run = moe_worker.offload_train(str(tmp_path / "m"))
    ref = moe_worker.reference_train(str(tmp_path / "m"))
    out = ref["last_outputs"][0]
    assert out.aux_loss is not None and 0.1 * out.aux_loss > 1e-3  # the loss trained on holds the router's term
    _assert_trains_as_reference(run, ref, 1e-5)


def test_lora_over_an_moe_base_trains_as_peft(tmp_path):
    save_moe(tmp_path / "m", "qwen2_moe")
    run = moe_worker.offload_train(str(tmp_path / "m"), lora=True)
    assert any(".shared_expert.gate_proj.lora_A." in n for n in run["trained"])  # inside the MoE block too
    ref = moe_worker.reference_train(str(tmp_path / "m"), lora=True, start=run["start"])
    _assert_trains_as_reference(run, ref, 1e-5)


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """A Mixtral trained on 2 ranks (gloo), in full and under LoRA, in one launch (tests/moe_worker.py)."""
    tmp = tmp_path_factory.mktemp("moe2")
    model_dir = save_moe(tmp / "m", "mixtral")
    proc = rank_launch.launch([str(TESTS / "moe_worker.py"), str(model_dir), str(tmp / "run")], 2, timeout=600,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return model_dir, {kind: torch.load(tmp / f"run.{kind}.pt") for kind in ("full", "lora")}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_two_ranks_whose_routers_choose_differently_train_as_plain_pytorch(two_rank_runs, lora):
    """Each rank's tokens go to other experts: the runtime gathers whole decoder layers (the fused experts inside),
    so both ranks run the same gathers and reduces (else it refuses the step); the result is plain PyTorch's on the
    mean of the two ranks' losses. With LoRA the adapters are kept-gathered units whose elements all lie in rank 0's
    shard: rank 1 did not re-gather them after a step and rank 0 did (gloo aborted: a collective of 22016 bytes met
    one of 512; update/optimizer.py, _outdate_kept_units_stepped_elsewhere)."""
    model_dir, runs = two_rank_runs
    ids = moe_worker.data(96, 2)[0]
    with torch.no_grad():  # the routers' choices differ between the ranks' batches
        plain = AutoModelForCausalLM.from_pretrained(model_dir)
        chosen = [plain(input_ids=ids[r]).router_logits[0].topk(2, dim=-1).indices for r in range(2)]
    load = [torch.bincount(c.flatten(), minlength=4) for c in chosen]  # tokens per expert, layer 0
    assert not torch.equal(load[0], load[1])
    run = runs["lora" if lora else "full"]
    ref = moe_worker.reference_train(str(model_dir), world=2, lora=lora, start=run["start"])
    _assert_trains_as_reference(run, ref, 1e-4)  # (the reduce over ranks sums in another order)


def test_offload_finetune_on_1_and_2_ranks_and_its_output_loads_in_transformers(tmp_path):
    """`offload finetune --model DIR` refused a Mixtral saved by transformers; now it trains it on 1 and 2 ranks alike
    (the load-balancing loss in the gradient, as the config asks) and writes a directory transformers loads with
    every tensor used."""
    from offload.cli import main
    from offload.finetune.corpus import Example, stdlib_corpus
    from offload.finetune.tokenizer import train_bpe

    text = "\n\n".join(e.text for e in stdlib_corpus(max_chars=60_000))
    (tmp_path / "train.txt").write_text(text)
    tok = train_bpe([Example(text)], 300)
    model_dir = save_moe(tmp_path / "m", "mixtral", vocab_size=len(tok))
    tok.save_pretrained(model_dir)
    common = ["finetune", "--model", str(model_dir), "--data", str(tmp_path / "train.txt"), "--steps", "2",
              "--seq-len", "32", "--compute-dtype", "fp32", "--cpu-budget", "8MiB", "--eval-blocks", "2"]
    assert main([*common, "--micro-batch", "4", "--output", str(tmp_path / "out"),
                 "--json", str(tmp_path / "run.json")]) == 0
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "offload.cli", *common, "--micro-batch", "2", "--output", str(tmp_path / "two"),
                           "--json", str(tmp_path / "two.json")], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("run", "two"))
    assert len(one["losses"]) == 2 and two["losses"] == pytest.approx(one["losses"], rel=1e-5)  # the same samples
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    base = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    trained = loaded.state_dict()
    assert not torch.equal(trained["model.layers.0.mlp.experts.gate_up_proj"],
                           base["model.layers.0.mlp.experts.gate_up_proj"])  # the experts trained


def test_a_per_expert_checkpoint_streams_in_within_the_budget_plus_a_few_units(tmp_path):
    """Building a layer's fused experts reads that layer's per-expert tensors only: RSS grows by at most the cpu
    budget + 3 units (fp32) + 32 MiB while a 24-layer Qwen2-MoE of ~330 MB fp32 loads (the probe and the bound of
    test_finetune.py's dense test_streaming_load_peak_rss)."""
    save_moe(tmp_path / "big", "qwen2_moe", vocab_size=1024, hidden_size=256, moe_intermediate_size=512,
             shared_expert_intermediate_size=256, num_hidden_layers=24, num_experts=8, head_dim=64,
             num_attention_heads=4, num_key_value_heads=2)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "big" / "model.safetensors"), framework="pt") as f:  # expert 0's gate comes first
        expected = f.get_tensor("model.layers.0.mlp.experts.0.gate_proj.weight")[0, :4].tolist()
    (tmp_path / "swap").mkdir()
    budget = 32 << 20
    proc = subprocess.run([sys.executable, str(TESTS / "finetune_rss_probe.py"), str(tmp_path / "big"),
                           str(tmp_path / "swap"), f"{budget}B", "model.layers.0.mlp.experts.gate_up_proj"],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OFFLOAD_MALLOC_TUNE="frugal"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["first"] == expected  # the values are the files', fused
    model_bytes = r["params"] * 4
    bound = budget + 3 * r["largest_unit_fp32"] + (32 << 20)
    assert bound < model_bytes / 1.8  # the bound is meaningful: holding the model whole would break it
    assert r["peak"] - r["rss0"] <= bound, r


def test_offload_finetune_trains_on_the_load_balancing_loss_the_config_asks_for(tmp_path):
    """The job computes its loss from the logits: the router's load-balancing term, which the model adds to its own
    loss when its config sets output_router_logits, was dropped from the gradient (router_aux_loss_coef changed
    nothing). The second step's loss now depends on it."""
    from offload.finetune import FinetuneConfig, finetune
    from offload.finetune.corpus import Example, stdlib_corpus
    from offload.finetune.tokenizer import train_bpe

    text = "\n\n".join(e.text for e in stdlib_corpus(max_chars=30_000))
    (tmp_path / "train.txt").write_text(text)
    tok = train_bpe([Example(text)], 300)
    losses = {}
    for coef in (0.0, 0.5):
        model_dir = save_moe(tmp_path / f"m{coef}", "mixtral", vocab_size=len(tok), router_aux_loss_coef=coef)
        tok.save_pretrained(model_dir)
        losses[coef] = finetune(FinetuneConfig(model=str(model_dir), data=str(tmp_path / "train.txt"), steps=2,
                                               seq_len=32, compute_dtype="fp32", cpu_budget="8MiB", eval_blocks=2,
                                               warmup_steps=0,
                                               output=str(tmp_path / f"out{coef}"))).losses
    assert losses[0.0][0] == losses[0.5][0]  # the reported loss is the language-model loss
    assert losses[0.0][1] != losses[0.5][1]  # the first step's update followed the router's term
