"""`python -m labkit ...`: doctor | bench cluster|ring|strategies|model-parallel|
roofline|expert |
launch FILE.py:FN [ARG...] [--results DIR] | export NOTEBOOK --out FILE.py |
results DIR... [--chart DIR] | images | clean-notebooks FILES... | student [--run] |
nbgrader [CHAPTER...] | footprint [--out FILE] (one module per command)."""

from __future__ import annotations

import argparse
import sys


def bench_model_parallel(world_size: int) -> int:
    """The tensor-parallel MLP against DTensor's, then the 1F1B pipeline against
    torch.distributed.pipelining's Schedule1F1B: one table, one exit status."""
    from labkit.cli.bench import exit_code, table
    from labkit.cli.bench_pipeline import bench_pipeline
    from labkit.cli.bench_tensor_parallel import bench_tensor_parallel

    rows = bench_tensor_parallel(world_size) + bench_pipeline(world_size)
    print()
    print(table(rows))
    return exit_code(rows)


# -- one function per command: (parsed arguments) -> exit status ----------------


def _doctor(args) -> int:
    from labkit.cli.doctor import doctor

    return doctor()


def _bench(args) -> int:
    from labkit.cli.bench import world_size_problem

    problem = world_size_problem(args.what, args.world_size)
    if problem:
        print(f"labkit bench {args.what}: {problem}", file=sys.stderr)
        return 2
    n = args.world_size or (2 if args.what == "model-parallel" else 4)
    if args.what == "model-parallel":
        return bench_model_parallel(n)
    if args.what == "strategies":
        from labkit.cli.bench_strategies import bench_strategies

        return bench_strategies(n)
    if args.what == "roofline":  # one GPU, no ranks
        from labkit.cli.bench_roofline import bench_roofline

        return bench_roofline()
    if args.what == "ring":
        from labkit.cli.bench_ring import bench_ring

        return bench_ring(n)
    if args.what == "expert":
        from labkit.cli import bench_expert

        return bench_expert.run(n)
    from labkit.cli.bench import bench_cluster

    return bench_cluster(n)


def _launch(args) -> int:
    from labkit.runtime import launch_torchrun

    try:
        return launch_torchrun(args.target, args.nproc, args.torchrun, args.args,
                               args.results)
    except ValueError as e:
        print(f"labkit launch: {e}", file=sys.stderr)
        return 2


def _export(args) -> int:
    from labkit.cli.export import export

    return export(args.notebook, args.out)


def _results(args) -> int:
    from labkit.cli.results import results_command

    return results_command(args.dirs, args.chart)


def _images(args) -> int:
    from labkit.cli.images import render

    for path in render():
        print(f"wrote {path}")
    return 0


def _clean_notebooks(args) -> int:
    from labkit.cli.nbclean import clean, mark_slides

    for path in args.paths:
        changed = clean(path) | mark_slides(path)
        print(("cleaned   " if changed else "clean     ") + path)
    return 0


def _footprint(args) -> int:
    from labkit.cli.footprint import footprint

    return footprint(args.out)


def _nbgrader(args) -> int:
    from labkit.cli.assignments import nbgrader_course

    return nbgrader_course(args.out, chapters=args.chapters or None)


def _student(args) -> int:
    from labkit.cli.student import student

    return student(args.out, run=args.run)


def parser() -> argparse.ArgumentParser:
    """`python -m labkit`'s parser: one subcommand each, its handler in `func`."""
    p = argparse.ArgumentParser(prog="python -m labkit")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("doctor", help="versions, backend, and a 2-rank smoke test"
                   ).set_defaults(func=_doctor)
    b = sub.add_parser("bench", help="benchmarks: each figure beside its target; "
                       "exit status 1 when one falls short, 2 on a bad flag")
    b.add_argument("what", choices=["cluster", "ring", "strategies", "model-parallel",
                                    "roofline", "expert"])
    b.add_argument("--world-size", type=int, default=None,
                   help="ranks, at least 2 (default: 2 for model-parallel, else 4; "
                   "model-parallel and expert need sizes that split evenly; "
                   "roofline takes none)")
    b.set_defaults(func=_bench)
    sub.add_parser("images", help="draw the course's diagrams into images/"
                   ).set_defaults(func=_images)
    la = sub.add_parser("launch", help="run FILE.py:FUNCTION under torchrun")
    la.add_argument("target", help="FILE.py:FUNCTION or module:FUNCTION")
    la.add_argument("args", nargs="*", help="fn's arguments after (rank, "
                    "world_size): Python literals, else strings")
    la.add_argument("--nproc", type=int, default=2, help="processes on this machine")
    la.add_argument("--results", default=None,
                    help="folder: every rank writes what fn returned to rank{r}.pt")
    la.add_argument("--torchrun", nargs="...", default=[],
                    help="everything after this goes to torchrun")
    la.set_defaults(func=_launch)
    ex = sub.add_parser("export", help="a notebook's imports, constants and "
                        "functions as an importable module (for torchrun)")
    ex.add_argument("notebook")
    ex.add_argument("--out", required=True, help="the module to write (FILE.py)")
    ex.set_defaults(func=_export)
    from labkit.cli.results import EXIT_HELP

    rs = sub.add_parser("results", help="merge a torchrun run's rank*.pt files in "
                        "rank order and summarize them", epilog=EXIT_HELP)
    rs.add_argument("dirs", nargs="+", help="the --results folder(s), one per node "
                    "without a shared file system")
    rs.add_argument("--chart", default=None,
                    help="folder: draw the ledgers the ranks returned as PNGs")
    rs.set_defaults(func=_results)
    c = sub.add_parser("clean-notebooks",
                       help="strip outputs and execution counts; mark slides")
    c.add_argument("paths", nargs="+")
    c.set_defaults(func=_clean_notebooks)
    st = sub.add_parser("student", help="the student edition: solutions out, outputs "
                        "cleared, into dist/student/")
    st.add_argument("--out", default=None, help="folder (default: dist/student)")
    st.add_argument("--run", action="store_true",
                    help="then run each notebook up to its first exercise")
    st.set_defaults(func=_student)
    ng = sub.add_parser("nbgrader", help="the chapters as nbgrader assignments "
                        "(a course folder, default dist/nbgrader)")
    ng.add_argument("chapters", nargs="*", help="chapter stems (default: all)")
    ng.add_argument("--out", default=None, help="folder (default: dist/nbgrader)")
    ng.set_defaults(func=_nbgrader)
    fp = sub.add_parser("footprint", help="what one student's kernel and 4-rank "
                        "cluster hold, chapter by chapter (for a class on one server)")
    fp.add_argument("--out", default=None, help="where to save the figures doctor "
                    "reads (default: ~/.cache/labkit/footprint.json)")
    fp.set_defaults(func=_footprint)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # python -m labkit.cli.main
    sys.exit(main())
