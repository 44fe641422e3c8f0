"""How setup.py cuts _C into translation units (Note [unity build], Note [torch headers
precompiled]): every source compiled exactly once, units of a bounded size with the torch-free
layers left out, and torch's headers precompiled and really used by the checkout's build. GCC
parses a header as text again, silently, when its .gch does not match a unit's flags: only
the compiler's own report (-H) tells, so the last test asks it."""

import importlib.util
import os
import re
import shlex
import subprocess
import sys

import pytest
from setuptools import Distribution

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


@pytest.fixture(scope="module")
def setup_py():
    """setup.py as a module: its setup() call runs only as __main__ (pip runs it so)."""
    spec = importlib.util.spec_from_file_location("fastddp_setup_py", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    cwd, environ = os.getcwd(), dict(os.environ)
    os.chdir(ROOT)  # sources() globs csrc/ relative to the checkout, as pip runs it
    try:
        spec.loader.exec_module(module)  # (it guesses CUDA_HOME into os.environ)
        module.ALL_SOURCES = module.sources(with_cuda=True)
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)
    return module


def test_every_source_is_compiled_exactly_once(setup_py):
    files = setup_py.ALL_SOURCES
    groups = setup_py.unity_groups(files)
    grouped = [path for members in groups.values() for path in members]
    assert len(grouped) == len(set(grouped)), "a source in two units"
    own = [path for path in files if path not in set(grouped)]
    assert sorted(grouped + own) == sorted(files)
    # The torch-free layers and CUDA stay units of their own; nothing else does.
    assert all(p.startswith(setup_py.UNITY_OWN_UNITS) or p.endswith(".cu") for p in own), own
    assert not any(p.startswith(setup_py.UNITY_OWN_UNITS) for p in grouped)
    for name, members in groups.items():
        family = name.rsplit("_", 1)[0]
        assert len(members) <= setup_py.UNITY_CHUNK.get(family, setup_py.UNITY_CHUNK_DEFAULT)
        assert {p.split("/")[1] for p in members} == {family}, f"{name} mixes families"
    # Counted, not timed: 77 files were 77 units; each unit parses torch's headers once.
    assert len(groups) + len(own) <= 32, f"{len(groups) + len(own)} units"


# A definition at the top level of an anonymous namespace, or a static one at namespace
# scope (the sources' style: such definitions start in column 0).
FILE_LOCAL = re.compile(r"^(?:template <[^>]*>\s*)?(?:\[\[[\w:]+\]\]\s*)?"
                        r"(?:constexpr |const |inline |static |struct |class |enum class |enum "
                        r"|using )*(?:[\w:<>,*&]+ )*?[*&]?(\w+)\s*(?:\(|=|\{|;|\[|$)")


def file_local_names(path: str) -> set[str]:
    names, depth = set(), 0
    with open(path) as f:
        for line in f.read().splitlines():
            if line.startswith("namespace {"):
                depth += 1
            elif depth and re.match(r"^\}\s*// namespace\s*$", line):
                depth -= 1
            elif line and line[0] not in " \t#/}{)" and (depth or line.startswith("static ")):
                match = FILE_LOCAL.match(line)
                if match:
                    names.add(match.group(1))
    return names


def test_no_file_local_name_is_defined_twice_in_a_family(setup_py):
    # Any two files of a family may share a unit once a file is added or removed; two
    # file-local definitions of one name (even overloads, which compile until the day
    # they are ambiguous) would then break the build, so they are refused here first.
    families: dict[str, list[str]] = {}
    for name, members in setup_py.unity_groups(setup_py.ALL_SOURCES).items():
        families.setdefault(name.rsplit("_", 1)[0], []).extend(members)
    found = 0
    for family, members in families.items():
        where: dict[str, list[str]] = {}
        for path in members:
            for name in file_local_names(os.path.join(ROOT, path)):
                where.setdefault(name, []).append(path)
        found += len(where)
        twice = {name: paths for name, paths in where.items() if len(paths) > 1}
        assert not twice, f"file-local names defined twice in csrc/{family}: {twice}"
    assert found > 50  # the scan sees the sources' helpers (it would pass on nothing)


TORCH_NINJA = """ninja_required_version = 1.3
cxx = ccache c++
cflags = -O3 -fPIC -I{root}/csrc -c
post_cflags = -O3 -g0 -std=c++20
rule compile
  command = $cxx -MMD -MF $out.d $cflags -c $in -o $out $post_cflags
  depfile = $out.d
  deps = gcc
build {root}/build/temp/build/unity/reducer_0.o: compile {root}/build/unity/reducer_0.cpp
build {root}/build/temp/csrc/kernels/quant8_cpu.o: compile {root}/csrc/kernels/quant8_cpu.cpp
"""


def test_the_precompiled_header_is_an_edge_that_only_the_unity_units_wait_for(setup_py,
                                                                              monkeypatch):
    unity = os.path.join(ROOT, "build", "unity")
    text = TORCH_NINJA.format(root=ROOT)
    monkeypatch.setattr(setup_py, "gcc_compiler", lambda command: command == ["ccache", "c++"])
    edited, why = setup_py.add_pch_edge(text, unity)
    assert why == ""
    gch = os.path.join(unity, "torch_headers.h.gch")
    lines = edited.splitlines()
    unit = lines.index(f"build {ROOT}/build/temp/build/unity/reducer_0.o: compile "
                       f"{ROOT}/build/unity/reducer_0.cpp | {gch}")
    assert lines[unit + 1] == "  post_cflags = $post_cflags -Winvalid-pch"
    assert f"build {ROOT}/build/temp/csrc/kernels/quant8_cpu.o: compile " \
           f"{ROOT}/csrc/kernels/quant8_cpu.cpp" in lines  # torch-free: untouched
    assert f"build {gch}: fastddp_pch {unity}/torch_headers.h" in lines
    # The units' own flags, so that GCC accepts the .gch for them.
    assert "  command = $cxx -MMD -MF $out.d $cflags -x c++-header $in -o $out $post_cflags" in lines

    monkeypatch.setattr(setup_py, "gcc_compiler", lambda command: False)
    assert setup_py.add_pch_edge(text, unity) == (text, "ccache c++ is not GCC")
    monkeypatch.setattr(setup_py, "gcc_compiler", lambda command: True)
    assert setup_py.add_pch_edge(text.replace("build/unity", "elsewhere"), unity) == (
        text.replace("build/unity", "elsewhere"), "no unity unit in build.ninja")


def ninja_variable(text: str, name: str) -> list[str]:
    return shlex.split(re.search(rf"^{name} = (.*)$", text, re.M).group(1))


def test_the_checkouts_units_use_the_precompiled_torch_headers(setup_py):
    path = os.path.join(ROOT, "build", "temp", "build.ninja")
    if not os.path.exists(path):
        pytest.skip("_C was not built from this checkout by setup.py (no build/temp/build.ninja)")
    with open(path) as f:
        text = f.read()
    cxx = [w for w in ninja_variable(text, "cxx") if w != "ccache"]
    if not setup_py.gcc_compiler(cxx):
        pytest.skip(f"{cxx} is not GCC: torch's headers are not precompiled")
    if "build/unity/" not in text:
        pytest.skip("_C was built file by file here (FASTDDP_UNITY=0)")
    if "rule fastddp_pch" not in text:
        pytest.fail("GCC built the unity units without the precompiled header (FASTDDP_PCH=0?); "
                    "build/pip-install.log says why")
    gch = os.path.join(ROOT, "build", "unity", "torch_headers.h.gch")
    assert os.path.exists(gch)
    unit = os.path.join(ROOT, "build", "unity", "optim_0.cpp")  # the smallest unit
    # -H lists each header as it is read: "! x.gch" a precompiled header used, "x x.gch" one
    # found and refused (the same flags as ninja's, so a refusal is the build's too).
    done = subprocess.run(cxx + ninja_variable(text, "cflags") + ["-fsyntax-only", "-H", unit]
                          + ninja_variable(text, "post_cflags") + ["-Winvalid-pch"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"! {gch}" in done.stderr.splitlines(), [
        line for line in done.stderr.splitlines() if "gch" in line or "pch" in line][:10]


def test_an_empty_venv_include_folder_stays_out_of_the_compile(setup_py, tmp_path, monkeypatch):
    # setuptools adds <venv>/include to every compile line; its absolute path outside the
    # checkout entered ccache's key of the precompiled header, so each new venv rebuilt it.
    def include_dirs() -> list[str]:
        command = setup_py.BuildExtension(Distribution({"name": "fastddp"}))
        command.finalize_options()
        return command.include_dirs

    venv_include = tmp_path / "include"
    venv_include.mkdir()
    monkeypatch.setattr(sys, "exec_prefix", str(tmp_path))
    monkeypatch.setattr(sys, "base_exec_prefix", str(tmp_path / "base"))
    assert str(venv_include) not in include_dirs()
    # A folder that holds a header (a package installed one there) stays: it may be used.
    (venv_include / "site").mkdir()
    (venv_include / "site" / "greenlet.h").write_text("")
    assert str(venv_include) in include_dirs()
