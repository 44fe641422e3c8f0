"""The environment a test builds fastddp._C in: the Makefile's CCACHE_ENV (ccache's compilers
first on PATH, nvcc through torch's PYTORCH_NVCC, paths under `root` made relative), so that a
second build of the same sources (the sdist's, a copy's) costs seconds once cached."""

import os
import shutil


def ccache_env(root: str) -> dict[str, str]:
    """os.environ for a build under `root`, through ccache when it is installed."""
    env = dict(os.environ, MAX_JOBS=os.environ.get("MAX_JOBS", "2"))
    if shutil.which("ccache"):
        env.update(PATH="/usr/lib/ccache:" + env["PATH"], CCACHE_BASEDIR=root,
                   CCACHE_NOHASHDIR="1")
        nvcc = next((p for p in (os.path.join(os.environ.get("CUDA_HOME", "/nonexistent"),
                                              "bin", "nvcc"), "/usr/local/cuda/bin/nvcc")
                     if os.path.exists(p)), shutil.which("nvcc"))
        if nvcc:
            env["PYTORCH_NVCC"] = f"ccache {nvcc}"
    return env
