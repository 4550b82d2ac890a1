"""Engine settings from the environment: SPARK_HVD_FUSION_THRESHOLD,
SPARK_HVD_CACHE_CAPACITY, SPARK_HVD_TIMELINE, SPARK_HVD_GLOO_DATA_PLANE,
SPARK_HVD_GLOO_CHUNK_BYTES and SPARK_HVD_IDLE_CYCLE_TIME_MS (cases_knobs.py)."""

import json
import os

import pytest

import cases_knobs

NAMES = cases_knobs.CASES.names()
SMALL = {"SPARK_HVD_FUSION_THRESHOLD": "4096", "SPARK_HVD_CACHE_CAPACITY": "2",
         "SPARK_HVD_TIMELINE": "{outdir}/timeline.json"}
OFF = {"SPARK_HVD_FUSION_THRESHOLD": "0", "SPARK_HVD_CACHE_CAPACITY": "0"}
# Gloo's pairs and algorithms instead of the own connections (halving-doubling
# allreduce in pieces of 1000 bytes: not a multiple of 8, pieces are whole
# elements), and a long idle back-off.
PIECES = {"SPARK_HVD_FUSION_THRESHOLD": "65536", "SPARK_HVD_CACHE_CAPACITY": "1024",
          "SPARK_HVD_GLOO_DATA_PLANE": "gloo", "SPARK_HVD_GLOO_CHUNK_BYTES": "1000",
          "SPARK_HVD_IDLE_CYCLE_TIME_MS": "50"}
SETTINGS = {"small_fusion_small_cache_timeline": (3, SMALL), "no_fusion_no_cache": (2, OFF),
            "gloo_pieces_slow_idle": (3, PIECES)}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("case", NAMES)
def test_case(case_runs, case, setting):
    np_, env = SETTINGS[setting]
    case_runs.get("cases_knobs", np_, env=env).check(case)


def test_timeline_env_file_is_valid_and_names_the_tensors(case_runs):
    np_, env = SETTINGS["small_fusion_small_cache_timeline"]
    run = case_runs.get("cases_knobs", np_, env=env)
    run.check("knobs/timeline_tensors")
    path = os.path.join(run.outdir, "timeline.json")
    assert os.path.exists(path), f"SPARK_HVD_TIMELINE={path} was not written\n{run.tail()}"
    with open(path) as f:
        text = f.read()
    try:
        trace = json.loads(text)
    except ValueError as e:
        pytest.fail(f"the timeline of a {np_}-rank job is not valid JSON ({e}); "
                    f"{len(text)} bytes, starting:\n{text[:600]}", pytrace=False)
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    names = set()
    for e in events:
        assert {"name", "ph", "pid"} <= set(e), e
        args = e.get("args", {})
        names.update(str(args.get(k)) for k in ("tensor", "name"))
    for tensor in ("knobs.tl.alpha", "knobs.tl.beta", "knobs.tl.gamma"):
        assert tensor in names, f"{tensor} is not in the timeline ({len(events)} events)"
    # The other ranks write beside it, one file each (never into rank 0's file).
    for r in range(1, np_):
        other = os.path.join(run.outdir, f"timeline.rank{r}.json")
        with open(other) as f:
            rank_events = json.load(f)["traceEvents"]
        assert {e["pid"] for e in rank_events} == {r}, other
