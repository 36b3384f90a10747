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

class DeviceError(ComeraError):
    """A device that is not there or cannot take the work (no driver, GPU or NVRTC, a plan
    that does not fit, or what the GPU path does not do yet)."""

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
    device: Optional[str] = ...,
) -> Dict[str, Any]: ...
def resume(
    path: str,
    *,
    callback: Optional[Any] = ...,
    console: bool = ...,
    threads: Optional[int] = ...,
    extend_epochs: Optional[int] = ...,
    device: Optional[str] = ...,
) -> Dict[str, Any]: ...
def run_config(path: str) -> str: ...
def run_metrics(path: str) -> List[Dict[str, Any]]: ...
def run_predict(
    path: str,
    texts: List[str],
    *,
    batch_size: int = ...,
    checkpoint: Optional[str] = ...,
    device: Optional[str] = ...,
) -> Tuple[List[str], npt.NDArray[np.float32], List[str]]: ...
def run_evaluate(
    path: str,
    *,
    texts: Optional[Tuple[List[str], Optional[List[str]], List[str]]] = ...,
    file: Optional[str] = ...,
    batch_size: int = ...,
    checkpoint: Optional[str] = ...,
    device: Optional[str] = ...,
) -> Dict[str, Any]: ...
def devices(*, open: bool = ...) -> Dict[str, Any]: ...
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
def run_tt_modules(path: str) -> List[Dict[str, Any]]: ...
def cli_main(argv: List[str]) -> int: ...

# --- kernels of comera.torch (comera/torch.py wraps them as torch modules) ---

_F32 = npt.NDArray[np.float32]

class TtLinearKernel:
    """comera's TtLinear and a workspace per batch-row count (see comera.torch.TTLinear)."""

    def __init__(
        self, in_modes: List[int], out_modes: List[int], ranks: List[int], threshold: float = ...
    ) -> None: ...
    @property
    def in_features(self) -> int: ...
    @property
    def out_features(self) -> int: ...
    @property
    def ranks(self) -> List[int]: ...
    @property
    def core_shapes(self) -> List[Tuple[int, int, int]]: ...
    @property
    def threshold(self) -> float: ...
    def path(self, rows: int) -> str: ...
    def forward(
        self, x: _F32, cores: List[_F32], gates: List[_F32], bias: Optional[_F32], y: _F32
    ) -> int: ...
    def backward(
        self,
        forward_id: int,
        x: _F32,
        cores: List[_F32],
        gates: List[_F32],
        bias: Optional[_F32],
        dy: _F32,
        dx: Optional[_F32],
        core_grads: List[_F32],
        gate_grads: List[_F32],
        bias_grad: Optional[_F32],
    ) -> bool: ...

class TtmKernel:
    """comera's TtmEmbedding and a workspace per id count (see comera.torch.TTMEmbedding)."""

    def __init__(
        self,
        vocab_modes: List[int],
        dim_modes: List[int],
        ranks: List[int],
        num_embeddings: int,
        threshold: float = ...,
    ) -> None: ...
    @property
    def num_embeddings(self) -> int: ...
    @property
    def embedding_dim(self) -> int: ...
    @property
    def ranks(self) -> List[int]: ...
    @property
    def core_shapes(self) -> List[Tuple[int, int, int, int]]: ...
    @property
    def threshold(self) -> float: ...
    def forward(self, ids: npt.NDArray[np.int64], cores: List[_F32], gates: List[_F32], y: _F32) -> int: ...
    def backward(self, *args: Any) -> bool: ...

def tt_matrix_svd(
    w: _F32, in_modes: List[int], out_modes: List[int], max_rank: Optional[int] = ..., rel_tol: Optional[float] = ...
) -> Any: ...
def ttm_svd(
    table: _F32, vocab_modes: List[int], dim_modes: List[int], max_rank: Optional[int] = ..., rel_tol: Optional[float] = ...
) -> Any: ...
def balanced_modes(n: int, parts: int = ...) -> List[int]: ...
def empty(rows: int, cols: int) -> _F32: ...
def empty_cache() -> int: ...
def cached_bytes() -> int: ...
def set_cache_limit(bytes: int) -> int: ...
def set_num_threads(threads: int) -> None: ...
def get_num_threads() -> int: ...

class PooledBuffer: ...
