"""Issue 41 item 9: offload.AdamW's errors for bad hyperparameters are torch.optim.AdamW's ValueErrors, in its
words, followed by the argument (they were offload's own wording, and a 2-element tensor lr gave "only one element
tensors can be converted"); `offload.integrations.lora.load_peft_model(...)`, as the README writes it, works after
`import offload` alone, which still loads neither transformers nor peft; the drop-in's defaults are torch's
(weight_decay 0.01, not DeepSpeedCPUAdam's 0)."""
import inspect
import re
import subprocess
import sys

import pytest
import torch

import offload


@pytest.mark.parametrize("kwargs, argument", [
    (dict(lr=torch.tensor([1e-3, 2e-3])), "lr"), (dict(lr=-1.0), "lr"), (dict(eps=-1e-8), "eps"),
    (dict(betas=(0.9, 1.5)), "betas"), (dict(betas=(-0.1, 0.999)), "betas"), (dict(weight_decay=-0.1), "weight_decay"),
])
def test_bad_hyperparameters_raise_torchs_valueerror_naming_the_argument(kwargs, argument):
    with pytest.raises(ValueError) as theirs:
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], **kwargs)
    with pytest.raises(ValueError) as ours:
        offload.AdamW([torch.nn.Parameter(torch.zeros(2))], **kwargs)
    assert str(ours.value).startswith(str(theirs.value))
    assert re.search(rf"offload.AdamW {argument}\b", str(ours.value))
    with pytest.raises(ValueError, match=r"offload.AdamW betas=\(0.9,\): expected two values"):
        offload.AdamW([torch.nn.Parameter(torch.zeros(2))], betas=(0.9,))  # (torch: an IndexError)


def test_the_defaults_are_torchs_adamws():
    ours = inspect.signature(offload.AdamW).parameters
    theirs = inspect.signature(torch.optim.AdamW).parameters
    for name in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"):
        assert ours[name].default == theirs[name].default, name
    assert ours["weight_decay"].default == 0.01  # (DeepSpeedCPUAdam's is 0: docs/guide/optimizers.md)


def test_the_readme_lora_call_works_after_import_offload_alone():
    code = ("import sys, offload\n"
            "assert 'transformers' not in sys.modules and 'peft' not in sys.modules\n"
            "print(offload.integrations.lora.load_peft_model.__name__, "
            "offload.integrations.transformers.OffloadTrainer.__name__)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.split() == ["load_peft_model", "OffloadTrainer"], proc.stderr[-2000:]
