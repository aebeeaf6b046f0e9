"""The cache's memory accounting equals the bytes it really holds."""

import torch

from k3.config import get_preset
from k3.model.cache import cache_bytes_per_sequence
from k3.model.decoder import K3ForCausalLM


def test_accounting_matches_held_bytes():
    cfg = get_preset("tiny")
    model = K3ForCausalLM(cfg)
    cache = model.new_cache(2)
    with torch.no_grad():
        model(torch.randint(0, 512, (2, 33)), cache=cache)
    expect = cache_bytes_per_sequence(cfg, 33, state_bytes=4, kv_bytes=4)["total_bytes"]
    assert cache.nbytes() == 2 * expect
    assert cache.seq_lens == [33, 33]


def test_state_dtype_is_configurable():
    model = K3ForCausalLM(get_preset("tiny"))
    cache = model.new_cache(1, state_dtype=torch.float64)
    with torch.no_grad():
        model(torch.randint(0, 512, (1, 5)), cache=cache)
    assert cache.layers[0].recurrent.dtype == torch.float64


def test_reset_of_many_slots_zeroes_exactly_those():
    """One reset of several slots empties those (KDA and conv states zero, no latents) and leaves the others;
    release forgets a slot's length only (its states are zeroed when it is reset for its next request)."""
    model = K3ForCausalLM(get_preset("tiny"))
    cache = model.new_cache(4)
    with torch.no_grad():
        model(torch.randint(0, 512, (4, 9)), cache=cache)
    kda = [layer for layer in cache.layers if hasattr(layer, "recurrent")]
    mla = [layer for layer in cache.layers if hasattr(layer, "kv")]
    kept = [(layer.recurrent[1].clone(), [c[1].clone() for c in layer.conv]) for layer in kda]
    cache.reset([0, 2, 3])
    assert cache.seq_lens == [0, 9, 0, 0] and all(m.lengths == [0, 9, 0, 0] for m in mla)
    for layer, (rec, conv) in zip(kda, kept):
        for slot in (0, 2, 3):
            assert not layer.recurrent[slot].any() and not any(c[slot].any() for c in layer.conv)
        assert torch.equal(layer.recurrent[1], rec) and all(torch.equal(c[1], k) for c, k in zip(layer.conv, conv))
    state = kda[0].recurrent[1].clone()
    cache.release(1)
    assert cache.seq_lens[1] == 0 and all(m.lengths[1] == 0 for m in mla)
    assert torch.equal(kda[0].recurrent[1], state)


def test_append_many_and_gather_equal_one_slot_at_a_time():
    """The indexed write and read of several slots' latent rows equal appending and reading them slot by slot,
    growth of the capacity included."""
    torch.manual_seed(0)
    cfg = get_preset("tiny")
    one, many = K3ForCausalLM(cfg).new_cache(4), K3ForCausalLM(cfg).new_cache(4)
    a, b = (next(layer for layer in c.layers if hasattr(layer, "kv")) for c in (one, many))
    width = a.kv.shape[2]
    for slots, counts in (([2, 0, 3], [5, 1, 300]), ([0, 3], [7, 2])):
        rows = torch.randn(sum(counts), width)
        for s, r in zip(slots, rows.split(counts)):
            a.append(s, r)
        b.append_many(slots, rows, counts)
        assert a.lengths == b.lengths
        want = torch.cat([a.rows(s) for s in (3, 0, 2)])
        assert torch.equal(b.gather([3, 0, 2]), want)
    assert b.kv.shape[1] >= 302 and a.lengths == [8, 0, 5, 302]
