"""The notebooks run top to bottom (a small run: 2 epochs, local[2]).

Both run in one kernel, each in a fresh namespace (``%reset -f`` first): the kernel's
imported modules and Spark's JVM stay, so the second notebook's session cell (the
``except NameError`` branch, as in the first) gets the running session from
``getOrCreate`` instead of starting another JVM.
"""

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


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """One started "python3" kernel (this interpreter: jupyter_client runs the spec with
    sys.executable) for the notebooks of this module."""
    pytest.importorskip("nbclient")
    jupyter_client = pytest.importorskip("jupyter_client")
    env_backup = dict(os.environ)
    km = jupyter_client.KernelManager(kernel_name="python3")
    try:
        km.start_kernel(cwd=str(tmp_path_factory.mktemp("notebooks")))
    finally:
        os.environ.clear()
        os.environ.update(env_backup)
    yield km
    km.shutdown_kernel(now=True)


@pytest.mark.spark
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_notebook_runs(tmp_path, kernel, name):
    nbformat = pytest.importorskip("nbformat")
    import nbclient

    nbclient.NotebookClient(nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("%reset -f")]), km=kernel, timeout=60).execute()
    nb = nbformat.read(str(NOTEBOOKS / name), as_version=4)
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1, "the notebook needs one cell tagged 'parameters'"
    params[0].source = (f"EPOCHS = 2\nNUM_PROC = 2\nMASTER = 'local[2]'\n"
                        f"STORE_DIR = {str(tmp_path / 'store')!r}\n")
    nbclient.NotebookClient(nb, km=kernel, timeout=300).execute()
    text = "\n".join(out.get("text", "") for c in nb.cells if c.cell_type == "code"
                     for out in c.get("outputs", []))
    for needle in EXPECTED[name]:
        assert needle in text, (needle, text[-3000:])
