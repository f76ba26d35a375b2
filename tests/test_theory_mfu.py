"""theory.mfu (labkit.theory.utilisation): published MFUs reproduced from their
publishers' own throughput, under the convention each publisher states; bad
inputs refused; an MFU over 100 % diagnosed; conventions that must agree, agree."""

import math

import pytest

from labkit.theory.utilisation import (
    CONVENTIONS,
    MFU,
    ImpossibleMFU,
    flops_per_token,
    likely_miscounts,
    mfu,
)
from labkit.theory.models import MODELS, param_count


def _printed(got_percent: float, printed: float, digits: int, what: str) -> None:
    """got (a percentage) rounds to the published figure: within half a unit
    of its last printed digit."""
    half = 0.5 * 10 ** -digits
    assert abs(got_percent - printed) <= half + 1e-9, (
        f"{what}: computed {got_percent:.4f} %, published {printed} % (printed "
        f"to {digits} decimals: allowed +-{half})")


# PaLM (Chowdhery et al. 2022, arXiv 2204.02311) app. B: 238.3K tokens/s on
# 6144 TPU v4 chips of 275 peak matmul TFLOP/s, N = 540 (billion) in its own
# arithmetic; table 1's shape: 118 layers, 48 heads of 256, T = 2048.
PALM = dict(params=540e9, layers=118, heads=48, head_dim=256, seq_len=2048)
PALM_RATE, PALM_PEAK = 238.3e3 / 6144, 275e12
# PaLM app. B: MT-NLG 530B (Smith et al. 2022) at 65.43K tokens/s (1920 x 2048 /
# 60.1 s) on 2240 A100s of 312 TFLOP/s; its shape (Smith et al. 2022, table 1):
# 105 layers, hidden 20480, 128 heads (of 160), T = 2048.
MTNLG = dict(params=530e9, layers=105, heads=128, head_dim=160, seq_len=2048)
MTNLG_RATE, A100 = 65.43e3 / 2240, 312e12


def test_palm_540b_mfu_with_and_without_attention():
    # PaLM sec. 4.1 / app. B: "45.7% without self-attention or 46.2% with it"
    got = mfu(PALM_RATE, PALM_PEAK, **PALM, convention="palm")
    _printed(got.percent, 46.2, 1, "PaLM 540B MFU (palm: 6N + 12LHQT)")
    six_n = mfu(PALM_RATE, PALM_PEAK, **PALM, convention="kaplan")
    _printed(six_n.percent, 45.7, 1, "PaLM 540B MFU without attention (6N)")
    assert str(got).startswith("46.2 % MFU (palm: 6N + 12LHQT, Chowdhery et al. "
                               "2022"), str(got)


def test_mtnlg_mfu_as_palm_prints_it_truncated():
    # PaLM app. B: MT-NLG 530B "29.7% without attention ... or 30.2% with it".
    # Its own arithmetic, (65.43 x 6 x 530)/(312 x 2240), is 29.77 %: PaLM cut
    # these two to one decimal (truncated) where its own 45.697 rounds to 45.7.
    for convention, printed in (("kaplan", 29.7), ("palm", 30.2)):
        got = mfu(MTNLG_RATE, A100, **MTNLG, convention=convention).percent
        assert printed <= got < printed + 0.1, (
            f"MT-NLG under {convention}: computed {got:.4f} %, published "
            f"{printed} % truncated to 0.1: allowed [{printed}, {printed + 0.1})")


# mosaicml/llm-foundry scripts/train/benchmarking/README.md, H100 80GB BF16
# tables: (model, d_model, n_layers from scripts/train/yamls/pretrain/mpt-*.yaml,
# SeqLen, # GPUs, MFU, HFU, Throughput (T/s), NumParams). Peak: composer's
# GPU_AVAILABLE_FLOPS['h100-sxm']['amp_bf16'] = 1.979e15 / 2 (dense BF16).
# T/s is printed truncated to whole tokens: under 1e-4 of an MFU point here.
FOUNDRY = [
    ("70b", 8192, 80, 2048, 512, 41.25, 55.0, 515636, 64862437376, True),
    ("30b", 7168, 48, 2048, 128, 41.85, 55.8, 281491, 29975214080, True),
    ("13b", 5120, 40, 32768, 8, 31.68, 42.24, 15812, 13011240960, True),
    ("7b", 4096, 32, 2048, 8, 46.44, 46.44, 85144, 6658859008, False),
]
H100_FOUNDRY = 1.979e15 / 2


@pytest.mark.parametrize("row", FOUNDRY, ids=[f"{r[0]}-{r[3]}" for r in FOUNDRY])
def test_llm_foundry_mfu_and_hfu_tables(row):
    name, d, layers, t, gpus, mfu_p, hfu_p, tps, n, checkpointing = row
    shape = dict(params=n, layers=layers, heads=d // 128, head_dim=128, seq_len=t,
                 hidden=d, convention="llm-foundry")
    got = mfu(tps / gpus, H100_FOUNDRY, **shape)
    _printed(got.percent, mfu_p, 2, f"MPT-{name} T={t} on {gpus} GPUs, MFU")
    hfu = mfu(tps / gpus, H100_FOUNDRY, **shape, hardware=True,
              recompute="full" if checkpointing else "none")
    _printed(hfu.percent, hfu_p, 2, f"MPT-{name} T={t} on {gpus} GPUs, HFU")


# pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md: "the 1D Llama
# 3.1 8B model training on 8 or 128 H100 GPUs without Float8 achieves 33% to 39%
# MFU"; TPS/GPU of tables 1 and 3 (FSDP, FSDP + compile, on 8 and on 128 GPUs);
# seq_len 8192 (train_configs/llama3_8b.toml at commit 9dec370); peak 989e12
# (torchtitan/utils.py get_peak_flops, H100 SXM); N without tok_embeddings
# (get_num_params(exclude_embedding=True)).
TITAN_TPS = (5762, 6667, 5605, 6514)


def test_torchtitan_llama3_8b_mfu_range():
    c = MODELS["llama3-8b"]
    n, embedding = param_count("llama3-8b"), c.vocab * c.hidden
    assert n == 8_030_261_248, n  # Llama 3.1 8B's published 8.03B
    got = [mfu(tps, 989e12, params=n, embedding_params=embedding,
               layers=c.layers, heads=c.heads, head_dim=c.hidden // c.heads,
               seq_len=8192, kv_heads=c.kv_heads, convention="torchtitan").percent
           for tps in TITAN_TPS]
    _printed(min(got), 33, 0, "torchtitan Llama 3.1 8B, lowest MFU")
    _printed(max(got), 39, 0, "torchtitan Llama 3.1 8B, highest MFU")


def test_one_run_under_two_conventions():
    # The chapter's point: the torchtitan run at 6,667 tokens/s/GPU is 39.0 %
    # counting the full T x T square and 34.7 % counting the causal half
    # (Megatron-LM's count); the gap is exactly 6LHQT's share.
    c = MODELS["llama3-8b"]
    shape = dict(params=param_count("llama3-8b"), embedding_params=c.vocab * c.hidden,
                 layers=32, heads=32, head_dim=128, seq_len=8192)
    full = mfu(6667, 989e12, **shape, convention="torchtitan")
    half = mfu(6667, 989e12, **shape, convention="megatron")
    gap = 6 * 32 * 32 * 128 * 8192 * 6667 / 989e12
    assert abs((full.value - half.value) - gap) <= 1e-12, (
        f"torchtitan minus megatron: {full.value - half.value!r}, 6LHQT's share "
        f"{gap!r} (allowed 1e-12: float rounding)")
    assert (round(full.percent, 1), round(half.percent, 1)) == (39.0, 34.7), (
        f"torchtitan {full.percent:.3f} %, megatron {half.percent:.3f} %")
    # PaLM 540B: the causal half moves its 46.2 % by a quarter point only
    palm = mfu(PALM_RATE, PALM_PEAK, **PALM).percent
    causal = mfu(PALM_RATE, PALM_PEAK, **PALM, convention="megatron").percent
    assert 0.2 < palm - causal < 0.3, (
        f"PaLM 540B: palm {palm:.3f} %, megatron {causal:.3f} %, expected "
        "0.2-0.3 points apart (6LHQT is 1.1 % of its FLOPs)")


def test_megatron_sc21_equation_3():
    # Narayanan et al. 2021 eq. 3: F = 96Bslh²(1 + s/6h + V/16lh) per iteration
    b, s, n_l, h, v = 1536, 2048, 96, 12288, 51200  # GPT-3 175B's shape
    eq3 = 96 * b * s * n_l * h * h * (1 + s / (6 * h) + v / (16 * n_l * h))
    shape = dict(params=175e9, layers=n_l, heads=96, head_dim=128, seq_len=s,
                 vocab=v, convention="megatron-sc21")
    got = flops_per_token(**shape, hardware=True, recompute="full") * b * s
    assert math.isclose(got, eq3, rel_tol=1e-12), (got, eq3)
    # without the recomputed forward: the layers' 96 becomes 72, the logits stay
    model = flops_per_token(**shape) * b * s
    assert math.isclose(model, eq3 - 24 * b * s * n_l * h * h * (1 + s / (6 * h)),
                        rel_tol=1e-12), (model, eq3)


def test_conventions_agree_where_they_must():
    base = dict(params=7e9, layers=32, heads=32, head_dim=128, seq_len=4096)
    palm = flops_per_token(**base)
    assert flops_per_token(**base, convention="llm-foundry") == palm
    assert flops_per_token(**base, convention="torchtitan") == palm  # E = 0
    assert flops_per_token(**base, convention="nanogpt",
                           embedding_params=1e8) == palm - 6e8
    causal = flops_per_token(**base, convention="megatron")
    for w in (4096, 5000, 10**6):  # a window as long as T: the causal count
        assert flops_per_token(**base, convention="megatron", window=w) == causal
    assert flops_per_token(**base, convention="megatron", causal=False) == palm
    assert flops_per_token(**base, convention="megatron", window=1024) < causal
    # GQA changes parameters, not the attention scores' FLOPs
    assert flops_per_token(**base, convention="megatron", kv_heads=8) == causal
    # HFU: full recompute adds a forward (4/3), selective attention's core
    hfu = flops_per_token(**base, hardware=True, recompute="full")
    assert math.isclose(hfu, 4 / 3 * palm, rel_tol=1e-15), (hfu, palm)
    sel = flops_per_token(**base, hardware=True, recompute="selective")
    assert sel == palm + 4 * 32 * 32 * 128 * 4096
    assert flops_per_token(**base, hardware=True) == palm
    assert flops_per_token(**base, recompute="full") == palm  # MFU ignores it


def test_window_counts_the_band():
    # keys per query under a window w < T: w - w²/2T (the band's area over T)
    base = dict(params=1e9, layers=2, heads=4, head_dim=64, seq_len=8192)
    dense = flops_per_token(**base, convention="kaplan")
    got = flops_per_token(**base, convention="megatron", window=1024) - dense
    assert got == 12 * 2 * 4 * 64 * (1024 - 1024**2 / (2 * 8192)), got


def test_conventions_are_documented():
    for name, (formula, source) in CONVENTIONS.items():
        assert formula and len(source) > 40, name
    assert isinstance(mfu(1.0, 1e15, **PALM), MFU)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(tokens_per_second=0), ValueError, "tokens_per_second"),
    (dict(tokens_per_second=-5.0), ValueError, "tokens_per_second"),
    (dict(tokens_per_second=float("nan")), ValueError, "tokens_per_second"),
    (dict(tokens_per_second=True), TypeError, "tokens_per_second"),
    (dict(tokens_per_second="40"), TypeError, "tokens_per_second"),
    (dict(peak_flops=float("inf")), ValueError, "peak_flops"),
    (dict(peak_flops=0), ValueError, "peak_flops"),
    (dict(params=0), ValueError, "params"),
    (dict(params=float("nan")), ValueError, "params"),
    (dict(params=True), TypeError, "params"),
    (dict(layers=0), ValueError, "layers"),
    (dict(layers=2.5), TypeError, "layers"),
    (dict(heads=True), TypeError, "heads"),
    (dict(head_dim=-1), ValueError, "head_dim"),
    (dict(seq_len=0), ValueError, "seq_len"),
    (dict(window=0), ValueError, "window"),
    (dict(kv_heads=5), ValueError, "kv_heads must divide heads"),
    (dict(kv_heads=0), ValueError, "kv_heads"),
    (dict(embedding_params=2e9), ValueError, "embedding_params"),
    (dict(embedding_params=-1), ValueError, "embedding_params"),
    (dict(recompute="half"), ValueError, "recompute"),
    (dict(hardware="yes"), TypeError, "hardware"),
    (dict(causal=1), TypeError, "causal"),
    (dict(gpus=0), ValueError, "gpus"),
    (dict(convention="gpt"), ValueError, "palm, kaplan, torchtitan"),
    (dict(convention="megatron-sc21"), ValueError, "vocab="),
    (dict(vocab=0, convention="megatron-sc21"), ValueError, "vocab"),
    (dict(windw=4), TypeError, "windw"),
])
def test_bad_inputs_are_refused(kwargs, error, words):
    args = dict(tokens_per_second=1e3, peak_flops=1e15, params=1e9, layers=4,
                heads=8, head_dim=64, seq_len=1024) | kwargs
    with pytest.raises(error, match=words):
        mfu(args.pop("tokens_per_second"), args.pop("peak_flops"), **args)


# ------------------------------------------------------------- over 100 %

RUN = dict(params=7e9, layers=32, heads=32, head_dim=128, seq_len=4096)
PEAK = 989e12


def _rate(target: float, **kw) -> float:
    """tokens/s per GPU that gives `target` MFU under palm."""
    return target * PEAK / flops_per_token(**RUN, **kw)


def _first(err) -> str:
    return err.value.candidates[0].name


def test_whole_job_tokens_are_named_and_divided():
    with pytest.raises(ImpossibleMFU, match=r"whole job given as one GPU's.*"
                                            r"-> 45\.0 %, a typical MFU") as e:
        mfu(_rate(0.45) * 64, PEAK, **RUN, gpus=64)
    assert _first(e) == "job_tokens" and e.value.value == pytest.approx(0.45 * 64)
    with pytest.raises(ImpossibleMFU, match=r"tokens/s for the whole job\? pass "
                                            r"gpus="):
        mfu(_rate(0.45) * 64, PEAK, **RUN)


@pytest.mark.parametrize("true, factor, name", [
    (0.60, 2.0, "low_peak"),
    (0.40, 100.0, "percent"),
    (0.50, 4096.0, "per_sequence"),
])
def test_each_miscount_is_named_first(true, factor, name):
    with pytest.raises(ImpossibleMFU) as e:
        mfu(_rate(true) * factor, PEAK, **RUN)
    best = e.value.candidates[0]
    assert (best.name, best.plausible) == (name, True), e.value.candidates
    assert best.corrected == pytest.approx(true, rel=1e-12), best
    assert str(e.value).startswith(f"{100 * true * factor:.1f} % MFU (palm) is "
                                   "impossible"), str(e.value)


def test_attention_twice_is_named():
    long = dict(RUN, seq_len=65536)  # attention 1.2x the dense term
    f = flops_per_token(**long)
    a = 12 * 32 * 32 * 128 * 65536
    rate = 0.62 * PEAK / f
    value = rate * (f + a) / PEAK  # what counting it twice reports
    found = likely_miscounts(value, **long)
    twice = [m for m in found if m.name == "attention_twice"]
    assert twice and twice[0].plausible, found
    assert twice[0].corrected == pytest.approx(0.62, rel=1e-12), twice
    # a factor under 2 over 100 %: halving (low_peak) lands in the band too;
    # only the report's FLOPs per token tells the two apart
    assert {m.name for m in found if m.plausible} == {"attention_twice",
                                                      "low_peak"}, found


def test_hfu_counted_as_mfu_is_named():
    # a 4/3 slip takes a 78 % run to 104 %: not typical, but the one that fits
    value = 0.78 * 4 / 3
    found = likely_miscounts(value, **RUN)
    hfu = [m for m in found if m.name == "hfu"]
    assert hfu and hfu[0].corrected == pytest.approx(0.78, rel=1e-12), found
    assert not hfu[0].plausible


def test_plausible_mfu_is_returned_not_diagnosed():
    assert 0.2 < mfu(_rate(0.45), PEAK, **RUN, gpus=8).value < 0.7
    assert likely_miscounts(0.45, **RUN, gpus=8)[0].corrected < 0.45
