"""The servers' codecs of the schemes beyond MXNet's (fp16, bf16, 1bit_scaled, topk, randomk), and pulls
answered at half width: what a server decodes and merges, what it sends back, and what it refuses
(each refusal answered, naming the value; the server serves on)."""

import numpy as np
import pytest
from psnode_testkit import InProcJob, init_keys

from psnode.compression.codecs import CodecTable, codec_id
from psnode.compression.schemes import HalfScheme, ScaledSignScheme, SparseScheme, from_half, to_half
from psnode.errors import RemoteError, RequestRefused

pytestmark = pytest.mark.unit

F32 = np.dtype(np.float32)


def done(worker, future):
    assert worker.wait_for(future, 10)
    return future.result()


def test_the_new_codecs_have_their_ids_and_decode_what_their_scheme_encodes():
    assert [codec_id(n) for n in ("fp16", "bf16", "1bit_scaled", "topk", "randomk")] == [3, 4, 5, 6, 7]
    table = CodecTable()
    table.configure(codec_id("1bit_scaled"), {"block": 100})
    table.configure(codec_id("topk"), {"ratio": 0.1})
    table.configure(codec_id("randomk"), {"ratio": 0.1})
    grad = np.random.default_rng(0).standard_normal(1001).astype(np.float32)
    for scheme in (HalfScheme("fp16"), HalfScheme("bf16"), ScaledSignScheme(100), SparseScheme("topk", 0.1),
                   SparseScheme("randomk", 0.1)):
        data = scheme.encode(grad, np.zeros_like(grad) if scheme.keeps_residual else None)
        codec = table.get(codec_id(scheme.name))
        assert codec.encoded_nbytes(grad.size, F32) == data.nbytes
        assert np.array_equal(table.decode(codec.id, data.tobytes(), F32, grad.size), scheme.decode(data, size=grad.size))


@pytest.mark.parametrize("name, params, words", [
    ("topk", {"ratio": 0}, "ratio is the fraction of values sent, in \\(0, 1\\], got 0"),
    ("randomk", {"ratio": 1.5}, "got 1.5"),
    ("topk", {}, "cannot use the parameters \\{\\}"),
    ("1bit_scaled", {"block": -3}, "got -3"),
    ("1bit_scaled", {"block": 2.5}, "block must be an integer, got 2.5"),
    ("fp16", {"ratio": 0.1}, "it takes none, got \\['ratio'\\]"),
])
def test_bad_codec_parameters_are_refused_naming_them(name, params, words):
    with pytest.raises(RequestRefused, match=words):
        CodecTable().configure(codec_id(name), params)


def test_a_sparse_push_before_its_ratio_or_with_a_forged_index_is_refused_in_the_codecs_terms():
    table = CodecTable()
    with pytest.raises(RequestRefused, match="a topk push arrived before the compression parameters"):
        table.decode(codec_id("topk"), bytes(8), F32, 10)
    table.configure(codec_id("topk"), {"ratio": 0.1})
    forged = np.array([99], np.uint32).tobytes() + np.ones(1, np.float32).tobytes()
    with pytest.raises(RequestRefused, match="a topk push that does not decode: topk data names index 99 of a value of 10"):
        table.decode(codec_id("topk"), forged, F32, 10)
    with pytest.raises(RequestRefused, match="fp16 pushes carry float32 values, but the key holds int32"):
        table.decode(codec_id("fp16"), bytes(20), np.dtype(np.int32), 10)


def test_pushes_in_each_new_codec_merge_in_float32_and_pulls_come_at_half_width_when_asked():
    n = 5000
    with InProcJob(num_workers=2, num_servers=1) as job:
        init_keys(job, {5: (0, np.zeros(n, np.float32))})
        first = job.workers[0]
        done(first, first.set_codec(codec_id("topk"), {"ratio": 0.01}))
        rng = np.random.default_rng(1)
        for name in ("fp16", "topk", "bf16"):
            scheme = HalfScheme(name) if name != "topk" else SparseScheme("topk", 0.01)
            expected = np.zeros(n, np.float32)
            for worker in job.workers:
                grad = rng.standard_normal(n).astype(np.float32)
                data = scheme.encode(grad, np.zeros(n, np.float32) if scheme.keeps_residual else None)
                expected += scheme.decode(data, size=n)
                done(worker, worker.push([(0, 5, data)], codec=codec_id(name)))
            for pull_codec in ("fp16", "bf16"):
                bits = np.empty(n, np.uint16)
                done(first, first.pull([(0, 5, bits)], codecs=[codec_id(pull_codec)]))
                assert bits.tobytes() == to_half(pull_codec, expected).tobytes()
                assert np.array_equal(from_half(pull_codec, bits), from_half(pull_codec, to_half(pull_codec, expected)))
            out = np.empty(n, np.float32)
            done(first, first.pull([(0, 5, out)]))
            assert out.tobytes() == expected.tobytes()  # a raw pull beside them: the full width


def test_a_pull_of_many_keys_some_at_half_width_and_some_raw_answers_each_in_its_own_form():
    keys = {k: (k % 2, np.arange(k, k + 40 * k, dtype=np.float32) / 3) for k in range(1, 21)}
    keys[21] = (0, np.arange(5, dtype=np.int32))  # another dtype: raw
    keys[22] = (1, np.linspace(0, 1, 100_000, dtype=np.float32))  # a big value: a frame of its own
    with InProcJob(num_workers=1, num_servers=2) as job:
        init_keys(job, keys)
        worker = job.workers[0]
        parts, codecs, outs = [], [], {}
        for key, (server, value) in keys.items():
            half = value.dtype == np.float32 and key % 3 != 0
            out = np.empty(value.size, np.uint16 if half else value.dtype)
            outs[key] = (out, half)
            parts.append((server, key, out))
            codecs.append(codec_id("bf16") if half else 0)
        done(worker, worker.pull(parts, codecs=codecs))
        for key, (out, half) in outs.items():
            value = keys[key][1]
            assert out.tobytes() == (to_half("bf16", value) if half else value).tobytes(), key


@pytest.mark.parametrize("key, codec, nbytes, words", [
    (5, "topk", 8, "a pull asked for its reply in topk, which encodes pushes only"),
    (6, "fp16", 8, "but the key holds int32; only float32 keys travel at half width"),
    (5, "fp16", 6, "a fp16 pull of 6 bytes, but the 4 values held here take 8 bytes in fp16"),
    (5, 77, 8, "unknown codec 77"),
])
def test_a_pull_in_a_codec_the_server_cannot_answer_in_is_refused_naming_why_and_the_server_serves_on(
        key, codec, nbytes, words):
    with InProcJob(num_workers=1, num_servers=1) as job:
        init_keys(job, {5: (0, np.ones(4, np.float32)), 6: (0, np.ones(4, np.int32))})
        worker = job.workers[0]
        future = worker.pull([(0, key, np.empty(nbytes, np.uint8))], codecs=[codec if isinstance(codec, int) else codec_id(codec)])
        with pytest.raises(RemoteError, match=words):
            done(worker, future)
        out = np.empty(4, np.uint16)
        done(worker, worker.pull([(0, 5, out)], codecs=[codec_id("fp16")]))
        assert out.view(np.float16).tolist() == [1.0] * 4
