"""Hugging Face both ways from Python: a run exported, imported back (dense and compressed by
TT-SVD), and the same predictions from the dense import."""

import numpy as np
import pytest

import comera
from conftest import classifier_config, labelled_texts


def test_export_then_import_gives_back_the_model(workdir):
    texts, labels = labelled_texts(120)
    run = comera.train(classifier_config(workdir, epochs=1), data=(texts, labels), out=workdir / "run",
                       progress=False)
    out = run.export_hf(workdir / "hf")
    assert out["architecture"] and "config.json" in out["files"]
    with pytest.raises(comera.ComeraError, match="not empty"):
        run.export_hf(workdir / "hf")

    back = comera.import_hf(workdir / "hf", workdir / "imported", seq_len=12)
    queries = ["good great dress", "bad awful fit"]
    a, b = run.predict(queries), back.predict(queries)
    assert a.label_names == b.label_names
    assert np.allclose(a.probabilities, b.probabilities, atol=1e-5)

    small = comera.import_hf(workdir / "hf", workdir / "tt", tt=True, rank=2, seq_len=12)
    rep = small.import_report
    assert rep["compressions"][0]["rank"] == 2
    assert all(max(l["ranks"]) <= 2 for l in rep["compressions"][0]["layers"])
    assert rep["params"] < rep["dense_params"]
    assert small.predict(queries).probabilities.shape == (2, 3)
    with pytest.raises(comera.ComeraError):
        comera.import_hf(workdir / "missing", workdir / "x")


def test_pre_ln_export_gives_transformers_the_same_probabilities(workdir):
    """A pre-LN classifier exports as RoBERTa-PreLayerNorm: transformers' AutoTokenizer gives
    comera's token ids and AutoModelForSequenceClassification comera's probabilities."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from conftest import VOCAB

    texts, labels = labelled_texts(120)
    cfg = classifier_config(workdir, epochs=2)
    cfg["model"].update(pre_ln=True, layers=2)
    run = comera.train(cfg, data=(texts, labels), out=workdir / "run", progress=False)
    out = run.export_hf(workdir / "hf")
    assert out["architecture"] == "RobertaPreLayerNormForSequenceClassification"

    tok = transformers.AutoTokenizer.from_pretrained(str(workdir / "hf"))
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(workdir / "hf")).eval()
    assert type(model).__name__ == "RobertaPreLayerNormForSequenceClassification"
    ids = [VOCAB.index(t) for t in ["[CLS]", "good", "great", "dress", "[SEP]"]]
    assert tok("Good great dress")["input_ids"] == ids

    # Short and long texts in one padded batch (RoBERTa's positions skip the padding), one
    # word comera's vocabulary lacks, one text cut to the sequence length.
    queries = ["good great dress", "bad awful fit", "the very good shirt was a awful color",
               "unknownword good", "a " * 20 + "bad"]
    ours = run.predict(queries)
    enc = tok(queries, padding=True, truncation=True, return_tensors="pt")
    assert enc["input_ids"].shape[1] == 12
    with torch.no_grad():
        theirs = model(**enc).logits.softmax(-1).numpy()
    assert [model.config.id2label[i] for i in range(len(ours.label_names))] == ours.label_names
    assert np.abs(theirs - ours.probabilities).max() < 1e-5


# --- models with comera layers through save_pretrained / from_pretrained ---------------------


def _tiny_bert_with_tt_layers(transformers, torch, ct):
    """A 2-layer BERT classifier (hidden 64, FFN 128) whose feed-forward layers are
    TTLinear.from_linear, one gate pruned and truncated away, the word table a TTMEmbedding."""
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=60, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=16, num_labels=3)
    model = transformers.BertForSequenceClassification(cfg).eval()
    for layer in model.bert.encoder.layer:
        layer.intermediate.dense = ct.TTLinear.from_linear(layer.intermediate.dense, rank=6)
        layer.output.dense = ct.TTLinear.from_linear(layer.output.dense, rank=5)
    up = model.bert.encoder.layer[0].intermediate.dense
    before = up.ranks
    with torch.no_grad():
        up.gates[0][0] = 0.0
    assert up.truncate() == [1, before[1] - 1, *before[2:]]
    model.bert.embeddings.word_embeddings = ct.TTMEmbedding.from_embedding(
        model.bert.embeddings.word_embeddings, [4, 4, 4], [4, 4, 4], rank=8)
    return model


def test_tt_layers_survive_save_pretrained_and_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    import comera.torch as ct

    model = _tiny_bert_with_tt_layers(transformers, torch, ct)
    ids = torch.randint(0, 60, (2, 9))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    ranks = model.bert.encoder.layer[0].intermediate.dense.ranks
    assert ranks != ct.TTLinear([4, 4, 4], [8, 4, 4], rank=6).ranks  # TT-SVD's, one slice less

    ct.save_pretrained(model, tmp_path / "tt")
    for load in (
        lambda: transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "tt"),
                                                                                trust_remote_code=True),
        lambda: ct.from_pretrained(tmp_path / "tt"),
    ):
        back = load()
        assert type(back).__name__ == "BertForSequenceClassification"
        assert isinstance(back.bert.encoder.layer[0].intermediate.dense, ct.TTLinear)
        assert back.bert.encoder.layer[0].intermediate.dense.ranks == ranks
        assert isinstance(back.bert.embeddings.word_embeddings, ct.TTMEmbedding)
        assert sum(p.numel() for p in back.parameters()) == sum(p.numel() for p in model.parameters())
        with torch.no_grad():
            assert torch.equal(back(input_ids=ids).logits, want)

    # Never random dense layers in their place: plain loaders stop.
    with pytest.raises(Exception, match="trust_remote_code|custom code"):
        transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "tt"))
    with pytest.raises(OSError):
        transformers.BertForSequenceClassification.from_pretrained(str(tmp_path / "tt"))
    # A plain save (what the Trainer's checkpoints are) carries the layouts in its weights:
    # comera.torch.from_pretrained loads it whole; ct.save_pretrained refuses its directory.
    model.save_pretrained(str(tmp_path / "plain"))
    back = ct.from_pretrained(tmp_path / "plain")
    assert back.bert.encoder.layer[0].intermediate.dense.ranks == ranks
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, want)
    with pytest.raises(ValueError, match="model.safetensors"):
        ct.save_pretrained(model, tmp_path / "plain")
    # A plain model without comera layers is not one to load here.
    transformers.BertForSequenceClassification(model.config).save_pretrained(str(tmp_path / "dense"))
    with pytest.raises(ValueError, match="no comera layers"):
        ct.from_pretrained(tmp_path / "dense")


def test_a_mismatching_compressed_checkpoint_is_an_error(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    import json

    import comera.torch as ct

    model = _tiny_bert_with_tt_layers(transformers, torch, ct)
    ct.save_pretrained(model, tmp_path / "tt")
    cfg_path = tmp_path / "tt" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    # A layer the weights do not have: the loader's model has a weight the file lacks.
    name = "bert.encoder.layer.1.attention.output.dense"
    cfg["comera"]["layers"][name] = {"kind": "TTLinear",
                                     "layout": ct.TTLinear([4, 4, 4], [4, 4, 4], rank=2).get_extra_state().tolist()}
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(RuntimeError, match="attention.output.dense"):
        ct.from_pretrained(tmp_path / "tt")


@pytest.mark.parametrize("pre_ln", [False, True])
def test_a_compressed_export_loads_in_transformers_with_its_tt_parameters(workdir, pre_ln):
    """export_hf(compressed=True): transformers loads the TT layers with the run's cores (the
    run's parameter count) and gives `comera predict`'s probabilities; post-LN (BERT) and
    pre-LN (RoBERTa-PreLayerNorm)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    import json
    import subprocess

    from conftest import comera_bin

    texts, labels = labelled_texts(120)
    cfg = classifier_config(workdir, epochs=1)
    cfg["model"]["pre_ln"] = pre_ln
    run = comera.train(cfg, data=(texts, labels), out=workdir / "run", progress=False)
    out = run.export_hf(workdir / "hf", compressed=True)
    assert out["compressed"] and "comera_model.safetensors" in out["files"]
    assert "model.safetensors" not in out["files"]
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(workdir / "hf"),
                                                                             trust_remote_code=True)
    params = sum(p.numel() for p in model.parameters())
    # RoBERTa's position table has rows before its first position (zeros, never used).
    unused = (model.config.max_position_embeddings - run.config["model"]["seq_len"]) * model.config.hidden_size
    assert (unused > 0) == pre_ln
    assert params == out["params"] == run.summary["params"] + unused, (params, out["params"], run.summary["params"])
    assert params < run.summary["dense_params"]

    tok = transformers.AutoTokenizer.from_pretrained(str(workdir / "hf"), trust_remote_code=True)
    queries = ["good great dress", "bad awful fit", "the very good shirt was a awful color"]
    enc = tok(queries, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        theirs = model(**enc).logits.softmax(-1).numpy()
    cli = subprocess.run([comera_bin(), "predict", "--json", str(run.path), *queries],
                         capture_output=True, text=True, check=True).stdout
    ours = np.array([json.loads(line)["probabilities"] for line in cli.strip().splitlines()])
    assert np.abs(theirs - ours).max() < 1e-4, np.abs(theirs - ours).max()

    # Exported again over itself with overwrite=True; without it, refused.
    with pytest.raises(comera.ComeraError, match="not empty"):
        run.export_hf(workdir / "hf", compressed=True)
    run.export_hf(workdir / "hf", compressed=True, overwrite=True)
