"""examples/notebook.ipynb, executed as a user's Jupyter kernel runs it: twice in one kernel,
with ``ray.shutdown()`` between.

nbclient starts a fresh ``python3`` kernel process; the notebook starts its own local Ray in
it (``address="local"``, so it never attaches to this test session's Ray or to any other
Ray on the machine) and shuts it down in its last cell. The test reads the cells' outputs.
"""

from __future__ import annotations

import ast
import base64
import re
from pathlib import Path
from typing import Any, Dict, List

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("matplotlib")
pytest.importorskip("ipykernel")

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "notebook.ipynb"


def _outputs_by_tag(nb: Any) -> Dict[str, Dict[str, Any]]:
    cells: Dict[str, Dict[str, Any]] = {}
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for output in cell.get("outputs", []):
            assert output.output_type != "error", \
                f"cell failed:\n{cell.source}\n{output.get('ename')}: {output.get('evalue')}"
        for tag in cell.metadata.get("tags", []):
            stdout = "".join(o.get("text", "") for o in cell.outputs
                             if o.output_type == "stream" and o.name == "stdout")
            data: List[Dict[str, Any]] = [o.data for o in cell.outputs
                                          if o.output_type in ("display_data", "execute_result")]
            cells[tag] = {"stdout": stdout, "data": data}
    return cells


def _value(stdout: str, label: str) -> Any:
    match = re.search(rf"^{re.escape(label)}:? (.*)$", stdout, flags=re.M)
    assert match, f"no line {label!r} in:\n{stdout}"
    return ast.literal_eval(match.group(1))


def _check_outputs(cells: Dict[str, Dict[str, Any]]) -> None:
    """What one run of the notebook printed and drew."""
    assert cells["start"]["data"][0]["text/plain"] == "4.0"
    assert _value(cells["group"]["stdout"], "ranks") == [(0, 3), (1, 3), (2, 3)]

    collectives = cells["collectives"]["stdout"]
    assert _value(collectives, "all_reduce on every rank") == [[6.0] * 4] * 3  # 1 + 2 + 3
    assert _value(collectives, "all_gather of shard sizes") == [[20, 25, 30]] * 3

    status = cells["status"]["stdout"]
    assert "group 'nb': 3 ranks" in status
    for rank in range(3):
        assert re.search(rf"^rank {rank}: .*all_gather #2", status, flags=re.M), status

    train = cells["train"]["stdout"]
    assert _value(train, "steps per rank") == [20, 25, 30]
    assert _value(train, "join order") == [0, 1, 2]
    final = _value(train, "final loss per rank")
    assert all(loss < 0.1 for loss in final), final

    pngs = [d["image/png"] for d in cells["plot"]["data"] if "image/png" in d]
    assert len(pngs) == 1
    assert base64.b64decode(pngs[0])[:8] == b"\x89PNG\r\n\x1a\n"

    params = cells["params"]["stdout"]
    assert _value(params, "largest difference between ranks") == 0.0
    assert _value(params, "error against the true model") < 0.1


@pytest.mark.timeout(900)
def test_notebook_runs_twice_in_one_kernel_across_a_ray_restart(tmp_path):
    """As a user re-runs it: top to bottom but its clean-up cell (group "nb" stays formed),
    then ``ray.shutdown()`` in the same kernel, then the whole notebook again. The second
    run starts a new Ray, new actors and forms "nb" again while the kernel still remembers
    the first; both runs give the same results, and the last cell (destroy_group,
    ray.shutdown()) runs at the end."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=400, startup_timeout=180, kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}})
    last = max(i for i, c in enumerate(nb.cells) if "shutdown" in c.metadata.get("tags", []))
    with client.setup_kernel():  # one kernel for both runs
        for index in range(last):  # raises CellExecutionError (with the traceback) on failure
            client.execute_cell(nb.cells[index], index)
        first = _outputs_by_tag(nb)
        assert nb.cells[last].execution_count is None  # "nb" stays formed
        nb.cells.append(nbformat.v4.new_code_cell("ray.shutdown()"))  # the user's restart
        client.execute_cell(nb.cells[-1], len(nb.cells) - 1)
        nb.cells.pop()
        for index, cell in enumerate(nb.cells):
            client.execute_cell(cell, index)
        second = _outputs_by_tag(nb)
        assert nb.cells[last].execution_count is not None  # destroy_group, ray.shutdown()
    _check_outputs(first)
    _check_outputs(second)


def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]
