"""Known error texts of CUDA-graph capture and of DDP's model checks (rows of ``explain()``)."""

from __future__ import annotations

from ._known_errors import _WARMUP_FIX, Cause, Known, _known, _seen, _single

__all__ = ["CAPTURE_AND_DDP"]

# Ops whose output size is the number of True values (matched in text without spaces, lowered):
# a boolean-mask index, x[mask] / x[:, ~mask] / x[mask.bool()] / x[labels != -100]; nonzero (not
# is_nonzero, a truth test); argwhere; masked_select; unique; one-argument torch.where.
_DATA_DEPENDENT_SHAPE = (
    r"[\w)\]]\[(?:(?::|\.\.\.),)*~?[\w.]*mask[\w.]*(?:\(\))?\]"
    r"|[\w)\]]\[[\w.]+(?:!=|==|>=|<=|>|<)-?[\w.]+\]"
    r"|(?<!is_)nonzero|argwhere|masked_select|torch\.unique\(|\.unique\("
    r"|torch\.where\((?:[^,()]|\([^()]*\))*\)"
)

CAPTURE_AND_DDP: tuple[Known, ...] = (
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
        "earlier-loss-graph-alive",
        r"AccumulateGrad node's stream does not match the stream of the node that produced",
        "an earlier loss's autograd graph kept alive across the capture",
        "a tensor from an earlier iteration (typically the script's last `loss` of eager steps "
        "run before the capture) still holds its autograd graph, and with it the parameters' "
        "AccumulateGrad nodes, made on another stream; the captured backward reuses them and "
        "syncs with that stream (seen with FSDP2 on torch 2.11, which then fails the capture)",
        "drop the reference before capturing (`del loss`, or keep `loss.item()` / "
        "`loss.detach()`); ddpgraph.TrainStep with FSDP2 names it and gives the parameters new "
        "accumulators itself",
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
    _single(
        "capture-generator-state",
        r"Cannot call CUDAGeneratorImpl::\w+ during CUDA graph capture"
        r"|set_current_seed can be called during stream capture only if new seed is the same",
        "the random generator's state read or set inside CUDA-graph capture",
        "the captured code reads or sets the generator's seed and offset: before torch 2.10 "
        "any read or set (torch.utils.checkpoint saving the state for its recompute, "
        "preserve_rng_state=True, its default; flash-attn's dropout; torch.compile tracing a "
        "new frame during capture), from torch 2.10 on a new seed (torch.manual_seed in the "
        "step) or a state read outside the capture",
        "upgrade to torch 2.10 or later, where a state read and set back within the capture "
        "(torch.utils.checkpoint's) is captured as a rewind; seed and compile before the step, "
        "not inside it; on older torch, where the checkpointed blocks draw no random numbers "
        "(no dropout, as in Llama-style models), pass preserve_rng_state=False",
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
            "data-dependent-shape",
            "a data-dependent shape in the captured code (x[mask], nonzero, masked_select)",
            "a boolean-mask index (x[mask], x[x > 0]), nonzero, argwhere, masked_select, unique "
            "or one-argument torch.where sizes its output by the number of True values; the CPU "
            "must read that count from the GPU before it can allocate the result, and a capture "
            "cannot wait for the GPU",
            "keep every shape fixed: compute on all positions and mask the result instead of "
            "selecting them (torch.where(mask, x, 0), x * mask, masked_fill, a loss over all "
            "positions with ignore_index=-100); a failed TrainStep capture names the line after "
            "'at'",
            tell="the failing line indexes a tensor with a boolean tensor (x[mask], "
            "x[labels != -100]) or calls nonzero, argwhere, masked_select, unique or "
            "one-argument torch.where; torch's frames show nonzero_cuda_out",
            evidence=_seen(_DATA_DEPENDENT_SHAPE),
        ),
        Cause(
            "host-sync",
            "a host synchronisation in the captured code",
            "something in the captured region waited for the GPU: .item(), .cpu(), .tolist(), "
            "print(tensor), `if tensor:`, torch.cuda.synchronize() or a stream/device "
            "synchronize",
            "move every .item()/.cpu()/print of a tensor and every synchronize out of the "
            "captured region (read the static outputs after g.replay())",
            tell="the failing frame is .item(), .cpu(), print, a truth test of a tensor or a "
            "*Synchronize call",
            evidence=_seen(
                r"\.item\(|\.cpu\(|\.tolist\(|synchroni[sz]e|is_nonzero|cudaMemcpy(?!Async)"
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
)
