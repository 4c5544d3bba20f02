"""Every public module declares ``__all__`` and every name in it exists."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import tokenward.pricing
import tokenward.proxy
import tokenward.reports

MODULES = sorted(
    name
    for package in (tokenward.pricing, tokenward.proxy, tokenward.reports)
    for name in [package.__name__] + [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
    if not name.rsplit(".", 1)[-1].startswith("_")
)


@pytest.mark.parametrize(
    "name", [m for m in MODULES if m.count(".") >= 2 and not m.endswith(("proxy", "pricing", "reports"))]
)
def test_all_is_declared_and_complete(name):
    module = importlib.import_module(name)
    assert hasattr(module, "__all__"), name
    for member in module.__all__:
        assert hasattr(module, member), f"{name}.{member}"
