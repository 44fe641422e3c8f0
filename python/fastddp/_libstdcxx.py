"""Whether a compiled module uses the shared libstdc++ that torch runs on.

Note [one libstdc++] (csrc/util/message.h has the C++ side, Note [no streams in _C]):
an extension that carries libstdc++'s stream and locale code of its own (a compiler
that links libstdc++ statically, or ``LDFLAGS=-static-libstdc++``) runs that copy
against the process's shared libstdc++, whose facet ids differ: stream reads fail or
crash in ``codecvt`` (the first GPU machine segfaulted registering torch's PowerSGD
hook; pytorch/pytorch#109923). setup.py links the libstdc++ that torch loaded
(link_args) and refuses a module that check_module() finds fault with;
``python -m fastddp --check`` reports the same.

Pure Python, no torch import: setup.py loads this file by path, before fastddp exists.
It reads ELF files itself (64-bit little-endian: x86-64 and aarch64 Linux), so that
no binutils are needed where it runs.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass, field

# libstdc++'s stream and locale classes (and std::use_facet/has_facet): a definition
# of any of their members, vtables or typeinfo means the module carries its own copy.
_NAMES = ("locale", "ios_base", "basic_ios", "basic_istream", "basic_ostream",
          "basic_iostream", "basic_streambuf", "basic_stringbuf", "basic_istringstream",
          "basic_ostringstream", "basic_stringstream", "basic_filebuf", "basic_ifstream",
          "basic_ofstream", "basic_fstream", "num_get", "num_put", "codecvt", "ctype",
          "numpunct", "moneypunct", "money_get", "money_put", "time_get", "time_put",
          "messages", "collate", "use_facet", "has_facet")
# _Z, then a vtable/VTT/typeinfo/name prefix or a nested name with its qualifiers,
# then std::istream/ostream/iostream (Si, So, Sd) or std::[__cxx11::]<name>.
_STREAM_SYMBOL = re.compile(
    r"^_Z(?:T[VTIS])?N?[KVrRO]*(?:S[iod]|St(?:7__cxx11)?(?:"
    + "|".join(f"{len(n)}{n}" for n in _NAMES) + r"))")
_GLIBCXX = re.compile(r"^GLIBCXX_(\d+(?:\.\d+)*)$")

_SHT_SYMTAB, _SHT_DYNAMIC, _SHT_DYNSYM = 2, 6, 11
_SHT_GNU_VERDEF, _SHT_GNU_VERNEED = 0x6FFFFFFD, 0x6FFFFFFE
_DT_NEEDED = 1
_STB_GLOBAL = 1


@dataclass
class ElfInfo:
    """What check_module() needs from one shared object."""
    needed: list[str] = field(default_factory=list)
    # Strong (STB_GLOBAL) definitions; weak ones are inline template code, normal.
    strong_symbols: set[str] = field(default_factory=set)
    # Version names this object needs from each library it links (GLIBCXX_3.4.30, ...).
    needed_versions: dict[str, set[str]] = field(default_factory=dict)
    # Version names it defines (a libstdc++ defines GLIBCXX_3.4 ... GLIBCXX_3.4.N).
    defined_versions: set[str] = field(default_factory=set)


def _cstr(data: bytes, offset: int) -> str:
    end = data.index(b"\0", offset)
    return data[offset:end].decode("utf-8", "replace")


def read_elf(path: str) -> ElfInfo:
    """The NEEDED entries, strong symbol definitions and symbol versions of an ELF file.
    Raises ValueError for a file that is not a 64-bit little-endian ELF."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
                for i in range(shnum)]

    def strtab(index: int) -> int:  # a section's linked string table: its file offset
        return sections[index][4]

    info = ElfInfo()
    for _name, kind, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
        if kind in (_SHT_SYMTAB, _SHT_DYNSYM):
            names = strtab(link)
            for pos in range(offset, offset + size, entsize or 24):
                st_name, st_info, _other, st_shndx, _value, _size = struct.unpack_from(
                    "<IBBHQQ", data, pos)
                if st_shndx != 0 and st_info >> 4 == _STB_GLOBAL and st_name:
                    info.strong_symbols.add(_cstr(data, names + st_name))
        elif kind == _SHT_DYNAMIC:
            names = strtab(link)
            for pos in range(offset, offset + size, entsize or 16):
                tag, value = struct.unpack_from("<qQ", data, pos)
                if tag == _DT_NEEDED:
                    info.needed.append(_cstr(data, names + value))
        elif kind == _SHT_GNU_VERNEED:
            names, pos = strtab(link), offset
            while True:
                _version, count, file_name, aux, next_ = struct.unpack_from("<HHIII", data, pos)
                wanted = info.needed_versions.setdefault(_cstr(data, names + file_name), set())
                apos = pos + aux
                for _ in range(count):
                    _hash, _vflags, _other, vname, anext = struct.unpack_from("<IHHII", data, apos)
                    wanted.add(_cstr(data, names + vname))
                    apos += anext
                if not next_:
                    break
                pos += next_
        elif kind == _SHT_GNU_VERDEF:
            names, pos = strtab(link), offset
            while True:
                _version, _vflags, _ndx, count, _hash, aux, next_ = struct.unpack_from(
                    "<HHHHIII", data, pos)
                if count:
                    vname, _anext = struct.unpack_from("<II", data, pos + aux)
                    info.defined_versions.add(_cstr(data, names + vname))
                if not next_:
                    break
                pos += next_
    return info


def stream_symbols(info: ElfInfo) -> list[str]:
    """The stream and locale machinery the object defines itself (mangled names)."""
    return sorted(s for s in info.strong_symbols if _STREAM_SYMBOL.match(s))


def _version_key(name: str) -> tuple[int, ...]:
    match = _GLIBCXX.match(name)
    return tuple(int(x) for x in match.group(1).split(".")) if match else ()


def newest_glibcxx(versions: set[str]) -> str | None:
    found = [v for v in versions if _GLIBCXX.match(v)]
    return max(found, key=_version_key) if found else None


def loaded_libstdcxx() -> str | None:
    """The libstdc++ mapped into this process (torch's, once torch is imported), or None
    where there is none or /proc is not there."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                if os.path.basename(path).startswith("libstdc++.so"):
                    return path
    except OSError:
        return None
    return None


def link_args() -> list[str]:
    """Linker inputs that make a module use the shared libstdc++ this process runs on:
    the file itself, ahead of the compiler's own -lstdc++, so that every libstdc++
    symbol binds to it (DT_NEEDED libstdc++.so.6) even where the compiler would link
    libstdc++ statically. Empty where no libstdc++ is loaded."""
    path = loaded_libstdcxx()
    return [path] if path else []


def check_module(path: str, runtime: str | None = None) -> list[str]:
    """What is wrong with the compiled module at `path`, as sentences (empty: nothing).
    `runtime` is the libstdc++ it will run with (default: the one loaded here)."""
    info = read_elf(path)
    problems = []
    own = stream_symbols(info)
    if own:
        shown = ", ".join(own[:4]) + (f" and {len(own) - 4} more" if len(own) > 4 else "")
        problems.append(
            f"it defines {len(own)} symbols of libstdc++'s stream and locale code itself "
            f"({shown}): libstdc++ was linked statically into it")
    if not any(n.startswith("libstdc++.so") for n in info.needed):
        problems.append("it does not link the shared libstdc++ (no NEEDED libstdc++.so.6; "
                        f"NEEDED: {', '.join(info.needed) or 'none'})")
    runtime = runtime or loaded_libstdcxx()
    wanted = set().union(*(v for lib, v in info.needed_versions.items()
                           if lib.startswith("libstdc++.so")))
    if runtime and wanted:
        have = read_elf(runtime).defined_versions
        missing = sorted((v for v in wanted - have if _GLIBCXX.match(v)), key=_version_key)
        if missing:
            problems.append(
                f"it needs {', '.join(missing)} but the libstdc++ that runs it ({runtime}) "
                f"provides up to {newest_glibcxx(have)}: the compiler is newer than the "
                "runtime library")
    return problems


def explain(path: str, problems: list[str]) -> str:
    """The message for a refused module: what was found, why it matters, what to do."""
    lines = [f"fastddp: the compiled module {path} cannot run safely with torch:"]
    lines += [f"  - {p}" for p in problems]
    lines.append(
        "  A second copy of libstdc++'s locale and stream code inside the module crashes or "
        "misreads numbers at run time (pytorch/pytorch#109923). Build with a g++ that links "
        "the shared libstdc++ torch uses (for example CXX=/usr/bin/g++), without "
        "-static-libstdc++ in LDFLAGS, then `pip install --no-build-isolation .` again.")
    return "\n".join(lines)
