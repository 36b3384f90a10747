"""comera from Python: configs (dict, TOML string, path), data in memory for the three tasks,
callbacks that stop a run, resume through the command line, errors as exceptions, Ctrl-C."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import comera
from conftest import VOCAB, classifier_config, comera_bin, labelled_texts, small_model


def toml_of(cfg):
    """A dict config written as TOML by hand (tables of scalars, lists and inline tables)."""

    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        return repr(v)

    return "".join(
        f"[{name}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in table.items()) for name, table in cfg.items()
    )


def sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def train_losses(run):
    return [(r["step"], r["loss"]) for r in run.metrics if r["kind"] == "train"]


def test_a_dict_a_toml_string_and_a_path_give_the_same_run(workdir):
    texts, labels = labelled_texts(120)
    cfg = classifier_config(workdir)
    runs = []
    for i, config in enumerate([cfg, toml_of(cfg), None]):
        if config is None:
            path = workdir / "run.toml"
            path.write_text(toml_of(cfg))
            config = path
        run = comera.train(config, data=(texts, labels), out=workdir / f"run{i}", progress=False, threads=2)
        runs.append(run)
    assert runs[0].summary["steps"] > 0
    assert train_losses(runs[0]) == train_losses(runs[1]) == train_losses(runs[2])
    assert runs[0].config["data"]["labels"] == ["mixed", "neg", "pos"]
    # The run names its data by file and digest; the file holds what was given.
    data = runs[0].config["data"]
    assert data["source"] == "csv" and len(data["train_sha256"]) == 64
    assert sha(data["train"]) == data["train_sha256"]


def test_classifier_from_a_dataframe_learns_and_predicts_like_the_command_line(workdir):
    pd = pytest.importorskip("pandas")
    texts, labels = labelled_texts(300, seed=1)
    frame = pd.DataFrame({"text": texts, "label": labels})
    vt, vl = labelled_texts(60, seed=2)
    run = comera.train(
        classifier_config(workdir, epochs=4),
        data=frame,
        valid={"text": vt, "label": vl},
        out=workdir / "run",
        progress=False,
        threads=2,
    )
    s = run.summary
    assert s["final_valid"]["accuracy"] > 0.6, s["final_valid"]
    ev = run.evaluate()
    assert ev["examples"] == 60 and abs(ev["accuracy"] - s["final_valid"]["accuracy"]) < 1e-9
    ev2 = run.evaluate((vt, vl))
    assert ev2["examples"] == 60 and abs(ev2["accuracy"] - ev["accuracy"]) < 1e-9
    frame = run.metrics_frame("eval")
    assert len(frame) == 4 and "valid_accuracy" in frame.columns

    queries = ["good great dress", "awful bad fit", "good bad shirt the"]
    p = run.predict(queries)
    assert p.label_names == ["mixed", "neg", "pos"]
    assert p.probabilities.shape == (3, 3) and np.allclose(p.probabilities.sum(axis=1), 1, atol=1e-5)
    assert p.labels == [p.label_names[i] for i in p.probabilities.argmax(axis=1)]
    # The command line's `predict --json` gives every probability.
    out = subprocess.run(
        [comera_bin(), "predict", "--json", str(run.path), *queries], capture_output=True, text=True, check=True
    ).stdout
    rows = [json.loads(line) for line in out.strip().splitlines()]
    assert [r["label"] for r in rows] == p.labels, out
    assert all(r["labels"] == p.label_names for r in rows)
    assert np.abs(np.array([r["probabilities"] for r in rows]) - p.probabilities).max() <= 1e-6


def test_integer_labels_are_ordered_as_numbers(workdir):
    texts, labels = labelled_texts(90, labels=(2, 10, 1))
    run = comera.train(
        classifier_config(workdir, epochs=1), data=(texts, np.array(labels)), out=workdir / "r", progress=False
    )
    assert run.config["data"]["labels"] == ["1", "2", "10"]


def test_masked_lm_from_texts_in_memory(workdir):
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.choice(VOCAB[5:], size=rng.integers(8, 20))) for _ in range(80)]
    cfg = classifier_config(workdir)
    cfg["model"] = small_model(head="mlm")
    cfg["model"]["pre_ln"] = True
    del cfg["data"]["valid_fraction"]
    cfg["data"]["valid_fraction"] = 0.2
    run = comera.train(cfg, corpus=docs, out=workdir / "mlm", progress=False, threads=2)
    assert run.config["data"]["source"] == "corpus"
    ev = [r for r in run.metrics if r["kind"] == "eval"]
    assert ev and np.isfinite(ev[-1]["valid_loss"])
    assert run.evaluate()["task"] == "masked_lm"


def click_rows(n, seed):
    rng = np.random.default_rng(seed)
    dense = rng.integers(0, 50, size=(n, 13))
    cats = rng.integers(0, 40, size=(n, 26))
    label = ((cats[:, 0] % 2 == 0) ^ (rng.random(n) < 0.1)).astype(np.int64)
    return {"dense": dense, "categorical": cats, "label": label}


def test_dlrm_from_numpy_arrays(workdir):
    cfg = {
        "dlrm": {"embedding_dim": 8, "bottom_mlp": [16], "top_mlp": [16], "tables": "auto",
                 "ttm_threshold": 30, "ttm_cores": 2, "ttm_rank": 4},
        "data": {"cache_dir": str(workdir / "cache")},
        "train": {"epochs": 3, "batch_size": 50, "log_every": 5},
    }
    run = comera.train(cfg, clicks=click_rows(2000, 1), valid_clicks=click_rows(400, 2),
                       out=workdir / "dlrm", progress=False, threads=2)
    assert run.config["data"]["source"] == "criteo"
    assert run.config["data"]["table_sizes"] == [40] * 26
    auc = run.summary["final_valid"]["auc"]
    assert auc is not None and auc > 0.7, run.summary["final_valid"]
    with pytest.raises(comera.DataError, match="13"):
        comera.train(cfg, clicks={"dense": np.zeros((5, 3)), "categorical": np.zeros((5, 26)),
                                  "label": np.zeros(5)}, out=workdir / "bad", progress=False)


def test_a_callback_stops_the_run_and_the_command_line_resumes_it_bit_identically(workdir):
    texts, labels = labelled_texts(200, seed=3)
    cfg = classifier_config(workdir, epochs=3)
    full = comera.train(cfg, data=(texts, labels), out=workdir / "full", progress=False, threads=2)

    seen = []

    class StopAt7:
        def on_train(self, record):
            seen.append(record["step"])

        def on_step(self, event):
            return comera.STOP if event["step"] == 7 else None

    stopped = comera.train(cfg, data=(texts, labels), out=workdir / "part", progress=False, threads=2,
                           callback=StopAt7())
    assert stopped.summary["stopped"] and stopped.summary["steps"] == 7
    assert seen == [5]
    subprocess.run([comera_bin(), "--threads", "2", "train", "--resume", str(stopped.path), "--quiet"],
                   check=True, capture_output=True)
    assert train_losses(comera.Run(stopped.path)) == train_losses(full)
    assert sha(stopped.path / "model.safetensors") == sha(full.path / "model.safetensors")


def test_every_event_kind_reaches_a_function_callback(workdir):
    texts, labels = labelled_texts(60)
    kinds = []
    comera.train(classifier_config(workdir, epochs=1), data=(texts, labels), out=workdir / "r",
                 progress=False, callback=lambda e: kinds.append(e["kind"]))
    for kind in ["message", "started", "epoch_started", "step", "train", "eval", "checkpoint",
                 "training_ended", "ranks", "finished"]:
        assert kind in kinds, (kind, sorted(set(kinds)))


def test_an_exception_in_the_callback_stops_the_run_with_a_checkpoint_and_is_raised(workdir):
    texts, labels = labelled_texts(60)

    def boom(e):
        if e["kind"] == "step" and e["step"] == 3:
            raise ValueError("my callback failed")

    with pytest.raises(ValueError, match="my callback failed"):
        comera.train(classifier_config(workdir), data=(texts, labels), out=workdir / "r", progress=False,
                     callback=boom)
    run = comera.Run(workdir / "r")
    done = run.resume(progress=False)
    assert done.summary["steps"] > 3 and not done.summary["stopped"]


def test_errors_are_exceptions_naming_what_is_wrong(workdir):
    texts, labels = labelled_texts(30)
    cfg = classifier_config(workdir)
    cfg["train"]["batch_sise"] = 4
    with pytest.raises(comera.ConfigError, match="batch_sise"):
        comera.train(cfg, data=(texts, labels), out=workdir / "a", progress=False)
    with pytest.raises(comera.ConfigError, match="epochs"):
        comera.train("[train]\nepochs = -1\n", out=workdir / "b", progress=False)
    with pytest.raises(comera.ComeraError):
        comera.train({"model": {"d_model": None}}, progress=False)
    with pytest.raises(comera.DataError, match="30 texts but 29 labels"):
        comera.train(classifier_config(workdir), data=(texts, labels[:-1]), out=workdir / "c", progress=False)
    with pytest.raises(TypeError, match="texts"):
        comera.train(classifier_config(workdir), data=([1, 2], ["a", "b"]), out=workdir / "d", progress=False)
    with pytest.raises(comera.RunError):
        comera.Run(workdir)  # not a run
    run = comera.train(classifier_config(workdir, epochs=1), data=(texts, labels), out=workdir / "e",
                       progress=False)
    with pytest.raises(comera.DataError):
        run.evaluate((texts, ["unknown"] * len(texts)))
    (run.path / "config.toml").write_text((run.path / "config.toml").read_text() + "\n# edited\n")
    with pytest.raises(comera.RunError, match="changed since the run started"):
        comera.Run(run.path)
    # A run whose data file was altered is refused on resume, naming the field.
    assert issubclass(comera.ConfigError, comera.ComeraError)


def test_ctrl_c_stops_after_a_checkpoint_and_raises_keyboard_interrupt(workdir):
    texts, labels = labelled_texts(400, seed=5)
    cfg = classifier_config(workdir, epochs=50)
    marker = workdir / "started"
    script = textwrap.dedent(
        f"""
        import json, signal, sys, time
        # Python's own Ctrl-C handler, as in a terminal or a notebook (a process started in the
        # background of a non-interactive shell inherits SIGINT ignored, and then has none).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.path.insert(0, {str(os.path.dirname(__file__))!r})
        import comera
        cfg = json.loads({json.dumps(json.dumps(cfg))})
        texts, labels = json.loads({json.dumps(json.dumps([texts, labels]))})
        def cb(e):
            if e["kind"] == "step" and e["step"] == 5:
                open({str(marker)!r}, "w").close()
            time.sleep(0.002)
        try:
            comera.train(cfg, data=(texts, labels), out={str(workdir / "run")!r}, progress=False, callback=cb)
            print("finished")
        except KeyboardInterrupt:
            print("interrupted")
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(600):
        if marker.exists() or proc.poll() is not None:
            break
        import time

        time.sleep(0.05)
    assert marker.exists(), proc.communicate()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert out.strip() == "interrupted", (out, err)
    run = comera.Run(workdir / "run")
    ck = [r for r in run.metrics if r["kind"] == "train"]
    assert ck, "the run logged before it stopped"
    assert list((run.path / "checkpoints").iterdir()), "a checkpoint was written"
    done = run.resume(progress=False)
    assert not done.summary["stopped"]


def test_run_directory_errors_name_python_arguments(workdir):
    """A RunError raised in Python names overwrite=True / comera.resume, not CLI flags."""
    texts, labels = labelled_texts(30)
    cfg = classifier_config(workdir, epochs=1)
    run = comera.train(cfg, data=(texts, labels), out=workdir / "r", progress=False)
    with pytest.raises(comera.RunError) as e:
        comera.train(cfg, data=(texts, labels), out=workdir / "r", progress=False)
    msg = str(e.value)
    assert "overwrite=True" in msg and "comera.resume(" in msg and "out=" in msg, msg
    assert "--" not in msg, msg
    with pytest.raises(comera.RunError) as e:
        run.resume(progress=False)
    msg = str(e.value)
    assert "extend_epochs=N" in msg and "--" not in msg, msg
    longer = run.resume(progress=False, extend_epochs=1)
    assert longer.config["train"]["epochs"] == 2 and not longer.summary["stopped"]
    with pytest.raises(ValueError, match="extend_epochs"):
        run.resume(extend_epochs=0)
    comera.train(cfg, data=(texts, labels), out=workdir / "r", progress=False, overwrite=True)
    with pytest.raises(comera.ConfigError) as e:
        comera.train(cfg, data=(texts, labels), out=workdir / "z", progress=False, batch_size=0)
    assert "batch_size" in str(e.value) and "--" not in str(e.value), str(e.value)


@pytest.mark.parametrize("progress", [False, True])
def test_a_warmup_longer_than_the_run_is_clamped_with_a_warning(workdir, progress):
    texts, labels = labelled_texts(40)
    cfg = classifier_config(workdir, epochs=1, warmup_steps=100)  # 32 examples / 8: 4 steps
    with pytest.warns(comera.ComeraWarning, match=r"train.warmup_steps = 100 is not shorter than the run \(4 steps\)"):
        comera.train(cfg, data=(texts, labels), out=workdir / "w", progress=progress)


def test_the_command_line_warns_of_a_warmup_longer_than_the_run(workdir):
    texts, labels = labelled_texts(40)
    csv = workdir / "d.csv"
    csv.write_text("text,label\n" + "".join(f"{t},{l}\n" for t, l in zip(texts, labels)))
    cfg = classifier_config(workdir, epochs=1, warmup_steps=100)
    toml = comera._comera.json_to_toml(json.dumps(cfg))
    (workdir / "c.toml").write_text(toml)
    done = subprocess.run(
        [comera_bin(), "--threads", "1", "train", "--config", str(workdir / "c.toml"), "--data", str(csv),
         "--out", str(workdir / "cli"), "--quiet"],
        capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "warning: train.warmup_steps = 100 is not shorter than the run" in done.stderr, done.stderr


def test_fine_tuning_an_imported_model_with_a_partial_config(workdir):
    """The imported model's sizes (and vocabulary) fill in what the config does not set."""
    texts, labels = labelled_texts(120)
    source = comera.train(classifier_config(workdir, epochs=1), data=(texts, labels), out=workdir / "src",
                          progress=False)
    source.export_hf(workdir / "hf")
    imported = comera.import_hf(workdir / "hf", workdir / "imported", seq_len=12)
    partial = {"data": {"cache_dir": str(workdir / "cache")},
               "train": {"epochs": 1, "batch_size": 8, "warmup_steps": 2}}
    run = comera.train(partial, data=(texts, labels), init_from=imported, out=workdir / "tuned", progress=False)
    model = run.config["model"]
    assert (model["d_model"], model["ffn"], model["layers"]) == (16, 32, 1)
    assert run.config["data"]["vocab"] == imported.config["data"]["vocab"]
    assert run.summary["final_valid"]["accuracy"] > 0.5
    # A field the config does set wins.
    with pytest.raises(comera.ComeraError, match="d_model|heads"):
        comera.train({**partial, "model": {"d_model": 24}}, data=(texts, labels), init_from=imported,
                     out=workdir / "other", progress=False)


def test_device_is_an_argument_of_training_evaluation_and_prediction(workdir):
    """`device=` on train, resume, Run.evaluate, Run.predict and Run.resume: "cpu" is the
    default and changes nothing; "cuda" either runs (a GPU answered) or raises DeviceError
    naming what is missing, before anything is written; a malformed string is a ConfigError
    naming the accepted forms."""
    texts, labels = labelled_texts(120, seed=3)
    cfg = classifier_config(workdir, epochs=1)
    run = comera.train(cfg, data=(texts, labels), out=workdir / "cpu", progress=False, threads=2)
    same = comera.train(cfg, data=(texts, labels), out=workdir / "cpu2", progress=False, threads=2, device="cpu")
    assert train_losses(same) == train_losses(run)
    queries = ["good great dress", "awful bad fit"]
    p = run.predict(queries)
    assert np.array_equal(run.predict(queries, device="cpu").probabilities, p.probabilities)
    assert run.evaluate(device="cpu") == run.evaluate()
    missing = ("driver", "no CUDA device", "NVRTC", "cuBLAS", "memory")
    gpu = workdir / "gpu"
    try:
        comera.train(cfg, data=(texts, labels), out=gpu, progress=False, device="cuda")
    except comera.DeviceError as e:
        assert any(m in str(e) for m in missing), str(e)
        assert "cuda:0" in str(e), str(e)
        assert 'device="cpu"' in str(e) and "--device" not in str(e), str(e)
        assert not gpu.exists(), "a refused GPU run wrote its directory"
    for call in (
        lambda: run.predict(queries, device="cuda"),
        lambda: run.evaluate(device="cuda:0"),
    ):
        try:
            call()
        except comera.DeviceError as e:
            assert any(m in str(e) for m in missing), str(e)
    assert isinstance(comera.DeviceError("x"), comera.ComeraError)
    for bad in ("gpu", "CUDA", "cuda:x"):
        with pytest.raises(comera.ConfigError, match="cuda:N"):
            run.predict(queries, device=bad)
        with pytest.raises(comera.ConfigError, match="device"):
            comera.train(cfg, data=(texts, labels), out=workdir / "bad", progress=False, device=bad)
        with pytest.raises(comera.ConfigError, match="cuda:N"):
            run.resume(device=bad)
    assert not (workdir / "bad").exists()


def test_devices_lists_the_cpu_and_each_gpu_or_why_there_is_none():
    d = comera.devices()
    assert d["cpu"]["threads"] >= 1
    cuda = d["cuda"]
    assert isinstance(cuda["gpus"], list) and isinstance(cuda["cublas"], bool)
    if not cuda["gpus"]:
        assert cuda["problem"], d
    for g in cuda["gpus"]:
        assert g["device"].startswith("cuda:") and g["memory_bytes"] > 0, g
        assert g["ready"] is None
    opened = comera.devices(open=True)["cuda"]["gpus"]
    assert all(g["ready"] in (True, False) for g in opened)
