"""transformers runs a K3 checkpoint (the multimodal release's text part too): config.json's auto_map points at the
configuration_k3.py / modeling_k3.py that save_pretrained copies in, and AutoModelForCausalLM(trust_remote_code=True)
then gives k3's own logits;
the tokenizer saved beside it loads with AutoTokenizer and renders chats as k3 does."""

import json

import pytest
import torch

import k3
import k3.checkpoint.format as ckpt
from k3.config import get_preset
from k3.checkpoint import hf_code
from k3.data.chat import render_chat
from k3.infer.generate import greedy_generate
from k3.model.decoder import K3ForCausalLM
from tests.helpers import KIMI_LINEAR_STYLE

transformers = pytest.importorskip("transformers")


def random_model(cfg, seed=0):
    torch.manual_seed(seed)
    model = K3ForCausalLM(cfg).eval()
    with torch.no_grad():  # non-zero AttnRes queries and router biases: every branch does work
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("_res_proj.weight", "e_score_correction_bias")):
                t.normal_(0, 0.1)
    return model


@pytest.fixture(scope="module")
def modules_cache(tmp_path_factory):
    """transformers copies remote code into its modules cache: a temporary one here."""
    import transformers.dynamic_module_utils as dmu

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dmu, "HF_MODULES_CACHE", str(tmp_path_factory.mktemp("hf_modules")))
        yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, modules_cache):
    model = random_model(get_preset("tiny"))
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    k3.save_pretrained(model, path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
    return model, path, hf


def test_checkpoint_carries_its_code(tiny):
    _, path, _ = tiny
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "kimi_k3" and config["architectures"] == ["KimiK3ForCausalLM"]
    assert config["auto_map"] == {
        "AutoConfig": "configuration_k3.KimiK3Config",
        "AutoModelForCausalLM": "modeling_k3.KimiK3ForCausalLM",
    }
    for name in hf_code.FILES:
        assert (path / name).read_bytes() == hf_code.source(name).read_bytes()
    assert set(hf_code.FILES) <= set(ckpt.read_checksums(path))
    ckpt.verify_files(path)


def test_tampered_code_fails_verification(tmp_path):
    k3.save_pretrained(random_model(get_preset("tiny")), tmp_path / "ck")
    with open(tmp_path / "ck" / "modeling_k3.py", "a") as f:
        f.write("\nimport os\n")
    with pytest.raises(ValueError, match="modeling_k3.py is corrupted"):
        ckpt.verify_files(tmp_path / "ck")


def test_auto_model_gives_k3_logits(tiny):
    model, path, hf = tiny
    assert type(hf).__name__ == "KimiK3ForCausalLM" and not hf.training
    assert transformers.AutoConfig.from_pretrained(path, trust_remote_code=True).model_type == "kimi_k3"
    fresh = transformers.AutoModelForCausalLM.from_config(hf.config, trust_remote_code=True)  # k3's init
    assert fresh.k3_model.config == model.config
    torch.manual_seed(1)
    ids = torch.randint(0, 512, (2, 70))
    with torch.no_grad():
        got, want = hf(input_ids=ids).logits, model(ids).logits
    assert want.abs().max() > 0.1  # a non-trivial model
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_padding_and_generate(tiny):
    """Left padding: each row's tokens run as their own sequence; greedy generate equals k3's."""
    model, _, hf = tiny
    torch.manual_seed(2)
    ids = torch.randint(3, 512, (2, 30))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    with torch.no_grad():
        got = hf(input_ids=ids, attention_mask=mask).logits
        short = model(ids[1:, 9:]).logits[0]
    torch.testing.assert_close(got[1, 9:], short, rtol=1e-5, atol=1e-5)
    assert not got[1, :9].any()
    with torch.no_grad():
        out = hf.generate(ids[:, :12], max_new_tokens=6, do_sample=False)
    assert torch.equal(out, greedy_generate(model, ids[:, :12], 6))


def test_dtype_and_refusals(tiny, modules_cache):
    model, path, hf = tiny
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.bfloat16)
    assert bf16.k3_model.lm_head.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 512, (1, 8))
    with pytest.raises(ValueError, match="not supported by the K3 model: labels"):
        hf(input_ids=ids, labels=ids)
    gappy = torch.tensor([[1, 0, 1, 1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="one contiguous run of tokens"):
        hf(input_ids=ids, attention_mask=gappy)
    with pytest.raises(ValueError, match="k3.save_pretrained"):
        hf.save_pretrained(path.parent / "other")
    assert not (path.parent / "other").exists()


def test_multimodal_release_runs_its_text_part(tmp_path, modules_cache):
    """The multimodal release layout (k3 convert --format k3-release) carries the code too: transformers runs it
    as K3ForConditionalGeneration on text (its text_config a sub-config transformers reads), k3's logits and
    greedy tokens; the config it holds reads back to the model's own."""
    from k3.config.hf import from_hf_config
    from k3.config.presets import with_vision
    from k3.model.multimodal import K3ForConditionalGeneration

    torch.manual_seed(0)
    model = K3ForConditionalGeneration(with_vision(get_preset("tiny"))).eval()
    ckpt.save_pretrained(model, tmp_path / "r", fmt="k3-release")
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert config["architectures"] == ["KimiK3ForConditionalGeneration"] and "text_config" in config
    assert config["auto_map"] == hf_code.AUTO_MAP and set(hf_code.FILES) <= set(ckpt.read_checksums(tmp_path / "r"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "r", trust_remote_code=True)
    assert type(hf.k3_model) is K3ForConditionalGeneration
    assert from_hf_config(hf.config.to_dict()) == model.config
    ids = torch.randint(0, 512, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
        out = hf.generate(ids[:, :10], max_new_tokens=5, do_sample=False)
    assert torch.equal(out, greedy_generate(model, ids[:, :10], 5))


def test_kimi_linear_shaped_checkpoint_loads_natively(tmp_path):
    """A config transformers' KimiLinear runs keeps its name and carries no code; transformers runs it natively."""
    model = random_model(get_preset("tiny").replace(**KIMI_LINEAR_STYLE))
    k3.save_pretrained(model, tmp_path / "kl")
    config = json.loads((tmp_path / "kl" / "config.json").read_text())
    assert config["model_type"] == "kimi_linear" and "auto_map" not in config
    assert not any((tmp_path / "kl" / name).exists() for name in hf_code.FILES)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "kl").eval()
    assert type(ref).__name__ == "KimiLinearForCausalLM"
    ids = torch.randint(0, 512, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(ref(input_ids=ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_checkpoint_tokenizer_chats_like_k3(tiny, tmp_path):
    """A checkpoint's tokenizer (k3's Tokenizer.save) through AutoTokenizer: apply_chat_template's text and ids
    equal render_chat's, and the ids drive the model's generate."""
    from k3.data.tokenizer import train_bpe

    _, _, hf = tiny
    specials = ("<|endoftext|>", "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
    tok = train_bpe(["The user asks and the assistant answers briefly. " * 30], vocab_size=300, special_tokens=specials)
    tok.save(tmp_path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    msgs = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Who answers?"},
        {"role": "assistant", "content": "The assistant."},
        {"role": "user", "content": "And who asks?"},
    ]
    want = render_chat(msgs, tok)
    assert hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == want.text
    ids = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == want.token_ids
    out = hf.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, len(want.token_ids) + 3)
