"""``k3 info --preset NAME [--context N] [--json]``: layer schedule, parameters, FLOPs and cache bytes.
``k3 info --kernels [--device D]``: the kernel plan on a device, the full table (k3.ops.kernel_plan).

Counts come from the module tree built on the meta device (no weights are allocated).
"""

from __future__ import annotations

import argparse
import json

from k3.config import PRESETS, get_preset


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="small", help=f"one of: {', '.join(PRESETS)}")
    p.add_argument("--context", type=int, default=4096, help="context length for attention FLOPs and cache bytes")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--kernels",
        action="store_true",
        help="print the kernel plan instead: what runs each op and each of our kernels on --device, and why",
    )
    p.add_argument("--device", default="auto", help="with --kernels: auto, cpu or cuda[:N]")


def run(args: argparse.Namespace) -> int:
    if args.kernels:
        return kernels(args)
    if args.context <= 0:
        raise ValueError(f"--context={args.context} must be positive")
    from k3.audit.accounting import report
    from k3.audit.format import human as _human
    from k3.audit.format import human_bytes as _bytes

    r = report(get_preset(args.preset), context=args.context)
    if args.json:
        print(json.dumps(r, indent=1))
        return 0
    print(f"preset {r['preset']}: {len(r['layers'])} layers")
    print("layer  mixer  ffn    attn_res_block")
    for layer in r["layers"]:
        block = "-" if layer["attn_res_block"] is None else layer["attn_res_block"]
        print(f"{layer['index']:5d}  {layer['mixer']:5s}  {layer['ffn']:5s}  {block}")
    print(
        f"\nparameters: total {_human(r['params_total'])}, activated per token {_human(r['params_activated'])} "
        f"(input embedding excluded; {_human(r['params_activated_with_embedding'])} with it)"
    )
    for path, n in r["params_by_path"].items():
        note = " (the tower is counted apart, below)" if path == "vision" else ""
        print(f"  {path:15s} {_human(n):>10s}   activated {_human(r['params_activated_by_path'][path]):>10s}{note}")
    print(
        f"routed experts {_human(r['params_routed_experts'])}, shared {_human(r['params_shared_experts'])}, "
        f"dense path {_human(r['params_dense_path'])}"
    )
    if r["params_vision"]:
        print(
            f"vision tower (MoonViT-V2, not in the totals above): encoder {_human(r['params_vision_encoder'])} "
            f"+ merge/projector to the LM width {_human(r['params_vision_projector'])}"
        )
    print()
    for form, total, parts in (
        ("forward", "flops_per_token_forward", "flops_per_token_breakdown"),
        ("decode (MLA absorbed)", "flops_per_token_decode", "flops_per_token_decode_breakdown"),
    ):
        f = r[parts]
        print(
            f"{form} FLOPs per token at context {r['context']}: {_human(r[total], 'FLOP')} (matmul "
            f"{_human(f['matmul'])}, MLA attention {_human(f['mla_attention'])}, KDA state {_human(f['kda_state'])}, "
            f"AttnRes mixes {_human(f['attn_res_mix'])})"
        )
    print(f"weight bytes read per token (batch 1, bf16): {_bytes(r['weight_bytes_per_token'])}")
    c = r["cache_per_sequence"]
    print(
        f"cache per sequence at {c['context']} tokens: {_bytes(c['total_bytes'])} "
        f"(KDA state {_bytes(c['kda_state_bytes'])} fp32, conv {_bytes(c['conv_state_bytes'])}, "
        f"MLA latents {_bytes(c['mla_cache_bytes'])} bf16)"
    )
    return 0


def kernels(args: argparse.Namespace) -> int:
    """``--kernels``: the kernel plan table on ``--device`` (with ``--json``, its rows as objects)."""
    from k3.infer.load import resolve_device
    from k3.ops.kernel_plan import plan, plan_table

    device = resolve_device(args.device)
    if args.json:
        rows = [{"name": name, "runs": runs, "why": why} for name, runs, why in plan(device)]
        print(json.dumps({"device": str(device), "rows": rows}, indent=1))
    else:
        print(plan_table(device))
    return 0
