"""The table behind :func:`ddpgraph.errors.explain`: known error texts, their causes and fixes.

Data only, kept apart from ``errors.py`` so the exception types stay readable. Each row names an
error by a regular expression and lists its causes, most likely first; a cause whose ``evidence``
shows in the text moves ahead of those whose evidence does not. Rows are ordered so that a
specific root cause wins over the generic failure it leads to (a peer that exited or a network
fault before a collective timeout; the first capture error before "previous error during
capture").

Patterns and evidence are matched against the text with all whitespace removed and its letters
lowered (so a message wrapped over lines, even inside a word, still matches), so they are written
without ``\\s`` or ``\\b``: their spaces are only for reading and are dropped when compiled.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from .facts import WARMUP_RULE

__all__ = ["KNOWN", "Cause", "Known", "squeezed_regex"]


def squeezed_regex(pattern: str) -> re.Pattern[str]:
    """``pattern`` compiled to match text whose whitespace was removed and letters lowered.

    Its own spaces are dropped and its letters lowered too: matching lowered text is several
    times faster than ``re.IGNORECASE``, which matters for long logs.
    """
    if re.search(r"\\[A-Z]", pattern):  # lowering \D, \S, \W, ... would invert them
        raise ValueError(f"pattern {pattern!r} uses an upper-case escape; write it another way")
    return re.compile(pattern.replace(" ", "").lower())


def _seen(pattern: str) -> Callable[[str], bool]:
    regex = squeezed_regex(pattern)
    return lambda squeezed: regex.search(squeezed) is not None


@dataclass(frozen=True)
class Cause:
    """One cause of a known error: ``title``, what happened (``cause``), the ``fix``, and ``tell``,
    how to recognise this cause among the error's others."""

    id: str
    title: str
    cause: str
    fix: str
    tell: str = ""
    evidence: Callable[[str], bool] | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class Known:
    """A known error: ``id``, the ``pattern`` that recognises it, its ``title`` and its causes."""

    id: str
    pattern: re.Pattern[str]
    title: str
    causes: tuple[Cause, ...]


def _known(id: str, pattern: str, title: str, *causes: Cause) -> Known:
    return Known(id, squeezed_regex(pattern), title, causes)


def _single(id: str, pattern: str, title: str, cause: str, fix: str) -> Known:
    return _known(id, pattern, title, Cause(id, title, cause, fix))


def _more_workers_than_world_size(squeezed: str) -> bool:
    # torch prints "(world_size=2, worker_count=4, timeout=0:30:00)": more arrivals than ranks
    # means two launches share one store; fewer means some rank never arrived.
    found = re.search(r"world_size=(\d+),worker_count=(\d+)", squeezed)
    return found is not None and int(found.group(2)) > int(found.group(1))


_WARMUP_FIX = f"{WARMUP_RULE}; ddpgraph.TrainStep does this for you"
_NCCL_ANY = _seen(r"ProcessGroupNCCL|watchdog|WorkNCCL|NCCL")

KNOWN: tuple[Known, ...] = (
    # --- CUDA-graph capture: the first error of a capture before its consequences ------------
    _single(
        "ddp-default-stream",
        r"would make the legacy stream depend on a capturing blocking stream",
        "DDP (or other work) on the default stream while capturing",
        "the captured code synchronised with the legacy default stream; with DDP this happens "
        "when the DistributedDataParallel model was constructed on the default stream, so its "
        "reducer's all-reduce and copies are ordered after it",
        "create a side stream s = torch.cuda.Stream(), build DDP, the optimizer and the warm-up "
        "under `with torch.cuda.stream(s):`, and capture with `torch.cuda.graph(g, stream=s)`; "
        "ddpgraph.TrainStep does this for you",
    ),
    _single(
        "optimizer-not-capturable",
        r"Attempting (?:CUDA|XPU) graph capture of step\(\)",
        "optimizer not capturable",
        "the optimizer keeps its step counters on the CPU and reads them on the host, which a "
        "CUDA graph cannot capture (Adam, AdamW, NAdam, RAdam, Adamax, ASGD, ...)",
        "construct the optimizer with capturable=True (e.g. torch.optim.AdamW(params, lr=..., "
        "capturable=True)) before the warm-up, and keep the same setting when loading its state",
    ),
    _known(
        "optimizer-step-on-cuda",
        r"If capturable=False, state_steps should not be CUDA tensors",
        "optimizer step counters on the GPU of a non-capturable optimizer",
        Cause(
            "state-moved-to-gpu",
            "optimizer state moved to the GPU",
            "the optimizer's 'step' counters were moved to the GPU when its state was loaded or "
            "resumed, by torch 1.12.0's Optimizer.load_state_dict or by code that calls .cuda() "
            "on every tensor in optimizer.state",
            "upgrade to torch >= 1.12.1, and when moving optimizer state to the GPU skip the "
            "'step' entries (for k, v in state.items(): if k != 'step': state[k] = v.cuda())",
            tell="the error comes on the first step after loading a checkpoint or resuming",
            evidence=_seen(r"load_state_dict|checkpoint|resum|1\.12"),
        ),
        Cause(
            "capturable-state-loaded",
            "capturable state loaded into a non-capturable optimizer",
            "state saved by an optimizer built with capturable=True (step counters on the GPU) "
            "was loaded into one built with capturable=False",
            "build the optimizer that loads the state with the same capturable setting as the "
            "one that saved it",
            tell="the checkpoint came from a CUDA-graph run (TrainStep, capturable=True)",
        ),
    ),
    _known(
        "capturable-needs-cuda",
        r"If capturable=True, params and state_steps must be (?:CUDA|on supported devices)",
        "capturable optimizer with parameters or step counters off the GPU",
        Cause(
            "params-on-cpu",
            "parameters on the CPU",
            "capturable=True keeps every parameter and step counter on the GPU, but some "
            "parameters (or the step counters loaded from a checkpoint) are on the CPU",
            "move the model to the GPU before building the optimizer (and before "
            "optimizer.load_state_dict), or pass capturable=False when you do not capture "
            "CUDA graphs",
            tell="some parameters live on the CPU, or the state came from a CPU checkpoint",
        ),
        Cause(
            "group-capturable-mismatch",
            "capturable set per parameter group only",
            "torch 1.12-1.13 created the step counters from the constructor's capturable "
            "default, so a param group with capturable=True but a constructor default of False "
            "got CPU counters (pytorch#89987)",
            "pass capturable=True to the optimizer constructor itself, not only in a param "
            "group, or upgrade to torch >= 2.0",
            tell="param_groups set 'capturable' themselves, or capturable was flipped after "
            "construction (optimizer.param_groups[0]['capturable'] = True)",
            evidence=_seen(
                r"param_?groups?|parameter groups?|'capturable'|\"capturable\"|1\.1[23]"
            ),
        ),
    ),
    _single(
        "capture-cpu-copy",
        r"Cannot copy between CPU and CUDA tensors during CUDA graph capture",
        "a pageable CPU tensor copied to the GPU inside CUDA-graph capture",
        "the captured code builds a tensor on the CPU and moves it to the GPU (torch.tensor(...)"
        ".to(device), a Python list turned into a tensor each step); a graph cannot replay a copy "
        "from pageable host memory. In transformers this is the attention-mask code of "
        "attn_implementation='eager', and the KV cache a model builds when its config says "
        "use_cache=True (Mistral's sliding-window cache, cache_utils.py)",
        "create the tensor on the device (torch.tensor(..., device=x.device)) or once, outside "
        "the step, as a buffer; for transformers train with model.config.use_cache = False "
        "(training needs no KV cache) and attn_implementation='sdpa', or pass a prebuilt 4-D "
        "float attention mask",
    ),
    _known(
        "capture-not-permitted",
        r"operation not permitted when stream is capturing|cudaErrorStreamCaptureUnsupported"
        r"|CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
        "a forbidden call inside CUDA-graph capture",
        Cause(
            "ddp-warmup",
            "DDP timing a captured iteration (warm-up count)",
            "DDP's runtime-stats logging records CUDA-event timers at iterations 1..10 and every "
            "100th and reads them on the host in the next forward "
            "(DistributedDataParallel._pre_forward -> set_runtime_stats_and_log), which a "
            "capture forbids",
            _WARMUP_FIX,
            tell="the traceback goes through DistributedDataParallel._pre_forward or "
            "set_runtime_stats_and_log",
            # only the failing frame: every DDP forward passes through distributed.py's forward
            evidence=_seen(r"set_runtime_stats_and_log|_pre_forward"),
        ),
        Cause(
            "host-sync",
            "a host synchronisation in the captured code",
            "something in the captured region waited for the GPU: .item(), .cpu(), .tolist(), "
            "print(tensor), torch.cuda.synchronize(), a data-dependent shape (nonzero, "
            "one-argument torch.where, masked_select) or a stream/device synchronize",
            "move every .item()/.cpu()/print of a tensor and every synchronize out of the "
            "captured region (read the static outputs after g.replay()), and replace "
            "data-dependent shapes with fixed-size ops (e.g. torch.where(mask, a, b))",
            tell="the failing frame is .item(), .cpu(), nonzero/where, print or a "
            "*Synchronize call",
            evidence=_seen(
                r"\.item\(|\.cpu\(|\.tolist\(|synchroni[sz]e|nonzero|torch\.where\("
                r"|masked_select|is_nonzero|cudaMemcpy(?!Async)"
            ),
        ),
        Cause(
            "device-mismatch",
            "the current device is not the capture device",
            "the capture stream or the captured tensors are on another GPU than the current "
            "device, so allocations and library handles are made on the current device (cuda:0 "
            "unless set) during the capture",
            "call torch.cuda.set_device(capture_device) before creating the side stream, the "
            "warm-up and the capture (ddpgraph.init() binds LOCAL_RANK's GPU for you)",
            tell="only on hosts with several GPUs, when the model is on cuda:1 or higher",
            evidence=_seen(
                r"cuda:[1-9]|more than (?:1|one) gpu|[2-9] gpus|set_device|cuda\.device\("
            ),
        ),
        Cause(
            "uncaptured-setup",
            "warm-up missing, or run on another stream or thread",
            "one-time setup (cuBLAS/cuDNN workspaces, kernel module loading, allocator growth) "
            "ran inside the capture because the warm-up was skipped or ran on the default "
            "stream, or another thread made a CUDA call that is unsafe during a global-mode "
            "capture",
            "warm up the exact captured code for a few iterations on the side stream you "
            "capture on (s.wait_stream(torch.cuda.current_stream()); with "
            "torch.cuda.stream(s): ...; torch.cuda.current_stream().wait_stream(s)) and keep "
            "other threads' CUDA work out of the capture (capture_error_mode='thread_local')",
            tell="the failing call loads a module, creates a cuBLAS/cuDNN handle or workspace, "
            "or runs in another thread",
            evidence=_seen(r"load_module|moduleload|cublas|cudnn|workspace|cudaMalloc(?!Async)"),
        ),
    ),
    _single(
        "capture-previous-error",
        r"operation failed due to a previous error during capture"
        r"|STREAM_CAPTURE_INVALIDATED|cudaErrorStreamCaptureInvalidated",
        "capture aborted by an earlier error",
        "an earlier operation in the same capture failed (often 'operation would make the "
        "legacy stream depend on a capturing blocking stream' or 'operation not permitted when "
        "stream is capturing'); this message is only the consequence",
        "scroll up to the first CUDA error of the capture and fix that one; run `ddpgraph lint` "
        "on the script to find the usual causes (DDP stream, warm-up count, .item() in capture)",
    ),
    # --- setup: launch, rendezvous, process group -----------------------------------------
    _single(
        "duplicate-gpu",
        r"Duplicate GPU detected|ncclInvalidUsage",
        "two ranks on one GPU",
        "two ranks of a host use the same GPU, nearly always because torch.cuda.set_device("
        "LOCAL_RANK) was never called or a device is hard-coded, so every rank uses cuda:0 (or "
        "two ranks were given the same CUDA_VISIBLE_DEVICES)",
        "call ddpgraph.init() - or torch.cuda.set_device(local_rank) and "
        "init_process_group('nccl', device_id=torch.device('cuda', local_rank)) - before any "
        "CUDA work or collective, and do not hard-code a device; run `ddpgraph doctor` to "
        "check the devices",
    ),
    _known(
        "unused-parameters",
        r"Expected to have finished reduction in the prior iteration"
        r"|parameters that were not used in producing (?:the )?loss"
        r"|did not receive grad for rank",
        "DDP found parameters without gradients",
        Cause(
            "unused-in-forward",
            "parameters unused in forward",
            "some parameters took no part in this iteration's forward (a branch not taken, a "
            "frozen or auxiliary head, a module built but never called), so DDP's reducer "
            "waited for their gradients and never finished the previous iteration's reduction",
            "pass find_unused_parameters=True to DistributedDataParallel (Lightning: "
            "strategy='ddp_find_unused_parameters_true'), or delete the unused modules or set "
            "requires_grad=False on them; TORCH_DISTRIBUTED_DEBUG=DETAIL names them",
            tell="the model has branches, optional heads or frozen parts; "
            "TORCH_DISTRIBUTED_DEBUG=DETAIL lists the parameters by name",
        ),
        Cause(
            "output-not-in-loss",
            "a forward output left out of the loss",
            "every parameter ran in forward, but an output of forward did not feed the loss, "
            "so the parameters behind it got no gradient",
            "make every output of forward contribute to the loss (or return only what the loss "
            "uses); find_unused_parameters=True does not help here, static_graph=True can",
            tell="the error stays with find_unused_parameters=True already set",
            evidence=_seen(r"find_unused_parameters=True was specified|already (?:set|enabled)"),
        ),
    ),
    _known(
        "variable-ready-twice",
        r"Expected to mark a variable ready only once|has been marked as ready twice",
        "DDP saw a parameter's gradient twice in one backward",
        Cause(
            "reentrant-checkpointing",
            "reentrant activation checkpointing",
            "activation checkpointing with the reentrant implementation (torch.utils.checkpoint "
            "with use_reentrant=True, or gradient_checkpointing_enable() in older transformers) "
            "runs a second backward through the checkpointed layers, so DDP's hooks fire twice "
            "for their parameters",
            "use non-reentrant checkpointing (checkpoint(fn, x, use_reentrant=False); "
            "transformers: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
            "{'use_reentrant': False})), or DistributedDataParallel(..., static_graph=True) "
            "when the graph does not change between iterations",
            tell="it appears as soon as gradient checkpointing is switched on",
        ),
        Cause(
            "param-used-outside-forward",
            "a parameter used outside the DDP forward",
            "a parameter of the wrapped module is used outside its forward (read from "
            "model.module directly, or shared by two forwards before one backward), so its "
            "gradient arrives through two paths",
            "use parameters only inside the DDP module's forward (return what the loss needs "
            "from forward) and call the DDP module once per backward",
            tell="no checkpointing; TORCH_DISTRIBUTED_DEBUG=DETAIL names the parameter, which "
            "the code also touches outside forward",
        ),
    ),
    _known(
        "model-mismatch",
        r"DDP expects same model across all ranks",
        "ranks built different models",
        Cause(
            "rank-dependent-model",
            "the model is built differently on some ranks",
            "DDP compares the parameters that require grad on every rank, and they differ: code "
            "that depends on the rank (adapters, LoRA or a checkpoint applied on rank 0 only, a "
            "config or branch read differently) built another model on some ranks",
            "build the same model on every rank before wrapping it in DDP - run the adapter, "
            "LoRA and checkpoint code on all ranks - and compare sum(p.numel() for p in "
            "model.parameters() if p.requires_grad) across ranks",
            tell="the counts differ but are not zero",
        ),
        Cause(
            "frozen-on-some-ranks",
            "nothing trainable on some ranks",
            "a rank reports 0 parameters: every parameter there has requires_grad=False (e.g. "
            "the adapter was enabled, or unfrozen, on one rank only)",
            "set requires_grad (or enable the adapter) the same way on every rank before DDP",
            tell="a rank has inconsistent 0 params",
            evidence=_seen(r"inconsistent 0 params"),
        ),
    ),
    _known(
        "pg-not-initialized",
        r"Default process group has not been initialized|Default process group is not initialized",
        "torch.distributed used before init_process_group",
        # SyncBatchNorm first: most public threads about this error end with "use BN on one GPU"
        Cause(
            "sync-batchnorm",
            "SyncBatchNorm in a single-process run",
            "the model uses SyncBatchNorm (or the config's SyncBN), which needs a process group "
            "even on one GPU",
            "use BatchNorm for single-GPU runs (norm_cfg type 'BN', NORM 'BN', or "
            "torch.nn.SyncBatchNorm only when world_size > 1), or init a one-process group "
            "first: init_process_group('gloo', init_method='tcp://127.0.0.1:29500', rank=0, "
            "world_size=1)",
            tell="the model or config uses SyncBatchNorm/SyncBN, and the run has one process",
            evidence=_seen(r"SyncBatchNorm|SyncBN|sync_batch_norm"),
        ),
        Cause(
            "not-launched",
            "started as one plain process",
            "the script was run as a single plain process (python train.py) without torchrun "
            "or the project's distributed launcher flag, so init_process_group never ran while "
            "a distributed call (barrier, all_reduce, get_rank) still did",
            "start it with torchrun --nproc_per_node=N train.py (or the project's launcher "
            "option such as --launcher pytorch), or guard the calls with "
            "torch.distributed.is_initialized() for single-process runs",
            tell="no SyncBatchNorm; the traceback ends in a barrier, reduce or get_rank call of "
            "a script started with python instead of torchrun",
            evidence=_seen(r"barrier\(|get_rank\(|get_world_size\(|all_reduce\("),
        ),
    ),
    _known(
        "address-in-use",
        r"Address already in use|errno: ?98|EADDRINUSE"
        r"|server socket has failed to listen on any local network address",
        "rendezvous port already in use",
        Cause(
            "port-taken",
            "the port is held by another job",
            "the rendezvous port (MASTER_PORT, 29500 by default, or the --rdzv-endpoint port, "
            "29400 for c10d) is already held by another job on this host or by a leftover "
            "process of an earlier run",
            "give each job its own port (torchrun --master_port=29501 ..., or --standalone / "
            "--rdzv-endpoint=localhost:0 on one node to pick a free one) and kill leftover "
            "workers (`lsof -i :29500`)",
            tell="another training job or a crashed run's workers are still alive on this host",
        ),
        Cause(
            "two-store-hosts",
            "more than one process hosts the store",
            "two processes (or two calls) each tried to host the TCP store on the same port: "
            "every process thinks it is rank 0 (rank or --local_rank hard-coded or passed on the "
            "command line) or init_process_group was called twice",
            "let the launcher set RANK/LOCAL_RANK (do not pass --local_rank 0 or rank=0 "
            "yourself) and call init_process_group once per process",
            tell="it fails even with a fresh port and a single job; rank 0 appears more than once",
            evidence=_seen(r"--local_rank(?:=)?0|local-rank(?:=)?0"),
        ),
    ),
    _known(
        "store-barrier-timeout",
        r"Timed out initializing process group in store based barrier",
        "not every rank joined the process group",
        Cause(
            "missing-workers",
            "some ranks never arrived",
            "fewer processes reached init_process_group than world_size (worker_count < "
            "world_size): a node or rank did not start, crashed before init, cannot reach "
            "MASTER_ADDR:MASTER_PORT, or world_size is larger than the number launched",
            "check that nnodes x nproc_per_node equals world_size and that every node runs the "
            "command with the same MASTER_ADDR/MASTER_PORT, then read the missing ranks' logs",
            tell="worker_count in the message is smaller than world_size",
        ),
        Cause(
            "too-many-workers",
            "two launches share one store",
            "more processes joined than world_size (worker_count > world_size): the job was "
            "started twice on the same store, e.g. srun tasks that each mp.spawn, two jobs on "
            "one MASTER_PORT, or a file:// init file left by an earlier run",
            "launch each rank once (one launcher per node, not srun plus mp.spawn), give each "
            "job its own MASTER_PORT, and delete a stale file:// init file before starting",
            tell="worker_count in the message is larger than world_size",
            evidence=_more_workers_than_world_size,
        ),
    ),
    _known(
        "nccl-id-timeout",
        r"ncclUniqueId from \[\d+\] via c10d",
        "rank 0 did not publish the NCCL id in time",
        Cause(
            "root-late-or-dead",
            "rank 0 late or dead",
            "the other ranks waited in their first collective for rank 0's NCCL id, but rank 0 "
            "was still busy in rank-0-only work (preprocessing, downloading, loading a "
            "checkpoint) or had crashed, and the store timeout ran out",
            "read rank 0's log first; run the rank-0-only work before init_process_group or on "
            "every rank, or raise init_process_group(timeout=...) above its duration",
            tell="rank 0's log shows it still working or an earlier error",
        ),
        Cause(
            "store-unreachable",
            "the store or rank 0 is unreachable",
            "this rank cannot reach rank 0 over the network the store and NCCL bootstrap use "
            "(firewall, wrong interface, a multi-homed host)",
            "make MASTER_ADDR an address every node reaches, open MASTER_PORT, and set "
            "NCCL_SOCKET_IFNAME (and GLOO_SOCKET_IFNAME) to that interface",
            tell="it fails at once on a fresh start, only across nodes",
            evidence=_seen(r"Connection refused|No route to host|Network is unreachable"),
        ),
    ),
    _single(
        "nccl-no-gather",
        r"ProcessGroupNCCL does not support (?:gather|scatter)",
        "gather or scatter on NCCL with torch < 1.11",
        "torch older than 1.11 has no NCCL gather/scatter, so dist.gather, dist.scatter and "
        "gather_object on an NCCL group raise",
        "upgrade to torch >= 1.11, or use all_gather / all_gather_object, or pass a gloo group "
        "(group=dist.new_group(backend='gloo')) to gather",
    ),
    # --- failures while running: root causes before the failures they lead to ---------------
    _single(
        "oom",
        r"CUDA out of memory|OutOfMemoryError|Cuda failure '?out of memory",
        "GPU out of memory",
        "an allocation did not fit on the GPU (on any rank: NCCL logs it as \"Cuda failure 'out "
        "of memory'\"); a CUDA graph keeps a private memory pool alive, and several ranks on one "
        "GPU multiply the usage",
        "reduce the batch size, capture once (not per shape), make sure each rank uses its own "
        "GPU (ddpgraph.init()), and free old graphs before capturing new ones",
    ),
    _known(
        "illegal-memory-access",
        r"an illegal memory access was encountered|illegal memory access"
        r"|cudaErrorIllegalAddress|CUDA_ERROR_ILLEGAL_ADDRESS",
        "illegal memory access",
        Cause(
            "kernel-before",
            "a kernel that ran earlier",
            "a kernel launched before this call (a custom or Triton kernel, an out-of-range "
            "index, a tensor on another device) faulted, and the error is only reported now "
            "because CUDA errors are asynchronous and sticky - NCCL's watchdog merely polls its "
            "collective's event",
            "rerun with CUDA_LAUNCH_BLOCKING=1 (and TORCH_USE_CUDA_DSA or compute-sanitizer) so "
            "the error is raised at the faulting kernel, then fix its indices or inputs",
            tell="with CUDA_LAUNCH_BLOCKING=1 the traceback stops in a compute kernel",
            # not "kernel": torch appends "CUDA kernel errors might be asynchronously reported"
            evidence=_seen(r"watchdog|ProcessGroupNCCL|WorkNCCL|Triton|flash_attn"),
        ),
        Cause(
            "nccl-p2p",
            "NCCL peer-to-peer transfers",
            "NCCL's direct GPU-to-GPU (P2P) path faulted: PCIe ACS/IOMMU settings, a "
            "virtualised host or consumer GPUs that advertise but do not support P2P",
            "rerun with NCCL_P2P_DISABLE=1; if it then works, disable ACS/IOMMU in the BIOS or "
            "kernel (iommu=pt) or keep NCCL_P2P_DISABLE=1, and check `nvidia-smi topo -m`",
            tell="it goes away with NCCL_P2P_DISABLE=1, and appears only with several GPUs "
            "of one host",
            evidence=_NCCL_ANY,
        ),
        Cause(
            "graph-memory",
            "a CUDA graph replayed on freed memory",
            "a CUDA-graph replay read or wrote memory that was freed or re-allocated after "
            "capture: its static inputs/outputs were re-bound instead of updated, or its memory "
            "pool was released",
            "keep every static tensor of a graph alive and update it with .copy_() instead of "
            "re-binding; do not free the graph's pool while the graph may replay",
            tell="it starts at g.replay() and not in eager steps",
            evidence=_seen(r"replay|cuda_?graph"),
        ),
    ),
    _known(
        "peer-gone",
        r"remote process exited|ncclRemoteError|Connection (?:closed|reset) by (?:remote )?peer"
        r"|Broken pipe",
        "a peer rank is gone",
        Cause(
            "remote-exited",
            "another rank exited",
            "another rank exited or crashed (or destroyed its process group) while this rank "
            "was still inside a collective with it; this rank's error is only the consequence",
            "find the first error in the other ranks' logs (torchrun prints the root-cause "
            "rank); make every rank reach the same collectives, and call ddpgraph.shutdown() "
            "on all ranks at the end",
            tell="another rank's log shows an earlier exception, a signal or an exit code",
            evidence=_seen(r"exitcode|exit code|SIGKILL|SIGSEGV|Segmentation|ChildFailedError"),
        ),
        Cause(
            "network-fault",
            "a network fault between nodes",
            "the link between ranks failed: an InfiniBand/RoCE error (NET/IB completion with "
            "error, vendor err), a flapping port, or connections set up on an interface the "
            "peers cannot reach",
            "run with NCCL_DEBUG=INFO and check the NET/IB lines and `ibstat` on the failing "
            "nodes, drain nodes with IB errors, and set NCCL_SOCKET_IFNAME to the interface the "
            "nodes share",
            tell="every rank is alive until the error; NCCL WARN lines name NET/IB or a socket "
            "peer; it may happen already in init_process_group",
            evidence=_seen(
                r"NET/IB|NET/OFI|ib_plugin|ibv_|vendor err|InfiniBand|Network is unreachable"
                r"|_set_sequence_number_for_group"
            ),
        ),
    ),
    _known(
        "nccl-cuda-error",
        r"unhandled cuda error|ncclUnhandledCudaError",
        "a CUDA call inside NCCL failed",
        Cause(
            "earlier-cuda-error",
            "an earlier CUDA error surfaced in NCCL",
            "a CUDA call NCCL made failed, often because of an earlier asynchronous error on "
            "this GPU or a resource it could not get; the 'Cuda failure' line under 'Last "
            "error' names it",
            "rerun with NCCL_DEBUG=INFO and CUDA_LAUNCH_BLOCKING=1 and fix the failure the "
            "'Cuda failure' line names",
            tell="NCCL_DEBUG=INFO prints a 'Cuda failure N' line naming the CUDA error",
        ),
        Cause(
            "driver-fault",
            "a broken driver or GPU state",
            "the driver or a GPU is in a bad state or does not match the CUDA runtime (Cuda "
            "failure 999 'unknown error', often after a driver update without a reboot, in "
            "WSL or in a container with the wrong driver libraries)",
            "check that `nvidia-smi` and a one-GPU CUDA program work, reboot or reload the "
            "driver, and use a torch build whose CUDA version the driver supports",
            tell="'Cuda failure 999' or 'unknown error'; even a single-GPU CUDA call fails",
            evidence=_seen(r"failure 999|unknown error|driver"),
        ),
        Cause(
            "p2p-unsupported",
            "peer-to-peer access not supported",
            "NCCL tried direct GPU-to-GPU access that this host does not support",
            "set NCCL_P2P_DISABLE=1 (or NCCL_P2P_LEVEL=SYS) and check `nvidia-smi topo -m`",
            tell="'peer access is not supported' in the last error",
            evidence=_seen(r"peer access|P2P"),
        ),
    ),
    _known(
        "nccl-system-error",
        r"unhandled system error|ncclSystemError",
        "a system call inside NCCL failed",
        # shared memory first: most single-node threads about this error end with --ipc=host
        Cause(
            "shared-memory",
            "shared memory too small or not writable",
            "NCCL could not create its shared-memory segments in /dev/shm: a container's 64 MB "
            "default is too small, or /dev/shm is not writable",
            "start the container with --ipc=host or --shm-size=16g and make /dev/shm writable "
            "(or set NCCL_SHM_DISABLE=1 at some speed cost)",
            tell="single-node jobs, often in Docker/Kubernetes; NCCL_DEBUG=INFO shows a WARN "
            "naming shm_open or /dev/shm",
            evidence=_seen(r"shm|docker|container|No space left|Bus error"),
        ),
        Cause(
            "network-setup",
            "sockets or network devices",
            "NCCL could not open or connect its sockets or network devices: a wrong or "
            "unreachable interface, a firewall between nodes, or a misconfigured InfiniBand",
            "rerun with NCCL_DEBUG=INFO and read the 'NCCL WARN' line; set NCCL_SOCKET_IFNAME "
            "to the interface the nodes reach each other on, and try NCCL_IB_DISABLE=1 to test "
            "without InfiniBand",
            tell="multi-node jobs; the WARN line names a socket connect, an interface or NET/IB",
            # not plain "socket": old messages always say "System call (socket, malloc, ...)"
            evidence=_seen(
                r"socketStartConnect|Connect to|Connection refused|NET/|ibv|nodes|multi-?node"
                r"|[0-9]\*[0-9]"
            ),
        ),
    ),
    _known(
        "collective-timeout",
        r"Watchdog caught collective operation timeout|collective operation timeout"
        r"|ProcessGroupNCCL.{0,160}?timed ?out",
        "a collective timed out",
        Cause(
            "rank-diverged",
            "a rank never reached the collective",
            "one rank did not reach a collective the others entered: it crashed, hangs "
            "elsewhere, or ranks call collectives in a different order or number (e.g. behind "
            "`if rank == 0`, or an uneven last batch)",
            "find the rank that is missing (the flight recorder, TORCH_NCCL_DUMP_ON_TIMEOUT=1 "
            "and `torchfrtrace`, names it) and make every rank issue the same collectives in "
            "the same order; bind each rank to its own GPU (ddpgraph.init())",
            tell="the ranks' SeqNum or OpType differ, or one rank's log stops earlier",
        ),
        Cause(
            "rank-slow",
            "a rank legitimately slower than the timeout",
            "every rank reaches the collective, but one arrives after the timeout because it "
            "does long rank-0-only work (evaluation, saving, data preprocessing) first",
            "move the long work out of the collective's path or onto every rank, or raise "
            "init_process_group(timeout=...) above its duration",
            tell="it happens right after evaluation, checkpointing or preprocessing on rank 0",
        ),
    ),
    _single(
        "object-collective",
        r"all_gather_object|gather_object|broadcast_object_list|scatter_object_list",
        "object collective failure or hang",
        "torch's object collectives pickle on the *current* CUDA device and need every rank to "
        "call them with an output list of exactly world_size entries; without set_device all "
        "ranks use cuda:0 and hang or fail, and a wrong-sized list raises or keeps silent Nones",
        "bind the device first (ddpgraph.init() or torch.cuda.set_device(local_rank)), size the "
        "output list with [None] * dist.get_world_size(), and call on every rank; "
        "ddpgraph.all_gather_object returns a correctly sized list and names the failing rank",
    ),
    _single(
        "devices-differ",
        r"Expected all tensors to be on the same device",
        "tensors on different devices",
        "an input or parameter is on another device than the model - often cuda:0 on every rank "
        "because the device was never bound",
        "bind the device with ddpgraph.init() (or torch.cuda.set_device(local_rank)) and move "
        "inputs with .to(device)",
    ),
)
