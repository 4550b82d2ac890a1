"""Lifetime of in-flight ops (cases_lifetime.py) on 2 and 3 ranks: dropped handles,
exceptions between submit and synchronize, invalid group members, duplicate names."""

import pytest

import cases_lifetime

NAMES = cases_lifetime.CASES.names()


@pytest.mark.parametrize("np", [2, 3])
@pytest.mark.parametrize("case", NAMES)
def test_case(case_runs, case, np):
    case_runs.get("cases_lifetime", np).check(case)
