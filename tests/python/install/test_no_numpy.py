"""fastddp needs nothing torch does not bring (issue 43 item 3): torch's wheel does not require
numpy, so `import fastddp` and `python -m fastddp --check` must work in an environment that has
torch and no numpy. The environment is a fresh venv that sees every package of this one but
numpy: its site folder adds a folder of links to this environment's site-packages entries,
numpy's left out (the installed fastddp comes along, as pip's editable-install .pth)."""

import os
import site
import sys

import pytest
import torch

from tests.python.install.build_env import run_in_own_group


def _site_packages_of_torch() -> str:
    return os.path.dirname(os.path.dirname(torch.__file__))


@pytest.fixture(scope="module")
def python_without_numpy(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("no-numpy")
    links = root / "links"
    links.mkdir()
    # In this interpreter's own order (its venv first), so that where two folders hold an
    # entry of one name the one this interpreter imports wins: a system site-packages may
    # hold another checkout's editable fastddp (.pth of the same name, its path long gone).
    folders = dict.fromkeys([*site.getsitepackages(), _site_packages_of_torch()])
    for folder in folders:
        for name in sorted(os.listdir(folder)):
            if name.split("-")[0].split(".")[0].lower() == "numpy" or (links / name).exists():
                continue
            (links / name).symlink_to(os.path.join(folder, name))
    venv = root / "venv"
    done = run_in_own_group([sys.executable, "-m", "venv", "--without-pip", str(venv)], 120)
    assert done.returncode == 0, done.stderr
    python = str(venv / "bin" / "python")
    purelib = run_in_own_group(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], 60)
    # .pth lines that start with `import` run: addsitedir also reads the links' .pth files.
    with open(os.path.join(purelib.stdout.strip(), "with_links.pth"), "w") as f:
        f.write(f"import site; site.addsitedir({str(links)!r})\n")
    return python


def test_the_environment_has_torch_and_no_numpy(python_without_numpy, tmp_path):
    done = run_in_own_group([python_without_numpy, "-c", "import torch, fastddp; import numpy"],
                            300, cwd=tmp_path)
    assert "No module named 'numpy'" in done.stderr, done.stderr[-3000:]


def test_import_and_the_self_check_need_no_numpy(python_without_numpy, tmp_path):
    done = run_in_own_group(
        [python_without_numpy, "-c", "import sys, fastddp, fastddp.hooks, fastddp.ddp; "
         "assert 'numpy' not in sys.modules, 'numpy imported'"], 300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    check = run_in_own_group([python_without_numpy, "-m", "fastddp", "--check"], 600,
                             cwd=tmp_path)
    out = check.stdout + check.stderr
    assert check.returncode == 0 and "fastddp self-check passed" in out, out[-4000:]
    # The PowerSGD rows are named as skipped, not silently left out.
    assert "powerSGD_hook + PowerSGDState(rank 2)  " in out and "needs numpy" in out, out
