"""Type stubs of comera's extension module (the Rust library's Python bindings).

The public API is the `comera` package (`comera/__init__.py`), which calls these.
"""

from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import numpy.typing as npt

__version__: str

class ComeraError(Exception):
    """Any error of comera."""

class ConfigError(ComeraError):
    """A config field or argument comera cannot use; the message names the field."""

class DataError(ComeraError):
    """Data that cannot be read or used."""

class RunError(ComeraError):
    """A run directory that cannot be created, resumed, locked or read, or a failed run."""

class ModelError(ComeraError):
    """A model that cannot be built, loaded or used."""

def json_to_toml(json: str) -> str: ...
def toml_to_py(text: str) -> Any: ...
def resolve_config(text: Optional[str], origin: str) -> str: ...
def train(
    text: Optional[str],
    origin: str,
    *,
    out: Optional[str] = ...,
    overwrite: bool = ...,
    epochs: Optional[int] = ...,
    batch_size: Optional[int] = ...,
    seed: Optional[int] = ...,
    stop_after_steps: Optional[int] = ...,
    init_from: Optional[str] = ...,
    dense: bool = ...,
    train: Optional[Tuple[List[str], Optional[List[str]], List[str]]] = ...,
    valid: Optional[Tuple[List[str], Optional[List[str]], List[str]]] = ...,
    labels: Optional[List[str]] = ...,
    corpus_texts: Optional[List[str]] = ...,
    corpus_paths: Optional[List[str]] = ...,
    clicks_train: Optional[Tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]] = ...,
    clicks_valid: Optional[Tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]] = ...,
    callback: Optional[Any] = ...,
    console: bool = ...,
    threads: Optional[int] = ...,
) -> Dict[str, Any]: ...
def resume(
    path: str, *, callback: Optional[Any] = ..., console: bool = ..., threads: Optional[int] = ...
) -> Dict[str, Any]: ...
def run_config(path: str) -> str: ...
def run_metrics(path: str) -> List[Dict[str, Any]]: ...
def run_predict(
    path: str, texts: List[str], *, batch_size: int = ..., checkpoint: Optional[str] = ...
) -> Tuple[List[str], npt.NDArray[np.float32], List[str]]: ...
def run_evaluate(
    path: str,
    *,
    texts: Optional[Tuple[List[str], Optional[List[str]], List[str]]] = ...,
    file: Optional[str] = ...,
    batch_size: int = ...,
    checkpoint: Optional[str] = ...,
) -> Dict[str, Any]: ...
def import_hf(
    source: Optional[str],
    out: str,
    *,
    minilm_cache: Optional[str] = ...,
    tt: bool = ...,
    ranks: Optional[List[int]] = ...,
    tol: Optional[float] = ...,
    dense_embedding: bool = ...,
    uniform_ranks: bool = ...,
    seq_len: Optional[int] = ...,
    num_labels: Optional[int] = ...,
    seed: int = ...,
    config: Optional[Tuple[str, str]] = ...,
    overwrite: bool = ...,
) -> Dict[str, Any]: ...
def export_hf(run: str, dir: str, *, samples: int = ..., overwrite: bool = ...) -> Dict[str, Any]: ...
