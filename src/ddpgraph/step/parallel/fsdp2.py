"""FSDP2 (``torch.distributed.fsdp.fully_shard``) as the step's wrapper: the one module that names it.

Facts this is built on (a probe on one H200, torch 2.11, and CPU runs on gloo, torch 2.13; see
REFERENCES.md, "FSDP2, frameworks and script habits"):

* Forward, ``backward()`` with its reduce-scatters, ``clip_grad_norm_(foreach=True)`` on the
  DTensor gradients and ``AdamW(capturable=True)`` (foreach or fused) on the DTensor shards are
  captured as one CUDA graph after a few eager steps on the capture stream (FSDP2 builds its
  streams and buffers at its lazy init, the first forward), and replay bitwise equal to eager.
* FSDP2 keeps events and buffers from eager work between iterations (the last all-gather, the
  reduce-scatter inputs, post-reduce events); a capture must start with none pending, so
  :meth:`FSDP2.allows_capture` checks that FSDP2 is idle and names what was pending.
* ``torch.nn.utils.clip_grad_norm_`` / ``get_total_norm`` on DTensor gradients return a
  replicated DTensor (the partial norms are all-reduced on the device); ``.full_tensor()`` of a
  replicated DTensor is its local tensor: no host sync.
* SGD has no DTensor rule for its fused kernel (``aten._fused_sgd_.tensor_lr``) and its foreach
  kernel turns a tensor LR into a host number (``alpha=-lr``): refused under graphs.
* With a world size of 1 FSDP2 runs no collective at all (it skips them); the reduce-scatters
  and all-gathers inside a graph run only from a world size of 2.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...errors import CaptureError, ConfigError
from ..live_graphs import find_earlier_graph, fresh_accumulators
from ..streams import on_stream
from .base import DataParallel
from .dtensor import full_tensor, mesh_group

__all__ = [
    "FSDP2",
    "check_not_fsdp1",
    "find_fsdp2",
    "is_fsdp2",
    "shard_blocks",
    "sharded_root",
]


def is_fsdp2(module: object) -> bool:
    """Whether ``module`` is a module the script ran ``fully_shard`` on."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return False
    return isinstance(module, FSDPModule)


def find_fsdp2(module: nn.Module) -> list[str]:
    """The names of ``module``'s submodules (itself: "") that ``fully_shard`` was run on."""
    return [name for name, sub in module.named_modules() if is_fsdp2(sub)]


class FSDP2(DataParallel):
    """The module the script sharded with ``fully_shard`` (or :func:`shard_blocks` sharded for
    it), used as it is: FSDP2 has no wrapper object, so ``module`` and ``inner`` are the module
    the step calls, and :attr:`root` FSDP2's root: the module itself, or the sharded model
    inside a parameter-free module around it (a loss module, as GraphTrainer's).

    * Gradient sync: FSDP2 reduce-scatters each block's gradients in backward; an accumulating
      micro-step turns that off with ``set_requires_gradient_sync(False)`` for its backward.
    * Buffers: FSDP2 does not broadcast buffers (BatchNorm statistics stay per rank, as in a
      plain FSDP2 loop).
    * Evaluation runs the root's forward (FSDP2 all-gathers each block) without gradients; the
      root's own parameters, which FSDP2 keeps gathered after a no-grad forward, are resharded
      at its end, so every graph starts from the sharded state.
    """

    shards_gradients = True  # each rank reduce-scatters into its own shard
    checks_before_call = True  # before_call() undoes what the script left unsharded

    def __init__(
        self,
        module: nn.Module,
        stream: torch.cuda.Stream | None,
        replaced: dict[int, nn.Parameter] | None = None,
    ) -> None:
        root = sharded_root(module)
        self._replaced = replaced or {}  # sharded here: the old parameters' new DTensor ones
        self.module = module
        self.inner = module
        self.root = root  # what FSDP2's own methods (gradient sync, reshard, reset) are called on
        self._stream = stream
        self.group = mesh_group(root)
        # a no-grad (evaluation) forward leaves the root's parameters gathered: reshard them
        self._hook = root.register_forward_hook(_reshard_after_no_grad_forward)
        # each sharded module with its parameter groups, walked once: read on every call
        self._sharded = [
            (sub, _param_groups(sub._get_fsdp_state()))  # type: ignore[operator]
            for sub in root.modules()
            if is_fsdp2(sub)
        ]
        self._flags = [g for _, groups in self._sharded for g in groups]  # reduce_grads
        self.sync_dicts = tuple(vars(group) for group in self._flags)  # as script_sync reads
        self.sync_keys = ("reduce_grads",) * len(self._flags)
        self._script_off = False  # the script's set_requires_gradient_sync(False) was read
        self._capture_hint: str | None = None  # what before_capture saw and could not mend

    # ---------------------------------------------------- GradSync: forward, backward and the norm
    def take_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """``parallel="fsdp2"`` sharded the model after the script built its optimizer over the
        plain parameters: point the optimizer's param groups at the DTensor parameters that
        ``fully_shard`` put in their place (by name), as if it had been built after sharding."""
        if not self._replaced:
            return
        held = [p for group in optimizer.param_groups for p in group["params"]]
        if any(id(p) in self._replaced and p in optimizer.state for p in held):
            raise ConfigError(
                "TrainStep(parallel='fsdp2') shards the model, but the optimizer already holds "
                "state for its unsharded parameters (it has stepped); build the optimizer "
                "before its first step, or shard the model with fully_shard yourself first."
            )
        for group in optimizer.param_groups:
            group["params"] = [self._replaced.get(id(p), p) for p in group["params"]]

    @contextlib.contextmanager
    def forward_context(self, *, sync_grads: bool, sync_buffers: bool) -> Iterator[None]:
        if sync_grads:
            yield
            return
        # FSDP2 reads the flag in backward (no reduce-scatter: the unsharded gradients
        # accumulate until the last micro-batch's backward reduces them all); the script's own
        # value is put back after (its flag is read at each call: script_sync)
        before = all(group.reduce_grads for group in self._flags)
        self.root.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            self.root.set_requires_gradient_sync(before)  # type: ignore[operator]

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the DTensor gradients as ``torch.nn.utils.clip_grad_norm_`` does in a plain FSDP2
        loop; the total norm as a plain device tensor (the partial norms are all-reduced on the
        device by DTensor; ``full_tensor()`` of the replicated result moves nothing)."""
        return full_tensor(super().clip_grad_norm_(max_norm))

    def grad_norm(self) -> torch.Tensor:
        return full_tensor(super().grad_norm())

    # ------------------------ CaptureGate: the script's sync, the warm-up, what cannot be captured
    def script_sync(self) -> bool | None:
        """The script's own ``model.set_requires_gradient_sync(False)`` kept around ``step()``
        (a plain FSDP2 loop's accumulation), read from FSDP2's parameter groups: False while it
        is off (a micro-batch of the window), True on every call with it on once the script has
        turned it off (a window's end, as DDP's ``no_sync``: two such calls in a row are a window
        and a short window of one), else None. One read per parameter group."""
        if not all(group.reduce_grads for group in self._flags):
            self._script_off = True
            return False
        return True if self._script_off else None

    def count_allows_capture(self, forwards: int) -> bool:
        # FSDP2 times no iteration: after its lazy init (the first forward) and one optimizer
        # step (its state tensors exist), any count can be captured
        return forwards >= 2

    def allows_capture(self, steps: int) -> bool:
        """Raises :class:`CaptureError` naming what FSDP2 has pending if it is not idle: a graph
        captured then would wait on an event recorded by eager work, or free its buffer."""
        pending = fsdp2_pending(self.root)
        if pending:
            raise CaptureError(
                "FSDP2 is not idle, so the step cannot be captured: pending "
                f"{'; '.join(pending)}. Capture after a whole eager step (forward, backward and "
                "optimizer step); do not call unshard() or run a forward outside the TrainStep "
                "between its steps."
            )
        return True

    def capture_problem(
        self, optimizer: torch.optim.Optimizer, *, fp16: bool, accumulate_calls: int
    ) -> str | None:
        """What FSDP2 cannot capture: CPU offload (host syncs), SGD on DTensor shards, fp16,
        more than two accumulate_calls."""
        offloaded = _offloading(self.root)
        if offloaded:
            return (
                f"FSDP2's CPUOffloadPolicy (on {offloaded}) copies to and from the host and "
                "synchronizes with it in every step, which a CUDA graph cannot hold; shard "
                "without offload_policy=CPUOffloadPolicy(), or pass graph='never'"
            )
        if isinstance(optimizer, torch.optim.SGD):
            return (
                "SGD on FSDP2's DTensor shards cannot be stepped inside a CUDA graph (its fused "
                "kernel has no DTensor rule, its foreach kernel reads a tensor LR on the host); "
                "use torch.optim.AdamW or Adam (capturable on DTensors), or pass graph='never'"
            )
        if accumulate_calls > 2:
            # measured on an H200 (MixedPrecisionPolicy bf16, fused AdamW, accumulate_calls=3):
            # the replays drifted from eager FSDP2 after the first window
            return (
                f"accumulate_calls={accumulate_calls} with FSDP2: the first micro-batch of a "
                "window creates FSDP2's unsharded gradient accumulator and the later ones add to "
                "it (host-side branches), but every micro-batch replays one graph; use "
                "accumulate=k (one call split in k, captured as one graph) or accumulate_calls=2"
            )
        if fp16:
            return (
                "amp='fp16' with FSDP2 needs an inf/NaN check agreed over the gradient shards of "
                "every rank, which TrainStep does not do yet; use amp='bf16' (or FSDP2's "
                "MixedPrecisionPolicy(param_dtype=torch.bfloat16)), which needs no loss scaling"
            )
        return None

    def before_capture(self) -> str | None:
        """An earlier loss's autograd graph that still holds the gradient accumulators of
        FSDP2's unsharded parameters (the script's eager steps before the TrainStep, their last
        ``loss`` kept): the capture would reuse nodes made on another stream and fail. Where
        live tensors hold it (the usual case), the parameters get new accumulators here and the
        capture proceeds; the returned text names it either way (None: nothing found)."""
        leaves = unsharded_leaves(self.root)
        earlier = find_earlier_graph(leaves)
        if earlier is None:
            self._capture_hint = None
            return None
        text = earlier.describe(f"FSDP2's {len(leaves)} unsharded parameters")
        if earlier.holders:
            fresh_accumulators(earlier.leaves)
            self._capture_hint = None
            return (
                f"{text}. TrainStep gave those parameters new accumulators for its capture, so "
                "the step graphs; the old graph stays in memory until the reference goes."
            )
        self._capture_hint = text  # named again if the capture fails
        return text

    # ------------------------------------------ Recovery: between calls and after a failed capture
    def before_call(self) -> None:
        """Every call starts from FSDP2's idle, sharded state: a graph captured its all-gathers
        from there, and a module left unsharded registers its unsharded parameters in place of
        the shards. A script's explicit prefetch (``model.unshard()`` before each step, as
        pytorch/examples' FSDP2 example does) is therefore undone here: a pending all-gather is
        waited for, then the module resharded; the step all-gathers again itself, so the
        prefetch saves nothing under TrainStep and changes no number. One pass over the
        sharded modules' parameter groups."""
        for module, groups in self._sharded:
            pending = [g for g in groups if g._all_gather_result is not None]
            if not pending and not any(g.is_unsharded for g in groups):
                continue
            with on_stream(self._stream):
                for group in pending:
                    group.wait_for_unshard()
                module.reshard()  # type: ignore[operator]

    def follow_storage(self) -> str | None:
        """FSDP2 keeps its own views of each shard (``FSDPParam``): a move behind its back
        (``p.data = ...``, ``model.to()``) would all-gather stale memory."""
        raise ConfigError(
            "a parameter, gradient or buffer of the FSDP2 model moved to new memory between "
            "TrainStep calls (model.to() or p.data = ... after fully_shard); FSDP2 keeps its own "
            "views of the shards and cannot follow that: move the model before fully_shard "
            "(accelerate's prepare_model skips .to() for DTensor models), or change values in "
            "place (param.data.copy_(new))."
        )

    def dirty(self) -> bool:
        """Whether a failed capture left FSDP2 mid-iteration (a forward or backward state)."""
        return any(not_idle for not_idle in _training_states(self.root))

    def reset(self) -> None:
        """FSDP2's own recovery (``reset_iter_state`` on the root, torch >= 2.12): wait on the
        events of the failed iteration, reshard, and clear its per-iteration state. An older
        torch (2.11 on the device image) gets the same steps from :func:`reset_iter_state`."""
        own = getattr(self.root, "reset_iter_state", None)
        with on_stream(self._stream):
            if own is not None:
                own()
            else:
                try:
                    reset_iter_state(self.root)
                except Exception as exc:  # FSDP2's internals moved: name it, with the way on
                    raise CaptureError(
                        "a capture failed inside FSDP2's forward or backward, and FSDP2's state "
                        f"could not be reset on this torch ({torch.__version__}, no "
                        f"FSDPModule.reset_iter_state()): {type(exc).__name__}: {exc}. Pass "
                        "graph='never' (the capture's own failure is below), or upgrade torch "
                        "to 2.12 or later."
                    ) from exc
        _drop_unsharded_gradients(self.root)

    def explain_capture_failure(self, reason: str) -> str | None:
        """What :meth:`before_capture` found and could not mend, if anything."""
        return self._capture_hint

    def check_reset_alone(self) -> None:
        if dist.get_world_size(self.group) > 1:
            raise CaptureError(
                "a capture failed inside FSDP2's forward or backward on this rank while other "
                "ranks may be replaying; FSDP2's collectives can only recover with every rank at "
                "the same step. Pad batches to shapes captured at the start, or pass "
                "on_new_shape='eager'."
            )


# --------------------------------------------------------------------- what FSDP2 holds
def _states(root: nn.Module) -> list[Any]:
    return [m._get_fsdp_state() for m in root.modules() if is_fsdp2(m)]  # type: ignore[operator]


def _param_groups(state: Any) -> list[Any]:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)  # torch < 2.12: one group per state
    return [] if group is None else [group]


def _training_states(root: nn.Module) -> Iterator[bool]:
    for state in _states(root):
        yield state._training_state.name != "IDLE"
        for group in _param_groups(state):
            yield group._training_state.name != "IDLE"


def unsharded_leaves(root: nn.Module) -> list[torch.Tensor]:
    """The tensors FSDP2's backward accumulates into: each parameter's unsharded form (made at
    the first all-gather and kept; its storage freed between uses), and any parameter it does
    not manage."""
    from torch.distributed.tensor import DTensor

    leaves: list[torch.Tensor] = []
    for state in _states(root):
        for group in _param_groups(state):
            for fsdp_param in group.fsdp_params:
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    leaves.append(unsharded)
    leaves.extend(p for p in root.parameters() if not isinstance(p, DTensor))
    return leaves


def _pending_reduce_scatters(ctx: Any) -> list[Any]:
    """The reduce-scatters in flight, taken off ``ctx``: torch 2.12+ keeps a list
    (``reduce_scatter_states``), 2.11 one (``reduce_scatter_state``; the H100 image's torch
    raised AttributeError on the list's name)."""
    if hasattr(ctx, "reduce_scatter_states"):
        pending = list(ctx.reduce_scatter_states)
        ctx.reduce_scatter_states.clear()
        return pending
    one = getattr(ctx, "reduce_scatter_state", None)
    ctx.reduce_scatter_state = None
    return [] if one is None else [one]


def reset_iter_state(root: nn.Module) -> None:
    """``FSDPModule.reset_iter_state()`` of torch 2.12 (``FSDPState._reset_iter_state``), for a
    torch without it (2.11 names its reduce-scatter state in the singular): wait on the failed iteration's
    all-gather, reduce-scatter and post-reduce events, reshard every parameter group and set
    every state idle. The failed iteration's gradient reductions are dropped, as torch's own
    reset drops them."""
    state = root._get_fsdp_state()  # type: ignore[operator]
    if state._is_root is False:
        raise RuntimeError("reset_iter_state must be called on the root FSDP module")
    stream = state._device_handle.current_stream()
    ctx = state._comm_ctx
    if ctx.all_gather_state is not None:
        if ctx.all_gather_state.event is not None:
            stream.wait_event(ctx.all_gather_state.event)
        ctx.all_gather_state = None
    for reduce_scatter in _pending_reduce_scatters(ctx):
        if reduce_scatter.event is not None:
            stream.wait_event(reduce_scatter.event)
    for event in getattr(ctx, "_last_post_reduce_events", {}).values():
        stream.wait_event(event)
    getattr(ctx, "_last_post_reduce_events", {}).clear()
    ctx.post_forward_order.clear()
    for each in state._state_ctx.all_states:
        each._modules_to_run_forward.clear()
        each._training_state = type(each._training_state).IDLE
        for group in _param_groups(each):
            _reset_group(group)
    state._state_ctx.iter_forward_root = None
    state._state_ctx.post_backward_final_callback_queued = False


def _drop_unsharded_gradients(root: nn.Module) -> None:
    """The failed iteration's unsharded gradients: torch's reset keeps them, and the next
    backward would add to them (a capture's backward assigns ``.grad`` on the host even though
    it runs no kernel). The step runs the failed call again eagerly from a window's start."""
    for state in _states(root):
        for group in _param_groups(state):
            for fsdp_param in group.fsdp_params:
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None
                fsdp_param.unsharded_accumulated_grad = None


def _reset_group(group: Any) -> None:
    """``FSDPParamGroup._reset_iter_state`` of torch 2.12."""
    stream = group.device_handle.current_stream()
    result = group._all_gather_result
    if result is not None:
        if result.all_gather_event is not None:
            stream.wait_event(result.all_gather_event)
        if isinstance(result.all_gather_work, dist.distributed_c10d.Work):
            result.all_gather_work.wait()
        group._all_gather_result = None
    if group._post_reduce_event is not None:
        stream.wait_event(group._post_reduce_event)
        group._post_reduce_event = None
    if group._all_reduce_state is not None and group._all_reduce_state.event is not None:
        stream.wait_event(group._all_reduce_state.event)
    group._all_reduce_state = None
    if group._reshard_after_forward_event is not None:
        group._wait_all_gather_streams_on_event(group._reshard_after_forward_event)
        group._reshard_after_forward_event = None
    group._partial_reduce_output = None
    group._post_forward_indices.clear()
    group._training_state = type(group._training_state).IDLE
    group._to_sharded()


def fsdp2_pending(root: nn.Module) -> list[str]:
    """What FSDP2 holds from eager work that a capture must not inherit; empty when idle."""
    pending: list[str] = []
    for name, module in root.named_modules():
        if not is_fsdp2(module):
            continue
        state = module._get_fsdp_state()
        where = name or "the root"
        if state._training_state.name != "IDLE":
            pending.append(f"{where} in state {state._training_state.name}")
        for group in _param_groups(state):
            for attr in (
                "_all_gather_result",
                "_post_reduce_event",
                "_all_reduce_state",
                "_reshard_after_forward_event",
            ):
                if getattr(group, attr, None) is not None:
                    pending.append(f"{where}: {attr.lstrip('_').replace('_', ' ')}")
            if group._training_state.name != "IDLE":
                pending.append(f"{where}: parameter group in state {group._training_state.name}")
    states = _states(root)  # one communication context, shared by every state of the root
    ctx = getattr(states[0], "_comm_ctx", None) if states else None
    if ctx is not None:
        if getattr(ctx, "all_gather_state", None) is not None:
            pending.append("the last all-gather's buffer (comm_ctx.all_gather_state)")
        if getattr(ctx, "reduce_scatter_states", None) or getattr(
            ctx, "reduce_scatter_state", None
        ):
            pending.append("reduce-scatter inputs (comm_ctx.reduce_scatter_states)")
        if getattr(ctx, "_last_post_reduce_events", None):
            pending.append("post-reduce events (comm_ctx._last_post_reduce_events)")
    return pending


def _offloading(root: nn.Module) -> str | None:
    """The first sharded module with a CPUOffloadPolicy, or None."""
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy
    except ImportError:
        return None
    for name, module in root.named_modules():
        if not is_fsdp2(module):
            continue
        for group in _param_groups(module._get_fsdp_state()):
            if isinstance(getattr(group, "offload_policy", None), CPUOffloadPolicy):
                return name or "the root"
    return None


def _reshard_after_no_grad_forward(module: nn.Module, args: Any, output: Any) -> None:
    if not torch.is_grad_enabled():
        module.reshard()  # type: ignore[operator]


# --------------------------------------------------------------------- checks and sharding
def sharded_root(module: nn.Module) -> nn.Module:
    """FSDP2's root for the module TrainStep calls: ``module`` itself if ``fully_shard`` was run
    on it, else the one sharded submodule that holds every parameter (``module`` only wraps it,
    as GraphTrainer's loss module wraps the model the Trainer sharded). Refuses a model whose
    blocks were sharded without the root, and a DDP inside."""
    check_sharded_root(module)
    if is_fsdp2(module):
        return module
    outer: list[nn.Module] = [
        sub
        for name, sub in module.named_modules()
        if is_fsdp2(sub) and not any(is_fsdp2(module.get_submodule(a)) for a in _ancestors(name))
    ]
    return outer[0]


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def check_sharded_root(module: nn.Module) -> None:
    """The module TrainStep calls must be FSDP2's root, or a module around it with no parameters
    of its own, and must not also be DDP-wrapped."""
    from torch.nn.parallel import DistributedDataParallel

    sharded = find_fsdp2(module)
    if sharded and "" not in sharded and not _wraps_one_root(module, sharded):
        raise ConfigError(
            f"the model's submodules {sharded[:3]} were sharded with fully_shard, but the model "
            "itself was not; call fully_shard(model) last (the root), as FSDP2's docs do."
        )
    wrapped = [n for n, m in module.named_modules() if isinstance(m, DistributedDataParallel)]
    if wrapped:
        raise ConfigError(
            f"the model is sharded with fully_shard and also holds a DistributedDataParallel "
            f"({wrapped[0] or 'the root'}); use one of them: pass the fully_shard-ed module "
            "without DDP (FSDP2 reduces the gradients itself)."
        )


def _wraps_one_root(module: nn.Module, sharded: list[str]) -> bool:
    """Whether ``module`` only wraps one sharded root: one outermost sharded submodule, and
    every parameter of ``module`` inside it."""
    outer = [n for n in sharded if not any(a in sharded for a in _ancestors(n))]
    if len(outer) != 1:
        return False
    inside = {id(p) for p in module.get_submodule(outer[0]).parameters()}
    return all(id(p) in inside for p in module.parameters())


def check_not_fsdp1(model: object) -> None:
    """Refuse FSDP1 (``FullyShardedDataParallel``): its flat parameters and hooks are not
    captured; FSDP2's ``fully_shard`` is."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return
    if not isinstance(model, nn.Module):
        return
    found = [n for n, m in model.named_modules() if isinstance(m, FullyShardedDataParallel)]
    if found:
        raise ConfigError(
            f"the model is wrapped in FSDP1's FullyShardedDataParallel ({found[0] or 'the root'})"
            ", which TrainStep cannot capture; shard it with FSDP2 instead: "
            "torch.distributed.fsdp.fully_shard(block) for each block, then fully_shard(model), "
            "or pass the bare model with TrainStep(..., parallel='fsdp2')."
        )


def shard_blocks(model: nn.Module) -> dict[int, nn.Parameter]:
    """``TrainStep(..., parallel="fsdp2")``'s policy for a plain model: ``fully_shard`` each
    child with parameters of every ``nn.ModuleList`` / ``nn.Sequential`` (the blocks of a
    transformer, the layers of a Sequential; outermost lists only), then the model itself (the
    root: embeddings, heads and whatever else is left). The default mesh spans every rank;
    parameters stay in their dtype (``amp=`` autocasts). Returns each replaced parameter's new
    DTensor parameter by the old one's ``id`` (``fully_shard`` replaces them: an optimizer built
    before is pointed at the new ones by :meth:`FSDP2.take_optimizer`).

    A model that needs another policy (a mesh of its own, ``MixedPrecisionPolicy``,
    ``reshard_after_forward``) is sharded by the script and passed as it is.
    """
    from torch.distributed.fsdp import fully_shard

    before = dict(model.named_parameters())
    modules = dict(model.named_modules())
    for name in _block_names(model):
        fully_shard(modules[name])
    fully_shard(model)
    after = dict(model.named_parameters())
    return {id(old): after[name] for name, old in before.items() if after[name] is not old}


def _block_names(model: nn.Module) -> list[str]:
    names: list[str] = []
    containers: list[str] = []
    for name, module in model.named_modules():
        if any(c == "" or name.startswith(c + ".") for c in containers):
            # inside a list already chosen (the root itself, for a Sequential model: every
            # name is inside it): its children are the blocks, sharded whole, never a list of
            # theirs first (a nested list sharded after its block is sharded twice)
            continue
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            containers.append(name)
            prefix = f"{name}." if name else ""
            names.extend(
                prefix + child
                for child, sub in module.named_children()
                if any(True for _ in sub.parameters())
            )
    return names
