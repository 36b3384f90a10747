"""comera: computing- and memory-efficient training by rank-adaptive tensor compression."""

from . import _comera  # noqa: F401
