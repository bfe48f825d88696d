"""pyproject.toml as setuptools reads it: the license in the current form (issue 54)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"


def test_the_license_is_an_spdx_expression_and_setuptools_reads_it_without_a_deprecation_warning():
    """``license = {text = ...}`` (the table form) made every install warn that it is
    deprecated (setuptools >= 77 takes the SPDX string; builds stop accepting the table in
    2027). The build requires a setuptools that knows the string form."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    setuptools = pytest.importorskip("setuptools")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    data = tomllib.loads(PYPROJECT.read_text())
    assert data["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77" in data["build-system"]["requires"]
    assert int(setuptools.__version__.split(".")[0]) >= 77  # the one the tests run with
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), str(PYPROJECT))
    assert [str(w.message) for w in caught if "license" in str(w.message).lower()] == []
    assert dist.metadata.license_expression == "Apache-2.0"
