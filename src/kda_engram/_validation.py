"""Compatibility re-export: the argument rules live in :mod:`kda_engram.validation`."""

from .validation.common import (  # noqa: F401
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_index_range,
    check_same_dtype,
    check_tensor,
)
