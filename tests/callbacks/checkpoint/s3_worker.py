"""Subprocess for test_checkpoint_object_store.py: tests/callbacks/crash_worker.py's seeded run, plus a stall.

`--stall-put N --marker PATH`: the N-th upload of an `arrays.npz` stalls (after touching PATH) before
its PUT, so the test can SIGKILL the process in the middle of a save on the object store. Every other
argument goes to crash_worker.py (`--dir s3://...`).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--stall-put", type=int, default=None)
    p.add_argument("--marker", default=None)
    args, rest = p.parse_known_args()
    if args.stall_put is not None:
        from trainwell import storage

        real_put, calls = storage.ObjectStore.put, {"n": 0}

        def put(self, rel, data):
            if rel.endswith("/arrays.npz"):
                calls["n"] += 1
                if calls["n"] == args.stall_put:
                    Path(args.marker).write_text(rel)
                    time.sleep(120)
            return real_put(self, rel, data)

        storage.ObjectStore.put = put
    path = Path(__file__).resolve().parents[1] / "crash_worker.py"
    spec = importlib.util.spec_from_file_location("crash_worker", path)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    return worker.main(rest)


if __name__ == "__main__":
    sys.exit(main())
