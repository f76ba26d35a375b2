"""labkit.units: figures that read right at every size."""

from labkit.units import human_bytes, percent, seconds, si_bytes


def test_bytes_binary_and_decimal():
    assert human_bytes(1536) == "1.5 KiB" and human_bytes(512) == "512 B"
    assert [si_bytes(n) for n in (0, 512, 12_300, 4.5e6, 1.234e9, 123e9, 2.5e12)] \
        == ["0 B", "512 B", "12.3 kB", "4.5 MB", "1.2 GB", "123 GB", "2.5 TB"]
    assert si_bytes(-2e6) == "-2.0 MB"


def test_a_share_or_a_time_that_is_not_zero_never_reads_zero():
    assert [percent(x) for x in (0.41, 0.034, 0.0025, 0.0)] == \
        ["41%", "3.4%", "0.25%", "0%"]
    assert [seconds(t) for t in (1.234, 429.84, 0.0123, 0.0001)] == \
        ["1.23 s", "429.84 s", "0.0123 s", "0.0001 s"]
