"""The build decided CUDA as documented: built when the installed torch has CUDA and nvcc is
found, unless FASTDDP_CUDA=0. CI relies on this to prove every CUDA source compiled."""

import os
import shutil

import torch

import fastddp


def nvcc_found() -> bool:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    return shutil.which("nvcc") is not None or os.path.exists(os.path.join(home, "bin", "nvcc"))


def test_build_info_reports_the_running_torch():
    info = fastddp.build_info()
    assert info["torch"] == torch.__version__
    assert info["built_with_torch"] == torch.__version__, "rebuild fastddp after changing torch"


def test_cuda_sources_were_built_when_they_could_be():
    info = fastddp.build_info()
    expected = torch.version.cuda is not None and nvcc_found()
    if os.environ.get("FASTDDP_CUDA") in ("0", "1"):
        expected = os.environ["FASTDDP_CUDA"] == "1"
    assert info["cuda"] == expected
    assert info["nvtx"] == info["cuda"]
    if info["cuda"]:
        assert info["cuda_version"] == torch.version.cuda
