"""k3.ops.fused: the pointwise ops dispatch like every op; on CPU they run their eager reference.

(The compiled fast path is checked against the reference on a GPU: tests/gpu/test_fast_paths.py.)"""

import logging

import pytest
import torch

from k3.model.activation import situ_glu, swiglu
from k3.model.norm import gated_rms_norm, rms_norm
from k3.ops import backend
from k3.ops.fused import fused
from k3.ops.kda import kda_gate, l2norm

OPS = [situ_glu, swiglu, rms_norm, gated_rms_norm, kda_gate, l2norm]


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
def test_cpu_runs_the_reference(op):
    name, fn = backend.resolve(op.__name__, torch.device("cpu"))
    assert (name, fn) == ("reference", op.reference)


def test_dispatcher_returns_the_reference_result_and_logs_the_backend(caplog):
    calls = []

    @fused
    def scaled_tanh_test_op(x, s: float):
        calls.append(x.shape)
        return torch.tanh(x) * s

    x = torch.randn(5, 3)
    with caplog.at_level(logging.DEBUG, logger="k3.ops"):
        y = scaled_tanh_test_op(x, 2.0)
    assert torch.equal(y, torch.tanh(x) * 2.0) and calls == [(5, 3)]
    assert "op scaled_tanh_test_op runs backend reference on cpu" in caplog.text


def test_fast_on_cpu_is_refused_not_silently_downgraded():
    before = backend.get_backend()
    backend.set_backend("fast")
    try:
        with pytest.raises(RuntimeError, match="rms_norm"):
            rms_norm(torch.randn(2, 4), torch.ones(4), 1e-6)
    finally:
        backend.set_backend(before)


def test_first_compilation_raises_dynamos_recompile_limit():
    """A model needs more than dynamo's default 8 versions of rms_norm; with fullgraph=True the limit is an error."""
    import torch._dynamo

    from k3.ops.fused import RECOMPILE_LIMIT, raise_recompile_limit

    config = torch._dynamo.config
    with config.patch(recompile_limit=8, accumulated_recompile_limit=256):
        raise_recompile_limit()
        assert config.recompile_limit == RECOMPILE_LIMIT >= 32
        raise_recompile_limit(200, "a test")  # e.g. the compiled decode of an engine with max_batch 192
        assert config.recompile_limit == 200 and config.accumulated_recompile_limit == 800
        raise_recompile_limit(16)  # never lowered
        assert config.recompile_limit == 200 and config.accumulated_recompile_limit == 800


def test_compiled_path_needs_cuda_triton_and_compile_enabled(monkeypatch):
    import torch._dynamo
    import torch.utils._triton

    from k3.ops.fused import compilable

    assert not compilable(torch.device("cpu"))
    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: True)
    cuda = torch.device("cuda")
    assert compilable(cuda)
    with torch._dynamo.config.patch(disable=True):  # TORCH_COMPILE_DISABLE=1 (config.patch restores it cleanly)
        assert not compilable(cuda)
    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: False)
    assert not compilable(cuda)


def test_a_failed_compilation_answers_with_the_reference_and_says_so(monkeypatch, caplog):
    """A compile error (here: a graph break under fullgraph=True, forced onto the CPU) is logged once and the
    op's reference answers this call and the later ones; K3_BACKEND=fast raises it instead."""
    import torch._dynamo

    import k3.ops.fused as fused_module

    monkeypatch.setattr(fused_module, "compilable", lambda device: True)

    @fused_module.fused
    def broken_compile_test_op(x):
        torch._dynamo.graph_break()
        return x * 3

    x = torch.randn(4, 2)
    with caplog.at_level(logging.DEBUG, logger="k3.ops"):
        assert torch.equal(broken_compile_test_op(x), x * 3)
        assert torch.equal(broken_compile_test_op(x + 1), (x + 1) * 3)
    assert "op broken_compile_test_op runs backend fast" in caplog.text
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "torch.compile failed" in errors[0].getMessage()

    @fused_module.fused
    def strict_compile_test_op(x):
        torch._dynamo.graph_break()
        return x * 3

    before = backend.get_backend()
    backend.set_backend("fast")
    try:
        with pytest.raises(torch._dynamo.exc.TorchDynamoException):
            strict_compile_test_op(x)
    finally:
        backend.set_backend(before)
        torch._dynamo.reset()


def test_too_many_input_shapes_answer_with_the_reference(monkeypatch, caplog):
    """Past dynamo's recompile limit a fullgraph compile raises FailOnRecompileLimitHit, which is not a
    TorchDynamoException: it too is logged once and answered by the reference (dynamo's eager backend here, the
    limit lowered to 2, so the third list length hits it)."""
    import functools

    import torch._dynamo

    import k3.ops.fused as fused_module

    monkeypatch.setattr(fused_module, "compilable", lambda device: True)
    monkeypatch.setattr(fused_module, "raise_recompile_limit", lambda *a, **k: None)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))

    @fused_module.fused
    def list_length_test_op(x, parts):
        return x + sum(parts)

    x = torch.randn(3)
    try:
        with torch._dynamo.config.patch(recompile_limit=2), caplog.at_level(logging.INFO, logger="k3.ops"):
            for n in range(1, 5):
                parts = [torch.full((3,), float(i)) for i in range(n)]
                assert torch.equal(list_length_test_op(x, parts), x + sum(parts))
    finally:
        torch._dynamo.reset()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "FailOnRecompileLimitHit" in errors[0], errors


def test_fast_path_support_is_asked_once_per_device():
    """resolve asks an op's ``supports`` once per device and remembers the answer: traced into a compiled decode
    step, a support check (a CUDA capability query) cut the step's graph at every layer. Here the check itself
    breaks graphs; after the first eager call a compiled caller has none."""
    calls = []

    def supports(device):
        calls.append(device)
        torch._dynamo.graph_break()
        return True

    backend.register("doubling_test_op", "reference", lambda x: x + x)
    backend.register("doubling_test_op", "fast", lambda x: x * 2, supports)
    try:

        def caller(x):
            return backend.dispatch("doubling_test_op", x.device, x.sin()).cos()

        x = torch.randn(4)
        assert torch.equal(caller(x), (x.sin() * 2).cos())
        assert torch._dynamo.explain(caller)(x).graph_break_count == 0
        assert calls == [torch.device("cpu")]
        backend.register("doubling_test_op", "fast", lambda x: x * 2, lambda d: False)  # re-registered: asked again
        assert backend.resolve("doubling_test_op", x.device)[0] == "reference"
    finally:
        backend._OPS.pop("doubling_test_op")
