"""--advise and --hook auto weigh DiLoCo (Note [DiLoCo advice] in
fastddp/tuning/diloco_advice.py) from injected measurements (no clock): on a slow link it is
recommended only when the quality table holds a DiLoCo row within tolerance of fp32
allreduce, never on a fast link, never without rows (and the text says so); the text cites
the table's figures; auto prints it once and chooses exactly as without it. Plus
cost_model.diloco on hand-computed cases."""

import copy
import io
import math
from contextlib import redirect_stdout

import pytest

from fastddp.launch.sync_patch import parse_sync_spec
from fastddp.hooks.auto_hook import AutoHook
from fastddp.link.model import Link, parse_link
from fastddp.tuning import _auto_choice, advise, auto, candidates, diloco_advice, quality_table
from fastddp.tuning import cost_model as cm

WORLD = 4
# One bucket of 2M values in 1-D tensors (8 MB of fp32): no low-rank hook compresses it, so
# on a slow link even the best per-step hook (8-bit) is link-bound.
SHAPES = [[(1_000_000,), (1_000_000,)]]
SLOW, FAST = parse_link("100Mb/s"), parse_link("10GB/s")
# Text-task scores (bits/char, lower is better; fp32 allreduce 3.1438, tolerance 2%: up to
# 3.2067 is within): the full-model rows within, the streaming ones not.
ROWS = {"diloco h10": 3.1500, "diloco h50": 3.1600, "diloco h100": 3.1900,
        "streaming int8 p4": 3.3000, "streaming int4 p4": 3.3500,
        "torchft diloco h50": 3.1610, "torch post-local SGD": 3.2500}
ALL_DILOCO = (*diloco_advice.CONFIGS, *diloco_advice.REFERENCES)


def _sample(step_ms: float = 20.0, ready_ms: float = 10.0) -> dict:
    """A 20 ms step whose bucket is ready at 10 ms, nothing exposed: 20 ms of compute."""
    stats = {"world_size": WORLD, "steps": 1, "exposed_comm_ms": 0.0, "buckets": [
        {"ready_ms": ready_ms, "launched_ms": ready_ms, "done_ms": ready_ms,
         "wire_bytes": 8e6}]}
    return {"step_ms": step_ms, "stats": stats, "shapes": SHAPES}


def _free_kernels() -> dict:
    return {**{name: {} for _, name in advise._CANDIDATES}, "hier": {}}


@pytest.fixture
def table(monkeypatch: pytest.MonkeyPatch):
    """Sets the quality table the advice reads: ``rows`` added to the text task's (with
    counted bytes for one), every DiLoCo row removed first (another session may land some)."""
    def use(rows: dict[str, float]) -> dict:
        quality = copy.deepcopy(quality_table.QUALITY)
        for task in quality.values():
            for name in ALL_DILOCO:
                task["final"].pop(name, None)
                for key in ("bytes", "bytes_per_step", "other_runs"):  # merged rows' keys
                    task.get(key, {}).pop(name, None)
        quality["text"]["final"].update(rows)
        if "diloco h100" in rows:
            quality["text"].setdefault("bytes", {})["diloco h100"] = 120_000.0
        monkeypatch.setattr(quality_table, "QUALITY", quality)
        return quality["text"]
    return use


def _advice(link: Link) -> dict:
    return advise.advise([_sample()], link, None, _free_kernels())


def test_cost_model_diloco_by_hand() -> None:
    link = Link(bus_gbs=1.0)  # 1e6 bytes a ms
    # fp32: one allreduce of 4e6 bytes, bus factor 2 * 3/4: 6 ms every 10 steps of 10 ms.
    p = cm.diloco(1_000_000, 10.0, link, 4, 10)
    assert math.isclose(p.sync_ms, 6.0) and math.isclose(p.step_ms, 10.6)
    assert math.isclose(p.bytes_per_step, 6e6 / 10)
    # int4, gathered: every rank's 0.5625 bytes a value, 4 ranks, bus factor 3/4.
    p = cm.diloco(1_000_000, 10.0, link, 4, 10, wire="int4")
    assert math.isclose(p.sync_ms, 4 * 0.5625 * 0.75)
    # int8 shards: an alltoall and an allgather of 1.015625 bytes a value, 3/4 each.
    p = cm.diloco(1_000_000, 10.0, link, 4, 10, wire="int8", quantized_sum="shards")
    assert math.isclose(p.sync_ms, 2 * 1.015625 * 0.75)
    # Streaming: 4 fragments of 2.5e5 values, one every 25 steps; 1.5 ms of fp32 allreduce
    # hidden behind overlap=1 inner step of 10 ms: nothing exposed.
    p = cm.diloco(1_000_000, 10.0, link, 4, 100, fragments=4, overlap=1)
    assert math.isclose(p.sync_ms, 1.5) and p.exposed_ms == 0 and p.step_ms == 10.0
    # overlap 0: the 1.5 ms is exposed once per 25 steps.
    p = cm.diloco(1_000_000, 10.0, link, 4, 100, fragments=4)
    assert math.isclose(p.step_ms, 10.0 + 1.5 / 25)
    # int8 shards, overlap 3: the alltoall has 2 inner steps to hide behind, the allgather
    # (launched once the alltoall is waited for) 1, as DiLoCo runs them: each 15.234375 ms,
    # 20e6 values at 1.015625 bytes, 3/4 bus: 0 + 5.234375 ms exposed (not the whole window's
    # max(0, 30.47 - 30)).
    p = cm.diloco(20_000_000, 10.0, link, 4, 10, wire="int8", quantized_sum="shards",
                  overlap=3)
    assert math.isclose(p.sync_ms, 2 * 15.234375)
    assert math.isclose(p.exposed_ms, 15.234375 - 10.0)
    with pytest.raises(ValueError, match="wire"):
        cm.diloco(10, 1.0, link, 4, 10, wire="fp16")
    # What fastddp.DiLoCo refuses has no cost either.
    with pytest.raises(ValueError, match="quantized_sum must be"):
        cm.diloco(10, 1.0, link, 4, 10, wire="int8", quantized_sum="shard")
    with pytest.raises(ValueError, match="needs an int8 or int4 wire"):
        cm.diloco(10, 1.0, link, 4, 10, wire="bf16", quantized_sum="shards")
    with pytest.raises(ValueError, match="overlap=10"):
        cm.diloco(10, 1.0, link, 4, 10, overlap=10)
    with pytest.raises(ValueError, match="overlap=-1"):
        cm.diloco(10, 1.0, link, 4, 10, overlap=-1)
    with pytest.raises(ValueError, match="multiple of fragments"):
        cm.diloco(10, 1.0, link, 4, 10, fragments=3)


def test_sync_flags_are_the_launchers() -> None:
    for config, settings in diloco_advice.CONFIGS.items():
        flag = diloco_advice.sync_flag(config)
        parsed = parse_sync_spec(flag.removeprefix("--sync "))
        assert {k: parsed[k] for k in settings} == settings, config


def test_slow_link_recommends_diloco_the_table_supports(table) -> None:
    text_table = table(ROWS)
    advice = _advice(SLOW)
    verdict = advice["diloco"]
    assert verdict["bound"] and verdict["per_step"] in ("int8", "fp8")
    options = {o["config"]: o for o in verdict["options"]}
    # Streaming int4 is predicted fastest (its exchange hides behind 2 inner steps), but
    # its row is not within 2% of fp32: the fastest supported one, H = 100, is recommended.
    assert min(options, key=lambda c: options[c]["predicted_step_ms"]) == "streaming int4 p4"
    assert verdict["recommended"] == "diloco h100"
    assert verdict["sync"] == "--sync diloco:H=100"
    # 20 ms of compute + 8e6 bytes allreduced (bus factor 1.5) at 12.5e6 B/s, every 100 steps.
    assert math.isclose(verdict["predicted_step_ms"], 20.0 + 8e6 * 1.5 / 12.5e6 * 1e3 / 100)
    text = verdict["text"]
    # The why: the link time against compute, and the table's figures.
    assert f"fastest per-step hook, {verdict['per_step']}" in text
    assert f"fp32 allreduce {text_table['final']['fp32 allreduce']:.4f}" in text
    for name, score in ROWS.items():
        assert f"{name} {score:.4f}" in text, name
    assert "streaming int4 p4 3.3500 (not within 2%)" in text
    assert "diloco h100 3.1900 (within 2%), 0.12 MB sent a step" in text
    assert "Recommended: --sync diloco:H=100 " in text
    assert text in advise.format_markdown(advice)
    # The outer settings' line: the small-job table's row for these 4 workers, or its absence.
    assert text.endswith(diloco_advice.outer_settings("text", WORLD))


def test_slow_link_unmeasured_rows_are_never_recommended(table) -> None:
    table({"diloco h10": 3.1500})  # only H = 10 measured
    verdict = _advice(SLOW)["diloco"]
    assert verdict["recommended"] == "diloco h10"
    assert ("Not measured, so not recommended: streaming int4 p4, streaming int8 p4, "
            "diloco h100, diloco h50.") in verdict["text"]


def test_slow_link_rows_out_of_tolerance_recommend_nothing(table) -> None:
    table({name: 3.3 for name in diloco_advice.CONFIGS})
    verdict = _advice(SLOW)["diloco"]
    assert verdict["bound"] and verdict["recommended"] is None and verdict["sync"] is None
    assert "were not measured within 2% of fp32 allreduce" in verdict["text"]


def test_slow_link_without_rows_says_so_and_recommends_nothing(table) -> None:
    table({})
    advice = _advice(SLOW)
    verdict = advice["diloco"]
    assert verdict["bound"] and verdict["recommended"] is None
    assert any(o["gain"] >= diloco_advice.MIN_GAIN for o in verdict["options"])
    assert "quality has not been measured on real data" in verdict["text"]
    assert "not recommended on speed alone" in verdict["text"]
    assert "Recommended:" not in verdict["text"]
    assert verdict["text"] in advise.format_markdown(advice)


def test_fast_link_says_nothing_of_diloco(table) -> None:
    table(ROWS)
    advice = _advice(FAST)
    verdict = advice["diloco"]
    # 8-bit at 10 GB/s: about 0.3 ms of link against 20 ms of compute.
    assert not verdict["bound"] and verdict["recommended"] is None and verdict["text"] is None
    assert "DiLoCo" not in advise.format_markdown(advice)


def test_auto_choice_unchanged_and_its_one_message(table, monkeypatch) -> None:
    monkeypatch.setattr(advise, "kernel_costs", lambda shapes, device: _free_kernels())
    spec = AutoHook("any")
    names = candidates.for_auto(spec, 25.0, False)

    def plan() -> tuple:
        return _auto_choice.predict([_sample()] * 3, names, WORLD, "cpu", SLOW, None)

    table({})
    without = plan()
    table(ROWS)
    predicted, link, ranked, verdict = plan()
    # The table changes what auto says, never what it predicts, tries or chooses.
    assert (predicted, link, ranked) == without[:3]
    assert verdict["recommended"] == "diloco h100" and without[3]["recommended"] is None
    measured = {"allreduce_fp32": 260.0, ranked[0]: 240.0}
    chosen = [_choose(spec, names, predicted, measured, v) for v in (None, verdict)]
    assert chosen[0][0] == chosen[1][0] == ranked[0]
    assert "DiLoCo" not in chosen[0][1]
    out = chosen[1][1]
    assert out.count(verdict["text"]) == 1 and out.count("never switches to DiLoCo") == 1
    assert out.splitlines()[0].startswith(f"[fastddp] auto:any chose {ranked[0]}")
    assert chosen[1][2] == verdict["text"] and chosen[0][2] is None  # model.auto_choice()


class _Tuner(auto.AutoTuner):
    """The choice step alone: no model, no group (one rank)."""

    def _broadcast(self, values: list[int]) -> list[int]:
        return values

    def _switch(self, name: str, fresh: bool) -> None:
        self.current = name


class _Model:
    def check_each_step(self, on: bool) -> None:
        pass


def _choose(spec: AutoHook, names: list, predicted: dict, measured: dict,
            verdict: dict | None) -> tuple[str, str, str | None]:
    tuner = object.__new__(_Tuner)
    tuner.spec, tuner.names, tuner.rank0, tuner.model = spec, names, True, _Model()
    tuner.measured, tuner.predicted, tuner.diloco, tuner.error = {}, predicted, verdict, None
    tuner.times = {n: [t] * 8 for n, t in measured.items()}
    tuner.step, tuner._natives, tuner.history, tuner.link = 40, {}, [], None
    out = io.StringIO()
    with redirect_stdout(out):
        tuner._choose()
    return tuner.choice, out.getvalue(), tuner.summary()["diloco"]


def test_a_failing_diloco_verdict_costs_nothing_else(table, monkeypatch) -> None:
    table(ROWS)

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(diloco_advice, "consider", broken)
    advice = _advice(SLOW)
    assert advice["diloco"] == {"error": "RuntimeError: boom", "recommended": None,
                                "text": None}
    assert advice["best"] in ("int8", "fp8") and "DiLoCo" not in advise.format_markdown(advice)


# A small-job table as benchmarks/diloco_small.py writes it (bits/char, lower is better).
SMALL = {"steps": 1000, "sync_every": 20, "reference": "torch DDP", "alone": "no communication",
         "paper": "diloco 0.7/0.9 (paper)",
         "settings": {"diloco 0.7/0.9 (paper)": [0.7, 0.9], "diloco 1/0 (averaging)": [1.0, 0.0],
                      "diloco 0.5/0.5": [0.5, 0.5]},
         "tasks": {"text": {"metric": "bits/char", "higher_is_better": False, "worlds": {
             2: {"torch DDP": 2.50, "no communication": 2.90, "diloco 0.7/0.9 (paper)": 2.95,
                 "diloco 1/0 (averaging)": 2.60, "diloco 0.5/0.5": 2.70},
             3: {"torch DDP": 2.50, "no communication": 2.90, "diloco 0.7/0.9 (paper)": 2.55,
                 "diloco 1/0 (averaging)": 2.60, "diloco 0.5/0.5": 2.58}}}}}


def test_outer_settings_cite_the_small_job_row(monkeypatch) -> None:
    monkeypatch.setattr(diloco_advice.diloco_small_table, "SMALL_JOBS", SMALL)
    text = diloco_advice.outer_settings("text", 2)
    assert text.startswith("Outer settings on a short run (1000 inner steps at H = 20, 2 workers")
    for cited in ("torch DDP 2.5000", "no communication 2.9000",
                  "the defaults (diloco 0.7/0.9 (paper)) 2.9500",
                  "the best measured diloco 1/0 (averaging) 2.6000 "
                  "(--sync diloco:H=20,outer_lr=1,outer_momentum=0)"):
        assert cited in text, cited
    # The paper's setting ended worse than no communication (2.95 against 2.90): said so.
    assert "no better than not communicating" in text
    # The flag it cites is the launcher's.
    flag = text[text.index("(--sync ") + len("(--sync "):text.index(").", text.index("(--sync "))]
    assert parse_sync_spec(flag) == {"sync_every": 20, "outer_lr": 1.0, "outer_momentum": 0.0}
    # At 3 workers the defaults are the best and beat no communication: nothing more said.
    text = diloco_advice.outer_settings("text", 3)
    assert text.endswith("the defaults (diloco 0.7/0.9 (paper)) 2.5500: the best measured.")


def test_outer_settings_say_what_the_table_does_not_know(monkeypatch) -> None:
    monkeypatch.setattr(diloco_advice.diloco_small_table, "SMALL_JOBS", SMALL)
    for task, world in (("text", 8), ("digits", 2)):
        text = diloco_advice.outer_settings(task, world)
        assert text.startswith(f"Outer settings: the small-job table "
                               f"(docs/diloco.md#small-jobs) has no row for {world} workers")
        assert "(measured: 2, 3 workers, 1000 inner steps at H = 20)" in text
        assert "is not known here" in text and "Recommended" not in text


def test_the_shipped_small_job_table_is_whole() -> None:
    """Every measured world holds the reference, no communication and every setting, and
    each setting is one the launcher's --sync takes."""
    table = diloco_advice.diloco_small_table.SMALL_JOBS
    assert {task: set(entry["worlds"]) for task, entry in table["tasks"].items()} == {
        "text": {2, 4}, "digits": {2, 4}}  # what docs/diloco.md's small-job table shows
    assert table["paper"] in table["settings"]
    for task in table["tasks"].values():
        for rows in task["worlds"].values():
            assert set(rows) == {table["reference"], table["alone"], *table["settings"]}
    for lr, momentum in table["settings"].values():
        spec = f"diloco:H={table['sync_every']},outer_lr={lr:g},outer_momentum={momentum:g}"
        assert parse_sync_spec(spec)["outer_lr"] == lr
