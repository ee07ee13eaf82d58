"""``rawpaged.errors.import_optional``: a missing library becomes a ``ValueError`` that names the
package and how to install it (the server answers it with a 400)."""

import sys

import pytest

from rawpaged.errors import InvalidRequestError, MissingDependencyError, import_optional


def test_a_present_module_is_returned():
    assert import_optional("json", "anything") is sys.modules["json"]


def test_a_missing_default_dependency_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # as on a host without it
    with pytest.raises(MissingDependencyError) as e:
        import_optional("llguidance", "structured outputs", param="structured_outputs")
    assert isinstance(e.value, InvalidRequestError) and isinstance(e.value, ValueError)
    assert str(e.value) == (
        "structured outputs needs the package 'llguidance', not installed here: "
        "pip install llguidance (in rawpaged's default install)"
    )
    assert e.value.param == "structured_outputs"


def test_a_missing_extra_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(MissingDependencyError, match=r"needs the package 'ray'.*pip install 'rawpaged\[ray\]'"):
        import_optional("ray", "data-parallel replicas")
