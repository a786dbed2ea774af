"""The rule table (config/rules.py): one refusal per broken rule, named; the README's matrix is generated from it."""

from __future__ import annotations

from pathlib import Path

import pytest

import autopar
from autopar.config.rules import RULES, Setup, check_rules
from autopar.config.rules_matrix import readme_section, refusal, render_grid, render_rules, FEATURES
from autopar.config.schedules import SCHEDULE_TABLE
from autopar.errors import ConfigError
from autopar.strategies import resolve

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path, render", [("README.md", render_grid), ("docs/features/rules.md", render_rules)])
def test_generated_sections_are_the_tables(path, render):
    """Regenerate with: python -c "from pathlib import Path; from autopar.config.rules_matrix import *;
    [Path(p).write_text(with_section(Path(p).read_text(), r())) for p, r in
     (('README.md', render_grid), ('docs/features/rules.md', render_rules))]" """
    assert readme_section((ROOT / path).read_text()) == render(), \
        f"{path}'s generated section differs from the rule table: regenerate it (see this test's docstring)"


def test_rule_names_are_unique_and_every_rule_says_when_why_and_fix():
    names = [rule.name for rule in RULES]
    assert len(names) == len(set(names))
    assert all(rule.when and rule.why and rule.fix and rule.phase in ("layout", "search") for rule in RULES)


def test_the_first_broken_rule_is_named_with_values_and_fix():
    with pytest.raises(ConfigError) as caught:
        resolve(autopar.Strategy(pp=2, zero=3, schedule="zb-h1"), autopar.TrainConfig(global_batch_size=8,
                                                                                      micro_batch_size=2), 4)
    message = str(caught.value)
    assert "(rule zero-3-stage-schedule)" in message and "pp=2 tp=1" in message and "--zero 2" in message


def test_every_rule_refuses_something_in_the_matrix_or_its_own_layout():
    """Each rule is reachable: broken by some pair of matrix features, or by the layout written here."""
    own = {  # rules whose trigger is not a matrix feature (a train option, a file, the Python API)
        "stage-tp-search": (dict(stage_tp="1,2", plan="plan.json"), {}, 6),
        "stage-tp-memory-budget": (dict(stage_tp="1,2", memory_budget_mb=10.0), {}, 6),
        "stage-tp-subbatches": (dict(stage_tp="1,2", tp_subbatches=2), {}, 3),
        "boundary-needs-pipeline": (dict(tp=2, boundary="scatter_gather"), {}, 2),
        "no-flush-chunks": (dict(pp=2, chunks=2, schedule="pipedream-2bw"), {}, 2),
        "parameter-server-sgd": (dict(dp_mode="async"), {}, 2),
        "pipedream-one-microbatch": (dict(pp=2, schedule="pipedream"), {}, 4),
        "schedule-microbatches": (dict(pp=4, schedule="pipedream-2bw"), {"global_batch_size": 2, "micro_batch_size": 1},
                                  4),
        "vertical-sync-needs-pipedream": (dict(pp=2, vertical_sync=True), {}, 4),
        "tied-delay-needs-pipedream": (dict(pp=2, tied_delay=1), {}, 4),
        "sparse-schedule-needs-embrace": (dict(sparse_embeddings="allgather", sparse_schedule=True), {}, 2),
        "zero-needs-replicas": (dict(zero=1, tp=2), {}, 2),
        "zero-needs-optimizer-state": (dict(zero=1), {"optimizer": "sgd"}, 2),
        "two-bw-whole-model-resume": (dict(schedule="pipedream-2bw"), {"resume": "runs/x"}, 2),
        "parameter-server-workers": (dict(dp_mode="async", servers=2), {"optimizer": "sgd"}, 2),
        "parameter-server-runs-once": (dict(dp_mode="async"), {"optimizer": "sgd", "eval_every": 5}, 2),
        "sparse-cpu-only": (dict(sparse_embeddings="allgather"), {"device": "cuda"}, 2),
        "sparse-schedule-clipping": (dict(sparse_embeddings="embrace", sparse_schedule=True), {}, 2),
        "sparse-resume": (dict(sparse_embeddings="allgather"), {"resume": "runs/x"}, 2),
        "traced-forward": (dict(tp=2), {}, 2),
        "cp-forward": (dict(cp=2), {}, 2),
        "cp-loss": (dict(cp=2), {}, 2),
        "pretrained-synchronous": (dict(dp_mode="gossip"), {}, 2),
        "tp-subbatches-need-tp": (dict(tp_subbatches=2), {}, 2),
        "tp-subbatches-divide": (dict(tp=2, tp_subbatches=3), {}, 2),
        "schedule-chunks": (dict(pp=2, chunks=2), {}, 2),
        "schedule-microbatch-groups": (dict(pp=2, chunks=2, schedule="interleaved-1f1b"),
                                       {"global_batch_size": 6, "micro_batch_size": 2}, 2),
        "interleaved-one-chunk": (dict(pp=2, schedule="interleaved-1f1b"), {}, 2),
        "cp-plan": (dict(cp=2, plan="plan.json"), {}, 2),
        "sp-needs-tp": (dict(sp=True), {}, 2),
        "sp-stage-tp": (dict(sp=True, stage_tp="1,2"), {}, 3),
        "sp-subbatches": (dict(sp=True, tp=2, tp_subbatches=2), {}, 2),
        "sp-boundary": (dict(sp=True, tp=2, pp=2, boundary="scatter_gather"), {}, 4),
        "ep-divides-dp": (dict(ep=4), {}, 2),
        "dp-shares-data-parallel": (dict(cp=2, dp_shares="2,1"), {}, 4),
    }
    from_matrix = {r.name for a in FEATURES for b in FEATURES if not isinstance(r := refusal((a, b)), (str, type(None)))}
    for name, (fields, train, world) in own.items():
        setup = Setup(autopar.Strategy(**fields).resolved(world),
                      autopar.TrainConfig(**{"global_batch_size": 8, "micro_batch_size": 2, **train}), world,
                      custom_forward=name in ("traced-forward", "cp-forward"), pretrained=name == "pretrained-synchronous",
                      custom_loss=name == "cp-loss")
        broken = [rule.name for rule in RULES if rule.broken(setup)]
        assert broken[:1] == [name], (name, broken)
    assert {rule.name for rule in RULES} <= from_matrix | set(own), {rule.name for rule in RULES} - from_matrix - set(own)


def test_search_rules_run_before_the_search():
    with pytest.raises(ConfigError, match=r"--dp-mode gossip is outside it.*\(rule search-scope\)"):
        check_rules(Setup(autopar.Strategy(search="auto", dp_mode="gossip"), autopar.TrainConfig(), 4), phase="search")


def test_schedule_table_names_each_schedule_once_with_a_registered_generator():
    from autopar.pipeline.schedules import GENERATORS
    names = [spec.name for spec in SCHEDULE_TABLE]
    assert len(names) == len(set(names)) and all(spec.generator in GENERATORS for spec in SCHEDULE_TABLE)
    assert autopar.config.SCHEDULES == tuple(spec.name for spec in SCHEDULE_TABLE if spec.flushes)


def test_strategies_argument_replaces_the_table():
    from autopar.strategies import STRATEGIES
    only = (STRATEGIES[-1],)  # data parallelism, whatever is asked
    resolved = resolve(autopar.Strategy(pp=2), autopar.TrainConfig(global_batch_size=8, micro_batch_size=2), 2,
                       strategies=only)
    assert resolved.entry is only[0]
    with pytest.raises(ConfigError, match="no strategy entry applies"):
        resolve(autopar.Strategy(), autopar.TrainConfig(global_batch_size=8, micro_batch_size=2), 2, strategies=())


def test_autopar_rules_prints_the_matrix(capsys):
    from autopar.cli import main
    assert main(["rules"]) == 0
    assert capsys.readouterr().out == render_grid() + "\n" + render_rules()


@pytest.mark.parametrize("mode, world", [("gossip", 2), ("async", 3)])
def test_a_sparse_exchange_is_not_silently_dropped_by_gossip_or_the_parameter_server(mode, world):
    """Both entries come before the sparse one in the strategy table, so their engines used to run with the
    tables all-reduced their own way and --sparse-embeddings unused; now the choice is refused, named."""
    with pytest.raises(ConfigError, match=r"--sparse-embeddings embrace with --dp-mode .*rule sparse-exchange"):
        resolve(autopar.Strategy(dp_mode=mode, sparse_embeddings="embrace"),
                autopar.TrainConfig(global_batch_size=8, micro_batch_size=2), world)
