"""--strategy auto under torchrun: which plan a (re)start runs, decided without starting any process."""

from __future__ import annotations

import pytest

from autopar.config import JobConfig, Strategy, TrainConfig
from autopar.elastic_plan import plan_for_world, read_previous_plan, searches_on_the_ranks
from autopar.errors import ConfigError
from autopar.search.auto import Plan, resolve_choice

NUM_PARAMS = 1000


def _plan(dp: int, *, pp: int = 1, num_params: int = NUM_PARAMS, source: str = "run/plan.json") -> Plan:
    return Plan({"strategy": {"dp": dp, "tp": 1, "pp": pp}, "nproc": dp * pp, "num_params": num_params,
                 "train": {"global_batch_size": 8, "micro_batch_size": 2}}, source=source)


class Search:
    """A stand-in for the search: counts its calls, returns a plan for `world`."""

    def __init__(self, world: int, pp: int = 1):
        self.calls, self.world, self.pp = 0, world, pp

    def __call__(self) -> Plan:
        self.calls += 1
        plan = _plan(self.world // self.pp, pp=self.pp, source="the search")
        plan.record["searched"] = True
        return plan


def test_a_restart_with_as_many_processes_keeps_its_plan():
    previous, search = _plan(4), Search(4)
    plan, note = plan_for_world(4, Strategy.auto(), TrainConfig(), previous, NUM_PARAMS, search)
    assert plan is previous and search.calls == 0
    assert note == "the run's plan is for 4 processes, as this start: keeps dp=4 tp=1 pp=1 m=1 of 2"


def test_another_world_size_is_planned_again_and_the_old_plan_is_kept_beside_it():
    previous, search = _plan(4), Search(2, pp=2)
    plan, note = plan_for_world(2, Strategy.auto(), TrainConfig(), previous, NUM_PARAMS, search)
    assert search.calls == 1 and plan.record["searched"] and plan.nproc == 2
    assert note == "world changed from 4 to 2: re-planned: dp=1 tp=1 pp=2 1f1b m=4 of 2 time cut"
    assert plan.record["replanned"] == {"from_nproc": 4, "to_nproc": 2, "how": "searched again"}
    assert plan.record["earlier_plans"] == [previous.record]
    # growing back to 4: the plan this run had for 4 comes back, without searching, and 2's is kept
    again, search = Search(4), Search(4)
    back, note = plan_for_world(4, Strategy.auto(), TrainConfig(), plan, NUM_PARAMS, again)
    assert again.calls == 0 and back.record["strategy"] == previous.record["strategy"]
    assert note.startswith("world changed from 2 to 4: re-planned: dp=4 tp=1 pp=1")
    assert [p["nproc"] for p in back.record["earlier_plans"]] == [2]
    assert "earlier_plans" not in back.record["earlier_plans"][0]


def test_no_plan_or_a_plan_for_another_model_or_batch_is_searched_afresh():
    for previous, config in ((None, TrainConfig()), (_plan(4, num_params=7), TrainConfig()),
                             (_plan(4), TrainConfig(global_batch_size=16))):  # the user changed the batch
        search = Search(4)
        plan, note = plan_for_world(4, Strategy.auto(), config, previous, NUM_PARAMS, search)
        assert search.calls == 1 and note is None and "replanned" not in plan.record


def test_a_plan_the_user_fixed_for_another_world_is_refused_not_replaced(tmp_path):
    path = tmp_path / "plan.json"
    _plan(4).save(path)
    job = JobConfig(strategy=Strategy(search="auto", plan=str(path)))
    assert not searches_on_the_ranks(job) and searches_on_the_ranks(JobConfig(strategy=Strategy.auto()))
    with pytest.raises(ConfigError, match="was made for 4 processes, this run has 2"):
        resolve_choice(job.strategy, TrainConfig(), 2)


def test_a_damaged_or_missing_plan_file_is_searched_again(tmp_path):
    assert read_previous_plan(None) is None and read_previous_plan(tmp_path / "plan.json") is None
    (tmp_path / "plan.json").write_text("{not json")
    assert read_previous_plan(tmp_path / "plan.json") is None


def _agree(outcome: str) -> object:
    """agree_on_plan on every rank of the pool, rank 0's choice replaced by `outcome`: a plan, or an error."""
    import autopar.elastic_plan as elastic_plan
    from autopar.errors import AutoparError

    def choose(job, world):  # called on rank 0 only
        if outcome == "plan":
            return _plan(world, source="the search"), None
        raise ConfigError("no configuration fits") if outcome == "config" else RuntimeError("search crashed")

    original, elastic_plan.choose_on_rank_zero = elastic_plan.choose_on_rank_zero, choose
    try:
        return elastic_plan.agree_on_plan(JobConfig(strategy=Strategy.auto())).record
    except (AutoparError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        elastic_plan.choose_on_rank_zero = original


def test_every_rank_gets_rank_zeros_plan_or_its_error(rank_pool):
    pool = rank_pool(2)
    assert pool.run(_agree, "plan") == [_plan(2).record] * 2
    assert pool.run(_agree, "config") == ["ConfigError: no configuration fits"] * 2
    assert pool.run(_agree, "crash") == ["RuntimeError: search crashed",
                                         "DistributedError: rank 0 failed while choosing the plan: RuntimeError: "
                                         "search crashed"]
