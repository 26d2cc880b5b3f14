"""Optimizers follow MXNet's update rules, keep state per key, and serialise it."""

import json

import numpy as np
import pytest

from kvcore import optim
from kvcore.errors import OptimizerError

pytestmark = pytest.mark.unit


def step(optimizer, weight, grad, key=0, updater=None):
    updater = updater or optim.Updater(optimizer)
    updater(key, grad.copy(), weight)
    return updater


def test_create_by_name_is_case_insensitive():
    assert isinstance(optim.create("SGD", learning_rate=0.2), optim.SGD)
    assert isinstance(optim.create("adam"), optim.Adam)
    assert isinstance(optim.create("Test"), optim.Test)


def test_create_unknown_optimizer_lists_known_ones():
    with pytest.raises(OptimizerError) as info:
        optim.create("rmsprop_x")
    assert "'rmsprop_x'" in str(info.value) and "sgd" in str(info.value) and "adam" in str(info.value)


def test_sgd_without_momentum_matches_rule():
    w = np.array([1.0, 2.0], np.float32)
    g = np.array([0.5, -1.0], np.float32)
    step(optim.SGD(learning_rate=0.1, wd=0.01, rescale_grad=0.5), w, g)
    expected = np.array([1.0, 2.0]) - 0.1 * (0.5 * np.array([0.5, -1.0]) + 0.01 * np.array([1.0, 2.0]))
    assert np.allclose(w, expected)


def test_sgd_momentum_accumulates_per_key():
    opt = optim.SGD(learning_rate=0.1, momentum=0.9)
    updater = optim.Updater(opt)
    w = np.zeros(2, np.float32)
    other = np.zeros(2, np.float32)
    for _ in range(2):
        updater(0, np.ones(2, np.float32), w)
    updater(1, np.ones(2, np.float32), other)
    assert np.allclose(w, -0.1 - (0.9 * 0.1 + 0.1))
    assert np.allclose(other, -0.1)


def test_sgd_clips_rescaled_gradient():
    w = np.zeros(3, np.float32)
    step(optim.SGD(learning_rate=1.0, clip_gradient=0.5, rescale_grad=2.0), w, np.array([1.0, -0.1, -3.0], np.float32))
    assert np.allclose(w, [-0.5, 0.2, 0.5])


@pytest.mark.parametrize("rescale", [1.0, 0.5, 0.25, 1 / 3, 0.1])
@pytest.mark.parametrize("extra", [{}, {"wd": 0.01}, {"clip_gradient": 0.05}, {"momentum": 0.9}])
def test_sgd_in_place_gives_the_bits_of_the_rule_written_with_temporaries(rescale, extra):
    # The update scales the gradient in place (no temporary the size of the gradient) and folds
    # the rescale into the learning rate when that rounds nothing: every bit must stay as before.
    rng = np.random.default_rng(7)
    w0 = rng.standard_normal(4096).astype(np.float32)
    grads = [rng.standard_normal(4096).astype(np.float32) for _ in range(3)]
    lr, f32 = 0.0123, np.float32
    w, mom = w0.copy(), np.zeros_like(w0)
    for g in grads:
        g = g * f32(rescale)
        if "clip_gradient" in extra:
            g = np.clip(g, -extra["clip_gradient"], extra["clip_gradient"])
        if "wd" in extra:
            g = g + w * f32(extra["wd"])
        if "momentum" in extra:
            mom = mom * f32(0.9) - f32(lr) * g
            w = w + mom
        else:
            w = w - f32(lr) * g
    weight = w0.copy()
    updater = optim.Updater(optim.SGD(learning_rate=lr, rescale_grad=rescale, **extra))
    for g in grads:
        updater(0, g.copy(), weight)
    assert weight.tobytes() == w.tobytes()


def test_adam_first_step_moves_each_weight_by_learning_rate():
    w = np.zeros(3, np.float32)
    step(optim.Adam(learning_rate=0.01), w, np.array([2.0, -3.0, 0.5], np.float32))
    # with bias correction the first step is lr * g / (|g| + eps) = lr * sign(g)
    assert np.allclose(w, [-0.01, 0.01, -0.01], atol=1e-6)


def test_adam_matches_reference_over_several_steps():
    rng = np.random.default_rng(0)
    w = rng.standard_normal(5).astype(np.float64)
    ref = w.copy()
    m = np.zeros(5)
    v = np.zeros(5)
    opt = optim.Adam(learning_rate=0.05, beta1=0.8, beta2=0.9, wd=0.1)
    updater = optim.Updater(opt)
    for t in range(1, 5):
        g = rng.standard_normal(5)
        updater(0, g.copy(), w)
        g = g + 0.1 * ref
        m = 0.8 * m + 0.2 * g
        v = 0.9 * v + 0.1 * g * g
        lr_t = 0.05 * np.sqrt(1 - 0.9**t) / (1 - 0.8**t)
        ref = ref - lr_t * m / (np.sqrt(v) + 1e-8)
    assert np.allclose(w, ref)


def test_lr_scheduler_sets_learning_rate_from_update_count():
    opt = optim.SGD(learning_rate=1.0, lr_scheduler=lambda n: 1.0 / n)
    w = np.zeros(1)
    updater = optim.Updater(opt)
    updater(0, np.ones(1), w)  # lr 1
    updater(0, np.ones(1), w)  # lr 1/2
    assert np.allclose(w, -1.5)


def test_updater_states_round_trip_including_optimizer():
    opt = optim.Adam(learning_rate=0.1)
    updater = optim.Updater(opt)
    w = np.ones(4, np.float32)
    updater("k", np.ones(4, np.float32), w)
    blob = updater.get_states(dump_optimizer=True)

    restored = optim.Updater(optim.SGD())
    restored.set_states(blob)
    assert isinstance(restored.optimizer, optim.Adam)
    w2 = w.copy()
    updater("k", np.full(4, 0.5, np.float32), w)
    restored("k", np.full(4, 0.5, np.float32), w2)
    assert np.allclose(w, w2)


def test_updater_rejects_non_optimizer():
    with pytest.raises(OptimizerError, match="Optimizer instance"):
        optim.Updater("sgd")


def test_user_defined_optimizer_registers_and_is_created_by_name():
    @optim.register
    class HalfStep(optim.Optimizer):
        def update(self, key, weight, grad, state):
            weight -= 0.5 * grad

    w = np.ones(2)
    step(optim.create("halfstep"), w, np.ones(2))
    assert np.allclose(w, 0.5)
    assert "halfstep" in optim.registered_names()


def test_optimizers_pickle_for_shipping():
    import pickle

    opt = pickle.loads(pickle.dumps(optim.SGD(learning_rate=0.3, momentum=0.5)))
    assert opt.learning_rate == 0.3 and opt.momentum == 0.5


@pytest.mark.parametrize("make", [lambda: optim.SGD(learning_rate=0.5), lambda: optim.SGD(learning_rate=0.5, momentum=0.9),
                                  lambda: optim.Adam(learning_rate=0.1)])
def test_updater_state_dict_restores_every_key_so_the_next_steps_match_bit_for_bit(make):
    grads = [np.linspace(-1, 1, 6, dtype=np.float32) * (i + 1) for i in range(4)]
    reference, copy = optim.Updater(make()), optim.Updater(make())
    weights = {k: np.ones(6, np.float32) * (i + 1) for i, k in enumerate(("a", 7))}
    for g in grads[:2]:
        for key, w in weights.items():
            reference(key, g.copy(), w)
    state = reference.state_dict()
    # what the servers write and read back: arrays copied, scalars through JSON
    copy.load_state_dict({"scalars": state["scalars"], "keys": {
        k: {"scalars": json.loads(json.dumps(v["scalars"])), "arrays": [a.copy() for a in v["arrays"]]}
        for k, v in state["keys"].items()}})
    assert copy.optimizer.num_update == reference.optimizer.num_update == 2
    twins = {k: w.copy() for k, w in weights.items()}
    for g in grads[2:]:
        for key in weights:
            reference(key, g.copy(), weights[key])
            copy(key, g.copy(), twins[key])
    assert all(weights[k].tobytes() == twins[k].tobytes() for k in weights)


def test_updater_state_dict_names_the_key_of_a_state_it_cannot_hold():
    updater = optim.Updater(optim.SGD())
    updater.states["k"] = {"not": "supported"}
    with pytest.raises(TypeError, match="the optimizer state of key 'k' holds a dict"):
        updater.state_dict()
