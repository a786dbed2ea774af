"""The compatibility matrix, rendered from the rule table (config/rules.py) and the schedule table.

Why generated: a hand-written matrix drifts from the checks; this one evaluates the very rules
`resolve()` runs on each pair of features (a small layout that has both), so the README's copy is
what the code refuses (tests/test_rules.py keeps them equal). `autopar rules` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError
from . import TrainConfig
from .rules import RULES, Rule, Setup
from .schedules import SCHEDULE_TABLE
from .strategy import Strategy

MARKERS = ("<!-- rules:begin -->", "<!-- rules:end -->")
DP = 2  # replicas in every layout of the matrix
MICRO_BATCH = 2


@dataclass(frozen=True)
class Feature:
    """One choice of the matrix: the strategy and train fields that turn it on."""

    name: str
    strategy: dict = field(default_factory=dict)
    train: dict = field(default_factory=dict)


FEATURES: tuple[Feature, ...] = (
    Feature("pp 2", {"pp": 2}),
    Feature("tp 2", {"tp": 2}),
    Feature("stage-tp 1,2", {"stage_tp": "1,2"}),
    Feature("interleaved-1f1b", {"pp": 2, "chunks": 2, "schedule": "interleaved-1f1b"}),
    Feature("zb-h1", {"pp": 2, "schedule": "zb-h1"}),
    Feature("zbv", {"pp": 2, "chunks": 2, "schedule": "zbv"}),
    Feature("boundary scatter_gather", {"pp": 2, "boundary": "scatter_gather"}),
    Feature("tp-subbatches 2", {"tp": 2, "tp_subbatches": 2}),
    Feature("recompute all", {"recompute": "all"}),
    Feature("zero 1", {"zero": 1}),
    Feature("zero 3", {"zero": 3}),
    Feature("dtype bf16", train={"dtype": "bf16"}),
    Feature("pipedream-2bw", {"pp": 2, "schedule": "pipedream-2bw"}),
    Feature("pipedream", {"pp": 2, "schedule": "pipedream"}, {"global_batch_size": DP * MICRO_BATCH}),
    Feature("gossip", {"dp_mode": "gossip"}),
    Feature("parameter server", {"dp_mode": "async"}, {"optimizer": "sgd"}),
    Feature("sparse embrace", {"sparse_embeddings": "embrace"}),
    Feature("strategy auto", {"search": "auto"}),
    Feature("ep 2", {"ep": 2}),
    Feature("compile", train={"compile": True}),
    Feature("cp 2", {"cp": 2}),
)


def _merged(a: dict, b: dict) -> dict | None:
    """Both sets of fields, or None where they disagree on a field (no single layout has both)."""
    if any(a[k] != b[k] for k in a.keys() & b.keys()):
        return None
    return {**a, **b}


def refusal(features: tuple[Feature, ...]) -> Rule | str | None:
    """The first rule a layout with all `features` breaks; None when it runs; a string when no layout has them."""
    fields: dict | None = {}
    train: dict | None = {}
    for feature in features:
        fields = None if fields is None else _merged(fields, feature.strategy)
        train = None if train is None else _merged(train, feature.train)
    if fields is None or train is None:
        return "one field, two values"
    strategy = Strategy(dp=DP, **fields)
    world = DP * strategy.cp * (sum(strategy.stage_tps) if strategy.stage_tp else strategy.tp * strategy.pp)
    try:
        resolved = strategy.resolved(world)
    except ConfigError:
        return "no such layout"
    batch = {"global_batch_size": 8 * DP * MICRO_BATCH, "micro_batch_size": MICRO_BATCH, **train}
    setup = Setup(resolved, TrainConfig(**batch), world)
    for rule in RULES:
        try:
            if rule.broken(setup):
                return rule
        except ConfigError:  # the batch does not split for this layout: not a combination refusal
            continue
    return None


def render_grid() -> str:
    """README.md's section: every feature against every other, each cell naming the rule that refuses it."""
    numbers = {rule.name: i + 1 for i, rule in enumerate(RULES)}

    def cell(result: Rule | str | None) -> str:
        if result is None:
            return "✓"
        if isinstance(result, str):
            return "—"
        return f"✗ {numbers[result.name]}"

    lines = ["Generated from the rule table (`src/autopar/config/rules.py`) by `autopar rules`; a test keeps this "
             f"copy equal. Each cell is a layout with both features (dp={DP} replicas): ✓ runs, ✗ N is refused by "
             "rule N of [the rules](docs/features/rules.md), — no single layout has both.", "",
             "| | " + " | ".join(f.name for f in FEATURES) + " |",
             "|---" * (len(FEATURES) + 1) + "|"]
    for row in FEATURES:
        cells = [cell(refusal((row, col))) for col in FEATURES]
        lines.append(f"| **{row.name}** | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_rules() -> str:
    """docs/features/rules.md's section: the rules, numbered as the grid names them, then the schedules."""
    lines = ["Generated from `src/autopar/config/rules.py` and `src/autopar/config/schedules.py` by "
             "`autopar rules`; a test keeps this copy equal.", "",
             "| # | rule | refused | why | what works |", "|---|---|---|---|---|"]
    for i, rule in enumerate(RULES, 1):
        when, why, fix = (_symbolic(text) for text in (rule.when, rule.why, rule.fix))
        lines.append(f"| {i} | `{rule.name}` | {when} | {why} | {fix} |")
    lines += ["", "| schedule | what it does | chunks per rank | micro-batches per replica | placement | "
              "split backward | stage-tp, planned boundary | zero 3 per stage | searched |",
              "|---|---|---|---|---|---|---|---|---|"]
    yes = {True: "yes", False: "no"}
    for spec in SCHEDULE_TABLE:
        flush = "" if spec.flushes else " (no flush)"
        lines.append(f"| `{spec.name}`{flush} | {spec.summary} | {spec.chunks_text()} | {spec.microbatches} | "
                     f"{spec.placement} | {yes[spec.split_backward]} | {yes[spec.stage_tp]} | "
                     f"{yes[spec.zero3_stages]} | {yes[spec.searched]} |")
    return "\n".join(lines) + "\n"


def render_matrix() -> str:
    """Both, as `autopar rules` prints them."""
    return render_grid() + "\n" + render_rules()


class _Placeholder:
    """A value in a rule's text shown by name: {s.pp} becomes <pp>."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, name: str) -> _Placeholder:
        return _Placeholder(name)

    def __format__(self, spec: str) -> str:
        return f"<{self._name}>"

    def __repr__(self) -> str:
        return f"<{self._name}>"


class _Placeholders(dict):
    def __missing__(self, key: str) -> _Placeholder:
        return _Placeholder(key)


def _symbolic(text: str) -> str:
    return text.format_map(_Placeholders()).replace("|", "\\|")


def readme_section(text: str) -> str:
    """The text between the README's markers (without them)."""
    begin, end = MARKERS
    if begin not in text or end not in text:
        raise ConfigError(f"no generated section between {begin} and {end}")
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n") + "\n"


def with_section(text: str, section: str) -> str:
    """`text` (README.md or docs/features/rules.md) with what is between its markers replaced by `section`."""
    begin, end = MARKERS
    head, rest = text.split(begin, 1)
    return f"{head}{begin}\n{section}{end}{rest.split(end, 1)[1]}"
