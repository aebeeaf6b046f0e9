"""Serving a model whose routed experts stay packed MXFP4 (docs/architecture.md#mx): a packed checkpoint written
by save_pretrained(quantize="mxfp4"), served by ``k3 serve`` with the experts kept packed and queried with the openai
client; greedy answers equal the in-process greedy generation."""

import argparse
import collections
import functools
import json

import openai
import pytest
import torch

from k3.config import get_preset
from k3.checkpoint.format import save_pretrained
from k3.data.tokenizer import train_bpe
from k3.infer.generate import greedy_generate
from k3.infer.load import load_for_inference
from k3.model.decoder import K3ForCausalLM
from k3.quant.packed import PackedExperts
from tests.infer.test_server import start_serve

MODEL, CONTEXT = "k3-packed", 256
PROMPTS = ["The json module", "def parse(", "Ordered dictionaries"]


@pytest.fixture(scope="module")
def packed_ckpt(tmp_path_factory):
    """tiny (widths 64 / 32, multiples of the MX block) with random router biases, experts written packed."""
    tok = train_bpe(["\n".join(m.__doc__ for m in (argparse, collections, json, functools))], vocab_size=400)
    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset("tiny").replace(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id))
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    path = tmp_path_factory.mktemp("packed")
    save_pretrained(model, path, quantize="mxfp4")
    tok.save(path)
    return path


def test_k3_serve_runs_a_packed_checkpoint(packed_ckpt):
    """``k3 serve`` keeps the experts packed by default and prints its kernel plan; its greedy answers (openai client)
    equal the in-process greedy generation of the same packed model."""
    assert "quantization_config" in json.loads((packed_ckpt / "config.json").read_text())
    model, tok, _ = load_for_inference(packed_ckpt, "cpu", "float32")  # the loading path k3 serve takes
    experts = [m for m in model.modules() if isinstance(m, PackedExperts)]
    assert len(experts) == 4 and not any(".experts." in n for n, _ in model.named_parameters())
    assert all(b.dtype == torch.uint8 for e in experts for b in e.state_dict().values())

    proc, url = start_serve(packed_ckpt, "--dtype", "float32", "--model-name", MODEL, "--max-context", str(CONTEXT))
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        served = [
            client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0].text
            for p in PROMPTS
        ]
    finally:
        proc.terminate()
        proc.wait(30)
    printed = proc.stdout.read()
    assert printed.count("kernel plan on cpu: PyTorch reference ops") == 1  # the plan, one line, once at start
    for prompt, text in zip(PROMPTS, served):
        ids = torch.tensor([tok.encode(prompt)])
        new = greedy_generate(model, ids, 12, tok.eos_id)[0, ids.shape[1] :].tolist()
        if tok.eos_id in new:
            new = new[: new.index(tok.eos_id)]
        assert len(new) > 0
        assert text == tok.decode(new), prompt
