"""A CPU recording of one captured call: the tensor operations it ran, replayed as a CUDA graph is.

:func:`record` runs a callable under a :class:`~torch.utils._python_dispatch.TorchDispatchMode`
that sees every ATen and c10d operation below autograd (the forward, autograd's backward, the
optimizer's kernels, DDP's and FSDP2's collectives) and keeps them, in order, with the tensors
they read and wrote. :meth:`Program.replay` runs only that list: no Python of the body, no
autograd, no module or tensor hooks. What CUDA's capture gives, this gives too:

* **Static addresses.** Every tensor an operation created at capture is kept; a replay writes
  that operation's new result into it (``copy_``), so a later operation, the step's outputs and
  a script's reference to them see the replay's values (the next replay overwrites them, as the
  graph's private pool does). Views are not re-run: a view made at capture already aliases the
  storage the replay writes.
* **Capture runs nothing.** A CUDA capture launches no kernel. Here the operations must run to
  give later ones their shapes, so each tensor that existed before the capture is saved before
  its first write and put back afterwards: parameters, gradients, optimizer state and buffers
  are as they were, whether the capture succeeds or fails. Collectives are not sent at capture
  (a peer that runs eagerly meanwhile would pair with them): each returns its input unchanged
  and a finished ``Work``; the replay sends them and waits for each before the next operation
  (a stream orders them so on the GPU).
* **Capture looks like capture.** ``torch.cuda.is_current_stream_capturing()`` is True while
  recording, so libraries that branch on it (transformers' ``is_tracing``) take the branch they
  take on the GPU.
* **What capture refuses.** A host read (``aten._local_scalar_dense``: ``.item()``, ``float(t)``,
  ``if t:``; ``torch.equal``) and an output whose shape depends on the data
  (``nonzero``, a boolean-mask ``index``/``index_put_``, ``masked_select``, ``unique``,
  one-argument ``where``, ``repeat_interleave`` with a tensor of repeats and no ``output_size``,
  ``bincount``) raise :class:`CaptureRefused` whose first line is the error CUDA gives.
  CPU kernels call ``nonzero`` below the dispatcher, so a boolean index is seen by its dtype.
  Not seen: what reads a CPU tensor's memory without an operation (``.tolist()``, ``.numpy()``),
  which on CUDA would be a device-to-host copy (refused there), and kernels that run below the
  dispatcher (Inductor's: the step refuses a model compiled with it,
  :func:`~.assembly.build_graphs`).
* **The generator's state.** CUDA capture (torch 2.10+) lets a state read and set back within
  the capture rewind the generator's offset (pytorch#162505): ``torch.utils.checkpoint`` saves
  the state in the forward and restores it for the recompute (``preserve_rng_state=True``).
  Here ``torch.get_rng_state()`` during a recording adds an operation that refills the returned
  state tensor with the replay's state, and ``set_rng_state`` of that tensor one that restores
  it, so each replay's recompute draws its own forward's numbers. Setting a seed
  (``manual_seed``, ``seed``) or a state not read in the capture raises
  :class:`CaptureRefused` with CUDA's error.

Random numbers: a replayed ``dropout`` draws new numbers, from the CPU's generator in the order
the operations run, the same numbers an eager step at that point would draw. CUDA's graph reads
a Philox seed and offset that ``replay()`` advances by what the capture consumed: also the
numbers an eager step would draw from the same generator state. The two streams differ from each
other (mt19937 against Philox), never within one device, and every comparison the tests make is
graphed against eager on the same device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_map_only

__all__ = ["CUDA_CAPTURE_ERROR", "CaptureRefused", "Program", "record"]

CUDA_CAPTURE_ERROR = "CUDA error: operation not permitted when stream is capturing"

_aten = torch.ops.aten
# what reads a tensor's value on the host: CUDA must wait for the device, which a capture forbids
_HOST_READS = {
    _aten._local_scalar_dense.default: "a host read (.item(), float(t), int(t))",
    _aten.equal.default: "a host read (torch.equal returns a Python bool)",
    _aten.is_nonzero.default: "a host read (a truth test of a tensor, `if t:`)",
}
# what sizes its output by the data: the host must read a count first
_DATA_DEPENDENT = {
    "nonzero",
    "argwhere",
    "masked_select",
    "unique",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "bincount",
}
_INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index", "index_add"}
_BOOL_INDEX_DTYPES = (torch.bool, torch.uint8)
# arguments written by ops whose schema does not say so (BatchNorm's running statistics)
_UNDECLARED_WRITES = {"native_batch_norm": (3, 4), "cudnn_batch_norm": (3, 4)}


class CaptureRefused(RuntimeError):
    """What CUDA capture refuses, refused on the CPU: the first line is CUDA's own error text."""


@dataclass
class _Op:
    """One recorded operation: run again on the same arguments; ``writes_back`` pairs each
    result the operation created with the tensor that received it at capture."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    writes_back: tuple[tuple[int, torch.Tensor], ...]
    collective: bool


class Program:
    """The operations of one capture, in order; :meth:`replay` runs them on the same tensors."""

    def __init__(self, ops: list[_Op]) -> None:
        self._ops = ops

    def __len__(self) -> int:
        return len(self._ops)

    def replay(self) -> None:
        # autograd is off as in a graph: the recorded ops already include the backward's
        with torch.no_grad():
            for op in self._ops:
                result = op.func(*op.args, **op.kwargs)
                if op.collective:
                    _wait(result)
                if op.writes_back:
                    flat, _ = tree_flatten(result)
                    for index, kept in op.writes_back:
                        kept.copy_(flat[index])


def record(run: Callable[[], Any]) -> tuple[Any, Program]:
    """``run()`` recorded: its result (graph-owned tensors) and its :class:`Program`.

    Every tensor that existed before is as it was afterwards, also when ``run`` raises (a
    :class:`CaptureRefused` for what CUDA capture refuses, or the body's own error).
    """
    recorder = _Recorder()
    # a CUDA capture draws no random number either: a replay advances the generator, not this
    rng = torch.random.get_rng_state()
    try:
        with recorder, _capturing(), _storage_resizes(recorder), _generator_state(recorder):
            result = run()
    finally:
        recorder.restore()
        torch.random.set_rng_state(rng)
    return result, Program(recorder.ops)


_RESIZE = torch.UntypedStorage.resize_


@contextlib.contextmanager
def _storage_resizes(recorder: _Recorder) -> Iterator[None]:
    """Record ``UntypedStorage.resize_`` (no operation of the dispatcher): FSDP2 frees each
    unsharded parameter's storage after use and allocates it again before the next all-gather.
    A replay does the same in the same order, so every recorded write finds its memory (on CUDA
    the graph's private pool keeps it)."""

    def resize(storage: torch.UntypedStorage, nbytes: int) -> Any:
        result = _RESIZE(storage, nbytes)
        recorder.ops.append(_Op(_RESIZE, (storage, nbytes), {}, (), collective=False))
        recorder.created(storage)
        return result

    torch.UntypedStorage.resize_ = resize  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = _RESIZE  # type: ignore[method-assign]


@contextlib.contextmanager
def _capturing() -> Iterator[None]:
    """``torch.cuda.is_current_stream_capturing()`` is True while recording, as in a CUDA
    capture: libraries take their capture-safe branch on it (transformers' ``is_tracing`` skips
    its host read of the padding mask, masking_utils.py)."""
    original = torch.cuda.is_current_stream_capturing
    torch.cuda.is_current_stream_capturing = lambda: True
    try:
        yield
    finally:
        torch.cuda.is_current_stream_capturing = original


@contextlib.contextmanager
def _generator_state(recorder: _Recorder) -> Iterator[None]:
    """The generator's state calls as CUDA capture takes them (torch 2.10+, pytorch#162505): a
    state read during capture and set back later is a rewind the replay repeats (the read
    refills the same state tensor with the replay's state, the set restores it), so a
    checkpoint's recompute draws its forward's numbers on every replay; a seed set during
    capture is refused with CUDA's error. ``torch.X`` and ``torch.random.X`` both, the names
    libraries call."""
    get_state, set_state = torch.random.get_rng_state, torch.random.set_rng_state
    read: list[torch.Tensor] = []

    def get_rng_state() -> torch.Tensor:
        state = get_state()
        read.append(state)
        recorder.ops.append(_Op(_refill, (state, get_state), {}, (), collective=False))
        return state

    def set_rng_state(new_state: torch.Tensor) -> None:
        if not any(new_state is state for state in read):
            raise CaptureRefused(
                f"{_SEED_DURING_CAPTURE}\n(ddpgraph's CPU graphs refuse what CUDA capture "
                "refuses: torch.set_rng_state with a state not read in this capture)"
            )
        set_state(new_state)
        recorder.ops.append(_Op(set_state, (new_state,), {}, (), collective=False))

    patched: dict[str, Callable[..., Any]] = {
        "get_rng_state": get_rng_state,
        "set_rng_state": set_rng_state,
        "manual_seed": _seed_refused("torch.manual_seed"),
        "seed": _seed_refused("torch.seed"),
    }
    originals = {name: getattr(torch.random, name) for name in patched}
    for module in (torch, torch.random):
        for name, replacement in patched.items():
            setattr(module, name, replacement)
    try:
        yield
    finally:
        for module in (torch, torch.random):
            for name, original in originals.items():
                setattr(module, name, original)


# CUDAGeneratorImpl::set_current_seed during capture (torch 2.10+; before it, every state call)
_SEED_DURING_CAPTURE = (
    "CUDAGeneratorImpl::set_current_seed can be called during stream capture only if new seed "
    "is the same as the original seed."
)


def _refill(state: torch.Tensor, get_state: Callable[[], torch.Tensor]) -> None:
    state.copy_(get_state())


def _seed_refused(name: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise CaptureRefused(
            f"{_SEED_DURING_CAPTURE}\n(ddpgraph's CPU graphs refuse what CUDA capture refuses: "
            f"{name} seeds the generator)"
        )

    return refuse


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: list[_Op] = []
        self._created: set[int] = set()  # storages made during the capture
        self._saved: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func.namespace == "profiler":
            return func(*args, **kwargs)
        if any(is_traceable_wrapper_subclass(t) for t in _tensors((args, kwargs))):
            # a DTensor (FSDP2's parameters): its own dispatch runs the operations on its local
            # tensors, which come back here and are recorded; its Python runs at capture only
            return NotImplemented
        _refuse_what_cuda_refuses(func, args, kwargs)
        if func.namespace in ("c10d", "_c10d_functional"):
            result = _unsent_collective(func, args, kwargs)
            self._keep(func, args, kwargs, result, collective=True)
            return result
        self._save_before_write(func, args, kwargs)
        result = func(*args, **kwargs)
        self._keep(func, args, kwargs, result, collective=False)
        return result

    def _keep(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        result: Any,
        *,
        collective: bool,
    ) -> None:
        inputs = {_storage(t) for t in _tensors((args, kwargs))}
        flat, _ = tree_flatten(result)
        fresh = tuple(
            (i, t)
            for i, t in enumerate(flat)
            if isinstance(t, torch.Tensor) and _storage(t) not in inputs
        )
        for _, t in fresh:
            self.created(t.untyped_storage())
        if collective:
            # the collective's own results (functional ones) land in the kept tensors; a c10d
            # op's in-place output is its argument
            self.ops.append(_Op(func, args, kwargs, fresh, collective=True))
            return
        if not fresh and _view_or_query(func):
            return  # what it returned aliases a kept storage, or is no tensor
        self.ops.append(_Op(func, args, kwargs, fresh, collective=False))

    def created(self, storage: torch.UntypedStorage) -> None:
        """``storage`` was made (or allocated again) during the capture: nothing to put back."""
        self._created.add(storage.data_ptr())

    def _save_before_write(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        for tensor in _written(func, args, kwargs):
            key = _storage(tensor)
            if key in self._created or key in self._saved or key == 0:
                continue
            storage = tensor.untyped_storage()
            self._saved[key] = (storage, storage.clone())  # type: ignore[no-untyped-call]

    def restore(self) -> None:
        """Put back every tensor the capture wrote that existed before it (as no kernel ran)."""
        with torch.no_grad():
            for storage, saved in self._saved.values():
                if storage.nbytes() == saved.nbytes():  # else freed since (FSDP2's reshard)
                    storage.copy_(saved)
        self._saved.clear()


def _view_or_query(func: Any) -> bool:
    """An operation that writes nothing: a declared view, or an ATen query returning no tensor.

    Anything else is replayed even when its outputs alias its inputs: an operation may write an
    argument without declaring it (FSDP2's ``fsdp::all_gather_copy_in`` fills the buffer it is
    given and returns views of it)."""
    schema = func._schema
    if schema.is_mutable:
        return False
    tensors = [r for r in schema.returns if "Tensor" in str(r.type)]
    if not tensors:
        return bool(func.namespace == "aten")
    return all(r.alias_info is not None for r in tensors)


def _refuse_what_cuda_refuses(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    what = _HOST_READS.get(func)
    name = func._schema.name.split("::")[-1]
    if what is None and name in _DATA_DEPENDENT:
        what = f"a data-dependent shape ({name} sizes its output by the data)"
    if what is None and name in _INDEXING and _bool_index(args, kwargs):
        what = f"a data-dependent shape ({name} with a boolean mask index, x[mask])"
    if what is None and name == "repeat_interleave" and _repeats_tensor_without_size(args, kwargs):
        what = "a data-dependent shape (repeat_interleave with a tensor of repeats)"
    if what is not None:
        raise CaptureRefused(
            f"{CUDA_CAPTURE_ERROR}\n(ddpgraph's CPU graphs refuse what CUDA capture refuses: "
            f"aten.{name} is {what})"
        )


def _bool_index(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
    return any(isinstance(i, torch.Tensor) and i.dtype in _BOOL_INDEX_DTYPES for i in indices or ())


def _repeats_tensor_without_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    repeats = args[0] if args else kwargs.get("repeats")
    if not isinstance(repeats, torch.Tensor):
        return False
    return kwargs.get("output_size") is None and not (len(args) > 2 and args[2] is not None)


def _unsent_collective(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What a collective returns at capture, sending nothing: its input unchanged and a finished
    ``Work`` (c10d's in-place ops), or a tensor of the result's shape (functional ones)."""
    if func.namespace == "_c10d_functional":
        meta = func(*_to_meta(args), **_to_meta(kwargs))
        return tree_map_only(torch.Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype), meta)
    first = args[0] if args else None
    results: list[Any] = []
    for returned in func._schema.returns:
        if "Work" in str(returned.type):
            results.append(_finished_work(first))
        else:
            results.append(first)
    return results[0] if len(results) == 1 else tuple(results)


def _finished_work(value: Any) -> Any:
    future: torch.futures.Future[Any] = torch.futures.Future()
    future.set_result(value)
    # boxed: a dispatcher op returns c10d's Work as a TorchScript object
    c10d: Any = torch._C._distributed_c10d
    return c10d._create_work_from_future(future).boxed()


def _wait(result: Any) -> None:
    """Wait for a replayed collective before its result is copied or read: a c10d op's
    ``Work``, or a functional op's result tensors (DTensor's, FSDP2's norms), whose ``Work`` is
    registered on the tensor and waited by ``wait_tensor`` (the recorded ``wait_tensor`` reads
    the capture's tensor, which has none)."""
    c10d = torch._C._distributed_c10d
    for item in result if isinstance(result, (tuple, list)) else (result,):
        if isinstance(item, torch.ScriptObject):
            item = c10d.Work.unbox(item)
        if isinstance(item, c10d.Work):
            item.wait()
        elif isinstance(item, torch.Tensor):
            torch.ops._c10d_functional.wait_tensor(item)


def _to_meta(tree: Any) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.to("meta"), tree)


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterable[torch.Tensor]:
    undeclared = _UNDECLARED_WRITES.get(func._schema.name.split("::")[-1], ())
    for i, argument in enumerate(func._schema.arguments):
        info = argument.alias_info
        if i not in undeclared and (info is None or not info.is_write):
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        yield from _tensors(value)


def _tensors(tree: Any) -> list[torch.Tensor]:
    flat, _ = tree_flatten(tree)
    return [t for t in flat if isinstance(t, torch.Tensor)]


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()
