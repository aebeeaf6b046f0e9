"""The kernel plan as one table: for a device, what runs each op and each of our kernels, and why
(docs/kernels.md#the-kernel-plan). ``k3 train``, ``k3 serve`` and ``k3 bench`` print it at start (:func:`plan_report`:
one line where nothing of ours runs, as on a CPU; the table with ``-v`` and from ``k3 info --kernels``); resolving it
fixes the answers later calls read (k3.ops.backend resolves each once)."""

from __future__ import annotations

import torch

import k3.ops.attn_res  # noqa: F401  (every op package, so that each has registered its implementations)
import k3.ops.conv  # noqa: F401
import k3.ops.kda  # noqa: F401
import k3.ops.linear  # noqa: F401
import k3.ops.mla  # noqa: F401
import k3.ops.moe  # noqa: F401
import k3.ops.norm  # noqa: F401
import k3.ops.router  # noqa: F401
from k3.ops import backend, pdl


def plan(device: torch.device | str) -> list[tuple[str, str, str]]:
    """The kernel plan on ``device``: rows (op or kernel, what runs, why), the ops first, then our kernels."""
    device = torch.device(device)
    choice = backend.get_backend()
    rows = []
    for name, entry in sorted(backend.registered().items()):
        try:
            runs, _ = backend.resolve(name, device)
        except RuntimeError as e:  # K3_BACKEND=fast and a fast path that cannot run here
            rows.append((name, "error", str(e)))
            continue
        label = entry.labels.get(runs, "")
        if runs == "fast" or choice == "reference":
            why = f"K3_BACKEND={choice}"
        else:
            why = "no fast path" if "fast" not in entry.impls else f"its fast path does not run on {device.type}"
        rows.append((name, runs + (f": {label}" if label else ""), why))
    for name, (runs, why) in backend.kernel_choices().items():
        kernel = backend.KERNELS[name]
        if name == "pdl" and runs == "on" and not pdl.enabled(device):
            runs, why = "off", f"not supported on {device}"
        if runs == kernel.off and kernel.no_triton and not backend.triton_usable():
            runs = kernel.no_triton  # its off form is Triton code too: show what runs instead
        rows.append((f"kernel {name}", runs, f"{why}; {kernel.what}"))
    return rows


def plan_table(device: torch.device | str) -> str:
    """:func:`plan` as a plain-text table under a line naming the device and the user's choices."""
    rows = [("op / kernel", "runs", "why")] + plan(device)
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    head = (
        f"kernel plan on {torch.device(device)} (K3_BACKEND={backend.get_backend()}, "
        f"K3_KERNELS={backend.kernel_spec() or '-'})"
    )
    return "\n".join([head] + [f"  {a:<{widths[0]}}  {b:<{widths[1]}}  {c}" for a, b, c in rows])


def plan_summary(device: torch.device | str) -> str | None:
    """The plan in one line where nothing of ours runs on ``device`` (not a GPU, no kernel on, no op in error):
    PyTorch reference ops, naming those whose fast path runs anyway (pure-PyTorch forms, such as the short conv's);
    None where the table has more to say."""
    device = torch.device(device)
    ops, kernels = [], []
    for name, runs, why in plan(device):
        if name.startswith("kernel "):
            kernels.append((backend.KERNELS[name.removeprefix("kernel ")], runs, why.split(";")[0]))
        else:
            ops.append((name, runs))
    if device.type == "cuda" or any(runs == "error" for _, runs in ops) or any(r == k.on for k, r, _ in kernels):
        return None
    fast = [name for name, runs in ops if runs.startswith("fast")]
    reasons = {why for _, _, why in kernels}
    choice = backend.get_backend()
    return (
        f"kernel plan on {device}: PyTorch reference ops"
        + (f" (K3_BACKEND={choice})" if choice != "auto" else "")
        + (f" ({', '.join(fast)}: {'its' if len(fast) == 1 else 'their'} fast path)" if fast else "")
        + ", none of our kernels"
        + (f" ({reasons.pop()})" if len(reasons) == 1 else "")
        + "; the table: k3 info --kernels or -v"
    )


def plan_report(device: torch.device | str, verbose: bool = False) -> str:
    """What ``k3 train`` / ``k3 serve`` / ``k3 bench`` print at start: :func:`plan_summary` where it has one and
    ``verbose`` is off, else :func:`plan_table`."""
    line = None if verbose else plan_summary(device)
    return line or plan_table(device)
