"""pyproject.toml lists its packages by name (generic top-level names must not pull in anything else), so
a new subpackage left out of the list would be missing from an installed pdserve (a container image)
while every test from the checkout still passes. Here the list and the tree agree."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_product_package_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    tops = {name.split(".")[0] for name in listed}
    found = {
        ".".join(init.parent.relative_to(ROOT).parts) for top in tops for init in (ROOT / top).rglob("__init__.py")
    }
    assert found == listed
