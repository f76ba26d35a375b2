"""python -m labkit doctor | bench cluster|ring | images | clean-notebooks FILES..."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m labkit")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("doctor", help="versions, backend, and a 2-rank smoke test")
    b = sub.add_parser("bench", help="benchmarks, printed as ratios to a reference")
    b.add_argument("what", choices=["cluster", "ring"])
    b.add_argument("--world-size", type=int, default=4)
    sub.add_parser("images", help="draw the course's diagrams into images/")
    c = sub.add_parser("clean-notebooks",
                       help="strip outputs and execution counts; mark slides")
    c.add_argument("paths", nargs="+")
    args = p.parse_args(argv)

    if args.cmd == "doctor":
        from labkit.doctor import doctor

        return doctor()
    if args.cmd == "bench":
        from labkit.bench import bench_cluster, bench_ring

        if args.what == "ring":
            return bench_ring(args.world_size)
        return bench_cluster(args.world_size)
    if args.cmd == "images":
        from labkit.images import render

        for path in render():
            print(f"wrote {path}")
        return 0
    if args.cmd == "clean-notebooks":
        from labkit.nbclean import clean, mark_slides

        for path in args.paths:
            changed = clean(path) | mark_slides(path)
            print(("cleaned   " if changed else "clean     ") + path)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
