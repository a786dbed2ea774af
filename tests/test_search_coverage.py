"""What the strategy search covers: every candidate it lists is one the rule table runs (and only those), a rule
added to the table prunes it, and every Strategy field or dimension it does not search is named in the docs and
in `plan --auto`'s output."""

from __future__ import annotations

import json

import pytest

from autopar.config import Strategy
from autopar.search.cluster import preset
from autopar.search.cost import StepModel
from autopar.search.search import SearchSpace, enumerate_candidates

def test_every_dimension_not_searched_is_named_in_the_docs_and_the_plan(capsys):
    from pathlib import Path

    from autopar.cli import main
    from autopar.config.rules import RULES
    from autopar.config.schedules import SCHEDULE_TABLE
    from autopar.search.coverage import COVERAGE, not_covered
    doc = (Path(__file__).resolve().parents[1] / "docs" / "features" / "strategy-search.md").read_text()
    names = [d.name for d in COVERAGE if not d.searched]
    assert [n for n in names if f"`{n}`" not in doc] == []
    assert {f"--schedule {s.name}" for s in SCHEDULE_TABLE if not s.searched} <= set(names)
    scope = next(r for r in RULES if r.name == "search-scope").when  # what auto refuses beside it
    flags = {"--dp-mode", "--sparse-embeddings", "--tp-subbatches", "--recompute all-but-last", "--memory-budget-mb",
             "--optimizer sparse-adam"}
    assert all(flag in scope for flag in flags)
    assert all(any(n.startswith(flag) for n in names) for flag in flags | {"--stage-tp", "--dtype", "--boundary"})
    args = ["plan", "--auto", "--model", "gpt-tiny", "--nproc", "2", "--seq-len", "32", "--global-batch-size", "4",
            "--cost-model", "flops", "--cluster", "cpu-local", "--top", "1"]
    assert main(args) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("not searched: ")]
    assert len(line) == 1 and all(n in line[0] for n in names)
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["search"]["not_covered"] == not_covered()


def _tiny_step_model(optimizer="adamw", dtype="fp32", nproc=8):
    from autopar.search.profile import profile_model
    prof = profile_model("gpt-tiny", seq_len=32, tp_degrees=tuple(d for d in (1, 2, 4, 8) if nproc % d == 0))
    return StepModel(prof, preset("a100-80gb"), global_batch_size=16, optimizer=optimizer, dtype=dtype)


@pytest.mark.parametrize("optimizer,dtype", [("adamw", "fp32"), ("sgd", "bf16")])
def test_search_enumerates_exactly_what_the_rule_table_runs(optimizer, dtype):
    """Among the layouts within the search's own limits, a candidate is enumerated iff check_rules accepts it."""
    import itertools

    from autopar.config import TrainConfig
    from autopar.config.rules import Setup, check_rules
    from autopar.errors import ConfigError
    from autopar.search.search import search_limits
    model = _tiny_step_model(optimizer, dtype)
    space = SearchSpace(nproc=8)
    listed = {(c.dp, c.tp, c.pp, c.micro_batch_size, c.schedule, c.chunks, c.zero, c.recompute)
              for c in enumerate_candidates(model, space)}
    seen = {"zero 3 with pp": False, "zero 1 with tp": False}
    for tp, pp in itertools.product((1, 2, 4), (1, 2, 4)):
        dp = 8 // (tp * pp)
        if tp not in model.profile.tp or dp < 1:
            continue
        for mbs, schedule, chunks, zero, recompute in itertools.product(
                (1, 2), space.schedules, space.chunks, space.zero_levels, space.recompute):
            if not search_limits(schedule, pp, chunks, model.profile.num_blocks):
                continue
            strategy = Strategy(dp=dp, tp=tp, pp=pp, schedule=schedule, chunks=chunks, zero=zero,
                                recompute="all" if recompute == "all" else "none",
                                memory_budget_mb=1.0 if recompute == "stage-aware" else None)
            config = TrainConfig(global_batch_size=16, micro_batch_size=mbs, optimizer=optimizer, dtype=dtype)
            try:
                check_rules(Setup(strategy, config, 8))
                runs = True
            except ConfigError:
                runs = False
            assert ((dp, tp, pp, mbs, schedule, chunks, zero, recompute) in listed) == runs, (strategy, config)
            seen["zero 3 with pp"] |= runs and zero == 3 and pp > 1
            seen["zero 1 with tp"] |= runs and zero == 1 and tp > 1
    assert all(seen.values()) == (optimizer != "sgd")  # every zero level with pp and tp, where the rules allow


def test_a_rule_added_to_the_table_prunes_the_search(monkeypatch):
    from autopar.config import rules
    from autopar.search.runnable import broken_rules
    model = _tiny_step_model()
    before = list(enumerate_candidates(model, SearchSpace(nproc=8)))
    assert any(c.zero == 2 and c.tp > 1 for c in before)
    extra = rules.Rule("test-no-zero-2-with-tp", "--zero 2 with tp > 1",
                       lambda setup: setup.strategy.replicas.zero == 2 and setup.strategy.tp > 1, "seen", "why", "fix")
    monkeypatch.setattr(rules, "RULES", (*rules.RULES, extra))
    broken_rules.cache_clear()
    try:
        after = list(enumerate_candidates(model, SearchSpace(nproc=8)))
    finally:
        monkeypatch.undo()
        broken_rules.cache_clear()
    assert after == [c for c in before if not (c.zero == 2 and c.tp > 1)]


def test_every_strategy_field_is_searched_or_named_as_not_searched():
    """A new runtime dimension (a Strategy field) fails here until the coverage table names it."""
    from autopar.search.coverage import COVERAGE, FIELD_ROWS, SEARCH_SETTINGS
    fields = {f.name for f in Strategy.flat_fields()}
    assert sorted(fields - set(FIELD_ROWS) - set(SEARCH_SETTINGS)) == []
    assert set(FIELD_ROWS.values()) <= {d.name for d in COVERAGE}
