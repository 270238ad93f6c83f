"""The DS4REF_* environment variables: one table (ds4ref/settings.py), read through getenv."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import ds4ref
from ds4ref import settings


def test_every_variable_the_package_names_is_in_the_table():
    root = Path(ds4ref.__file__).parent
    named = {m for p in root.rglob("*.py") for m in re.findall(r"DS4REF_[A-Z0-9_]+", p.read_text())}
    assert named and named <= set(settings.SETTINGS), sorted(named - set(settings.SETTINGS))
    raw = [str(p.relative_to(root)) for p in root.rglob("*.py")
           if p.name != "settings.py" and "os.environ" in p.read_text()]
    assert raw == [], f"read the environment through ds4ref.settings.getenv: {raw}"


def test_getenv_defaults_overrides_and_refuses_unknown_names(monkeypatch):
    monkeypatch.delenv("DS4REF_PREFILL_RPW", raising=False)
    assert settings.getenv_int("DS4REF_PREFILL_RPW") == 2
    monkeypatch.setenv("DS4REF_PREFILL_RPW", "1")
    assert settings.getenv_int("DS4REF_PREFILL_RPW") == 1
    monkeypatch.setenv("DS4REF_PREFILL_RPW", "two")
    with pytest.raises(ValueError, match="DS4REF_PREFILL_RPW='two' is not an integer"):
        settings.getenv_int("DS4REF_PREFILL_RPW")
    with pytest.raises(KeyError, match="not a ds4ref setting"):
        settings.getenv("DS4REF_NO_SUCH_THING")


def test_the_table_prints_without_the_api_key(monkeypatch, capsys):
    monkeypatch.setenv("DS4REF_API_KEY", "sk-do-not-print")
    settings.main()
    out = capsys.readouterr().out
    assert "DS4REF_MATVEC_RPW" in out and "sk-do-not-print" not in out
