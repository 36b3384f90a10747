"""Fork safety: a process forked after its parent ran comera's kernels (a DataLoader's
workers, multiprocessing, gunicorn) gets a fresh pool of the parent's thread count instead of
the parent's pool, whose threads the fork did not copy. Each case runs in a subprocess with a
timeout, so a regression fails instead of hanging the suite."""

import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("torch")

LIMIT_S = 60


def run_script(tmp_path, body):
    """Runs ``body`` as a script (a file: multiprocessing's spawn imports it) and returns its
    output; fails if it does not end within LIMIT_S seconds or exits non-zero."""
    script = tmp_path / "case.py"
    script.write_text(textwrap.dedent(body))
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the script did not end within {LIMIT_S} s (a fork hang?)")
    elapsed = time.monotonic() - start
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, elapsed


def test_a_forking_dataloader_whose_dataset_calls_a_layer_returns(tmp_path):
    """The issue's snippet: the parent runs a layer forward and backward, then a DataLoader
    with 2 forked workers runs it in each of them."""
    out, elapsed = run_script(tmp_path, """
        import torch
        import comera.torch as ct
        from torch.utils.data import DataLoader, Dataset

        L = ct.TTLinear([4, 4, 4], [4, 4, 4], rank=8)
        L(torch.randn(4096, 64)).sum().backward()

        class DS(Dataset):
            def __len__(self):
                return 4

            def __getitem__(self, i):
                with torch.no_grad():
                    return L(torch.randn(4096, 64)).sum()

        batches = list(DataLoader(DS(), batch_size=2, num_workers=2,
                                  multiprocessing_context="fork"))
        print(len(batches), [tuple(b.shape) for b in batches])
    """)
    assert out.split()[0] == "2", out
    assert elapsed < 30, f"took {elapsed:.1f} s"


def test_multiprocessing_fork_and_spawn_get_the_layers_results(tmp_path):
    """fork (after the parent used its own pool from set_num_threads, and rayon's global one)
    and spawn: the children compute what the parent computes, on the parent's thread count."""
    out, _ = run_script(tmp_path, """
        import multiprocessing as mp
        import torch
        import comera.torch as ct

        def work(seed):
            torch.manual_seed(seed)
            layer = ct.TTLinear([4, 4, 4], [4, 4, 4], rank=8)
            with torch.no_grad():
                y = layer(torch.randn(2048, 64))
            return ct.get_num_threads(), float(y.double().sum())

        def close(a, b):
            return abs(a - b) <= 1e-6 * abs(b) + 1e-6  # thread counts may differ in rounding

        if __name__ == "__main__":
            expected = work(3)[1]  # rayon's global pool
            ct.set_num_threads(2)
            assert close(work(3)[1], expected)  # a pool of the kernels' own
            for method in ("fork", "spawn"):
                # torch's own OpenMP threads do not survive fork either: its ops in a forked
                # child hang unless it runs them on one thread (DataLoader workers do this).
                with mp.get_context(method).Pool(2, initializer=torch.set_num_threads, initargs=(1,)) as pool:
                    got = pool.map(work, [3, 3, 3])
                assert all(close(v, expected) for _, v in got), (method, got, expected)
                threads = {n for n, _ in got}
                print(method, sorted(threads))
                if method == "fork":
                    assert threads == {2}, threads  # the parent's count
    """)
    assert "fork [2]" in out and "spawn" in out, out


def test_a_forked_child_predicts_after_its_parent_did(tmp_path):
    """Predictions run on the same pool: a fork child of a process that predicted predicts."""
    out, _ = run_script(tmp_path, f"""
        import multiprocessing as mp
        import sys
        sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})
        import comera
        from conftest import VOCAB, classifier_config, labelled_texts

        work = __import__('pathlib').Path({str(tmp_path)!r})
        (work / "vocab.txt").write_text("\\n".join(VOCAB) + "\\n")
        (work / "cache").mkdir()
        texts, labels = labelled_texts(60)
        run = comera.train(classifier_config(work, epochs=1), data=(texts, labels),
                           out=work / "run", progress=False)
        parent = run.predict(["good great dress"]).probabilities.tolist()

        def child(_):
            return comera.Run(work / "run").predict(["good great dress"]).probabilities.tolist()

        if __name__ == "__main__":
            with mp.get_context("fork").Pool(1) as pool:
                got = pool.map(child, [0])
            assert got == [parent], (got, parent)
            print("ok")
    """)
    assert out.strip() == "ok", out
