"""Generate the Python code of ``protos/corpusd/v1/*.proto`` into ``corpusd/v1/`` (never edit it).

    python -m tools.gen_protos           # regenerate
    python -m tools.gen_protos --check   # exit 1 if the committed code is not what protoc makes

The generated modules import each other as ``corpusd.v1.*_pb2``, which is why they live in that
package. The test suite runs ``--check``, so a .proto edit without regeneration fails CI.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
PACKAGE = Path("corpusd") / "v1"
INIT = '"""Generated gRPC/protobuf code for corpusd.v1 (see tools/gen_protos.py)."""\n'


def generate(out_root: Path) -> list[Path]:
    from grpc_tools import protoc

    files = sorted(PROTOS.glob("corpusd/v1/*.proto"))
    args = [
        "protoc",
        f"-I{PROTOS}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(f) for f in files),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    (out_root / PACKAGE / "__init__.py").write_text(INIT)
    return sorted((out_root / PACKAGE).iterdir())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare instead of writing")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        made = generate(Path(tmp))
        dest = ROOT / PACKAGE
        if a.check:
            names = {f.name for f in made}
            have = {f.name for f in dest.glob("*") if f.is_file()} if dest.exists() else set()
            stale = sorted(names ^ have) + [
                f.name
                for f in made
                if f.name in have and not filecmp.cmp(f, dest / f.name, shallow=False)
            ]
            if stale:
                print(f"generated code is stale: {stale}; run python -m tools.gen_protos")
                return 1
            print(f"generated code is current ({len(made)} files)")
            return 0
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        for f in made:
            shutil.copy(f, dest / f.name)
        print(f"wrote {len(made)} files to {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
