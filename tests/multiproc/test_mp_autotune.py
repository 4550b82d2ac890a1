"""SPARK_HVD_AUTOTUNE at 2 ranks (cases_autotune.py): a full search at small sample
settings (on the tcp and the gloo data planes), one with the fusion threshold fixed (through
Horovod's names, which count as set explicitly), and autotune off (the header's fields are
ignored)."""

import pytest

import cases_autotune

NAMES = cases_autotune.CASES.names()
FAST = {"SPARK_HVD_AUTOTUNE_WARMUP_SAMPLES": "1", "SPARK_HVD_AUTOTUNE_STEPS_PER_SAMPLE": "2",
        "SPARK_HVD_AUTOTUNE_SAMPLES": "3", "SPARK_HVD_AUTOTUNE_LOG": "{outdir}/autotune.csv"}
SETTINGS = {
    "search": {"SPARK_HVD_AUTOTUNE": "1", **FAST},
    # Gloo's allreduce through one fusion buffer and algorithms cached by size: every
    # threshold changes the fused sizes.
    "search_gloo": {"SPARK_HVD_AUTOTUNE": "1", "SPARK_HVD_CPU_OPERATIONS": "gloo", **FAST},
    "fixed_threshold_horovod_names": {"HOROVOD_AUTOTUNE": "1",
                                      "HOROVOD_FUSION_THRESHOLD": "262144", **FAST},
    "off": {},
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("case", NAMES)
def test_case(case_runs, case, setting):
    case_runs.get("cases_autotune", 2, env=SETTINGS[setting]).check(case)
