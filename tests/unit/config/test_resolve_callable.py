"""``callable_path`` / ``resolve_callable``: the one resolver of config values that name a
Python callable (reward functions, checkers, environment factories)."""

from __future__ import annotations

import os.path

import pytest

from nemo_rlhf.config import callable_path, resolve_callable

BUILTINS = {"join": "os.path:join"}


def test_callable_path_maps_short_names_keeps_paths_and_refuses_the_rest():
    assert callable_path("join", BUILTINS) == "os.path:join"
    assert callable_path("os.path:basename", BUILTINS) == "os.path:basename"
    for bad in ("nope", "os.path:", ":join", None, 3):
        assert callable_path(bad, BUILTINS) is None


def test_resolve_callable_imports_dotted_attributes_and_names_key_and_value_in_errors():
    assert resolve_callable("join", "os.path:join", "k") is os.path.join
    assert resolve_callable("os:path.join", "os:path.join", "k") is os.path.join
    with pytest.raises(ImportError, match=r"env\.name='no_such_mod:f'.*'no_such_mod'"):
        resolve_callable("no_such_mod:f", "no_such_mod:f", "env.name")
    with pytest.raises(AttributeError, match=r"k='join' \(built-in: 'os.path:nope'\).*'nope'"):
        resolve_callable("join", "os.path:nope", "k")
    with pytest.raises(TypeError, match=r"os.path:sep is a str, not a callable"):
        resolve_callable("os.path:sep", "os.path:sep", "k")
