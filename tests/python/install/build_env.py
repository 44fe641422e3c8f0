"""The environment a test builds fastddp._C in: the Makefile's CCACHE_ENV (ccache's compilers
first on PATH, nvcc through torch's PYTORCH_NVCC, paths under `root` made relative), so that a
second build of the same sources (the sdist's, a copy's) costs seconds once cached."""

import os
import shutil
import signal
import subprocess


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


def run_in_own_group(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs), but in
    a process group of its own that is killed whole on timeout: subprocess.run kills only
    its child (pip), and the compilers under it would go on loading the machine."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
