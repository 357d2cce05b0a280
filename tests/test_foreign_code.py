"""Other people's code under the runtime (issue 41): the plain-loop patterns scripts already have either train as
plain PyTorch or are refused at once, naming the fix. A torch optimizer and torch's clip over a wrapped model, a
nanoGPT-shaped model built inside the block with its own init, `model.to()` right after construction, and the
other calls that touch parameters (hooks, .data, torch.save, deepcopy, EMA copies)."""
import copy
import io
import math
import os
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import clip_grad_norm_ as clip_imported_before_the_block
from torch.nn.utils import parameters_to_vector as to_vector_imported_before_the_block

import offload

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_common import (TinyTransformer, compute_loss, one_torch_thread, small_config as _small,  # noqa: E402
                         token_ids as _ids, transformers_available)


@pytest.fixture(autouse=True)
def _one_thread():
    yield from one_torch_thread()


def small_config(**kw):
    """fp32 unless asked: the parity checks compare with plain fp32 PyTorch."""
    kw.setdefault("compute_dtype", "fp32")
    return _small(**kw)


# ---- a nanoGPT-shaped model (Karpathy's model.py, cut down: same init code, same tie, same custom LayerNorm) ----

@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 96
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    bias: bool = True


class LayerNorm(nn.Module):
    """nanoGPT's: no reset_parameters, its values are the ones registered."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head, self.n_embd = config.n_head, config.n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1, self.attn = LayerNorm(config.n_embd, config.bias), CausalSelfAttention(config)
        self.ln_2, self.mlp = LayerNorm(config.n_embd, config.bias), MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():  # init code in __init__ after the submodules exist
            if pn.endswith('c_proj.weight'):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):  # a method of this name, but not a Hugging Face model
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def _gpt_batch(seed: int, config=GPTConfig()):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, config.vocab_size, (4, config.block_size + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def _expected_std(name: str, config=GPTConfig()) -> float | None:
    """The std nanoGPT's own init gives `name` (None: a constant it keeps, checked apart)."""
    if name.endswith("c_proj.weight"):
        return 0.02 / math.sqrt(2 * config.n_layer)
    if name.endswith(".weight") and ("ln_" not in name):
        return 0.02
    return None


def test_a_nanogpt_model_built_inside_the_block_starts_from_its_own_init():
    """It has a method named _init_weights: it was taken for a Hugging Face model, so its LayerNorms kept torch.empty
    memory and its scaled c_proj init (written in __init__ on placeholders) was lost; every Linear got torch's
    kaiming init and the tied embedding N(0, 1)."""
    torch.manual_seed(0)
    plain = GPT(GPTConfig())
    with offload.init(small_config()) as rt:
        model = GPT(GPTConfig())
        model.to("cpu")  # most scripts have that line right here
        opt = offload.AdamW(model.parameters(), lr=1e-3)
        got = rt.full_state_dict(model)
        first = model(*_gpt_batch(0)).item()
    for name, ref in plain.state_dict().items():
        value = got[name]
        std = _expected_std(name)
        if std is None:  # LayerNorm weights 1, every bias 0: as registered / as _init_weights zeroes them
            assert torch.equal(value, ref), name
        else:
            assert abs(value.std().item() / std - 1) < 0.1, (name, value.std().item(), std)
            assert abs(ref.std().item() / std - 1) < 0.1, name  # (the same check holds for plain PyTorch's)
    reference = plain(*_gpt_batch(0)).item()
    assert math.isfinite(first) and abs(first - reference) < 0.05 * reference, (first, reference)
    assert abs(reference - math.log(GPTConfig().vocab_size)) < 0.1  # (a small init: the uniform guess's loss)
    del opt


def test_a_nanogpt_model_built_inside_the_block_trains_as_plain_pytorch_from_the_same_weights():
    """The same values put through load_state_dict: offload.AdamW with torch's clip over the wrapped model gives plain
    torch's losses, so what differs in the test above is the draw, not the training."""
    torch.manual_seed(0)
    plain = GPT(GPTConfig())
    ref_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    with offload.init(small_config()) as rt:
        model = GPT(GPTConfig())
        model.load_state_dict(plain.state_dict())
        opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        for s in range(4):
            ours, ref = model(*_gpt_batch(s)), plain(*_gpt_batch(s))
            assert abs(ours.item() - ref.item()) <= 1e-5 * ref.item(), (s, ours.item(), ref.item())
            ours.backward()
            ref.backward()
            n_ours = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            n_ref = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
            assert abs(n_ours.item() - n_ref.item()) <= 1e-5 * n_ref.item(), (s, n_ours.item(), n_ref.item())
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
        got = rt.full_state_dict(model)
    for name, ref in plain.state_dict().items():
        assert torch.allclose(got[name], ref, rtol=1e-4, atol=1e-5), name  # (Adam on near-zero gradients)


class _TensorMethodInit(nn.Module):
    """Init code written with tensor methods after the submodules exist (GPT-2-style custom models): on the whole
    parameter through .data, on part of it (a padding row, a view of a view), and by assignment to .data."""

    def __init__(self, pretrained: torch.Tensor):
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 8)
        self.emb.weight.data.normal_(mean=0.0, std=0.02)
        with torch.no_grad():
            self.emb.weight[0].zero_()
            self.proj.weight.data[:, 1:].t()[0].fill_(3.0)  # column 1
            self.proj.bias.copy_(pretrained)
        self.head.weight.data = torch.full((8, 4), 0.25)

    def forward(self, ids):
        return self.head(self.proj(self.emb(ids)))


def test_init_written_with_tensor_methods_in_init_is_replayed():
    """Writes through tensor methods on placeholders were lost in silence: the modules' own init stood instead."""
    pretrained = torch.arange(4.0)
    with offload.init(small_config()) as rt:
        model = _TensorMethodInit(pretrained)
        got = rt.full_state_dict(model)
        model(torch.tensor([[1, 2]])).sum().backward()  # (a plain parameter once sharded: it trains)
    assert torch.equal(got["emb.weight"][0], torch.zeros(4))
    assert abs(got["emb.weight"][1:].std().item() - 0.02) < 0.008  # not nn.Embedding's N(0, 1)
    assert torch.equal(got["proj.weight"][:, 1], torch.full((4,), 3.0))
    assert not torch.equal(got["proj.weight"][:, 0], torch.full((4,), 3.0))
    assert torch.equal(got["proj.bias"], pretrained) and torch.equal(got["head.weight"], torch.full((8, 4), 0.25))


def test_a_write_reading_another_parameter_before_first_use_is_refused_naming_rt_wrap():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            with torch.no_grad():
                self.b.weight.copy_(self.a.weight)  # the values of a placeholder: none yet

        def forward(self, x):
            return self.b(self.a(x))

    with offload.init(small_config()):
        model = Tied()
        with pytest.raises(RuntimeError, match=r"b\.weight.*rt\.wrap\(model\)"):
            model(torch.ones(1, 4))


def test_an_ema_copy_updated_before_the_first_use_is_refused():
    """An EMA buffer updated in place from a placeholder read nothing (torch adds a meta tensor as nothing)."""
    with offload.init(small_config()):
        model = TinyTransformer()
        ema = [torch.zeros(p.shape) for p in model.parameters()]
        with pytest.raises(RuntimeError, match=r"rt\.full_state_dict\(model\)"):
            ema[0].mul_(0.9).add_(next(model.parameters()).detach(), alpha=0.1)


def test_a_parameter_no_initializer_writes_keeps_its_registered_value():
    """A module with a reset_parameters() that leaves one of its parameters alone: that one was not kept (the module
    had an initializer) and came out as torch.empty memory."""
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.gain = nn.Parameter(torch.full((8,), 0.5))
            self.reset_parameters()

        def reset_parameters(self):
            self.lin.reset_parameters()  # (gain keeps its registered value)

        def forward(self, x):
            return self.lin(x) * self.gain

    with offload.init(small_config()) as rt:
        model = Scaled()
        got = rt.full_state_dict(model)
    assert torch.equal(got["gain"], torch.full((8,), 0.5))


@pytest.mark.skipif(not transformers_available(), reason="needs transformers")
def test_a_hugging_face_model_keeps_what_its_init_weights_does_not_write():
    """A PreTrainedModel whose _init_weights handles Linears only: its LayerNorm (which has a reset_parameters, so its
    value was not kept) came out as torch.empty memory on the Hugging Face path."""
    from transformers import PretrainedConfig, PreTrainedModel

    class Cfg(PretrainedConfig):
        model_type = "offload-test-norm"

    class Model(PreTrainedModel):
        config_class = Cfg

        def __init__(self, config):
            super().__init__(config)
            self.lin = nn.Linear(8, 8)
            self.norm = nn.LayerNorm(8)
            self.post_init()

        def _init_weights(self, module):
            if isinstance(module, nn.Linear):
                module.weight.data.normal_(0.0, 0.02)
                module.bias.data.zero_()

        def forward(self, x):
            return self.norm(self.lin(x))

    with offload.init(small_config()) as rt:
        model = Model(Cfg())
        got = rt.full_state_dict(model)
    assert torch.equal(got["norm.weight"], torch.ones(8)) and torch.equal(got["norm.bias"], torch.zeros(8))
    assert torch.equal(got["lin.bias"], torch.zeros(8)) and abs(got["lin.weight"].std().item() - 0.02) < 0.006


# ---- a torch optimizer and torch's clip over a wrapped model ------------------------------------------------------

def _wrapped_pair():
    torch.manual_seed(0)
    base = TinyTransformer()
    return base, copy.deepcopy(base)


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.SGD])
@pytest.mark.parametrize("built", ["wrap", "inside"])
def test_a_torch_optimizer_over_a_wrapped_model_is_refused_at_its_first_step(cls, built):
    """It stepped nothing: the placeholders' .grad stays None (nanoGPT's loss 4.31 after 20 steps against 2.98)."""
    base, _ = _wrapped_pair()
    plain = nn.Linear(4, 4)  # built outside: a module built in the block is sharded at its first use
    with offload.init(small_config()) as rt:
        model = rt.wrap(base) if built == "wrap" else TinyTransformer()
        opt = cls(model.parameters(), lr=1e-2)
        compute_loss(model, _ids(0), "tiny").backward()
        before = rt.full_state_dict(model)
        with pytest.raises(RuntimeError, match=r"offload\.AdamW\(model\.parameters\(\)"):
            opt.step()
        after = rt.full_state_dict(model)
        assert all(torch.equal(before[k], after[k]) for k in before)
        w = plain.weight.detach().clone()
        popt = cls(plain.parameters(), lr=0.1)
        plain(torch.ones(2, 4)).sum().backward()
        popt.step()  # a torch optimizer over plain parameters in the block is torch's
        assert not torch.equal(plain.weight.detach(), w)


def test_torch_and_accelerates_clip_grad_norm_over_a_wrapped_model_is_the_runtimes_global_norm():
    """torch.nn.utils.clip_grad_norm_(model.parameters(), ...) returned 0 and clipped nothing. Now: plain torch's
    norms and weights, step for step, with torch's clip called the same way on both sides."""
    base, ref = _wrapped_pair()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with offload.init(small_config()) as rt:
        model = rt.wrap(base)
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        for s in range(3):
            for m in (model, ref):
                compute_loss(m, _ids(s), "tiny").backward()
            clip = torch.nn.utils.clip_grad_norm_ if s != 2 else torch.nn.utils.clip_grad.clip_grad_norm_
            ours, theirs = clip(model.parameters(), 0.1), clip(ref.parameters(), 0.1)
            assert ours.item() > 0.1 and abs(ours.item() - theirs.item()) <= 1e-5 * theirs.item()
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
        compute_loss(model, _ids(5), "tiny").backward()
        compute_loss(ref, _ids(5), "tiny").backward()
        accelerate = pytest.importorskip("accelerate")
        acc = accelerate.Accelerator(cpu=True)
        try:
            ours = acc.clip_grad_norm_(model.parameters(), 0.1)
        finally:
            accelerate.state.AcceleratorState._reset_state(True)
        theirs = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        assert abs(ours.item() - theirs.item()) <= 1e-5 * theirs.item()
        opt.step(), ref_opt.step()
        got = rt.full_state_dict(model)
    for name, p in ref.named_parameters():
        assert torch.allclose(got[name], p.detach(), rtol=1e-5, atol=1e-7), name


def test_clips_torch_cannot_route_are_refused_naming_rt_clip_grad_norm_():
    base, _ = _wrapped_pair()
    original = torch.nn.utils.clip_grad_norm_
    with offload.init(small_config()) as rt:
        model = rt.wrap(base)
        compute_loss(model, _ids(0), "tiny").backward()
        extra = nn.Parameter(torch.ones(3))
        extra.grad = torch.ones(3)
        for call in (lambda: torch.nn.utils.clip_grad_norm_(model.layers[0].parameters(), 1.0),  # part of them
                     lambda: torch.nn.utils.clip_grad_norm_([*model.parameters(), extra], 1.0),  # with plain ones
                     lambda: torch.nn.utils.clip_grad_value_(model.parameters(), 1.0),
                     lambda: torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, torch.tensor(5.0)),
                     lambda: clip_imported_before_the_block(model.parameters(), 1.0)):
            with pytest.raises(RuntimeError, match=r"rt\.clip_grad_norm_\(max_norm\)"):
                call()
        assert rt.grad_scale == 1.0  # nothing was clipped by a refused call
        p = nn.Parameter(torch.ones(3))  # plain parameters: torch's own clip
        p.grad = torch.full((3,), 4.0)
        assert torch.nn.utils.clip_grad_norm_([p], 1.0).item() == pytest.approx(math.sqrt(48))
        assert p.grad.norm().item() == pytest.approx(1.0, rel=1e-5)
    assert torch.nn.utils.clip_grad_norm_ is original  # put back when the runtime closed


def test_norms_vectors_and_torchs_grad_scaler_over_a_wrapped_model_are_refused_naming_the_fix():
    """get_total_norm over the placeholders' .grad (None: torch's AttributeError), parameters_to_vector (a meta
    vector, silently) and torch's GradScaler stepping offload.AdamW (torch's 'No inf checks were recorded') each
    name the fix; over plain parameters in the same block they are torch's; the patches go when the block closes."""
    base, _ = _wrapped_pair()
    originals = (torch.nn.utils.get_total_norm, torch.nn.utils.convert_parameters._check_param_device,
                 torch.amp.GradScaler.step, torch.amp.GradScaler.unscale_)
    plain = nn.Linear(4, 4)  # built outside: a module built in the block is sharded at its first use
    with offload.init(small_config()) as rt:
        model = rt.wrap(base)
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(compute_loss(model, _ids(0), "tiny")).backward()
        with pytest.raises(RuntimeError, match=r"get_total_norm got None.*rt\.clip_grad_norm_\(float\('inf'\)\)"):
            torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        n = sum(p.numel() for p in model.parameters())
        for call in (lambda: torch.nn.utils.parameters_to_vector(model.parameters()),
                     lambda: to_vector_imported_before_the_block(model.parameters()),
                     lambda: torch.nn.utils.vector_to_parameters(torch.zeros(n), model.parameters())):
            with pytest.raises(RuntimeError, match=r"parameters_to_vector.*rt\.full_state_dict\(model\)"):
                call()
        before = rt.full_state_dict(model)
        for call in (lambda: scaler.unscale_(opt), lambda: scaler.step(opt)):
            with pytest.raises(RuntimeError, match=r"GradScaler\.(unscale_|step) over an offload optimizer.*"
                                                   r"offload\.GradScaler\(\)"):
                call()
        after = rt.full_state_dict(model)
        assert all(torch.equal(before[k], after[k]) for k in before)
        # plain parameters in the same block: torch's own
        popt = torch.optim.SGD(plain.parameters(), lr=0.1)
        w = plain.weight.detach().clone()
        scaler.scale(plain(torch.ones(2, 4)).sum()).backward()
        assert torch.nn.utils.get_total_norm([p.grad for p in plain.parameters()]).item() > 0
        assert torch.equal(torch.nn.utils.parameters_to_vector(plain.parameters())[:16], plain.weight.detach().view(-1))
        scaler.step(popt)
        scaler.update()
        assert not torch.equal(plain.weight.detach(), w)
    assert (torch.nn.utils.get_total_norm, torch.nn.utils.convert_parameters._check_param_device,
            torch.amp.GradScaler.step, torch.amp.GradScaler.unscale_) == originals


# ---- model.to() / .cuda() / .float() / .half() ----------------------------------------------------------------------

def test_to_and_float_right_after_construction_train_as_without_them():
    """model.to(device) right after construction inside the block crashed ('Cannot copy out of meta tensor')."""
    def run(move: bool) -> tuple[list, dict]:
        with offload.init(small_config(seed=5)) as rt:
            model = TinyTransformer()
            if move:
                assert model.to(rt.device) is model
                model.float().to(torch.float32).cpu()
            opt = offload.AdamW(model.parameters(), lr=1e-2)
            losses = []
            for s in range(2):
                loss = compute_loss(model, _ids(s), "tiny")
                loss.backward()
                opt.step(), opt.zero_grad()
                losses.append(loss.item())
            model.to("cpu").float()  # and once wrapped and used
            return losses, rt.full_state_dict(model)

    moved, still = run(True), run(False)
    assert moved[0] == still[0]
    assert all(torch.equal(moved[1][k], still[1][k]) for k in still[1])


@pytest.mark.parametrize("when", ["built", "wrapped"])
@pytest.mark.parametrize("call", ["half", "double", "bfloat16", "to_meta"])
def test_a_cast_or_move_the_runtime_cannot_honour_is_refused_naming_the_setting(when, call):
    with offload.init(small_config()) as rt:
        model = TinyTransformer()
        if when == "wrapped":
            rt.wrap(model)
        buffers = {n: b.clone() for n, b in model.named_buffers()}
        fix = r"compute_dtype" if call != "to_meta" else r"rt\.device"
        with pytest.raises(RuntimeError, match=fix):
            model.to("meta") if call == "to_meta" else getattr(model, call)()
        assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())  # refused before anything moved
        compute_loss(model, _ids(0), "tiny").backward()  # and it still trains


@pytest.mark.filterwarnings("ignore:offload. compute_dtype='fp16' on this CPU")
def test_half_under_an_fp16_runtime_is_a_no_op():
    with offload.init(small_config(compute_dtype="fp16")) as rt:
        model = TinyTransformer().half()
        assert all(p.dtype == torch.float32 for p in model.parameters())  # (placeholders: fp32 masters)
        rt.wrap(model).half()


# ---- the other calls that touch parameters ---------------------------------------------------------------------------

def test_torch_save_of_a_state_dict_holds_the_values():
    base, ref = _wrapped_pair()
    with offload.init(small_config()) as rt:
        model = rt.wrap(base)
        buf = io.BytesIO()
        torch.save(model.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf)
    for name, p in ref.state_dict().items():
        assert torch.equal(loaded[name], p), name


def test_writes_into_and_value_reads_of_a_wrapped_models_parameters_are_refused_naming_the_fix():
    """On the meta placeholders of a wrapped model `p.data.copy_(x)`, torch.nn.init and `p.mul_()` changed nothing,
    `[p.detach().clone() ...]` (an EMA's start) held no values, and `ema.add_(p)` added nothing: in silence."""
    base, ref = _wrapped_pair()
    with offload.init(small_config()) as rt:
        model = rt.wrap(base)
        p = model.layers[0].mlp[0].weight
        writes = [lambda: p.data.copy_(torch.ones(p.shape)), lambda: torch.nn.init.normal_(p),
                  lambda: p.data[0].zero_(), lambda: setattr(p, "data", torch.ones(p.shape)),
                  lambda: p.detach().mul_(2.0)]
        for write in writes:
            with torch.no_grad(), pytest.raises(RuntimeError, match=r"model\.load_state_dict"):
                write()
        ema = torch.zeros(p.shape)
        reads = [lambda: [q.detach().clone() for q in model.parameters()], lambda: p.data.to(torch.float64),
                 lambda: ema.mul_(0.9).add_(p.detach(), alpha=0.1), lambda: ema.copy_(p), lambda: p.cpu()]
        for read in reads:
            with torch.no_grad(), pytest.raises(RuntimeError, match=r"rt\.full_state_dict\(model\)"):
                read()
        # what stays: metadata, and the values through the runtime
        assert sum(q.numel() for q in model.parameters()) == sum(q.numel() for q in ref.parameters())
        assert p.shape == ref.layers[0].mlp[0].weight.shape and p.requires_grad and p.dtype == torch.float32
        assert torch.equal(rt.full_state_dict(model)["layers.0.mlp.0.weight"], ref.layers[0].mlp[0].weight)


def test_an_ema_kept_from_full_state_dict_is_plain_pytorchs():
    """The recipe the refusal names: an EMA of the weights updated from rt.full_state_dict after each step gives
    plain torch's EMA."""
    base, ref = _wrapped_pair()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_ema = {n: p.detach().clone() for n, p in ref.named_parameters()}
    with offload.init(small_config()) as rt:
        model = rt.wrap(base)
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        ema = {n: v.clone() for n, v in rt.full_state_dict(model).items() if n in ref_ema}
        for s in range(3):
            for m, o in ((model, opt), (ref, ref_opt)):
                compute_loss(m, _ids(s), "tiny").backward()
                o.step()
                o.zero_grad()
            now = rt.full_state_dict(model)
            with torch.no_grad():
                for n, p in ref.named_parameters():
                    ref_ema[n].mul_(0.9).add_(p, alpha=0.1)
                    ema[n].mul_(0.9).add_(now[n], alpha=0.1)
    for n in ref_ema:
        assert torch.allclose(ema[n], ref_ema[n], rtol=1e-5, atol=1e-7), n
