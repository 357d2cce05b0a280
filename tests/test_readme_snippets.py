"""The README's Python examples run as written (issue 41): every ```python block, and the "+" side of each
```diff block, is executed here at a tiny CPU scale. What a snippet leaves to the reader (a model directory, a
data file, build_model(), a loader, sizes for a real run) is substituted from the table below, each entry an exact
text of the snippet, so a snippet that changes fails here until the table follows it; a new block fails until it
is listed. Nothing else of a snippet is changed."""
import json
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _blocks(kind):
    return [m.group(1) for m in re.finditer(rf"```{kind}\n(.*?)```", README, re.S)]


def _added(diff):
    """The "+" side of a diff block, as code."""
    return "\n".join(line[1:] for line in diff.splitlines() if line.startswith("+"))


def _snippet(text, substitutions):
    for old, new in substitutions:
        assert old in text, f"the README snippet no longer has {old!r}: update tests/test_readme_snippets.py"
        text = text.replace(old, new)
    return text


# The table. Per snippet (found by a text only it has): (what the README says, what runs here).
def _table(tmp_path):
    model_dir, data = str(tmp_path / "model"), str(tmp_path / "train.jsonl")
    return {
        "finetune(FinetuneConfig(": [
            ('"./Llama-3.2-1B"', repr(model_dir)),                           # a 2-layer Llama saved here
            ('"train.jsonl"', repr(data)),                                    # 40 short JSONL records
            ("steps=500", "steps=2, seq_len=32, eval_blocks=2, micro_batch=2"),  # sizes for a CPU test
            ('"./ft"', repr(str(tmp_path / "ft")))],
        "with offload.init(cfg) as rt:": [
            ('"/mnt/nvme/run1"', repr(str(tmp_path / "run1"))),
            ('"60GiB"', '"64MiB"'), ('"200GiB"', '"64MiB"'),
            # build_model() and loader come from the namespace: a tiny causal LM whose model(batch) has .loss,
            # and two batches of token ids
        ],
        "OffloadTrainer as Trainer": [
            ("TrainingArguments(...)", "TrainingArguments(output_dir=OUT, max_steps=2, per_device_train_batch_size=2, "
                                       "report_to=[], use_cpu=True, save_strategy='no')"),
            ('"ds_config.json"', repr(str(tmp_path / "ds_config.json"))),   # Hugging Face's ZeRO-3 "auto" JSON
            ('"64GiB"', '"64MiB"')],
        "offload_trainer(SFTTrainer)": [
            ('"Qwen/Qwen2.5-0.5B"', repr(model_dir)),
            ("SFTConfig(...)", "SFTConfig(output_dir=OUT, max_steps=2, per_device_train_batch_size=2, report_to=[], "
                               "use_cpu=True, save_strategy='no', bf16=False, max_length=32)")],
    }


NOT_RUN = {}  # a block's identifying text -> why it cannot run here (none so far)


def _tiny_model_dir(path: Path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from offload.finetune.corpus import Example
    from offload.finetune.tokenizer import train_bpe

    tok = train_bpe([Example(" ".join(["the cat sat on the mat and the dog ran on the log"] * 50))], 300)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 pad_token_id=tok.pad_token_id)).save_pretrained(path)
    tok.save_pretrained(path)
    return tok


class TinyLM(nn.Module):
    """build_model()'s stand-in: `model(batch).loss`, as the README's loop uses it."""

    def __init__(self):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.lm = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))

    def forward(self, batch):
        return self.lm(input_ids=batch, labels=batch)


def _namespace(tmp_path):
    from transformers import TrainingArguments

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_trainer import Blocks, tiny_llama

    return {"build_model": TinyLM, "OUT": str(tmp_path / "out"), "TrainingArguments": TrainingArguments,
            "loader": [torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)],
            "model": tiny_llama(), "ds": Blocks(8)}


def _runnable():
    out = [("python", b) for b in _blocks("python")] + [("diff", _added(b)) for b in _blocks("diff")]
    return [(kind, code) for kind, code in out if code.strip()]


def _key(code, table):
    keys = [k for k in (*table, *NOT_RUN) if k in code]
    assert len(keys) == 1, f"a README block not in tests/test_readme_snippets.py's table:\n{code}"
    return keys[0]


def test_every_readme_block_is_in_the_table(tmp_path):
    table = _table(tmp_path)
    keys = [_key(code, table) for _, code in _runnable()]
    assert sorted(keys) == sorted({*table, *NOT_RUN}), "a table entry whose README block is gone"


@pytest.mark.parametrize("key", ["finetune(FinetuneConfig(", "with offload.init(cfg) as rt:",
                                 "OffloadTrainer as Trainer", "offload_trainer(SFTTrainer)"])
def test_the_readme_snippet_runs(tmp_path, key, capsys):
    table = _table(tmp_path)
    code = next(code for _, code in _runnable() if _key(code, table) == key)
    ns = _namespace(tmp_path)
    if key in ("finetune(FinetuneConfig(", "offload_trainer(SFTTrainer)"):
        _tiny_model_dir(tmp_path / "model")
        lines = ["the cat sat on the mat", "the dog ran on the log", "a cat and a dog sat"] * 14
        (tmp_path / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    if key == "with offload.init(cfg) as rt:":
        (tmp_path / "run1").mkdir()  # the swap directory exists on the drive (Config refuses one that does not)
    if key == "OffloadTrainer as Trainer":
        (tmp_path / "ds_config.json").write_text(json.dumps({
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                  "offload_param": {"device": "cpu"}, "stage3_gather_16bit_weights_on_model_save": True},
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto"}))
    if key == "offload_trainer(SFTTrainer)":
        pytest.importorskip("trl", reason="TRL is not installed (pip install trl runs this snippet)")
        datasets = pytest.importorskip("datasets", reason="TRL's SFTTrainer needs datasets")
        pyarrow = pytest.importorskip("pyarrow", reason="datasets' tables need pyarrow")
        from trl import SFTConfig, SFTTrainer

        ns.update(SFTTrainer=SFTTrainer, SFTConfig=SFTConfig,
                  ds=datasets.Dataset(pyarrow.table({"text": ["the cat sat on the mat"] * 8}), fingerprint="readme"))
    exec(compile(_snippet(code, table[key]), f"README.md ({key})", "exec"), ns)
    if "trainer" in ns:  # the diffs build a trainer: it trains, and closes its runtime
        with ns["trainer"] as trainer:
            trainer.train()
            assert trainer.state.global_step == 2
    if key == "finetune(FinetuneConfig(":
        assert ns["result"].output.is_dir() and ns["result"].eval_loss_after is not None
    if key == "with offload.init(cfg) as rt:":
        assert ns["rt"].closed and not any((tmp_path / "run1").glob("*"))  # the swap files it created are gone
