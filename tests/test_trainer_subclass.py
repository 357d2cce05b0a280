"""offload_trainer(cls): OffloadTrainer's machinery over any Trainer subclass (issue 41 item 7). A local subclass
that changes __init__'s signature and compute_loss, as TRL's SFTTrainer does, trains as the plain subclass does
(losses within 1e-5), from a model object or a model directory; the subclass's own model-building arguments that
would act on a sharded model (peft_config, quantization_config) are refused naming the fix. With TRL installed,
its real SFTTrainer is run the same way (skipped otherwise)."""
import inspect
import os
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import Trainer  # noqa: E402

import offload  # noqa: E402
from offload.integrations.transformers import OffloadTrainer, offload_trainer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_trainer import Blocks, logged, tiny_llama, training_args  # noqa: E402


class WeightedTrainer(Trainer):
    """Shaped as SFTTrainer: its own arguments before Trainer's, its own model-building ones, its own loss."""

    def __init__(self, model, loss_weight=1.0, args=None, train_dataset=None, peft_config=None,
                 quantization_config=None, **kwargs):
        self.loss_weight = loss_weight
        self.seen_model_params = sum(1 for _ in model.parameters())  # runs on the sharded model
        super().__init__(model=model, args=args, train_dataset=train_dataset, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        logits = model(**inputs).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                                                 reduction="sum") / num_items_in_batch
        return self.loss_weight * loss


def cpu_config():
    return offload.Config(params="cpu", optimizer="cpu", cpu_budget="64MiB", device_budget="64MiB")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ref = WeightedTrainer(tiny_llama(), 0.5, training_args(tmp_path_factory.mktemp("ref")), Blocks())
    ref.train()
    return logged(ref), logged(ref, "grad_norm")


def test_the_made_class_takes_the_subclass_signature_plus_offload_config():
    cls = offload_trainer(WeightedTrainer)
    assert cls is offload_trainer(WeightedTrainer) and issubclass(cls, WeightedTrainer)
    assert cls.__name__ == "OffloadWeightedTrainer"
    assert list(inspect.signature(cls).parameters)[:3] == ["model", "loss_weight", "args"]
    assert "offload_config" in inspect.signature(cls).parameters
    assert offload_trainer(Trainer) is OffloadTrainer
    with pytest.raises(TypeError, match="not a transformers.Trainer subclass"):
        offload_trainer(torch.nn.Module)
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such'"):
        cls(tiny_llama(), no_such=1)


@pytest.mark.parametrize("given", ["model", "directory"])
def test_a_trainer_subclass_trains_as_the_plain_subclass(tmp_path, reference, given):
    losses, norms = reference
    model = tiny_llama()
    if given == "directory":  # a model name where the subclass takes one: loaded inside the runtime
        model.save_pretrained(tmp_path / "model")
        model = str(tmp_path / "model")
    cls = offload_trainer(WeightedTrainer)
    with cls(model, 0.5, training_args(tmp_path / "run"), Blocks(), offload_config=cpu_config()) as trainer:
        assert trainer.seen_model_params == 21 and trainer.loss_weight == 0.5
        assert isinstance(trainer.optimizer or trainer.create_optimizer(), offload.AdamW)
        trainer.train()
        assert logged(trainer) == pytest.approx(losses, rel=1e-5)
        assert logged(trainer, "grad_norm") == pytest.approx(norms, rel=1e-5)
    assert list(tmp_path.glob("offload-*")) == []


@pytest.mark.parametrize("kw, match", [
    (dict(peft_config=object()), r"peft_config is not supported.*load_peft_model.*get_peft_model"),
    (dict(quantization_config=object()), r"quantization_config is not supported"),
])
def test_the_subclass_model_building_arguments_are_refused_naming_the_fix(tmp_path, kw, match):
    model = tiny_llama()
    with pytest.raises(ValueError, match=match):
        offload_trainer(WeightedTrainer)(model, args=training_args(tmp_path), train_dataset=Blocks(),
                                         offload_config=cpu_config(), **kw)
    assert not any(hasattr(p, "_offload_unit") for p in model.parameters())  # refused before sharding


def _tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "the a cat dog sat ran on mat log and".split()
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def test_trls_sft_trainer_trains_as_itself(tmp_path):
    trl = pytest.importorskip("trl", reason="TRL is not installed (pip install trl runs this test)")
    datasets = pytest.importorskip("datasets", reason="TRL's SFTTrainer needs datasets")
    from trl import SFTConfig, SFTTrainer

    tok = _tokenizer(tmp_path)
    text = ["the cat sat on the mat", "a dog ran on a log", "the dog and the cat sat", "a cat ran and sat"] * 4
    pyarrow = pytest.importorskip("pyarrow", reason="datasets' tables need pyarrow")
    ds = datasets.Dataset(pyarrow.table({"text": text}), fingerprint="offload-sft-test")

    def args(out):
        return SFTConfig(output_dir=str(out), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-3,
                         logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                         dataloader_num_workers=0, max_length=16, optim="adamw_torch",
                         bf16=False)  # (SFTConfig defaults to bf16: fp32 compares within 1e-5)

    def model():
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            pad_token_id=0, eos_token_id=1, bos_token_id=1))

    ref = SFTTrainer(model=model(), args=args(tmp_path / "ref"), train_dataset=ds, processing_class=tok)
    ref.train()
    model().save_pretrained(tmp_path / "model")  # TRL takes a model name too: loaded inside the runtime
    for given in (model(), str(tmp_path / "model")):
        with offload_trainer(SFTTrainer)(model=given, args=args(tmp_path / "run"), train_dataset=ds,
                                         processing_class=tok, offload_config=cpu_config()) as trainer:
            trainer.train()
            assert logged(trainer) == pytest.approx(logged(ref), rel=1e-5)
            assert logged(trainer, "grad_norm") == pytest.approx(logged(ref, "grad_norm"), rel=1e-5)
    print("trl", trl.__version__, "losses", logged(ref))
