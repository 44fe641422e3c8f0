"""Note [one libstdc++]: a module with libstdc++'s stream code of its own misreads numbers
(or crashes, on the first GPU machine) next to torch; the build check refuses it, and
setup.py's link recipe keeps the code out even where the compiler links libstdc++
statically.

Shown on a one-function library rather than on fastddp._C: a full _C build takes minutes,
the library a second, and it reproduces the fault of the GPU machine's build (a stream
read of "42" fails once torch's shared libstdc++ is loaded beside it)."""

import os
import shutil
import subprocess
import sys

import pytest

import fastddp
from fastddp import _C, _libstdcxx

SOURCE = """
#include <sstream>
// -2: the read failed; what the GPU machine's PowerSGD state read did before it crashed.
extern "C" int parse(const char* s) { std::istringstream in(s); int v = -1; in >> v;
                                      return in ? v : -2; }
"""

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


def build(tmp_path, name: str, flags: list[str], link_args: tuple[str, ...] = ()) -> str:
    """setuptools' order: flags, the sources, -o, then the extension's extra_link_args."""
    src = tmp_path / "parse.cpp"
    src.write_text(SOURCE)
    out = str(tmp_path / f"{name}.so")
    subprocess.run(["g++", "-O2", "-shared", "-fPIC", *flags, str(src), "-o", out, *link_args],
                   check=True)
    return out


def parse_next_to_torch(library: str) -> int:
    """parse("42") in a fresh process that imported torch first, as fastddp is loaded."""
    code = ("import ctypes, torch; "
            f"print(ctypes.CDLL({library!r}).parse(b'42'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


@needs_gxx
def test_a_static_libstdcxx_build_is_refused_and_misreads_numbers(tmp_path):
    bad = build(tmp_path, "static", ["-static-libstdc++"])
    problems = _libstdcxx.check_module(bad)
    assert any("stream and locale code itself" in p for p in problems), problems
    assert any("does not link the shared libstdc++" in p for p in problems), problems
    assert "pytorch/pytorch#109923" in _libstdcxx.explain(bad, problems)
    # The fault itself, so the next test proves a fix and not a non-event.
    assert parse_next_to_torch(bad) == -2


@needs_gxx
def test_setup_link_recipe_fixes_the_static_build(tmp_path):
    # setup.py's extra_link_args, with the bad flag still on the command line.
    import torch  # noqa: F401 - link_args() names the libstdc++ torch loaded

    args = _libstdcxx.link_args()
    assert args and os.path.basename(args[0]).startswith("libstdc++.so")
    fixed = build(tmp_path, "fixed", ["-static-libstdc++"], tuple(args))
    assert _libstdcxx.check_module(fixed) == []
    assert parse_next_to_torch(fixed) == 42


@needs_gxx
def test_a_normal_build_passes(tmp_path):
    normal = build(tmp_path, "normal", [])
    assert _libstdcxx.check_module(normal) == []
    assert parse_next_to_torch(normal) == 42


def test_the_installed_module_passes_the_check():
    assert _libstdcxx.check_module(_C.__file__) == []
    info = fastddp.build_info()
    assert info["compiler"] and info["libstdcxx_headers"].startswith("GCC ")


def test_a_runtime_older_than_the_compiler_is_named():
    # A "runtime" that defines no GLIBCXX version at all stands for one older than every
    # version the module needs: the check names them instead of an ImportError later.
    problems = _libstdcxx.check_module(_C.__file__, runtime=_C.__file__)
    assert len(problems) == 1 and "compiler is newer than the runtime" in problems[0]
    assert "GLIBCXX_3.4" in problems[0]


def test_non_elf_files_are_refused_with_their_name(tmp_path):
    junk = tmp_path / "junk.so"
    junk.write_bytes(b"not an elf file")
    with pytest.raises(ValueError, match="junk.so: not a 64-bit little-endian ELF"):
        _libstdcxx.read_elf(str(junk))
