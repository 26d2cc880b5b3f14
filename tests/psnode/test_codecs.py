"""The codec seam: a push record names its codec, the server decodes through the table before the round;
the 2bit and 1bit codecs and the parameters (``SET_CODEC``) they need first."""

import numpy as np
import pytest
from psnode_testkit import InProcJob, init_keys

from psnode.compression import dequantize, quantize
from psnode.compression.codecs import RAW, Codec, CodecTable, codec_id, register_codec
from psnode.errors import RemoteError, RequestRefused

pytestmark = pytest.mark.unit


class HalfCodec(Codec):
    """float32 values sent as float16: a codec a test can check by hand."""

    id = 900
    name = "half"

    def encoded_nbytes(self, count, dtype):
        return 2 * count

    def decode(self, data, dtype, count):
        return np.frombuffer(data, np.float16, count).astype(dtype)


register_codec(HalfCodec)


def test_the_table_decodes_raw_as_a_view_and_refuses_unknown_codecs_naming_the_known_ones():
    table = CodecTable()
    data = np.arange(3, dtype=np.float32).tobytes()
    view = table.decode(RAW, data, np.dtype(np.float32), 3)
    assert view.tolist() == [0, 1, 2] and not view.flags.owndata
    with pytest.raises(RequestRefused, match=r"unknown codec 77; the codecs are raw \(0\), .*half \(900\)"):
        table.get(77)


def test_a_codec_id_taken_by_another_codec_is_refused():
    class Other(HalfCodec):
        name = "other"

    with pytest.raises(ValueError, match="codec id 900 is taken by 'half'"):
        register_codec(Other)


def test_pushes_in_a_codec_are_decoded_before_the_round_and_sum_exactly():
    with InProcJob(num_workers=2, num_servers=1) as job:
        init_keys(job, {5: (0, np.zeros(4, np.float32))})
        for worker in job.workers:
            value = np.full(4, 0.5 + worker.rank, np.float32)
            future = worker.push([(0, 5, value.astype(np.float16).view(np.uint8))], codec=HalfCodec.id)
            assert worker.wait_for(future, 10)
            future.result()
        out = np.zeros(4, np.float32)
        future = job.workers[0].pull([(0, 5, out)])
        assert job.workers[0].wait_for(future, 10)
        future.result()
        assert out.tolist() == [2.0] * 4  # 0.5 + 1.5


def test_a_push_whose_bytes_do_not_encode_the_keys_size_is_refused_in_the_codecs_terms():
    with InProcJob(num_workers=1, num_servers=1) as job:
        init_keys(job, {5: (0, np.zeros(4, np.float32))})
        worker = job.workers[0]
        future = worker.push([(0, 5, np.zeros(6, np.uint8))], codec=HalfCodec.id)
        assert worker.wait_for(future, 10)
        with pytest.raises(RemoteError, match=r"a half push of 6 bytes, but the 4 values held here take 8 bytes in half"):
            future.result()


# ---- the 2bit and 1bit codecs ----------------------------------------------------------------------

F32 = np.dtype(np.float32)


def configured(name, threshold):
    table = CodecTable()
    table.configure(codec_id(name), {"threshold": threshold})
    return table


def test_2bit_decodes_codes_11_10_00_01_to_plus_t_minus_t_and_zero_in_packing_order():
    table = configured("2bit", 0.25)
    # byte 0 holds elements 0-3 from bits 7-6 down: 11 10 00 01; byte 1: 10 11 11 00; padding zero
    packed = bytes([0b11100001, 0b10111100, 0, 0])
    values = table.decode(codec_id("2bit"), packed, F32, 7)
    assert values.tolist() == [0.25, -0.25, 0, 0, -0.25, 0.25, 0.25]
    assert table.get(codec_id("2bit")).encoded_nbytes(17, F32) == 8  # ceil(17 / 16) words


def test_1bit_decodes_bits_to_plus_or_minus_one_most_significant_first():
    table = configured("1bit", 0)
    values = table.decode(codec_id("1bit"), bytes([0b10110000, 0, 0, 0]), F32, 5)
    assert values.tolist() == [1, -1, 1, 1, -1]
    assert table.get(codec_id("1bit")).encoded_nbytes(33, F32) == 8


def test_codecs_are_found_by_name_and_an_unknown_name_lists_the_known_ones():
    assert (codec_id("raw"), codec_id("2bit"), codec_id("1bit")) == (0, 1, 2)
    with pytest.raises(ValueError, match=r"no codec is called '3bit'; the codecs are raw \(0\), 2bit \(1\), 1bit \(2\)"):
        codec_id("3bit")


@pytest.mark.parametrize(
    "name, params, words",
    [
        ("2bit", {"threshold": 0}, "threshold must be greater than 0, got 0"),
        ("2bit", {"threshold": -0.5}, "threshold must be greater than 0, got -0.5"),
        ("2bit", {"threshold": float("nan")}, "must be a finite number, got nan"),
        ("1bit", {"threshold": 1e39}, "must be a finite number, got 1e\\+39"),  # past float32's range
        ("2bit", {"threshold": "0.5"}, "threshold must be a number, got '0.5'"),
        ("2bit", {"threshold": True}, "threshold must be a number, got True"),
        ("2bit", {}, "needs a threshold, got the parameters \\[\\]"),
    ],
)
def test_a_bad_threshold_is_refused_naming_it(name, params, words):
    with pytest.raises(RequestRefused, match=words):
        CodecTable().configure(codec_id(name), params)


def test_a_compressed_push_before_its_parameters_or_of_a_non_float32_key_is_refused():
    table = CodecTable()
    with pytest.raises(RequestRefused, match="a 2bit push arrived before the compression parameters"):
        table.decode(codec_id("2bit"), bytes(4), F32, 3)
    table.configure(codec_id("2bit"), {"threshold": 0.5})
    with pytest.raises(RequestRefused, match="2bit pushes carry float32 values, but the key holds float16"):
        table.decode(codec_id("2bit"), bytes(4), np.dtype(np.float16), 3)


def quantized(kind, grad, residual, threshold):
    return quantize(kind, np.asarray(grad, np.float32), residual, threshold)


def test_set_codec_reaches_every_server_and_compressed_pushes_sum_exactly_in_float32():
    two_bit = codec_id("2bit")
    n = 40  # whole words and a padded last one
    with InProcJob(num_workers=3, num_servers=2) as job:
        init_keys(job, {5: (0, np.zeros(n, np.float32)), 6: (1, np.zeros(n, np.float32))})
        first = job.workers[0]
        future = first.set_codec(two_bit, {"threshold": 0.5})
        assert first.wait_for(future, 10)
        future.result()
        assert [s.codecs.get(two_bit).threshold for s in job.servers] == [np.float32(0.5)] * 2
        rng = np.random.default_rng(3)
        residuals = {(w, k): np.zeros(n, np.float32) for w in range(3) for k in (5, 6)}
        for _ in range(3):  # residuals carry over rounds
            expected = {}
            for worker in job.workers:
                parts = []
                for key, server in ((5, 0), (6, 1)):
                    grad = rng.uniform(-1.5, 1.5, n).astype(np.float32)
                    packed = quantized("2bit", grad, residuals[(worker.rank, key)], 0.5)
                    value = dequantize("2bit", packed, 0.5, size=n)
                    expected[key] = value if key not in expected else (expected[key] + value).astype(np.float32)
                    parts.append((server, key, packed))
                future = worker.push(parts, codec=two_bit)
                assert worker.wait_for(future, 10)
                future.result()
            for key, server in ((5, 0), (6, 1)):
                out = np.zeros(n, np.float32)
                future = first.pull([(server, key, out)])
                assert first.wait_for(future, 10)
                future.result()
                assert out.tobytes() == expected[key].tobytes()


def test_a_malformed_or_refused_set_codec_gets_an_error_reply_naming_the_value():
    with InProcJob(num_workers=1, num_servers=2) as job:
        worker = job.workers[0]
        future = worker.set_codec(codec_id("2bit"), {"threshold": -1.5})
        assert worker.wait_for(future, 10)
        with pytest.raises(RemoteError, match="threshold must be greater than 0, got -1.5"):
            future.result()
        future = worker.set_codec(77, {"threshold": 0.5})
        assert worker.wait_for(future, 10)
        with pytest.raises(RemoteError, match=r"unknown codec 77; the codecs are raw \(0\), 2bit \(1\)"):
            future.result()
        future = worker.set_codec(codec_id("2bit"), {"threshold": [0.5]})
        assert worker.wait_for(future, 10)
        with pytest.raises(RemoteError, match=r"SET_CODEC parameter 'threshold' = '\[0.5\]' is not a short number"):
            future.result()
        # the servers still serve: a good one goes through afterwards
        future = worker.set_codec(codec_id("2bit"), {"threshold": 0.5})
        assert worker.wait_for(future, 10)
        future.result()


def test_the_size_of_a_compressed_push_is_checked_against_the_decoded_size():
    with InProcJob(num_workers=1, num_servers=1) as job:
        init_keys(job, {5: (0, np.zeros(17, np.float32))})
        worker = job.workers[0]
        future = worker.set_codec(codec_id("2bit"), {"threshold": 0.5})
        assert worker.wait_for(future, 10)
        future = worker.push([(0, 5, np.zeros(4, np.uint8))], codec=codec_id("2bit"))  # one word: 16 values
        assert worker.wait_for(future, 10)
        with pytest.raises(RemoteError, match=r"a 2bit push of 4 bytes, but the 17 values held here take 8 bytes in 2bit"):
            future.result()


@pytest.mark.parametrize("codec, words", [(codec_id("2bit"), "a 2bit push arrived before the compression parameters"),
                                          (77, "unknown codec 77")])
def test_a_push_the_server_cannot_decode_is_refused_and_later_pulls_do_not_wait_for_it(codec, words):
    with InProcJob(num_workers=1, num_servers=1) as job:
        init_keys(job, {5: (0, np.ones(16, np.float32))})
        worker = job.workers[0]
        future = worker.push([(0, 5, np.zeros(4, np.uint8))], codec=codec)
        assert worker.wait_for(future, 10)
        with pytest.raises(RemoteError, match=words):
            future.result()
        out = np.zeros(16, np.float32)
        future = worker.pull([(0, 5, out)])  # it must include this worker's one push, which was refused
        assert worker.wait_for(future, 10), "the pull waited for a push the server refused"
        future.result()
        assert out.tolist() == [1.0] * 16
