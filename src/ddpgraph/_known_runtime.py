"""Known error texts of process groups, NCCL, memory and object collectives (rows of ``explain()``)."""

from __future__ import annotations

from ._known_errors import (
    _NCCL_ANY,
    Cause,
    Known,
    _known,
    _more_workers_than_world_size,
    _seen,
    _single,
)

__all__ = ["RUNTIME"]

RUNTIME: tuple[Known, ...] = (
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
