"""Files are cut by concept, not by length (issue 53).

A source file holds one concept, and length alone is no reason to cut one: the 450-line rule
that stood here before cut the reducer into 12 files and most features into a class and its
glue. A file past REVIEW_LINES is read again for a second concept, and the reading is
recorded in READ_FOR_ONE_CONCEPT: each such file with the one concept it holds. A file that
grows past the mark unread fails, and so does an entry whose file is no longer past it, so
that the record stays true.

In csrc a feature is one unit, its header and its .cpp: its state, its logic and the
reducer's calls into it. A ``<family>_<feature>.cpp`` beside a ``<feature>.h`` holds one
feature in a second file, and fails. In csrc/reducer every .cpp is the body of the header
of its name, or one of the reducer's own parts in REDUCER_PARTS (reducer.h's class is
cut by concept there too); a new part is named there with its concept, so that glue such
as the reducer_join.cpp that stood beside join_shadow.h does not come back unseen.

class Reducer keeps at most REDUCER_MEMBERS data members: a feature's state is its own class's
member, one per feature, not loose fields of the reducer.

The Python a newcomer reads to follow one synchronized step, listed in docs/design.md ("One
step, read in order"), stays under ONE_STEP_LINES: the core stays small as the extras grow.

Run as a script on another checkout: ``python3 tests/python/test_file_concepts.py PATH``.
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Where the sources are, and which files are sources.
FOLDERS = ("python/fastddp", "csrc", "tests", "benchmarks")
SUFFIXES = (".py", ".h", ".cpp", ".cu", ".cuh")
REVIEW_LINES = 600
ONE_STEP_LINES = 4_500
REDUCER_MEMBERS = 25
# Files past REVIEW_LINES that were read again and hold one concept: path -> that concept.
READ_FOR_ONE_CONCEPT: dict[str, str] = {}
# The Reducer's parts beyond reducer.cpp (its step), each one concept of the class itself.
REDUCER_PARTS = {"reducer_graph.cpp": "its view of the autograd graph"}


def sources(root: Path) -> list[Path]:
    return sorted(path for folder in FOLDERS if (root / folder).is_dir()
                  for path in (root / folder).rglob("*") if path.suffix in SUFFIXES
                  and path.is_file() and "egg-info" not in path.as_posix())


def unread_long_files(root: Path, read: dict[str, str]) -> list[str]:
    """Files past REVIEW_LINES that READ_FOR_ONE_CONCEPT does not name."""
    found = []
    for path in sources(root):
        name = path.relative_to(root).as_posix()
        lines = len(path.read_text(errors="replace").splitlines())
        if lines > REVIEW_LINES and name not in read:
            found.append(f"{name}: {lines} lines, not read for a second concept")
    return found


def stale_entries(root: Path, read: dict[str, str]) -> list[str]:
    """Entries of READ_FOR_ONE_CONCEPT whose file is gone or no longer past REVIEW_LINES."""
    stale = []
    for name in read:
        path = root / name
        if not path.is_file() or len(path.read_text().splitlines()) <= REVIEW_LINES:
            stale.append(name)
    return stale


def split_features(root: Path) -> list[str]:
    """csrc's ``<family>_<feature>.cpp`` files that stand beside their ``<feature>.h``."""
    split = []
    for path in sorted((root / "csrc").rglob("*.cpp")):
        family, _, feature = path.stem.partition("_")
        if feature and family == path.parent.name and (path.parent / f"{feature}.h").exists():
            split.append(f"{path.relative_to(root).as_posix()}: beside {feature}.h")
    return split


def unlisted_reducer_parts(root: Path) -> list[str]:
    """csrc/reducer's .cpp files with no header of their name, not in REDUCER_PARTS."""
    return [path.name for path in sorted((root / "csrc/reducer").glob("*.cpp"))
            if not path.with_suffix(".h").exists() and path.name not in REDUCER_PARTS]


def data_members(header: str, name: str) -> list[str]:
    """The data members of C++ class ``name`` in ``header``'s text: declarations ending in
    ``_;``, ``_ = ...;`` or ``_{...};`` (the project's trailing underscore), not functions."""
    body = header.split(f"\nclass {name} ", 1)[1].split("\n};", 1)[0]
    found = []
    for line in body.split("\n"):
        code = line.split("//", 1)[0].strip()
        match = re.search(r"(\w+_)\s*(=[^;(]*|\{[^;]*\})?;$", code)
        if match and "(" not in code.split("=", 1)[0]:
            found.append(match.group(1))
    return found


def test_the_reducer_holds_its_features_not_their_fields() -> None:
    members = data_members((ROOT / "csrc/reducer/reducer.h").read_text(), "Reducer")
    assert {"params_", "buckets_", "mutex_", "grad_hooks_"} <= set(members)  # read right
    assert len(members) <= REDUCER_MEMBERS, members


def one_step_reading(root: Path) -> dict[str, int]:
    """The Python files docs/design.md lists under "One step, read in order", with their
    lines (-1: no such file)."""
    text = (root / "docs/design.md").read_text()
    section = text.split("## One step, read in order", 1)[1].split("\n## ", 1)[0]
    return {name: len((root / name).read_text().splitlines()) if (root / name).is_file()
            else -1 for name in dict.fromkeys(re.findall(r"`(python/[\w/]+\.py)`", section))}


def test_one_step_reads_in_under_the_limit() -> None:
    files = one_step_reading(ROOT)
    assert "python/fastddp/ddp/distributed.py" in files  # the section was found
    assert [name for name, lines in files.items() if lines < 0] == []
    assert sum(files.values()) <= ONE_STEP_LINES, files


def test_a_long_file_was_read_for_one_concept() -> None:
    assert len(sources(ROOT)) > 300  # the sources were found
    assert unread_long_files(ROOT, READ_FOR_ONE_CONCEPT) == []


def test_the_record_of_long_files_is_true() -> None:
    assert stale_entries(ROOT, READ_FOR_ONE_CONCEPT) == []


def test_no_feature_is_split_from_its_glue() -> None:
    assert (ROOT / "csrc/reducer/reducer.cpp").is_file()  # the layout this test knows
    assert split_features(ROOT) == []
    assert unlisted_reducer_parts(ROOT) == []


def test_the_checkers_find_what_they_look_for(tmp_path: Path) -> None:
    (tmp_path / "csrc/reducer").mkdir(parents=True)
    (tmp_path / "python/fastddp").mkdir(parents=True)
    long = "x = 1\n" * (REVIEW_LINES + 1)
    (tmp_path / "python/fastddp/long.py").write_text(long)
    (tmp_path / "python/fastddp/short.py").write_text("x = 1\n" * REVIEW_LINES)
    assert unread_long_files(tmp_path, {}) == [
        f"python/fastddp/long.py: {REVIEW_LINES + 1} lines, not read for a second concept"]
    assert unread_long_files(tmp_path, {"python/fastddp/long.py": "one concept"}) == []
    assert stale_entries(tmp_path, {"python/fastddp/short.py": "", "gone.py": ""}) == [
        "python/fastddp/short.py", "gone.py"]
    for name in ("join.h", "reducer_join.cpp", "reducer_graph.cpp", "grad_hooks.cpp"):
        (tmp_path / "csrc/reducer" / name).write_text("")
    assert split_features(tmp_path) == ["csrc/reducer/reducer_join.cpp: beside join.h"]
    (tmp_path / "csrc/reducer/grad_hooks.h").write_text("")
    assert unlisted_reducer_parts(tmp_path) == ["reducer_join.cpp"]


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    found = (unread_long_files(root, READ_FOR_ONE_CONCEPT) + split_features(root)
             + [f"csrc/reducer/{name}: no header of its name, not a listed reducer part"
                for name in unlisted_reducer_parts(root)]
             + [f"{name}: recorded as long, no longer is" for name in
                stale_entries(root, READ_FOR_ONE_CONCEPT)])
    print("\n".join(found) or "every file one concept, as far as this test can tell")
    sys.exit(1 if found else 0)
