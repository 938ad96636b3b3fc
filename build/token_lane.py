"""Compile the front's token lane (front/token_lane.c) for the Python that runs this: `python
build/token_lane.py` (make setup runs it) writes front/_token_lane<ext>; `--source FILE --out-dir DIR`
builds elsewhere (the GPU image: deploy/Dockerfile.trtllm, where the project is mounted read-only). Without
a C compiler or Python's headers the front keeps its Python path (front/token_lane.py says which runs). A
build is redone only when the source changes, and carries the source's sha256, so that a build older than
the source beside it is ignored, not run.

No instruction set is assumed (-O2, no -march): the same build runs on any x86-64 or arm64 host."""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "front" / "token_lane.c"


def target(out_dir: Path | None = None) -> Path:
    return (out_dir or ROOT / "front") / ("_token_lane" + sysconfig.get_config_var("EXT_SUFFIX"))


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def missing() -> str:
    """Why this host cannot build the lane ("" when it can)."""
    if compiler() is None:
        return "no C compiler (cc, gcc or clang)"
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        return f"no Python headers in {include} (python3-dev)"
    return ""


def source_digest(source: Path) -> str:
    return hashlib.sha256(source.read_bytes()).hexdigest()


def build(force: bool = False, source: Path | None = None, out_dir: Path | None = None) -> Path | None:
    """The built module's path, or None (no compiler, or no Python headers): the front runs its Python path."""
    source = source or SOURCE
    out = target(out_dir)
    stamp = out.with_suffix(".sha256")
    digest = source_digest(source)
    if not force and out.exists() and stamp.exists() and stamp.read_text().strip() == digest:
        return out
    why = missing()
    if why:
        print(f"[setup] the front's token lane not compiled: {why}; the front runs its Python path", file=sys.stderr)
        return None
    cc, include = compiler(), sysconfig.get_paths()["include"]
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        built = Path(tmp) / out.name
        cmd = [cc, "-O2", "-fPIC", "-shared", "-fno-strict-aliasing", "-Wall", "-Werror=implicit-function-declaration",
               f'-DLANE_SOURCE_SHA256="{digest}"', f"-I{include}", str(source), "-o", str(built)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            print(f"[setup] compiling the front's token lane failed ({' '.join(cmd)}):\n{result.stderr}"
                  "[setup] the front runs its Python path", file=sys.stderr)
            return None
        os.replace(built, out)
    stamp.write_text(digest + "\n")
    print(f"[setup] compiled the front's token lane: {out}", file=sys.stderr)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--force", action="store_true", help="rebuild even if the source is unchanged")
    ap.add_argument("--source", type=Path, help="the lane's C source (default: front/token_lane.c)")
    ap.add_argument("--out-dir", type=Path, help="where _token_lane<ext> goes (default: front/)")
    ap.add_argument("--require", action="store_true", help="exit 1 if it cannot be built (an image's build)")
    args = ap.parse_args(argv)
    built = build(args.force, args.source, args.out_dir)
    return 1 if built is None and args.require else 0


if __name__ == "__main__":
    sys.exit(main())
