"""Shared fixtures: a tiny vocabulary, labelled texts and small configs that train in
seconds, and the `comera` command line built from this repository (for the tests that
compare the two front doors)."""

import os
import random
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

WORDS = ["good", "great", "bad", "awful", "the", "a", "dress", "shirt", "fit", "color", "is", "was", "very"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS  # 18 ids


def labelled_texts(n, seed=0, labels=("neg", "pos", "mixed")):
    """`n` short texts whose label is decided by their sentiment words."""
    rng = random.Random(seed)
    texts, out = [], []
    for i in range(n):
        label = labels[i % len(labels)]
        if label == "pos":
            words = [rng.choice(["good", "great"])] * 2
        elif label == "neg":
            words = [rng.choice(["bad", "awful"])] * 2
        else:
            words = [rng.choice(["good", "great"]), rng.choice(["bad", "awful"])]
        words += [rng.choice(WORDS[4:]) for _ in range(rng.randint(2, 5))]
        rng.shuffle(words)
        texts.append(" ".join(words))
        out.append(label)
    return texts, out


def small_model(vocab_size=len(VOCAB), head=None):
    model = {
        "vocab_size": vocab_size,
        "seq_len": 12,
        "d_model": 16,
        "heads": 2,
        "ffn": 32,
        "layers": 1,
        "dropout": 0.0,
        "tt_linear": True,
        "ttm_embedding": False,
        "attn_tt": {"in_modes": [4, 4], "out_modes": [4, 4], "rank": 3},
        "ffn_up_tt": {"in_modes": [4, 4], "out_modes": [4, 8], "rank": 3},
        "ffn_down_tt": {"in_modes": [4, 8], "out_modes": [4, 4], "rank": 3},
    }
    if head is not None:
        model["head"] = head
    return model


@pytest.fixture
def workdir(tmp_path):
    """A temporary directory with the vocabulary and a data cache of its own."""
    (tmp_path / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    (tmp_path / "cache").mkdir()
    return tmp_path


def classifier_config(workdir, epochs=2, **train):
    return {
        "data": {
            "vocab": str(workdir / "vocab.txt"),
            "cache_dir": str(workdir / "cache"),
            "valid_fraction": 0.2,
        },
        "model": small_model(),
        "optim": {"lr_cores": 0.01, "lr_gates": 0.01, "lr_other": 0.01},
        "train": {"epochs": epochs, "batch_size": 8, "log_every": 5, "warmup_steps": 5, **train},
    }


def comera_bin():
    """The command line of this repository: $COMERA_BIN (CI sets it, and a missing binary
    is then a failure), else target/release/comera if it was built; else the test skips."""
    env = os.environ.get("COMERA_BIN")
    if env:
        assert Path(env).is_file(), f"COMERA_BIN={env} does not exist"
        return env
    for p in (REPO / "target" / "release" / "comera", shutil.which("comera")):
        if p and Path(p).is_file():
            return str(p)
    pytest.skip("the comera command is not built (cargo build --release, or set COMERA_BIN)")
