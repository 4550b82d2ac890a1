"""The notebooks run top to bottom (a small run: 2 epochs, local[2])."""

import os
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"

# What each notebook's output must contain.
_BOTH = ["[0] epoch 2/2", "test accuracy:", "identical predictions after save and load",
         "4 epochs in the history"]
EXPECTED = {
    "01_torch_estimator.ipynb": _BOTH + ["resuming run 'digits_notebook' at epoch 3/4"],
    "02_keras_estimator.ipynb": _BOTH + ["val_accuracy", "['best.keras', 'last.keras']",
                                         "resuming run 'digits_keras_notebook' at epoch 3/4"],
}


@pytest.mark.spark
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_notebook_runs(tmp_path, name):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(str(NOTEBOOKS / name), as_version=4)
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1, "the notebook needs one cell tagged 'parameters'"
    params[0].source = (f"EPOCHS = 2\nNUM_PROC = 2\nMASTER = 'local[2]'\n"
                        f"STORE_DIR = {str(tmp_path / 'store')!r}\n")
    # The kernel is this interpreter: jupyter_client runs the "python3" spec with sys.executable.
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=300,
                                     resources={"metadata": {"path": str(tmp_path)}})
    env_backup = dict(os.environ)
    try:
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(env_backup)
    text = "\n".join(out.get("text", "") for c in nb.cells if c.cell_type == "code"
                     for out in c.get("outputs", []))
    for needle in EXPECTED[name]:
        assert needle in text, (needle, text[-3000:])
