"""The multimodal model: images spliced at placeholders, packing, checkpoints, engine generation with images,
the OpenAI server with image_url data URIs, and ``k3 train --task vision`` end to end (tiny)."""

import base64
import io
import json

import openai
import pytest
import torch

from k3.config import get_preset
from k3.config.presets import with_vision
from k3.checkpoint.load import from_pretrained
from k3.infer.async_engine import AsyncEngine
from k3.infer.engine import Engine
from k3.infer.sampling import SamplingParams
from k3.infer.server import create_app
from k3.model.multimodal import K3ForConditionalGeneration
from k3.data.vision import media_ids, task_tokenizer
from k3.vision.media import expand_placeholders, merged_tokens
from k3.vision.processor import ImageProcessor
from k3.vision.task import make_example
from k3.checkpoint.format import save_pretrained
from tests.helpers import rel

PAD, BEGIN, END = 500, 501, 502


@pytest.fixture(scope="module")
def model(perturb):
    torch.manual_seed(0)
    cfg = with_vision(get_preset("tiny")).replace(
        **{
            "vision.media_placeholder_token_id": PAD,
            "vision.media_begin_token_id": BEGIN,
            "vision.media_end_token_id": END,
        }
    )
    m = perturb(K3ForConditionalGeneration(cfg).eval())
    with torch.no_grad():  # the tower's norms start at ones: make every weight random
        for p in m.vision_tower.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m


def images(n=2):
    return [make_example(i, "validation").image for i in range(n)]


def prompt_with(model, imgs, text_ids):
    patches, grids = ImageProcessor.from_config(model.config.vision).process(imgs)
    counts = [merged_tokens(g, 2) for g in grids.tolist()]
    ids, _ = expand_placeholders([PAD] + text_ids[:3] + [PAD] * (len(imgs) - 1) + text_ids[3:], counts, PAD, BEGIN, END)
    return torch.tensor([ids]), patches, grids


def test_images_replace_the_placeholders_in_order(model):
    ids, patches, grids = prompt_with(model, images(2), list(range(10, 20)))
    with torch.no_grad():
        got = model(ids, pixel_patches=patches, grid_hws=grids).logits
        feats = model.encode_images(patches, grids)
        embeds = model.model.embed_tokens(ids[0]).clone()
        embeds[ids[0] == PAD] = feats
        hidden, _, _ = model.model(ids[0], torch.tensor([0, ids.shape[1]]), inputs_embeds=embeds)
        want = model.lm_head(hidden)
    assert rel(got[0], want) <= 1e-6
    assert rel(got[0, :1], model(ids[:, :1]).logits[0]) <= 1e-6  # before the first image: text only
    with pytest.raises(ValueError, match="media placeholder tokens but image_features"):
        model(ids, image_features=feats[:-1])
    with pytest.raises(ValueError, match="pixel_patches or image_features"):
        model(ids, pixel_patches=patches, grid_hws=grids, image_features=feats)


def test_packed_multimodal_examples_equal_separate(model):
    a = prompt_with(model, images(1), list(range(30, 37)))
    b = prompt_with(model, [make_example(5, "train").image], list(range(40, 44)))
    ids = torch.cat([a[0], b[0]], 1)
    cu = torch.tensor([0, a[0].shape[1], ids.shape[1]])
    with torch.no_grad():
        packed = model(
            ids, cu_seqlens=cu, pixel_patches=torch.cat([a[1], b[1]]), grid_hws=torch.cat([a[2], b[2]])
        ).logits[0]
        alone = torch.cat([model(x[0], pixel_patches=x[1], grid_hws=x[2]).logits[0] for x in (a, b)])
    assert rel(packed, alone) <= 1e-5


def test_checkpoint_round_trip_keeps_the_tower(model, tmp_path):
    save_pretrained(model, tmp_path)
    loaded = from_pretrained(tmp_path)
    assert isinstance(loaded, K3ForConditionalGeneration) and loaded.config == model.config
    for k, v in model.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k


class Ids:
    eos_id = None

    def decode(self, ids):
        return "".join(f" {i}" for i in ids)


def test_engine_generates_with_images_like_the_full_forward(model):
    """Chunked prefill splits the image tokens over several passes (features fed in order), an image request and
    a text-only request share passes, and greedy tokens equal a plain greedy loop over the full forward."""
    img = images(1)
    text = list(range(60, 66))
    engine = Engine(model, Ids(), max_batch=2, max_num_batched_tokens=5, cuda_graphs=False)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    rid = engine.add([PAD] + text, params, images=img)
    engine.add(list(range(70, 80)), params)
    outs = {}
    while engine.has_work():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
    ids, patches, grids = prompt_with(model, img, text)
    with torch.no_grad():
        feats = model.encode_images(patches, grids)
        for _ in range(6):
            logits = model(ids, image_features=feats).logits[0, -1]
            logits[[PAD, BEGIN, END]] = float("-inf")
            ids = torch.cat([ids, logits.argmax().view(1, 1)], 1)
    assert outs[rid] == ids[0, -6:].tolist()


def test_engine_rejects_bad_image_requests(model):
    engine = Engine(model, Ids(), max_batch=1, cuda_graphs=False)
    p = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="1 media placeholder token.*but 2 image"):
        engine.add([PAD, 5], p, images=images(2))
    with pytest.raises(ValueError, match="media placeholder token.*but 0 image"):
        engine.add([PAD, 5], p)
    with pytest.raises(ValueError, match="cannot decode .*not an image format"):
        engine.add([PAD, 5], p, images=[b"not an image at all"])
    assert not engine.has_work()


def test_server_takes_image_url_data_uris():
    from tests.infer.test_server import LiveServer

    tok = task_tokenizer(400)
    torch.manual_seed(1)
    cfg = with_vision(get_preset("tiny")).replace(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id, **media_ids(tok))
    engine = Engine(K3ForConditionalGeneration(cfg).eval(), tok, max_batch=4, max_context=256, cuda_graphs=False)
    server = LiveServer(create_app(AsyncEngine(engine), tok, "k3-vision", engine.max_context))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        buf = io.BytesIO()
        images(1)[0].save(buf, format="PNG")
        uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        content = [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": " how many shapes ?"}]
        r = client.chat.completions.create(
            model="k3-vision", messages=[{"role": "user", "content": content}], max_tokens=3, temperature=0
        )
        n_image = merged_tokens(ImageProcessor.from_config(cfg.vision).process(images(1))[1][0].tolist(), 2)
        assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens > n_image
        # no max_tokens: the default fills the context left after the EXPANDED prompt (every image token counted)
        r = client.chat.completions.create(
            model="k3-vision", messages=[{"role": "user", "content": content}], temperature=0
        )
        assert r.choices and r.usage.prompt_tokens > n_image
        for bad, match in (
            ("http://example.com/x.png", "data: URI"),
            ("data:image/png;base64,@@@", "base64"),
            ("data:image/png;base64," + base64.b64encode(b"junk").decode(), "cannot decode .*not an image format"),
        ):
            with pytest.raises(openai.BadRequestError, match=match):
                client.chat.completions.create(
                    model="k3-vision",
                    max_tokens=2,
                    messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": bad}}]}],
                )
        assert client.chat.completions.create(
            model="k3-vision", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        ).choices  # still serving
    finally:
        server.stop()


def test_k3_train_vision_runs_end_to_end(tmp_path, capsys):
    from k3.cli.main import main

    assert main(["train", "--task", "vision", "--preset", "tiny", "--vision-eval", "0", "--out", str(tmp_path)]) == 2
    assert "--vision-eval=0 must be a positive" in capsys.readouterr().err and not (tmp_path / "metrics.jsonl").exists()

    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--task",
                "vision",
                "--preset",
                "tiny",
                "--steps",
                "3",
                "--batch-size",
                "4",
                "--eval-every",
                "3",
                "--eval-rows",
                "8",
                "--vision-eval",
                "8",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.count("kernel plan on cpu: ") == 1  # printed once at start
    result = json.loads((out / "vision_eval.json").read_text())
    assert set(result) == {"examples", "count", "colour", "position", "text", "all"}
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "val_acc_all" in history[-1] and history[-1]["val_loss"] < history[0]["val_loss_init"]
    assert isinstance(from_pretrained(out / "checkpoints" / "step-000003"), K3ForConditionalGeneration)


def test_k3_generate_with_an_image(tmp_path, capsys):
    from k3.cli.main import main
    from k3.model.decoder import K3ForCausalLM

    tok = task_tokenizer(400)
    torch.manual_seed(2)
    cfg = with_vision(get_preset("tiny")).replace(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id, **media_ids(tok))
    save_pretrained(K3ForConditionalGeneration(cfg), tmp_path / "mm")
    tok.save(tmp_path / "mm")
    png = tmp_path / "q.png"
    images(1)[0].save(png)
    args = [
        "generate",
        "--ckpt",
        str(tmp_path / "mm"),
        "--image",
        str(png),
        "--prompt",
        " how many shapes ?",
        "--temperature",
        "0",
        "--max-tokens",
        "3",
    ]
    assert main(args) == 0
    stats = capsys.readouterr().err
    n_image = merged_tokens(ImageProcessor.from_config(cfg.vision).process([png])[1][0].tolist(), 2)
    assert f"[{len(tok.encode(' how many shapes ?')) + n_image + 2} prompt" in stats  # + begin / end tokens
    save_pretrained(K3ForCausalLM(get_preset("tiny").replace(vocab_size=tok.vocab_size)), tmp_path / "text")
    tok.save(tmp_path / "text")
    args[2] = str(tmp_path / "text")
    assert main(args) != 0
    assert "needs a multimodal checkpoint" in capsys.readouterr().err


def test_image_prompt_recognises_only_the_media_placeholder():
    """`k3 generate --image`: the placeholder written in the text stands where it is; any other special-token
    string in the prompt (here the EOS) stays plain text; without one, one placeholder per image goes first."""
    from types import SimpleNamespace

    from k3.cli.generate import image_prompt

    tok = task_tokenizer(400)
    cfg = with_vision(get_preset("tiny")).replace(vocab_size=tok.vocab_size, **media_ids(tok))
    pad = cfg.vision.media_placeholder_token_id
    model = SimpleNamespace(config=cfg, vision_tower=None)
    marker, eos = tok.hf.id_to_token(pad), tok.hf.id_to_token(tok.eos_id)
    ids = image_prompt(model, tok, f" look{marker} here {eos}", 1)
    assert ids == tok.encode(" look") + [pad] + tok.encode(f" here {eos}")
    assert ids.count(pad) == 1 and tok.eos_id not in ids
    assert image_prompt(model, tok, " look", 2) == [pad, pad] + tok.encode(" look")
