"""`summary.json`: every key `tokenload analyze` writes, as types (docs/summary.md says what each means).

The writer (`tokenload.analysis.summary.summarize` and the modules it calls) builds these dicts and every
reader (report, compare, thresholds, history, the commands) reads them through these types, so a key is
named in one place. A block a key holds only in some runs is a `total=False` class beside the keys every
run has. Percentile keys follow the percentiles asked for (`ttft_p99.9_s`): `PATTERN_KEYS` names them,
the JSON Schema admits them by pattern.

`SUMMARY_VERSION` goes up when a key is renamed or removed, or its meaning changes; adding a key does not
change it.
"""

from __future__ import annotations

from typing import Any, Final, Literal, TypedDict

SUMMARY_VERSION: Final = 1

LoadUnit = Literal["users", "req/s"]
Bound = Literal["prefill", "decode", "queue", "errors"]
Interval = list[float]  # [lo, hi]
# An interval whose upper end may be unknown (a search's boundary above the range).
OpenInterval = tuple[float, float | None]


# ----- run -----------------------------------------------------------------------------------------------------


class Completeness(TypedDict):
    """Did the run finish its plan (`run.completeness`)."""

    stop_reason: str | None
    interrupted: bool
    truncated: bool
    storm: bool
    steps_planned: int | None
    steps_run: int
    censored: int
    censored_step_down: int
    note: str | None
    auto_stop: str | None


class Sampled(TypedDict):
    """`run.sampled`: a run too long to load whole; what was counted over every record and what over a sample."""

    records: int
    sample: int
    seed: int
    from_sample: list[str]
    rank_error: float
    confidence: float
    note: str


class _RunInfo(TypedDict):

    run_id: str | None
    run_dir: str
    label: str
    started_at: float | None
    ended_at: float | None
    duration_s: float | None
    requests: int
    ok: int
    errors: int
    in_flight: int
    cut_step_down: int
    truncated: int
    models: list[str]
    channel: dict[str, Any] | None  # the manifest's channel, without secrets
    scenario: str | None
    scheduler_lag: dict[str, Any] | None  # the manifest's (tokenload.load.lag)
    load_unit: LoadUnit | None
    load_kind: str | None
    completeness: Completeness


class RunInfo(_RunInfo, total=False):
    """What was run, when, and how many requests (`run`)."""

    sampled: Sampled


class AnalysisOptions(TypedDict):
    percentiles: list[float]
    warmup_s: float | None
    goodput_s: dict[str, float] | None
    min_step_requests: int


class SloTable(TypedDict):
    """An SLO's fields (`tokenload.slo.Slo`): per-request bounds in seconds (null: not judged), the share that
    must meet them all, and the load-error limit."""

    ttft_s: float | None
    tpot_s: float | None
    itl_s: float | None
    e2e_s: float | None
    target: float
    max_error_rate: float


class SloSummary(SloTable):
    """The SLO judged by, and the whole run's attainment (`slo`)."""

    describe: str
    attainment: float | None
    judged: int
    not_judged: int
    per_probe: bool  # a search: its probes are each judged at their own load, not pooled (`attainment` null)


# ----- fits and the formula ------------------------------------------------------------------------------------


class LinearFitSummary(TypedDict):
    slope_s_per_token: float
    intercept_s: float
    r2: float
    n: int
    slope_ci95: Interval
    intercept_ci95: Interval


class PowerFitSummary(TypedDict):
    a_s: float
    b: float
    exponent: float
    r2: float
    n: int


class _TtftFit(TypedDict):
    model: Literal["linear", "power"] | None
    slope_s_per_token: float | None
    intercept_s: float | None
    exponent: float | None
    r2: float | None
    n: int


class TtftFit(_TtftFit, total=False):
    """`fits.ttft_vs_input`: the chosen model, both candidates, and the data it rests on."""

    note: str
    linear: LinearFitSummary | None
    power: PowerFitSummary | None
    criterion: str
    slope_at_input_tokens: float
    intercept_check: str | None
    sublinear: str
    steps_used: list[int]
    steps_used_reason: str
    requests_used: str
    of_model: str  # a run of several models: the first model's fit (each one's is in `models`)


class _E2eFit(TypedDict):
    slope_s_per_token: float | None
    intercept_s: float | None
    r2: float | None
    n: int


class E2eFit(_E2eFit, total=False):
    """`fits.e2e_vs_output`, with the slope set against TPOT and the intercept against TTFT."""

    note: str
    slope_ci95: Interval
    intercept_ci95: Interval
    residual_mape: float | None
    tpot_p50_s: float | None
    slope_over_tpot_p50: float | None
    ttft_p50_s: float | None
    intercept_expected_exact_s: float | None
    steps_used: list[int]


class Fits(TypedDict):
    ttft_vs_input: TtftFit
    e2e_vs_output: E2eFit


class _Formula(TypedDict):
    mape_simple: float | None
    mape_exact: float | None
    holds: bool


class Formula(_Formula, total=False):
    """`formula`: e2e predicted from each step's typical TTFT and TPOT, both forms."""

    note: str
    tolerance: float
    basis: str
    not_judged_steps: list[int]
    identity_mape: float | None
    simple_overshoot_p50_s: float | None
    exact_residual_p95_s: float | None
    typical_values_tolerance: float
    typical_values_break_at_active_users: int | None
    typical_values_break_at: str | None
    n: int


class _E2eDrivers(TypedDict):
    r2_input: float | None
    r2_output: float | None
    r2_both: float | None
    verdict: str


class E2eDrivers(_E2eDrivers, total=False):
    """`e2e_drivers`: the third claim; its verdict judged by `attribution` when both lengths varied (`basis`)."""

    basis: str


class _MetricLatency(TypedDict):
    n: int
    censored: int
    censored_step_down: int
    bounds: list[str]  # the percentiles (`p99`) that are lower bounds


class MetricLatency(_MetricLatency, total=False):
    """One metric's whole-run percentiles (`latency.ttft`): `p50`, `p95`, ... as asked (`PATTERN_KEYS`)."""

    p50: float | None
    p95: float | None


class Latency(TypedDict):
    ttft: MetricLatency
    tpot: MetricLatency
    e2e: MetricLatency


# ----- steps ---------------------------------------------------------------------------------------------------


class StepServer(TypedDict, total=False):
    """`steps[].server`: the server's own view of the step, those terms it publishes."""

    running_mean: float | None
    waiting_mean: float | None
    kv_cache_usage_mean: float | None
    queue_time_p50_s: float | None
    server_ttft_p50_s: float | None
    client_minus_server_ttft_p50_s: float | None


class _StepRow(TypedDict):
    """The contract's keys, in its order, then the extras (the writer's order: `analysis.steps.STEP_KEYS`)."""

    step: int
    load_level: float
    load_unit: LoadUnit
    active_users: int
    requests: int
    censored: int
    errors: int
    error_rate: float | None
    rps: float | None
    output_tok_s: float | None
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    tpot_p50_s: float | None
    tpot_p95_s: float | None
    e2e_p95_s: float | None
    slo_attainment: float | None
    formula_mape: float | None
    # extras
    offered_rate: float | None
    achieved_rate: float | None
    achieved_concurrency: float | None
    planned_users: int
    input_tok_s: float | None
    total_tok_s: float | None
    ok: int
    open_at_step_end: int
    warmup_excluded: int
    load_errors: int
    input_errors: int
    config_errors: int
    load_error_rate: float | None
    start: float | None
    end: float | None
    duration_s: float | None
    slo_n: int
    slo_ci: Interval | None
    goodput_rps: float | None
    goodput_share: float | None
    ttft_n: float | None
    tpot_n: float | None
    e2e_n: float | None
    ttft_censored: float | None
    e2e_censored: float | None
    e2e_p50_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    input_tokens_p50: float | None
    output_tokens_p50: float | None
    ttft_slope_s_per_token: float | None
    decided: bool
    new_connections: int
    connect_p50_s: float | None
    connect_p95_s: float | None
    reconnects: int
    send_lag_p99_s: float | None
    ttft_upper_bounds: int
    ttft_inexact: int  # requests whose TTFT is not both ends kernel-stamped, where the step has exact ones
    steady: bool  # the step lasted long enough for its window rates to be a steady state
    bounds: list[str]  # the percentile keys that are lower bounds
    ci: dict[str, Interval | None]  # 95% bootstrap interval per percentile key
    errors_by_kind: dict[str, int]


class StepRow(_StepRow, total=False):
    """One load step (`steps[]`); further percentiles by `PATTERN_KEYS`."""

    server: StepServer


# ----- breakpoint, outage, diagnosis ---------------------------------------------------------------------------


class RuleHit(TypedDict, total=False):
    """Where a breakpoint rule fired (the fields `breakpoint` and every fired rule of `breakpoint_rules` hold)."""

    load_level: float | None
    load_unit: LoadUnit
    active_users: int | None
    step: int
    last_good_load_level: float | None
    last_good_active_users: int | None
    detail: str


class Breakpoint(RuleHit, total=False):
    """`breakpoint`: the first load at which a rule fired (`below_range`: already at the lowest judged)."""

    reason: Literal["error_rate", "slo", "knee"]
    below_range: bool
    lowest_load_level: float
    lowest_active_users: int
    server_cause: str


class _Fired(TypedDict):
    fired: bool


class RuleOutcome(RuleHit, _Fired):
    """`breakpoint_rules.NAME`: whether the rule fired and, when it did, where."""


class BreakpointRules(TypedDict, total=False):
    """`breakpoint_rules`: each rule's outcome (empty when no step was judged)."""

    error_rate: RuleOutcome
    slo: RuleOutcome
    knee: RuleOutcome


class UndecidedStep(TypedDict):
    step: int
    load: str
    n: int


class AutoStop(TypedDict):
    """`auto_stop`: the live rule that ended the run (manifest.json's `stop`), beside the SLO breakpoint."""

    rule: str  # its [stop] key: breakpoint_ttft_p95_s or breakpoint_error_rate
    step: int
    condition: str
    reason: str
    load_level: float | None
    load_unit: LoadUnit | None
    breakpoint: str | None
    verdict: str


class Outage(TypedDict):
    """`outage`: the channel went down mid-run."""

    at_s: float
    at: float
    step: int
    active_users: int
    served_before: int
    failed: int
    errors_by_kind: dict[str, int]
    recovered_at_s: float | None
    http_status: int | None
    message: str | None
    verdict: str
    advice: str


class _Diagnosis(TypedDict):
    bound: Bound | None
    share_ttft: float | None
    error_rate: float
    advice: list[str]


class Diagnosis(_Diagnosis, total=False):
    """`diagnosis`: what bounds the latency, and advice."""

    bound_reason: str
    share_ttft_low_load: float
    load_share_of_e2e: float
    server_cause: str


# ----- caching, fidelity, rate limits, server metrics ----------------------------------------------------------


class Caching(TypedDict):
    usage_reported: bool
    requests: int
    requests_with_cache_reads: int
    cache_read_tokens: int
    cache_creation_tokens: int
    input_tokens: int
    hit_ratio: float | None
    later_turns: int
    later_turns_hit_ratio: float | None
    ttft_p50_cached_s: float | None
    ttft_p50_uncached_s: float | None
    ttft_p50_first_turn_s: float | None
    ttft_p50_later_turns_s: float | None
    honoured: bool | None
    verdict: str


class Fidelity(TypedDict):
    requests: int
    max_tokens_exceeded: int
    usage_below_deltas: int
    headers_held: int
    headers_judged: int
    findings: list[str]


class LowestRemaining(TypedDict):
    remaining: int | None
    limit: int | None
    share: float
    step: int | None


class _RateLimits(TypedDict):
    seen: bool


class RateLimits(_RateLimits, total=False):
    """`rate_limits`: what the channel announced and how it pushed back."""

    requests_per_min: int | None
    tokens_per_min: int | None
    lowest_requests_remaining: LowestRemaining | None
    lowest_tokens_remaining: LowestRemaining | None
    rate_limited: int
    overloaded: int
    limited_from_step: int | None
    limited_after_s: float | None
    backoff_s: float
    held_s: float
    retries: int
    note: str


class ServerCause(TypedDict):
    kind: Literal["kv_cache", "queue", "between"]
    step: int
    text: str


class ServerMetrics(TypedDict, total=False):
    """`server_metrics`: the server's own view; only `note` when nothing was scraped."""

    note: str
    sources: list[str]
    servers: list[str]
    terms: list[str]
    raw_names: int
    steps: list[dict[str, Any]]  # per step the server's numbers beyond steps[].server (names follow its terms)
    cause: ServerCause | None


# ----- search --------------------------------------------------------------------------------------------------


class _ProbeRow(TypedDict):
    level: float
    verdict: Literal["pass", "fail", "undecided"]
    trial: int
    n: int
    attainment: float | None
    ci: Interval | None
    error_rate: float | None
    binding: str | None
    duration_s: float
    tokens: int
    step: int
    run_id: str
    confident: bool
    early: int
    served: int | None


class ProbeRow(_ProbeRow, total=False):
    """`search.probes[]`: one probe, recounted from its records when this run holds them (`this_run`): then with
    the percentiles of its own requests (`ttft_p95_s`, ... by `PATTERN_KEYS`)."""

    this_run: bool
    goodput_rps: float | None
    tokens_split: dict[str, int]  # counted / warmup / cut
    ttft_n: int
    tpot_n: int
    e2e_n: int
    bounds: list[str]  # the percentile keys that are lower bounds
    recount: str
    decided_at: float | None  # unix s, when the search decided it
    binding_detail: str | None  # a failed probe's reason: "TTFT p90 1.1 s > 0.5 s"
    after_outage: bool  # decided after the channel went down (`outage`): its failures are the outage's
    edge: bool  # undecided at the edge: its interval holds the target, within the edge margin of it
    rephased: Literal["burst", "spread"] | None  # started after a pause with every user anew


class _SearchSummary(TypedDict):
    over: Literal["users", "rate"]
    unit: LoadUnit
    capacity: float | None
    first_failing: float | None
    interval: OpenInterval
    binding: Literal["ttft", "tpot", "itl", "e2e", "errors"] | None
    shape: Literal["cliff", "gradual"] | None
    probes: list[ProbeRow]
    tokens: int
    tokens_split: dict[str, int]  # counted / warmup / cut / earlier_runs
    duration_s: float
    range: Interval
    below_range: bool
    above_range: bool
    stopped: str | None
    disagreements: list[float]
    undecided: list[float]
    slo: SloTable  # the SLO the run decided its probes by
    served: int | None
    verdict: str


class EdgeLevel(TypedDict):
    """`search.edge[]`: a level at the edge, its trials' requests pooled."""

    level: float
    n: int
    attainment: float | None
    ci: Interval | None


class SearchSummary(_SearchSummary, total=False):
    """`search`: a searched run's capacity and its probes."""

    binding_detail: str | None
    outage_level: float | None  # the level being probed when the channel went down, left undecided
    edge: list[EdgeLevel]  # the levels at the edge, lowest first


# ----- thresholds ----------------------------------------------------------------------------------------------


class ThresholdResult(TypedDict):
    """`thresholds[]`: one threshold (`tokenload.thresholds`) as judged: the number, its 95% interval (an end
    null: unbounded there), the bound and the outcome."""

    expr: str
    value: float | None
    ci: list[float | None] | None
    bound: float | None
    result: Literal["pass", "fail", "inconclusive"]
    where: str  # "the whole run", "at 8 users", "model sim-7b", ...
    relative: bool  # value, interval and bound are shares of the baseline's number (compare's "+10%")
    note: str | None


# ----- per model, which factor, which lever (analysis/models.py, attribution.py, levers.py) ---------------------


class _ModelPercentiles(TypedDict):
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    tpot_p50_s: float | None
    tpot_p95_s: float | None
    e2e_p50_s: float | None
    e2e_p95_s: float | None
    ci: dict[str, Interval | None]


class ModelStep(_ModelPercentiles):
    """`models.NAME.steps[]`: one model's own numbers at a step."""

    step: int
    load_level: float | None
    load_unit: str
    active_users: int
    requests: int
    slo_attainment: float | None
    formula_mape: float | None


class ModelEntry(_ModelPercentiles):
    """`models.NAME`: one model's requests alone."""

    n: int
    size_b: float | None
    bounds: list[str]
    steps: list[ModelStep]
    formula: Formula | None
    fits: Fits


class Ratio(TypedDict):
    ratio: float
    ci: Interval


class ModelRatio(TypedDict):
    """`model_ratios[]`: a model against the first, within cells of matched load, prompt and output length."""

    model: str
    baseline: str
    matched_cells: int
    n: int
    ttft: Ratio | None
    tpot: Ratio | None
    e2e: Ratio | None
    headline: str


class SizeExponents(TypedDict):
    ttft: float | None
    tpot: float | None


class SizeIntervals(TypedDict):
    ttft: Interval | None
    tpot: Interval | None


class _SizeLaw(TypedDict):
    exponent: SizeExponents
    ci: SizeIntervals
    sizes_b: dict[str, float | None]
    verdict: str


class SizeLaw(_SizeLaw, total=False):
    """`model_size_law`: latency ∝ size^k within matched cells (two sizes or more)."""

    matched_cells: int


class PrefillCoef(TypedDict):
    a_s: float
    b: float


class _PrefillLaw(TypedDict):
    exponent: float | None
    ci: Interval | None
    n: int
    verdict: str


class PrefillLaw(_PrefillLaw, total=False):
    """`prefill_law`: TTFT = a + b n^k per model, one k for all, on the low-load requests that ran alone."""

    requests_used: str
    models: dict[str, PrefillCoef]


class Share(TypedDict):
    share: float
    ci: Interval


class MetricShares(TypedDict):
    """`attribution.ttft` (`tpot`, `e2e`): the model's R² and each factor's share of the variance of log latency."""

    r2: float
    r2_ci: Interval
    shares: dict[str, Share]
    labels: dict[str, str]


class FactorLevels(TypedDict):
    varied: bool
    levels: list[float | None]


class MovedTogether(TypedDict):
    factors: list[str]
    cramers_v: float
    r: float | None


class Attribution(TypedDict, total=False):
    """`attribution`: TTFT, TPOT and e2e over input length, output length, model size and load."""

    note: str
    e2e_verdict: str | None
    scale: Literal["log"]
    factors: dict[str, FactorLevels]
    did_not_vary: list[str]
    moved_together: list[MovedTogether]
    interactions: list[list[str]]
    n: int
    ttft: MetricShares
    tpot: MetricShares
    e2e: MetricShares


class LeverCondition(TypedDict):
    input_tokens: int
    max_tokens: int
    model: str
    load: str


class LeverCi(TypedDict):
    ttft_s: Interval
    tpot_s: Interval
    e2e_s: Interval
    attainment: Interval


class Change(TypedDict):
    change: float
    ci: Interval


class VsToday(TypedDict):
    """A lever's medians over the baseline's (`ratio`) and its attainment minus the baseline's (`change`)."""

    ttft_s: Ratio
    tpot_s: Ratio
    e2e_s: Ratio
    attainment: Change


class LeverBaseline(TypedDict):
    """`lever_baseline`: the condition every lever changes, as predicted."""

    ttft_s: float
    tpot_s: float
    e2e_s: float
    output_tokens: float
    attainment: float
    ci: LeverCi
    arithmetic: str
    condition: LeverCondition


class _LeverRow(TypedDict):
    lever: Literal["prompt", "model", "max_tokens", "load", "off_peak"]
    change: str
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    attainment: float | None
    ci: LeverCi | None
    meets_slo: bool | None


class LeverRow(_LeverRow, total=False):
    """`levers[]`: one lever, predicted; a lever on factors the run moved together has only a `note`."""

    output_tokens: float
    arithmetic: str
    condition: LeverCondition
    vs_today: VsToday
    note: str


# ----- the whole file ------------------------------------------------------------------------------------------


class _Summary(TypedDict):

    schema_version: Literal[1]
    run: RunInfo
    analysis_options: AnalysisOptions
    slo: SloSummary
    fits: Fits
    formula: Formula
    e2e_drivers: E2eDrivers
    latency: Latency
    steps: list[StepRow]
    errors_by_kind: dict[str, int]
    errors_by_class: dict[str, int]
    outage: Outage | None
    breakpoint: Breakpoint | None
    breakpoint_note: str | None
    breakpoint_rules: BreakpointRules
    breakpoint_undecided: list[UndecidedStep]
    auto_stop: AutoStop | None
    diagnosis: Diagnosis
    caching: Caching | None
    fidelity: Fidelity
    rate_limits: RateLimits
    search: SearchSummary | None
    server_metrics: ServerMetrics
    thresholds: list[ThresholdResult]
    problems: list[str]


class Summary(_Summary, total=False):
    """summary.json."""

    models: dict[str, ModelEntry]
    model_ratios: list[ModelRatio]  # runs of several models
    model_size_law: SizeLaw | None
    prefill_law: PrefillLaw
    attribution: Attribution
    levers: list[LeverRow]
    lever_baseline: LeverBaseline | None
    lever_verdict: str


# Keys named by the percentiles asked for: (the TypedDict, a regular expression over its keys, the value type).
PATTERN_KEYS: tuple[tuple[type, str, Any], ...] = (
    (StepRow, r"^(ttft|tpot|e2e)_p[0-9]+(\.[0-9]+)?_s$", float | None),
    (ProbeRow, r"^(ttft|tpot|e2e)_p[0-9]+(\.[0-9]+)?_s$", float | None),
    (MetricLatency, r"^p[0-9]+(\.[0-9]+)?$", float | None),
)
