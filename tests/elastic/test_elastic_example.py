"""examples/elastic_torch_digits.py as an elastic job (2 workers, sizes 1 to 3): it trains
and reports from rank 0."""

import os
import re

from _ranks import ROOT
from elastic_harness import run_job

EXAMPLE = os.path.join(ROOT, "examples", "elastic_torch_digits.py")


def test_elastic_torch_digits_example(tmp_path):
    out = run_job(EXAMPLE, 2, str(tmp_path), min_np=1, max_np=3, args=["--epochs", "4"],
                  timeout_s=90)
    assert out.codes == {0: 0, 1: 0}, out.describe()
    found = re.findall(r"^final test accuracy: ([0-9.]+) \(2 ranks", out.output[0], re.M)
    assert found and float(found[0]) >= 0.8, out.describe()
    assert "final test accuracy" not in out.output[1], "only rank 0 reports"
