"""oneDNN-packed linear layers on CPU (kvmem/cpu_linear.py): used only for inference on the weight they were
packed from; training, copies and changed weights run the plain F.linear; the model's outputs and greedy
tokens stay those of the plain layers."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from kvmem import cpu_linear
from kvmem.cpu_linear import ATTR, pack_linears, unpack_linears
from tests.conftest import make_tiny_llama

pytestmark = pytest.mark.skipif(not cpu_linear.supported(), reason="this torch build has no oneDNN linear")


def linears(model):
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


def plain(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


def test_every_linear_is_packed_once_and_gives_the_plain_output(tokenizer):
    model = make_tiny_llama(len(tokenizer))
    n = len(linears(model))
    assert pack_linears(model) == n
    assert pack_linears(model) == 0  # idempotent
    assert all(getattr(m, ATTR) is not None for m in linears(model))
    layer = model.model.layers[0].mlp.up_proj
    x = torch.randn(3, 5, layer.in_features)
    with torch.inference_mode():
        got = layer(x)
    assert got.shape == (3, 5, layer.out_features)
    torch.testing.assert_close(got, plain(layer, x), rtol=1e-5, atol=1e-5)


def test_tied_weights_share_one_packed_copy():
    other = torch.nn.Linear(8, 8)
    twin = torch.nn.Linear(8, 8)
    twin.weight = other.weight
    both = torch.nn.Sequential(other, twin)
    assert pack_linears(both) == 2
    assert getattr(other, ATTR).weight is getattr(twin, ATTR).weight


def test_a_packed_model_generates_the_plain_models_greedy_tokens_and_logits(tokenizer):
    model = make_tiny_llama(len(tokenizer))
    ids = torch.tensor([tokenizer("The user's sister lives in Lisbon and plays the violin.")["input_ids"]])
    with torch.inference_mode():
        ref = model(input_ids=ids).logits
        ref_tokens = model.generate(ids, max_new_tokens=12, do_sample=False)
        pack_linears(model)
        got = model(input_ids=ids).logits
        tokens = model.generate(ids, max_new_tokens=12, do_sample=False)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert tokens.tolist() == ref_tokens.tolist()


def test_training_runs_the_plain_layer_with_gradients():
    layer = torch.nn.Linear(16, 4)
    pack_linears(layer)
    x = torch.randn(2, 16, requires_grad=True)
    y = layer(x)
    assert torch.equal(y, plain(layer, x))  # the very same kernel: grad mode is on
    y.sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


def test_a_weight_changed_in_place_or_replaced_is_used_as_it_is_now():
    layer = torch.nn.Linear(16, 4)
    pack_linears(layer)
    x = torch.randn(2, 16)
    with torch.no_grad():
        layer.weight.add_(1.0)  # the version counter moves: the packed copy is stale
        assert torch.equal(layer(x), plain(layer, x))
        layer.weight = torch.nn.Parameter(torch.randn(4, 16))  # another tensor
        assert torch.equal(layer(x), plain(layer, x))


def test_a_deep_copy_is_not_packed_and_follows_its_own_weights():
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4))
    pack_linears(model)
    twin = copy.deepcopy(model)  # distillation trains a deep copy of the served model
    assert all(getattr(m, ATTR) is None for m in linears(twin))
    assert twin[0].forward.__self__ is twin[0]
    x = torch.randn(3, 16)
    with torch.no_grad():
        twin[0].weight.mul_(2.0)
        assert torch.equal(twin(x), plain(twin[1], plain(twin[0], x)))
        torch.testing.assert_close(model(x), plain(model[1], plain(model[0], x)), rtol=1e-5, atol=1e-5)


def test_nothing_is_packed_when_the_copy_would_take_over_a_quarter_of_ram(monkeypatch):
    layer = torch.nn.Linear(256, 256)  # 256 KiB of weights
    monkeypatch.setattr(cpu_linear, "_total_ram_bytes", lambda: 4 * 256 * 256 * 4 - 4)
    assert pack_linears(layer) == 0
    assert getattr(layer, ATTR, None) is None
    monkeypatch.setattr(cpu_linear, "_total_ram_bytes", lambda: 4 * 256 * 256 * 4)
    assert pack_linears(layer) == 1


def test_bfloat16_and_unpacked_layers_are_left_plain():
    layer = torch.nn.Linear(16, 4).to(torch.bfloat16)
    assert pack_linears(layer) == 0
    plain32 = torch.nn.Linear(16, 4)
    pack_linears(plain32)
    unpack_linears(plain32)
    assert getattr(plain32, ATTR, None) is None and "forward" not in plain32.__dict__


def test_load_model_packs_on_cpu_unless_told_not_to(tiny_model_dir, tmp_path):
    from kvmem.models import load_model

    digests = tmp_path / "digests.json"
    packed = load_model(str(tiny_model_dir), device="cpu", dtype="float32", digest_cache=digests)
    assert all(getattr(m, ATTR, None) is not None for m in linears(packed.model))
    unpacked = load_model(
        str(tiny_model_dir), device="cpu", dtype="float32", digest_cache=digests, packed_linears=False
    )
    assert all(getattr(m, ATTR, None) is None for m in linears(unpacked.model))
    # the weights, hence the blocks' addresses, are the same
    assert packed.fingerprint == unpacked.fingerprint
