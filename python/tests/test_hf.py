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
