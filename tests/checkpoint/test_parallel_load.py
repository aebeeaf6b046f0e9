"""Parallel shard loading (k3.checkpoint.stream): several shards read and hashed at once, and the staged path that
copies to GPUs through reused host buffers.

Whatever the number of workers and whichever path, the loaded tensors must be exactly the files' (tensors spanning
several staging chunks and chunks holding several tensors included, packed pairs split across shards included);
a bad shard still fails with its one message; the bytes held in flight stay within their bounds.
"""

import threading
import time

import pytest
import torch

import k3.checkpoint.format as ckpt
import k3.checkpoint.stream as stream
from k3.config import get_preset
from k3.checkpoint.format import save_pretrained
from k3.checkpoint.load import from_pretrained, load_eager
from k3.model.decoder import K3ForCausalLM
from k3.quant.packed import PackedExperts
from tests.checkpoint.test_streamed_load import assert_same, random_multimodal


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    model = random_multimodal()
    d = tmp_path_factory.mktemp("p") / "ck"
    save_pretrained(model, d, max_shard_bytes=2**16)
    return model, d


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    cfg = get_preset("tiny").replace(**{"moe.moe_intermediate_size": 64, "moe.latent_size": 64})
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("q") / "q"
    save_pretrained(K3ForCausalLM(cfg), d, quantize="mxfp4", max_shard_bytes=3000)  # pairs split across shards
    return d


def staged(monkeypatch, chunk: int) -> None:
    """Send every shard through the staging path (as onto a GPU; unpinned buffers here) in ``chunk``-byte reads."""
    monkeypatch.setattr(stream, "_staged", lambda place: True)
    monkeypatch.setattr(stream, "_CHUNK", chunk)


@pytest.mark.parametrize("workers", [1, 3])
def test_workers_give_the_files_tensors(sharded, workers):
    model, d = sharded
    assert len(list(d.glob("*.safetensors"))) > 3
    assert_same(model, from_pretrained(d, workers=workers))
    assert_same(load_eager(d, dtype=torch.float32), from_pretrained(d, torch.float32, workers=workers))


@pytest.mark.parametrize("chunk", [1000, 4096, 1 << 20])
def test_staged_path_gives_the_files_tensors(sharded, monkeypatch, chunk):
    model, d = sharded
    staged(monkeypatch, chunk)
    assert_same(model, from_pretrained(d, workers=3))
    assert_same(load_eager(d, dtype=torch.float32), from_pretrained(d, torch.float32, workers=2))


@pytest.mark.parametrize("path", ["read", "staged"])
def test_packed_pairs_across_shards_and_workers(packed, monkeypatch, path):
    if path == "staged":
        staged(monkeypatch, 1000)
    assert_same(load_eager(packed), from_pretrained(packed, packed="dequantize", workers=4))
    kept = from_pretrained(packed, packed="keep", workers=4)
    assert isinstance(kept.model.layers[1].block_sparse_moe.experts, PackedExperts)
    monkeypatch.undo()
    assert_same(from_pretrained(packed, packed="keep", workers=1), kept)


@pytest.mark.parametrize("path", ["read", "staged"])
def test_bad_shard_among_workers_fails_with_one_message(sharded, tmp_path, monkeypatch, path):
    if path == "staged":
        staged(monkeypatch, 4096)
    model, src = sharded
    d = tmp_path / "ck"
    save_pretrained(model, d, max_shard_bytes=2**16)
    shard = sorted(d.glob("model-*.safetensors"))[3]
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF  # a weight byte: the header still parses
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError) as err:
        from_pretrained(d, workers=4)
    assert str(err.value) == f"{shard} is corrupted: its SHA-256 differs from {ckpt.CHECKSUMS}"
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data) + b"\0")  # a byte more: the tail is checksummed too
    with pytest.raises(ValueError, match=f"{shard.name} is corrupted: its SHA-256 differs"):
        from_pretrained(d, workers=4)
    shard.write_bytes(bytes(data))
    assert_same(model, from_pretrained(d, workers=4))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="must be a positive number of shards"):
            from_pretrained(d, workers=bad)


def test_budget_lets_at_most_its_limit_through_but_a_large_tensor_alone():
    budget, cancel = stream._Budget(100), threading.Event()
    inside, peak, lock = [0], [0], threading.Lock()

    def job(n: int) -> None:
        held = budget.take(n, cancel)
        with lock:
            inside[0] += n
            peak[0] = max(peak[0], inside[0])
        time.sleep(0.01)
        with lock:
            inside[0] -= n
        budget.give(held)

    threads = [threading.Thread(target=job, args=(n,)) for n in [60, 30, 150, 60, 40, 60, 150]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak[0] == budget.peak and 60 <= peak[0] <= 150 and budget.used == 0
    budget.take(80, cancel)
    cancel.set()
    with pytest.raises(stream._Cancelled):
        budget.take(80, cancel)


def test_staging_buffers_stay_within_one_gib():
    for workers in range(1, 65):
        size = stream._stage_size(workers)
        assert size & (size - 1) == 0 and stream._STAGE_BUFFERS * workers * size <= 1 << 30
    assert stream._stage_size(1) == stream._CHUNK


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("chunk", [4096, 64 << 20])
def test_gpu_load_gives_the_files_tensors(sharded, packed, monkeypatch, chunk):
    model, d = sharded
    monkeypatch.setattr(stream, "_CHUNK", chunk)
    for workers in (1, 3):
        got = from_pretrained(d, device="cuda", workers=workers)
        assert all(t.is_cuda for t in got.state_dict().values())
        assert_same(model, got.cpu())
        fp32 = from_pretrained(d, torch.float32, "cuda", workers=workers)
        assert_same(load_eager(d, dtype=torch.float32), fp32.cpu())
    assert_same(load_eager(packed), from_pretrained(packed, device="cuda", packed="dequantize", workers=4).cpu())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_host_finite_check_is_exact(dtype):
    info = torch.finfo(dtype)
    values = [0.0, -0.0, info.max, -info.max, info.tiny, info.tiny / 4, -1.5]  # the largest, a subnormal
    t = torch.tensor(values, dtype=dtype).repeat(stream._FINITE_STEP // 3)  # several steps
    assert stream.host_finite(t) and stream.host_finite(t[::3]) and stream.host_finite(t[:0])
    for bad in (float("nan"), float("inf"), -float("inf")):
        u = t.clone()
        u[-2] = bad
        assert not stream.host_finite(u) and not stream.host_finite(u[1::3])
