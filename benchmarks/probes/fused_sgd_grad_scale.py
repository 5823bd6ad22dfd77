"""Does torch's fused SGD give the same new parameters when it unscales the gradients itself
(``grad_scale``, as a fused optimizer under ``GradScaler`` and TrainStep's fp16 step do) as when
they were unscaled before it (``GradScaler.unscale_``, as for a script's plain SGD)?

    python benchmarks/probes/fused_sgd_grad_scale.py [--device cuda] [--out FILE.json]

Random parameters, gradients and momentum buffers (float32, 1M elements), SGD(lr=0.02 as a float32
device tensor, momentum=0.9, weight_decay=1e-4), a power-of-two scale (so unscaling is exact):
the count of elements where the two new parameters (and momentum buffers) differ.
"""

from __future__ import annotations

import argparse
import json

import torch


def compare(device: str, scale: float = 32.0, n: int = 1 << 20) -> dict[str, object]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    p = torch.randn(n, generator=gen).to(device)
    g = (torch.randn(n, generator=gen) * 1e-2).to(device)
    buf = (torch.randn(n, generator=gen) * 1e-2).to(device)
    lr = torch.tensor(0.02, device=device)
    found_inf = torch.zeros((), device=device)
    options = dict(weight_decay=1e-4, momentum=0.9, lr=lr, dampening=0.0, nesterov=False,
                   maximize=False, is_first_step=False)  # fmt: skip

    def step(grad: torch.Tensor, **extra: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        params, bufs = [p.clone()], [buf.clone()]
        torch._fused_sgd_(params, [grad.clone()], bufs, **options, **extra)
        return params[0], bufs[0]

    unscaled = step(g, found_inf=found_inf)
    in_kernel = step(g * scale, grad_scale=torch.tensor(scale, device=device),
                     found_inf=found_inf)  # fmt: skip
    plain = step(g)
    rounded_once = (p.double() - lr.double() * unscaled[1].double()).float()
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "elements": n,
        "params_differ_unscaled_vs_grad_scale": int((unscaled[0] != in_kernel[0]).sum()),
        "buffers_differ_unscaled_vs_grad_scale": int((unscaled[1] != in_kernel[1]).sum()),
        "params_differ_unscaled_vs_no_found_inf": int((unscaled[0] != plain[0]).sum()),
        "unscaled_not_rounded_once": int((unscaled[0] != rounded_once).sum()),
        "grad_scale_not_rounded_once": int((in_kernel[0] != rounded_once).sum()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out")
    args = parser.parse_args()
    result = compare(args.device)
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
