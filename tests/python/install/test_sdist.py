"""fastddp installs as torch extensions are installed: a source distribution that holds every
source and header and builds in a fresh environment, a wheel whose version names its torch
and CUDA, metadata pip understands, and no deprecation warning from the build.

The sdist's build compiles the same sources as the checkout's: with the Makefile's ccache
settings (CCACHE_ENV there, build_env.ccache_env() here) the second build costs seconds."""

import os
import shutil
import sys
import tarfile
import zipfile

import pytest
import torch

from tests.python.install.build_env import ccache_env, run_in_own_group

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
# Under the checkout, so that ccache's base folder covers both source trees alike.
SDIST_CHECK = os.path.join(ROOT, "build", "sdist-check")
VERSION = "0.1.0"


def run(cmd: list[str], timeout: float, **kwargs) -> str:
    done = run_in_own_group(cmd, timeout, **kwargs)  # a timed-out build leaves no compiler
    assert done.returncode == 0, f"{cmd}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done.stdout + done.stderr


def tracked(folder: str) -> set[str]:
    out = run(["git", "ls-files", folder], 60, cwd=ROOT)
    return set(out.split())


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> tuple[str, str]:
    """(path of the built sdist, the build's output)."""
    if not os.path.isdir(os.path.join(ROOT, ".git")) or shutil.which("git") is None:
        pytest.skip("needs the git checkout (its file list is the reference)")
    out_dir = str(tmp_path_factory.mktemp("sdist"))
    # Not from ROOT: its build/ folder would shadow the `build` package for `python -m`.
    log = run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", out_dir,
               ROOT], 300, cwd=out_dir)
    (name,) = os.listdir(out_dir)
    return os.path.join(out_dir, name), log


def test_sdist_holds_every_source_header_and_the_license(sdist):
    path, _ = sdist
    assert os.path.basename(path) == f"fastddp-{VERSION}.tar.gz"  # no torch label on an sdist
    with tarfile.open(path) as tar:
        prefix = f"fastddp-{VERSION}/"
        members = {m.name[len(prefix):] for m in tar.getmembers() if m.isfile()}
    wanted = tracked("csrc") | tracked("python") | {"LICENSE", "README.md", "setup.py",
                                                    "pyproject.toml", "CMakeLists.txt"}
    missing = sorted(wanted - members)
    assert not missing, f"the sdist lacks {missing}"
    assert not any(m.endswith((".so", ".o", ".pyc")) for m in members)


def test_the_build_log_has_no_deprecation_warning(sdist):
    _, log = sdist
    assert "Deprecat" not in log and "deprecat" not in log, log


def test_the_checkouts_build_log_has_no_deprecation_warning():
    # make install's log of `pip install -e .`: the compiler's warnings too (ccache replays
    # them), e.g. torch's deprecated collective names (csrc/hooks/common/collectives.h).
    log = os.path.join(ROOT, "build", "pip-install.log")
    if not os.path.exists(log):
        pytest.skip("_C was not built by make install here (no build/pip-install.log)")
    with open(log) as f:
        found = [line for line in f if "deprecat" in line.lower()]
    assert not found, "".join(found[:10])


def test_sdist_builds_in_a_fresh_environment_and_passes_the_check(sdist, tmp_path):
    path, _ = sdist
    shutil.rmtree(SDIST_CHECK, ignore_errors=True)
    os.makedirs(SDIST_CHECK)
    with tarfile.open(path) as tar:
        tar.extractall(SDIST_CHECK, filter="data")
    source = os.path.join(SDIST_CHECK, f"fastddp-{VERSION}")
    venv = os.path.join(SDIST_CHECK, "venv")
    # A fresh environment that sees the installed torch, as a user's would (and this
    # interpreter's pip and setuptools: --without-pip seeds no older ones of its own).
    run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv], 120)
    python = os.path.join(venv, "bin", "python")
    run([python, "-m", "pip", "install", "--no-build-isolation", "--no-index", source], 1500,
        env=ccache_env(SDIST_CHECK))
    # From outside both source trees: the installed package, not the checkout's.
    where = run([python, "-c", "import fastddp, importlib.metadata as m; "
                 "print(fastddp.__file__); print(m.version('fastddp'))"], 120, cwd=tmp_path)
    assert where.split()[0].startswith(venv) and where.split()[1] == VERSION, where
    check = run([python, "-m", "fastddp", "--check"], 600, cwd=tmp_path)
    assert "fastddp self-check passed" in check, check


def test_wheel_version_names_its_torch_and_cuda(tmp_path):
    # From the checkout: bdist_wheel reuses the editable build's objects (build/temp).
    out = tmp_path / "dist"
    log = run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out),
               ROOT], 1500, cwd=tmp_path, env=ccache_env(ROOT))
    assert "Deprecat" not in log and "deprecat" not in log, log
    (wheel,) = os.listdir(out)
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    cuda = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    label = f"{VERSION}+torch{major}.{minor}{cuda}"
    assert wheel.startswith(f"fastddp-{label}-"), wheel
    with zipfile.ZipFile(out / wheel) as z:
        meta = z.read(f"fastddp-{label}.dist-info/METADATA").decode()
        names = z.namelist()
    assert f"Version: {label}" in meta
    assert "Requires-Dist: torch<2.16,>=2.11" in meta or "Requires-Dist: torch>=2.11,<2.16" in meta
    assert "License-Expression: BSD-3-Clause" in meta
    assert any(n.startswith("fastddp/_C.") and n.endswith(".so") for n in names)
    assert "fastddp/_libstdcxx.py" in names and "fastddp/selfcheck/worker.py" in names
