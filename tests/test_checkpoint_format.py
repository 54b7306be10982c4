"""The state-tree encoding round-trips everything a training state holds, deterministically."""

import json
import random

import numpy as np
import pytest
import torch

from training.checkpoint import format as fmt
from training.checkpoint.rng import capture_rng_state, restore_rng_state


def _roundtrip(tree):
    tensors = {}
    skeleton = json.loads(json.dumps(fmt.encode_tree(tree, tensors)))  # through real JSON text
    return fmt.decode_tree(skeleton, tensors), tensors


def _assert_same(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1
                                                                           else a, b.view(torch.uint8)
                                                                           if b.dtype.itemsize == 1 else b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, float) and a != a:
        assert b != b
    else:
        assert a == b


@pytest.mark.parametrize("shape", [(3, 5), (7,), ()])
def test_optimizer_state_roundtrip(shape):
    p = torch.nn.Parameter(torch.randn(shape))
    q = torch.nn.Parameter(torch.randn(4, 2, dtype=torch.float64))
    opt = torch.optim.AdamW([{"params": [p], "lr": 0.1}, {"params": [q], "weight_decay": 0.0}], betas=(0.9, 0.95))
    (p.sum() + q.pow(2).sum()).backward()
    opt.step()
    sd = opt.state_dict()
    out, tensors = _roundtrip(sd)
    _assert_same(sd, out)
    assert set(out["state"]) == {0, 1}  # int keys survive JSON
    assert out["param_groups"][0]["betas"] == (0.9, 0.95)  # tuples survive
    assert len(tensors) == 6  # exp_avg, exp_avg_sq, step for two parameters


def test_odd_leaves_roundtrip():
    tree = {
        "bytes": b"\x00\xffabc", "nd": np.arange(7, dtype=np.uint32) * 3, "dtype": torch.bfloat16,
        (1, "a"): "tuple key", 3.5: [None, True, float("inf"), float("nan")], "__dunder": 1,
        "bf16": torch.randn(3, 2).to(torch.bfloat16), "empty": torch.empty(0, 4),
    }
    out, _ = _roundtrip(tree)
    _assert_same(tree, out)
    size, _ = _roundtrip({"s": torch.Size([2, 3])})
    assert size["s"] == (2, 3)  # torch.Size comes back as the tuple it subclasses


def test_inline_tensors_roundtrip_and_rng_restores_exactly():
    state = capture_rng_state()
    skeleton = json.loads(json.dumps(fmt.encode_tree(state, None)))
    expected = (random.random(), np.random.rand(), torch.rand(3))
    restore_rng_state(fmt.decode_tree(skeleton, {}))
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert expected[0] == got[0] and expected[1] == got[1] and torch.equal(expected[2], got[2])


def test_encoding_is_deterministic_and_rejects_unknown_types():
    tree = {"a": torch.randn(2), "b": {"c": [1, 2.5, "x"]}}
    assert fmt.dumps(fmt.encode_tree(tree, {})) == fmt.dumps(fmt.encode_tree(tree, {}))
    with pytest.raises(ValueError, match="opt/fn.*function"):
        fmt.encode_tree({"opt": {"fn": lambda: 0}}, {})
    assert fmt.config_hash({"a": 1, "b": [1, 2]}) == fmt.config_hash({"b": [1, 2], "a": 1})
    assert fmt.config_hash({"a": 1}) != fmt.config_hash({"a": 2})


def test_names_validate():
    assert fmt.parse_step_dirname(fmt.step_dirname(42)) == 42
    assert fmt.parse_step_dirname(".staging-step_000000042") is None
    with pytest.raises(ValueError, match="step"):
        fmt.step_dirname(-1)
    with pytest.raises(ValueError, match="section"):
        fmt.check_section_name("model/x")
