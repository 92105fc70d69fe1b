"""gate's cache of derived budgets (qualification/decide/budget_check.py): an entry edited without its
digest drops the file; the spot check derives one used entry again. The gate-level cases (no
HOME, a forged cache matching a loosened report) are in tests_fast/decide/test_gate_budgets.py."""

import json

from sage_qual.qualification.decide import budget_check


def test_an_entry_edited_without_its_digest_drops_the_file(tmp_path):
    path = tmp_path / "budgets-x.json"
    budget_check.save_cache(path, "model", {"v f": {"max_rel_l2": 0.05}})
    assert budget_check.load_cache(path, "model") == {"v f": {"max_rel_l2": 0.05}}
    assert budget_check.load_cache(path, "other model code") == {}
    stored = json.loads(path.read_text())
    stored["entries"]["v f"]["max_rel_l2"] = 0.5
    path.write_text(json.dumps(stored))
    assert budget_check.load_cache(path, "model") == {}


def test_the_spot_check_derives_one_used_entry_and_compares_it():
    cache = budget_check.Entries({"a": {"max_rel_l2": 0.05}, "b": {"max_rel_l2": 0.07}})
    cache.get("a")
    asked = []

    def derive(key):
        asked.append(key)
        return {"max_rel_l2": 0.05}

    assert budget_check.spot_check(cache, list(cache.hits), derive, 1e-4) and asked == ["a"]
    cache.hits = {"b"}
    assert not budget_check.spot_check(cache, list(cache.hits), derive, 1e-4)
    assert budget_check.spot_check(cache, [], derive, 1e-4)  # nothing trusted, nothing to check
    assert not budget_check.agrees({"max_rel_l2": 0.05}, {"max_rel_l2": 0.05, "min_cosine": 0.9}, 1e-4)


