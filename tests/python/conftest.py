"""Shared fixtures: tiny models and the cuda marker."""

from __future__ import annotations

import pytest

import kvcache


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if kvcache.cuda_available():
        return
    skip = pytest.mark.skip(reason="no usable CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
