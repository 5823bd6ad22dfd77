"""Turn Python objects into bytes and back for the object collectives.

Two codecs:

* ``"data"`` (the default): msgpack, with extension types for torch tensors, numpy arrays and
  numpy scalars, integers beyond 64 bits and tuples. It carries None, bool, int, float, str,
  bytes, list, tuple and dict (keys of those types) plus tensors and arrays, and nothing else:
  decoding runs no code named by the sender, so a malicious or corrupt peer can at worst make
  decoding fail. Tensors come back on the CPU (whatever device they left from), contiguous,
  with their dtype (bfloat16 and the float8 types included) and shape. ``bytearray`` and
  ``memoryview`` arrive as ``bytes``; numpy scalars as numpy scalars.
* ``"pickle"``: any picklable object. **Security warning:** unpickling runs code chosen by the
  sender; use it only when every rank is trusted (your own job's ranks). Tensors inside are
  still loaded on the CPU.

Type checks are exact (``type(x) is dict``, not ``isinstance``): a subclass such as
``OrderedDict`` or a named tuple would not come back as itself, so it is refused with its path
rather than silently changed.
"""

from __future__ import annotations

import gc
import io
import json
import pickle
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import chain
from typing import Any

import msgpack
import msgspec
import numpy as np
import torch

__all__ = ["CODECS", "DecodeError", "UnsupportedTypeError", "decode", "encode", "encode_parts"]

# The codec ids travel in every collective header, so they must never be renumbered.
CODECS: dict[str, int] = {"data": 1, "pickle": 2}

# Extension type codes of the data codec (msgpack allows 0..127). Never renumber these either.
_EXT_TENSOR = 1
_EXT_NDARRAY = 2
_EXT_NPSCALAR = 3
_EXT_BIGINT = 4
_EXT_TUPLE = 5
_EXT_COLUMN = 6  # a list of floats, or of ints, as one little-endian array
_EXT_DICT_COLUMN = 7  # a dict whose values are all floats, or all ints: keys, then the array
_EXT_BYTES = 8  # a long bytes value, its bytes after the body

# Lists and dicts at least this long whose items (values) are all floats, or all ints, travel as
# one array of raw bytes after the body (decoded at C speed by numpy's tolist) instead of one
# msgpack value each: unpacking 60,000 str -> float entries took msgpack ~2x pickle's time, the
# array half of it. Shorter ones are not worth the check.
_COLUMN_MIN = 32
# the only dtypes a column names: decoded through this table, never through np.dtype(name)
_COLUMN_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name) for name in ("<f8", "|i1", "<i2", "<i4", "<i8")
}
# an int column travels in the narrowest of these that holds its values (labels: one byte each)
_LOOKUP_MIN = 1024  # int columns at least this long may decode through a table (_few_distinct)
_INT_WIDTHS = [np.dtype(name) for name in ("|i1", "<i2", "<i4")]
_COLUMN_DEPTH = 100  # nesting levels searched for columns
# bytes values at least this long travel after the body too: msgpack would copy them into its
# own growing buffer first (the walk that finds columns finds them)
_RAW_BYTES_MIN = 1 << 16
_WALKED = (list, dict, bytes)
_WALK_BUDGET = 4096

# Decoding maps names to dtypes through this table only: a payload cannot name anything else.
_TORCH_DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}
_FRAME = struct.Struct("<Q")  # length of the msgpack body, in front of the array bytes

_PICKLE_HINT = (
    'pass codec="pickle" to send arbitrary objects (only between trusted ranks: unpickling runs '
    "code the sender chooses)"
)


class UnsupportedTypeError(TypeError):
    """An object holds a value the data codec cannot carry; the message names its path and type."""


class DecodeError(ValueError):
    """A payload is not valid for its codec (corrupt, truncated, or from a mismatched sender)."""


def encode(obj: Any, codec: str = "data") -> bytes:
    """Serialize ``obj`` with ``codec`` ("data" or "pickle"); raise with the path of a bad value."""
    return b"".join(encode_parts(obj, codec))


def encode_parts(obj: Any, codec: str = "data") -> list[bytes | memoryview]:
    """:func:`encode` as pieces to be concatenated, without copying tensor or array data.

    The pieces may be views of the tensors' own memory: copy them out before those change.
    """
    if codec == "data":
        return _Encoder().encode(obj)
    if codec == "pickle":
        return [_encode_pickle(obj)]
    raise ValueError(f"codec={codec!r} is not one of {sorted(CODECS)}")


def decode(payload: bytes | memoryview, codec: str = "data") -> Any:
    """Inverse of :func:`encode`. Tensors are returned on the CPU. Raises :class:`DecodeError`."""
    if codec == "data":
        return _decode_data(memoryview(payload))
    if codec == "pickle":
        return _decode_pickle(payload)
    raise ValueError(f"codec={codec!r} is not one of {sorted(CODECS)}")


# ---- data codec: encoding ----
#
# A data payload is  [u64 length of the msgpack body][msgpack body][array bytes…]. Tensors and
# arrays leave only (dtype, shape, offset) in the body; their bytes follow it, so that a 64 MB
# tensor is copied once into the send buffer and once out of the receive buffer, instead of
# through msgpack's buffers several times. Long lists of floats or ints (and dicts of them)
# travel the same way, as columns (see _COLUMN_MIN): msgpack never calls back for a list or a
# dict, so a walk over the lists and dicts finds them first (_Encoder.columns).


class _Encoder:
    def __init__(self) -> None:
        self.buffers: list[memoryview] = []
        self.offset = 0  # where the next buffer starts, after the body
        # items the walk for columns may visit one by one in Python (~0.3-1 us each): a list
        # of 100,000 small records is left to msgpack rather than walked for nothing
        self.budget = _WALK_BUDGET

    def encode(self, obj: Any) -> list[bytes | memoryview]:
        try:
            body = self.pack(self.columns(obj))
        except (TypeError, ValueError, OverflowError) as exc:
            raise _unsupported(obj, exc) from None
        return [_FRAME.pack(len(body)), body, *self.buffers]

    def pack(self, obj: Any) -> bytes:
        # strict_types: a tuple, an int subclass or an OrderedDict reaches default() instead of
        # being silently turned into a list / int / dict.
        packed: bytes = msgpack.packb(
            obj, default=self.default, strict_types=True, use_bin_type=True
        )
        return packed

    def default(self, obj: Any) -> msgpack.ExtType:
        """msgpack calls this for every value it has no native (strict) type for."""
        kind = type(obj)
        if kind is int:  # msgpack handles -2**63 .. 2**64-1 itself and calls us beyond that
            return msgpack.ExtType(_EXT_BIGINT, _int_to_bytes(obj))
        if kind is tuple:
            return msgpack.ExtType(_EXT_TUPLE, self.pack(self.columns(list(obj))))
        if isinstance(obj, torch.Tensor):
            problem = _tensor_problem(obj)
            if problem:
                raise UnsupportedTypeError(problem)
            return self.array(
                _EXT_TENSOR, str(obj.dtype).removeprefix("torch."), obj.shape, _tensor_bytes(obj)
            )
        if kind is np.ndarray:
            problem = _dtype_problem(obj.dtype)
            if problem:
                raise UnsupportedTypeError(problem)
            return self.array(_EXT_NDARRAY, obj.dtype.str, obj.shape, _array_bytes(obj))
        if isinstance(obj, np.generic) and _dtype_problem(obj.dtype) is None:
            # the array's dtype, not the scalar's: np.str_("") has dtype <U0 but 4 bytes
            array = np.asarray(obj)
            raw = bytes(_array_bytes(array))
            return msgpack.ExtType(_EXT_NPSCALAR, self.pack([array.dtype.str, raw]))
        raise UnsupportedTypeError(f"type {kind.__module__}.{kind.__qualname__}")

    def columns(self, obj: Any, depth: int = 0) -> Any:
        """``obj`` with its long lists of floats or ints (and dicts of them) replaced by column
        extensions and its long bytes values by raw-bytes extensions; containers that hold
        none are returned as they are, not copied. Deeper than _COLUMN_DEPTH it leaves things
        as they are (msgpack refuses what nests itself)."""
        kind = type(obj)
        if depth > _COLUMN_DEPTH or kind not in _WALKED:
            return obj
        if kind is bytes:
            return obj if len(obj) < _RAW_BYTES_MIN else self.raw_bytes(obj)
        if kind is list:
            column = self.column(obj) if len(obj) >= _COLUMN_MIN else None
            return column if column is not None else self.descend(obj, obj, depth)
        column = self.column(obj.values()) if len(obj) >= _COLUMN_MIN else None
        if column is not None:
            return msgpack.ExtType(_EXT_DICT_COLUMN, self.keys(obj) + column.data)
        values = self.descend(obj.values(), None, depth)
        return obj if values is None else dict(zip(obj, values, strict=True))

    def raw_bytes(self, value: bytes) -> msgpack.ExtType:
        meta = self.pack([len(value), self.offset])
        self.buffers.append(memoryview(value))
        self.offset += len(value)
        return msgpack.ExtType(_EXT_BYTES, meta)

    def keys(self, obj: dict[Any, Any]) -> bytes:
        """A dict column's keys: str keys as one UTF-8 text joined by NUL (split at C speed on
        the way back; msgpack makes one object per key), other keys as a list."""
        if set(map(type, obj)) == {str}:
            joined = "\0".join(obj)
            if joined.count("\0") == len(obj) - 1:  # no key holds a NUL itself
                return self.pack(joined.encode("utf-8", "surrogatepass"))
        return self.pack(list(obj))

    def descend(self, items: Any, unchanged: Any, depth: int) -> Any:
        """The items with columns() applied, or ``unchanged`` if none is walked further, or
        if the walk's budget is spent (then msgpack packs them one by one, as it would)."""
        if set(_WALKED).isdisjoint(map(type, items)) or len(items) > self.budget:
            return unchanged
        if _flat_records(items):
            return unchanged
        self.budget -= len(items)
        return [self.columns(x, depth + 1) for x in items]

    def column(self, items: Any) -> msgpack.ExtType | None:
        """The items as one array (a column extension), if they are all floats or all ints
        that fit in 64 bits; else None."""
        kind = type(next(iter(items)))
        # the exact type of every item, at C speed (a set of the types costs twice this)
        if kind not in (float, int) or list(map(type, items)).count(kind) != len(items):
            return None
        if kind is float:
            array = np.fromiter(items, dtype=np.float64, count=len(items))
        else:
            try:
                array = np.fromiter(items, dtype=np.int64, count=len(items))
            except OverflowError:
                return None
            array = _narrowest(array)
        array = array.astype(array.dtype.newbyteorder("<"), copy=False)
        meta = self.pack([array.dtype.str, len(array), self.offset])
        raw = array.view(np.uint8).data
        self.buffers.append(raw)
        self.offset += raw.nbytes
        return msgpack.ExtType(_EXT_COLUMN, meta)

    def array(self, code: int, dtype: str, shape: Any, raw: memoryview) -> msgpack.ExtType:
        meta = self.pack([dtype, list(shape), self.offset])
        self.buffers.append(raw)
        self.offset += raw.nbytes
        return msgpack.ExtType(code, meta)


def _flat_records(items: Any) -> bool:
    """Whether the items are all short dicts of values the walk leaves alone (records such as
    ``{"id", "pred", "score"}``): found at C speed, ~5x cheaper than visiting each."""
    if list(map(type, items)).count(dict) != len(items) or max(map(len, items)) >= _COLUMN_MIN:
        return False
    return set(_WALKED).isdisjoint(map(type, chain.from_iterable(map(dict.values, items))))


def _narrowest(array: np.ndarray) -> np.ndarray:
    """An int64 array in the narrowest int dtype that holds its values: fewer bytes to move."""
    low, high = int(array.min()), int(array.max())
    for dtype in _INT_WIDTHS:
        info = np.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return array.astype(dtype)
    return array


def _unsupported(obj: Any, exc: Exception) -> UnsupportedTypeError:
    where = _find_unsupported(obj, "obj", set(), 0)
    if where is None:
        return UnsupportedTypeError(f'codec="data" cannot encode the object: {exc}')
    path, what = where
    return UnsupportedTypeError(
        f'{path} is {what}, which codec="data" cannot send; convert it to None, bool, int, '
        "float, str, bytes, list, tuple, dict, a torch.Tensor or a numpy array, or "
        f"{_PICKLE_HINT}."
    )


def _int_to_bytes(value: int) -> bytes:
    return value.to_bytes(value.bit_length() // 8 + 1, "little", signed=True)


def _tensor_problem(t: torch.Tensor) -> str | None:
    if t.layout != torch.strided:
        return (
            f"a tensor with layout {t.layout} (only dense tensors are supported; call .to_dense())"
        )
    if t.is_quantized:
        return "a quantized tensor (call .dequantize() first)"
    if t.device.type == "meta":
        return "a tensor on the meta device (it has no data)"
    if str(t.dtype).removeprefix("torch.") not in _TORCH_DTYPES:
        return f"a tensor of dtype {t.dtype}"
    return None


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    # .cpu() copies from the tensor's own device (no new CUDA context: it already lives there);
    # viewing as bytes carries every dtype, bfloat16 included, which numpy cannot represent.
    flat = t.detach().cpu().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data


def _dtype_problem(dtype: np.dtype) -> str | None:
    if dtype.hasobject or dtype.fields is not None:
        return f"a numpy array of dtype {dtype} (object and structured dtypes are not supported)"
    return None


def _array_bytes(a: np.ndarray) -> memoryview:
    if not a.flags.c_contiguous:
        a = a.copy(order="C")  # not np.ascontiguousarray: it turns a 0-d array into shape (1,)
    return a.reshape(-1).view(np.uint8).data


def _find_unsupported(obj: Any, path: str, seen: set[int], depth: int) -> tuple[str, str] | None:
    """The path and description of the first value the data codec refuses, walking like msgpack."""
    kind = type(obj)
    if obj is None or kind in (bool, int, float, str, bytes):
        return None
    if depth > 500 or id(obj) in seen:
        return path, "nested too deeply (or contains itself)"
    if kind in (list, tuple):
        seen.add(id(obj))
        for i, item in enumerate(obj):
            found = _find_unsupported(item, f"{path}[{i}]", seen, depth + 1)
            if found:
                return found
        return None
    if kind is dict:
        seen.add(id(obj))
        for key, value in obj.items():
            key_path = f"{path}[{_key_text(key)}]"
            if _find_unsupported(key, "", seen, depth + 1) is not None:
                return key_path, f"a dict key of type {type(key).__qualname__}"
            found = _find_unsupported(value, key_path, seen, depth + 1)
            if found:
                return found
        return None
    if isinstance(obj, torch.Tensor):
        problem = _tensor_problem(obj)
        return (path, problem) if problem else None
    if kind is np.ndarray:
        problem = _dtype_problem(obj.dtype)
        return (path, problem) if problem else None
    if isinstance(obj, np.generic) and _dtype_problem(obj.dtype) is None:
        return None
    return path, f"a {kind.__module__}.{kind.__qualname__}".replace("builtins.", "")


def _key_text(key: Any) -> str:
    return json.dumps(key) if type(key) is str else repr(key)


# ---- data codec: decoding ----


def _decode_data(payload: memoryview) -> Any:
    try:
        (body_len,) = _FRAME.unpack_from(payload)
        body_end = _FRAME.size + body_len
        if body_end > len(payload):
            raise DecodeError(f"body of {body_len} bytes in a payload of {len(payload)}")
        with _collector_paused():
            return _Decoder(payload[body_end:]).unpack(payload[_FRAME.size : body_end])
    except DecodeError as exc:
        raise DecodeError(f"not a valid data-codec payload ({exc})") from None
    except Exception as exc:  # msgpack raises several types (ExtraData, FormatError, ValueError…)
        raise DecodeError(f"not a valid data-codec payload ({type(exc).__name__}: {exc})") from None


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cycle collector off while a payload is decoded: decoding only creates objects
    (none becomes garbage), yet each few hundred new dicts start a collection, and msgspec's
    dicts make those ~2x more costly than pickle's (measured: two decodes of 1e5 records 244 ms
    with the collector on, 100 ms with it off; pickle 147 / 110). msgpack's docs advise the
    same for large payloads. It is turned back on only if it was on."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


class _Decoder:
    def __init__(self, buffers: memoryview) -> None:
        self.buffers = buffers  # the array bytes that follow the body
        # msgspec's decoder reads the bodies msgpack's packer writes: it builds the same plain
        # values (never a class a payload names) and reuses the str of short repeated dict keys,
        # so a list of records decodes ~1.5x faster than with msgpack's unpacker (as fast as
        # pickle's C loop); extension values still come through ext_hook.
        self.decoder = msgspec.msgpack.Decoder(ext_hook=self.ext_hook)

    def unpack(self, body: memoryview | bytes) -> Any:
        return self.decoder.decode(body)

    def ext_hook(self, code: int, data: bytes | memoryview) -> Any:
        if code == _EXT_BIGINT:
            return int.from_bytes(data, "little", signed=True)
        if code == _EXT_TUPLE:
            return tuple(self.unpack(data))
        if code == _EXT_TENSOR:
            return self.tensor(data)
        if code == _EXT_COLUMN:
            return self.column(data)
        if code == _EXT_BYTES:
            _, _, raw = self.array_meta(data, _byte_dtype, column=True, raw_bytes=True)
            return bytes(raw)
        if code == _EXT_DICT_COLUMN:
            return self.dict_column(data)
        if code == _EXT_NDARRAY:
            dtype, shape, raw = self.array_meta(data, _numpy_dtype)
            return np.frombuffer(raw, dtype=np.uint8).copy().view(dtype).reshape(shape)
        if code == _EXT_NPSCALAR:
            meta = msgpack.unpackb(data, raw=False)
            if not (isinstance(meta, list) and len(meta) == 2 and isinstance(meta[1], bytes)):
                raise DecodeError(f"bad numpy scalar {meta!r}")
            dtype = _numpy_dtype(meta[0])
            if len(meta[1]) != dtype.itemsize:
                raise DecodeError(f"numpy scalar of {dtype} with {len(meta[1])} bytes")
            return np.frombuffer(meta[1], dtype=dtype)[0]
        raise DecodeError(f"unknown extension type {code}")

    def tensor(self, data: bytes | memoryview) -> torch.Tensor:
        dtype, shape, raw = self.array_meta(data, _torch_dtype)
        if not raw.nbytes:
            return torch.empty(shape, dtype=dtype)
        # one copy, through numpy (no warning for read-only input), into memory the tensor owns
        flat = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy())
        return flat.view(dtype).reshape(shape)

    def column(self, data: bytes | memoryview) -> list[Any]:
        dtype, _, raw = self.array_meta(data, _column_dtype, column=True)
        array = np.frombuffer(raw, dtype=dtype)
        if dtype.kind != "i":
            floats: list[Any] = array.tolist()
            return floats
        # int64's tolist is about twice as fast as int32's: widen first (a copy of 8 bytes each)
        wide = array.astype(np.int64)
        return _few_distinct(wide) or wide.tolist()

    def dict_column(self, data: bytes | memoryview) -> dict[Any, Any]:
        """[the keys, packed as a list][the values' column header]."""
        unpacker = msgpack.Unpacker(
            None, ext_hook=self.ext_hook, raw=False, strict_map_key=False, use_list=True
        )
        unpacker.feed(data)
        keys = unpacker.unpack()
        if type(keys) is bytes:
            keys = keys.decode("utf-8", "surrogatepass").split("\0")
        values = self.column(data[unpacker.tell() :])
        if not isinstance(keys, list) or len(keys) != len(values):
            count = len(keys) if isinstance(keys, list) else type(keys).__name__
            raise DecodeError(f"bad dict column: {count} keys for {len(values)} values")
        return dict(zip(keys, values, strict=True))

    def array_meta(
        self,
        data: bytes | memoryview,
        to_dtype: Callable[[str], Any],
        *,
        column: bool = False,
        raw_bytes: bool = False,
    ) -> tuple[Any, list[int], memoryview]:
        meta = msgpack.unpackb(data, raw=False)
        if raw_bytes and isinstance(meta, list):  # [length, offset]
            meta = ["|u1", *meta]
        if column:  # [dtype, length, offset]: a one-dimensional array
            if not (isinstance(meta, list) and len(meta) == 3 and type(meta[1]) is int):
                raise DecodeError(f"bad column header {meta!r}")
            meta = [meta[0], [meta[1]], meta[2]]
        if (
            not isinstance(meta, list)
            or len(meta) != 3
            or not isinstance(meta[0], str)
            or not isinstance(meta[1], list)
            or not all(type(n) is int and n >= 0 for n in meta[1])
            or type(meta[2]) is not int
            or meta[2] < 0
        ):
            raise DecodeError(f"bad array header {meta!r}")
        name, shape, offset = meta
        dtype = to_dtype(name)
        nbytes = _numel(shape) * dtype.itemsize
        if offset + nbytes > len(self.buffers):
            raise DecodeError(
                f"array {name}{shape} needs bytes {offset}..{offset + nbytes}, the payload has "
                f"{len(self.buffers)}"
            )
        return dtype, shape, self.buffers[offset : offset + nbytes]


def _few_distinct(values: np.ndarray) -> list[Any] | None:
    """Ints over a range much shorter than the column (labels, classes) as a list that shares
    one int object per value, taken from a table at C speed (~1.6x faster than making an int
    per item, as tolist and pickle do); None for other columns."""
    if len(values) < _LOOKUP_MIN:
        return None
    low, high = int(values.min()), int(values.max())
    if high - low >= len(values) // 4:
        return None
    table = np.arange(low, high + 1, dtype=np.int64).astype(object)
    shared: list[Any] = table[values - low].tolist()
    return shared


def _torch_dtype(name: str) -> torch.dtype:
    dtype = _TORCH_DTYPES.get(name)
    if dtype is None:
        raise DecodeError(f"unknown tensor dtype {name!r}")
    return dtype


def _byte_dtype(name: str) -> np.dtype:
    return np.dtype(np.uint8)


def _column_dtype(name: str) -> np.dtype:
    dtype = _COLUMN_DTYPES.get(name)
    if dtype is None:
        raise DecodeError(f"unknown column dtype {name!r}")
    return dtype


def _numpy_dtype(name: str) -> np.dtype:
    try:
        dtype = np.dtype(name)
    except TypeError:
        raise DecodeError(f"unknown numpy dtype {name!r}") from None
    if _dtype_problem(dtype):
        raise DecodeError(f"refusing numpy dtype {name!r}")
    return dtype


def _numel(shape: list[int]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


# ---- pickle codec ----


def _encode_pickle(obj: Any) -> bytes:
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # PicklingError, TypeError, AttributeError for local classes…
        raise UnsupportedTypeError(
            f'codec="pickle" cannot pickle the object ({type(exc).__name__}: {exc})'
        ) from None


def _load_storage_on_cpu(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


class _CpuUnpickler(pickle.Unpickler):
    """Loads tensors on the CPU: torch's own path puts them back on the sender's GPU, creating a
    CUDA context there on every receiver (pytorch#76865)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _load_storage_on_cpu
        return super().find_class(module, name)


def _decode_pickle(payload: bytes | memoryview) -> Any:
    try:
        return _CpuUnpickler(io.BytesIO(payload)).load()
    except Exception as exc:
        raise DecodeError(f"cannot unpickle the payload ({type(exc).__name__}: {exc})") from None
