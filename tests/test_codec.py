from __future__ import annotations

import datetime
import gc
import pickle
import struct
from collections import OrderedDict, namedtuple
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpgraph.distributed.codec import DecodeError, UnsupportedTypeError, decode, encode

pytestmark = pytest.mark.timeout(120)


def same(a: Any, b: Any) -> bool:
    """Equal values *and* equal types all the way down (1 == 1.0 == True would hide a bug)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(
            same(a[k], b[k]) and same(k, kb) for k, kb in zip(a, b, strict=True)
        )
    if isinstance(a, float) and a != a:
        return b != b
    return bool(a == b)


scalars = (
    st.none()
    | st.booleans()
    | st.integers()  # unbounded: beyond msgpack's 64 bits too
    | st.integers(min_value=-(1 << 300), max_value=1 << 300)
    | st.floats(allow_nan=True)
    | st.text()
    | st.binary()
)
keys = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.text()
    | st.binary()
    | st.tuples(st.integers(), st.text())
)
data = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(keys, inner, max_size=4)
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(data)
def test_plain_data_round_trips_with_exact_types(obj):
    assert same(decode(encode(obj)), obj)


DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64,
]  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 5), max_size=4),
    transpose=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_tensors_round_trip_on_cpu_contiguous_with_dtype_and_shape(dtype, shape, transpose, seed):
    gen = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=gen) * 50).to(dtype) if shape else torch.tensor(3.5).to(dtype)
    if transpose and t.dim() >= 2:
        t = t.transpose(0, -1)  # non-contiguous
    out = decode(encode({"t": t, "nested": [(t,)]}))
    assert same(out["t"], t) and same(out["nested"][0][0], t)
    assert out["t"].is_contiguous() and out["t"].device.type == "cpu"
    out["t"].add_(
        0
    ) if dtype != torch.bool else None  # decoded memory is writable, not the payload's


def test_bfloat16_bits_survive_exactly():
    t = torch.tensor([1.0, -0.0, float("inf"), 3.14159, 1e-38], dtype=torch.bfloat16)
    out = decode(encode(t))
    assert torch.equal(out.view(torch.int16), t.view(torch.int16))


def test_tensor_that_requires_grad_is_sent_as_data():
    t = torch.ones(2, requires_grad=True) * 2
    out = decode(encode(t))
    assert not out.requires_grad and out.tolist() == t.tolist()


@settings(max_examples=100, deadline=None)
@given(
    dtype=st.sampled_from(["<f4", "<f8", "<i8", "|u1", "?", "<U3", "<c16", "<M8[s]"]),
    shape=st.lists(st.integers(0, 4), max_size=3),
    fortran=st.booleans(),
)
def test_numpy_arrays_and_scalars_round_trip(dtype, shape, fortran):
    a = np.zeros(shape, dtype=dtype, order="F" if fortran else "C")
    a.reshape(-1).view(np.uint8)[:] = np.arange(a.nbytes, dtype=np.uint64).astype(np.uint8) % 7
    out = decode(
        encode([a, a[()] if a.ndim == 0 else a.dtype.type(a.reshape(-1)[0]) if a.size else None])
    )
    assert same(out[0], a) and out[0].flags.writeable
    assert same(
        out[1], [a[()] if a.ndim == 0 else a.dtype.type(a.reshape(-1)[0]) if a.size else None][0]
    )


@pytest.mark.parametrize(
    "value", [0, -1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 7**500, -(7**500)]
)
def test_integers_of_any_size(value):
    out = decode(encode(value))
    assert type(out) is int and out == value


def test_empty_containers_keep_their_types():
    obj = {"l": [], "t": (), "d": {}, "s": "", "b": b"", "nested": ([], ((),), {"": {}})}
    assert same(decode(encode(obj)), obj)


Point = namedtuple("Point", "x y")


class Custom:
    pass


@pytest.mark.parametrize(
    ("obj", "path", "what"),
    [
        ({"stats": [1, 2, 3, {4}]}, 'obj["stats"][3]', "a set"),
        ([1, (2, Custom())], "obj[1][1]", "test_codec.Custom"),
        ({"o": OrderedDict(a=1)}, 'obj["o"]', "collections.OrderedDict"),
        ((Point(1, 2),), "obj[0]", "Point"),
        ({"a": np.array([None, 1])}, 'obj["a"]', "dtype object"),
        ({frozenset({1}): 1}, "obj[frozenset({1})]", "a dict key of type frozenset"),
        ({"s": torch.ones(2).to_sparse()}, 'obj["s"]', "to_dense"),
        ({"m": torch.ones(2, device="meta")}, 'obj["m"]', "meta"),
    ],
)
def test_unsupported_values_are_named_by_path_and_type(obj, path, what):
    with pytest.raises(UnsupportedTypeError) as info:
        encode(obj)
    message = str(info.value)
    assert message.startswith(f"{path} is ") and what in message
    assert 'codec="pickle"' in message


def test_bytearray_and_memoryview_arrive_as_bytes():
    # msgpack packs both as binary natively; documented in the codec's docstring
    assert same(decode(encode([bytearray(b"ab"), memoryview(b"cd")])), [b"ab", b"cd"])


def test_an_object_that_contains_itself_is_refused_clearly():
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(UnsupportedTypeError, match="contains itself"):
        encode(loop)


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_pickle_payload_is_never_unpickled_by_the_data_codec(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"x": Evil(str(marker))})
    assert not marker.exists()
    with pytest.raises(DecodeError):
        decode(payload)
    assert not marker.exists()
    decode(payload, "pickle")  # the same bytes *are* code under the pickle codec
    assert marker.exists()


def framed(body: bytes, buffers: bytes = b"") -> bytes:
    """A data-codec payload built by hand: [u64 body length][msgpack body][array bytes]."""
    return struct.pack("<Q", len(body)) + body + buffers


def tensor_ext(dtype: str, shape: list, offset: int) -> msgpack.ExtType:
    return msgpack.ExtType(1, msgpack.packb([dtype, shape, offset]))


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\x01\x00",  # shorter than the frame
        struct.pack("<Q", 99) + b"\x90",  # body longer than the payload
        framed(b"\xc7\x03\x63abc"),  # extension type 99: unknown
        framed(b"\x92\x01"),  # array of 2 with 1 element
        framed(msgpack.packb(tensor_ext("float32", [4], 0)), bytes(15)),  # 15 of 16 bytes
        framed(msgpack.packb(tensor_ext("float32", [1], -4)), bytes(8)),  # negative offset
        framed(msgpack.packb(tensor_ext("float32", ["x"], 0)), bytes(8)),
        encode(torch.ones(4))[:-3],  # truncated tensor bytes
    ],
)
def test_corrupt_payloads_raise_decode_error(payload):
    with pytest.raises(DecodeError):
        decode(payload)


def test_decoder_refuses_a_dtype_name_it_does_not_know():
    payload = framed(msgpack.packb(tensor_ext("os.system", [1], 0)), b"\0")
    with pytest.raises(DecodeError, match=r"unknown tensor dtype 'os\.system'"):
        decode(payload)


def test_refuses_object_dtype_arrays_in_payloads():
    payload = framed(msgpack.packb(msgpack.ExtType(2, msgpack.packb(["|O", [1], 0]))), bytes(8))
    with pytest.raises(DecodeError, match="refusing numpy dtype"):
        decode(payload)


def test_large_tensors_travel_outside_the_msgpack_body():
    from ddpgraph.distributed.codec import encode_parts

    t = torch.arange(1 << 16, dtype=torch.float32)
    parts = encode_parts({"a": t, "b": (t[:10].to(torch.bfloat16),)})
    assert [len(p) for p in parts[2:]] == [t.nbytes, 20]
    assert len(parts[1]) < 100  # only dtype, shape and offset in the body
    out = decode(b"".join(parts))
    assert torch.equal(out["a"], t) and out["b"][0].dtype == torch.bfloat16


def test_pickle_codec_carries_arbitrary_objects_with_tensors_on_cpu():
    obj = {"set": {1, 2}, "od": OrderedDict(a=torch.arange(3)), "p": Point(1, 2)}
    out = decode(encode(obj, "pickle"), "pickle")
    assert out["set"] == {1, 2} and type(out["od"]) is OrderedDict and out["p"] == Point(1, 2)
    assert torch.equal(out["od"]["a"], torch.arange(3))


def test_unknown_codec():
    with pytest.raises(ValueError, match="codec='json' is not one of"):
        encode(1, "json")


@pytest.mark.parametrize(
    "value", [np.str_(""), np.str_("ab"), np.bytes_(b""), np.float16(1.5), np.bool_(True)]
)
def test_numpy_scalars_of_every_width(value):
    out = decode(encode(value))
    assert type(out) is type(value) and out == value


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.complex32])
def test_exotic_dtypes_keep_their_bits(dtype):
    t = (torch.randn(4, 3) * 4).to(dtype)
    out = decode(encode(t))
    assert out.dtype == dtype and out.shape == t.shape
    assert torch.equal(out.view(torch.uint8), t.view(torch.uint8))


# ---- columns: long lists of floats or ints, and dicts of them, as raw arrays ----

numbers = st.floats(allow_nan=True) | st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1)
column_keys = st.text() | st.integers() | st.tuples(st.integers(), st.text())


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.floats(allow_nan=True), min_size=28, max_size=40)
    | st.lists(st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1), min_size=28, max_size=40)
    | st.lists(st.integers(min_value=-(1 << 31), max_value=(1 << 31) - 1), min_size=28, max_size=40)
    | st.lists(st.integers(), min_size=30, max_size=40)  # beyond 64 bits: no column
    | st.lists(numbers, min_size=30, max_size=40)  # floats and ints mixed: no column
    | st.dictionaries(column_keys, st.floats(allow_nan=True), min_size=28, max_size=40)
    | st.dictionaries(st.text(), st.integers(min_value=-(1 << 40), max_value=1 << 40), min_size=30)
)
def test_long_lists_and_dicts_of_numbers_round_trip_with_exact_types(obj):
    assert same(decode(encode(obj)), obj)
    assert same(decode(encode((obj, [obj, {"in": obj}]))), (obj, [obj, {"in": obj}]))


@pytest.mark.parametrize(
    "keys",
    [
        [f"k{i}" for i in range(40)],
        [f"nul\0{i}" for i in range(40)],  # a NUL inside a key: keys go as a list instead
        ["", *(f"é{i}\ud800" for i in range(39))],  # empty, non-ASCII, a lone surrogate
        [(i, "t") for i in range(40)],
        list(range(40)),
    ],
    ids=["str", "nul", "unicode", "tuple", "int"],
)
def test_dict_columns_keep_every_key_and_its_order(keys):
    obj = {k: float(i) * 1.5 for i, k in enumerate(reversed(keys))}
    assert same(decode(encode(obj)), obj)


def test_columns_carry_eight_bytes_a_float_and_four_an_int_id():
    floats = [i / 7 for i in range(10_000)]
    ids = list(range(10**6, 10**6 + 10_000))
    assert len(encode(floats)) < 8 * 10_000 + 64
    assert len(encode(ids)) < 4 * 10_000 + 64
    assert len(encode({f"k{i}": v for i, v in enumerate(floats)})) < 15 * 10_000


@pytest.mark.parametrize(
    ("low", "high", "width"),
    [
        (-128, 127, 1),
        (-129, 0, 2),
        (0, 128, 2),
        (-32768, 32767, 2),
        (0, 32768, 4),
        (-(1 << 31), 0, 4),
        (0, 1 << 31, 8),
        (-(1 << 63), (1 << 63) - 1, 8),
    ],
)
def test_int_columns_travel_in_the_narrowest_width_that_holds_them(low, high, width):
    values = [low, high] * 50
    assert len(encode(values)) < width * 100 + 64
    assert same(decode(encode(values)), values)
    as_dict = {f"k{i}": v for i, v in enumerate(values)}
    assert same(decode(encode(as_dict)), as_dict)


@pytest.mark.parametrize(
    "values",
    [
        [i % 7 - 3 for i in range(5000)],  # few distinct values: decoded through a table
        [(1 << 62) + i % 3 for i in range(5000)],
        [-(1 << 63), (1 << 63) - 1] * 600 + [0] * 4000,  # two extremes: no table
        list(range(3000)),  # all distinct
    ],
    ids=["labels", "far-labels", "extremes", "distinct"],
)
def test_long_int_columns_come_back_as_exact_ints(values):
    out = decode(encode(values))
    assert out == values and {type(v) for v in out} == {int}


def test_lists_of_records_round_trip_with_their_key_order():
    records = [{"id": i, "pred": i % 10, "score": i / 3} for i in range(5000)]
    records[7] = {"pred": 1, "id": 7, "score": 0.5}  # another key order in one record
    records[9] = {"id": 9, "pred": True, "score": None}
    out = decode(encode(records))
    assert same(out, records)
    assert [list(r) for r in out] == [list(r) for r in records]


def test_a_msgpack_timestamp_from_a_peer_decodes_to_data_only():
    # msgspec, which decodes the body, reads msgpack's timestamp extension as a datetime: a
    # value, no code run; the encoder never writes one
    body = msgpack.packb(msgpack.Timestamp(5, 0))
    assert decode(framed(body, b"")) == datetime.datetime(1970, 1, 1, 0, 0, 5, tzinfo=datetime.UTC)


def column_ext(dtype: str, length: object, offset: int) -> msgpack.ExtType:
    return msgpack.ExtType(6, msgpack.packb([dtype, length, offset]))


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (framed(msgpack.packb(column_ext("|O", 1, 0)), bytes(8)), "unknown column dtype"),
        (framed(msgpack.packb(column_ext("<f4", 2, 0)), bytes(8)), "unknown column dtype"),
        (framed(msgpack.packb(column_ext("<f8", 3, 0)), bytes(16)), "needs bytes 0..24"),
        (framed(msgpack.packb(column_ext("<i8", -1, 0)), bytes(8)), "bad array header"),
        (framed(msgpack.packb(column_ext("<i8", "2", 0)), bytes(16)), "bad column header"),
        (
            framed(msgpack.packb(msgpack.ExtType(6, msgpack.packb(["<f8", 1]))), bytes(8)),
            "bad column header",
        ),
        (
            framed(
                msgpack.packb(
                    msgpack.ExtType(7, msgpack.packb(["a", "b"]) + column_ext("<f8", 1, 0).data)
                ),
                bytes(8),
            ),
            "2 keys for 1 values",
        ),
        (
            framed(
                msgpack.packb(
                    msgpack.ExtType(7, msgpack.packb(b"a\0b\0c") + column_ext("<f8", 2, 0).data)
                ),
                bytes(16),
            ),
            "3 keys for 2 values",
        ),
        (
            framed(
                msgpack.packb(
                    msgpack.ExtType(7, msgpack.packb([[1], [2]]) + column_ext("<f8", 2, 0).data)
                ),
                bytes(16),
            ),
            "unhashable",
        ),
    ],
    ids=[
        "object",
        "float32",
        "short",
        "negative",
        "str-length",
        "two-fields",
        "keys",
        "str-keys",
        "list-keys",
    ],
)
def test_corrupt_columns_raise_decode_error_before_building_anything(payload, message):
    with pytest.raises(DecodeError, match=message):
        decode(payload)


def test_long_bytes_travel_after_the_body_and_come_back_as_bytes():
    from ddpgraph.distributed.codec import encode_parts

    blob = bytes(range(256)) * 1024
    obj = {"blob": blob, "short": b"x" * 10, "nested": [blob[:70_000], (blob,)]}
    parts = encode_parts(obj)
    assert len(parts[1]) < 200  # the body holds only lengths and offsets
    assert same(decode(b"".join(parts)), obj)
    assert same(decode(encode(blob)), blob)


@pytest.mark.parametrize(
    "meta",
    [[5, 0], [4, 5], [-1, 0], ["4", 0], [4], [4, 0, 0]],
    ids=["past-end", "offset-past-end", "negative", "str", "short", "long"],
)
def test_corrupt_raw_bytes_raise_decode_error(meta):
    payload = framed(msgpack.packb(msgpack.ExtType(8, msgpack.packb(meta))), b"abcd")
    with pytest.raises(DecodeError):
        decode(payload)


@pytest.mark.parametrize("was_on", [True, False])
def test_decoding_leaves_the_cycle_collector_as_it_was(was_on):
    (gc.enable if was_on else gc.disable)()
    try:
        assert decode(encode([{"id": i} for i in range(100)]))[99] == {"id": 99}
        with pytest.raises(DecodeError):
            decode(framed(b"\xc1", b""))  # 0xc1 is never valid msgpack
        assert gc.isenabled() is was_on
    finally:
        gc.enable()
