"""Standard torch calls on a model wrapped by offload.init behave as on the plain model (or raise a clear
error): model.zero_grad, several optimizers with clipping, zero_grad(set_to_none=False), state_dict /
load_state_dict, loading inside the block, requires_grad changes, a failed backward, a double backward (refused),
the swap directory."""
import contextlib
import copy
import os
import re
import sys
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn

import offload

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_common import (DIM, VOCAB, TinyTransformer, compute_loss, make_llama, one_torch_thread,  # noqa: E402
                         small_config as _cfg, token_ids as _ids, transformers_available)


@pytest.fixture(autouse=True)
def _one_thread():
    yield from one_torch_thread()


def _worst(got: dict, ref: nn.Module) -> float:
    return max(((got[n] - p.detach()).norm() / p.detach().norm().clamp_min(1e-12)).item()
               for n, p in ref.named_parameters())


@contextlib.contextmanager
def _beside_torch():
    """One TinyTransformer twice, from the same weights: plain PyTorch's with torch.optim.AdamW, and one wrapped
    by offload.init with offload.AdamW. Yields (rt, (ref, ref_opt), (model, opt))."""
    torch.manual_seed(0)
    base = TinyTransformer()
    ref = copy.deepcopy(base)
    with offload.init(_cfg()) as rt:
        model = rt.wrap(copy.deepcopy(base))
        yield rt, (ref, torch.optim.AdamW(ref.parameters(), lr=1e-2)), (model, offload.AdamW(model.parameters(),
                                                                                               lr=1e-2))


def _steps_side_by_side(rt, pairs, steps: int, after_backward=lambda rt, m: None) -> None:
    for s in range(steps):
        for m, o in pairs:
            compute_loss(m, _ids(s), "tiny").backward()
            after_backward(rt, m)
            o.step()
            o.zero_grad()


def test_model_zero_grad_clears_runtime_gradients():
    torch.manual_seed(0)
    base = TinyTransformer()
    ref = copy.deepcopy(base)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for s in range(4):
        compute_loss(ref, _ids(s), "tiny").backward()
        ropt.step()
        ref.zero_grad()  # what HF Trainer calls
    with offload.init(_cfg()) as rt:
        model = rt.wrap(copy.deepcopy(base))
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        for s in range(4):
            compute_loss(model, _ids(s), "tiny").backward()
            opt.step()
            model.zero_grad()
        assert not any(u.has_grad for u in rt.units)
        got = rt.full_state_dict()
    assert _worst(got, ref) < 1e-5


def test_two_forwards_then_two_backwards_accumulate_as_torch():
    """Two graphs built before either backward (two forwards, then two backwards: the second backward starts
    from IDLE, a move of the training state the runtime allows) accumulate as plain PyTorch does."""
    torch.manual_seed(0)
    base = TinyTransformer()
    ref = copy.deepcopy(base)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with offload.init(_cfg()) as rt:
        model = rt.wrap(copy.deepcopy(base))
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        for m, o in ((ref, ropt), (model, opt)):
            for s in range(2):
                first, second = compute_loss(m, _ids(2 * s), "tiny"), compute_loss(m, _ids(2 * s + 1), "tiny")
                first.backward()
                second.backward()
                o.step()
                o.zero_grad()
        got = rt.full_state_dict()
    assert _worst(got, ref) < 1e-5


def test_one_back_reference_to_the_runtime_on_modules_and_parameters():
    """`_offload_runtime`, on every module of a wrapped model and on every parameter (docs/environment.md): the
    one name; the two others it had (`_offload_rt`, `_offload_runtime_ref`) are gone."""
    with offload.init(_cfg()) as rt:
        model = rt.wrap(TinyTransformer())
        for obj in [*model.modules(), *model.parameters()]:
            assert obj._offload_runtime is rt, type(obj)
            assert not hasattr(obj, "_offload_rt") and not hasattr(obj, "_offload_runtime_ref"), type(obj)
        assert not hasattr(nn.Linear(2, 2), "_offload_runtime")  # a module built outside no runtime owns


def test_submodule_zero_grad_clears_only_its_parameters():
    torch.manual_seed(0)
    base = TinyTransformer()
    ref = copy.deepcopy(base)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with offload.init(_cfg()) as rt:
        model = rt.wrap(copy.deepcopy(base))
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        for m, o in ((ref, ropt), (model, opt)):
            for s in range(3):  # block 1 and the final norm accumulate over steps, the rest does not
                compute_loss(m, _ids(s), "tiny").backward()
                o.step()
                m.layers[0].zero_grad()
                m.emb.zero_grad()
                m.frozen.zero_grad()
        got = rt.full_state_dict()
    assert _worst(got, ref) < 1e-5


def test_two_optimizers_share_the_clip_and_zero_only_their_own_grads():
    torch.manual_seed(0)
    base = TinyTransformer()

    def split(m):
        emb = [m.emb.weight]
        return emb, [p for n, p in m.named_parameters() if p.requires_grad and n != "emb.weight"]

    ref = copy.deepcopy(base)
    emb, rest = split(ref)
    r1, r2 = torch.optim.AdamW(emb, lr=1e-2), torch.optim.AdamW(rest, lr=1e-2)
    with offload.init(_cfg()) as rt:
        model = rt.wrap(copy.deepcopy(base))
        memb, mrest = split(model)
        o1, o2 = offload.AdamW(memb, lr=1e-2), offload.AdamW(mrest, lr=1e-2)
        for s in range(4):
            compute_loss(ref, _ids(s), "tiny").backward()
            torch.nn.utils.clip_grad_norm_(emb + rest, 0.1)
            compute_loss(model, _ids(s), "tiny").backward()
            rt.clip_grad_norm_(0.1)
            # o1 zeroes before o2 steps: o2 must still see its own (clipped) gradients
            r1.step(), r1.zero_grad(), r2.step(), r2.zero_grad()
            o1.step(), o1.zero_grad(), o2.step(), o2.zero_grad()
        got = rt.full_state_dict()
    assert _worst(got, ref) < 1e-5


class _Blk(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, use_b):
        return self.b(self.a(x)) if use_b else self.a(x)


class _TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Blk(), _Blk()])

    def forward(self, x, use_b):
        for layer in self.layers:
            x = layer(x, use_b)
        return x.pow(2).mean()


@pytest.mark.parametrize("zero", ["optimizer", "model"])
def test_zero_grad_set_to_none_false_keeps_zero_grads_that_are_stepped(zero):
    """torch keeps a zero .grad, so AdamW still decays and moves a parameter unused in this step."""
    torch.manual_seed(0)
    base, xs = _TwoBlocks(), torch.randn(6, 4, 8)
    ref = copy.deepcopy(base)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    with offload.init(_cfg()) as rt:
        model = rt.wrap(copy.deepcopy(base))
        opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        for m, o in ((ref, ropt), (model, opt)):
            for s in range(6):
                m(xs[s], s % 2 == 0).backward()  # .b is used on even steps only
                o.step()
                (o if zero == "optimizer" else m).zero_grad(set_to_none=False)
        got = rt.full_state_dict()
    assert _worst(got, ref) < 1e-5


def test_swap_dir_is_private_fresh_and_removed_on_error(tmp_path):
    os.umask(0o022)
    planted = tmp_path / f"offload-{os.getpid()}-rank0"  # the name a predictable scheme would use
    planted.symlink_to(tmp_path)
    with pytest.raises(KeyError):
        with offload.init(_cfg(params="nvme", optimizer="nvme", nvme_path=str(tmp_path))) as rt:
            model = rt.wrap(TinyTransformer())
            opt = offload.AdamW(model.parameters())
            compute_loss(model, _ids(0), "tiny").backward()
            opt.step()
            run_dirs = [e for e in os.scandir(tmp_path) if e.name != planted.name]
            assert len(run_dirs) == 1 and not run_dirs[0].is_symlink()
            assert os.stat(run_dirs[0].path).st_mode & 0o777 == 0o700
            assert any(os.scandir(run_dirs[0].path))  # the swap files are in there
            assert not [e for e in os.scandir(tmp_path) if e.is_file()]  # nothing written through the link
            raise KeyError("user error inside the block")
    assert sorted(os.listdir(tmp_path)) == [planted.name]  # the run directory is gone


@pytest.mark.parametrize("dtype,persist", [("fp32", "0"), ("bf16", "0"), ("fp32", "1MiB")])
def test_state_dict_and_load_state_dict_round_trip_real_values(tmp_path, dtype, persist):
    torch.manual_seed(0)
    base, other = TinyTransformer(), TinyTransformer()
    ref = copy.deepcopy(base)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    compute_loss(ref, _ids(0), "tiny").backward()
    ropt.step()
    with offload.init(_cfg(compute_dtype=dtype, persist_threshold=persist)) as rt:
        model = rt.wrap(copy.deepcopy(base))
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        compute_loss(model, _ids(0), "tiny").backward()
        opt.step()
        sd = model.state_dict()
        want = ref.state_dict()
        assert list(sd) == list(want)  # torch's keys and order (tied head.weight included)
        full = rt.full_state_dict(model)
        for k, v in want.items():
            assert sd[k].device.type == "cpu" and torch.equal(sd[k], full[k]), k
            if dtype == "fp32":  # bf16 compute trains differently from the fp32 reference
                assert (sd[k] - v).norm() <= 1e-5 * v.norm() + 1e-6, k
        sub = model.layers[1].state_dict()
        assert list(sub) == list(ref.layers[1].state_dict())
        assert torch.equal(sub["mlp.0.weight"], sd["layers.1.mlp.0.weight"])
        torch.save(sd, tmp_path / "m.pt")
        # load another model's weights: forward then matches that model exactly (fp32)
        result = model.load_state_dict(other.state_dict())
        assert result.missing_keys == [] and result.unexpected_keys == []
        got = rt.full_state_dict(model)
        for k, v in other.state_dict().items():  # floating buffers are kept in the compute dtype
            assert torch.equal(got[k], v.to(got[k].dtype)), k
        with torch.no_grad():
            out, want_out = model(_ids(5)), other(_ids(5))
        tol = 1e-5 if dtype == "fp32" else 5e-2
        assert (out.float() - want_out).norm() <= tol * want_out.norm()
        # and back from the file torch.save wrote (real data, not meta)
        model.load_state_dict(torch.load(tmp_path / "m.pt"))
        assert torch.equal(rt.full_state_dict(model)["emb.weight"], sd["emb.weight"])
        bad = dict(sd)
        del bad["ln_f.weight"]
        with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: .*ln_f.weight"):
            model.load_state_dict(bad)
        assert model.load_state_dict(bad, strict=False).missing_keys == ["ln_f.weight"]


@pytest.mark.parametrize("assign", [False, True])
def test_load_state_dict_into_model_built_in_block_keeps_pretrained(assign):
    torch.manual_seed(123)
    pre = TinyTransformer()
    sd = pre.state_dict()
    with offload.init(_cfg()) as rt:
        model = TinyTransformer()  # meta placeholders until first use
        result = model.load_state_dict(sd, assign=assign)
        assert result.missing_keys == [] and result.unexpected_keys == []
        with torch.no_grad():
            out = model(_ids(3))
        got = rt.full_state_dict(model)
        for k, v in sd.items():
            assert torch.equal(got[k], v), k
        with torch.no_grad():
            assert torch.allclose(out, pre(_ids(3)), rtol=1e-5, atol=1e-6)
        # a submodule of a fresh in-block model: the whole model is sharded, that block loaded
        again = TinyTransformer()
        again.layers[1].load_state_dict(pre.layers[1].state_dict())
        got = rt.full_state_dict(again)
        assert torch.equal(got["layers.1.mlp.0.weight"], sd["layers.1.mlp.0.weight"])
    assert nn.Module.load_state_dict.__qualname__ == "Module.load_state_dict"  # patch removed on exit


@pytest.mark.parametrize("change", ["freeze", "unfreeze", "unfreeze_persistent"])
def test_changing_requires_grad_after_wrap_raises_naming_the_parameter(change):
    torch.manual_seed(0)
    persist = "1MiB" if change == "unfreeze_persistent" else "0"
    with offload.init(_cfg(persist_threshold=persist)) as rt:
        model = rt.wrap(TinyTransformer())
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        compute_loss(model, _ids(0), "tiny").backward()
        if change == "freeze":
            model.layers[0].mlp[0].weight.requires_grad_(False)
            name = "layers.0.mlp.0.weight"
        else:  # persistent: the module holds the gathered (detached, leaf) view of the frozen weight
            model.frozen.weight.requires_grad_(True)
            name = "frozen.weight"
        with pytest.raises(RuntimeError, match=f"{name}.*requires_grad"):
            opt.step()
        with pytest.raises(RuntimeError, match=f"{name}.*requires_grad"):
            compute_loss(model, _ids(1), "tiny")


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise ValueError("boom")


def test_backward_that_raises_does_not_break_later_steps():
    with _beside_torch() as (rt, (ref, ropt), (model, opt)):
        def nothing_stays_gathered(rt, m):
            if m is model:  # the end-of-backward callback ran again
                assert rt.gathered_bytes == 0 and rt.peak_gathered_bytes <= rt.gathered_bound()

        h = model.frozen.register_forward_hook(lambda mod, a, out: _Boom.apply(out))
        with pytest.raises(ValueError, match="boom"):
            compute_loss(model, _ids(0), "tiny").backward()
        h.remove()
        opt.zero_grad()
        _steps_side_by_side(rt, ((ref, ropt), (model, opt)), 2, nothing_stays_gathered)
        got = rt.full_state_dict()
    assert _worst(got, ref) < 1e-5


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")  # (torch's, about .grad cycles)
def test_a_double_backward_is_refused_by_name_and_later_steps_train_as_torch():
    """create_graph=True (a gradient penalty) needs the parameters after their backward freed them: it raised a
    storage error naming no setting; now it is refused naming create_graph, and the run goes on exactly."""
    with _beside_torch() as (rt, (ref, ropt), (model, opt)):
        loss = compute_loss(model, _ids(0), "tiny")
        with pytest.raises(RuntimeError, match="create_graph=True"):
            loss.backward(create_graph=True)
        del loss
        opt.zero_grad()
        _steps_side_by_side(rt, ((ref, ropt), (model, opt)), 2)
        got = rt.full_state_dict()
    assert _worst(got, ref) < 1e-5


def test_params_on_device_counts_gathered_units_against_device_budget():
    model = TinyTransformer(d=64, layers=4)  # big enough that the store's page rounding is small
    with offload.init(_cfg(params="device", pipeline=False)) as rt:  # no gather-ahead: the minimum bound
        rt.wrap(copy.deepcopy(model))
        shards = rt.states.nbytes_in("device")
        bound = rt.gathered_bound()
    budget = shards + bound // 2  # the shards fit, shards + gathered units do not
    with offload.init(_cfg(params="device", device_budget=f"{budget}B")) as rt:
        with pytest.raises(MemoryError, match=r"device_budget.*gathering units needs up to .*working set") as e:
            rt.wrap(model)
    # the largest unit's working set: its gathered params (at least the unpipelined bound) and its gradients
    need = int(re.search(r"needs up to [^(]*\((\d+) bytes\)", str(e.value)).group(1))
    assert need > bound, (need, bound)


def test_state_dict_of_unused_in_block_model_is_real_and_meta_values_are_refused():
    with offload.init(_cfg()) as rt:
        source = TinyTransformer()  # built in the block, never used: placeholders until now
        sd = source.state_dict()
        assert all(v.device.type == "cpu" for v in sd.values())
        assert torch.equal(sd["emb.weight"], rt.full_state_dict(source)["emb.weight"])
        target = rt.wrap(TinyTransformer())
        target.load_state_dict(sd)
        assert torch.equal(rt.full_state_dict(target)["layers.1.mlp.0.weight"], sd["layers.1.mlp.0.weight"])
        meta_sd = {"weight": torch.empty(DIM, DIM, device="meta"), "bias": torch.empty(DIM, device="meta")}
        with pytest.raises(RuntimeError, match="weight is a meta tensor"):
            target.frozen.load_state_dict(meta_sd)


def test_an_inference_mode_forward_leaves_persistent_units_training():
    """An evaluation under torch.inference_mode re-gathered the persistent units (stale after opt.step()) with
    views that had no autograd link to their shards: no gradient reached them again and their parameters stopped
    training without an error (LoRA's adapters are persistent). The losses are now those of the same run without
    the evaluation, bit for bit, and those of plain PyTorch with the same optimizer (offload.AdamW over plain
    parameters: the fused kernel, whose rounding differs from torch.optim.AdamW's in the last bits)."""
    def run(evaluate: bool, wrapped: bool) -> list[float]:
        torch.manual_seed(0)
        model = TinyTransformer()
        with offload.init(_cfg(persist_threshold="1MiB")) if wrapped else contextlib.nullcontext() as rt:
            if wrapped:
                model = rt.wrap(model)
                assert all(u.persistent for u in rt.units)
            opt = offload.AdamW(model.parameters(), lr=1e-2)
            seen = []
            for s in range(4):
                if s == 1 and evaluate:
                    with torch.inference_mode():
                        compute_loss(model, _ids(9), "tiny")  # an evaluation between steps
                loss = compute_loss(model, _ids(s), "tiny")
                loss.backward()
                opt.step()
                opt.zero_grad()
                seen.append(loss.item())
            return seen

    evaluated = run(evaluate=True, wrapped=True)
    assert evaluated == run(evaluate=False, wrapped=True)
    assert evaluated == run(evaluate=True, wrapped=False)


def test_a_wrapped_model_is_not_deep_copied_or_pickled_and_says_what_to_do_instead(tmp_path):
    """copy.deepcopy failed on a lock deep in the runtime and torch.save(model) on the module's class: errors that
    named neither the cause (the values live in the shards) nor the fix (copy rt.full_state_dict())."""
    import pickle

    torch.manual_seed(0)
    base, plain = TinyTransformer(), TinyTransformer()
    with offload.init(_cfg()) as rt:
        model = rt.wrap(copy.deepcopy(base))
        for attempt in (lambda: copy.deepcopy(model), lambda: copy.deepcopy(model.layers[0]),
                        lambda: pickle.dumps(model), lambda: torch.save(model, tmp_path / "model.pt")):
            with pytest.raises(TypeError, match=r"values live in the runtime's shards.*"
                                                r"plain.load_state_dict\(rt.full_state_dict\(model\)\)"):
                attempt()
        assert copy.copy(model).layers is model.layers  # a shallow copy shares the modules, as before
        model.compile(backend="eager")
        assert copy.copy(model)._compiled_call_impl is None  # as torch's: not the original's compiled call
        plain.load_state_dict(rt.full_state_dict(model))  # what the message says to do
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), base.state_dict().values()))


@pytest.mark.parametrize("config", ["cpu", "nvme", "persistent"])
def test_torch_compile_of_a_wrapped_model_trains_as_the_eager_one(config, tmp_path):
    """torch.compile of a wrapped model failed inside Dynamo (it traced the runtime's hooks: lanes, futures,
    locks). The hooks run eagerly now and each unit's forward is compiled between them: under aot_eager (Dynamo
    and AOTAutograd, the gradients reaching the shards through the gathered views) the losses and parameters
    are the eager run's bit for bit, and the steps after the first compile nothing new though every gather
    makes new parameter views. The compiled wrapper's zero_grad clears the runtime's gradients (it cleared
    nothing: they summed over the steps)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    kw = {"cpu": {}, "persistent": {"persist_threshold": "1MiB"},
          "nvme": {"params": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path), "cpu_budget": "256KiB"}}[config]

    def run(compiled: bool):
        torch._dynamo.reset()  # (each runtime's global hook is new: no graph of an earlier run is reused)
        counters.clear()
        torch.manual_seed(0)
        model = TinyTransformer()
        losses, graphs = [], []
        with offload.init(_cfg(**kw)) as rt:
            model = rt.wrap(model)
            opt = offload.AdamW(model.parameters(), lr=1e-2)
            forward = torch.compile(model, backend="aot_eager") if compiled else model
            for step in range(4):
                ids = _ids(step)
                logits = forward(ids[:, :-1])
                loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
                loss.backward()
                opt.step()
                forward.zero_grad()  # (the compiled one: torch's wrapper, routed to the runtime's gradients)
                losses.append(loss.item())
                graphs.append(counters["stats"]["unique_graphs"])
            return losses, graphs, rt.full_state_dict(model)

    try:
        eager, _, eager_values = run(compiled=False)
        compiled, graphs, values = run(compiled=True)
    finally:
        torch._dynamo.reset()
    assert graphs[0] > 0 and graphs[-1] == graphs[0], graphs  # compiled once, then reused
    assert compiled == eager
    assert values.keys() == eager_values.keys() and all(torch.equal(values[k], eager_values[k]) for k in values)


def test_a_submodule_called_outside_its_units_forward_raises_instead_of_computing_on_placeholders():
    """A module holding a unit's parameters, called by itself (a Hugging Face model's lm_head or embeddings, a
    probe on one layer's MLP), computed on meta placeholders: F.linear with a meta weight returned a cpu tensor of
    garbage without an error, and a persistent unit's module after opt.step() gave the values before the step. It
    raises now with gradients on, naming the module and its unit; without gradients the unit is gathered for the
    call; gathered and current (inside the model's forward, or a persistent unit after a forward) it computes with
    the real values."""
    torch.manual_seed(0)
    x = torch.randn(2, DIM)
    with offload.init(_cfg()) as rt:
        model = rt.wrap(TinyTransformer())
        names = {u.name for u in rt.units}
        assert "layers.0" in names and "layers.0.mlp" not in names  # the MLP's linears belong to block 0's unit
        with pytest.raises(RuntimeError, match=r"module 'layers.0.mlp.0' was called outside the forward of its "
                                               r"unit \d \(layers.0\).*placeholders without values"):
            model.layers[0].mlp(x)
        with pytest.raises(RuntimeError, match=r"module 'head' .* unit 0 \(<root>\)"):
            model.head(x)
        compute_loss(model, _ids(0), "tiny").backward()  # inside the forward and its backward, as before
        with torch.no_grad():  # without gradients the unit is gathered for the call
            got = model.layers[0].mlp[0](x)
        held = rt.full_state_dict(model)
        assert torch.equal(got, nn.functional.linear(x, held["layers.0.mlp.0.weight"], held["layers.0.mlp.0.bias"]))
    with offload.init(_cfg(persist_threshold="1MiB")) as rt:  # every unit persistent: gathered for good
        model = rt.wrap(TinyTransformer())
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        compute_loss(model, _ids(0), "tiny").backward()
        opt.step()
        with pytest.raises(RuntimeError, match=r"'layers.0.mlp.0' .* outdated \(updated since it was gathered\)"):
            model.layers[0].mlp[0](torch.randn(2, DIM))
        with torch.no_grad():
            model(_ids(1))  # the forward re-gathers the updated values
            got = model.layers[0].mlp[0](x)
        held = rt.full_state_dict(model)
        assert torch.equal(got, nn.functional.linear(x, held["layers.0.mlp.0.weight"], held["layers.0.mlp.0.bias"]))


def test_a_submodule_called_first_on_a_model_built_in_the_block_is_checked_too():
    """A model built inside the block is wrapped by its first module call, so that call's own inside-unit pre-hook
    came too late: a submodule called first met meta placeholders ("Tensor on device meta is not on the expected
    device cpu"). It gets the same check now: raised with gradients, gathered and real values without."""
    torch.manual_seed(0)
    x = torch.randn(2, DIM)
    with offload.init(_cfg()):
        model = TinyTransformer()
        with pytest.raises(RuntimeError, match=r"module 'layers.0.mlp.0' was called outside the forward of its "
                                               r"unit \d \(layers.0\).*placeholders without values"):
            model.layers[0].mlp[0](x)
    with offload.init(_cfg()) as rt:
        model = TinyTransformer()
        with torch.no_grad():
            got = model.layers[0].mlp[0](x)
        held = rt.full_state_dict(model)
        assert torch.equal(got, nn.functional.linear(x, held["layers.0.mlp.0.weight"], held["layers.0.mlp.0.bias"]))


def test_load_state_dict_runs_the_modules_load_hooks_as_torch_does():
    """model.load_state_dict wrote the shards by key and ran none of the modules' own load code: a pre-hook that
    renames a legacy key (here on a block, inside a unit) left the parameter unloaded under strict=False, or was
    refused as missing and unexpected keys; a post-hook never ran; a module's own _load_from_state_dict (BatchNorm's
    num_batches_tracked of old checkpoints) was bypassed. torch's own walk runs now: the wrapped model loads what the
    plain one loads, and the hooks run once each."""
    def legacy(module, state_dict, prefix, *args):  # "w_in" was "mlp.0" in an older version of the block
        for suffix in ("weight", "bias"):
            old = f"{prefix}w_in.{suffix}"
            if old in state_dict:
                state_dict[f"{prefix}mlp.0.{suffix}"] = state_dict.pop(old)

    class WithNorm(TinyTransformer):
        def __init__(self):
            super().__init__()
            self.norm = nn.BatchNorm1d(DIM)

    def build():
        torch.manual_seed(0)
        model = WithNorm()
        model.layers[1].register_load_state_dict_pre_hook(legacy)
        model.register_load_state_dict_post_hook(lambda module, keys: posts.append(sorted(keys.missing_keys)))
        return model

    torch.manual_seed(1)
    source = WithNorm()
    sd = {k.replace("layers.1.mlp.0.", "layers.1.w_in."): v + 1.0 for k, v in source.state_dict().items()
          if not k.endswith("num_batches_tracked")}  # (an old BatchNorm checkpoint: version 1, no counter)
    sd = OrderedDict(sd)
    sd._metadata = {"norm": {"version": 1}}
    posts = []
    plain = build()
    plain.load_state_dict(sd)
    with offload.init(_cfg()) as rt:
        model = rt.wrap(build())
        model.load_state_dict(sd)
        held = rt.full_state_dict(model)
    assert posts == [[], []]  # once per load, nothing missing
    expected = plain.state_dict()
    assert held.keys() == expected.keys()
    assert all(torch.equal(held[k], expected[k]) for k in held)
    assert torch.equal(held["layers.1.mlp.0.weight"], source.state_dict()["layers.1.mlp.0.weight"] + 1.0)
    assert held["norm.num_batches_tracked"] == 0  # BatchNorm's own load filled it in


def test_a_gradient_hook_on_a_parameter_is_refused_rather_than_never_run():
    """p.register_hook / p.register_post_accumulate_grad_hook on a wrapped model's parameter (a placeholder) were
    accepted and never ran: the gradients go to the shards. They raise now, naming the parameter."""
    with offload.init(_cfg()) as rt:
        model = rt.wrap(TinyTransformer())
        named = dict(model.named_parameters())
        with pytest.raises(RuntimeError, match=r"gradient hook on parameter 'layers.0.mlp.0.weight' .* never run"):
            named["layers.0.mlp.0.weight"].register_hook(lambda grad: grad * 2)
        with pytest.raises(RuntimeError, match=r"parameter 'emb.weight' .*rt.clip_grad_norm_"):
            named["emb.weight"].register_post_accumulate_grad_hook(lambda p: None)
        compute_loss(model, _ids(0), "tiny").backward()  # the runtime's own hooks (on the gathered views) still run
        assert rt.clip_grad_norm_(1e9) > 0


@pytest.mark.skipif(not transformers_available(), reason="transformers not installed")
@pytest.mark.parametrize("kind", ["t5", "peft"])
@pytest.mark.parametrize("persist", ["0B", "1MiB"])
def test_generate_that_calls_a_submodule_first_gives_the_plain_models_tokens(kind, persist):
    """generate() of an encoder-decoder model calls its encoder by itself, and a PeftModel's calls the base model's
    generate: both reached modules of a unit outside its forward, which failed on meta placeholders (or, with the
    unit persistent, used the values before the last step). Without gradients such a call gathers the unit: after a
    training step the greedy tokens are the plain model's."""
    from transformers import T5Config, T5ForConditionalGeneration

    def build():
        if kind == "t5":
            torch.manual_seed(0)
            return T5ForConditionalGeneration(T5Config(
                vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
        peft = pytest.importorskip("peft")
        torch.manual_seed(1)
        return peft.get_peft_model(make_llama(tie=False), peft.LoraConfig(r=4, target_modules=["q_proj"],
                                                                          init_lora_weights="gaussian"))

    ids = torch.randint(2, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))

    def run(wrapped: bool) -> torch.Tensor:
        model = build()
        with offload.init(_cfg(persist_threshold=persist)) if wrapped else contextlib.nullcontext() as rt:
            if wrapped:
                model = rt.wrap(model)
            opt = offload.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                return model.generate(input_ids=ids, max_new_tokens=5, do_sample=False)

    assert torch.equal(run(wrapped=True), run(wrapped=False))


def test_modules_built_in_every_forward_are_not_kept_on_record():
    """A module built in every forward (a loss, `nn.CrossEntropyLoss()`) inside the block was recorded for good: the
    records of dead modules piled up, and the scan for models to wrap before each forward walked all of them, a
    cost growing with the step count. Dead records go before each scan."""
    with offload.init(_cfg()) as rt:
        model = rt.wrap(TinyTransformer())
        records = []
        for step in range(20):
            ids = _ids(step)
            logits = model(ids[:, :-1])
            nn.CrossEntropyLoss()(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
            records.append(len(rt._capture.modules))
        assert records[-1] == records[1], records  # as many as live (was one more each step)


def test_full_state_dict_loads_into_a_plain_model():
    """rt.full_state_dict() held the non-persistent buffers too (Llama's rotary inv_freq): plain
    model.load_state_dict refused it with unexpected keys."""
    class WithCache(TinyTransformer):
        def __init__(self):
            super().__init__()
            self.register_buffer("cache", torch.arange(4.0), persistent=False)

    torch.manual_seed(0)
    base = WithCache()
    with offload.init(_cfg()) as rt:
        state = rt.full_state_dict(rt.wrap(copy.deepcopy(base)))
    assert "cache" not in state and state.keys() == base.state_dict().keys()
    plain = WithCache()
    plain.load_state_dict(state)  # strict
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), base.state_dict().values()))


@pytest.mark.skipif(not transformers_available(), reason="transformers not installed")
def test_a_hugging_face_models_device_and_dtype_are_the_runtimes():
    """model.device and model.dtype read the first parameter, a meta placeholder: `ids.to(model.device)` moved the
    batch to meta, and the forward returned garbage without an error. They are the compute device and dtype."""
    torch.manual_seed(0)
    base = make_llama()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = base(ids).logits
    with offload.init(_cfg(compute_dtype="fp32")) as rt:
        model = rt.wrap(copy.deepcopy(base))
        assert model.device == rt.device and model.dtype == torch.float32
        with torch.no_grad():
            assert torch.equal(model(ids.to(model.device)).logits, expected)
    with offload.init(_cfg(compute_dtype="bf16")) as rt:
        assert rt.wrap(copy.deepcopy(base)).dtype == torch.bfloat16


def test_a_parameter_of_a_dtype_the_shards_cannot_hold_is_refused():
    """fp64 parameters were computed and stored in the compute dtype, the placeholder still saying float64 and
    state_dict() returning float32: values changed without a word. The wrap refuses them, naming the parameter."""
    model = TinyTransformer()
    model.frozen.double()
    with offload.init(_cfg()) as rt:
        with pytest.raises(ValueError, match=r"parameter frozen.weight is torch.float64; .*\(model.float\(\)\)"):
            rt.wrap(model)
