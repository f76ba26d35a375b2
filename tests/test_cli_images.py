"""labkit.cli.images: the diagrams in images/ are drawn from today's data."""

from labkit.cli.images import IMAGES, stale


def test_images_are_up_to_date():
    assert stale() == [], "run `make images` and commit images/"
    assert (IMAGES / "ring_allreduce_4.svg").exists()


def test_stale_names_missing_and_redrawn_diagrams(tmp_path):
    from labkit.cli.images import MARK, digest, specs
    from labkit.comm.collectives import OPS

    data = specs()  # one diagram per collective, plus the ring step by step
    assert set(data) == {f"collective_{op}" for op in OPS} | {"ring_allreduce_4"}
    for name, d in data.items():
        (tmp_path / f"{name}.svg").write_text(f"<!-- {MARK}{digest(d)} -->\n<svg/>")
    assert stale(tmp_path) == []
    (tmp_path / "collective_reduce.svg").write_text(f"<!-- {MARK}0 -->\n<svg/>")
    (tmp_path / "ring_allreduce_4.svg").unlink()
    assert sorted(stale(tmp_path)) == ["collective_reduce", "ring_allreduce_4"]


def test_a_change_in_the_drawing_code_makes_a_diagram_stale(tmp_path):
    from labkit.cli.images import digest

    code = tmp_path / "draw.py"
    code.write_text("colour = 'red'\n")
    before = digest({"op": "reduce"}, (code,))
    code.write_text("colour = 'blue'\n")  # same data, another style
    assert digest({"op": "reduce"}, (code,)) != before
    assert digest({"op": "reduce"}) != before  # labkit's own files by default
