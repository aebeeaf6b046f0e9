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
