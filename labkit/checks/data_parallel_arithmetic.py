"""Chapter 05's arithmetic exercises: the bytes a parameter server sharded over m
ranks writes per step, and how many buckets DDP's rule makes. Each is called on
cases drawn fresh each run (and held to what the traffic ledger or DataParallel
measured where the chapter measured it), against references computed here with
exact fractions; labkit's own bucket builders and α-β functions are refused."""

from __future__ import annotations

import random
from fractions import Fraction

from labkit.checks.common import (
    NOT_WRITTEN,
    NOT_YET,
    PASSED,
    ExerciseError,
    call_answer,
    finite,
    is_number,
    is_whole,
)
from labkit.checks.verify import fresh_seed, own_calls, refuse_own

# ------------------------------------------------- a sharded parameter server

_BYTES_KEYS = ("server", "worker")
_OWN_BYTES = ("labkit.theory.collective_cost",
              "labkit.checks.data_parallel_arithmetic:_server_bytes")


def _server_bytes(s: float, n: int, m: int) -> dict[str, Fraction]:
    """Bytes a rank writes per step, n ranks, server shards on m of them: a
    shard's rank pushes 1/m of its gradient to each of the m-1 other shards and
    sends its 1/m of the new weights to the n-1 other ranks; a rank without one
    pushes its whole gradient, 1/m to each shard."""
    s = Fraction(s)
    return {"server": (m - 1) * s / m + (n - 1) * s / m, "worker": s}


def _bytes_cases(seed: int) -> list[tuple[float, int, int]]:
    rng = random.Random(seed)
    cases = [(14e9, 64, 8)]  # the follow-up: 7B in bf16 on 64 ranks, 8 shards
    for _ in range(6):
        n = rng.randint(2, 512)
        m = rng.choice([1, n, rng.randint(1, n)])
        cases.append((float(rng.randint(1, 10**6) * rng.choice([1, 997, 4096])),
                      n, m))
    return cases


def _bytes_hint(key: str, s: float, n: int, m: int, got: float) -> str:
    near = {
        "server": {
            "(N-1)·S, one server's bytes: with m shards, each sends only its 1/m "
            "of the weights": (n - 1) * s,
            "the weights alone, (N-1)·S/m: a shard's rank is a worker too, and "
            "pushes 1/m of its gradient to each of the other m-1 shards": (n - 1)
            * s / m,
            "(N+m-1)·S/m, one 1/m too many: it pushes its gradient to the m-1 "
            "OTHER shards (its own 1/m stays), and sends weights to the N-1 other "
            "ranks": (n + m - 1) * s / m,
            "(N+m)·S/m: neither its own gradient's 1/m nor its own weights "
            "travel": (n + m) * s / m,
            "2(N-1)/N·S, a ring's bytes: right only when every rank holds a shard "
            "(m = N)": 2 * (n - 1) / n * s,
            "N·S/m: the shard's rank also pushes its gradient to the other "
            "shards, and sends no weights to itself": n * s / m,
        },
        "worker": {
            "S/m: a worker pushes 1/m of its gradient to EACH of the m shards": s / m,
            "(m-1)·S/m: a worker holds no shard, so all m parts travel": (m - 1)
            * s / m,
            "2S: a worker writes only gradients; the weights come back to it": 2 * s,
        },
    }[key]
    for why, v in near.items():
        if abs(got - v) <= 1e-9 * abs(v):
            return f"; that is {why}"
    return ""


def check_bytes_per_step(fn, measured: dict | None = None) -> bool:
    """Check a student's `fn(S, n, m)`: bytes each rank WRITES per step when every
    rank holds S bytes of gradients and the parameters are sharded over m server
    shards on ranks 0..m-1 (each shard's rank is a worker too), as {"server":
    bytes of a rank holding a shard, "worker": bytes of a rank holding none}
    ("worker" is not read when m = n). Cases are drawn fresh each run, plus the
    follow-up's (14 GB, 64 ranks, 8 shards). `measured` maps (S, n, m) to what the
    traffic ledger measured there, {"server": [b, ...], "worker": [b, ...]} (rank
    by rank), held to 1% (gloo's headers). labkit's α-β functions are refused."""
    cases = [(s, n, m, seen) for (s, n, m), seen in (measured or {}).items()]
    cases += [(*case, None) for case in _bytes_cases(fresh_seed())]
    for s, n, m, seen in cases:
        with own_calls(*_OWN_BYTES) as own:
            got = call_answer(fn, s, n, m, what="bytes_per_step")
        where = f"bytes_per_step(S={s:,.6g}, n={n}, m={m})"
        refuse_own(where, own, "closed forms (or this check's reference)")
        if got is NOT_WRITTEN:
            return NOT_YET
        keys = _BYTES_KEYS if m < n else ("server",)
        if not isinstance(got, dict) or not set(keys) <= set(got):
            have = sorted(got) if isinstance(got, dict) else type(got).__name__
            raise ExerciseError(f"{where} returned {have}; return a dict with the "
                                f"keys {list(_BYTES_KEYS)}")
        want = _server_bytes(s, n, m)
        for key in keys:
            value = got[key]
            if not is_number(value):
                raise ExerciseError(f"{where}[{key!r}] is {value!r}, not a number")
            finite(f"{where}[{key!r}]", value)
            for i, b in enumerate((seen or {}).get(key, [])):  # rank by rank
                if abs(value - b) > 0.01 * b:
                    who = (f"rank {i}, a shard's" if key == "server" else
                           f"rank {m + i}, a worker")
                    raise ExerciseError(
                        f"{where}[{key!r}] = {value:,.6g} bytes, but the traffic "
                        f"ledger measured {b:,.6g} written by {who} in section 4"
                        + _bytes_hint(key, s, n, m, value))
            # the closed form exactly; a float answer differs from it in the 16th
            # digit at most, 1e-9 relative absorbs that only
            if not abs(value - want[key]) <= 1e-9 * want[key]:
                raise ExerciseError(
                    f"{where}[{key!r}] = {value:,.6g} bytes, expected "
                    f"{float(want[key]):,.6g}" + _bytes_hint(key, s, n, m, value))
    s, n, m = 14e9, 64, 8
    busiest = float(_server_bytes(s, n, m)["server"])
    seen = len(measured or {})
    print(f"correct on {len(cases) - seen} cases drawn this run"
          + (f" and the {seen} the traffic ledger measured in section 4" if seen
             else "")
          + f"; e.g. 7B in bf16 on {n} ranks with {m} shards: a shard's rank writes "
          f"{busiest / 1e9:.1f} GB a step, a worker {s / 1e9:.0f} GB")
    return PASSED


# ------------------------------------------------------------ DDP's buckets

_OWN_BUCKETS = ("labkit.parallel.data_parallel",
                "labkit.parallel.buckets", "labkit.parallel.zero_buckets",
                "labkit.checks.data_parallel_arithmetic:_bucket_count")


def _bucket_count(sizes, cap: int) -> int:
    """Buckets DDP's rule fills (whole tensors, in order; a bucket closes once it
    holds at least `cap` bytes), counted from the running total: a bucket ends
    after tensor i when the bytes since the last end reach cap."""
    ends, start = 0, 0
    total = 0
    for b in sizes:
        total += b
        if total - start >= cap:
            ends, start = ends + 1, total
    return ends + (total > start)


def _bucket_cases(seed: int) -> list[tuple[tuple[int, ...], float]]:
    """Two cases where each usual mistake gives its own count (first), then
    sizes drawn from `seed`."""
    c = 2**20
    cases = [((c - 4, 8, c // 2, c // 2, 3 * c, c // 2, c // 2, 3 * c, 4), 1),
             ((1_000_000, 10, 1_000_000, 10), 1)]  # a MiB is not 10^6 bytes
    rng = random.Random(seed)
    for _ in range(6):
        k = rng.randint(2, 12)
        sizes = tuple(rng.choice([4 * rng.randint(1, 4096),
                                  4 * rng.randint(c // 16, 2 * c)])
                      for _ in range(k))
        cases.append((sizes, rng.choice([0.25, 0.5, 1, 2, 4, 25])))
    return cases


def _bucket_hint(sizes, mb: float, got) -> str:
    mib = 2**20
    cap = mb * mib
    total = sum(sizes)
    strict = at_most = 0
    held = None
    for b in sizes:  # closes only above the cap
        if held is None or held > cap:
            strict, held = strict + 1, 0
        held += b
    held = None
    for b in sizes:  # a bucket never exceeds the cap (a tensor larger alone)
        if held is None or held + b > cap:
            at_most, held = at_most + 1, 0
        held += b
    near = [
        (-(-total // cap), "the total divided by the bucket size, rounded up: "
                           "tensors are never split across buckets"),
        (total // cap, "the total divided by the bucket size, rounded down: "
                       "tensors are never split, and a last bucket that is not "
                       "full still goes"),
        (_bucket_count(sizes, mb * 10**6), "buckets of bucket_mib × 10⁶ bytes: a "
                                           "MiB is 2²⁰ = 1,048,576 bytes"),
        (strict, "a bucket that closes only ABOVE the cap: it closes once it "
                 "holds at least bucket_mib MiB"),
        (at_most, "buckets that never exceed the cap: a bucket closes only once "
                  "it holds at least bucket_mib MiB, so the tensor that crosses "
                  "the line stays in it"),
        (_bucket_count(sizes, cap) - 1, "one bucket short: the last bucket goes "
                                        "even if it is not full"),
    ]
    for v, why in near:
        if got == v:
            return f". That is {why}"
    return (". Hint: a bucket closes once it holds AT LEAST bucket_mib MiB, so the "
            "tensor that crosses the line stays in it and the next tensor opens a "
            "new one")


def check_bucket_count(fn, measured: dict | None = None) -> bool:
    """Check a student's `fn(tensor_bytes, bucket_mib)`: how many buckets (so how
    many all-reduces a step) DDP's rule makes from gradients of these sizes, in
    the order backward produces them, with buckets of bucket_mib MiB: a bucket
    closes once it holds at least bucket_mib MiB. Cases are drawn fresh each run;
    `measured` maps (tuple of sizes, bucket_mib) to the number of buckets
    DataParallel made. labkit's bucket builders are refused."""
    mib = 2**20
    cases = [(sizes, mb, want) for (sizes, mb), want in (measured or {}).items()]
    cases += [(sizes, mb, None) for sizes, mb in _bucket_cases(fresh_seed())]
    for sizes, mb, seen in cases:
        where = f"n_buckets({_short(list(sizes))}, bucket_mib={mb:g})"
        with own_calls(*_OWN_BUCKETS) as own:
            got = call_answer(fn, list(sizes), mb, what="n_buckets")
        refuse_own(where, own, "bucket builder (or this check's reference)")
        if got is NOT_WRITTEN:
            return NOT_YET
        if not is_whole(got):
            raise ExerciseError(f"{where} returned {got!r}: return a whole number "
                                "of buckets")
        got = int(got)
        want = _bucket_count(sizes, mb * mib)
        if seen is not None and got != seen:
            raise ExerciseError(f"{where} = {got}, but DataParallel made {seen}"
                                + _bucket_hint(sizes, mb, got))
        if got != want:
            raise ExerciseError(f"{where} = {got}, but DDP's rule makes {want}"
                                + _bucket_hint(sizes, mb, got))
    seen = len(measured or {})
    print(f"correct on {len(cases) - seen} cases drawn this run"
          + (f" and the {seen} DataParallel built" if seen else "")
          + ": buckets fill in backward order and close at >= bucket_mib MiB")
    return PASSED


def _short(sizes: list) -> str:
    text = repr(sizes)
    return text if len(text) <= 70 else text[:67] + "...]"
