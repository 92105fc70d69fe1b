"""gate's cache of derived budgets in odd environments and restored from elsewhere: without HOME,
XDG_CACHE_HOME and a passwd entry it lives in the run's folder; an entry edited without its
digest drops the file; a forgery that recomputes the digest is caught by the entry derived again."""

import json
import pwd

import pytest

from sage_qual.qualification import budget_cache
from tests_fast.test_gate_budgets import flux_report, gate, loosen  # noqa: F401 (a fixture)


@pytest.fixture
def no_home(monkeypatch):
    """An arbitrary uid in a container: no HOME, no XDG_CACHE_HOME, no passwd entry."""
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def no_entry(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", no_entry)


def test_without_a_home_the_cache_lives_in_the_runs_folder(capsys, flux_report, no_home):  # noqa: F811
    path, fixtures, _, _ = flux_report
    code, _, err = gate(capsys, path, fixtures)
    assert (code, err) == (0, "")
    cached, = (path.parent / ".sage-qual-cache").glob("budgets-*.json")
    assert json.loads(cached.read_text())["entries"]


def forge(tmp_path, path, data, index):
    """Every cached entry loosened, the digest recomputed as a forger would, and the report's
    failing cell loosened to match."""
    cache_file, = (tmp_path / "cache" / "sage-qual").glob("budgets-*.json")
    model = cache_file.stem.removeprefix("budgets-")
    entries = {key: {**value, "max_rel_l2": 1.0} for key, value in
               json.loads(cache_file.read_text())["entries"].items()}
    budget_cache.save(cache_file, model, entries)
    assert budget_cache.load(cache_file, model) == entries  # the digest checks out
    loosen(path, data, index, max_rel_l2=1.0)
    return cache_file


def test_a_forged_cache_matching_a_loosened_report_is_caught(capsys, tmp_path, flux_report):  # noqa: F811
    path, fixtures, data, index = flux_report
    assert gate(capsys, path, fixtures)[0] == 0
    cache_file = forge(tmp_path, path, data, index)
    code, _, err = gate(capsys, path, fixtures)
    assert code == 2 and "bounds.max_rel_l2: 1.0 in the report is looser" in err
    entries = json.loads(cache_file.read_text())["entries"]
    assert entries and all(e["max_rel_l2"] < 1.0 for e in entries.values())  # derived afresh


def test_an_entry_edited_without_its_digest_drops_the_file(tmp_path):
    path = tmp_path / "budgets-x.json"
    budget_cache.save(path, "model", {"v f": {"max_rel_l2": 0.05}})
    assert budget_cache.load(path, "model") == {"v f": {"max_rel_l2": 0.05}}
    assert budget_cache.load(path, "other model code") == {}
    stored = json.loads(path.read_text())
    stored["entries"]["v f"]["max_rel_l2"] = 0.5
    path.write_text(json.dumps(stored))
    assert budget_cache.load(path, "model") == {}


def test_the_spot_check_derives_one_used_entry_and_compares_it():
    cache = budget_cache.Entries({"a": {"max_rel_l2": 0.05}, "b": {"max_rel_l2": 0.07}})
    cache.get("a")
    asked = []

    def derive(key):
        asked.append(key)
        return {"max_rel_l2": 0.05}

    assert budget_cache.spot_check(cache, list(cache.hits), derive, 1e-4) and asked == ["a"]
    cache.hits = {"b"}
    assert not budget_cache.spot_check(cache, list(cache.hits), derive, 1e-4)
    assert budget_cache.spot_check(cache, [], derive, 1e-4)  # nothing trusted, nothing to check
    assert not budget_cache.agrees({"max_rel_l2": 0.05}, {"max_rel_l2": 0.05, "min_cosine": 0.9}, 1e-4)


