"""Note [no streams in _C]: csrc/ formats its messages without iostreams, so that a bad-input
error stays an exception even in a module that carries its own stream code. This keeps new
code from bringing them back: streams, locales and the TORCH_CHECK family (whose messages
c10::str formats with an ostringstream in our translation unit) only in message.h."""

import pathlib
import re

CSRC = pathlib.Path(__file__).resolve().parents[3] / "csrc"
ALLOWED = {CSRC / "util" / "message.h"}
FORBIDDEN = re.compile(
    r"#include\s*<(sstream|iostream|istream|ostream|fstream|iomanip|locale)>"
    r"|\bstd::(ostringstream|istringstream|stringstream|cout|cerr|clog|locale|ostream|istream)\b"
    r"|\bTORCH_(CHECK|CHECK_[A-Z_]+|WARN|WARN_ONCE|INTERNAL_ASSERT)\s*\("
    r"|\bc10::str\s*\(")


def test_csrc_has_no_streams_and_no_torch_check():
    found = []
    for path in sorted(CSRC.rglob("*")):
        if path.suffix not in (".h", ".cpp", ".cu", ".cuh") or path in ALLOWED:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if FORBIDDEN.search(line) and not line.lstrip().startswith("//"):
                found.append(f"{path.relative_to(CSRC.parent)}:{number}: {line.strip()}")
    assert not found, "use fastddp::cat / FASTDDP_CHECK (csrc/util/message.h):\n" + "\n".join(
        found)


def test_the_pattern_catches_what_it_guards():
    # The guard above passes vacuously if the pattern matches nothing: show it matches.
    for line in ('#include <sstream>', 'std::ostringstream out;', 'TORCH_CHECK(x, "n ", n);',
                 'TORCH_CHECK_VALUE(ok, "bad");', 'return c10::str("a", 1);'):
        assert FORBIDDEN.search(line), line
    assert not FORBIDDEN.search('FASTDDP_CHECK(x, "n ", n);')
