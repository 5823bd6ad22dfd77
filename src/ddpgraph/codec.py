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

import io
import json
import pickle
import struct
from collections.abc import Callable
from typing import Any, cast

import msgpack
import numpy as np
import torch

__all__ = ["CODECS", "DecodeError", "UnsupportedTypeError", "decode", "encode"]

# The codec ids travel in every collective header, so they must never be renumbered.
CODECS: dict[str, int] = {"data": 1, "pickle": 2}

# Extension type codes of the data codec (msgpack allows 0..127). Never renumber these either.
_EXT_TENSOR = 1
_EXT_NDARRAY = 2
_EXT_NPSCALAR = 3
_EXT_BIGINT = 4
_EXT_TUPLE = 5

# Decoding maps names to dtypes through this table only: a payload cannot name anything else.
_TORCH_DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}
_PREFIX = struct.Struct("<I")  # length of the msgpack meta block in front of raw array bytes

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
    if codec == "data":
        return _encode_data(obj)
    if codec == "pickle":
        return _encode_pickle(obj)
    raise ValueError(f"codec={codec!r} is not one of {sorted(CODECS)}")


def decode(payload: bytes | memoryview, codec: str = "data") -> Any:
    """Inverse of :func:`encode`. Tensors are returned on the CPU. Raises :class:`DecodeError`."""
    if codec == "data":
        return _decode_data(payload)
    if codec == "pickle":
        return _decode_pickle(payload)
    raise ValueError(f"codec={codec!r} is not one of {sorted(CODECS)}")


# ---- data codec: encoding ----


def _default(obj: Any) -> msgpack.ExtType:
    """msgpack calls this for every value it has no native (strict) type for."""
    kind = type(obj)
    if kind is int:  # msgpack handles -2**63 .. 2**64-1 itself and calls us beyond that
        return msgpack.ExtType(_EXT_BIGINT, _int_to_bytes(obj))
    if kind is tuple:
        return msgpack.ExtType(_EXT_TUPLE, _pack(list(obj)))
    if isinstance(obj, torch.Tensor):
        problem = _tensor_problem(obj)
        if problem:
            raise UnsupportedTypeError(problem)
        return msgpack.ExtType(_EXT_TENSOR, _tensor_to_bytes(obj))
    if kind is np.ndarray:
        problem = _ndarray_problem(obj)
        if problem:
            raise UnsupportedTypeError(problem)
        return msgpack.ExtType(_EXT_NDARRAY, _array_to_bytes(obj))
    if isinstance(obj, np.generic) and _dtype_problem(obj.dtype) is None:
        return msgpack.ExtType(_EXT_NPSCALAR, _array_to_bytes(np.asarray(obj)))
    raise UnsupportedTypeError(f"type {kind.__module__}.{kind.__qualname__}")


def _pack(obj: Any) -> bytes:
    # strict_types: a tuple, a bool-like int subclass or an OrderedDict reaches _default instead
    # of being silently flattened to a list / int / dict.
    return msgpack.packb(obj, default=_default, strict_types=True, use_bin_type=True)


def _encode_data(obj: Any) -> bytes:
    try:
        return _pack(obj)
    except (TypeError, ValueError, OverflowError) as exc:
        where = _find_unsupported(obj, "obj", set(), 0)
        if where is None:
            raise UnsupportedTypeError(f'codec="data" cannot encode the object: {exc}') from None
        path, what = where
        raise UnsupportedTypeError(
            f'{path} is {what}, which codec="data" cannot send; convert it to None, bool, int, '
            "float, str, bytes, list, tuple, dict, a torch.Tensor or a numpy array, or "
            f"{_PICKLE_HINT}."
        ) from None


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


def _tensor_to_bytes(t: torch.Tensor) -> bytes:
    # .cpu() copies from the tensor's own device (no new CUDA context: it already lives there);
    # viewing as bytes carries every dtype, bfloat16 included, which numpy cannot represent.
    flat = t.detach().cpu().contiguous().reshape(-1)
    meta = _pack([str(t.dtype).removeprefix("torch."), list(t.shape)])
    raw = flat.view(torch.uint8).numpy().data if flat.numel() else b""
    return b"".join((_PREFIX.pack(len(meta)), meta, raw))


def _dtype_problem(dtype: np.dtype) -> str | None:
    if dtype.hasobject or dtype.fields is not None:
        return f"a numpy array of dtype {dtype} (object and structured dtypes are not supported)"
    return None


def _ndarray_problem(a: np.ndarray) -> str | None:
    return _dtype_problem(a.dtype)


def _array_to_bytes(a: np.ndarray) -> bytes:
    if not a.flags.c_contiguous:
        a = a.copy(order="C")  # not np.ascontiguousarray: it turns a 0-d array into shape (1,)
    meta = _pack([a.dtype.str, list(a.shape)])
    return b"".join((_PREFIX.pack(len(meta)), meta, a.reshape(-1).view(np.uint8).data))


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
        problem = _ndarray_problem(obj)
        return (path, problem) if problem else None
    if isinstance(obj, np.generic) and _dtype_problem(obj.dtype) is None:
        return None
    return path, f"a {kind.__module__}.{kind.__qualname__}".replace("builtins.", "")


def _key_text(key: Any) -> str:
    return json.dumps(key) if type(key) is str else repr(key)


# ---- data codec: decoding ----


def _decode_data(payload: bytes | memoryview) -> Any:
    try:
        return msgpack.unpackb(
            payload, ext_hook=_ext_hook, raw=False, strict_map_key=False, use_list=True
        )
    except DecodeError:
        raise
    except Exception as exc:  # msgpack raises several types (ExtraData, FormatError, ValueError…)
        raise DecodeError(f"not a valid data-codec payload ({type(exc).__name__}: {exc})") from None


def _ext_hook(code: int, data: bytes) -> Any:
    handler = _EXT_DECODERS.get(code)
    if handler is None:
        raise DecodeError(f"unknown extension type {code}")
    return handler(data)


def _split_meta(data: bytes) -> tuple[str, list[int], memoryview]:
    view = memoryview(data)
    if len(view) < _PREFIX.size:
        raise DecodeError("truncated array header")
    (meta_len,) = _PREFIX.unpack_from(view)
    end = _PREFIX.size + meta_len
    meta = msgpack.unpackb(view[_PREFIX.size : end], raw=False)
    if (
        not isinstance(meta, list)
        or len(meta) != 2
        or not isinstance(meta[0], str)
        or not all(type(n) is int and n >= 0 for n in meta[1])
    ):
        raise DecodeError(f"bad array header {meta!r}")
    return meta[0], meta[1], view[end:]


def _decode_tensor(data: bytes) -> torch.Tensor:
    name, shape, raw = _split_meta(data)
    dtype = _TORCH_DTYPES.get(name)
    if dtype is None:
        raise DecodeError(f"unknown tensor dtype {name!r}")
    expected = _numel(shape) * dtype.itemsize
    if len(raw) != expected:
        raise DecodeError(f"tensor {name}{shape} needs {expected} bytes, payload has {len(raw)}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    # bytearray: one copy into memory the tensor may own and write to.
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def _decode_array(data: bytes) -> np.ndarray:
    name, shape, raw = _split_meta(data)
    try:
        dtype = np.dtype(name)
    except TypeError:
        raise DecodeError(f"unknown numpy dtype {name!r}") from None
    if _dtype_problem(dtype):
        raise DecodeError(f"refusing numpy dtype {name!r}")
    expected = _numel(shape) * dtype.itemsize
    if len(raw) != expected:
        raise DecodeError(f"array {name}{shape} needs {expected} bytes, payload has {len(raw)}")
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


def _decode_scalar(data: bytes) -> np.generic:
    array = _decode_array(data)
    if array.shape != ():
        raise DecodeError(f"numpy scalar with shape {array.shape}")
    return cast(np.generic, array[()])


def _numel(shape: list[int]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


_EXT_DECODERS: dict[int, Callable[[bytes], Any]] = {
    _EXT_TENSOR: _decode_tensor,
    _EXT_NDARRAY: _decode_array,
    _EXT_NPSCALAR: _decode_scalar,
    _EXT_BIGINT: lambda data: int.from_bytes(data, "little", signed=True),
    _EXT_TUPLE: lambda data: tuple(_decode_data(data)),
}


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
