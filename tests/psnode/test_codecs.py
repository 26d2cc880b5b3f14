"""The codec seam: a push record names its codec, the server decodes through the table before the round."""

import numpy as np
import pytest
from psnode_testkit import InProcJob, init_keys

from psnode.codecs import RAW, Codec, CodecTable, register_codec
from psnode.errors import RemoteError, RequestRefused


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
    with pytest.raises(RequestRefused, match=r"unknown codec 7; the codecs are raw \(0\), .*half \(900\)"):
        table.get(7)


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
