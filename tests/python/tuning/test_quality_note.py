"""--advise's quality line (fastddp.tuning.quality): it cites the scores benchmarks/quality.py
measured (quality_table.py) for the recommended hook on the nearest task, and nothing for a
hook that does not change the gradients."""

from fastddp.tuning import quality
from fastddp.tuning.quality_table import QUALITY

CONV = [[(32, 1, 3, 3), (32,)], [(10, 128), (10,)]]
MLP = [[(1000, 1000)]]


def test_the_nearest_task_and_its_numbers():
    assert quality.nearest_task(CONV) == "digits" and quality.nearest_task(MLP) == "text"
    for shapes, task in ((CONV, "digits"), (MLP, "text")):
        table = QUALITY[task]
        note = quality.quality_note("acpsgd_r2", shapes)
        assert quality.TASKS[task] in note
        assert f"acpsgd r2 ended at {table['metric']} {table['final']['acpsgd r2']:.4f}" in note
        assert f"fp32 allreduce at {table['final']['fp32 allreduce']:.4f}" in note
        at = table["reaches_fp32_at"]["acpsgd r2"]
        assert (f"from step {at}." in note) if at is not None else ("not within" in note)


def test_every_lossy_candidate_is_measured_or_says_so():
    for candidate, config in quality.CONFIG.items():
        for task in ("digits", "text"):
            assert config in QUALITY[task]["final"], (candidate, task)
    assert "was not measured" in quality.quality_note("powersgd_r32", MLP)  # not a config
    for lossless in ("allreduce_fp32", "allreduce_fp32@16MB", "hier_allreduce_fp32"):
        assert quality.quality_note(lossless, MLP) is None
