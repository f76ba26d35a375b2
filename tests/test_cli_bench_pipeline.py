"""labkit.cli.bench_pipeline: the rows it reports (no timing here: the figures
are made up; `python -m labkit bench pipeline` measures them)."""

from labkit.cli.bench_pipeline import NAMES, TARGET, pipeline_rows


def test_pipeline_rows_ratio_and_target():
    rows = pipeline_rows({NAMES[0]: 0.03, NAMES[1]: 0.025})
    assert [r.name for r in rows] == [
        "PipelineParallel 1F1B step, median of rounds",
        "torch Schedule1F1B step, median of rounds",
        "1F1B pipeline / torch Schedule1F1B"]
    ratio = rows[-1]
    assert ratio.value == 0.03 / 0.025 and ratio.target == TARGET == 1.2
    assert ratio.unit == "x" and ratio.status == "ok"
    assert pipeline_rows({NAMES[0]: 0.04, NAMES[1]: 0.025})[-1].status == "short"
