"""The porting guide's claim: the same training script gives the same model on torch.distributed
(real gloo, 2 processes on loopback) and on raycoll (2 Ray actors), and the diff shown in
docs/porting.md is the real diff between the two example scripts."""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import ray

REPO = Path(__file__).resolve().parents[1]
TORCH_SCRIPT = REPO / "examples" / "porting" / "train_torch.py"
RAYCOLL_SCRIPT = REPO / "examples" / "porting" / "train_raycoll.py"
GUIDE = REPO / "docs" / "porting.md"
STEPS = "30"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"_porting_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    ray.cloudpickle.register_pickle_by_value(module)  # not importable inside the actors
    return module


@pytest.mark.torch
@pytest.mark.timeout(300)
def test_torch_gloo_and_raycoll_train_the_same_model(ray_local, tmp_path):
    import torch

    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    torch_out = tmp_path / "torch.npz"
    proc = subprocess.Popen(  # real gloo in 2 processes, while raycoll runs here
        [sys.executable, str(TORCH_SCRIPT), "--world-size", "2", "--steps", STEPS,
         "--out", str(torch_out)],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        module = _load(RAYCOLL_SCRIPT)
        per_rank = module.main(["--world-size", "2", "--steps", STEPS,
                                "--out", str(tmp_path / "raycoll.npz")])
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 0, output
    assert f"saved {torch_out}" in output

    reference = dict(np.load(torch_out))
    assert sorted(reference) == ["bias", "weight"]
    for rank_params in per_rank:  # every raycoll rank ends with torch's parameters
        assert sorted(rank_params) == sorted(reference)
        for name, value in reference.items():
            np.testing.assert_allclose(rank_params[name], value, rtol=1e-5, atol=1e-6,
                                       err_msg=f"parameter {name}")
    saved = dict(np.load(tmp_path / "raycoll.npz"))
    np.testing.assert_array_equal(saved["weight"], per_rank[0]["weight"])

    # and training did something: the model found the generating weights
    x, y = module.make_data()
    w_true = np.linalg.lstsq(np.c_[x, np.ones(len(x))], y, rcond=None)[0]
    np.testing.assert_allclose(reference["weight"].ravel(), w_true[:-1].ravel(), atol=0.05)


def test_the_guide_shows_the_real_diff():
    before = TORCH_SCRIPT.read_text().splitlines()
    after = RAYCOLL_SCRIPT.read_text().splitlines()
    diff = list(difflib.unified_diff(before, after, "train_torch.py", "train_raycoll.py",
                                     lineterm="", n=1))
    blocks = re.findall(r"```diff\n(.*?)```", GUIDE.read_text(), flags=re.S)
    assert blocks, "docs/porting.md has no ```diff block"
    assert blocks[0].rstrip("\n").splitlines() == diff, (
        "docs/porting.md's diff is stale; regenerate it with:\n"
        "  python -c \"import difflib,sys; a=open('examples/porting/train_torch.py').read()"
        ".splitlines(); b=open('examples/porting/train_raycoll.py').read().splitlines(); "
        "print('\\n'.join(difflib.unified_diff(a, b, 'train_torch.py', 'train_raycoll.py', "
        "lineterm='', n=1)))\"")
