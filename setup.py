"""Builds fastddp._C against the torch that is already installed.

torch is deliberately not a build requirement: pip would build against a fresh
copy of torch instead of the user's. Install with
``pip install --no-build-isolation .``.

CUDA is decided from the installed torch and the toolkit, never from whether a
GPU is visible: sources are built with CUDA when ``torch.version.cuda`` is set
and nvcc is found. FASTDDP_CUDA=0/1 overrides.
"""

import glob
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys

import setuptools
from setuptools import setup


def _guess_cuda_home() -> None:
    """torch guesses CUDA_HOME from the nvcc on PATH, which may be a wrapper
    script outside the toolkit; prefer a folder that really holds the headers."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append("/usr/local/cuda")
    for home in candidates:
        if os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
            os.environ["CUDA_HOME"] = home
            return


_guess_cuda_home()

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:  # pragma: no cover - a message for people, not a code path
    sys.exit(
        "fastddp builds against an installed PyTorch (2.11-2.15): install torch first, "
        "then run `pip install --no-build-isolation .`"
    )

HERE = os.path.dirname(os.path.abspath(__file__))


def _load_libstdcxx():
    """python/fastddp/_libstdcxx.py by path: the package itself needs the module we build."""
    path = os.path.join(HERE, "python", "fastddp", "_libstdcxx.py")
    spec = importlib.util.spec_from_file_location("fastddp_build_libstdcxx", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


libstdcxx = _load_libstdcxx()
VERSION = "0.1.0"
# A short default keeps a GPU-less build fast; H100/H200 are sm_90.
DEFAULT_ARCH_LIST = "9.0"


def say(message: str) -> None:
    print(f"[fastddp setup] {message}", flush=True)


def find_nvcc() -> str | None:
    home = cpp_extension.CUDA_HOME
    if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
        return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def decide_cuda() -> tuple[bool, str]:
    forced = os.environ.get("FASTDDP_CUDA")
    if forced not in (None, "", "0", "1"):
        sys.exit(f"FASTDDP_CUDA must be 0 or 1, got {forced!r}")
    if forced == "0":
        return False, "FASTDDP_CUDA=0"
    if torch.version.cuda is None:
        if forced == "1":
            sys.exit("FASTDDP_CUDA=1 but the installed torch is a CPU build (torch.version.cuda is None)")
        return False, "the installed torch is a CPU build (torch.version.cuda is None)"
    nvcc = find_nvcc()
    if nvcc is None:
        if forced == "1":
            sys.exit("FASTDDP_CUDA=1 but nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
        return False, f"torch has CUDA {torch.version.cuda} but nvcc was not found"
    why = "FASTDDP_CUDA=1" if forced == "1" else f"torch.version.cuda={torch.version.cuda}"
    return True, f"{why}, nvcc at {nvcc}"


def sources(with_cuda: bool) -> list[str]:
    """Every .cpp under csrc/; .cu files and cuda/ folders only with CUDA."""
    found = []
    for path in sorted(glob.glob("csrc/**/*", recursive=True)):
        is_cuda = path.endswith(".cu") or f"{os.sep}cuda{os.sep}" in path
        if path.endswith((".cpp", ".cu")) and (with_cuda or not is_cuda):
            found.append(path)
    return found


# Note [unity build]: most of a torch-facing file's compile time went to torch's headers
# (ATen or c10d's ProcessGroup.hpp alone take ~10 s a file here; pybind11 adds code of its own
# to every file that includes it), so the torch-facing files of one family (csrc/<family>/)
# are compiled a few to a translation unit that #includes them in turn
# (build/unity/<family>_<n>.cpp). With -g0 and Note [torch headers precompiled], the 77 units
# of a cold build became 30, and its summed compile time fell from 1,417 s to about 200 s
# (benchmarks/results/suite.md). What is compiled is unchanged: each source keeps its own
# file, lines and include guards, and still includes what it uses (FASTDDP_UNITY=0 builds
# file by file); file-local names must not collide within a family, since any two of its
# files may share a unit as files come and go (tests/python/install/test_unity_build.py
# refuses a name defined twice). The torch-free layers (csrc/core, csrc/kernels, csrc/util:
# fast, and some set target attributes file-wide) and CUDA files stay one unit each.
UNITY_OWN_UNITS = ("csrc/core/", "csrc/kernels/", "csrc/util/")
# Files per unit, by family (csrc/<family>/...): small enough that touching one file
# recompiles its unit in seconds and that two cores stay busy, large enough that torch's
# headers are not parsed again for a handful of lines; the bindings instantiate pybind11 for
# each class they bind, so fewer of them.
UNITY_CHUNK = {"bindings": 4, "hooks": 4, "reducer": 9}
UNITY_CHUNK_DEFAULT = 8


def unity_groups(files: list[str]) -> dict[str, list[str]]:
    """{unit name: its .cpp files} for the files that go into unity units, by family."""
    by_family: dict[str, list[str]] = {}
    for path in files:
        if path.endswith(".cpp") and not path.startswith(UNITY_OWN_UNITS):
            by_family.setdefault(path.split("/")[1], []).append(path)
    groups = {}
    for family, members in sorted(by_family.items()):
        chunk = UNITY_CHUNK.get(family, UNITY_CHUNK_DEFAULT)
        count = -(-len(members) // chunk)
        for i in range(count):  # units of equal size (within one), neighbours together
            groups[f"{family}_{i}"] = members[i * len(members) // count:
                                              (i + 1) * len(members) // count]
    return groups


def write_if_changed(path: str, text: str) -> None:
    """Keeps the mtime of an unchanged unit, so that ninja does not recompile it."""
    if os.path.exists(path):
        with open(path) as f:
            if f.read() == text:
                return
    with open(path, "w") as f:
        f.write(text)


def build_sources(with_cuda: bool) -> list[str]:
    """What the extension compiles: sources() itself with FASTDDP_UNITY=0, else the unity
    units (Note [unity build]) and the files that stay units of their own."""
    files = sources(with_cuda)
    unity = os.environ.get("FASTDDP_UNITY", "1")
    if unity not in ("0", "1"):
        sys.exit(f"FASTDDP_UNITY must be 0 or 1, got {unity!r}")
    if unity == "0":
        say(f"unity build off (FASTDDP_UNITY=0): {len(files)} units")
        return files
    groups = unity_groups(files)
    grouped = {path for members in groups.values() for path in members}
    folder = os.path.join("build", "unity")
    os.makedirs(os.path.join(HERE, folder), exist_ok=True)
    # Beside the units, so that "torch_headers.h" finds its .gch there (Note [torch headers
    # precompiled]); a copy, so that the source tree holds no build output.
    with open(os.path.join(HERE, TORCH_HEADERS)) as f:
        write_if_changed(os.path.join(HERE, folder, os.path.basename(TORCH_HEADERS)), f.read())
    units = []
    for name, members in groups.items():
        lines = [f"// Generated by setup.py (Note [unity build]): {len(members)} sources, one unit.",
                 f'#include "{os.path.basename(TORCH_HEADERS)}"']
        lines += [f'#include "{path[len("csrc/"):]}"' for path in members]
        write_if_changed(os.path.join(HERE, folder, f"{name}.cpp"), "\n".join(lines) + "\n")
        units.append(os.path.join(folder, f"{name}.cpp"))
    # Units from a folder layout that no longer exists would only be stale files.
    for stale in set(glob.glob(os.path.join(HERE, folder, "*.cpp"))) - {
            os.path.join(HERE, u) for u in units}:
        os.remove(stale)
    own = [path for path in files if path not in grouped]
    say(f"unity build: {len(files)} sources in {len(units) + len(own)} units "
        f"({len(units)} unity units of torch-facing folders; FASTDDP_UNITY=0 builds file by file)")
    return units + own


# Note [torch headers precompiled]: after the unity build, what a unit still pays for torch is
# parsing its headers (~5 s of a unit's 15-20 s). GCC parses csrc/util/torch_headers.h once
# per build into build/unity/torch_headers.h.gch, a ninja edge of its own with the units'
# own $cflags and $post_cflags (added to the build.ninja that torch writes, just before
# ninja runs), and every unity unit includes it first and waits for it. A .gch that does not
# match a unit's flags is ignored by GCC, which then parses the header as text: the same
# code either way, and -Winvalid-pch says so in the build log. Clang has its own format, so
# the header is only precompiled under GCC; FASTDDP_PCH=0 turns it off. ccache caches the
# .gch and the units that use it with sloppiness pch_defines,time_macros (its manual).
TORCH_HEADERS = "csrc/util/torch_headers.h"


def gcc_compiler(command: list[str]) -> bool:
    """Whether `command` (the compiler ninja runs, ccache first or not) is GCC."""
    try:
        macros = subprocess.run(command + ["-dM", "-E", "-x", "c++", os.devnull],
                                capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "__GNUC__" in macros and "__clang__" not in macros


def add_pch_edge(ninja_text: str, unity_dir: str) -> tuple[str, str]:
    """(build.ninja with the precompiled header's edge and each unity unit waiting for it,
    why not) for torch's build.ninja; the text unchanged and the reason when it cannot."""
    cxx = re.search(r"^cxx = (.+)$", ninja_text, re.M)
    if not cxx:
        return ninja_text, "no cxx in build.ninja"
    if not gcc_compiler(shlex.split(cxx.group(1))):
        return ninja_text, f"{cxx.group(1)} is not GCC"
    header = os.path.join(unity_dir, os.path.basename(TORCH_HEADERS))
    gch = header + ".gch"
    unit = re.compile(rf"^(build \S+: compile {re.escape(unity_dir)}/\S+\.cpp)$", re.M)
    text, count = unit.subn(rf"\1 | {gch}\n  post_cflags = $post_cflags -Winvalid-pch", ninja_text)
    if count == 0:
        return ninja_text, "no unity unit in build.ninja"
    text += (f"\nrule fastddp_pch\n"
             f"  command = $cxx -MMD -MF $out.d $cflags -x c++-header $in -o $out $post_cflags\n"
             f"  depfile = $out.d\n  deps = gcc\n"
             f"  description = precompiling torch's headers\n"
             f"build {gch}: fastddp_pch {header}\n")
    return text, ""


def remove_stale_pch(unity_dir: str) -> None:
    """A .gch of an earlier build, where no edge keeps it up to date: GCC would still use it
    (it checks flags and macros, not the header's text or the torch it came from)."""
    gch = os.path.join(unity_dir, os.path.basename(TORCH_HEADERS) + ".gch")
    for path in (gch, gch + ".d"):
        if os.path.exists(path):
            os.remove(path)


class precompiled_torch_headers:
    """While building: adds the .gch edge to the build.ninja that torch's BuildExtension wrote,
    just before it runs ninja (torch offers no other way in). Says once why not where not."""

    def __enter__(self):
        self.original = getattr(cpp_extension, "_run_ninja_build", None)
        pch = os.environ.get("FASTDDP_PCH", "1")
        if pch not in ("0", "1"):
            sys.exit(f"FASTDDP_PCH must be 0 or 1, got {pch!r}")
        why_not = ("FASTDDP_PCH=0" if pch == "0" else
                   "FASTDDP_UNITY=0" if os.environ.get("FASTDDP_UNITY", "1") == "0" else
                   "this torch has no cpp_extension._run_ninja_build" if self.original is None
                   else "")
        unity_dir = os.path.join(HERE, "build", "unity")
        if why_not:
            say(f"precompiled torch headers off: {why_not}")
            remove_stale_pch(unity_dir)
            return self

        def run_ninja_build(build_directory, *args, **kwargs):
            path = os.path.join(build_directory, "build.ninja")
            with open(path) as f:
                text, why = add_pch_edge(f.read(), unity_dir)
            if why:
                say(f"precompiled torch headers off: {why}; the plain unity build")
                remove_stale_pch(unity_dir)
            else:
                with open(path, "w") as f:
                    f.write(text)
                say(f"precompiled torch headers: {TORCH_HEADERS}, once for every unity unit")
                sloppy = os.environ.get("CCACHE_SLOPPINESS", "")
                os.environ["CCACHE_SLOPPINESS"] = ",".join(
                    filter(None, [sloppy, "pch_defines", "time_macros"]))
            return self.original(build_directory, *args, **kwargs)

        cpp_extension._run_ninja_build = run_ninja_build
        return self

    def __exit__(self, *exc):
        if self.original is not None:
            cpp_extension._run_ninja_build = self.original


def build_stamp(with_cuda: bool) -> str:
    """What fastddp/_compat.py checks before loading _C (csrc/bindings/build_stamp.cpp)."""
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "visible GPUs") if with_cuda else "none"
    cuda = torch.version.cuda if with_cuda else "none"
    return f"fastddp-build-stamp:torch={torch.__version__};cuda={cuda};arch={arch};"


def local_version() -> str:
    """0.1.0+torch2.14cu130: the torch and CUDA a wheel was built for, in its name, as other
    torch extensions do. Plain for a source distribution, and for a build from one (pip
    installing an sdist compares the built version with the sdist's)."""
    if "sdist" in sys.argv or os.path.exists(os.path.join(HERE, "PKG-INFO")):
        return VERSION
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    cuda = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    return f"{VERSION}+torch{major}.{minor}{cuda}"


def license_metadata() -> dict:
    """BSD-3-Clause as an SPDX expression (PEP 639) where setuptools knows them (77 and
    later, which deprecate the old field), else in the old field: GPU machines without
    network build with whatever setuptools they have."""
    if int(setuptools.__version__.split(".")[0]) >= 77:
        return {"license_expression": "BSD-3-Clause", "license_files": ["LICENSE"]}
    return {"license": "BSD-3-Clause", "license_files": ["LICENSE"]}


def nvtx_include() -> str | None:
    home = cpp_extension.CUDA_HOME
    if home and os.path.exists(os.path.join(home, "include", "nvtx3", "nvToolsExt.h")):
        return os.path.join(home, "include")
    return None


def make_extension():
    with_cuda, why = decide_cuda()
    say(f"torch {torch.__version__} at {os.path.dirname(torch.__file__)}")
    say(f"CUDA {'on' if with_cuda else 'off'}: {why}")
    macros = [("FASTDDP_TORCH_VERSION", f'"{torch.__version__}"')]
    # -ffp-contract=off: GCC contracts a * b + c into one FMA by default in C++
    # (and the AVX-512 clones of the half-cast loops have FMA); the kernels must
    # round twice, like torch's separate ops, to match torch bit for bit.
    #
    # -g0: Python's own CFLAGS (sysconfig) bring -g, and debug info for torch's headers
    # costs as much compile time as the code itself (bucket.cpp: 25 s with it, 11 s
    # without). FASTDDP_DEBUG=1 keeps it for whoever debugs _C.
    cxx_flags = ["-O3", "-Wall", "-Wno-unused-parameter", "-ffp-contract=off"]
    debug = os.environ.get("FASTDDP_DEBUG", "0")
    if debug not in ("0", "1"):
        sys.exit(f"FASTDDP_DEBUG must be 0 or 1, got {debug!r}")
    if debug == "0":
        cxx_flags.append("-g0")
    say(f"debug info {'on (FASTDDP_DEBUG=1)' if debug == '1' else 'off (-g0; FASTDDP_DEBUG=1 keeps it)'}")
    include_dirs = [os.path.join(HERE, "csrc")]
    kwargs = {}
    if with_cuda:
        macros += [("FASTDDP_WITH_CUDA", None), ("FASTDDP_CUDA_VERSION", f'"{torch.version.cuda}"')]
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_ARCH_LIST
        say(f"TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST', '(visible GPUs)')}")
        nvtx = nvtx_include()
        if nvtx:
            macros.append(("FASTDDP_WITH_NVTX", None))
            include_dirs.append(nvtx)
        say(f"NVTX {'on' if nvtx else 'off (nvtx3 headers not found)'}")
        # No --use_fast_math: it flushes subnormals to zero and approximates
        # division, and the half-cast kernels must match torch's casts bit for
        # bit (subnormal float16 and float32 inputs included; see
        # Note [half rounding]). The kernels that need speed are
        # bandwidth-bound, so fast math would buy nothing.
        kwargs["extra_compile_args"] = {"cxx": cxx_flags, "nvcc": ["-O3"]}
        ext_type = cpp_extension.CUDAExtension
    else:
        say("NVTX off (needs CUDA)")
        kwargs["extra_compile_args"] = {"cxx": cxx_flags}
        ext_type = cpp_extension.CppExtension
    # Note [one libstdc++] (python/fastddp/_libstdcxx.py): the libstdc++ torch runs on,
    # named ahead of the compiler's own, so that none of its code is linked statically.
    kwargs["extra_link_args"] = libstdcxx.link_args()
    say(f"libstdc++: {kwargs['extra_link_args'][0] if kwargs['extra_link_args'] else 'none loaded'}"
        " (the one torch loaded)")
    stamp = build_stamp(with_cuda)
    macros.append(("FASTDDP_BUILD_STAMP", f'"{stamp}"'))
    say(f"stamp: {stamp}")
    srcs = build_sources(with_cuda)
    say(f"units: {' '.join(srcs)}")
    return ext_type(
        name="fastddp._C",
        sources=srcs,
        include_dirs=include_dirs,
        define_macros=macros,
        **kwargs,
    )


class BuildExtension(cpp_extension.BuildExtension):
    """Keeps objects in build/ so that a rebuild (editable installs use a fresh
    temporary folder otherwise) only recompiles what changed."""

    def finalize_options(self) -> None:
        super().finalize_options()
        self.build_temp = os.path.join(HERE, "build", "temp")
        # setuptools adds a venv's include/ folder to every compile. It is usually empty, and
        # its absolute path (outside the checkout, so CCACHE_BASEDIR cannot make it relative)
        # enters ccache's key of the precompiled torch headers, whose include paths ccache
        # hashes even in its preprocessor mode: each new venv recompiled them (~25 s of a
        # fresh clone's 49 s `make install`). An empty folder adds no header, so dropping it
        # compiles the same code (the same _C, byte for byte, as a build outside any venv).
        venv_include = os.path.join(sys.exec_prefix, "include")
        if venv_include in self.include_dirs and not any(
                files for _, _, files in os.walk(venv_include)):
            self.include_dirs.remove(venv_include)

    def build_extension(self, ext) -> None:
        with precompiled_torch_headers():
            super().build_extension(ext)
        # Refuse a module that would crash at run time (Note [one libstdc++]).
        path = self.get_ext_fullpath(ext.name)
        problems = libstdcxx.check_module(path)
        if problems:
            os.remove(path)
            sys.exit(libstdcxx.explain(path, problems))
        say(f"checked {os.path.basename(path)}: shared libstdc++, no stream or locale code "
            "of its own")


# pip (setuptools.build_meta) runs this file as __main__; tests import its functions.
if __name__ == "__main__":
    setup(
        version=local_version(),
        **license_metadata(),
        ext_modules=[make_extension()],
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    )
