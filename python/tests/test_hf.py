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
