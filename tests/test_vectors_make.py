"""Making steering vectors: difference of means and PCA from contrastive pairs read on a real engine, probe files, SAE
decoders (both layouts), the vector file's metadata, ``dynsteer vector make``; and a made vector steers."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

import dynsteer
from dynsteer.capture.spec import CaptureSpec
from dynsteer.cli.app import app
from dynsteer.config import DynsteerConfig
from dynsteer.make import SteeringVectors, from_pairs, from_probe, from_sae
from dynsteer.make.contrast import render
from dynsteer.spec import AddVector, SteeringSpec
from dynsteer.vectors import load_vector
from dynsteer.vectors.directions import pca_direction
from dynsteer.vectors.pairs import pairs_sha256, parse_pairs, read_pairs
from dynsteer.vectors.sae import load_sae_decoder
from tests.conftest import make_llm, token_ids

runner = CliRunner()
PAIRS = [("the sun is warm and the garden is lovely", "the rain is cold and the garden is dead"),
         ("we won the game and everyone cheered", "we lost the game and everyone cried"),
         ("what a kind and generous friend", "what a cruel and selfish friend"),
         ("the soup was delicious", "the soup was disgusting"),
         ("I feel wonderful today", "I feel terrible today"),
         ("the trip was a delight", "the trip was a disaster")]
LAYERS = (1, 3)


# ---- pure parts ------------------------------------------------------------------------------------------------------
def test_pca_is_signed_so_that_positives_project_higher():
    rng = np.random.default_rng(0)
    u = rng.standard_normal(32)
    u /= np.linalg.norm(u)
    base = rng.standard_normal((40, 32))
    shift = rng.uniform(0.5, 2.0, 40)[:, None] * u  # pairs differ by varying amounts along u, plus noise
    pos = base + shift + 0.05 * rng.standard_normal((40, 32))
    neg = base - shift + 0.05 * rng.standard_normal((40, 32))
    v = pca_direction(pos, neg).astype(np.float64)
    assert (pos @ v).mean() > (neg @ v).mean() and v @ u > 0.99 * np.linalg.norm(v)
    flipped = pca_direction(neg, pos).astype(np.float64)  # the same component, the other sign
    np.testing.assert_allclose(flipped, -v, rtol=1e-5, atol=1e-6)
    assert (neg @ flipped).mean() > (pos @ flipped).mean()
    # its length is the mean pair difference along it
    assert np.isclose(np.linalg.norm(v), ((pos - neg) @ (v / np.linalg.norm(v))).mean(), rtol=1e-5)
    with pytest.raises(ValueError, match="paired"):
        pca_direction(pos, neg[:-1])
    with pytest.raises(ValueError, match="no direction"):
        pca_direction(pos, pos)


def test_pairs_files_name_the_line_and_key(tmp_path):
    f = tmp_path / "pairs.jsonl"
    f.write_text('{"positive": "a", "negative": "b"}\n\n{"positive": "c"}\n')
    with pytest.raises(ValueError, match=r"line 3: missing key 'negative'"):
        read_pairs(f)
    f.write_text('{"positive": "a", "negative": "b"}\n{"positive": "a", negative: 1}\n')
    with pytest.raises(ValueError, match=r"line 2: not valid JSON"):
        read_pairs(f)
    f.write_text('{"positive": [{"role": "boss", "content": "x"}], "negative": "b"}\n')
    with pytest.raises(ValueError, match=r"line 1: positive"):
        read_pairs(f)
    # the hash is the content's: key order, spacing and extra keys do not change it; the data does
    f.write_text('{"negative": "b",   "positive": "a", "id": 7}\n')
    same = parse_pairs([{"positive": "a", "negative": "b"}])
    assert pairs_sha256(read_pairs(f)) == pairs_sha256(same)
    assert pairs_sha256(same) != pairs_sha256(parse_pairs([{"positive": "a", "negative": "c"}]))


def test_the_example_pairs_file_reads():
    from pathlib import Path

    pairs = read_pairs(Path(__file__).resolve().parents[1] / "examples" / "data" / "sentiment_pairs.jsonl")
    assert len(pairs) == 64 and len({p.positive for p in pairs}) == len({p.negative for p in pairs}) == 64
    assert all(p.positive != p.negative for p in pairs)


def write_sae(folder, W, key="W_dec", cfg=None):
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({key: np.ascontiguousarray(W, np.float32), "b_dec": np.zeros(W.shape[-1], np.float32)},
              str(folder / "sae_weights.safetensors"))
    if cfg is not None:
        (folder / "cfg.json").write_text(json.dumps(cfg))
    return folder


def test_sae_decoder_rows_in_both_layouts(tmp_path):
    rng = np.random.default_rng(1)
    W = rng.standard_normal((48, 16)).astype(np.float32)  # [d_sae, d_model]
    cfg = {"hook_name": "blocks.2.hook_resid_post", "d_in": 16, "d_sae": 48, "model_name": "tiny"}
    lens = write_sae(tmp_path / "lens", W, cfg=cfg)
    dec = load_sae_decoder(lens)
    assert dec.layout.startswith("W_dec") and (dec.layer, dec.site, dec.d_sae, dec.d_model) == (2, "post_block", 48, 16)
    made = from_sae(lens, [5, 7], coefficients=[1.0, -2.0])
    assert made.layers == [2] and made.site == "post_block" and made.model_id == "tiny" and made.method == "sae"
    np.testing.assert_allclose(made.vectors[2], W[5] - 2 * W[7], rtol=1e-6, atol=1e-6)
    unit = from_sae(lens, [5], norm=1.0)
    np.testing.assert_allclose(unit.vectors[2], W[5] / np.linalg.norm(W[5]), rtol=1e-6, atol=1e-6)

    # nn.Linear(d_sae, d_model).weight: [d_model, d_sae], read transposed; no cfg.json: the layer is the user's
    torch_layout = write_sae(tmp_path / "torch", W.T, key="decoder.weight")
    dec_t = load_sae_decoder(torch_layout / "sae_weights.safetensors")
    assert "transposed" in dec_t.layout and dec_t.layer is None
    np.testing.assert_array_equal(dec_t.W_dec, W)
    with pytest.raises(ValueError, match="layer: .*no cfg.json hook_name"):
        from_sae(torch_layout, [5])
    made_t = from_sae(torch_layout, [5], layer=1, site="pre_attn")
    assert made_t.layers == [1] and made_t.site == "pre_attn" and made_t.meta["sae_layout"] == dec_t.layout
    np.testing.assert_array_equal(made_t.vectors[1], W[5])

    with pytest.raises(ValueError, match=r"features\[1\]: index 48 out of range \(0\.\.47"):
        from_sae(lens, [0, 48])
    with pytest.raises(ValueError, match="layer: 3 given, but cfg.json hook_name"):
        from_sae(lens, [0], layer=3)
    # a decoder stored the other way round under W_dec: cfg.json's d_in/d_sae catch it, naming the field
    wrong = write_sae(tmp_path / "wrong", W.T, cfg=cfg)
    with pytest.raises(ValueError, match=r"d_sae=48 but sae_weights.safetensors's W_dec has shape \(16, 48\)"):
        load_sae_decoder(wrong)
    flat = write_sae(tmp_path / "flat", W.reshape(-1))
    with pytest.raises(ValueError, match=r"W_dec has shape \(768,\); expected a matrix"):
        load_sae_decoder(flat)
    none = tmp_path / "none"
    none.mkdir()
    from safetensors.numpy import save_file

    save_file({"W_enc": np.ascontiguousarray(W.T)}, str(none / "sae_weights.safetensors"))
    with pytest.raises(ValueError, match=r"no SAE decoder: expected 'W_dec'.*found tensors \['W_enc'\]"):
        load_sae_decoder(none)
    (tmp_path / "bad_hook").mkdir()
    write_sae(tmp_path / "bad_hook", W, cfg={**cfg, "hook_name": "blocks.2.attn.hook_z"})
    with pytest.raises(ValueError, match="hook_name: 'blocks.2.attn.hook_z' is not a residual-stream hook"):
        load_sae_decoder(tmp_path / "bad_hook")


def test_probe_direction_is_the_gate_direction(tmp_path):
    from dynsteer.probes import gate_params, save_probe

    rng = np.random.default_rng(2)
    w, mean, scale = rng.standard_normal(16), rng.standard_normal(16), rng.uniform(0.5, 2, 16)
    path = save_probe(tmp_path / "p.safetensors", w, 0.3, model_id="m", layer=2, site="pre_attn", mean=mean,
                      scale=scale, method="LogisticProbe")
    made = from_probe(path)
    raw_w = w / scale  # standardisation folded into the raw-space weights
    assert made.layers == [2] and made.site == "pre_attn" and made.model_id == "m" and made.method == "probe"
    np.testing.assert_allclose(made.vectors[2], gate_params(raw_w, 0.0).probe, rtol=1e-5, atol=1e-6)
    assert np.isclose(np.linalg.norm(made.vectors[2]), 1.0, rtol=1e-6)
    assert np.isclose(np.linalg.norm(from_probe(path, norm=3.0).vectors[2]), 3.0, rtol=1e-6)


# ---- on a real engine ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def steerer(tiny_llama_path):
    with make_llm(tiny_llama_path, **DynsteerConfig(capture_sites=("post_block",)).engine_kwargs()) as llm:
        yield dynsteer.attach(llm)


def captured_rows(st, chat_template=True):
    """Every prompt position's residual at LAYERS, positives then negatives, captured directly (the reference)."""
    from vllm import SamplingParams

    tok = st.llm.get_tokenizer()
    inputs = [render(tok, p[k], chat_template, "x") for k in (0, 1) for p in PAIRS]
    outs = st.generate(inputs, SamplingParams(temperature=0.0, max_tokens=1),
                       capture=CaptureSpec(layers=LAYERS, positions="all_prompt"))
    return [{layer: o.capture[(layer, "post_block")].astype(np.float64) for layer in LAYERS} for o in outs]


def close(a, b):
    # float32 CPU kernels round differently with another batch composition: near-equal
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.abs(b).max()))


def test_caa_and_pca_equal_numpy_on_the_captured_residuals(steerer):
    rows = captured_rows(steerer)
    n = len(PAIRS)
    for positions, reduce in (("last", lambda a: a[-1]), (3, lambda a: a[-3:].mean(0)), ("all", lambda a: a.mean(0))):
        made = from_pairs(steerer, PAIRS, layers=LAYERS, positions=positions, batch_size=5)
        assert made.layers == list(LAYERS) and made.meta["n_pairs"] == n and made.meta["positions"] == positions
        for layer in LAYERS:
            X = np.stack([reduce(r[layer]) for r in rows])
            close(made.vectors[layer], X[:n].mean(0) - X[n:].mean(0))
    # PCA: the top eigenvector of the differences' second moment, signed and scaled by the mean difference along it
    pca = from_pairs(steerer, PAIRS, layers=LAYERS, method="pca")
    for layer in LAYERS:
        X = np.stack([r[layer][-1] for r in rows])
        D = X[:n] - X[n:]
        _, vecs = np.linalg.eigh(D.T @ D)
        u = vecs[:, -1] * np.sign((D @ vecs[:, -1]).mean())
        close(pca.vectors[layer], u * (D @ u).mean())
        assert (X[:n] @ pca.vectors[layer]).mean() > (X[n:] @ pca.vectors[layer]).mean()


def test_raw_text_and_conversations(steerer):
    rows = captured_rows(steerer, chat_template=False)
    made = from_pairs(steerer, PAIRS, layers=(1,), chat_template=False)
    X = np.stack([r[1][-1] for r in rows])
    close(made.vectors[1], X[:len(PAIRS)].mean(0) - X[len(PAIRS):].mean(0))
    assert made.meta["chat_template"] is False
    # a conversation that ends with the assistant's answer is read at the answer's last token, not after it
    tok = steerer.llm.get_tokenizer()
    talk = [{"role": "user", "content": "pick one"}, {"role": "assistant", "content": "(A"}]
    ids = render(tok, talk, True, "x")["prompt_token_ids"]
    assert tok.decode(ids).rstrip().endswith("(A")
    conv = from_pairs(steerer, [{"positive": talk, "negative": [talk[0], {"role": "assistant", "content": "(B"}]}],
                      layers=(1,))
    assert conv.meta["n_pairs"] == 1 and np.linalg.norm(conv.vectors[1]) > 0
    with pytest.raises(ValueError, match=r"pairs\[0\]\.positive: a conversation needs the chat template"):
        from_pairs(steerer, [{"positive": talk, "negative": "b"}], layers=(1,), chat_template=False)
    with pytest.raises(ValueError, match=r"pairs\[1\]: missing key 'negative'"):
        from_pairs(steerer, [{"positive": "a", "negative": "b"}, {"positive": "c"}], layers=(1,))
    with pytest.raises(ValueError, match="positions: 0"):
        from_pairs(steerer, PAIRS, layers=(1,), positions=0)
    with pytest.raises(ValueError, match=r"layers\[0\]: layer 9 out of range"):
        from_pairs(steerer, PAIRS, layers=(9,))


def test_a_caa_vector_steers_and_its_file_loads_where_vectors_load(steerer, tmp_path):
    from vllm import SamplingParams

    from dynsteer.engine.build import load_named_vector

    made = from_pairs(steerer, PAIRS, layers=(2,), norm=8.0)
    path = made.save(tmp_path / "caa.safetensors")
    vectors, meta = load_vector(path)  # the file format every vector consumer reads
    np.testing.assert_array_equal(vectors[2], made.vectors[2])
    np.testing.assert_array_equal(load_named_vector(f"{path}:2", steerer.hidden_size), made.vectors[2])
    assert json.loads(meta["norms"]) == {"2": pytest.approx(8.0, rel=1e-6)} and meta["method"] == "caa"

    prompts = ["once upon a time", "the weather today", "my favourite food is", "the old man said"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    base = token_ids(steerer.generate(prompts, params))
    spec = SteeringSpec(vectors=[AddVector(layer=2, vector=vectors[2], scale=1.0)])
    steered = token_ids(steerer.generate(prompts, params, steering=[spec, None, spec, None]))
    assert steered[0] != base[0] and steered[2] != base[2]
    assert steered[1] == base[1] and steered[3] == base[3]  # batchmates without steering are untouched


def test_metadata_round_trips(steerer, tmp_path):
    made = from_pairs(steerer, PAIRS, layers=LAYERS, positions=2)
    back = SteeringVectors.load(made.save(tmp_path / "v.safetensors"))
    assert (back.layers, back.site, back.method, back.model_id) == (list(LAYERS), "post_block", "caa",
                                                                      steerer.shape.model_id)
    assert back.meta == {"n_pairs": len(PAIRS), "positions": 2, "chat_template": True,
                         "data_sha256": pairs_sha256(parse_pairs([{"positive": p, "negative": q} for p, q in PAIRS]))}
    assert back.norms == pytest.approx(made.norms, rel=1e-6)
    for layer in LAYERS:
        np.testing.assert_array_equal(back.vectors[layer], made.vectors[layer])


# ---- the CLI ---------------------------------------------------------------------------------------------------------
def test_cli_makes_a_caa_file(steerer, tmp_path, monkeypatch):
    import dynsteer.cli.vector as cli

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"positive": p, "negative": q}) + "\n" for p, q in PAIRS))
    seen = {}

    def engine(model, site, layers, **kw):  # the running test engine instead of a second one
        seen.update(model=model, site=site, layers=layers)
        return steerer.llm

    monkeypatch.setattr(cli, "make_engine", engine)
    monkeypatch.setattr("dynsteer.cli.engine.shutdown_engine", lambda llm: None)  # the shared engine lives on
    out = tmp_path / "v.safetensors"
    res = runner.invoke(app, ["vector", "make", "--method", "caa", "--pairs", str(pairs), "--model", "tiny",
                              "--layer", "1", "--layer", "3", "--positions", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert seen == {"model": "tiny", "site": "post_block", "layers": [1, 3]} and "wrote" in res.output
    back = SteeringVectors.load(out)
    ref = from_pairs(steerer, PAIRS, layers=LAYERS, positions=2)
    assert back.meta["positions"] == 2 and back.meta["data_sha256"] == ref.meta["data_sha256"]
    for layer in LAYERS:
        close(back.vectors[layer], ref.vectors[layer].astype(np.float64))


def test_cli_errors_name_the_option_and_line(tmp_path, tiny_llama_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"positive": "a", "negative": "b"}\n{"positive": "c", "negativ": "d"}\n')
    out = tmp_path / "v.safetensors"
    res = runner.invoke(app, ["vector", "make", "--method", "caa", "--pairs", str(pairs), "--model", "m",
                              "--layer", "1", "--out", str(out)])
    assert res.exit_code == 2 and "--pairs" in res.output and "line 2: missing key 'negative'" in res.output
    assert not out.exists()
    res = runner.invoke(app, ["vector", "make", "--method", "caa", "--pairs", str(pairs), "--out", str(out)])
    assert res.exit_code == 2 and "--model" in res.output and "required with --method caa" in res.output
    res = runner.invoke(app, ["vector", "make", "--method", "mean", "--out", str(out)])
    assert res.exit_code == 2 and "--method" in res.output

    W = np.random.default_rng(3).standard_normal((8, 64)).astype(np.float32)  # d_model 64, the tiny model has 128
    sae = write_sae(tmp_path / "sae", W, cfg={"hook_name": "blocks.1.hook_resid_post", "d_in": 64, "d_sae": 8})
    base = ["vector", "make", "--method", "sae", "--sae", str(sae), "--out", str(out)]
    res = runner.invoke(app, base + ["--feature", "8"])
    assert res.exit_code == 2 and "--feature" in res.output and "index 8 out of range" in res.output
    res = runner.invoke(app, base + ["--feature", "3", "--model", str(tiny_llama_path)])
    assert res.exit_code == 2 and "--model" in res.output and "(d_model) 64" in res.output and "128" in res.output
    res = runner.invoke(app, base + ["--feature", "3", "--norm", "2"])
    assert res.exit_code == 0, res.output
    assert "W_dec [d_sae, d_model]" in res.output
    back = SteeringVectors.load(out)
    assert back.layers == [1] and back.meta["features"] == [3] and np.isclose(back.norms[1], 2.0, rtol=1e-6)


def test_cli_makes_a_probe_file_vector(tmp_path, tiny_llama_path):
    from dynsteer.probes import save_probe

    w = np.random.default_rng(4).standard_normal(128)
    probe = save_probe(tmp_path / "p.safetensors", w, -0.5, model_id="tiny", layer=3, method="LogisticProbe")
    out = tmp_path / "v.safetensors"
    res = runner.invoke(app, ["vector", "make", "--method", "probe", "--probe", str(probe), "--norm", "5",
                              "--model", str(tiny_llama_path), "--out", str(out)])
    assert res.exit_code == 0, res.output
    back = SteeringVectors.load(out)
    assert (back.layers, back.site, back.method, back.model_id) == ([3], "post_block", "probe", "tiny")
    np.testing.assert_allclose(back.vectors[3], 5 * w / np.linalg.norm(w), rtol=1e-5, atol=1e-6)
    assert back.meta == {"probe": "p.safetensors", "probe_method": "LogisticProbe", "rescaled_to": 5.0}
    res = runner.invoke(app, ["vector", "make", "--method", "probe", "--probe", str(tmp_path / "none"), "--out",
                              str(out)])
    assert res.exit_code == 2 and "--probe" in res.output
