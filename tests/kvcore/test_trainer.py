"""The Trainer on the local store: exact steps against hand-computed ones, both update modes, errors."""

import numpy as np
import pytest
from kvcore_testkit import DEVICE_KINDS

import kvcore
from kvcore import Parameter, Trainer, arrays
from kvcore.stores.local import LocalKVStore

pytestmark = pytest.mark.unit

BOTH_MODES = pytest.mark.parametrize("update_on_kvstore", [False, True], ids=["update_here", "update_on_store"])


def _f32(*values):
    return np.array(values, dtype=np.float32)


@BOTH_MODES
@pytest.mark.parametrize("coalesce_bytes", [0, 1 << 20], ids=["alone", "together"])
def test_step_sums_two_devices_gradients_and_applies_one_sgd_step(update_on_kvstore, coalesce_bytes):
    w = [_f32(1, 2, 3), _f32(1, 2, 3)]
    b = [_f32(0.5), _f32(0.5)]
    trainer = Trainer({"w": w, "b": b}, kvcore.optim.SGD(learning_rate=0.5), update_on_kvstore=update_on_kvstore,
                      coalesce_bytes=coalesce_bytes)
    trainer.step(4, {"w": [_f32(1, 0, 4), _f32(3, 8, 0)], "b": [_f32(2), _f32(6)]})
    # w -= lr * (g0 + g1) / batch_size
    expected_w = _f32(1, 2, 3) - 0.5 * _f32(4, 8, 4) / 4
    for replica in w:
        np.testing.assert_array_equal(replica, expected_w)
    for replica in b:
        np.testing.assert_array_equal(replica, _f32(0.5 - 0.5 * 8 / 4))


@pytest.mark.parametrize("kind", DEVICE_KINDS)
@pytest.mark.parametrize("store", ["local", "device"])
@BOTH_MODES
def test_steps_on_device_arrays_keep_every_replica_exact_and_where_it_was(kind, store, update_on_kvstore):
    if kind == "gpu":  # two replicas: on two GPUs when there are two, else both on the one
        devices = [arrays.gpu(i % arrays.num_gpus()) for i in range(2)]
    else:
        devices = [arrays.cpu(), arrays.cpu()]
    w = [arrays.to_device(_f32(1, 2, 3), d) for d in devices]
    b = [arrays.to_device(_f32(0.5), d) for d in devices]
    trainer = Trainer({"w": w, "b": b}, kvcore.optim.SGD(learning_rate=0.5), kvstore=store,
                      update_on_kvstore=update_on_kvstore)
    for _ in range(2):
        gw = [arrays.to_device(g, d) for g, d in zip((_f32(1, 0, 4), _f32(3, 8, 0)), devices)]
        gb = [arrays.to_device(g, d) for g, d in zip((_f32(2), _f32(6)), devices)]
        trainer.step(4, {"w": gw, "b": gb})
    for replica, device in zip(w + b, devices + devices):
        assert arrays.device_of(replica) == device
    for replica in w:
        np.testing.assert_array_equal(arrays.asnumpy(replica), _f32(1, 2, 3) - 2 * 0.5 * _f32(4, 8, 4) / 4)
    for replica in b:
        np.testing.assert_array_equal(arrays.asnumpy(replica), _f32(0.5 - 2 * 0.5 * 8 / 4))


@BOTH_MODES
def test_momentum_sgd_over_three_steps_matches_the_hand_computed_trajectory(update_on_kvstore):
    w = np.array([1.0, -1.0], np.float64)
    trainer = Trainer([w], "sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.01},
                      update_on_kvstore=update_on_kvstore)
    expected, mom = np.array([1.0, -1.0]), np.zeros(2)
    for step in range(3):
        grad = np.array([2.0 + step, -4.0], np.float64)
        trainer.step(2, [grad.copy()])
        g = grad / 2 + 0.01 * expected
        mom = 0.9 * mom - 0.1 * g
        expected = expected + mom
        np.testing.assert_allclose(w, expected, rtol=0, atol=1e-12)


def test_adam_with_two_replicas_keeps_one_state_per_parameter():
    # Adam's bias correction counts updates per key: two replicas must not count twice.
    replicas = [np.ones(3, np.float32), np.ones(3, np.float32)]
    trainer = Trainer({"w": replicas}, kvcore.optim.Adam(learning_rate=0.01))
    reference = np.ones(3, np.float32)
    updater = kvcore.optim.Updater(kvcore.optim.Adam(learning_rate=0.01, rescale_grad=1 / 4))
    for step in range(3):
        g0, g1 = _f32(1, 2, 3) * (step + 1), _f32(-1, 0, 5)
        trainer.step(4, {"w": [g0.copy(), g1.copy()]})
        updater("w", g0 + g1, reference)
        np.testing.assert_allclose(replicas[0], reference, rtol=1e-6)
        np.testing.assert_array_equal(replicas[0], replicas[1])


@BOTH_MODES
def test_both_modes_give_the_same_weights(update_on_kvstore):
    rng = np.random.default_rng(0)
    start = rng.standard_normal((4, 3)).astype(np.float32)
    grads = [rng.standard_normal((4, 3)).astype(np.float32) for _ in range(5)]

    def train(mode):
        w = start.copy()
        trainer = Trainer({"w": w}, kvcore.optim.SGD(learning_rate=0.05, momentum=0.9), update_on_kvstore=mode)
        for g in grads:
            trainer.step(8, {"w": g.copy()})
        return w

    np.testing.assert_allclose(train(update_on_kvstore), train(not update_on_kvstore), rtol=1e-6)


def test_parameters_carry_their_gradients_as_arrays_or_callables():
    w, gw = _f32(1, 1), _f32(2, 4)
    v, gv = _f32(0, 0), _f32(1, 1)
    trainer = Trainer([Parameter("w", w, grad=gw), Parameter("v", v, grad=lambda: gv)],
                      kvcore.optim.SGD(learning_rate=1.0))
    trainer.step(2)
    np.testing.assert_array_equal(w, _f32(0, -1))
    np.testing.assert_array_equal(v, _f32(-0.5, -0.5))


def test_update_here_leaves_the_summed_gradients_in_every_replicas_gradient():
    grads = [_f32(1, 2), _f32(3, 4)]
    trainer = Trainer({"w": [_f32(0, 0), _f32(0, 0)]}, kvcore.optim.SGD(learning_rate=0.0))
    summed = trainer.allreduce_grads({"w": grads})
    np.testing.assert_array_equal(grads[1], _f32(4, 6))
    assert summed[0][1] is grads[1]
    trainer.update(2, {"w": grads})


def test_sync_params_makes_every_replica_equal_to_the_first():
    replicas = [_f32(1, 2), _f32(7, 7)]
    trainer = Trainer({"w": replicas}, "sgd")
    trainer.sync_params()
    np.testing.assert_array_equal(replicas[1], _f32(1, 2))
    out = np.zeros(2, np.float32)
    trainer.kvstore.pull("w", out=out)
    np.testing.assert_array_equal(out, _f32(1, 2))


def test_update_on_kvstore_defaults_to_true_only_for_dist_stores():
    assert Trainer([_f32(1)], "sgd", kvstore="local").update_on_kvstore is False
    assert Trainer([_f32(1)], "sgd", kvstore=LocalKVStore("device")).update_on_kvstore is False
    assert Trainer([_f32(1)], "sgd", kvstore=LocalKVStore("dist_sync")).update_on_kvstore is True


class _RecordingStore(LocalKVStore):
    """A real local store that also records the priority of each push and pull."""

    def __init__(self):
        super().__init__("local")
        self.calls = []

    def push(self, key, value, priority=0):
        self.calls.append(("push", key, priority))
        return super().push(key, value, priority)

    def pull(self, key, out=None, priority=0, ignore_sparse=True, wait=True):
        self.calls.append(("pull", key, priority))
        return super().pull(key, out, priority, ignore_sparse, wait)


def _pushes_and_pulls(store):
    return ([c[1:] for c in store.calls if c[0] == "push"], [c[1:] for c in store.calls if c[0] == "pull"])


@BOTH_MODES
def test_parameter_i_gets_priority_minus_i_like_mxnet(update_on_kvstore):
    store = _RecordingStore()
    params = {name: _f32(1) for name in ("a", "b", "c")}
    trainer = Trainer(params, "sgd", kvstore=store, update_on_kvstore=update_on_kvstore, coalesce_bytes=0)
    trainer.sync_params()
    store.calls.clear()
    trainer.step(1, {name: _f32(1) for name in params})
    expected = [(["a"], 0), (["b"], -1), (["c"], -2)]
    assert _pushes_and_pulls(store) == (expected, expected)


@BOTH_MODES
def test_small_parameters_travel_together_and_big_ones_alone_in_order(update_on_kvstore):
    store = _RecordingStore()
    params = {"a": _f32(1), "b": _f32(1), "big": np.zeros(100, np.float32), "c": _f32(1), "d": _f32(1, 2, 3)}
    trainer = Trainer(params, "sgd", kvstore=store, update_on_kvstore=update_on_kvstore, coalesce_bytes=12)
    trainer.sync_params()
    store.calls.clear()
    trainer.step(1, {name: np.ones_like(v) for name, v in params.items()})
    expected = [(["a", "b"], 0), (["big"], -2), (["c"], -3), (["d"], -4)]
    assert _pushes_and_pulls(store) == (expected, expected)


def test_missing_and_unknown_gradients_are_named_and_nothing_changes():
    w, v = _f32(1), _f32(2)
    trainer = Trainer({"w": w, "v": v}, kvcore.optim.SGD(learning_rate=1.0))
    with pytest.raises(ValueError, match=r"missing \['v'\], unknown \['x'\]"):
        trainer.step(1, {"w": _f32(1), "x": _f32(1)})
    with pytest.raises(ValueError, match="2 gradients were given for 1 parameters|1 gradients were given for 2"):
        trainer.step(1, [_f32(1)])
    with pytest.raises(ValueError, match=r"'w', 'v' have no gradient"):
        trainer.step(1)
    assert w[0] == 1 and v[0] == 2


def test_a_gradient_of_the_wrong_shape_is_named_before_anything_is_pushed():
    w, v = _f32(1, 1), _f32(2, 2)
    trainer = Trainer({"w": w, "v": v}, kvcore.optim.SGD(learning_rate=1.0), update_on_kvstore=True)
    with pytest.raises(kvcore.ShapeMismatchError, match=r"'v' has shape \(2,\), but its gradient 0 has shape \(3,\)"):
        trainer.step(1, {"w": _f32(1, 1), "v": _f32(1, 1, 1)})
    with pytest.raises(kvcore.DTypeMismatchError, match="'w' has dtype float32, but its gradient 0 has dtype float64"):
        trainer.step(1, {"w": np.ones(2), "v": _f32(1, 1)})
    np.testing.assert_array_equal(w, _f32(1, 1))
    np.testing.assert_array_equal(v, _f32(2, 2))


def test_replica_and_gradient_counts_must_match():
    trainer = Trainer({"w": [_f32(1), _f32(1)]}, "sgd")
    with pytest.raises(ValueError, match="'w' has 2 replicas but 1 gradients were given"):
        trainer.step(1, {"w": [_f32(1)]})


@pytest.mark.parametrize("batch_size", [0, -3, 2.5, True])
def test_step_rejects_a_bad_batch_size(batch_size):
    trainer = Trainer([_f32(1)], "sgd")
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        trainer.step(batch_size, [_f32(1)])


def test_changing_the_batch_size_with_the_optimizer_in_the_store_is_an_error_naming_both():
    trainer = Trainer([_f32(1)], "sgd", update_on_kvstore=True)
    trainer.step(32, [_f32(1)])
    with pytest.raises(ValueError, match="batch_size 30, .* batch_size 32"):
        trainer.step(30, [_f32(1)])


def test_changing_the_batch_size_with_the_optimizer_here_rescales_each_step():
    w = _f32(0)
    trainer = Trainer([w], kvcore.optim.SGD(learning_rate=1.0))
    trainer.step(2, [_f32(1)])
    trainer.step(np.int64(4), [_f32(1)])
    np.testing.assert_allclose(w, _f32(-0.75))


def test_bad_parameters_are_refused_naming_them():
    with pytest.raises(ValueError, match="replica 1 has shape \\(3,\\)"):
        Trainer({"w": [_f32(1, 2), _f32(1, 2, 3)]}, "sgd")
    with pytest.raises(TypeError, match="parameter 'w' must be a numpy or CuPy array"):
        Trainer({"w": [1.0, 2.0]}, "sgd")
    with pytest.raises(ValueError, match="no parameters"):
        Trainer({}, "sgd")
    with pytest.raises(ValueError, match="two parameters are named 'w'"):
        Trainer([Parameter("w", _f32(1)), Parameter("w", _f32(2))], "sgd")
    with pytest.raises(kvcore.OptimizerError, match="unknown optimizer 'nope'"):
        Trainer([_f32(1)], "nope")
    with pytest.raises(kvcore.UnknownStoreError, match="'nowhere'"):
        Trainer([_f32(1)], "sgd", kvstore="nowhere")


def test_allreduce_and_update_refuse_when_the_optimizer_runs_in_the_store():
    trainer = Trainer([_f32(1)], "sgd", update_on_kvstore=True)
    with pytest.raises(ValueError, match="allreduce_grads\\(\\) needs update_on_kvstore=False"):
        trainer.allreduce_grads([_f32(1)])


# ---- PyTorch, through the adapter (skipped when torch is not installed: the `torch` extra) ----------


def _torch_models():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    twin = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    twin.load_state_dict(model.state_dict())
    return torch, model, twin


@BOTH_MODES
def test_torch_model_through_the_adapter_matches_torch_sgd(update_on_kvstore):
    torch, model, twin = _torch_models()
    pointers = [p.data_ptr() for p in model.parameters()]
    trainer = Trainer(model, kvcore.optim.SGD(learning_rate=0.1, momentum=0.9), update_on_kvstore=update_on_kvstore)
    reference = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    for _ in range(3):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
        trainer.step(6)
        reference.zero_grad()
        torch.nn.functional.cross_entropy(twin(x), y).backward()
        reference.step()
    for (name, ours), theirs in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=name)
    # Updated in place: the model's own tensors changed, not copies.
    assert [p.data_ptr() for p in model.parameters()] == pointers
    assert [p.name for p in trainer.params] == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_torch_parameter_without_gradient_is_named():
    torch, model, _ = _torch_models()
    trainer = Trainer(model.named_parameters(), "sgd")
    model.zero_grad(set_to_none=True)
    model[0](torch.randn(2, 5)).sum().backward()  # the last layer gets no gradient
    with pytest.raises(ValueError, match="'2.weight', '2.bias' have no gradient"):
        trainer.step(2)


def test_torch_tensors_and_frozen_parameters():
    torch, model, _ = _torch_models()
    model[0].bias.requires_grad_(False)
    trainer = Trainer(list(model.parameters()), "sgd")
    assert len(trainer.params) == 3
    from kvcore.torch_adapter import tensor_as_array

    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        tensor_as_array(np.zeros(2), "x")
